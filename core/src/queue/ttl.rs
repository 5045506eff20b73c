//! Message TTL (`x-message-ttl`, per-message `expiration`), queue expiry (`x-expires`)
//! and the periodic tick that applies them.

use std::sync::atomic::Ordering;
use std::time::Duration;

use triad_store::commitlog::StoredRecord;

use super::tag::{tag_len, TAG_HAS_TTL};
use super::{lock, After, Queue, State};
use crate::envelope;
use crate::message::Properties;

impl Queue {
    pub(super) fn expiry(
        &self,
        queue_ttl: Option<u64>,
        tag: u64,
        rec: &StoredRecord,
        props: &Properties,
    ) -> Option<u64> {
        let msg_ttl = if tag & TAG_HAS_TTL != 0 {
            props
                .expiration
                .as_deref()
                .and_then(|s| s.parse::<u64>().ok())
        } else {
            None
        };
        let ttl = match (queue_ttl, msg_ttl) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }?;
        Some(rec.store_ts_ms.saturating_add(ttl))
    }

    pub(super) fn has_message_ttls(&self, st: &State) -> bool {
        st.ready
            .values()
            .next()
            .is_some_and(|e| e.tag & TAG_HAS_TTL != 0)
    }

    pub(super) fn expire_head(&self, st: &mut State, after: &mut After) {
        let now = self.clock.now_ms();
        loop {
            self.fill(st);
            let Some((&key, &e)) = st.ready.iter().next() else {
                return;
            };
            let Ok(rec) = self.store.read_entry(self.id, key.1, e.commit_offset) else {
                return;
            };
            let Ok((_, _, props)) = envelope::decode(&rec.properties) else {
                return;
            };
            if self
                .expiry(st.args.message_ttl, e.tag, &rec, &props)
                .is_none_or(|t| t > now)
            {
                return;
            }
            st.ready.remove(&key);
            st.ready_count = st.ready_count.saturating_sub(1);
            st.ready_bytes = st.ready_bytes.saturating_sub(tag_len(e.tag));
            self.drop_entry(key.1, e, "expired", after);
        }
    }

    /// Whether [`Queue::tick`] may have anything to do.
    pub(crate) fn needs_tick(&self) -> bool {
        // the declared settings and a flag (set by a policy with a TTL or `expires`):
        // no lock, since every tick asks every queue
        self.stream.is_some()
            || self.declared.message_ttl.is_some()
            || self.declared.expires.is_some()
            || self.tick_wanted.load(Ordering::Relaxed)
    }

    /// Periodic work: expire messages at the head (TTL), make parked messages whose
    /// back-off is over ready, and report whether the queue has been unused past
    /// `x-expires`.
    pub(crate) fn tick(&self) -> bool {
        if let Some(s) = &self.stream {
            s.tick(self.clock.now_ms());
            return false;
        }
        let mut after = After::default();
        let expired;
        {
            let mut st = lock(&self.state);
            if st.deleted {
                return false;
            }
            if st.args.message_ttl.is_some() || self.has_message_ttls(&st) {
                self.expire_head(&mut st, &mut after);
            }
            if self.unpark(&mut st) {
                self.dispatch(&mut st, &mut after);
            }
            self.flow_check(&mut st, &mut after);
            expired = st.args.expires.is_some_and(|ms| {
                st.consumers.is_empty()
                    && self.clock.instant().saturating_duration_since(st.last_used)
                        >= Duration::from_millis(ms)
            });
        }
        self.finish(after);
        expired
    }
}
