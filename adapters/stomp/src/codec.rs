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
    /// After login: frames of 129 MiB (a body of RabbitMQ's default `max_message_size`,
    /// 128 MiB, plus 1 MiB for the command and headers; the broker derives it from its
    /// `limits.max_message_size`), up to 1000 headers of up to 64 KiB each.
    pub const AUTHENTICATED: Limits = Limits {
        max_frame: (128 << 20) + (1 << 20),
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
/// (heart-beats already consumed). Stateless: a frame that arrives in many reads is
/// parsed again from its start each time; a connection uses a [`Decoder`] instead.
pub fn decode_with(
    buf: &mut BytesMut,
    limits: &Limits,
    dialect: Dialect,
) -> Result<Option<Frame>, DecodeError> {
    Decoder::default().decode(buf, limits, dialect)
}

/// The frame being decoded at the front of a connection's buffer, kept between reads so
/// each byte is looked at once however the frame is split: the head lines already parsed
/// and how far the body was searched for its NUL. (Parsing from the start on every read
/// made a frame trickled in small pieces cost its size squared: a 4 MiB body without
/// `content-length`, a byte per read, was rescanned whole for each byte.)
#[derive(Debug, Default)]
pub struct Decoder {
    command: Option<Command>,
    /// `Some(cr_allowed)` when header text is escaped (see [`Dialect`]).
    escapes: Option<bool>,
    headers: Vec<(String, String)>,
    /// Bytes of the buffer parsed as complete head lines.
    parsed: usize,
    /// Set once the blank line ending the head is parsed: `content-length`, if any.
    body: Option<Option<usize>>,
    /// Body bytes already known to hold no NUL (a body without `content-length`).
    searched: usize,
}

impl Decoder {
    /// As [`decode_with`], resuming where the last call for the same buffer stopped. The
    /// buffer must only have grown at its end since then; after `Ok(Some)` or `Err` the
    /// decoder starts afresh.
    pub fn decode(
        &mut self,
        buf: &mut BytesMut,
        limits: &Limits,
        dialect: Dialect,
    ) -> Result<Option<Frame>, DecodeError> {
        if self.parsed == 0 {
            skip_heartbeats(buf)?;
            if buf.is_empty() {
                return Ok(None);
            }
        }
        let r = self.step(buf, limits, dialect);
        if !matches!(r, Ok(None)) {
            *self = Decoder::default();
        }
        r
    }

    fn step(
        &mut self,
        buf: &mut BytesMut,
        limits: &Limits,
        dialect: Dialect,
    ) -> Result<Option<Frame>, DecodeError> {
        let content_length = match self.body {
            Some(cl) => cl,
            None => match self.head(buf, limits, dialect)? {
                Some(cl) => cl,
                None => return Ok(None),
            },
        };
        let head_len = self.parsed;
        let rest = buf.get(head_len..).unwrap_or_default();
        let (body_len, total) = match content_length {
            Some(n) => {
                let total = head_len
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
            None => {
                let unsearched = rest.get(self.searched..).unwrap_or_default();
                match unsearched.iter().position(|b| *b == 0) {
                    Some(p) if head_len + self.searched + p <= limits.max_frame => {
                        let p = self.searched + p;
                        (p, head_len + p + 1)
                    }
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
                    None => {
                        self.searched = rest.len();
                        return Ok(None);
                    }
                }
            }
        };
        let command = self.command.ok_or(DecodeError::MalformedHeader)?;
        let mut whole = buf.split_to(total);
        whole.advance(head_len);
        whole.truncate(body_len);
        Ok(Some(Frame {
            command,
            headers: std::mem::take(&mut self.headers),
            body: whole.freeze(),
        }))
    }

    /// The whole size of the frame being decoded (head, body and NUL) once its head is
    /// parsed and it declared a `content-length` (checked against the limits already):
    /// the driver reserves that much once instead of growing its buffer read by read.
    pub fn pending_len(&self) -> Option<usize> {
        match self.body {
            Some(Some(n)) => self.parsed.checked_add(n)?.checked_add(1),
            _ => None,
        }
    }

    /// Parses the head's complete lines not parsed yet. `Some(content_length)` once the
    /// blank line ending the head is parsed; `None` when the head is not complete yet (and
    /// within limits).
    fn head(
        &mut self,
        buf: &[u8],
        limits: &Limits,
        dialect: Dialect,
    ) -> Result<Option<Option<usize>>, DecodeError> {
        let too_long = || DecodeError::HeaderTooLong {
            limit: limits.max_header_len,
        };
        loop {
            let rest = buf.get(self.parsed..).unwrap_or_default();
            let Some(nl) = rest.iter().position(|b| *b == b'\n') else {
                return if buf.len() > limits.max_frame {
                    Err(DecodeError::FrameTooLarge {
                        limit: limits.max_frame,
                    })
                } else if rest.len() > limits.max_header_len {
                    Err(too_long())
                } else {
                    Ok(None)
                };
            };
            let raw = rest.get(..nl).unwrap_or_default();
            let l = raw.strip_suffix(b"\r").unwrap_or(raw);
            self.parsed += nl + 1;
            if self.command.is_none() {
                if l.len() > limits.max_header_len {
                    return Err(too_long());
                }
                let command = Command::parse(l).ok_or_else(|| {
                    let shown = l.get(..l.len().min(32)).unwrap_or_default();
                    DecodeError::UnknownCommand(String::from_utf8_lossy(shown).into_owned())
                })?;
                self.escapes = match dialect {
                    _ if !command.escapes_headers() => None,
                    Dialect::V10 => None,
                    Dialect::V11 => Some(false),
                    Dialect::V12 => Some(true),
                };
                self.command = Some(command);
                continue;
            }
            if l.is_empty() {
                if self.parsed > limits.max_frame {
                    return Err(DecodeError::FrameTooLarge {
                        limit: limits.max_frame,
                    });
                }
                let cl = content_length(&self.headers)?;
                self.body = Some(cl);
                return Ok(Some(cl));
            }
            if l.len() > limits.max_header_len {
                return Err(too_long());
            }
            if self.headers.len() >= limits.max_headers {
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
            self.headers
                .push((text(name, self.escapes)?, text(value, self.escapes)?));
        }
    }
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
    out.reserve(frame.body.len() + 1);
    encode_head_with(frame, out, dialect);
    out.put_slice(&frame.body);
    out.put_u8(0);
}

/// Appends what [`encode_with`] writes before the body: the command, the headers and
/// the blank line. The frame is then the body's bytes and one NUL: a writer may send
/// a large body from its own (shared) buffer instead of copying it after the head.
pub fn encode_head_with(frame: &Frame, out: &mut BytesMut, dialect: Dialect) {
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A frame trickled in small pieces is parsed as it arrives, never from its start
    /// again: the head lines once, the body searched for its NUL from where the last
    /// search stopped.
    #[test]
    fn a_trickled_frame_is_looked_at_once() {
        let limits = Limits::AUTHENTICATED;
        let mut d = Decoder::default();
        let mut buf = BytesMut::new();
        let head = b"SEND\ndestination:/queue/a\nx-note:a\\cb\n\n";
        for b in head.iter().take(head.len() - 1) {
            buf.extend_from_slice(&[*b]);
            assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
        }
        assert_eq!(
            d.headers.len(),
            2,
            "complete header lines parsed as they arrive"
        );
        assert_eq!(d.headers[1], ("x-note".into(), "a:b".into()));
        buf.extend_from_slice(b"\n");
        assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
        assert_eq!((d.parsed, d.body), (head.len(), Some(None)));
        for i in 1..=1000 {
            buf.extend_from_slice(b"xy");
            assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
            assert_eq!(d.searched, 2 * i, "the body is searched only past what was");
        }
        buf.extend_from_slice(b"z\0\n");
        let f = d.decode(&mut buf, &limits, Dialect::V12).unwrap().unwrap();
        assert_eq!(f.command, Command::Send);
        assert_eq!(f.body.len(), 2001);
        assert_eq!(f.headers.len(), 2);
        assert_eq!(
            (d.parsed, d.searched, d.headers.len()),
            (0, 0, 0),
            "reset for the next frame"
        );
        assert_eq!(&buf[..], b"\n", "the next frame's bytes stay");
    }

    /// Once the head declared a `content-length`, the whole frame's size is known (for
    /// the driver to reserve once); not before, and not without one.
    #[test]
    fn the_pending_length_is_known_from_the_head() {
        let limits = Limits::AUTHENTICATED;
        let mut d = Decoder::default();
        let head = b"SEND\ndestination:/queue/a\ncontent-length:1000\n\n";
        let mut buf = BytesMut::from(&head[..head.len() - 1]);
        assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
        assert_eq!(d.pending_len(), None);
        buf.extend_from_slice(b"\nab");
        assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
        assert_eq!(d.pending_len(), Some(head.len() + 1000 + 1));
        let mut d = Decoder::default();
        let mut buf = BytesMut::from(&b"SEND\n\nab"[..]);
        assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
        assert_eq!(
            d.pending_len(),
            None,
            "no content-length: read up to the NUL"
        );
    }

    /// The head alone, then the body and a NUL, is the whole frame.
    #[test]
    fn head_then_body_is_the_frame() {
        let f = Frame::new(Command::Message)
            .with("destination", "/topic/a:b")
            .with_body(vec![0u8, 1, 2]);
        let (mut whole, mut head) = (BytesMut::new(), BytesMut::new());
        encode_with(&f, &mut whole, Dialect::V12);
        encode_head_with(&f, &mut head, Dialect::V12);
        head.extend_from_slice(&f.body);
        head.put_u8(0);
        assert_eq!(whole, head);
    }

    /// Limits and malformed lines are still caught before the head is complete.
    #[test]
    fn an_incomplete_head_is_still_checked() {
        let limits = Limits::UNAUTHENTICATED;
        let mut d = Decoder::default();
        let mut buf = BytesMut::from(&b"SEND\nno colon here\n"[..]);
        assert!(matches!(
            d.decode(&mut buf, &limits, Dialect::V12),
            Err(DecodeError::MalformedHeader)
        ));
        let mut d = Decoder::default();
        let mut buf = BytesMut::from(&b"SEND\na:"[..]);
        assert!(d.decode(&mut buf, &limits, Dialect::V12).unwrap().is_none());
        buf.extend_from_slice(&vec![b'v'; limits.max_header_len]);
        assert!(matches!(
            d.decode(&mut buf, &limits, Dialect::V12),
            Err(DecodeError::HeaderTooLong { .. })
        ));
        let mut d = Decoder::default();
        let mut buf = BytesMut::from(&b"SEND\n"[..]);
        for i in 0..=limits.max_headers {
            buf.extend_from_slice(format!("h{i}:v\n").as_bytes());
        }
        assert!(matches!(
            d.decode(&mut buf, &limits, Dialect::V12),
            Err(DecodeError::TooManyHeaders { .. })
        ));
    }
}
