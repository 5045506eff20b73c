//! Length limits (`x-max-length`, `x-max-length-bytes`) and `x-overflow`.

use std::sync::atomic::Ordering;

use super::{lock, After, Overflow, Queue, QueueArgs, State};

pub(super) fn refuses_when_full(a: &QueueArgs) -> bool {
    a.overflow != Overflow::DropHead && (a.max_length.is_some() || a.max_length_bytes.is_some())
}

impl Queue {
    /// Whether a new message of `body_len` bytes would be refused (`x-overflow`
    /// reject-publish with the queue at its limit).
    pub(crate) fn rejects(&self, body_len: usize) -> bool {
        if !self.rejecting.load(Ordering::Relaxed) {
            return false;
        }
        let st = lock(&self.state);
        let args = &st.args;
        args.overflow != Overflow::DropHead
            && (args.max_length.is_some_and(|m| st.ready_count >= m)
                || args
                    .max_length_bytes
                    .is_some_and(|m| st.ready_bytes + body_len as u64 > m))
    }

    pub(super) fn enforce_limits(&self, st: &mut State, after: &mut After) {
        if st.args.overflow != Overflow::DropHead {
            return;
        }
        let (max_length, max_bytes) = (st.args.max_length, st.args.max_length_bytes);
        loop {
            let over = max_length.is_some_and(|m| st.ready_count > m)
                || max_bytes.is_some_and(|m| st.ready_bytes > m);
            if !over {
                return;
            }
            let Some((off, e)) = self.pop_oldest(st) else {
                return;
            };
            self.drop_entry(off, e, "maxlen", after);
        }
    }
}
