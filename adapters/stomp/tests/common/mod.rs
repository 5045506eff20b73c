#![allow(
    clippy::unwrap_used,
    clippy::indexing_slicing,
    clippy::panic,
    dead_code
)]
//! A STOMP server on a loopback port over a temp-dir store, and a minimal raw client.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use triad_core::{Broker, CoreConfig};
use triad_stomp::codec::{decode, encode, Limits};
use triad_stomp::{serve, Command, Frame, StompContext};
use triad_store::store::{Store, StoreConfig};

pub const WAIT: Duration = Duration::from_secs(5);

pub struct Server {
    pub dir: tempfile::TempDir,
    pub broker: Arc<Broker>,
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub fn open_broker(dir: &Path) -> Arc<Broker> {
    open_broker_sized(dir, 1 << 20)
}

/// A broker whose commitlog segments are `segment_size` bytes (a message must fit one).
pub fn open_broker_sized(dir: &Path, segment_size: u64) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = segment_size;
    c.cq_entries_per_file = 1024;
    let store = Arc::new(Store::open(c).unwrap());
    Broker::open(
        store,
        CoreConfig {
            queue_window: 64,
            // guest may open every vhost the tests create
            permissions: vec![
                triad_core::Permission::full("guest", "/"),
                triad_core::Permission::full("guest", "tenant"),
            ],
            ..CoreConfig::default()
        },
    )
    .unwrap()
}

pub async fn start() -> Server {
    start_with(|_| {}).await
}

pub async fn start_with(tweak: impl FnOnce(&mut StompContext)) -> Server {
    start_sized(1 << 20, tweak).await
}

/// [`start_with`] on commitlog segments of `segment_size` bytes.
pub async fn start_sized(segment_size: u64, tweak: impl FnOnce(&mut StompContext)) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let broker = open_broker_sized(dir.path(), segment_size);
    let shutdown = CancellationToken::new();
    let mut ctx = StompContext::new(broker.clone(), shutdown.clone());
    tweak(&mut ctx);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let token = shutdown.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                r = listener.accept() => {
                    let (s, peer) = r.unwrap();
                    let ctx = ctx.clone();
                    tokio::spawn(async move {
                        let _ = serve(s, peer, ctx).await;
                    });
                }
            }
        }
    });
    Server {
        dir,
        broker,
        addr,
        shutdown,
    }
}

pub struct Client {
    pub stream: TcpStream,
    pub buf: BytesMut,
    pub heartbeats: usize,
}

impl Client {
    pub async fn open(addr: SocketAddr) -> Client {
        Client {
            stream: TcpStream::connect(addr).await.unwrap(),
            buf: BytesMut::new(),
            heartbeats: 0,
        }
    }

    /// Connects with STOMP 1.2 as guest.
    pub async fn connect(addr: SocketAddr) -> Client {
        Client::connect_with(addr, &[("accept-version", "1.2"), ("host", "127.0.0.1")]).await
    }

    pub async fn connect_with(addr: SocketAddr, headers: &[(&str, &str)]) -> Client {
        let mut c = Client::open(addr).await;
        let mut f = Frame::new(Command::Connect);
        for (k, v) in headers {
            f.push(*k, *v);
        }
        c.send(f).await;
        let r = c.recv().await.expect("CONNECTED");
        assert_eq!(r.command, Command::Connected, "{r:?}");
        c
    }

    pub async fn send(&mut self, f: Frame) {
        let mut out = BytesMut::new();
        encode(&f, &mut out);
        self.stream.write_all(&out).await.unwrap();
    }

    pub async fn send_raw(&mut self, b: &[u8]) {
        self.stream.write_all(b).await.unwrap();
    }

    /// The next frame; `None` when the server closed the connection.
    pub async fn recv(&mut self) -> Option<Frame> {
        self.recv_within(WAIT)
            .await
            .expect("timed out waiting for a frame")
    }

    /// `Err(())` on timeout.
    pub async fn recv_within(&mut self, d: Duration) -> Result<Option<Frame>, ()> {
        let deadline = tokio::time::Instant::now() + d;
        loop {
            while self.buf.first() == Some(&b'\n') {
                self.heartbeats += 1;
                let _ = self.buf.split_to(1);
            }
            let limits = Limits {
                max_frame: 64 << 20,
                ..Limits::AUTHENTICATED
            };
            if let Some(f) = decode(&mut self.buf, &limits).unwrap() {
                return Ok(Some(f));
            }
            match tokio::time::timeout_at(deadline, self.stream.read_buf(&mut self.buf)).await {
                Err(_) => return Err(()),
                Ok(Ok(0)) | Ok(Err(_)) => return Ok(None),
                Ok(Ok(_)) => {}
            }
        }
    }

    /// Asserts nothing arrives for `ms` (heart-beats aside).
    pub async fn expect_nothing(&mut self, ms: u64) {
        match self.recv_within(Duration::from_millis(ms)).await {
            Err(()) => {}
            Ok(f) => panic!("expected nothing, got {f:?}"),
        }
    }

    pub async fn expect(&mut self, cmd: Command) -> Frame {
        let f = self
            .recv()
            .await
            .unwrap_or_else(|| panic!("closed, wanted {cmd}"));
        assert_eq!(f.command, cmd, "{f:?}");
        f
    }

    /// Expects an ERROR, then the server closing the connection.
    pub async fn expect_error(&mut self) -> Frame {
        let f = self.expect(Command::Error).await;
        self.expect_closed().await;
        f
    }

    pub async fn expect_closed(&mut self) {
        if let Some(f) = self.recv().await {
            panic!("expected close, got {f:?}");
        }
    }

    pub async fn subscribe(&mut self, id: &str, dest: &str, extra: &[(&str, &str)]) {
        let mut f = Frame::new(Command::Subscribe)
            .with("id", id)
            .with("destination", dest)
            .with("receipt", format!("sub-{id}"));
        for (k, v) in extra {
            f.push(*k, *v);
        }
        self.send(f).await;
        let r = self.expect(Command::Receipt).await;
        assert_eq!(r.header("receipt-id"), Some(format!("sub-{id}").as_str()));
    }

    /// SEND with a receipt, waiting for it.
    pub async fn publish(&mut self, dest: &str, body: &str, extra: &[(&str, &str)]) {
        let mut f = Frame::new(Command::Send)
            .with("destination", dest)
            .with("receipt", "pub")
            .with_body(body.to_string());
        for (k, v) in extra {
            f.push(*k, *v);
        }
        self.send(f).await;
        self.expect(Command::Receipt).await;
    }

    pub async fn disconnect(mut self) {
        self.send(Frame::new(Command::Disconnect).with("receipt", "bye"))
            .await;
        let r = self.expect(Command::Receipt).await;
        assert_eq!(r.header("receipt-id"), Some("bye"));
        self.expect_closed().await;
    }
}

pub fn body(f: &Frame) -> String {
    String::from_utf8(f.body.to_vec()).unwrap()
}
