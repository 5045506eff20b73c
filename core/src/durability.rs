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

/// See the module's documentation. Three words; cheap to hold per pending reply.
pub struct Durability(Inner);

enum Inner {
    /// The store's group commit (no allocation).
    Store(Durable),
    /// Any other wait: several durabilities joined, a test's.
    Other(Pin<Box<dyn Future<Output = Result<(), CoreError>> + Send>>),
}

impl Durability {
    /// Already durable: nothing to wait for.
    pub fn ready() -> Durability {
        Durability(Inner::Store(Durable::ready()))
    }

    /// A wait the core does not make: durable once `f` completes (boxed).
    pub fn from_future(f: impl Future<Output = Result<(), CoreError>> + Send + 'static) -> Self {
        Durability(Inner::Other(Box::pin(f)))
    }

    /// Whether it is durable already (never blocks; a joined wait says no until polled
    /// to completion).
    pub fn is_durable(&self) -> bool {
        match &self.0 {
            Inner::Store(d) => d.is_durable(),
            Inner::Other(_) => false,
        }
    }

    /// Blocks the calling thread until durable (not from an async task). Only the
    /// store's own waits block; another ([`Durability::from_future`]) needs an async
    /// caller and is refused here.
    pub fn wait(self) -> Result<(), CoreError> {
        match self.0 {
            Inner::Store(d) => d.wait().map_err(CoreError::from),
            Inner::Other(_) => Err(CoreError::Internal(
                "a joined durability wait cannot block a thread; await it".into(),
            )),
        }
    }
}

impl From<Durable> for Durability {
    fn from(d: Durable) -> Durability {
        Durability(Inner::Store(d))
    }
}

impl Future for Durability {
    type Output = Result<(), CoreError>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.0 {
            Inner::Store(d) => Pin::new(d).poll(cx).map_err(CoreError::from),
            Inner::Other(f) => f.as_mut().poll(cx),
        }
    }
}

impl std::fmt::Debug for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Inner::Store(d) => f.debug_tuple("Durability").field(d).finish(),
            Inner::Other(_) => f.write_str("Durability(..)"),
        }
    }
}
