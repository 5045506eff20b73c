//! The replication protocol's frames (ARCHITECTURE.md, "Replication").
//!
//! A frame is `u32 length` (of what follows, big-endian), `u8 kind`, then the payload;
//! integers are big-endian, strings `u16 length` + UTF-8, data runs to the frame's end.
//! The follower speaks first (`Hello`); the leader answers `Welcome` or `Refused`, then
//! pushes `Journal`, `Snapshot`, `Log`, `Retained` and `Heartbeat`; the follower answers
//! `Ack`.
//! [`decode`] checks the declared length against its limit before buffering anything.

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// `Hello`'s magic.
pub const MAGIC: &[u8; 4] = b"TRPL";
/// The protocol version this build speaks (2: `Welcome` carries where shipping starts
/// and the leader's epoch history; 3: `Retained`).
pub const VERSION: u16 = 3;
/// The default largest frame (a data chunk is at most [`MAX_CHUNK`]).
pub const MAX_FRAME: usize = (1 << 20) + 64;
/// The largest piece of log, journal or snapshot one frame carries.
pub const MAX_CHUNK: usize = 1 << 20;
/// The longest node id.
pub const MAX_NODE_ID: usize = 255;
/// The most epoch-history entries a `Welcome` carries.
pub const MAX_HISTORY: usize = 1024;
/// The most segments a `Retained` lists (8 bytes each: within [`MAX_FRAME`]). A leader
/// holding more sends none, and its followers keep what they hold until it holds fewer.
pub const MAX_RETAINED: usize = 100_000;

/// Where a leader term began: its first commitlog offset and journal position (the
/// leader's ends when it was elected). See `crate::epochs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochEntry {
    pub epoch: u64,
    pub log_start: u64,
    pub journal_start: u64,
}

const HELLO: u8 = 1;
const WELCOME: u8 = 2;
const REFUSED: u8 = 3;
const LOG: u8 = 4;
const JOURNAL: u8 = 5;
const SNAPSHOT: u8 = 6;
const HEARTBEAT: u8 = 7;
const ACK: u8 = 8;
const RETAINED: u8 = 9;

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Follower → leader, first: who it is and what it holds durably.
    Hello {
        version: u16,
        node: String,
        epoch: u64,
        log_end: u64,
        journal_pos: u64,
        segment_size: u64,
    },
    /// Leader → follower: accepted. Shipping starts at `log_from` and `journal_from`:
    /// the Hello's positions, or lower when the follower holds a suffix of an older term
    /// that this leader does not (the follower truncates to them first). `history` is
    /// the leader's epoch history, which the follower adopts.
    Welcome {
        node: String,
        epoch: u64,
        log_from: u64,
        journal_from: u64,
        history: Vec<EpochEntry>,
    },
    /// Leader → follower: not accepted, and why (then the leader closes).
    Refused { reason: String },
    /// Commitlog bytes at `offset`.
    Log { offset: u64, data: Bytes },
    /// Metadata-journal bytes at position `pos`.
    Journal { pos: u64, data: Bytes },
    /// A piece (`offset` of `total` bytes) of the journal snapshot at position `pos`.
    Snapshot {
        pos: u64,
        offset: u64,
        total: u64,
        data: Bytes,
    },
    /// Leader → follower when its retention or compaction deleted segments: the start of
    /// every segment it holds (ascending), listed before it read its log end `log_end`
    /// and journal position `journal_pos`. Once the follower holds both durably (the
    /// compactions' copies, and the ack states journaled at the checkpoint that let the
    /// segments go), it deletes its sealed segments the list lacks below its last entry.
    Retained {
        log_end: u64,
        journal_pos: u64,
        segments: Vec<u64>,
    },
    /// Leader → follower when idle: the leader's ends (the follower acks).
    Heartbeat { log_end: u64, journal_pos: u64 },
    /// Follower → leader: what it holds on disk.
    Ack {
        log_durable: u64,
        journal_durable: u64,
    },
}

/// A violation: the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("frame of {0} bytes is over the limit of {1}")]
    TooLarge(usize, usize),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("malformed {0} frame")]
    Malformed(&'static str),
    #[error("not a replication peer (bad magic)")]
    BadMagic,
}

