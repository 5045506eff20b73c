#![allow(clippy::unwrap_used)]
//! Half messages ([`triad_core::txn`]) over a real store: invisible until committed,
//! commit and rollback by message-id, check-back then rollback, permissions, and what a
//! reopen (the same recovery as after kill -9) finds.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use triad_core::testing::eventually_blocking;
use triad_core::txn::{commit_key, TxnConfig, HALF_QUEUE, TXN_EXCHANGE, TXN_HEADER};
use triad_core::{
    Broker, Clock, CoreConfig, CoreError, Credentials, ExchangeDef, ExchangeKind, FieldTable, Link,
    Peer, Permission, Properties, Protocol, Publish, QueueDeclare, ResourceKind, UserConfig,
};
use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::{Store, StoreConfig};

fn open(dir: &Path, txn: TxnConfig) -> Arc<Broker> {
    open_clocked(dir, txn, Clock::system())
}

/// A broker whose check-backs are due by `clock`.
fn open_clocked(dir: &Path, txn: TxnConfig, clock: Clock) -> Arc<Broker> {
    let mut sc = StoreConfig::new(dir);
    sc.segment_size = 1 << 20;
    let store = Arc::new(Store::open(sc).unwrap());
    let mut bob = Permission::full("bob", "/");
    bob.write = triad_core::Pattern::new("^other$").unwrap();
    let cfg = CoreConfig {
        users: vec![
            UserConfig::with_password("guest", "guest"),
            UserConfig::with_password("bob", "bob"),
        ],
        permissions: vec![Permission::full("guest", "/"), bob],
        txn,
        clock,
        ..CoreConfig::default()
    };
    Broker::open(store, cfg).unwrap()
}

fn login(b: &Broker, user: &str) -> Link {
    b.login(
        Credentials::Password {
            user,
            password: user,
        },
        Peer {
            addr: "127.0.0.1".parse().unwrap(),
            conn: b.next_connection_id(),
            failed_login_delay: Duration::ZERO,
        },
        "/",
        Protocol::Amqp,
    )
    .unwrap()
}

/// A durable topic exchange `orders` with durable queue `o` bound to `order.#`, and
/// durable queue `replies`.
fn topology(b: &Broker) {
    let v = b.vhost("/").unwrap();
    v.declare_exchange(
        ExchangeDef {
            durable: true,
            ..ExchangeDef::new("orders", ExchangeKind::Topic)
        },
        false,
    )
    .unwrap();
    for q in ["o", "replies"] {
        v.declare_queue(QueueDeclare {
            name: q.into(),
            durable: true,
            conn: 1,
            ..Default::default()
        })
        .unwrap();
    }
    v.bind_queue("o", "orders", "order.#", &FieldTable::default(), 1)
        .unwrap();
}

fn txn_props(op: &str, id: Option<&str>) -> Properties {
    let mut h = FieldTable::new();
    h.insert(TXN_HEADER, op);
    h.insert("app", "kept");
    Properties {
        message_id: id.map(str::to_string),
        reply_to: Some("replies".into()),
        delivery_mode: Some(2),
        headers: Some(h),
        ..Properties::default()
    }
}

fn half(link: &Link, id: &str, body: &str) -> Result<triad_core::Published, CoreError> {
    link.publish(Publish {
        exchange: "orders".into(),
        routing_key: "order.new".into(),
        properties: txn_props("half", Some(id)),
        body: Bytes::from(body.to_string()),
        ..Default::default()
    })
}

fn resolve(link: &Link, op: &str, id: &str) -> Result<triad_core::Published, CoreError> {
    link.publish(Publish {
        exchange: TXN_EXCHANGE.into(),
        routing_key: String::new(),
        properties: txn_props(op, Some(id)),
        ..Default::default()
    })
}

fn wait(p: triad_core::Published) {
    p.durable.expect("waits for the disk").wait().unwrap();
}

fn bodies(link: &Link, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(d) = link.get(queue, true).unwrap() {
        out.push(String::from_utf8_lossy(&d.body).into_owned());
        assert!(out.len() < 1000);
    }
    out
}

