//! Returned messages: delivery counts (`x-delivery-count`, `x-delivery-limit`) and the
//! `x-retry-backoff` wait (parked entries).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use triad_store::returns::Returned;

use super::tag::{tag_len, TAG_PERSISTENT};
use super::{lock, After, Entry, Queue, QueueArgs, State, MAX_DELIVERY_LIMIT};
use crate::message::Properties;
use crate::value::FieldValue;

/// `props` with the `x-delivery-count` header (RabbitMQ's quorum queues: absent on the
/// first delivery, the number of returns on each redelivery), replacing any a client set.
pub(super) fn with_delivery_count(props: &Properties, returns: u16) -> Arc<Properties> {
    let mut p = props.clone();
    let mut h = p.headers.take().unwrap_or_default();
    h.remove("x-delivery-count");
    h.insert("x-delivery-count", FieldValue::I64(i64::from(returns)));
    p.headers = Some(h);
    Arc::new(p)
}

impl Queue {
    /// Requeued entry `e` (queue offset `off`, `stored` as it was before this return)
    /// counts one return more. Past `x-delivery-limit` it is dead-lettered or dropped;
    /// with `x-retry-backoff` it is parked until its step is over; either way it is not
    /// ready now (`false`). `true`: it goes back to the ready window.
    pub(super) fn count_return(
        &self,
        st: &mut State,
        off: u64,
        stored: Entry,
        e: &mut Entry,
        after: &mut After,
    ) -> bool {
        e.returns = e.returns.saturating_add(1);
        if st
            .args
            .delivery_limit
            // (a policy's limit is not capped where it is read)
            .is_some_and(|l| u64::from(e.returns) > l.min(MAX_DELIVERY_LIMIT))
        {
            // `stored`: its count as stored (if it was)
            self.drop_entry(off, stored, "delivery_limit", after);
            return false;
        }
        let ready_at = st.args.retry_backoff.as_ref().map(|steps| {
            let i = (e.returns as usize).saturating_sub(1);
            let wait = steps.get(i).or(steps.last()).copied().unwrap_or(0);
            self.clock.now_ms().saturating_add(wait)
        });
        if self.store_count(&st.args, e) {
            e.count_stored = true;
            after.counted.push(Returned {
                offset: off,
                count: u32::from(e.returns),
                ready_at_ms: ready_at.unwrap_or(0),
            });
        }
        if let Some(at) = ready_at {
            st.parked
                .get_or_insert_with(Default::default)
                .insert((at, off), *e);
            self.tick_wanted.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Whether `e`'s delivery count is to be written to the store: a returned persistent
    /// message of a durable queue (transient ones do not outlive the broker anyway)
    /// whose count matters, that is, with a delivery limit or a retry back-off. Without
    /// them the count only feeds the informational `x-delivery-count` header and stays
    /// in memory (it does not survive a restart).
    pub(super) fn store_count(&self, args: &QueueArgs, e: &Entry) -> bool {
        e.returns > 0
            && self.durable
            && e.tag & TAG_PERSISTENT != 0
            && (args.delivery_limit.is_some() || args.retry_backoff.is_some())
    }

    /// Makes the parked (backing-off) messages whose wait is over ready again; returns
    /// whether there were any.
    pub(super) fn unpark(&self, st: &mut State) -> bool {
        let Some(parked) = st.parked.as_mut() else {
            return false;
        };
        let now = self.clock.now_ms();
        let mut due = Vec::new();
        while let Some(entry) = parked.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let ((_, off), e) = entry.remove_entry();
            due.push((off, e));
        }
        if parked.is_empty() {
            st.parked = None;
        }
        for (off, e) in &due {
            st.ready_count += 1;
            st.ready_bytes += tag_len(e.tag);
            self.note_tag(e.tag);
            st.ready.insert((255 - self.priority_of(e.tag), *off), *e);
        }
        !due.is_empty()
    }

    /// Returned messages waiting out their back-off step.
    pub fn parked_count(&self) -> u32 {
        lock(&self.state)
            .parked
            .as_ref()
            .map_or(0, |p| u32::try_from(p.len()).unwrap_or(u32::MAX))
    }
}
