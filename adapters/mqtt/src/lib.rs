//! MQTT 3.1.1 adapter.
//!
//! Not built yet: this crate is a placeholder in the workspace layout of
//! ARCHITECTURE.md and exports nothing.
