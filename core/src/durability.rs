//! [`Durability`]: what a reply that promises durability (a publisher confirm, a STOMP
//! RECEIPT, an MQTT PUBACK, a `tx.commit-ok`, a declare-ok of a durable entity) waits
//! for. The core's own type over the store's group-commit handle, so that adapters need
//! not know the store.
//!
//! It completes once the bytes it covers are on disk (`flush = "sync"`: after the
//! group commit's `fsync`; `"async"`: at once), or fails with the store's fatal error.
//! Handles complete in the order their records were appended, so a connection's
//! ordered queue of replies only ever waits on its front entry.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use triad_store::flush::Durable;

use crate::error::CoreError;

/// See the module's documentation. Two words; cheap to hold per pending reply.
pub struct Durability(Durable);

impl Durability {
    /// Already durable: nothing to wait for.
    pub fn ready() -> Durability {
        Durability(Durable::ready())
    }

    /// Whether it is durable already (never blocks).
    pub fn is_durable(&self) -> bool {
        self.0.is_durable()
    }

    /// Blocks the calling thread until durable (not from an async task).
    pub fn wait(self) -> Result<(), CoreError> {
        self.0.wait().map_err(CoreError::from)
    }
}

impl From<Durable> for Durability {
    fn from(d: Durable) -> Durability {
        Durability(d)
    }
}

impl Future for Durability {
    type Output = Result<(), CoreError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map_err(CoreError::from)
    }
}

impl std::fmt::Debug for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Durability").field(&self.0).finish()
    }
}
