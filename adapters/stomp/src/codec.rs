//! STOMP framing, pure: bytes ⇄ [`Frame`]. No I/O, no core types.
//!
//! ```text
//! frame   = *EOL command EOL *(header EOL) EOL body NUL
//! EOL     = [CR] LF          (bare LFs between frames are heart-beats)
//! header  = name ":" value   (first ':' splits; repeated names: first wins)
//! body    = content-length bytes (may hold NULs) | bytes up to the first NUL
//! ```
//!
//! Escapes (STOMP 1.2 "Value Encoding"): `\r` `\n` `\c` `\\` in names and values of
//! every frame but CONNECT, STOMP and CONNECTED; any other escape is an error. 1.1 has
//! the same minus `\r`; 1.0 has none. The [`Dialect`] says which applies.
//!
//! Three outcomes, never blurred: `Ok(Some(frame))`, `Ok(None)` (need more bytes; what
//! is buffered is within every limit), `Err` (a violation: answer with ERROR, close).
//! Limits are checked against what is buffered and what is declared
//! (`content-length`) before more is read, so a peer can never make the connection
//! buffer more than [`Limits::max_frame`] plus one read.

use bytes::{Buf, BufMut, BytesMut};
use nom::bytes::streaming::{tag, take_until};
use nom::{IResult, Parser};
use thiserror::Error;

use crate::frame::{Command, Frame};

/// Size bounds on incoming frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of one frame: command, headers and body.
    pub max_frame: usize,
    /// Most header lines in one frame.
    pub max_headers: usize,
    /// Most bytes of the command line or of one header line.
    pub max_header_len: usize,
}

impl Limits {
    /// After login: 4 MiB frames (RabbitMQ's `stomp.max_frame_size` of 3.x), up to 1000
    /// headers of up to 64 KiB each.
    pub const AUTHENTICATED: Limits = Limits {
        max_frame: 4 << 20,
        max_headers: 1000,
        max_header_len: 64 << 10,
    };

    /// Before CONNECT is accepted: 64 KiB frames (RabbitMQ's
    /// `stomp.max_frame_size_unauthenticated`), 64 headers of up to 8 KiB.
    pub const UNAUTHENTICATED: Limits = Limits {
        max_frame: 64 << 10,
        max_headers: 64,
        max_header_len: 8 << 10,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::AUTHENTICATED
    }
}

/// Which escaping rules apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dialect {
    /// No escapes at all.
    V10,
    /// `\n` `\c` `\\`.
    V11,
    /// `\r` `\n` `\c` `\\`.
    #[default]
    V12,
}

/// A framing violation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DecodeError {
    /// The frame is (or declares itself) larger than the limit.
    #[error("frame too large: more than {limit} bytes")]
    FrameTooLarge {
        /// The limit in force.
        limit: usize,
    },
    /// More header lines than the limit.
    #[error("too many headers: more than {limit}")]
    TooManyHeaders {
        /// The limit in force.
        limit: usize,
    },
    /// A command or header line longer than the limit.
    #[error("header line too long: more than {limit} bytes")]
    HeaderTooLong {
        /// The limit in force.
        limit: usize,
    },
    /// Not a STOMP command.
    #[error("unknown command '{0}'")]
    UnknownCommand(String),
    /// A header line without a ':'.
    #[error("malformed header line (no ':')")]
    MalformedHeader,
    /// An escape sequence the spec does not define.
    #[error("undefined escape sequence '\\{0}' in a header")]
    BadEscape(char),
    /// `content-length` is not a decimal byte count.
    #[error("invalid content-length")]
    BadContentLength,
    /// The byte after `content-length` body bytes is not NUL.
    #[error("frame body not terminated by NUL after content-length bytes")]
    MissingNul,
    /// A command or header is not UTF-8.
    #[error("header is not valid UTF-8")]
    NotUtf8,
    /// A CR not followed by LF where an end of line belongs.
    #[error("CR not followed by LF between frames")]
    BadEol,
}

/// Decodes one frame under STOMP 1.2's escaping (see [`decode_with`]).
pub fn decode(buf: &mut BytesMut, limits: &Limits) -> Result<Option<Frame>, DecodeError> {
    decode_with(buf, limits, Dialect::V12)
}

