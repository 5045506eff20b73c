//! Delayed delivery: a message published with `x-delay` (ms) or `x-delay-level`
//! (RocketMQ's 18 levels) is routed through its exchange when it is due, as RabbitMQ's
//! delayed-message plugin does.
//!
//! Storage: the message is appended once to the commitlog, with one consume-queue entry
//! in the vhost's delay queue ([`DELAY_QUEUE`], a store queue no client can address)
//! whose tag is its due time. The publish is confirmed once that append is fsynced, so
//! a confirmed delayed message survives a kill -9. The wheel that finds the messages
//! due next is [`triad_store::timer::TimerLog`]: memory per pending second, not per
//! message; it is rebuilt from the delay queue's entries at start.
//!
//! Scheduling: one thread per vhost that has a delay queue sleeps until the next due
//! time (woken early when an earlier message arrives), takes the due messages, routes
//! each through the exchange it was published to (as it is then: an exchange deleted in
//! the meantime drops it, as does a message that routes nowhere) and acks its delay-queue
//! entry after the routed copy is appended (the log is ordered, so a crash in between
//! delivers it again rather than losing it). A routed copy is a second commitlog record
//! of the body.

use std::collections::BTreeSet;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::{QueueId, Store};
use triad_store::timer::TimerLog;

use crate::error::CoreError;
use crate::message::Properties;
use crate::queue::now_ms;
use crate::value::{FieldTable, FieldValue};
use crate::vhost::Vhost;

/// The store queue that holds a vhost's delayed messages.
pub const DELAY_QUEUE: &str = "amq.triad.delayed";

/// RocketMQ's delay levels 1-18: 1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h.
pub const LEVELS_MS: [u64; 18] = [
    1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 180_000, 240_000, 300_000, 360_000, 420_000,
    480_000, 540_000, 600_000, 1_200_000, 1_800_000, 3_600_000, 7_200_000,
];

/// The longest delay: 2^32 - 1 ms (about 49.7 days), the delayed-message plugin's limit.
pub const MAX_DELAY_MS: u64 = u32::MAX as u64;

fn integer(v: &FieldValue) -> Option<i64> {
    // AMQP clients send any integer type; STOMP headers arrive as strings
    v.as_i64()
        .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
}

fn bad(header: &str, why: String) -> CoreError {
    CoreError::PreconditionFailed(format!("invalid {header} header: {why}"))
}

/// The delay (ms) a message's headers ask for: `x-delay` (ms; 0 or less: none, as the
/// plugin) or else `x-delay-level` (1-18). `None`: deliver now.
pub fn requested_delay(headers: Option<&FieldTable>) -> Result<Option<u64>, CoreError> {
    let Some(h) = headers else {
        return Ok(None);
    };
    if let Some(v) = h.get("x-delay") {
        let n =
            integer(v).ok_or_else(|| bad("x-delay", format!("{v:?} is not an integer (ms)")))?;
        if n > MAX_DELAY_MS as i64 {
            return Err(bad(
                "x-delay",
                format!("{n} ms is longer than the longest delay, {MAX_DELAY_MS} ms"),
            ));
        }
        return Ok((n > 0).then_some(n as u64));
    }
    if let Some(v) = h.get("x-delay-level") {
        let level = integer(v).unwrap_or(0);
        return match usize::try_from(level).ok().and_then(|l| l.checked_sub(1)) {
            Some(i) if i < LEVELS_MS.len() => Ok(LEVELS_MS.get(i).copied()),
            _ => Err(bad(
                "x-delay-level",
                format!("{v:?} is not a level from 1 to 18"),
            )),
        };
    }
    Ok(None)
}

/// The kind of an exchange declared with type `kind` and `arguments`: the type itself,
/// or for the delayed-message plugin's type `x-delayed-message` the kind its
/// `x-delayed-type` argument names (such an exchange routes as that kind; what delays a
/// message is its `x-delay` header, on this exchange as on any other).
pub fn exchange_kind(
    kind: &str,
    arguments: &FieldTable,
) -> Result<crate::routing::ExchangeKind, CoreError> {
    if kind != "x-delayed-message" {
        return kind.parse();
    }
    arguments
        .get("x-delayed-type")
        .and_then(|v| v.as_str())
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| {
            // the plugin's words
            CoreError::PreconditionFailed(
                "Invalid argument, 'x-delayed-type' must be an existing exchange type".into(),
            )
        })
}

