//! Test harness: a broker on a temp-dir store and `serve()` on a loopback listener.
#![allow(dead_code, clippy::unwrap_used)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use triad_amqp::{serve, AmqpConfig, AmqpContext};
use triad_core::{Broker, CoreConfig};
use triad_store::store::{Store, StoreConfig};

pub struct Server {
    pub addr: SocketAddr,
    pub broker: Arc<Broker>,
    pub token: CancellationToken,
    _dir: tempfile::TempDir,
}

impl Server {
    pub async fn start() -> Server {
        Self::with_config(AmqpConfig::default()).await
    }

    pub async fn with_config(config: AmqpConfig) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let mut sc = StoreConfig::new(dir.path());
        sc.segment_size = 8 << 20;
        sc.cq_entries_per_file = 1024;
        let store = Arc::new(Store::open(sc).unwrap());
        let broker = Broker::open(store, CoreConfig::default()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let token = CancellationToken::new();
        let ctx = AmqpContext {
            broker: broker.clone(),
            config,
            shutdown: token.clone(),
        };
        tokio::spawn(async move {
            loop {
                let Ok((s, peer)) = listener.accept().await else {
                    return;
                };
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    let _ = serve(s, peer, ctx).await;
                });
            }
        });
        Server {
            addr,
            broker,
            token,
            _dir: dir,
        }
    }

    pub fn uri(&self) -> String {
        format!("amqp://guest:guest@{}/%2f", self.addr)
    }

    pub async fn connect(&self) -> lapin::Connection {
        tokio::time::timeout(
            Duration::from_secs(10),
            lapin::Connection::connect(&self.uri(), lapin::ConnectionProperties::default()),
        )
        .await
        .expect("connect timeout")
        .expect("connect")
    }
}
