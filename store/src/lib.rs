//! Triad's durable store, after RocketMQ's design.
//!
//! Every message is written once, to the [`commitlog`]; each queue it was routed to gets
//! an entry in its [`consumequeue`] (in heap and the shared index [`smallcq`] while the
//! queue holds few entries, in its own files of 20-byte entries once it holds more);
//! message keys go to the [`index`]. Per-queue [`ack`] state records which entries were
//! consumed, and the [`journal`] holds durable metadata as an ordered log of changes plus
//! snapshots: the store's queue registry, ack states as of the checkpoint and delivery
//! counts, and what the core keeps there (vhosts, users, topology, policies, stream
//! offsets).
//! [`store`] ties them together: one writer path, group commit ([`flush`]), checkpoints,
//! crash recovery and retention. It knows nothing of protocols.
//!
//! Modules:
//! - [`record`]: the self-describing, CRC32C-checked commitlog record codec.
//! - [`commitlog`]: fixed-size memory-mapped segments named by start offset.
//! - [`consumequeue`]: a queue's entries (commitlog offset, size, tag hash) by logical
//!   offset; small queues in heap, big ones in files; moves a queue between the two.
//! - [`cqfile`]: a big queue's own files of 20-byte entries.
//! - [`smallcq`]: the shared index: one segmented append-only file that makes every small
//!   queue's entries durable, so an idle queue owns no file.
//! - [`index`]: on-disk hash index from message key to commitlog offsets.
//! - [`ack`]: ack head plus the set of acked entries above it.
//! - [`flush`]: durability waiters and the flusher (sync = group commit, async = interval).
//! - [`journal`]: the metadata journal: one record per change, group-committed, compacted
//!   into snapshots (the store's queue registry and ack states and the core's metadata
//!   live there).
//! - [`meta`]: atomic JSON metadata files, where earlier versions kept their metadata;
//!   nothing is written there any more: the store and the core read what an earlier
//!   version left once at start, move it into the journal and delete the file.
//! - [`replica`]: replication's store side: the leader's sync gate and a follower's
//!   copy of the log and journal written at the leader's offsets.
//! - [`returns`]: per-message delivery counts, one journal record per returned message.
//! - [`store`]: the [`store::Store`] itself: opening and recovery, the writer path, the
//!   queue registry, checkpoints, the flusher and maintenance threads, retention and
//!   compaction, one submodule each.
//! - [`timer`]: the timer wheel and log of delayed messages (derived from their queue).
//! - [`file`], [`error`]: helpers.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]

pub mod ack;
pub mod commitlog;
pub mod consumequeue;
pub mod cqfile;
pub mod error;
pub mod file;
pub mod flush;
pub mod index;
pub mod journal;
pub mod meta;
pub mod record;
pub mod replica;
pub mod returns;
pub mod smallcq;
pub mod store;
pub mod timer;

pub use error::{Result, StoreError};