/// Decodes one frame from the front of `buf`, consuming it (and any heart-beat EOLs
/// before it). `Ok(None)`: need more bytes; `buf` then holds only what is still needed
/// (heart-beats already consumed).
pub fn decode_with(
    buf: &mut BytesMut,
    limits: &Limits,
    dialect: Dialect,
) -> Result<Option<Frame>, DecodeError> {
    skip_heartbeats(buf)?;
    if buf.is_empty() {
        return Ok(None);
    }
    let head = match parse_head(buf, limits, dialect)? {
        Some(h) => h,
        None => return Ok(None),
    };
    let rest = buf.get(head.len..).unwrap_or_default();
    let (body_len, total) = match content_length(&head.headers)? {
        Some(n) => {
            let total = head
                .len
                .checked_add(n)
                .filter(|t| *t <= limits.max_frame)
                .ok_or(DecodeError::FrameTooLarge {
                    limit: limits.max_frame,
                })?;
            match rest.get(n) {
                None => return Ok(None),
                Some(0) => (n, total + 1),
                Some(_) => return Err(DecodeError::MissingNul),
            }
        }
        None => match rest.iter().position(|b| *b == 0) {
            Some(p) if head.len + p <= limits.max_frame => (p, head.len + p + 1),
            Some(_) => {
                return Err(DecodeError::FrameTooLarge {
                    limit: limits.max_frame,
                })
            }
            None if buf.len() > limits.max_frame => {
                return Err(DecodeError::FrameTooLarge {
                    limit: limits.max_frame,
                })
            }
            None => return Ok(None),
        },
    };
    let mut whole = buf.split_to(total);
    whole.advance(head.len);
    whole.truncate(body_len);
    Ok(Some(Frame {
        command: head.command,
        headers: head.headers,
        body: whole.freeze(),
    }))
}

/// Consumes EOLs (heart-beats) at the front.
fn skip_heartbeats(buf: &mut BytesMut) -> Result<(), DecodeError> {
    let mut n = 0;
    loop {
        match (buf.get(n), buf.get(n + 1)) {
            (Some(b'\n'), _) => n += 1,
            (Some(b'\r'), Some(b'\n')) => n += 2,
            (Some(b'\r'), None) => break,
            (Some(b'\r'), Some(_)) => return Err(DecodeError::BadEol),
            _ => break,
        }
    }
    buf.advance(n);
    Ok(())
}

struct Head {
    command: Command,
    headers: Vec<(String, String)>,
    /// Bytes up to and including the blank line.
    len: usize,
}

/// One line, without its `\n` and an optional `\r` before it.
fn line(i: &[u8]) -> IResult<&[u8], &[u8]> {
    let (rest, l) = take_until("\n").parse(i)?;
    let (rest, _) = tag("\n").parse(rest)?;
    Ok((rest, l.strip_suffix(b"\r").unwrap_or(l)))
}

/// `Ok(None)` when the head is not complete yet (and within limits).
fn parse_head(
    input: &[u8],
    limits: &Limits,
    dialect: Dialect,
) -> Result<Option<Head>, DecodeError> {
    let too_long = DecodeError::HeaderTooLong {
        limit: limits.max_header_len,
    };
    let incomplete = |rest: &[u8]| {
        if input.len() > limits.max_frame {
            Err(DecodeError::FrameTooLarge {
                limit: limits.max_frame,
            })
        } else if rest.len() > limits.max_header_len {
            Err(too_long.clone())
        } else {
            Ok(None)
        }
    };
    let (mut rest, cmd) = match line(input) {
        Ok(x) => x,
        Err(nom::Err::Incomplete(_)) => return incomplete(input),
        Err(_) => return Err(DecodeError::MalformedHeader),
    };
    if cmd.len() > limits.max_header_len {
        return Err(too_long);
    }
    let command = Command::parse(cmd).ok_or_else(|| {
        let shown = cmd.get(..cmd.len().min(32)).unwrap_or_default();
        DecodeError::UnknownCommand(String::from_utf8_lossy(shown).into_owned())
    })?;
    let escapes = match dialect {
        _ if !command.escapes_headers() => None,
        Dialect::V10 => None,
        Dialect::V11 => Some(false),
        Dialect::V12 => Some(true),
    };
    let mut headers = Vec::new();
    loop {
        let (r, l) = match line(rest) {
            Ok(x) => x,
            Err(nom::Err::Incomplete(_)) => return incomplete(rest),
            Err(_) => return Err(DecodeError::MalformedHeader),
        };
        rest = r;
        if l.is_empty() {
            break;
        }
        if l.len() > limits.max_header_len {
            return Err(too_long);
        }
        if headers.len() >= limits.max_headers {
            return Err(DecodeError::TooManyHeaders {
                limit: limits.max_headers,
            });
        }
        let colon = l
            .iter()
            .position(|b| *b == b':')
            .ok_or(DecodeError::MalformedHeader)?;
        let (name, value) = (
            l.get(..colon).unwrap_or_default(),
            l.get(colon + 1..).unwrap_or_default(),
        );
        headers.push((text(name, escapes)?, text(value, escapes)?));
    }
    let len = input.len() - rest.len();
    if len > limits.max_frame {
        return Err(DecodeError::FrameTooLarge {
            limit: limits.max_frame,
        });
    }
    Ok(Some(Head {
        command,
        headers,
        len,
    }))
}

