//! Dead-lettering: a message leaving the queue (expired, rejected, over a limit) goes to
//! the dead-letter exchange, with RabbitMQ's `x-death` bookkeeping.

use bytes::Bytes;

use super::{After, Entry, Queue};
use crate::message::Properties;
use crate::value::{FieldTable, FieldValue};

impl Queue {
    /// A ready entry leaves the queue without a consumer: dead-letter it if configured.
    pub(super) fn drop_entry(&self, off: u64, e: Entry, reason: &'static str, after: &mut After) {
        if e.count_stored {
            after.forget.push(off);
        }
        if self.args().dead_letter_exchange.is_some() {
            if let Ok(rec) = self.store.read_entry(self.id, off, e.commit_offset) {
                after.dead.push((off, rec, reason));
                return;
            }
        }
        after.acks.push(off);
    }

    /// Dead-letter routing for a message leaving this queue, with RabbitMQ's `x-death`
    /// bookkeeping; `None` when there is no dead-letter exchange or the message would
    /// cycle (already expired out of this queue before).
    ///
    /// `own_deaths`: the message was stored by an earlier dead-lettering, so its `x-death`
    /// is the broker's. Otherwise a client published it, and any `x-death` and
    /// `x-first-death-*` headers it set are replaced, not read (as RabbitMQ 4, which
    /// keeps deaths apart from client headers): a forged record could otherwise make a
    /// message look like a cycle and be dropped, or inflate its counts.
    pub(crate) fn dead_letter_target(
        &self,
        reason: &str,
        exchange: &str,
        routing_key: &str,
        props: &mut Properties,
        own_deaths: bool,
    ) -> Option<(String, String)> {
        let dlx = self.args().dead_letter_exchange.clone()?;
        let mut headers = props.headers.take().unwrap_or_default();
        if !own_deaths {
            for k in [
                "x-death",
                "x-first-death-reason",
                "x-first-death-queue",
                "x-first-death-exchange",
            ] {
                headers.remove(k);
            }
        }
        let mut deaths: Vec<FieldValue> = headers
            .get("x-death")
            .and_then(|v| v.as_array())
            .map(|a| a.to_vec())
            .unwrap_or_default();
        let same = |t: &FieldTable| {
            t.get_str("queue") == Some(self.name.as_str()) && t.get_str("reason") == Some(reason)
        };
        let existing = deaths.iter().position(|d| d.as_table().is_some_and(&same));
        let any_rejected = deaths.iter().any(|d| {
            d.as_table()
                .is_some_and(|t| t.get_str("reason") == Some("rejected"))
        });
        if reason != "rejected" && existing.is_some() && !any_rejected {
            // it left this queue for the same reason before and no client rejected it
            // on the way: a dead-letter cycle, which RabbitMQ breaks by dropping it
            props.headers = Some(headers);
            return None;
        }
        let mut entry = match existing {
            Some(i) => {
                let t = deaths.remove(i);
                t.as_table().cloned().unwrap_or_default()
            }
            None => FieldTable::default(),
        };
        let count = entry.get_i64("count").unwrap_or(0) + 1;
        entry.insert("count", FieldValue::I64(count));
        entry.insert(
            "reason",
            FieldValue::LongString(Bytes::from(reason.to_string())),
        );
        entry.insert(
            "queue",
            FieldValue::LongString(Bytes::from(self.name.clone())),
        );
        entry.insert("time", FieldValue::Timestamp(self.clock.now_ms() / 1000));
        entry.insert(
            "exchange",
            FieldValue::LongString(Bytes::from(exchange.to_string())),
        );
        entry.insert(
            "routing-keys",
            FieldValue::Array(vec![FieldValue::LongString(Bytes::from(
                routing_key.to_string(),
            ))]),
        );
        if let Some(exp) = props.expiration.take() {
            entry.insert(
                "original-expiration",
                FieldValue::LongString(Bytes::from(exp)),
            );
        }
        deaths.insert(0, FieldValue::Table(entry));
        headers.insert("x-death", FieldValue::Array(deaths));
        for (k, v) in [
            ("x-first-death-reason", reason),
            ("x-first-death-queue", self.name.as_str()),
            ("x-first-death-exchange", exchange),
        ] {
            if headers.get(k).is_none() {
                headers.insert(k, FieldValue::LongString(Bytes::from(v.to_string())));
            }
        }
        props.headers = Some(headers);
        let key = self
            .args()
            .dead_letter_routing_key
            .clone()
            .unwrap_or_else(|| routing_key.to_string());
        Some((dlx, key))
    }
}