#[test]
fn a_half_message_is_invisible_until_committed_then_delivered_once_as_published() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), TxnConfig::default());
    topology(&b);
    let link = login(&b, "guest");
    wait(half(&link, "m1", "payload").unwrap());
    assert!(
        bodies(&link, "o").is_empty(),
        "a half message is not routed"
    );
    assert!(b.vhost("/").unwrap().txn().is_pending("m1"));
    wait(resolve(&link, "commit", "m1").unwrap());
    let d = link.get("o", true).unwrap().expect("committed: routed");
    assert_eq!(&d.body[..], b"payload");
    assert_eq!(&*d.exchange, "orders");
    assert_eq!(&*d.routing_key, "order.new");
    assert_eq!(d.properties.message_id.as_deref(), Some("m1"));
    let h = d.properties.headers.as_ref().unwrap();
    assert_eq!(h.get_str("app"), Some("kept"));
    assert!(!h.contains(TXN_HEADER), "the x-txn header is not delivered");
    assert!(link.get("o", true).unwrap().is_none(), "delivered once");
    // resolved: a second commit does not know it
    let e = resolve(&link, "commit", "m1").unwrap_err();
    assert!(
        matches!(e, CoreError::NotFound { kind: ResourceKind::HalfMessage, ref name } if name == "m1"),
        "{e:?}"
    );
}

#[test]
fn rollback_discards_and_unknown_ids_are_not_found() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), TxnConfig::default());
    topology(&b);
    let link = login(&b, "guest");
    wait(half(&link, "m2", "never").unwrap());
    wait(resolve(&link, "rollback", "m2").unwrap());
    assert!(!b.vhost("/").unwrap().txn().is_pending("m2"));
    for op in ["commit", "rollback"] {
        assert!(matches!(
            resolve(&link, op, "m2").unwrap_err(),
            CoreError::NotFound {
                kind: ResourceKind::HalfMessage,
                ..
            }
        ));
    }
    assert!(bodies(&link, "o").is_empty());
    // the id as routing key (STOMP's SEND /txn/<id>) works as well as the message-id
    wait(half(&link, "m3", "by key").unwrap());
    let mut props = txn_props("commit", None);
    props.message_id = None;
    wait(
        link.publish(Publish {
            exchange: TXN_EXCHANGE.into(),
            routing_key: "m3".into(),
            properties: props,
            ..Default::default()
        })
        .unwrap(),
    );
    assert_eq!(bodies(&link, "o"), ["by key"]);
}

#[test]
fn bad_half_messages_and_commits_are_refused_naming_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), TxnConfig::default());
    topology(&b);
    let link = login(&b, "guest");
    let pre = |r: Result<triad_core::Published, CoreError>, what: &str| match r {
        Err(CoreError::PreconditionFailed(m)) => assert!(m.contains(what), "{m}"),
        other => panic!("expected a precondition failure naming {what}: {other:?}"),
    };
    // no message-id
    pre(
        link.publish(Publish {
            exchange: "orders".into(),
            routing_key: "order.new".into(),
            properties: txn_props("half", None),
            ..Default::default()
        }),
        "message-id",
    );
    // the same id twice while pending
    wait(half(&link, "dup", "a").unwrap());
    pre(half(&link, "dup", "b"), "already pending");
    // only the broker sends checks; unknown values are refused
    for op in ["check", "maybe"] {
        pre(
            link.publish(Publish {
                exchange: "orders".into(),
                routing_key: "order.new".into(),
                properties: txn_props(op, Some("x")),
                ..Default::default()
            }),
            "half, commit or rollback",
        );
    }
    // a commit goes to amq.triad.txn, and amq.triad.txn takes only commits and rollbacks
    pre(
        link.publish(Publish {
            exchange: "orders".into(),
            routing_key: "order.new".into(),
            properties: txn_props("commit", Some("dup")),
            ..Default::default()
        }),
        TXN_EXCHANGE,
    );
    pre(
        link.publish(Publish {
            exchange: TXN_EXCHANGE.into(),
            properties: Properties {
                message_id: Some("dup".into()),
                ..Properties::default()
            },
            ..Default::default()
        }),
        "commit",
    );
    // a half message for a missing exchange is refused as any publish is
    let e = link
        .publish(Publish {
            exchange: "nope".into(),
            properties: txn_props("half", Some("n")),
            ..Default::default()
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            CoreError::NotFound {
                kind: ResourceKind::Exchange,
                ..
            }
        ),
        "{e:?}"
    );
    // nor inside a transaction
    let e = link
        .publish_all(vec![Publish {
            exchange: "orders".into(),
            properties: txn_props("half", Some("t")),
            ..Default::default()
        }])
        .unwrap_err();
    assert!(matches!(e, CoreError::PreconditionFailed(_)), "{e:?}");
    assert!(b.vhost("/").unwrap().txn().is_pending("dup"));
    assert_eq!(b.vhost("/").unwrap().txn().pending(), 1);
}

