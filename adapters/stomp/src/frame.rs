//! A STOMP frame: command, headers in wire order (repeats kept), body.

use std::fmt;

use bytes::Bytes;

/// Every command of STOMP 1.0-1.2, client and server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Command {
    /// Client: open a session (1.0 name).
    Connect,
    /// Client: open a session (1.1+ name).
    Stomp,
    /// Client: publish.
    Send,
    /// Client: start a subscription.
    Subscribe,
    /// Client: end a subscription.
    Unsubscribe,
    /// Client: acknowledge.
    Ack,
    /// Client: negative acknowledge (1.1+).
    Nack,
    /// Client: start a transaction.
    Begin,
    /// Client: commit a transaction.
    Commit,
    /// Client: abort a transaction.
    Abort,
    /// Client: close the session.
    Disconnect,
    /// Server: session opened.
    Connected,
    /// Server: a delivery.
    Message,
    /// Server: a frame with `receipt` was processed.
    Receipt,
    /// Server: something went wrong; the connection closes.
    Error,
}

impl Command {
    /// All commands, for tests and generators.
    pub const ALL: [Command; 15] = [
        Command::Connect,
        Command::Stomp,
        Command::Send,
        Command::Subscribe,
        Command::Unsubscribe,
        Command::Ack,
        Command::Nack,
        Command::Begin,
        Command::Commit,
        Command::Abort,
        Command::Disconnect,
        Command::Connected,
        Command::Message,
        Command::Receipt,
        Command::Error,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Connect => "CONNECT",
            Command::Stomp => "STOMP",
            Command::Send => "SEND",
            Command::Subscribe => "SUBSCRIBE",
            Command::Unsubscribe => "UNSUBSCRIBE",
            Command::Ack => "ACK",
            Command::Nack => "NACK",
            Command::Begin => "BEGIN",
            Command::Commit => "COMMIT",
            Command::Abort => "ABORT",
            Command::Disconnect => "DISCONNECT",
            Command::Connected => "CONNECTED",
            Command::Message => "MESSAGE",
            Command::Receipt => "RECEIPT",
            Command::Error => "ERROR",
        }
    }

    /// Parses a wire name (case-sensitive, as the spec says).
    pub fn parse(name: &[u8]) -> Option<Command> {
        Command::ALL
            .into_iter()
            .find(|c| c.as_str().as_bytes() == name)
    }

    /// CONNECT, STOMP and CONNECTED never escape their headers (STOMP 1.2 "Value
    /// Encoding"), for 1.0 compatibility.
    pub fn escapes_headers(self) -> bool {
        !matches!(self, Command::Connect | Command::Stomp | Command::Connected)
    }
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The command.
    pub command: Command,
    /// Headers in wire order; a repeated name keeps every entry, and the first one is
    /// the one that counts ([`Frame::header`]).
    pub headers: Vec<(String, String)>,
    /// The body (empty for most commands).
    pub body: Bytes,
}

impl Frame {
    /// A frame with no headers and no body.
    pub fn new(command: Command) -> Frame {
        Frame {
            command,
            headers: Vec::new(),
            body: Bytes::new(),
        }
    }

    /// Adds a header (builder style).
    pub fn with(mut self, name: impl Into<String>, value: impl Into<String>) -> Frame {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the body (builder style).
    pub fn with_body(mut self, body: impl Into<Bytes>) -> Frame {
        self.body = body.into();
        self
    }

    /// Adds a header.
    pub fn push(&mut self, name: impl Into<String>, value: impl Into<String>) {
        self.headers.push((name.into(), value.into()));
    }

    /// The first value of a header (STOMP 1.2: repeated headers, first wins).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether a header is present.
    pub fn has(&self, name: &str) -> bool {
        self.header(name).is_some()
    }
}
