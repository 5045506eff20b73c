//! Names the broker keeps for itself, outside what clients can address: one rule, used
//! by the permission checks every adapter makes ([`crate::VhostAccess`]) and by routing
//! ([`crate::Vhost`]).
//!
//! - Queues named `amq.triad.…` hold the broker's own state (MQTT retained messages and
//!   persistent sessions). A client may not declare (passively either), publish to
//!   (through the default exchange), bind, consume, get, purge or delete them, in any
//!   protocol; no exchange routes to them (a dead-lettered message whose routing key
//!   names one included), so a message gets there only through
//!   [`crate::Vhost::publish_reserved`]. (`amq.` was already refused on declare, as
//!   RabbitMQ does, so no client queue can have such a name.)
//! - On `amq.topic`, the routing keys `$SYS` and `$SYS.…` (MQTT's `$SYS/…`) are the
//!   broker's status topics: clients may subscribe to them but not publish there
//!   (Mosquitto's rule).

/// Prefix of the queues that hold the broker's own state.
pub const RESERVED_QUEUE_PREFIX: &str = "amq.triad.";

/// Whether `name` is a queue name the broker keeps for itself.
pub fn is_reserved_queue(name: &str) -> bool {
    name.starts_with(RESERVED_QUEUE_PREFIX)
}

/// Whether publishing to `exchange` with routing key `key` is reserved to the broker:
/// `$SYS` topics on `amq.topic`.
pub fn is_reserved_topic(exchange: &str, key: &str) -> bool {
    exchange == "amq.topic" && (key == "$SYS" || key.starts_with("$SYS."))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_names() {
        assert!(is_reserved_queue("amq.triad.mqtt.retained"));
        assert!(!is_reserved_queue("amq.gen-abc"));
        assert!(!is_reserved_queue("mqtt-retained"));
        assert!(is_reserved_topic("amq.topic", "$SYS"));
        assert!(is_reserved_topic("amq.topic", "$SYS.broker.uptime"));
        assert!(!is_reserved_topic("amq.topic", "$SYSX.a"));
        assert!(!is_reserved_topic("amq.topic", "a.$SYS"));
        assert!(!is_reserved_topic("amq.direct", "$SYS.a"));
    }
}
