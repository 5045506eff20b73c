//! Triad's replication, phase 1 of issue 18: one leader streams its commitlog and
//! metadata journal, byte for byte at their offsets, to statically configured followers
//! (ARCHITECTURE.md, "Replication").
//!
//! Modules:
//! - [`codec`]: the wire protocol's frames: pure, bounded, no I/O.
//! - [`leader`]: the replication listener; one sender thread per follower, the in-sync
//!   set and the sync gate it moves ([`triad_store::replica::ReplicaGate`]).
//! - [`follower`]: connects to the leader, writes what it ships into a
//!   [`triad_store::replica::ReplicaStore`], fsyncs, acknowledges.
//! - [`status`]: what the leader knows of each replica (durable positions, in sync or
//!   not, lag in bytes and seconds), for the management API and metrics.
//! - [`tls`]: mutual TLS between nodes (`[cluster.tls]`) and the byte stream both sides
//!   speak over, plain or TLS.
//!
//! Connections are few (one per follower) and long-lived, and the work per frame is a
//! copy and an fsync: plain threads and blocking sockets, not the broker's runtime.
//! No election, fencing or client forwarding yet (later phases).

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]

pub mod codec;
pub mod follower;
pub mod leader;
pub mod status;
pub mod tls;