/// Marks a due message's headers as the delayed-message plugin does on delivery: a
/// positive `x-delay` becomes its negative (which [`requested_delay`] reads as "now"), so
/// republishing the message with the same headers does not delay it again. An
/// `x-delay-level` is left as it is.
pub(crate) fn mark_fired(props: &mut Properties) {
    let Some(h) = props.headers.as_mut() else {
        return;
    };
    let Some(v) = h.get("x-delay") else {
        return;
    };
    let Some(n) = integer(v).filter(|n| *n > 0) else {
        return;
    };
    let neg = match v {
        // STOMP headers are strings
        FieldValue::ShortString(_) | FieldValue::LongString(_) => {
            FieldValue::from((-n).to_string())
        }
        FieldValue::I64(_) => FieldValue::I64(-n),
        _ => i32::try_from(-n).map_or(FieldValue::I64(-n), FieldValue::I32),
    };
    h.insert("x-delay", neg);
}

/// How long a due message whose routing failed waits before it is tried again.
const RETRY_MS: u64 = 1_000;

/// How far ahead of its start a slot of the wheel is read into memory (one slot: at
/// most two seconds of due messages are held in `soon`).
const LOOKAHEAD_MS: u64 = triad_store::timer::SLOT_MS;

/// The scheduler wakes at least this often, to notice its vhost going away.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// What [`Delayed::take_due`] found.
struct Due {
    /// The due messages' queue offsets.
    offsets: Vec<u64>,
    /// When to look next (ms).
    next: u64,
    /// The wheel's epoch when `next` was computed.
    epoch: u64,
}

struct Wheel {
    log: TimerLog,
    /// The messages of the slots already started or starting within [`LOOKAHEAD_MS`],
    /// until each is due: (due, id).
    soon: BTreeSet<(u64, u64)>,
    /// Bumped by every add due before [`Wheel::next_wake`], so the scheduler does not
    /// sleep past a new earlier one.
    epoch: u64,
    /// When the scheduler wakes next (ms; set by [`Delayed::take_due`]): an add due
    /// later needs no wake-up.
    next_wake: u64,
    /// The delay queue was deleted with its vhost ([`Delayed::remove`]).
    removed: bool,
}

/// A vhost's delayed messages: the delay queue and its wheel.
pub(crate) struct Delayed {
    qid: QueueId,
    path: std::path::PathBuf,
    wheel: Mutex<Wheel>,
    wake: Condvar,
    /// The broker's clock: due times are by it.
    clock: crate::Clock,
}

impl std::fmt::Debug for Delayed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delayed").field("queue", &self.qid).finish()
    }
}

impl Delayed {
    /// The vhost's delay queue and wheel: `None` when it has none and `create` is false.
    /// The wheel is refilled from the queue's pending entries.
    pub(crate) fn open(
        store: &Store,
        vhost: &str,
        create: bool,
        clock: &crate::Clock,
    ) -> Result<Option<Arc<Delayed>>, CoreError> {
        let qid = match store.find_queue(vhost, DELAY_QUEUE) {
            Some(id) => id,
            None if create => store.create_queue(vhost, DELAY_QUEUE, true)?,
            None => return Ok(None),
        };
        let path = store.dir().join("timer").join(format!("{qid}.log"));
        let d = Delayed {
            qid,
            wheel: Mutex::new(Wheel {
                log: TimerLog::create(&path)?,
                soon: BTreeSet::new(),
                epoch: 0,
                next_wake: 0,
                removed: false,
            }),
            path,
            wake: Condvar::new(),
            clock: clock.clone(),
        };
        d.refill(store)?;
        let d = Arc::new(d);
        // a manual clock moved forward: the scheduler looks at the wheel again
        let weak = Arc::downgrade(&d);
        clock.on_advance(move || {
            if let Some(d) = weak.upgrade() {
                d.lock().epoch += 1;
                d.wake.notify_all();
            }
        });
        Ok(Some(d))
    }

