//! STOMP destinations as RabbitMQ's STOMP plugin reads them, and back.
//!
//! | destination | SEND | SUBSCRIBE |
//! |---|---|---|
//! | `/queue/Q` | default exchange, key Q (declares durable Q) | consume Q (declares it) |
//! | `/topic/K` | `amq.topic`, key K | private queue bound to `amq.topic` with K |
//! | `/exchange/X/K` | exchange X, key K | private queue bound to X with K |
//! | `/amq/queue/Q` | default exchange, key Q | consume existing Q (no declare) |
//! | `/temp-queue/T` | the connection's reply queue for T | the same queue |
//! | `/reply-queue/Q` | default exchange, key Q | consume existing Q |
//! | `/txn/ID` | commit or roll back half message ID (exchange `amq.triad.txn`, key ID) | — |

use thiserror::Error;

/// A parsed destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// `/queue/Q`.
    Queue(String),
    /// `/topic/K`.
    Topic(String),
    /// `/exchange/X[/K]`.
    Exchange {
        /// Exchange name.
        exchange: String,
        /// Routing key / binding pattern ("" when absent).
        key: String,
    },
    /// `/amq/queue/Q`.
    AmqQueue(String),
    /// `/temp-queue/T`.
    TempQueue(String),
    /// `/reply-queue/Q`.
    ReplyQueue(String),
}

/// A destination this broker does not understand.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BadDestination {
    /// Not one of the forms in the table above.
    #[error("unknown destination '{0}': use /queue/, /topic/, /exchange/, /amq/queue/, /temp-queue/, /reply-queue/ or /txn/")]
    Unknown(String),
    /// A queue or exchange name or a routing key longer than [`MAX_NAME`].
    #[error(
        "destination too long: a name or routing key of {0} bytes (at most {MAX_NAME}, as AMQP's)"
    )]
    TooLong(usize),
}

/// Longest queue name, exchange name or routing key in a destination: AMQP 0-9-1's
/// short string, so that every protocol can carry it (a longer routing key could not
/// be delivered to an AMQP consumer).
pub const MAX_NAME: usize = 255;

fn nonempty(s: &str, whole: &str) -> Result<String, BadDestination> {
    if s.is_empty() {
        Err(BadDestination::Unknown(whole.to_string()))
    } else {
        short(s)
    }
}

fn short(s: &str) -> Result<String, BadDestination> {
    if s.len() > MAX_NAME {
        Err(BadDestination::TooLong(s.len()))
    } else {
        Ok(s.to_string())
    }
}

impl Destination {
    /// Parses a `destination` header.
    pub fn parse(s: &str) -> Result<Destination, BadDestination> {
        if let Some(q) = s.strip_prefix("/queue/") {
            return Ok(Destination::Queue(nonempty(q, s)?));
        }
        if let Some(k) = s.strip_prefix("/topic/") {
            return Ok(Destination::Topic(nonempty(k, s)?));
        }
        if let Some(rest) = s.strip_prefix("/exchange/") {
            let (x, k) = rest.split_once('/').unwrap_or((rest, ""));
            return Ok(Destination::Exchange {
                exchange: nonempty(x, s)?,
                key: short(k)?,
            });
        }
        if let Some(q) = s.strip_prefix("/amq/queue/") {
            return Ok(Destination::AmqQueue(nonempty(q, s)?));
        }
        if let Some(t) = s.strip_prefix("/temp-queue/") {
            return Ok(Destination::TempQueue(nonempty(t, s)?));
        }
        if let Some(q) = s.strip_prefix("/reply-queue/") {
            return Ok(Destination::ReplyQueue(nonempty(q, s)?));
        }
        if let Some(id) = s.strip_prefix("/txn/") {
            // a half message's commit or rollback (`x-txn` header): the core's
            // transaction exchange, with the message-id as routing key
            return Ok(Destination::Exchange {
                exchange: triad_core::txn::TXN_EXCHANGE.to_string(),
                key: nonempty(id, s)?,
            });
        }
        Err(BadDestination::Unknown(s.to_string()))
    }

    /// The destination header of a delivery, from the exchange and routing key it was
    /// published with (RabbitMQ's reconstruction).
    pub fn for_delivery(exchange: &str, routing_key: &str) -> String {
        match exchange {
            "" => format!("/queue/{routing_key}"),
            "amq.topic" => format!("/topic/{routing_key}"),
            x if routing_key.is_empty() => format!("/exchange/{x}"),
            x => format!("/exchange/{x}/{routing_key}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_kind() {
        assert_eq!(
            Destination::parse("/queue/a").unwrap(),
            Destination::Queue("a".into())
        );
        assert_eq!(
            Destination::parse("/topic/a.*.#").unwrap(),
            Destination::Topic("a.*.#".into())
        );
        assert_eq!(
            Destination::parse("/exchange/x/k/l").unwrap(),
            Destination::Exchange {
                exchange: "x".into(),
                key: "k/l".into()
            }
        );
        assert_eq!(
            Destination::parse("/exchange/x").unwrap(),
            Destination::Exchange {
                exchange: "x".into(),
                key: "".into()
            }
        );
        assert_eq!(
            Destination::parse("/txn/order-1").unwrap(),
            Destination::Exchange {
                exchange: "amq.triad.txn".into(),
                key: "order-1".into()
            }
        );
        assert_eq!(
            Destination::parse("/amq/queue/q").unwrap(),
            Destination::AmqQueue("q".into())
        );
        assert_eq!(
            Destination::parse("/temp-queue/r").unwrap(),
            Destination::TempQueue("r".into())
        );
        assert!(Destination::parse("/queue/").is_err());
        assert!(Destination::parse("foo").is_err());
        assert_eq!(Destination::for_delivery("", "q"), "/queue/q");
        assert_eq!(Destination::for_delivery("amq.topic", "a.b"), "/topic/a.b");
        assert_eq!(Destination::for_delivery("x", "k"), "/exchange/x/k");
    }
}
