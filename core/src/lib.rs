//! Protocol-neutral broker core: vhosts, exchanges, queues, bindings, routing, consumers, acks.
//!
//! Not built yet: this crate is a placeholder in the workspace layout of
//! ARCHITECTURE.md and exports nothing.