    fn lock(&self) -> MutexGuard<'_, Wheel> {
        self.wheel.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rebuilds the wheel from the queue's pending entries (at open, and when the timer
    /// log is mostly dead).
    fn refill(&self, store: &Store) -> Result<(), CoreError> {
        let mut w = self.lock();
        if w.removed {
            return Ok(());
        }
        w.log = TimerLog::create(&self.path)?;
        w.soon.clear();
        const BATCH: usize = 1 << 16;
        let mut from = 0;
        loop {
            let pending = store.unacked_from(self.qid, from, BATCH)?;
            let Some(&last) = pending.last() else {
                break;
            };
            // one write per batch, not one per message
            let items: Vec<(u64, u64)> = pending
                .iter()
                .filter_map(|off| store.entry(self.qid, *off).map(|e| (e.tag_hash, *off)))
                .collect();
            w.log.add_all(&items)?;
            if pending.len() < BATCH {
                break;
            }
            from = last + 1;
        }
        w.epoch += 1;
        w.next_wake = 0;
        Ok(())
    }

    pub(crate) fn queue_id(&self) -> QueueId {
        self.qid
    }

    /// Stores a message due in `delay_ms` and adds it to the wheel. The returned append
    /// is durable once its handle completes.
    pub(crate) fn store(
        &self,
        store: &Store,
        exchange: &str,
        routing_key: &str,
        props: &Properties,
        body: &Bytes,
        delay_ms: u64,
    ) -> Result<triad_store::store::Appended, CoreError> {
        let due = self.clock.now_ms().saturating_add(delay_ms);
        let env = crate::envelope::encode(exchange, routing_key, props)?;
        let appended = store.append(&NewMessage {
            queues: &[self.qid],
            flags: if props.delivery_mode == Some(2) {
                FLAG_PERSISTENT
            } else {
                0
            },
            born_ts_ms: now_ms(),
            tag_hash: due,
            keys: &[],
            properties: &env,
            body,
        })?;
        let off = appended
            .queue_offsets
            .first()
            .map(|(_, o)| *o)
            .ok_or_else(|| CoreError::Internal("delayed append without an entry".into()))?;
        let mut w = self.lock();
        if w.removed {
            return Err(CoreError::Internal("the delay queue was deleted".into()));
        }
        w.log.add(due, off)?;
        if due < w.next_wake {
            w.next_wake = due;
            w.epoch += 1;
            drop(w);
            self.wake.notify_all();
        }
        Ok(appended)
    }

    /// Takes the messages due at `now` (their queue offsets) and says when to look
    /// next (at the latest `now` + [`MAX_SLEEP`]) and the wheel's epoch then, for
    /// [`Delayed::sleep`]: read under the same lock, so an add right after is not missed.
    fn take_due(&self, now: u64) -> Result<Due, CoreError> {
        let mut w = self.lock();
        if w.removed {
            return Ok(Due {
                offsets: Vec::new(),
                next: now.saturating_add(MAX_SLEEP.as_millis() as u64),
                epoch: w.epoch,
            });
        }
        // the next slot is read a slot ahead of its start, so its messages are in
        // `soon` (sorted) when the first of them is due, not read back then
        let ahead = now.saturating_add(LOOKAHEAD_MS);
        if w.log.next_slot_ms().is_some_and(|t| t <= ahead) {
            for rec in w.log.take_started(ahead)? {
                w.soon.insert(rec);
            }
        }
        let mut due = Vec::new();
        while let Some(&(t, id)) = w.soon.first() {
            if t > now {
                break;
            }
            w.soon.pop_first();
            due.push(id);
        }
        let read_next = w.log.next_slot_ms().map(|t| t.saturating_sub(LOOKAHEAD_MS));
        let next = match (w.soon.first().map(|r| r.0), read_next) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b).unwrap_or(u64::MAX),
        }
        .min(now.saturating_add(MAX_SLEEP.as_millis() as u64));
        w.next_wake = next;
        Ok(Due {
            offsets: due,
            next,
            epoch: w.epoch,
        })
    }

    /// Puts messages taken by [`Delayed::take_due`] but not routed back in the wheel,
    /// due again in a second (their delay-queue entries are still unacked).
    pub(crate) fn retry(&self, offsets: &[u64]) -> Result<(), CoreError> {
        if offsets.is_empty() {
            return Ok(());
        }
        let due = self.clock.now_ms().saturating_add(RETRY_MS);
        let items: Vec<(u64, u64)> = offsets.iter().map(|off| (due, *off)).collect();
        let mut w = self.lock();
        if w.removed {
            return Ok(());
        }
        w.log.add_all(&items)?;
        if due < w.next_wake {
            w.next_wake = due;
            w.epoch += 1;
        }
        Ok(())
    }

    /// Messages waiting for their time.
    pub(crate) fn pending(&self) -> u64 {
        let w = self.lock();
        if w.removed {
            return 0;
        }
        w.log.pending() + w.soon.len() as u64
    }

    /// The delay queue is being deleted (with its vhost): forgets the wheel and removes
    /// the timer log's file. The scheduler finds nothing due from now on (it ends with
    /// the vhost).
    pub(crate) fn remove(&self) {
        let mut w = self.lock();
        w.removed = true;
        w.soon.clear();
        if let Err(e) = std::fs::remove_file(&self.path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(path = %self.path.display(), error = %e, "removing a timer log failed");
            }
        }
        w.epoch += 1;
        drop(w);
        self.wake.notify_all();
    }

    fn wants_rebuild(&self) -> bool {
        self.lock().log.wants_rebuild()
    }

    /// Sleeps until `until` (ms), or until a message due earlier is added since the
    /// wheel was at `epoch`.
    fn sleep(&self, until: u64, epoch: u64) {
        let w = self.lock();
        let wait = Duration::from_millis(until.saturating_sub(self.clock.now_ms())).min(MAX_SLEEP);
        if wait.is_zero() || w.epoch != epoch {
            return;
        }
        let _ = self
            .wake
            .wait_timeout_while(w, wait, |w| w.epoch == epoch)
            .map_err(|e| e.into_inner());
    }
}