/// Encodes `f` onto `out`.
pub fn encode(f: &Frame, out: &mut BytesMut) {
    let start = out.len();
    out.put_u32(0);
    match f {
        Frame::Hello {
            version,
            node,
            epoch,
            log_end,
            journal_pos,
            segment_size,
        } => {
            out.put_u8(HELLO);
            out.put_slice(MAGIC);
            out.put_u16(*version);
            put_str(out, node);
            out.put_u64(*epoch);
            out.put_u64(*log_end);
            out.put_u64(*journal_pos);
            out.put_u64(*segment_size);
        }
        Frame::Welcome {
            node,
            epoch,
            log_from,
            journal_from,
            history,
        } => {
            out.put_u8(WELCOME);
            put_str(out, node);
            out.put_u64(*epoch);
            out.put_u64(*log_from);
            out.put_u64(*journal_from);
            // the newest entries when there are more than fit
            let skip = history.len().saturating_sub(MAX_HISTORY);
            out.put_u16((history.len() - skip) as u16);
            for e in history.iter().skip(skip) {
                out.put_u64(e.epoch);
                out.put_u64(e.log_start);
                out.put_u64(e.journal_start);
            }
        }
        Frame::Refused { reason } => {
            out.put_u8(REFUSED);
            put_str(out, reason);
        }
        Frame::Log { offset, data } => {
            out.put_u8(LOG);
            out.put_u64(*offset);
            out.put_slice(data);
        }
        Frame::Journal { pos, data } => {
            out.put_u8(JOURNAL);
            out.put_u64(*pos);
            out.put_slice(data);
        }
        Frame::Snapshot {
            pos,
            offset,
            total,
            data,
        } => {
            out.put_u8(SNAPSHOT);
            out.put_u64(*pos);
            out.put_u64(*offset);
            out.put_u64(*total);
            out.put_slice(data);
        }
        Frame::Heartbeat {
            log_end,
            journal_pos,
        } => {
            out.put_u8(HEARTBEAT);
            out.put_u64(*log_end);
            out.put_u64(*journal_pos);
        }
        Frame::Ack {
            log_durable,
            journal_durable,
        } => {
            out.put_u8(ACK);
            out.put_u64(*log_durable);
            out.put_u64(*journal_durable);
        }
        Frame::Retained {
            log_end,
            journal_pos,
            segments,
        } => {
            out.put_u8(RETAINED);
            out.put_u64(*log_end);
            out.put_u64(*journal_pos);
            // the senders list at most MAX_RETAINED; the decoder refuses more
            out.put_u32(u32::try_from(segments.len()).unwrap_or(u32::MAX));
            for s in segments {
                out.put_u64(*s);
            }
        }
    }
    let len = u32::try_from(out.len() - start - 4).unwrap_or(u32::MAX);
    if let Some(h) = out.get_mut(start..start + 4) {
        h.copy_from_slice(&len.to_be_bytes());
    }
}

/// A string of at most `u16::MAX` bytes (longer ones are cut at a character boundary).
fn put_str(out: &mut BytesMut, s: &str) {
    let mut n = s.len().min(u16::MAX as usize);
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    out.put_u16(n as u16);
    out.put_slice(s.as_bytes().get(..n).unwrap_or_default());
}

/// Decodes one frame from the front of `buf`: `Ok(None)` when more bytes are needed.
pub fn decode(buf: &mut BytesMut, max: usize) -> Result<Option<Frame>, DecodeError> {
    let Some(head) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(*head) as usize;
    if len > max {
        return Err(DecodeError::TooLarge(len, max));
    }
    if len == 0 {
        return Err(DecodeError::Malformed("empty"));
    }
    if buf.len() < 4 + len {
        buf.reserve(4 + len - buf.len());
        return Ok(None);
    }
    buf.advance(4);
    let mut p = buf.split_to(len).freeze();
    let kind = p.get_u8();
    let f = match kind {
        HELLO => {
            let what = "hello";
            if take(&mut p, 4, what)?.as_ref() != MAGIC {
                return Err(DecodeError::BadMagic);
            }
            let version = u16_(&mut p, what)?;
            let node = str_(&mut p, what)?;
            if node.len() > MAX_NODE_ID {
                return Err(DecodeError::Malformed("hello (node id too long)"));
            }
            Frame::Hello {
                version,
                node,
                epoch: u64_(&mut p, what)?,
                log_end: u64_(&mut p, what)?,
                journal_pos: u64_(&mut p, what)?,
                segment_size: u64_(&mut p, what)?,
            }
        }
        WELCOME => {
            let what = "welcome";
            let node = str_(&mut p, what)?;
            let epoch = u64_(&mut p, what)?;
            let log_from = u64_(&mut p, what)?;
            let journal_from = u64_(&mut p, what)?;
            let n = u16_(&mut p, what)? as usize;
            if n > MAX_HISTORY || p.len() != n * 24 {
                return Err(DecodeError::Malformed("welcome (epoch history)"));
            }
            let mut history = Vec::with_capacity(n);
            for _ in 0..n {
                history.push(EpochEntry {
                    epoch: u64_(&mut p, what)?,
                    log_start: u64_(&mut p, what)?,
                    journal_start: u64_(&mut p, what)?,
                });
            }
            Frame::Welcome {
                node,
                epoch,
                log_from,
                journal_from,
                history,
            }
        }
        REFUSED => Frame::Refused {
            reason: str_(&mut p, "refused")?,
        },
        LOG => Frame::Log {
            offset: u64_(&mut p, "log")?,
            data: std::mem::take(&mut p),
        },
        JOURNAL => Frame::Journal {
            pos: u64_(&mut p, "journal")?,
            data: std::mem::take(&mut p),
        },
        SNAPSHOT => Frame::Snapshot {
            pos: u64_(&mut p, "snapshot")?,
            offset: u64_(&mut p, "snapshot")?,
            total: u64_(&mut p, "snapshot")?,
            data: std::mem::take(&mut p),
        },
        HEARTBEAT => Frame::Heartbeat {
            log_end: u64_(&mut p, "heartbeat")?,
            journal_pos: u64_(&mut p, "heartbeat")?,
        },
        ACK => Frame::Ack {
            log_durable: u64_(&mut p, "ack")?,
            journal_durable: u64_(&mut p, "ack")?,
        },
        RETAINED => {
            let what = "retained";
            let log_end = u64_(&mut p, what)?;
            let journal_pos = u64_(&mut p, what)?;
            let n = u32_(&mut p, what)? as usize;
            // the count is checked against the bytes there before anything is allocated
            if n > MAX_RETAINED || p.len() != n * 8 {
                return Err(DecodeError::Malformed("retained (segment list)"));
            }
            let mut segments = Vec::with_capacity(n);
            for _ in 0..n {
                let s = u64_(&mut p, what)?;
                if segments.last().is_some_and(|l| *l >= s) {
                    return Err(DecodeError::Malformed("retained (not ascending)"));
                }
                segments.push(s);
            }
            Frame::Retained {
                log_end,
                journal_pos,
                segments,
            }
        }
        k => return Err(DecodeError::UnknownKind(k)),
    };
    if !p.is_empty() {
        return Err(DecodeError::Malformed("trailing bytes"));
    }
    Ok(Some(f))
}

