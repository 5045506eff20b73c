#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
//! The whole adapter over loopback: rumqttc (and raw sockets for what a well-behaved
//! client never sends) against `serve` on a TcpListener, with a Broker on a temp-dir
//! store.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rumqttc::{AsyncClient, Event, Incoming, LastWill, MqttOptions, QoS};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use triad_core::testing::eventually;
use triad_core::{Broker, Clock, CoreConfig};
use triad_mqtt::codec::{self, Connect, Packet, Publish, Subscribe, Will};
use triad_mqtt::{serve, MqttContext, MqttLimits, MqttState};
use triad_store::store::{Store, StoreConfig};

struct Server {
    addr: SocketAddr,
    ctx: MqttContext,
    accept: JoinHandle<()>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

fn open_broker(dir: &Path) -> Arc<Broker> {
    open_broker_with(dir, CoreConfig::default())
}

fn open_broker_with(dir: &Path, cfg: CoreConfig) -> Arc<Broker> {
    let mut c = StoreConfig::new(dir);
    c.segment_size = 1 << 20;
    c.cq_entries_per_file = 1024;
    let store = Arc::new(Store::open(c).unwrap());
    Broker::open(store, cfg).unwrap()
}

fn context(broker: Arc<Broker>) -> MqttContext {
    let state = MqttState::new(broker.clone()).unwrap();
    MqttContext {
        broker,
        state,
        anonymous_user: Some("guest".into()),
        limits: MqttLimits {
            connect_timeout: Duration::from_secs(2),
            ..MqttLimits::default()
        },
        shutdown: CancellationToken::new(),
        login: Default::default(),
    }
}

async fn start(dir: &Path) -> Server {
    start_ctx(context(open_broker(dir))).await
}

async fn start_ctx(ctx: MqttContext) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let conns: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
    let (c2, conns2) = (ctx.clone(), conns.clone());
    let accept = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = c2.shutdown.cancelled() => return,
                r = listener.accept() => {
                    let (s, peer) = r.unwrap();
                    // each connection its own token, as the broker's listener gives it
                    let mut ctx = c2.clone();
                    ctx.shutdown = c2.shutdown.child_token();
                    let h = tokio::spawn(async move { let _ = serve(s, peer, ctx).await; });
                    conns2.lock().unwrap().push(h);
                }
            }
        }
    });
    Server {
        addr,
        ctx,
        accept,
        conns,
    }
}

impl Server {
    /// Stops like `kill -9`: no clean store close (the abort marker stays, the last
    /// checkpoint is older than the data).
    async fn crash(self) {
        let store = self.ctx.broker.store().clone();
        self.stop_inner().await;
        Arc::try_unwrap(store)
            .ok()
            .expect("store still referenced")
            .abandon();
    }

    /// Stops everything and drops the broker, so the store closes and can be reopened.
    async fn stop(self) {
        self.stop_inner().await;
    }

    async fn stop_inner(self) {
        self.ctx.shutdown.cancel();
        self.accept.await.unwrap();
        let hs: Vec<_> = std::mem::take(&mut *self.conns.lock().unwrap());
        for h in hs {
            h.await.unwrap();
        }
        let weak = Arc::downgrade(self.ctx.broker.store());
        drop(self.ctx);
        assert!(weak.strong_count() <= 1, "store still referenced");
    }
}

#[derive(Debug)]
enum Ev {
    In(Incoming),
    Closed(#[allow(dead_code)] String),
}

struct Client {
    c: AsyncClient,
    rx: mpsc::UnboundedReceiver<Ev>,
    task: JoinHandle<()>,
}

fn opts(addr: SocketAddr, id: &str, clean: bool) -> MqttOptions {
    let mut o = MqttOptions::new(id, addr.ip().to_string(), addr.port());
    o.set_clean_session(clean);
    o.set_keep_alive(Duration::from_secs(30));
    o
}

async fn connect_with(o: MqttOptions) -> (Client, rumqttc::ConnAck) {
    let (c, mut el) = AsyncClient::new(o, 100);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        loop {
            match el.poll().await {
                Ok(Event::Incoming(i)) => {
                    let _ = tx.send(Ev::In(i));
                }
                Ok(Event::Outgoing(_)) => {}
                Err(e) => {
                    let _ = tx.send(Ev::Closed(e.to_string()));
                    return;
                }
            }
        }
    });
    let ack = loop {
        match tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("CONNACK in time")
        {
            Some(Ev::In(Incoming::ConnAck(a))) => break a,
            Some(Ev::In(_)) => {}
            other => panic!("connect failed: {other:?}"),
        }
    };
    (Client { c, rx, task }, ack)
}

async fn connect(addr: SocketAddr, id: &str, clean: bool) -> Client {
    connect_with(opts(addr, id, clean)).await.0
}

impl Client {
    async fn sub(&mut self, filter: &str, qos: QoS) -> Vec<u8> {
        self.c.subscribe(filter, qos).await.unwrap();
        loop {
            match self.next().await {
                Some(Ev::In(Incoming::SubAck(s))) => {
                    return s
                        .return_codes
                        .iter()
                        .map(|c| match c {
                            rumqttc::SubscribeReasonCode::Success(q) => *q as u8,
                            rumqttc::SubscribeReasonCode::Failure => 0x80,
                        })
                        .collect()
                }
                Some(_) => {}
                None => panic!("no SUBACK"),
            }
        }
    }

    async fn next(&mut self) -> Option<Ev> {
        tokio::time::timeout(Duration::from_secs(5), self.rx.recv())
            .await
            .ok()
            .flatten()
    }

    /// The next PUBLISH within `wait`.
    async fn publish_within(&mut self, wait: Duration) -> Option<rumqttc::Publish> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(Ev::In(Incoming::Publish(p)))) => return Some(p),
                Ok(Some(Ev::In(_))) => {}
                Ok(Some(Ev::Closed(_))) | Ok(None) | Err(_) => return None,
            }
        }
    }

    async fn publish(&mut self) -> rumqttc::Publish {
        self.publish_within(Duration::from_secs(5))
            .await
            .expect("a PUBLISH")
    }

    async fn closed(&mut self) -> bool {
        loop {
            match self.next().await {
                Some(Ev::Closed(_)) => return true,
                Some(Ev::In(_)) => {}
                None => return false,
            }
        }
    }

    /// Sends DISCONNECT and waits for the socket to close.
    async fn disconnect(mut self) {
        self.c.disconnect().await.unwrap();
        self.closed().await;
        self.task.abort();
    }

    /// Drops the TCP connection without DISCONNECT.
    async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

