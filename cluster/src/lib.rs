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
//! - [`election`] (phase 2): the leader election on etcd's JSON gateway: leases, the
//!   election key, the epoch of a term.
//! - [`epochs`] (phase 2): the epoch history in the data directory and the
//!   divergent-suffix truncation it drives (Kafka's leader epochs).
//! - [`testing`]: a real etcd on free loopback ports, for tests.
//!
//! Connections are few (one per follower) and long-lived, and the work per frame is a
//! copy and an fsync: plain threads and blocking sockets, not the broker's runtime.
//! Phase 2 adds the election ([`election`]); the broker's `src/cluster.rs` runs the
//! roles; its `src/forward.rs` splices a follower's client connections to the leader.

#![deny(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
#![cfg_attr(
    test,
    allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)
)]

pub mod codec;
pub mod election;
pub mod epochs;
pub mod follower;
pub mod leader;
pub mod status;
pub mod testing;
pub mod tls;
