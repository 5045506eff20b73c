//! Exchange kinds and definitions.

use std::fmt;
use std::str::FromStr;

use crate::error::CoreError;
use crate::value::FieldTable;

/// The exchange argument naming the alternate exchange.
pub const ALTERNATE_EXCHANGE: &str = "alternate-exchange";

/// How an exchange routes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExchangeKind {
    /// Routing key equals binding key.
    Direct,
    /// Every binding.
    Fanout,
    /// Binding keys are dot-separated patterns with `*` and `#`.
    Topic,
    /// Binding arguments are matched against message headers.
    Headers,
    /// `x-consistent-hash`: one destination per message, by a consistent hash of its
    /// routing key (or a header or property); binding keys are weights (see
    /// [`super::consistent_hash`]).
    ConsistentHash,
}

impl ExchangeKind {
    /// The type name as AMQP and the management API spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            ExchangeKind::Direct => "direct",
            ExchangeKind::Fanout => "fanout",
            ExchangeKind::Topic => "topic",
            ExchangeKind::Headers => "headers",
            ExchangeKind::ConsistentHash => "x-consistent-hash",
        }
    }
}

impl fmt::Display for ExchangeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ExchangeKind {
    type Err = CoreError;

    /// Parses `direct`, `fanout`, `topic`, `headers` or `x-consistent-hash` (exactly, as
    /// RabbitMQ);
    /// anything else is [`CoreError::CommandInvalid`].
    fn from_str(s: &str) -> Result<Self, CoreError> {
        match s {
            "direct" => Ok(ExchangeKind::Direct),
            "fanout" => Ok(ExchangeKind::Fanout),
            "topic" => Ok(ExchangeKind::Topic),
            "headers" => Ok(ExchangeKind::Headers),
            "x-consistent-hash" => Ok(ExchangeKind::ConsistentHash),
            other => Err(CoreError::CommandInvalid(format!(
                "unknown exchange type '{other}'"
            ))),
        }
    }
}

/// What an exchange was declared with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExchangeDef {
    /// Its name; `""` is the default exchange.
    pub name: String,
    /// Its kind.
    pub kind: ExchangeKind,
    /// Whether it survives a restart.
    pub durable: bool,
    /// Deleted when its last binding (as source) is removed.
    pub auto_delete: bool,
    /// Clients may not publish to it directly, only through exchange-to-exchange
    /// bindings or as an alternate exchange.
    pub internal: bool,
    /// Declare arguments (`alternate-exchange`, ...).
    pub arguments: FieldTable,
}

impl ExchangeDef {
    /// A durable, non-auto-delete, non-internal exchange without arguments.
    pub fn new(name: impl Into<String>, kind: ExchangeKind) -> Self {
        ExchangeDef {
            name: name.into(),
            kind,
            durable: true,
            auto_delete: false,
            internal: false,
            arguments: FieldTable::new(),
        }
    }

    /// The `alternate-exchange` argument, if set to a string.
    pub fn alternate_exchange(&self) -> Option<&str> {
        self.arguments.get_str(ALTERNATE_EXCHANGE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_and_print() {
        for k in [
            ExchangeKind::Direct,
            ExchangeKind::Fanout,
            ExchangeKind::Topic,
            ExchangeKind::Headers,
            ExchangeKind::ConsistentHash,
        ] {
            assert_eq!(k.as_str().parse::<ExchangeKind>(), Ok(k));
            assert_eq!(k.to_string(), k.as_str());
        }
        assert!(matches!(
            "x-modulus-hash".parse::<ExchangeKind>(),
            Err(CoreError::CommandInvalid(_))
        ));
        assert!("Direct".parse::<ExchangeKind>().is_err());
    }

    #[test]
    fn alternate_exchange_argument() {
        let mut d = ExchangeDef::new("x", ExchangeKind::Direct);
        assert_eq!(d.alternate_exchange(), None);
        d.arguments.insert(ALTERNATE_EXCHANGE, "ae");
        assert_eq!(d.alternate_exchange(), Some("ae"));
    }
}
