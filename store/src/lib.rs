//! Triad's durable store, after RocketMQ's design.
//!
//! Every message is written once, to the [`commitlog`]; each queue it was routed to gets
//! a fixed 20-byte entry in its own [`consumequeue`]; message keys go to the
//! [`index`]. Per-queue [`ack`] state records which entries were consumed, and the
//! [`journal`] holds durable metadata (queue registry, topology) as an ordered log of
//! changes plus snapshots.
//! [`store`] ties them together: one writer path, group commit ([`flush`]), checkpoints,
//! crash recovery and retention. It knows nothing of protocols.
//!
//! Modules:
//! - [`record`]: the self-describing, CRC32C-checked commitlog record codec.
//! - [`commitlog`]: fixed-size memory-mapped segments named by start offset.
//! - [`consumequeue`]: per-queue files of 20-byte entries (commitlog offset, size, tag hash).
//! - [`index`]: on-disk hash index from message key to commitlog offsets.
//! - [`ack`]: ack head plus the set of acked entries above it.
//! - [`flush`]: durability waiters and the flusher (sync = group commit, async = interval).
//! - [`journal`]: the metadata journal: one record per change, group-committed, compacted
//!   into snapshots (the store's queue registry and the core's topology live there).
//! - [`meta`]: atomic JSON metadata files, as earlier versions kept metadata (read once
//!   and moved into the journal).
//! - [`store`]: the [`Store`] itself.
//! - [`file`], [`error`]: helpers.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]

pub mod ack;
pub mod commitlog;
pub mod consumequeue;
pub mod error;
pub mod file;
pub mod flush;
pub mod index;
pub mod journal;
pub mod meta;
pub mod record;
pub mod store;

pub use error::{Result, StoreError};