#[test]
fn committing_or_rolling_back_needs_write_permission_on_the_original_exchange() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), TxnConfig::default());
    topology(&b);
    let guest = login(&b, "guest");
    let bob = login(&b, "bob");
    wait(half(&guest, "p1", "guarded").unwrap());
    for op in ["commit", "rollback"] {
        let e = resolve(&bob, op, "p1").unwrap_err();
        assert!(matches!(e, CoreError::AccessRefused(_)), "{e:?}");
    }
    assert!(b.vhost("/").unwrap().txn().is_pending("p1"));
    assert!(bodies(&guest, "o").is_empty());
    wait(resolve(&guest, "commit", "p1").unwrap());
    assert_eq!(bodies(&guest, "o"), ["guarded"]);
}

#[test]
fn unresolved_half_messages_get_checks_at_their_reply_to_then_are_rolled_back() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TxnConfig {
        check_timeout: Duration::from_millis(100),
        check_max: 2,
    };
    let clock = Clock::manual();
    let b = open_clocked(dir.path(), cfg, clock.clone());
    topology(&b);
    let link = login(&b, "guest");
    wait(half(&link, "c1", "unanswered").unwrap());
    let mut checks = Vec::new();
    eventually_blocking(
        "two checks and the rollback",
        Duration::from_secs(10),
        || {
            // each look is one check timeout later
            clock.advance(cfg.check_timeout);
            b.tick();
            while let Some(d) = link.get("replies", true).unwrap() {
                checks.push(d);
            }
            !b.vhost("/").unwrap().txn().is_pending("c1")
        },
    );
    while let Some(d) = link.get("replies", true).unwrap() {
        checks.push(d);
    }
    assert_eq!(checks.len(), 2, "check_max checks, then the rollback");
    for (i, d) in checks.iter().enumerate() {
        let h = d.properties.headers.as_ref().unwrap();
        assert_eq!(h.get_str(TXN_HEADER), Some("check"));
        assert_eq!(h.get_i64("x-txn-check-count"), Some(i as i64 + 1));
        assert_eq!(h.get_str("x-txn-exchange"), Some("orders"));
        assert_eq!(h.get_str("x-txn-routing-key"), Some("order.new"));
        assert_eq!(d.properties.message_id.as_deref(), Some("c1"));
        assert!(d.body.is_empty());
    }
    assert!(matches!(
        resolve(&link, "commit", "c1").unwrap_err(),
        CoreError::NotFound { .. }
    ));
    assert!(bodies(&link, "o").is_empty());
}

#[test]
fn a_reopen_keeps_pending_half_messages_and_resolutions() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path(), TxnConfig::default());
        topology(&b);
        let link = login(&b, "guest");
        for id in ["keep", "commit", "rollback"] {
            wait(half(&link, id, id).unwrap());
        }
        wait(resolve(&link, "commit", "commit").unwrap());
        wait(resolve(&link, "rollback", "rollback").unwrap());
        // left unconsumed: the committed message must come back once, not twice
        let store = b.store().clone();
        drop(link);
        drop(b);
        drop(store);
    }
    let b = open(dir.path(), TxnConfig::default());
    let link = login(&b, "guest");
    let t = b.vhost("/").unwrap();
    assert!(t.txn().is_pending("keep"));
    assert_eq!(t.txn().pending(), 1);
    assert_eq!(bodies(&link, "o"), ["commit"]);
    wait(resolve(&link, "commit", "keep").unwrap());
    assert_eq!(bodies(&link, "o"), ["keep"]);
}

#[test]
fn a_commit_whose_copy_was_stored_but_not_its_ack_is_not_offered_again() {
    let dir = tempfile::tempdir().unwrap();
    {
        let b = open(dir.path(), TxnConfig::default());
        topology(&b);
        let link = login(&b, "guest");
        wait(half(&link, "torn", "once").unwrap());
        // what a commit writes before its ack: the routed copy, indexed under the
        // half entry's commit key (here straight into the store, as if the broker died
        // before the ack)
        let store = b.store().clone();
        let half_q = store.find_queue("/", HALF_QUEUE).unwrap();
        let o = store.find_queue("/", "o").unwrap();
        let key = commit_key(half_q, 0);
        let keys: [&[u8]; 1] = [&key];
        let props = Properties {
            delivery_mode: Some(2),
            ..Properties::default()
        };
        let env = triad_core::envelope::encode("orders", "order.new", &props).unwrap();
        store
            .append(&NewMessage {
                queues: &[o],
                flags: FLAG_PERSISTENT,
                born_ts_ms: 1,
                // the core's consume-queue tag: body length 4, persistent (bit 41)
                tag_hash: 4 | 1 << 41,
                keys: &keys,
                properties: &env,
                body: b"once",
            })
            .unwrap()
            .durable
            .wait()
            .unwrap();
        drop(link);
        drop(b);
        drop(store);
    }
    let b = open(dir.path(), TxnConfig::default());
    let link = login(&b, "guest");
    assert!(!b.vhost("/").unwrap().txn().is_pending("torn"));
    assert_eq!(bodies(&link, "o"), ["once"]);
    assert!(matches!(
        resolve(&link, "commit", "torn").unwrap_err(),
        CoreError::NotFound { .. }
    ));
}