fn take(p: &mut Bytes, n: usize, what: &'static str) -> Result<Bytes, DecodeError> {
    if p.len() < n {
        return Err(DecodeError::Malformed(what));
    }
    Ok(p.split_to(n))
}

fn u16_(p: &mut Bytes, what: &'static str) -> Result<u16, DecodeError> {
    let b = take(p, 2, what)?;
    let mut a = [0u8; 2];
    a.copy_from_slice(&b);
    Ok(u16::from_be_bytes(a))
}

fn u32_(p: &mut Bytes, what: &'static str) -> Result<u32, DecodeError> {
    let b = take(p, 4, what)?;
    let mut a = [0u8; 4];
    a.copy_from_slice(&b);
    Ok(u32::from_be_bytes(a))
}

fn u64_(p: &mut Bytes, what: &'static str) -> Result<u64, DecodeError> {
    let b = take(p, 8, what)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(&b);
    Ok(u64::from_be_bytes(a))
}

fn str_(p: &mut Bytes, what: &'static str) -> Result<String, DecodeError> {
    let n = u16_(p, what)? as usize;
    let b = take(p, n, what)?;
    String::from_utf8(b.to_vec()).map_err(|_| DecodeError::Malformed(what))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<Frame> {
        vec![
            Frame::Hello {
                version: VERSION,
                node: "f1".into(),
                epoch: 3,
                log_end: 1 << 40,
                journal_pos: 77,
                segment_size: 4 << 20,
            },
            Frame::Welcome {
                node: "leader-é".into(),
                epoch: 3,
                log_from: 10,
                journal_from: 0,
                history: vec![
                    EpochEntry {
                        epoch: 1,
                        log_start: 0,
                        journal_start: 0,
                    },
                    EpochEntry {
                        epoch: 3,
                        log_start: 4096,
                        journal_start: 77,
                    },
                ],
            },
            Frame::Welcome {
                node: "l".into(),
                epoch: 0,
                log_from: 0,
                journal_from: 0,
                history: vec![],
            },
            Frame::Refused {
                reason: "offset gone".into(),
            },
            Frame::Log {
                offset: 4096,
                data: Bytes::from_static(b"abc"),
            },
            Frame::Log {
                offset: 0,
                data: Bytes::new(),
            },
            Frame::Journal {
                pos: 9,
                data: Bytes::from(vec![7u8; 1000]),
            },
            Frame::Snapshot {
                pos: 10,
                offset: 5,
                total: 20,
                data: Bytes::from_static(b"xyz"),
            },
            Frame::Heartbeat {
                log_end: 1,
                journal_pos: 2,
            },
            Frame::Ack {
                log_durable: u64::MAX,
                journal_durable: 0,
            },
            Frame::Retained {
                log_end: 1 << 33,
                journal_pos: 5,
                segments: vec![0, 4 << 20, 12 << 20],
            },
            Frame::Retained {
                log_end: 0,
                journal_pos: 0,
                segments: vec![],
            },
        ]
    }

    #[test]
    fn every_frame_round_trips_whole_and_split_at_every_byte() {
        let mut wire = BytesMut::new();
        for f in all() {
            encode(&f, &mut wire);
        }
        let wire = wire.freeze();
        // whole
        let mut buf = BytesMut::from(&wire[..]);
        let mut got = Vec::new();
        while let Some(f) = decode(&mut buf, MAX_FRAME).unwrap() {
            got.push(f);
        }
        assert_eq!(got, all());
        assert!(buf.is_empty());
        // fed one byte at a time: the same frames, `None` in between
        let mut buf = BytesMut::new();
        let mut got = Vec::new();
        for b in wire.iter() {
            buf.put_u8(*b);
            while let Some(f) = decode(&mut buf, MAX_FRAME).unwrap() {
                got.push(f);
            }
        }
        assert_eq!(got, all());
    }

    #[test]
    fn violations_are_errors_not_waits() {
        // declared length over the limit: refused before buffering
        let mut buf = BytesMut::from(&[0xff, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            decode(&mut buf, MAX_FRAME),
            Err(DecodeError::TooLarge(..))
        ));
        let mut buf = BytesMut::from(&[0, 0, 0, 0][..]);
        assert!(decode(&mut buf, MAX_FRAME).is_err());
        let mut buf = BytesMut::from(&[0, 0, 0, 1, 99][..]);
        assert_eq!(
            decode(&mut buf, MAX_FRAME),
            Err(DecodeError::UnknownKind(99))
        );
        // short fixed fields
        let mut buf = BytesMut::from(&[0, 0, 0, 3, ACK, 1, 2][..]);
        assert!(matches!(
            decode(&mut buf, MAX_FRAME),
            Err(DecodeError::Malformed(_))
        ));
        // trailing bytes after a fixed frame
        let mut out = BytesMut::new();
        encode(
            &Frame::Heartbeat {
                log_end: 1,
                journal_pos: 2,
            },
            &mut out,
        );
        out.put_u8(0);
        out[3] += 1;
        assert!(decode(&mut out, MAX_FRAME).is_err());
        // an epoch history whose count does not match its bytes, or is over the bound
        let mut out = BytesMut::new();
        encode(&all()[1], &mut out);
        out.truncate(out.len() - 1);
        out[3] -= 1;
        assert!(matches!(
            decode(&mut out, MAX_FRAME),
            Err(DecodeError::Malformed(_))
        ));
        let mut out = BytesMut::new();
        encode(&all()[2], &mut out);
        let at = out.len() - 2;
        out[at..].copy_from_slice(&(MAX_HISTORY as u16 + 1).to_be_bytes());
        assert!(matches!(
            decode(&mut out, MAX_FRAME),
            Err(DecodeError::Malformed(_))
        ));
        // a segment list whose count does not match its bytes, is over the bound, or is
        // not ascending
        let retained = |segments: Vec<u64>| {
            let mut out = BytesMut::new();
            encode(
                &Frame::Retained {
                    log_end: 9,
                    journal_pos: 9,
                    segments,
                },
                &mut out,
            );
            out
        };
        let mut out = retained(vec![1, 2]);
        out.truncate(out.len() - 1);
        out[3] -= 1;
        assert!(matches!(
            decode(&mut out, MAX_FRAME),
            Err(DecodeError::Malformed(_))
        ));
        let mut out = retained(vec![]);
        let at = out.len() - 4;
        out[at..].copy_from_slice(&(MAX_RETAINED as u32 + 1).to_be_bytes());
        assert!(matches!(
            decode(&mut out, MAX_FRAME),
            Err(DecodeError::Malformed(_))
        ));
        for list in [vec![5, 5], vec![6, 5]] {
            assert!(matches!(
                decode(&mut retained(list), MAX_FRAME),
                Err(DecodeError::Malformed(_))
            ));
        }
        // the longest list fits in a frame
        let mut out = retained((0..MAX_RETAINED as u64).collect());
        assert!(matches!(decode(&mut out, MAX_FRAME), Ok(Some(_))));
        // somebody else's protocol
        let mut out = BytesMut::new();
        encode(&all()[0], &mut out);
        out[5] = b'X';
        assert_eq!(decode(&mut out, MAX_FRAME), Err(DecodeError::BadMagic));
        // a string that is not UTF-8
        let mut out = BytesMut::new();
        encode(
            &Frame::Refused {
                reason: "ab".into(),
            },
            &mut out,
        );
        out[7] = 0xff;
        assert!(decode(&mut out, MAX_FRAME).is_err());
    }
}
