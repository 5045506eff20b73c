//! Limits and timeouts of the AMQP listener.

use std::time::Duration;

/// Per-connection limits and timeouts (RabbitMQ's defaults where it has them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpConfig {
    /// Largest frame offered in connection.tune (bytes, whole frame). Default 128 KiB.
    pub frame_max: u32,
    /// Highest channel number offered in connection.tune. Default 2047.
    pub channel_max: u16,
    /// Heartbeat interval offered in connection.tune; zero disables. Default 60 s.
    pub heartbeat: Duration,
    /// Largest message body accepted. Default 128 MiB (RabbitMQ's).
    pub max_message_size: u64,
    /// Deadline for the whole handshake (protocol header to connection.open-ok).
    pub handshake_timeout: Duration,
    /// How long to wait for connection.close-ok after sending connection.close, and,
    /// after sending close-ok, for the peer to close its socket (what it still sends
    /// meanwhile is read and dropped). Default 3 s.
    pub close_timeout: Duration,
    /// Deliveries buffered per connection before queues stop handing it more.
    pub outbox_capacity: usize,
    /// How long a refused login waits before its connection.close (in this
    /// connection's task only). Default 1 s.
    pub failed_login_delay: Duration,
    /// This connection's verified TLS client certificate CN: SASL EXTERNAL is offered
    /// and logs in as this user. `None` over plain TCP or without a certificate.
    pub peer_cert_cn: Option<String>,
}

impl Default for AmqpConfig {
    fn default() -> Self {
        AmqpConfig {
            frame_max: 128 * 1024,
            channel_max: 2047,
            heartbeat: Duration::from_secs(60),
            max_message_size: 128 * 1024 * 1024,
            handshake_timeout: Duration::from_secs(10),
            close_timeout: Duration::from_secs(3),
            outbox_capacity: 1024,
            failed_login_delay: Duration::from_secs(1),
            peer_cert_cn: None,
        }
    }
}
