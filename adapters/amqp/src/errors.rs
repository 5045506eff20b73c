//! AMQP reply codes and the one table mapping [`CoreError`] to them.
//!
//! | core condition | code | scope |
//! |---|---|---|
//! | `NotFound` | 404 NOT_FOUND | channel |
//! | `AccessRefused` | 403 ACCESS_REFUSED | channel |
//! | `ResourceLocked` | 405 RESOURCE_LOCKED | channel |
//! | `PreconditionFailed` | 406 PRECONDITION_FAILED | channel |
//! | `LimitExceeded` | 406 PRECONDITION_FAILED | channel (RabbitMQ answers an oversized message or an out-of-range argument with 406 on the channel; it keeps 530 for connection/channel-count limits, which this adapter enforces itself) |
//! | `CommandInvalid` | 503 COMMAND_INVALID | connection |
//! | `NotAllowed` | 530 NOT_ALLOWED | connection |
//! | `InvalidEncoding`, `Internal` | 541 INTERNAL_ERROR | connection (a corrupt stored record or a store failure, never the peer's fault) |
//!
//! Framing problems are 501 FRAME_ERROR / 502 SYNTAX_ERROR / 505 UNEXPECTED_FRAME
//! (see [`crate::codec::FrameError`] and the session).

use triad_core::CoreError;

/// 200
pub const REPLY_SUCCESS: u16 = 200;
/// 311
pub const CONTENT_TOO_LARGE: u16 = 311;
/// 312
pub const NO_ROUTE: u16 = 312;
/// 320
pub const CONNECTION_FORCED: u16 = 320;
/// 403
pub const ACCESS_REFUSED: u16 = 403;
/// 404
pub const NOT_FOUND: u16 = 404;
/// 405
pub const RESOURCE_LOCKED: u16 = 405;
/// 406
pub const PRECONDITION_FAILED: u16 = 406;
/// 501
pub const FRAME_ERROR: u16 = 501;
/// 502
pub const SYNTAX_ERROR: u16 = 502;
/// 503
pub const COMMAND_INVALID: u16 = 503;
/// 504
pub const CHANNEL_ERROR: u16 = 504;
/// 505
pub const UNEXPECTED_FRAME: u16 = 505;
/// 506
pub const RESOURCE_ERROR: u16 = 506;
/// 530
pub const NOT_ALLOWED: u16 = 530;
/// 540
pub const NOT_IMPLEMENTED: u16 = 540;
/// 541
pub const INTERNAL_ERROR: u16 = 541;

/// The reply code's name as RabbitMQ prefixes reply texts with it.
pub fn code_name(code: u16) -> &'static str {
    match code {
        REPLY_SUCCESS => "OK",
        CONTENT_TOO_LARGE => "CONTENT_TOO_LARGE",
        NO_ROUTE => "NO_ROUTE",
        CONNECTION_FORCED => "CONNECTION_FORCED",
        ACCESS_REFUSED => "ACCESS_REFUSED",
        NOT_FOUND => "NOT_FOUND",
        RESOURCE_LOCKED => "RESOURCE_LOCKED",
        PRECONDITION_FAILED => "PRECONDITION_FAILED",
        FRAME_ERROR => "FRAME_ERROR",
        SYNTAX_ERROR => "SYNTAX_ERROR",
        COMMAND_INVALID => "COMMAND_INVALID",
        CHANNEL_ERROR => "CHANNEL_ERROR",
        UNEXPECTED_FRAME => "UNEXPECTED_FRAME",
        RESOURCE_ERROR => "RESOURCE_ERROR",
        NOT_ALLOWED => "NOT_ALLOWED",
        NOT_IMPLEMENTED => "NOT_IMPLEMENTED",
        INTERNAL_ERROR => "INTERNAL_ERROR",
        _ => "ERROR",
    }
}

/// Whether an error closes the channel or the whole connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// channel.close
    Channel,
    /// connection.close
    Connection,
}

/// An error to report to the peer with channel.close or connection.close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AmqpError {
    /// Reply code.
    pub code: u16,
    /// Reply text, `NAME - detail`.
    pub text: String,
    /// Channel or connection.
    pub scope: Scope,
    /// Class id of the offending method (0 if none).
    pub class_id: u16,
    /// Method id of the offending method (0 if none).
    pub method_id: u16,
}

impl AmqpError {
    /// A channel error.
    pub fn channel(code: u16, detail: impl std::fmt::Display) -> Self {
        Self::new(code, Scope::Channel, detail)
    }

    /// A connection error.
    pub fn connection(code: u16, detail: impl std::fmt::Display) -> Self {
        Self::new(code, Scope::Connection, detail)
    }

    fn new(code: u16, scope: Scope, detail: impl std::fmt::Display) -> Self {
        AmqpError {
            code,
            text: format!("{} - {detail}", code_name(code)),
            scope,
            class_id: 0,
            method_id: 0,
        }
    }

    /// Records the offending method.
    pub fn on(mut self, class_id: u16, method_id: u16) -> Self {
        self.class_id = class_id;
        self.method_id = method_id;
        self
    }
}

/// The mapping table: a core error as an AMQP error.
pub fn from_core(e: &CoreError) -> AmqpError {
    let (code, scope) = match e {
        CoreError::NotFound { .. } => (NOT_FOUND, Scope::Channel),
        CoreError::AccessRefused(_) => (ACCESS_REFUSED, Scope::Channel),
        CoreError::ResourceLocked(_) => (RESOURCE_LOCKED, Scope::Channel),
        CoreError::PreconditionFailed(_) => (PRECONDITION_FAILED, Scope::Channel),
        CoreError::LimitExceeded(_) => (PRECONDITION_FAILED, Scope::Channel),
        CoreError::CommandInvalid(_) => (COMMAND_INVALID, Scope::Connection),
        CoreError::NotAllowed(_) => (NOT_ALLOWED, Scope::Connection),
        CoreError::NotImplemented(_) => (NOT_IMPLEMENTED, Scope::Connection),
        CoreError::InvalidEncoding(_) | CoreError::Internal(_) => {
            (INTERNAL_ERROR, Scope::Connection)
        }
    };
    let detail = match e {
        CoreError::NotFound { kind, name } => format!("no {kind} '{name}'"),
        CoreError::AccessRefused(s)
        | CoreError::ResourceLocked(s)
        | CoreError::PreconditionFailed(s)
        | CoreError::CommandInvalid(s)
        | CoreError::NotAllowed(s)
        | CoreError::NotImplemented(s)
        | CoreError::Internal(s) => s.clone(),
        CoreError::InvalidEncoding(s) | CoreError::LimitExceeded(s) => (*s).to_owned(),
    };
    AmqpError::new(code, scope, detail)
}

impl From<CoreError> for AmqpError {
    fn from(e: CoreError) -> Self {
        from_core(&e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let e = from_core(&CoreError::queue_not_found("q"));
        assert_eq!((e.code, e.scope), (404, Scope::Channel));
        assert_eq!(e.text, "NOT_FOUND - no queue 'q'");
        let e = from_core(&CoreError::CommandInvalid("x".into()));
        assert_eq!((e.code, e.scope), (503, Scope::Connection));
        let e = from_core(&CoreError::ResourceLocked("x".into()));
        assert_eq!((e.code, e.scope), (405, Scope::Channel));
        let e = from_core(&CoreError::NotAllowed("x".into())).on(10, 40);
        assert_eq!(
            (e.code, e.scope, e.class_id, e.method_id),
            (530, Scope::Connection, 10, 40)
        );
    }
}
