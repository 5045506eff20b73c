//! The `triad` broker's shell: everything between the process and the protocol
//! adapters. The binary (`src/main.rs`) wires these together.
//!
//! Modules:
//! - [`cli`]: command-line flags (an interface: scripts use these names).
//! - [`cluster`]: replication: a leader's gate and listener, the follower mode.
//! - [`config`]: the TOML configuration tree, its defaults and `validate()`.
//! - [`units`]: human sizes (`"64 KiB"`) and durations (`"200ms"`) for the config.
//! - [`listener`]: the accept loop every protocol shares (connection limit, accept
//!   backoff, one tracked task and span per connection) and the [`listener::Handler`]
//!   a protocol adapter plugs in as.
//! - [`http`]: the HTTP listener on hyper: `/health`, the management API, WebSockets.
//! - [`mgmt`]: the management API (`/api/...`) in RabbitMQ's shapes.
//! - [`adapters`]: glue from a connection to the AMQP, STOMP and MQTT adapters.
//! - [`counted`]: a connection's stream with its bytes counted (`/api/connections`).
//! - [`forward`]: a follower's client listeners, spliced to the leader's.
//! - [`proxy_protocol`]: PROXY protocol v1/v2 headers (`listeners.proxy_protocol`).
//! - [`shutdown`]: closing the store last, and saying whether it was closed.
//! - [`tls`]: the TLS listeners' rustls configuration (PEM files, TLS 1.2/1.3, client
//!   certificates) and the handler that runs the handshake before a protocol.

pub mod adapters;
pub mod cli;
pub mod cluster;
pub mod config;
pub mod counted;
pub mod forward;
pub mod http;
pub mod listener;
pub mod mgmt;
pub mod monitor;
pub mod proxy_protocol;
pub mod shutdown;
pub mod tls;
pub mod units;
pub mod websocket;
