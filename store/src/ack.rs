//! Per-queue ack state. CONTRACT STUB: replaced by the real implementation.
//!
//! The head is the lowest logical offset not yet acked; offsets above it that are acked
//! are kept as disjoint half-open ranges, merged as they grow, and the head advances over
//! any range that starts at it. Encoded snapshots are versioned and CRC32C-checked.

use crate::error::Result;

/// Ack head plus the acked set above it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AckState {}

#[allow(unused_variables)]
impl AckState {
    /// Nothing acked below `head` is pending; nothing above it is acked.
    pub fn new(head: u64) -> AckState {
        unimplemented!()
    }
    /// Lowest logical offset not yet acked.
    pub fn head(&self) -> u64 {
        unimplemented!()
    }
    /// Whether `offset` has been acked.
    pub fn is_acked(&self, offset: u64) -> bool {
        unimplemented!()
    }
    /// Marks `offset` acked; returns false when it already was.
    pub fn ack(&mut self, offset: u64) -> bool {
        unimplemented!()
    }
    /// Marks `start..end` acked (used by purge); returns how many were newly acked.
    pub fn ack_range(&mut self, start: u64, end: u64) -> u64 {
        unimplemented!()
    }
    /// How many offsets above the head are acked.
    pub fn acked_above_head(&self) -> u64 {
        unimplemented!()
    }
    /// Offsets in `head..end` not acked (for walking a queue's pending entries), ascending,
    /// at most `max` of them.
    pub fn unacked(&self, end: u64, max: usize) -> Vec<u64> {
        unimplemented!()
    }
    /// Serialises the state (magic, version, head, ranges, CRC32C).
    pub fn encode(&self) -> Vec<u8> {
        unimplemented!()
    }
    /// Parses what `encode` wrote; any damage is `StoreError::Corrupt`-free
    /// `StoreError::Invalid` (never a panic; lengths are bounded by the input size).
    pub fn decode(bytes: &[u8]) -> Result<AckState> {
        unimplemented!()
    }
}
