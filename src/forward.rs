//! Client forwarding on a follower (issue 18, "clients connect to any node"): a node that
//! is not the leader still binds the client listeners, and splices each accepted
//! connection byte for byte to the same listener of the current leader. An unchanged
//! AMQP, STOMP or MQTT client (TLS included: the bytes pass through, the leader
//! terminates TLS) that connects to a follower thus talks to the leader.
//!
//! Where the leader's listeners are comes from a [`watch`] channel (the election
//! value), so a failover retargets new connections at once; a connection already
//! spliced ends when the old leader goes (its client then reconnects, with its library's
//! own logic). While no leader is known a connection is closed at once, which clients
//! treat as a refused connection.
//!
//! Bounds: at most `max` connections are spliced at a time (each holds two sockets and
//! two 8 KiB copy buffers); one past that is closed at once. Connecting to the leader
//! has a deadline ([`CONNECT_TIMEOUT`]). The leader sees the follower as the peer
//! address (no PROXY header is sent: the leader's listeners take direct clients too).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::config::Config;
use crate::listener::Proto;

/// How long a forwarded connection waits for the leader's listener to accept.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The leader's client listeners, by protocol (those it binds).
pub type LeaderListeners = Arc<HashMap<Proto, SocketAddr>>;

/// Accepts on each of `listeners` until `shutdown`, splicing every connection to the
/// same protocol's listener of the leader `target` names (see the module notes).
pub async fn serve(
    listeners: Vec<(Proto, TcpListener)>,
    target: watch::Receiver<Option<LeaderListeners>>,
    max: usize,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(max));
    let mut tasks = tokio::task::JoinSet::new();
    for (proto, listener) in listeners {
        tasks.spawn(accept_loop(
            proto,
            listener,
            target.clone(),
            permits.clone(),
            shutdown.clone(),
        ));
    }
    while tasks.join_next().await.is_some() {}
}

async fn accept_loop(
    proto: Proto,
    listener: TcpListener,
    target: watch::Receiver<Option<LeaderListeners>>,
    permits: Arc<Semaphore>,
    shutdown: CancellationToken,
) {
    loop {
        let (client, peer) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and the like: back off instead of spinning
                    debug!(?proto, error = %e, "forward: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            debug!(?proto, %peer, "forward: too many forwarded connections; closed");
            continue;
        };
        let leader = target
            .borrow()
            .as_ref()
            .and_then(|l| l.get(&proto).copied());
        let Some(leader) = leader else {
            debug!(?proto, %peer, "forward: no leader known; closed");
            continue;
        };
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let _permit = permit;
            tokio::select! {
                _ = stop.cancelled() => {}
                r = splice(client, leader) => {
                    if let Err(e) = r {
                        debug!(?proto, %peer, %leader, error = %e, "forward: connection ended");
                    }
                }
            }
        });
    }
}

/// Connects to `leader` and copies both ways until either side closes.
async fn splice(mut client: TcpStream, leader: SocketAddr) -> std::io::Result<()> {
    let mut upstream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(leader))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    tokio::io::copy_bidirectional(&mut client, &mut upstream).await?;
    Ok(())
}