fn body(p: &rumqttc::Publish) -> &str {
    std::str::from_utf8(&p.payload).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qos_0_1_2_round_trips_with_granted_qos() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut sub = connect(s.addr, "sub", true).await;
    assert_eq!(sub.sub("q/#", QoS::ExactlyOnce).await, [2]);
    let mut low = connect(s.addr, "low", true).await;
    assert_eq!(low.sub("q/+", QoS::AtLeastOnce).await, [1]);
    let publ = connect(s.addr, "pub", true).await;
    for (i, q) in [QoS::AtMostOnce, QoS::AtLeastOnce, QoS::ExactlyOnce]
        .into_iter()
        .enumerate()
    {
        publ.c
            .publish(format!("q/{i}"), q, false, format!("m{i}"))
            .await
            .unwrap();
    }
    for i in 0..3u8 {
        let p = sub.publish().await;
        assert_eq!(p.topic, format!("q/{i}"));
        assert_eq!(body(&p), format!("m{i}"));
        assert_eq!(p.qos as u8, i);
        assert!(!p.retain);
        let p = low.publish().await;
        assert_eq!(p.qos as u8, i.min(1), "min(publish QoS, granted QoS)");
    }
    // in-order delivery of a burst beyond the in-flight window
    for i in 0..100 {
        publ.c
            .publish("q/burst", QoS::AtLeastOnce, false, i.to_string())
            .await
            .unwrap();
    }
    for i in 0..100 {
        assert_eq!(body(&sub.publish().await), i.to_string());
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clean_session_queue_waits_for_the_first_subscribe() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let vhost = s.ctx.state.vhost_state("/").unwrap().vhost.clone();
    let mut sub = connect(s.addr, "lazy", true).await;
    // connected, not subscribed: no queue, no consumer (an idle client costs neither)
    assert!(vhost.queue("mqtt-subscription-lazy").is_none());
    assert_eq!(sub.sub("lazy/#", QoS::AtLeastOnce).await, [1]);
    assert!(vhost.queue("mqtt-subscription-lazy").is_some());
    let publ = connect(s.addr, "lazy-pub", true).await;
    assert!(vhost.queue("mqtt-subscription-lazy-pub").is_none());
    publ.c
        .publish("lazy/1", QoS::AtLeastOnce, false, "m")
        .await
        .unwrap();
    let p = sub.publish().await;
    assert_eq!((p.topic.as_str(), body(&p)), ("lazy/1", "m"));
    // a second SUBSCRIBE reuses the queue and its consumer
    assert_eq!(sub.sub("other/#", QoS::AtMostOnce).await, [0]);
    publ.c
        .publish("other/x", QoS::AtMostOnce, false, "n")
        .await
        .unwrap();
    assert_eq!(body(&sub.publish().await), "n");
    drop(vhost);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wildcards_overlaps_and_dollar_topics() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut sub = connect(s.addr, "w", true).await;
    assert_eq!(sub.sub("a/+/c", QoS::AtMostOnce).await, [0]);
    assert_eq!(sub.sub("a/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(sub.sub("#", QoS::AtMostOnce).await, [0]);
    assert_eq!(
        sub.sub("a/#/c", QoS::AtMostOnce).await,
        [0x80],
        "invalid filter"
    );
    let p = connect(s.addr, "p", true).await;
    p.c.publish("a/b/c", QoS::AtLeastOnce, false, "one")
        .await
        .unwrap();
    p.c.publish("$SYS/x", QoS::AtMostOnce, false, "sys")
        .await
        .unwrap();
    p.c.publish("room.1/t", QoS::AtMostOnce, false, "dots")
        .await
        .unwrap();
    let got = sub.publish().await;
    assert_eq!((got.topic.as_str(), body(&got)), ("a/b/c", "one"));
    assert_eq!(
        got.qos,
        QoS::AtLeastOnce,
        "overlaps: once, at the highest QoS"
    );
    let got = sub.publish().await;
    assert_eq!(
        (got.topic.as_str(), body(&got)),
        ("room.1/t", "dots"),
        "the $SYS message is not delivered to #, and dots survive the mapping"
    );
    assert!(sub
        .publish_within(Duration::from_millis(300))
        .await
        .is_none());
    // unsubscribe
    sub.c.unsubscribe("#").await.unwrap();
    loop {
        if let Some(Ev::In(Incoming::UnsubAck(_))) = sub.next().await {
            break;
        }
    }
    p.c.publish("z", QoS::AtMostOnce, false, "gone")
        .await
        .unwrap();
    assert!(sub
        .publish_within(Duration::from_millis(300))
        .await
        .is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_set_delivered_cleared_and_durable() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut p = connect(s.addr, "p", true).await;
    p.c.publish("r/1", QoS::AtLeastOnce, true, "kept")
        .await
        .unwrap();
    p.c.publish("r/2", QoS::AtMostOnce, true, "two")
        .await
        .unwrap();
    loop {
        if let Some(Ev::In(Incoming::PubAck(_))) = p.next().await {
            break;
        }
    }
    eventually("both retained messages", Duration::from_secs(10), || {
        let vs = s.ctx.state.vhost_state("/").unwrap();
        vs.retained.matching("r/+").len() == 2
    })
    .await;
    let mut a = connect(s.addr, "a", true).await;
    a.sub("r/+", QoS::AtLeastOnce).await;
    let mut got = [a.publish().await, a.publish().await];
    got.sort_by(|x, y| x.topic.cmp(&y.topic));
    assert!(got.iter().all(|m| m.retain));
    assert_eq!(body(&got[0]), "kept");
    assert_eq!(got[0].qos, QoS::AtLeastOnce);
    assert_eq!(got[1].qos, QoS::AtMostOnce);
    // clear r/2 with an empty retained message
    p.c.publish("r/2", QoS::AtLeastOnce, true, Vec::<u8>::new())
        .await
        .unwrap();
    let cleared = a.publish().await;
    assert!(cleared.payload.is_empty() && !cleared.retain);
    p.disconnect().await;
    a.disconnect().await;
    s.stop().await;
    // across a restart
    let s = start(dir.path()).await;
    let mut b = connect(s.addr, "b", true).await;
    b.sub("r/#", QoS::AtLeastOnce).await;
    let m = b.publish().await;
    assert_eq!(
        (m.topic.as_str(), body(&m), m.retain),
        ("r/1", "kept", true)
    );
    assert!(b.publish_within(Duration::from_millis(300)).await.is_none());
    b.disconnect().await;
    s.stop().await;
}

/// A takeover cancels the connection's own shutdown token (no second token per
/// connection): the client taken over still gets its will published, and the other
/// connections are not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_publishes_the_will_and_leaves_other_connections_alone() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut watcher = connect(s.addr, "watcher", true).await;
    watcher.sub("wills/#", QoS::AtLeastOnce).await;
    let mut o = opts(s.addr, "same", true);
    o.set_last_will(LastWill::new(
        "wills/same",
        "taken",
        QoS::AtLeastOnce,
        false,
    ));
    let (mut first, _) = connect_with(o).await;
    let mut second = connect(s.addr, "same", true).await;
    assert!(
        first.closed().await,
        "first connection closed by the takeover"
    );
    let w = watcher.publish().await;
    assert_eq!((w.topic.as_str(), body(&w)), ("wills/same", "taken"));
    // the watcher's connection and the new one both still serve
    second.sub("t", QoS::AtLeastOnce).await;
    watcher
        .c
        .publish("t", QoS::AtLeastOnce, false, "still here")
        .await
        .unwrap();
    assert_eq!(body(&second.publish().await), "still here");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn will_on_abnormal_close_only() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut watcher = connect(s.addr, "watcher", true).await;
    watcher.sub("wills/#", QoS::AtLeastOnce).await;
    let mut o = opts(s.addr, "dies", true);
    o.set_last_will(LastWill::new("wills/dies", "gone", QoS::AtLeastOnce, false));
    let (dies, _) = connect_with(o).await;
    let mut o = opts(s.addr, "polite", true);
    o.set_last_will(LastWill::new("wills/polite", "x", QoS::AtLeastOnce, false));
    let (polite, _) = connect_with(o).await;
    polite.disconnect().await;
    dies.kill().await;
    let w = watcher.publish().await;
    assert_eq!((w.topic.as_str(), body(&w)), ("wills/dies", "gone"));
    assert!(watcher
        .publish_within(Duration::from_millis(300))
        .await
        .is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_session_queues_offline_and_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let (mut c, ack) = connect_with(opts(s.addr, "dev1", false)).await;
    assert!(!ack.session_present);
    c.sub("p/#", QoS::AtLeastOnce).await;
    c.disconnect().await;
    let mut p = connect(s.addr, "p", true).await;
    for i in 0..3 {
        p.c.publish("p/x", QoS::AtLeastOnce, false, format!("off{i}"))
            .await
            .unwrap();
    }
    for _ in 0..3 {
        loop {
            if let Some(Ev::In(Incoming::PubAck(_))) = p.next().await {
                break;
            }
        }
    }
    let (mut c, ack) = connect_with(opts(s.addr, "dev1", false)).await;
    assert!(ack.session_present);
    for i in 0..3 {
        assert_eq!(body(&c.publish().await), format!("off{i}"));
    }
    c.disconnect().await;
    for i in 0..2 {
        p.c.publish("p/y", QoS::AtLeastOnce, false, format!("restart{i}"))
            .await
            .unwrap();
    }
    for _ in 0..2 {
        loop {
            if let Some(Ev::In(Incoming::PubAck(_))) = p.next().await {
                break;
            }
        }
    }
    p.disconnect().await;
    s.stop().await;

    let s = start(dir.path()).await;
    let (mut c, ack) = connect_with(opts(s.addr, "dev1", false)).await;
    assert!(ack.session_present, "the session survives a restart");
    for i in 0..2 {
        assert_eq!(body(&c.publish().await), format!("restart{i}"));
    }
    // the subscription (and its QoS) survived too
    let p = connect(s.addr, "p", true).await;
    p.c.publish("p/z", QoS::ExactlyOnce, false, "after")
        .await
        .unwrap();
    let m = c.publish().await;
    assert_eq!((body(&m), m.qos), ("after", QoS::AtLeastOnce));
    c.disconnect().await;
    // clean session 1 discards it
    let (c, ack) = connect_with(opts(s.addr, "dev1", true)).await;
    assert!(!ack.session_present);
    c.disconnect().await;
    let (c, ack) = connect_with(opts(s.addr, "dev1", false)).await;
    assert!(!ack.session_present);
    c.disconnect().await;
    p.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_and_retained_survive_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut c = connect(s.addr, "crashy", false).await;
    c.sub("k/#", QoS::AtLeastOnce).await;
    c.disconnect().await;
    let mut p = connect(s.addr, "p", true).await;
    p.c.publish("k/r", QoS::AtLeastOnce, true, "old")
        .await
        .unwrap();
    p.c.publish("k/r", QoS::AtLeastOnce, true, "retained")
        .await
        .unwrap();
    p.c.publish("k/q", QoS::AtLeastOnce, false, "queued")
        .await
        .unwrap();
    let mut acks = 0;
    while acks < 3 {
        if let Some(Ev::In(Incoming::PubAck(_))) = p.next().await {
            acks += 1;
        }
    }
    p.kill().await;
    s.crash().await;

    let s = start(dir.path()).await;
    let (mut c, ack) = connect_with(opts(s.addr, "crashy", false)).await;
    assert!(ack.session_present);
    let mut got: Vec<(String, bool)> = Vec::new();
    for _ in 0..3 {
        let m = c.publish().await;
        got.push((body(&m).to_string(), m.retain));
    }
    assert_eq!(
        got,
        [
            ("old".to_string(), false),
            ("retained".to_string(), false),
            ("queued".to_string(), false)
        ]
    );
    let mut fresh = connect(s.addr, "fresh", true).await;
    fresh.sub("k/r", QoS::AtLeastOnce).await;
    let m = fresh.publish().await;
    assert_eq!((body(&m), m.retain), ("retained", true));
    assert!(fresh
        .publish_within(Duration::from_millis(300))
        .await
        .is_none());
    c.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_messages_are_resent_with_dup_after_reconnect() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    // a raw client that never acks
    let mut raw = Raw::connect(s.addr, "lazy", false).await;
    assert_eq!(raw.connack().await, (false, 0));
    raw.send(&Packet::Subscribe(Subscribe {
        pkid: 1,
        filters: vec![("d/#".into(), 1)],
    }))
    .await;
    assert!(matches!(raw.recv().await, Some(Packet::SubAck(_))));
    let p = connect(s.addr, "p", true).await;
    p.c.publish("d/1", QoS::AtLeastOnce, false, "once")
        .await
        .unwrap();
    let Some(Packet::Publish(first)) = raw.recv().await else {
        panic!()
    };
    assert!(!first.dup);
    drop(raw);
    eventually("the session to disconnect", Duration::from_secs(10), || {
        !s.ctx.state.is_connected("/", "lazy")
    })
    .await;
    let mut raw = Raw::connect(s.addr, "lazy", false).await;
    assert_eq!(raw.connack().await, (true, 0));
    let Some(Packet::Publish(again)) = raw.recv().await else {
        panic!()
    };
    assert!(again.dup, "resent with DUP");
    assert_eq!(again.payload.as_ref(), b"once");
    raw.send(&Packet::PubAck(again.pkid)).await;
    raw.send(&Packet::Disconnect).await;
    p.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_disconnects_the_first_client() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut first = connect(s.addr, "same", true).await;
    first.sub("t", QoS::AtMostOnce).await;
    let mut second = connect(s.addr, "same", true).await;
    assert!(
        first.closed().await,
        "first connection closed by the takeover"
    );
    second.sub("t", QoS::AtMostOnce).await;
    let p = connect(s.addr, "p", true).await;
    p.c.publish("t", QoS::AtMostOnce, false, "hi")
        .await
        .unwrap();
    assert_eq!(body(&second.publish().await), "hi");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_qos2_is_exactly_once_with_dup_resends() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut sub = connect(s.addr, "sub", true).await;
    sub.sub("e", QoS::ExactlyOnce).await;
    let mut raw = Raw::connect(s.addr, "q2", true).await;
    raw.connack().await;
    let mut pubp = Publish {
        dup: false,
        qos: 2,
        retain: false,
        topic: "e".into(),
        pkid: 7,
        payload: Bytes::from_static(b"x"),
    };
    raw.send(&Packet::Publish(pubp.clone())).await;
    assert_eq!(raw.recv().await, Some(Packet::PubRec(7)));
    pubp.dup = true;
    raw.send(&Packet::Publish(pubp)).await;
    assert_eq!(raw.recv().await, Some(Packet::PubRec(7)));
    raw.send(&Packet::PubRel(7)).await;
    assert_eq!(raw.recv().await, Some(Packet::PubComp(7)));
    assert_eq!(body(&sub.publish().await), "x");
    assert!(sub
        .publish_within(Duration::from_millis(300))
        .await
        .is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_connects_get_their_return_codes() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    // CONNACK 1: protocol level 5
    let mut raw = Raw::open(s.addr).await;
    raw.write(&[
        0x10, 12, 0, 4, b'M', b'Q', b'T', b'T', 5, 2, 0, 60, 0, 0, 0, 0,
    ])
    .await;
    // (a v5 CONNECT has properties; the server answers from the level alone)
    assert_eq!(raw.connack().await, (false, 1));
    assert!(raw.eof().await);
    // MQIsdp level 3 is accepted
    let mut raw = Raw::open(s.addr).await;
    raw.send(&Packet::Connect(Connect {
        protocol_name: "MQIsdp".into(),
        protocol_level: 3,
        ..connect_packet("old", true)
    }))
    .await;
    assert_eq!(raw.connack().await, (false, 0));
    // CONNACK 2: empty client id with clean session 0
    let mut raw = Raw::connect(s.addr, "", false).await;
    assert_eq!(raw.connack().await, (false, 2));
    assert!(raw.eof().await);
    // empty id with clean session 1 is assigned one
    let mut raw = Raw::connect(s.addr, "", true).await;
    assert_eq!(raw.connack().await, (false, 0));
    // CONNACK 4: bad password
    let mut raw = Raw::open(s.addr).await;
    raw.send(&Packet::Connect(Connect {
        username: Some("guest".into()),
        password: Some(Bytes::from_static(b"wrong")),
        ..connect_packet("x", true)
    }))
    .await;
    assert_eq!(raw.connack().await, (false, 4));
    // first packet not CONNECT: closed
    let mut raw = Raw::open(s.addr).await;
    raw.send(&Packet::PingReq).await;
    assert!(raw.eof().await);
    // CONNACK 5: no user name from a non-loopback peer
    let (a, b) = tokio::io::duplex(4096);
    let peer: SocketAddr = "192.0.2.1:5555".parse().unwrap();
    let h = tokio::spawn(serve(a, peer, s.ctx.clone()));
    let mut raw = Raw {
        s: Box::new(b),
        buf: BytesMut::new(),
    };
    raw.send(&Packet::Connect(connect_packet("remote", true)))
        .await;
    assert_eq!(raw.connack().await, (false, 5));
    h.await.unwrap().unwrap();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_packet_closes_only_that_connection() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut good = connect(s.addr, "good", true).await;
    good.sub("ok", QoS::AtMostOnce).await;
    let mut bad = Raw::connect(s.addr, "bad", true).await;
    bad.connack().await;
    // SUBSCRIBE with reserved flags 0000
    bad.write(&[0x80, 6, 0, 1, 0, 1, b'a', 0]).await;
    assert!(bad.eof().await);
    // a PUBLISH to a wildcard topic
    let mut bad = Raw::connect(s.addr, "bad2", true).await;
    bad.connack().await;
    bad.write(&[0x30, 3, 0, 1, b'#']).await;
    assert!(bad.eof().await);
    // an oversized packet before CONNECT (64 KiB limit) is refused from its header
    let mut bad = Raw::open(s.addr).await;
    bad.write(&[0x10, 0x80, 0x80, 0x08]).await;
    assert!(bad.eof().await);
    let p = connect(s.addr, "p", true).await;
    p.c.publish("ok", QoS::AtMostOnce, false, "still")
        .await
        .unwrap();
    assert_eq!(body(&good.publish().await), "still");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sys_topics_are_retained() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut c = connect(s.addr, "sys", true).await;
    s.ctx.state.publish_sys();
    c.sub("$SYS/broker/clients/connected", QoS::AtMostOnce)
        .await;
    let m = c.publish().await;
    assert!(m.retain);
    assert_eq!(body(&m), "1");
    s.stop().await;
}

#[tokio::test(start_paused = true)]
async fn keepalive_lapse_closes_and_publishes_the_will() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = context(open_broker(dir.path()));
    let (a, b) = tokio::io::duplex(4096);
    let h = tokio::spawn(serve(a, "127.0.0.1:1".parse().unwrap(), ctx.clone()));
    let mut raw = Raw {
        s: Box::new(b),
        buf: BytesMut::new(),
    };
    raw.send(&Packet::Connect(Connect {
        keep_alive: 2,
        will: Some(Will {
            topic: "ka/will".into(),
            payload: Bytes::from_static(b"late"),
            qos: 0,
            retain: true,
        }),
        ..connect_packet("ka", true)
    }))
    .await;
    assert_eq!(raw.connack().await, (false, 0));
    let t0 = tokio::time::Instant::now();
    // pings every 2 s keep it alive past the 3 s limit: in each 2 s of the client's
    // silence the broker neither sends anything nor closes (the clock is paused, so the
    // 2 s pass at once and in order with the broker's keep-alive timer)
    for _ in 0..3 {
        let quiet = tokio::time::timeout(Duration::from_secs(2), raw.recv()).await;
        assert!(quiet.is_err(), "within 2 s of silence: {quiet:?}");
        raw.send(&Packet::PingReq).await;
        assert_eq!(raw.recv().await, Some(Packet::PingResp));
    }
    assert!(raw.eof().await);
    let lived = t0.elapsed();
    assert!(
        lived >= Duration::from_secs(9) && lived < Duration::from_secs(10),
        "{lived:?}"
    );
    assert!(matches!(
        h.await.unwrap(),
        Err(triad_mqtt::MqttError::Timeout(_))
    ));
    let vs = ctx.state.vhost_state("/").unwrap();
    let will = vs.retained.matching("ka/#");
    assert_eq!(will.len(), 1, "the will was published (and retained)");
}

#[test]
fn many_retained_messages_are_rebuilt_at_start() {
    let dir = tempfile::tempdir().unwrap();
    {
        let ctx = context(open_broker(dir.path()));
        let vs = ctx.state.vhost_state("/").unwrap();
        for i in 0..6000 {
            let d = vs
                .retained
                .set(&format!("dev/{i}/t"), Bytes::from(i.to_string()), 1, true)
                .unwrap();
            if i == 5999 {
                d.unwrap().wait().unwrap();
            }
        }
        // replaced and cleared ones do not come back
        vs.retained
            .set("dev/0/t", Bytes::from_static(b"new"), 1, true)
            .unwrap();
        vs.retained.set("dev/1/t", Bytes::new(), 1, true).unwrap();
    }
    let ctx = context(open_broker(dir.path()));
    let vs = ctx.state.vhost_state("/").unwrap();
    assert_eq!(vs.retained.len(), 5999);
    assert_eq!(vs.retained.matching("dev/0/+")[0].payload.as_ref(), b"new");
    assert!(vs.retained.matching("dev/1/#").is_empty());
    assert_eq!(vs.retained.matching("dev/5999/t")[0].qos, 1);
}

fn connect_packet(id: &str, clean: bool) -> Connect {
    Connect {
        protocol_name: "MQTT".into(),
        protocol_level: 4,
        clean_session: clean,
        keep_alive: 30,
        client_id: id.into(),
        will: None,
        username: None,
        password: None,
    }
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// A raw MQTT client over the codec.
struct Raw {
    s: Box<dyn Io>,
    buf: BytesMut,
}

impl Raw {
    async fn open(addr: SocketAddr) -> Raw {
        Raw {
            s: Box::new(TcpStream::connect(addr).await.unwrap()),
            buf: BytesMut::new(),
        }
    }

    async fn connect(addr: SocketAddr, id: &str, clean: bool) -> Raw {
        let mut r = Raw::open(addr).await;
        r.send(&Packet::Connect(connect_packet(id, clean))).await;
        r
    }

    async fn write(&mut self, b: &[u8]) {
        self.s.write_all(b).await.unwrap();
    }

    async fn send(&mut self, p: &Packet) {
        let mut b = BytesMut::new();
        codec::encode(p, &mut b);
        self.write(&b).await;
    }

    async fn recv(&mut self) -> Option<Packet> {
        loop {
            if let Some(p) = codec::decode(&mut self.buf, &codec::Limits::default()).unwrap() {
                return Some(p);
            }
            let n = tokio::time::timeout(Duration::from_secs(5), self.s.read_buf(&mut self.buf))
                .await
                .ok()?
                .ok()?;
            if n == 0 {
                return None;
            }
        }
    }

    async fn connack(&mut self) -> (bool, u8) {
        match self.recv().await {
            Some(Packet::ConnAck {
                session_present,
                code,
            }) => (session_present, code),
            other => panic!("expected CONNACK, got {other:?}"),
        }
    }

    async fn eof(&mut self) -> bool {
        let mut b = [0u8; 64];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), self.s.read(&mut b)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }
}

/// Publisher flow control must not wedge clients that consume what they publish: two
/// clients each subscribed to `x/#` publish past the queues' high-water mark at QoS 1
/// and both still get every message, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flow_control_does_not_deadlock_clients_feeding_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut a = connect(s.addr, "fa", true).await;
    let mut b = connect(s.addr, "fb", true).await;
    assert_eq!(a.sub("x/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(b.sub("x/#", QoS::AtLeastOnce).await, [1]);
    let n = 1000usize;
    let (ca, cb) = (a.c.clone(), b.c.clone());
    let pa = tokio::spawn(async move {
        for i in 0..n {
            ca.publish("x/a", QoS::AtLeastOnce, false, i.to_string())
                .await
                .unwrap();
        }
    });
    let pb = tokio::spawn(async move {
        for i in 0..n {
            cb.publish("x/b", QoS::AtLeastOnce, false, i.to_string())
                .await
                .unwrap();
        }
    });
    for c in [&mut a, &mut b] {
        let (mut next_a, mut next_b) = (0usize, 0usize);
        while next_a < n || next_b < n {
            let p = c
                .publish_within(Duration::from_secs(20))
                .await
                .unwrap_or_else(|| panic!("stalled at x/a {next_a}, x/b {next_b}"));
            let next = if p.topic == "x/a" {
                &mut next_a
            } else {
                &mut next_b
            };
            assert_eq!(body(&p), next.to_string(), "in order on {}", p.topic);
            *next += 1;
        }
    }
    pa.await.unwrap();
    pb.await.unwrap();
    s.stop().await;
}

/// Collects PUBLISHes from `clients` until `n` arrived in all (each within 5 s).
async fn collect(clients: &mut [&mut Client], n: usize) -> Vec<Vec<String>> {
    let mut got = vec![Vec::new(); clients.len()];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while got.iter().map(Vec::len).sum::<usize>() < n {
        assert!(tokio::time::Instant::now() < deadline, "only {got:?}");
        for (i, c) in clients.iter_mut().enumerate() {
            if let Some(p) = c.publish_within(Duration::from_millis(50)).await {
                got[i].push(body(&p).to_string());
            }
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_subscription_members_take_turns_without_retained() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let p = connect(s.addr, "sh-pub", true).await;
    p.c.publish("sh/ret", QoS::AtLeastOnce, true, "retained")
        .await
        .unwrap();
    let mut a = connect(s.addr, "sh-a", true).await;
    let mut b = connect(s.addr, "sh-b", true).await;
    assert_eq!(a.sub("$share/g1/sh/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(b.sub("$share/g1/sh/#", QoS::AtLeastOnce).await, [1]);
    // another group gets every message too
    let mut other = connect(s.addr, "sh-other", true).await;
    assert_eq!(other.sub("$share/g2/sh/+", QoS::AtMostOnce).await, [0]);
    assert_eq!(s.ctx.state.shared_members("/", "mqtt-shared-g1/sh/#"), 2);
    for i in 0..6 {
        p.c.publish("sh/x", QoS::AtLeastOnce, false, i.to_string())
            .await
            .unwrap();
    }
    let got = collect(&mut [&mut a, &mut b], 6).await;
    // no retained message on a shared subscribe; each message to one member, in turn
    assert_eq!(got[0], ["0", "2", "4"], "{got:?}");
    assert_eq!(got[1], ["1", "3", "5"], "{got:?}");
    let all = collect(&mut [&mut other], 6).await;
    assert_eq!(all[0], ["0", "1", "2", "3", "4", "5"]);
    // the group's queue goes with its last (clean-session) member
    let vhost = s.ctx.broker.vhost("/").unwrap();
    a.disconnect().await;
    assert!(vhost.queue("mqtt-shared-g1/sh/#").is_some());
    b.disconnect().await;
    eventually("the group's queue to go", Duration::from_secs(5), || {
        vhost.queue("mqtt-shared-g1/sh/#").is_none()
    })
    .await;
    assert_eq!(s.ctx.state.shared_members("/", "mqtt-shared-g1/sh/#"), 0);
    drop(vhost);
    other.disconnect().await;
    p.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_shared_filters_get_0x80() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut raw = Raw::connect(s.addr, "sh-bad", true).await;
    assert_eq!(raw.connack().await, (false, 0));
    let bad = [
        "$share",
        "$share/",
        "$share//a",
        "$share/g",
        "$share/g/",
        "$share/g+/a",
        "$share/g#/a",
        "$share/g/a/#/b",
    ];
    let mut filters: Vec<(String, u8)> = bad.iter().map(|f| (f.to_string(), 1)).collect();
    filters.push(("$share/ok/a/+".into(), 2));
    raw.send(&Packet::Subscribe(Subscribe { pkid: 3, filters }))
        .await;
    match raw.recv().await {
        Some(Packet::SubAck(a)) => {
            assert_eq!(a.codes, [0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 2])
        }
        other => panic!("expected SUBACK, got {other:?}"),
    }
    raw.send(&Packet::Disconnect).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_subscriptions_declare_bounded_streams_and_count_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut ctx = context(open_broker(dir.path()));
    ctx.limits.max_subscriptions = 2;
    ctx.limits.stream_max_age = Duration::from_secs(3600);
    ctx.limits.stream_max_bytes = 1 << 20;
    let s = start_ctx(ctx).await;
    let mut raw = Raw::connect(s.addr, "st-dup", false).await;
    assert_eq!(raw.connack().await, (false, 0));
    // the same stream filter twice in one SUBSCRIBE: one subscription, the last QoS
    raw.send(&Packet::Subscribe(Subscribe {
        pkid: 1,
        filters: vec![
            ("$stream/first/st/#".into(), 1),
            ("$stream/first/st/#".into(), 0),
        ],
    }))
    .await;
    match raw.recv().await {
        Some(Packet::SubAck(a)) => assert_eq!(a.codes, [1, 0]),
        other => panic!("expected SUBACK, got {other:?}"),
    }
    // the auto-declared stream has the configured retention
    let vhost = s.ctx.broker.vhost("/").unwrap();
    let q = vhost.queue("mqtt-stream/st/#").unwrap();
    assert!(q.is_stream() && q.durable());
    assert_eq!(q.arguments().get_str("x-max-age"), Some("3600s"));
    assert_eq!(q.arguments().get_i64("x-max-length-bytes"), Some(1 << 20));
    drop(q);
    drop(vhost);
    // it counts once against max_subscriptions (2): a second stream filter fits
    raw.send(&Packet::Subscribe(Subscribe {
        pkid: 2,
        filters: vec![("$stream/first/other".into(), 1)],
    }))
    .await;
    match raw.recv().await {
        Some(Packet::SubAck(a)) => assert_eq!(a.codes, [1]),
        other => panic!("expected SUBACK, got {other:?}"),
    }
    // deliveries go out with the QoS granted last
    let p = connect(s.addr, "st-p", true).await;
    p.c.publish("st/a", QoS::AtLeastOnce, false, "one")
        .await
        .unwrap();
    match raw.recv().await {
        Some(Packet::Publish(m)) => {
            assert_eq!((m.topic.as_str(), m.qos), ("st/a", 0));
            assert_eq!(&m.payload[..], b"one");
        }
        other => panic!("expected PUBLISH, got {other:?}"),
    }
    raw.send(&Packet::Disconnect).await;
    p.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaving_members_unacked_messages_go_to_another() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    // a raw member that never acks
    let mut lazy = Raw::connect(s.addr, "sh-lazy", true).await;
    assert_eq!(lazy.connack().await, (false, 0));
    lazy.send(&Packet::Subscribe(Subscribe {
        pkid: 1,
        filters: vec![("$share/w/jobs".into(), 1)],
    }))
    .await;
    assert!(matches!(lazy.recv().await, Some(Packet::SubAck(_))));
    let mut busy = connect(s.addr, "sh-busy", true).await;
    assert_eq!(busy.sub("$share/w/jobs", QoS::AtLeastOnce).await, [1]);
    let p = connect(s.addr, "sh-p", true).await;
    for job in ["j0", "j1"] {
        p.c.publish("jobs", QoS::AtLeastOnce, false, job)
            .await
            .unwrap();
    }
    let Some(Packet::Publish(taken)) = lazy.recv().await else {
        panic!("the lazy member's turn")
    };
    let first = busy.publish().await;
    assert_ne!(body(&first), std::str::from_utf8(&taken.payload).unwrap());
    drop(lazy); // leaves without acking
    let again = busy.publish().await;
    assert_eq!(again.payload, taken.payload);
    busy.disconnect().await;
    p.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persistent_sessions_keep_their_shared_membership() {
    let dir = tempfile::tempdir().unwrap();
    let s = start(dir.path()).await;
    let mut m = connect(s.addr, "sh-keep", false).await;
    assert_eq!(m.sub("$share/g/keep/#", QoS::AtLeastOnce).await, [1]);
    m.disconnect().await;
    let vhost = s.ctx.broker.vhost("/").unwrap();
    assert!(vhost.queue("mqtt-shared-g/keep/#").unwrap().durable());
    drop(vhost);
    let p = connect(s.addr, "sh-keep-p", true).await;
    p.c.publish("keep/1", QoS::AtLeastOnce, false, "while away")
        .await
        .unwrap();
    p.disconnect().await;
    // back without subscribing again: the group's queue kept the message for it
    let (mut m, ack) = connect_with(opts(s.addr, "sh-keep", false)).await;
    assert!(ack.session_present);
    assert_eq!(body(&m.publish().await), "while away");
    m.disconnect().await;
    s.stop().await;

    // and across a restart
    let s = start(dir.path()).await;
    assert_eq!(s.ctx.state.shared_members("/", "mqtt-shared-g/keep/#"), 1);
    let p = connect(s.addr, "sh-keep-p", true).await;
    p.c.publish("keep/2", QoS::AtLeastOnce, false, "after restart")
        .await
        .unwrap();
    let (mut m, ack) = connect_with(opts(s.addr, "sh-keep", false)).await;
    assert!(ack.session_present);
    assert_eq!(body(&m.publish().await), "after restart");
    m.disconnect().await;
    // a clean session with the same id discards the session and leaves the group
    let c = connect(s.addr, "sh-keep", true).await;
    let vhost = s.ctx.broker.vhost("/").unwrap();
    assert!(vhost.queue("mqtt-shared-g/keep/#").is_none());
    drop(vhost);
    c.disconnect().await;
    p.disconnect().await;
    s.stop().await;
}

/// A broker with vhost `dev` besides `/`, guest and `dev-user` (password `pw`) allowed
/// in both.
fn two_vhosts(dir: &Path, login: triad_mqtt::MqttLogin) -> MqttContext {
    use triad_core::{Permission, UserConfig};
    let cfg = CoreConfig {
        users: vec![
            UserConfig::with_password("guest", "guest"),
            UserConfig::with_password("dev-user", "pw"),
        ],
        vhosts: vec!["dev".into()],
        permissions: vec![
            Permission::full("guest", "/"),
            Permission::full("guest", "dev"),
            Permission::full("dev-user", "dev"),
        ],
        ..CoreConfig::default()
    };
    let mut ctx = context(open_broker_with(dir, cfg));
    ctx.login = login;
    ctx
}

fn with_login(addr: SocketAddr, id: &str, user: &str, pass: &str) -> MqttOptions {
    let mut o = opts(addr, id, true);
    o.set_credentials(user, pass);
    o
}

async fn connack_code(o: MqttOptions) -> Option<rumqttc::ConnectReturnCode> {
    let (c, mut el) = AsyncClient::new(o, 10);
    let r = loop {
        match tokio::time::timeout(Duration::from_secs(5), el.poll()).await {
            Ok(Ok(Event::Incoming(Incoming::ConnAck(a)))) => break Some(a.code),
            Ok(Ok(_)) => {}
            Ok(Err(rumqttc::ConnectionError::ConnectionRefused(code))) => break Some(code),
            Ok(Err(_)) | Err(_) => break None,
        }
    };
    drop(c);
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_from_the_user_name_and_unknown_vhosts_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = start_ctx(two_vhosts(dir.path(), Default::default())).await;
    use rumqttc::ConnectReturnCode as Rc;
    // `dev:dev-user` opens dev; `dev-user` alone would open `/`, where it has no rights
    assert_eq!(
        connack_code(with_login(s.addr, "v1", "dev:dev-user", "pw")).await,
        Some(Rc::Success)
    );
    assert_eq!(
        connack_code(with_login(s.addr, "v2", "dev-user", "pw")).await,
        Some(Rc::BadUserNamePassword)
    );
    // an unknown vhost is refused as RabbitMQ does: bad user name or password
    assert_eq!(
        connack_code(with_login(s.addr, "v3", "nosuch:guest", "guest")).await,
        Some(Rc::BadUserNamePassword)
    );

    // retained messages and subscriptions are per vhost
    let (p, _) = connect_with(with_login(s.addr, "pd", "dev:guest", "guest")).await;
    p.c.publish("v/t", QoS::AtLeastOnce, true, "in dev")
        .await
        .unwrap();
    let (mut root, _) = connect_with(with_login(s.addr, "sr", "guest", "guest")).await;
    let (mut dev, _) = connect_with(with_login(s.addr, "sd", "dev:guest", "guest")).await;
    assert_eq!(root.sub("v/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(dev.sub("v/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(body(&dev.publish().await), "in dev");
    p.c.publish("v/t", QoS::AtLeastOnce, false, "dev again")
        .await
        .unwrap();
    assert_eq!(body(&dev.publish().await), "dev again");
    // the same client id in two vhosts is two clients
    let (same, _) = connect_with(with_login(s.addr, "sr", "dev:guest", "guest")).await;
    let (rp, _) = connect_with(with_login(s.addr, "rp", "guest", "guest")).await;
    rp.c.publish("v/t", QoS::AtLeastOnce, false, "in root")
        .await
        .unwrap();
    assert_eq!(
        body(&root.publish().await),
        "in root",
        "root's sr was not taken over"
    );
    assert!(s.ctx.state.is_connected("dev", "sr") && s.ctx.state.is_connected("/", "sr"));
    for c in [p, root, dev, same, rp] {
        c.disconnect().await;
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vhost_from_the_port() {
    let dir = tempfile::tempdir().unwrap();
    let login = triad_mqtt::MqttLogin {
        port_vhost: Some("dev".into()),
        ..Default::default()
    };
    let s = start_ctx(two_vhosts(dir.path(), login)).await;
    use rumqttc::ConnectReturnCode as Rc;
    assert_eq!(
        connack_code(with_login(s.addr, "p1", "dev-user", "pw")).await,
        Some(Rc::Success)
    );
    let (c, _) = connect_with(with_login(s.addr, "p2", "guest", "guest")).await;
    assert!(s.ctx.state.is_connected("dev", "p2"));
    // `vhost:user` still wins over the port
    let (r, _) = connect_with(with_login(s.addr, "p3", "/:guest", "guest")).await;
    assert!(s.ctx.state.is_connected("/", "p3"));
    c.disconnect().await;
    r.disconnect().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topic_permissions_with_the_client_id() {
    use triad_core::{Permission, TopicPermission};
    let dir = tempfile::tempdir().unwrap();
    let pat = |p: &str| TopicPermission::pattern(p, "guest", "/").unwrap();
    let cfg = CoreConfig {
        permissions: vec![Permission::full("guest", "/")],
        topic_permissions: vec![TopicPermission {
            user: "guest".into(),
            vhost: "/".into(),
            exchange: "amq.topic".into(),
            write: pat("^dev\\.{client_id}\\."),
            read: pat("^(dev\\.{client_id}|{username})\\."),
        }],
        ..CoreConfig::default()
    };
    let s = start_ctx(context(open_broker_with(dir.path(), cfg))).await;
    let mut c1 = connect(s.addr, "c1", true).await;
    assert_eq!(c1.sub("dev/c1/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(c1.sub("guest/#", QoS::AtLeastOnce).await, [1]);
    assert_eq!(c1.sub("dev/c2/#", QoS::AtLeastOnce).await, [0x80]);
    assert_eq!(c1.sub("dev/+/#", QoS::AtLeastOnce).await, [0x80]);
    c1.c.publish("dev/c1/t", QoS::AtLeastOnce, false, "mine")
        .await
        .unwrap();
    assert_eq!(body(&c1.publish().await), "mine");
    // a client id is matched literally: `.*` does not open every device's topics
    let mut wild = connect(s.addr, ".*", true).await;
    assert_eq!(wild.sub("dev/c1/#", QoS::AtLeastOnce).await, [0x80]);
    // publishing to another client's topic closes the connection, as RabbitMQ does
    wild.c
        .publish("dev/c1/t", QoS::AtLeastOnce, false, "not yours")
        .await
        .unwrap();
    assert!(wild.closed().await);
    // the refused message never arrives: the next one c1 gets is its own marker
    c1.c.publish("dev/c1/t", QoS::AtLeastOnce, false, "marker")
        .await
        .unwrap();
    assert_eq!(body(&c1.publish().await), "marker");
    c1.disconnect().await;
    s.stop().await;
}

/// Waits until no client is connected: the last one's disconnect (and its time, for
/// session expiry) has been recorded.
async fn all_disconnected(state: &MqttState) {
    eventually(
        "the clients' disconnects recorded",
        Duration::from_secs(10),
        || state.stats.connected.load(Ordering::Relaxed) == 0,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_expiry_counts_from_each_disconnect_by_the_broker_clock() {
    let dir = tempfile::tempdir().unwrap();
    let clock = Clock::manual();
    let cfg = CoreConfig {
        clock: clock.clone(),
        ..CoreConfig::default()
    };
    let ctx = context(open_broker_with(dir.path(), cfg));
    let state = ctx.state.clone();
    let expiry = state.spawn_session_expiry(Duration::from_secs(3600), ctx.shutdown.clone());
    let s = start_ctx(ctx).await;
    let vh = s.ctx.broker.vhost(s.ctx.broker.default_vhost()).unwrap();
    let present = |client: &str| vh.queue(&format!("mqtt-subscription-{client}")).is_some();

    // early leaves at T, late at T + 30 min
    for client in ["early", "late"] {
        let (mut c, _) = connect_with(opts(s.addr, client, false)).await;
        c.sub(&format!("{client}/#"), QoS::AtLeastOnce).await;
        c.disconnect().await;
        all_disconnected(&state).await;
        if client == "early" {
            clock.advance(Duration::from_secs(1800));
        }
    }
    assert!(present("early") && present("late"));

    // T + 1 h + 1 s: early is due, late (due at T + 1 h 30 min) is not
    clock.advance(Duration::from_secs(1801));
    eventually("early's session to expire", Duration::from_secs(10), || {
        !present("early")
    })
    .await;
    assert!(present("late"), "expired 30 min 1 s after its disconnect");
    let (c, ack) = connect_with(opts(s.addr, "early", false)).await;
    assert!(
        !ack.session_present,
        "the expired session was reported present"
    );
    c.disconnect().await;

    // late comes back just before its due time and leaves again: counted from then
    clock.advance(Duration::from_secs(1798));
    let (c, ack) = connect_with(opts(s.addr, "late", false)).await;
    assert!(
        ack.session_present,
        "expired 59 min 59 s after its disconnect"
    );
    c.disconnect().await;
    all_disconnected(&state).await;
    clock.advance(Duration::from_secs(1800));
    // the entry of its first disconnect is due and stale; the second is 30 min away
    let (c, ack) = connect_with(opts(s.addr, "late", false)).await;
    assert!(
        ack.session_present,
        "expired 30 min after its second disconnect"
    );
    c.disconnect().await;
    all_disconnected(&state).await;
    clock.advance(Duration::from_secs(3601));
    eventually("late's session to expire", Duration::from_secs(10), || {
        !present("late")
    })
    .await;

    drop(vh);
    s.ctx.shutdown.cancel();
    expiry.await.unwrap();
    drop(state);
    s.stop().await;
}