/// Unescapes (when `escapes` is `Some(cr_allowed)`) and checks UTF-8.
fn text(raw: &[u8], escapes: Option<bool>) -> Result<String, DecodeError> {
    let Some(cr) = escapes else {
        return String::from_utf8(raw.to_vec()).map_err(|_| DecodeError::NotUtf8);
    };
    if !raw.contains(&b'\\') {
        return String::from_utf8(raw.to_vec()).map_err(|_| DecodeError::NotUtf8);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut it = raw.iter();
    while let Some(b) = it.next() {
        if *b != b'\\' {
            out.push(*b);
            continue;
        }
        match it.next() {
            Some(b'n') => out.push(b'\n'),
            Some(b'r') if cr => out.push(b'\r'),
            Some(b'c') => out.push(b':'),
            Some(b'\\') => out.push(b'\\'),
            Some(other) => return Err(DecodeError::BadEscape(char::from(*other))),
            None => return Err(DecodeError::BadEscape(' ')),
        }
    }
    String::from_utf8(out).map_err(|_| DecodeError::NotUtf8)
}

fn content_length(headers: &[(String, String)]) -> Result<Option<usize>, DecodeError> {
    match headers.iter().find(|(n, _)| n == "content-length") {
        None => Ok(None),
        Some((_, v)) => {
            let v = v.trim();
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(DecodeError::BadContentLength);
            }
            v.parse::<usize>()
                .map(Some)
                .map_err(|_| DecodeError::BadContentLength)
        }
    }
}

/// Encodes under STOMP 1.2's escaping (see [`encode_with`]).
pub fn encode(frame: &Frame, out: &mut BytesMut) {
    encode_with(frame, out, Dialect::V12)
}

/// Appends a frame. A `content-length` header is added when the body is not empty and
/// the frame has none, so bodies may hold NULs. Under [`Dialect::V10`] and for
/// CONNECT/CONNECTED, which cannot escape, CR and LF are dropped from header values;
/// in names they (and ':') become '_', so the output always frames correctly and a
/// name never turns into another one (dropping the CR of `conte\rnt-length` would
/// make it a second, first-wins `content-length`).
pub fn encode_with(frame: &Frame, out: &mut BytesMut, dialect: Dialect) {
    let escapes = match dialect {
        _ if !frame.command.escapes_headers() => None,
        Dialect::V10 => None,
        Dialect::V11 => Some(false),
        Dialect::V12 => Some(true),
    };
    let size: usize = frame
        .headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + 2)
        .sum::<usize>()
        + frame.body.len()
        + 32;
    out.reserve(size);
    out.put_slice(frame.command.as_str().as_bytes());
    out.put_u8(b'\n');
    for (n, v) in &frame.headers {
        put_text(out, n, escapes, true);
        out.put_u8(b':');
        put_text(out, v, escapes, false);
        out.put_u8(b'\n');
    }
    if !frame.body.is_empty() && !frame.has("content-length") {
        out.put_slice(b"content-length:");
        out.put_slice(frame.body.len().to_string().as_bytes());
        out.put_u8(b'\n');
    }
    out.put_u8(b'\n');
    out.put_slice(&frame.body);
    out.put_u8(0);
}

fn put_text(out: &mut BytesMut, s: &str, escapes: Option<bool>, is_name: bool) {
    let bytes = s.as_bytes();
    // Almost every header is plain: one branch-free scan, then one copy.
    if !bytes.iter().fold(false, |any, &b| {
        any | matches!(b, b'\\' | b'\n' | b'\r' | b':')
    }) {
        out.put_slice(bytes);
        return;
    }
    // Copy runs of plain bytes in one go; only the few special bytes are replaced.
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let replacement: &[u8] = match (escapes, b) {
            (Some(_), b'\\') => b"\\\\",
            (Some(_), b'\n') => b"\\n",
            (Some(true), b'\r') => b"\\r",
            (Some(_), b':') => b"\\c",
            // what cannot be escaped: a name keeps a placeholder, so that it cannot
            // become another name (a value is never looked up by what it spells)
            (Some(false), b'\r') | (None, b'\n' | b'\r') if is_name => b"_",
            (None, b':') if is_name => b"_",
            // 1.1 cannot escape CR; unescaped ones would read as line ends
            (Some(false), b'\r') => b"",
            (None, b'\n' | b'\r') => b"",
            _ => continue,
        };
        out.put_slice(bytes.get(start..i).unwrap_or_default());
        out.put_slice(replacement);
        start = i + 1;
    }
    out.put_slice(bytes.get(start..).unwrap_or_default());
}

/// A heart-beat: one EOL.
pub const HEARTBEAT: &[u8] = b"\n";

/// Convenience for tests and clients: decode everything decodable in `bytes`.
pub fn decode_all(bytes: &[u8], limits: &Limits) -> Result<Vec<Frame>, DecodeError> {
    let mut buf = BytesMut::from(bytes);
    let mut out = Vec::new();
    while let Some(f) = decode(&mut buf, limits)? {
        out.push(f);
    }
    Ok(out)
}