/// A follower's forwarding, as the election drives it: the client listeners bound for
/// as long as the node follows, retargeted to each leader the election key names.
pub struct Forwarding {
    target: watch::Sender<Option<LeaderListeners>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Forwarding {
    /// Binds the client listeners `config` names (the TLS ones only with a certificate
    /// configured, as the broker does; the bytes pass through, so no certificate is
    /// read here) and logs `forwarding proto=... addr=...` for each. A listener that
    /// cannot be bound is skipped with a warning: the node still follows. At most
    /// `limits.max_connections` connections (or 10,000 when that is 0) are spliced.
    pub async fn start(config: &Config) -> Forwarding {
        let tls = config.tls.cert_file.is_some() && config.tls.key_file.is_some();
        let protos = Proto::ALL
            .iter()
            .chain(if tls { &Proto::TLS[..] } else { &[] });
        let mut listeners = Vec::new();
        for &proto in protos {
            let addr = config.listeners.addr(proto);
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    if let Ok(local) = l.local_addr() {
                        tracing::info!(proto = %proto, addr = %local, "forwarding");
                    }
                    listeners.push((proto, l));
                }
                Err(e) => {
                    tracing::warn!(proto = %proto, %addr, error = %e, "cannot listen to forward clients")
                }
            }
        }
        let max = match config.limits.max_connections {
            0 => 10_000,
            n => n as usize,
        };
        let (target, rx) = watch::channel(None);
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve(listeners, rx, max, stop.clone()));
        Forwarding { target, stop, task }
    }

    /// Forward to the client listeners `leader` names (its election value's
    /// `clients`), or close new connections while no leader is known (`None`).
    pub fn follow(&self, leader: Option<&[(String, String)]>) {
        let map = leader.map(|clients| {
            let by_name = |name: &str| {
                Proto::ALL
                    .iter()
                    .chain(&Proto::TLS)
                    .copied()
                    .find(|p| p.as_str() == name)
            };
            let m: HashMap<Proto, SocketAddr> = clients
                .iter()
                .filter_map(|(p, a)| Some((by_name(p)?, a.parse().ok()?)))
                .collect();
            Arc::new(m)
        });
        self.target.send_if_modified(|t| {
            let changed = *t != map;
            *t = map;
            changed
        });
    }

    /// Stops: the listeners are closed (their ports free for the broker) and spliced
    /// connections end (their clients reconnect, to this node as the leader now).
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An echo server on 127.0.0.1:0 that prefixes each answer with `tag`.
    async fn echo(tag: u8) -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n @ 1..) = s.read(&mut buf).await {
                        let mut out = vec![tag];
                        out.extend_from_slice(&buf[..n]);
                        if s.write_all(&out).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn roundtrip(addr: SocketAddr, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(msg).await?;
        let mut out = vec![0u8; msg.len() + 1];
        tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut out))
            .await
            .map_err(|_| std::io::Error::other("no answer"))??;
        Ok(out)
    }

    /// Whether the forwarder closes a new connection without a byte.
    async fn closed_at_once(addr: SocketAddr) -> bool {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let _ = s.write_all(b"x").await;
        let mut b = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(10), s.read(&mut b)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }

    async fn forwarder(
        max: usize,
    ) -> (
        SocketAddr,
        watch::Sender<Option<LeaderListeners>>,
        CancellationToken,
    ) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let (tx, rx) = watch::channel(None);
        let stop = CancellationToken::new();
        tokio::spawn(serve(vec![(Proto::Amqp, l)], rx, max, stop.clone()));
        (addr, tx, stop)
    }

    fn leader(amqp: SocketAddr) -> Option<LeaderListeners> {
        Some(Arc::new(HashMap::from([(Proto::Amqp, amqp)])))
    }

    #[tokio::test]
    async fn connections_go_to_the_current_leader_and_follow_a_failover() {
        let (a, b) = (echo(b'A').await, echo(b'B').await);
        let (addr, target, _stop) = forwarder(8).await;
        assert!(closed_at_once(addr).await, "no leader known yet");
        target.send_replace(leader(a));
        assert_eq!(roundtrip(addr, b"hello").await.unwrap(), b"Ahello");
        // a connection spliced to the old leader stays there; new ones go to the new one
        let mut old = TcpStream::connect(addr).await.unwrap();
        old.write_all(b"1").await.unwrap();
        let mut got = [0u8; 2];
        old.read_exact(&mut got).await.unwrap();
        target.send_replace(leader(b));
        assert_eq!(roundtrip(addr, b"hi").await.unwrap(), b"Bhi");
        old.write_all(b"2").await.unwrap();
        old.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"A2");
        // a protocol the leader does not serve is closed
        target.send_replace(Some(Arc::new(HashMap::from([(Proto::Mqtt, a)]))));
        assert!(closed_at_once(addr).await);
    }

    #[tokio::test]
    async fn at_most_max_connections_are_spliced() {
        let a = echo(b'A').await;
        let (addr, target, _stop) = forwarder(2).await;
        target.send_replace(leader(a));
        let mut held = Vec::new();
        for _ in 0..2 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            s.write_all(b"x").await.unwrap();
            let mut got = [0u8; 2];
            s.read_exact(&mut got).await.unwrap();
            held.push(s);
        }
        assert!(closed_at_once(addr).await, "the third is refused");
        drop(held);
        // the permits come back once those close
        triad_core::testing::eventually_async(
            "a permit back",
            Duration::from_secs(10),
            async || roundtrip(addr, b"y").await.is_ok(),
        )
        .await;
    }

    #[tokio::test]
    async fn an_unreachable_leader_closes_the_client() {
        let gone = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let (addr, target, stop) = forwarder(4).await;
        target.send_replace(leader(gone));
        assert!(closed_at_once(addr).await);
        stop.cancel();
    }
}
