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

struct Wheel {
    log: TimerLog,
    /// The messages of the slots already started, until each is due: (due, id).
    soon: BTreeSet<(u64, u64)>,
    /// Bumped by every add, so the scheduler does not sleep past a new earlier one.
    epoch: u64,
}

/// A vhost's delayed messages: the delay queue and its wheel.
pub(crate) struct Delayed {
    qid: QueueId,
    path: std::path::PathBuf,
    wheel: Mutex<Wheel>,
    wake: Condvar,
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
            }),
            path,
            wake: Condvar::new(),
        };
        d.refill(store)?;
        Ok(Some(Arc::new(d)))
    }

    fn lock(&self) -> MutexGuard<'_, Wheel> {
        self.wheel.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rebuilds the wheel from the queue's pending entries (at open, and when the timer
    /// log is mostly dead).
    fn refill(&self, store: &Store) -> Result<(), CoreError> {
        let mut w = self.lock();
        w.log = TimerLog::create(&self.path)?;
        w.soon.clear();
        const BATCH: usize = 1 << 16;
        let mut from = 0;
        loop {
            let pending = store.unacked_from(self.qid, from, BATCH)?;
            let Some(&last) = pending.last() else {
                break;
            };
            for off in &pending {
                if let Some(e) = store.entry(self.qid, *off) {
                    w.log.add(e.tag_hash, *off)?;
                }
            }
            if pending.len() < BATCH {
                break;
            }
            from = last + 1;
        }
        w.epoch += 1;
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
        let due = now_ms().saturating_add(delay_ms);
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
        w.log.add(due, off)?;
        w.epoch += 1;
        drop(w);
        self.wake.notify_all();
        Ok(appended)
    }

    /// Takes the messages due at `now` (their queue offsets) and says when to look
    /// next.
    fn take_due(&self, now: u64) -> Result<(Vec<u64>, Option<u64>), CoreError> {
        let mut w = self.lock();
        if w.log.next_slot_ms().is_some_and(|t| t <= now) {
            for rec in w.log.take_started(now)? {
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
        let next = match (w.soon.first().map(|r| r.0), w.log.next_slot_ms()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Ok((due, next))
    }

    /// Messages waiting for their time.
    pub(crate) fn pending(&self) -> u64 {
        let w = self.lock();
        w.log.pending() + w.soon.len() as u64
    }

    fn wants_rebuild(&self) -> bool {
        self.lock().log.wants_rebuild()
    }

    /// Sleeps until `until` (ms), at most `max`, or until a message is added.
    fn sleep(&self, until: Option<u64>, max: Duration) {
        let w = self.lock();
        let epoch = w.epoch;
        let now = now_ms();
        let wait = until
            .map(|t| Duration::from_millis(t.saturating_sub(now)))
            .unwrap_or(max)
            .min(max);
        if wait.is_zero() {
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
        let next = match d.take_due(now_ms()) {
            Ok((due, next)) => {
                if !due.is_empty() {
                    vh.fire_delayed(&d, &due);
                }
                if d.wants_rebuild() {
                    if let Err(e) = d.refill(vh.store()) {
                        tracing::warn!(vhost = %name, error = %e, "rebuilding the timer log failed");
                    }
                }
                next
            }
            Err(e) => {
                // the timer log is derived data: rebuild it from the queue
                tracing::warn!(vhost = %name, error = %e, "timer log unreadable; rebuilding it");
                if let Err(e) = d.refill(vh.store()) {
                    tracing::error!(vhost = %name, error = %e, "rebuilding the timer log failed");
                }
                None
            }
        };
        drop(vh);
        // wakes at least every second to notice the vhost going away
        d.sleep(next, Duration::from_secs(1));
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
}