#[test]
fn a_delayed_half_message_is_refused_naming_the_header() {
    // a half message is delivered when committed: x-delay would be silently ignored
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), TxnConfig::default());
    topology(&b);
    let link = login(&b, "guest");
    for (name, value) in [("x-delay", 5_000i64), ("x-delay-level", 3)] {
        let mut props = txn_props("half", Some("d"));
        if let Some(h) = props.headers.as_mut() {
            h.insert(name, value);
        }
        match link.publish(Publish {
            exchange: "orders".into(),
            routing_key: "order.new".into(),
            properties: props,
            body: Bytes::from_static(b"later"),
            ..Default::default()
        }) {
            Err(CoreError::PreconditionFailed(m)) => assert!(m.contains(name), "{m}"),
            other => panic!("expected a precondition failure naming {name}: {other:?}"),
        }
    }
    assert_eq!(b.vhost("/").unwrap().txn().pending(), 0);
}

#[test]
fn the_shared_publish_entry_takes_half_messages_and_commits() {
    // what the management API's publish calls: x-txn is not accepted and ignored there
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), TxnConfig::default());
    topology(&b);
    let v = b.vhost("/").unwrap();
    let access = triad_core::VhostAccess::full("guest", "/");
    let p = triad_core::txn::publish(
        &v,
        &access,
        Publish {
            exchange: "orders".into(),
            routing_key: "order.new".into(),
            properties: txn_props("half", Some("api")),
            body: Bytes::from_static(b"from the api"),
            ..Default::default()
        },
    )
    .unwrap();
    wait(p);
    assert!(v.txn().is_pending("api"));
    let link = login(&b, "guest");
    assert!(bodies(&link, "o").is_empty());
    let p = triad_core::txn::publish(
        &v,
        &access,
        Publish {
            exchange: TXN_EXCHANGE.into(),
            properties: txn_props("commit", Some("api")),
            ..Default::default()
        },
    )
    .unwrap();
    wait(p);
    assert_eq!(bodies(&link, "o"), ["from the api"]);
}

#[test]
fn a_half_messages_check_count_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = TxnConfig {
        check_timeout: Duration::from_millis(100),
        check_max: 3,
    };
    let clock = Clock::manual();
    let collect = |b: &Broker, link: &Link, until: &dyn Fn(&[i64]) -> bool| {
        let mut seen = Vec::new();
        eventually_blocking("checks", Duration::from_secs(10), || {
            // each look is one check timeout later
            clock.advance(cfg.check_timeout);
            b.tick();
            while let Some(d) = link.get("replies", true).unwrap() {
                let h = d.properties.headers.as_ref().unwrap();
                seen.push(h.get_i64("x-txn-check-count").unwrap());
            }
            until(&seen)
        });
        seen
    };
    {
        let b = open_clocked(dir.path(), cfg, clock.clone());
        topology(&b);
        let link = login(&b, "guest");
        wait(half(&link, "h", "unanswered").unwrap());
        let seen = collect(&b, &link, &|s| s.len() >= 2);
        assert_eq!(seen, [1, 2]);
        let store = b.store().clone();
        drop(link);
        drop(b);
        drop(store);
    }
    let b = open_clocked(dir.path(), cfg, clock.clone());
    let link = login(&b, "guest");
    assert!(b.vhost("/").unwrap().txn().is_pending("h"));
    let seen = collect(&b, &link, &|_| !b.vhost("/").unwrap().txn().is_pending("h"));
    let mut seen = seen;
    while let Some(d) = link.get("replies", true).unwrap() {
        seen.push(
            d.properties
                .headers
                .as_ref()
                .unwrap()
                .get_i64("x-txn-check-count")
                .unwrap(),
        );
    }
    assert_eq!(seen, [3], "the third and last check, then the rollback");
    assert!(bodies(&link, "o").is_empty());
    // the rollback forgot the stored count
    let left = b.store().journal().scan(b"R").unwrap();
    assert!(left.is_empty(), "{left:?}");
}