/// Starts the scheduler thread of `vh`'s delayed messages. It holds the vhost weakly and
/// ends once the vhost is gone.
pub(crate) fn spawn(vh: &Arc<Vhost>, d: Arc<Delayed>) {
    let weak: Weak<Vhost> = Arc::downgrade(vh);
    let name = vh.name().to_string();
    let run = move || loop {
        let Some(vh) = weak.upgrade() else {
            return;
        };
        let (next, epoch) = match d.take_due(d.clock.now_ms()) {
            Ok(due) => {
                if !due.offsets.is_empty() {
                    let left = vh.fire_delayed(&d, &due.offsets);
                    if let Err(e) = d.retry(&left) {
                        // they stay unacked in the delay queue: the next start routes them
                        tracing::warn!(vhost = %name, error = %e, "re-adding delayed messages failed");
                    }
                }
                if d.wants_rebuild() {
                    if let Err(e) = d.refill(vh.store()) {
                        tracing::warn!(vhost = %name, error = %e, "rebuilding the timer log failed");
                    }
                }
                (due.next, due.epoch)
            }
            Err(e) => {
                // the timer log is derived data: rebuild it from the queue
                tracing::warn!(vhost = %name, error = %e, "timer log unreadable; rebuilding it");
                if let Err(e) = d.refill(vh.store()) {
                    tracing::error!(vhost = %name, error = %e, "rebuilding the timer log failed");
                }
                (d.clock.now_ms().saturating_add(RETRY_MS), d.lock().epoch)
            }
        };
        drop(vh);
        // wakes at least every MAX_SLEEP to notice the vhost going away
        d.sleep(next, epoch);
    };
    if let Err(e) = std::thread::Builder::new()
        .name("triad-delayed".into())
        .spawn(run)
    {
        tracing::error!(error = %e, "could not start the delayed-message scheduler");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(k: &str, v: FieldValue) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert(k, v);
        t
    }

    #[test]
    fn delays_are_read_from_headers() {
        assert_eq!(requested_delay(None).unwrap(), None);
        assert_eq!(
            requested_delay(Some(&h("x-delay", FieldValue::I32(1500)))).unwrap(),
            Some(1500)
        );
        // STOMP: a string
        assert_eq!(
            requested_delay(Some(&h("x-delay", FieldValue::from(" 250 ")))).unwrap(),
            Some(250)
        );
        assert_eq!(
            requested_delay(Some(&h("x-delay", FieldValue::I64(-5)))).unwrap(),
            None
        );
        assert_eq!(
            requested_delay(Some(&h("x-delay-level", FieldValue::I32(3)))).unwrap(),
            Some(10_000)
        );
        assert_eq!(
            requested_delay(Some(&h("x-delay-level", FieldValue::from("18")))).unwrap(),
            Some(7_200_000)
        );
        for (k, v) in [
            ("x-delay", FieldValue::from("soon")),
            ("x-delay", FieldValue::I64(MAX_DELAY_MS as i64 + 1)),
            ("x-delay-level", FieldValue::I32(0)),
            ("x-delay-level", FieldValue::I32(19)),
            ("x-delay-level", FieldValue::from("x")),
        ] {
            match requested_delay(Some(&h(k, v))) {
                Err(CoreError::PreconditionFailed(m)) => assert!(m.contains(k), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_fired_delay_is_negative_in_the_type_it_came_in() {
        for (v, want) in [
            (FieldValue::I32(1500), FieldValue::I32(-1500)),
            (FieldValue::I64(1500), FieldValue::I64(-1500)),
            (
                FieldValue::U32(u32::MAX),
                FieldValue::I64(-i64::from(u32::MAX)),
            ),
            (FieldValue::from("250"), FieldValue::from("-250")),
            // not delayed: left alone
            (FieldValue::I32(-7), FieldValue::I32(-7)),
        ] {
            let mut p = Properties {
                headers: Some(h("x-delay", v)),
                ..Default::default()
            };
            mark_fired(&mut p);
            let got = p.headers.as_ref().and_then(|t| t.get("x-delay")).cloned();
            assert_eq!(got, Some(want.clone()));
            assert_eq!(requested_delay(p.headers.as_ref()).unwrap(), None);
        }
    }

    /// A store on a temporary directory (kept alive by the first value) and vhost `/`'s
    /// delay queue in it.
    fn open_delayed() -> (tempfile::TempDir, triad_store::store::Store, Arc<Delayed>) {
        let dir = tempfile::tempdir().unwrap();
        let mut sc = triad_store::store::StoreConfig::new(dir.path());
        sc.segment_size = 1 << 20;
        let store = triad_store::store::Store::open(sc).unwrap();
        let d = Delayed::open(&store, "/", true, &crate::Clock::system())
            .unwrap()
            .unwrap();
        (dir, store, d)
    }

    #[test]
    fn a_message_not_routed_is_due_again_a_second_later() {
        let (_dir, store, d) = open_delayed();
        let body = Bytes::from_static(b"m");
        d.store(&store, "", "q", &Properties::default(), &body, 0)
            .unwrap();
        let now = now_ms();
        let due = d.take_due(now).unwrap().offsets;
        assert_eq!(due.len(), 1);
        assert_eq!(d.pending(), 0);
        d.retry(&due).unwrap();
        assert_eq!(d.pending(), 1);
        assert!(d.take_due(now).unwrap().offsets.is_empty(), "not at once");
        let again = d.take_due(now_ms() + RETRY_MS + 1).unwrap().offsets;
        assert_eq!(again, due);
    }

    #[test]
    fn an_add_wakes_the_scheduler_only_when_due_before_its_wake() {
        let (_dir, store, d) = open_delayed();
        let body = Bytes::from_static(b"m");
        let props = Properties::default();
        d.store(&store, "", "q", &props, &body, 60_000).unwrap();
        let now = now_ms();
        let t = d.take_due(now).unwrap();
        assert!(t.offsets.is_empty());
        assert!(
            t.next <= now + MAX_SLEEP.as_millis() as u64,
            "wakes within a second"
        );
        // later than the wake: no wake-up
        d.store(&store, "", "q", &props, &body, 30_000).unwrap();
        assert_eq!(d.lock().epoch, t.epoch);
        // an add between take_due and sleep that is due earlier: the sleep returns
        d.store(&store, "", "q", &props, &body, 0).unwrap();
        assert_ne!(d.lock().epoch, t.epoch);
        let started = std::time::Instant::now();
        d.sleep(t.next, t.epoch);
        assert!(started.elapsed() < Duration::from_millis(500));
        assert_eq!(d.take_due(now_ms()).unwrap().offsets.len(), 1);
    }

    #[test]
    fn removing_the_delay_queue_removes_its_timer_log() {
        let (_dir, store, d) = open_delayed();
        let body = Bytes::from_static(b"m");
        d.store(&store, "", "q", &Properties::default(), &body, 0)
            .unwrap();
        assert!(d.path.exists());
        d.remove();
        assert!(!d.path.exists());
        assert_eq!(d.pending(), 0);
        assert!(d.take_due(now_ms() + 10_000).unwrap().offsets.is_empty());
    }
}
