//! The commitlog record: self-describing and CRC32C-checked, so that recovery can rebuild
//! every consume queue and index entry from the log alone and stop at a torn tail.
//!
//! All integers are little-endian. Every record starts with the same 12 bytes:
//!
//! ```text
//! 0  u32 total length (including these 12 bytes)
//! 4  u32 magic: MESSAGE, ACK or END_OF_SEGMENT
//! 8  u32 CRC32C of bytes 12..total length (0 for END_OF_SEGMENT)
//! ```
//!
//! A MESSAGE continues with
//!
//! ```text
//! u16 flags, u64 store timestamp ms, u64 born timestamp ms, u64 tag hash,
//! u16 queue count, (u32 queue id, u64 queue offset) * count,
//! u16 key count, (u16 length, bytes) * count,
//! u32 properties length, properties (opaque to the store),
//! u32 body length, body
//! ```
//!
//! An ACK records consumed consume-queue entries of one queue:
//!
//! ```text
//! u16 flags, u64 store timestamp ms, u32 queue id,
//! u32 range count, (u64 start, u64 end) * count      (half-open logical ranges)
//! ```
//!
//! END_OF_SEGMENT pads the rest of a segment (RocketMQ's BLANK_MAGIC_CODE): its length runs
//! to the segment's end and nothing follows it there. A record never straddles segments.

use crate::error::{Result, StoreError};

pub const MAGIC_MESSAGE: u32 = u32::from_le_bytes(*b"TRM1");
pub const MAGIC_ACK: u32 = u32::from_le_bytes(*b"TRA1");
pub const MAGIC_END_OF_SEGMENT: u32 = u32::from_le_bytes(*b"TRE0");

/// Length of the common record header.
pub const HEADER_LEN: usize = 12;
/// The smallest padding record: length and magic.
pub const MIN_PADDING: u64 = 8;
/// Message flag: the publisher asked for persistence (delivery-mode 2, QoS > 0).
pub const FLAG_PERSISTENT: u16 = 1;
/// Message flag: stored by the broker's dead-lettering, so the `x-death` header in its
/// properties is the broker's own record (a client-published one is not trusted).
pub const FLAG_DEAD_LETTERED: u16 = 2;

/// Most queues one message may be stored for.
pub const MAX_QUEUES: usize = u16::MAX as usize;
/// Most keys one message may be indexed under, and the longest key.
pub const MAX_KEYS: usize = 64;
pub const MAX_KEY_LEN: usize = u16::MAX as usize;

/// A message to append. Queue offsets are assigned by the store.
#[derive(Debug, Clone, Copy, Default)]
pub struct NewMessage<'a> {
    /// Queues the message was routed to (at least one).
    pub queues: &'a [u32],
    /// `FLAG_*` bits.
    pub flags: u16,
    /// When the publisher's message reached the broker (ms since the epoch).
    pub born_ts_ms: u64,
    /// Stored in every consume-queue entry of the message (e.g. a hash of its routing key).
    pub tag_hash: u64,
    /// Keys for the index (message id, business keys).
    pub keys: &'a [&'a [u8]],
    /// Encoded properties; opaque to the store.
    pub properties: &'a [u8],
    pub body: &'a [u8],
}

fn too_large(size: usize) -> StoreError {
    StoreError::TooLarge {
        size: size as u64,
        max: u32::MAX as u64,
    }
}

/// Length of the record `msg` encodes to.
pub fn message_len(msg: &NewMessage<'_>) -> Result<usize> {
    if msg.queues.len() > MAX_QUEUES {
        return Err(StoreError::Invalid(format!(
            "{} target queues, at most {MAX_QUEUES}",
            msg.queues.len()
        )));
    }
    if msg.keys.len() > MAX_KEYS {
        return Err(StoreError::Invalid(format!(
            "{} keys, at most {MAX_KEYS}",
            msg.keys.len()
        )));
    }
    let mut len = HEADER_LEN + 2 + 8 + 8 + 8 + 2 + msg.queues.len() * 12 + 2 + 4 + 4;
    for k in msg.keys {
        if k.len() > MAX_KEY_LEN {
            return Err(StoreError::Invalid(format!(
                "key of {} bytes, at most {MAX_KEY_LEN}",
                k.len()
            )));
        }
        len += 2 + k.len();
    }
    len = len
        .checked_add(msg.properties.len())
        .and_then(|l| l.checked_add(msg.body.len()))
        .ok_or_else(|| too_large(usize::MAX))?;
    if len > u32::MAX as usize {
        return Err(too_large(len));
    }
    Ok(len)
}

/// A cursor that writes into a slice; callers size the slice with `message_len` /
/// `ack_len` first, so running out of room is a bug reported as an error, not a panic.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        let end = self.pos + bytes.len();
        let dst = self
            .buf
            .get_mut(self.pos..end)
            .ok_or_else(|| StoreError::Invalid("record buffer too small".into()))?;
        dst.copy_from_slice(bytes);
        self.pos = end;
        Ok(())
    }
    fn u16(&mut self, v: u16) -> Result<()> {
        self.put(&v.to_le_bytes())
    }
    fn u32(&mut self, v: u32) -> Result<()> {
        self.put(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) -> Result<()> {
        self.put(&v.to_le_bytes())
    }
}

/// Fills in length, magic and CRC once the payload (from byte 12 on) is in place.
fn seal(buf: &mut [u8], magic: u32) -> Result<()> {
    let len = u32::try_from(buf.len()).map_err(|_| too_large(buf.len()))?;
    let crc = crc32c::crc32c(buf.get(HEADER_LEN..).unwrap_or_default());
    let head = buf
        .get_mut(..HEADER_LEN)
        .ok_or_else(|| StoreError::Invalid("record shorter than its header".into()))?;
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&len.to_le_bytes());
    h[4..8].copy_from_slice(&magic.to_le_bytes());
    h[8..].copy_from_slice(&crc.to_le_bytes());
    head.copy_from_slice(&h);
    Ok(())
}

/// Encodes `msg` into `buf`, which must be exactly `message_len(msg)` bytes long.
pub fn encode_message(
    buf: &mut [u8],
    msg: &NewMessage<'_>,
    store_ts_ms: u64,
    queue_offsets: &[u64],
) -> Result<()> {
    if queue_offsets.len() != msg.queues.len() {
        return Err(StoreError::Invalid("one queue offset per queue".into()));
    }
    let mut w = Writer {
        buf,
        pos: HEADER_LEN,
    };
    w.u16(msg.flags)?;
    w.u64(store_ts_ms)?;
    w.u64(msg.born_ts_ms)?;
    w.u64(msg.tag_hash)?;
    w.u16(msg.queues.len() as u16)?;
    for (q, off) in msg.queues.iter().zip(queue_offsets) {
        w.u32(*q)?;
        w.u64(*off)?;
    }
    w.u16(msg.keys.len() as u16)?;
    for k in msg.keys {
        w.u16(k.len() as u16)?;
        w.put(k)?;
    }
    w.u32(msg.properties.len() as u32)?;
    w.put(msg.properties)?;
    w.u32(msg.body.len() as u32)?;
    w.put(msg.body)?;
    if w.pos != w.buf.len() {
        return Err(StoreError::Invalid("record buffer size mismatch".into()));
    }
    seal(buf, MAGIC_MESSAGE)
}

/// Length of an ack record with `ranges` ranges.
pub fn ack_len(ranges: usize) -> usize {
    HEADER_LEN + 2 + 8 + 4 + 4 + ranges * 16
}

/// Encodes an ack record into `buf` (exactly `ack_len(ranges.len())` bytes).
pub fn encode_ack(
    buf: &mut [u8],
    store_ts_ms: u64,
    queue: u32,
    ranges: &[(u64, u64)],
) -> Result<()> {
    let mut w = Writer {
        buf,
        pos: HEADER_LEN,
    };
    w.u16(0)?;
    w.u64(store_ts_ms)?;
    w.u32(queue)?;
    w.u32(u32::try_from(ranges.len()).map_err(|_| too_large(ranges.len()))?)?;
    for (s, e) in ranges {
        w.u64(*s)?;
        w.u64(*e)?;
    }
    seal(buf, MAGIC_ACK)
}

/// Writes an end-of-segment padding header at the start of `buf` (whose length is the
/// padding's length, at least `MIN_PADDING`).
pub fn encode_padding(buf: &mut [u8]) -> Result<()> {
    let len = u32::try_from(buf.len()).map_err(|_| too_large(buf.len()))?;
    let head = buf
        .get_mut(..MIN_PADDING as usize)
        .ok_or_else(|| StoreError::Invalid("padding shorter than 8 bytes".into()))?;
    let mut h = [0u8; MIN_PADDING as usize];
    h[..4].copy_from_slice(&len.to_le_bytes());
    h[4..].copy_from_slice(&MAGIC_END_OF_SEGMENT.to_le_bytes());
    head.copy_from_slice(&h);
    Ok(())
}

/// A bounds-checked reader over a record.
#[derive(Clone)]
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_le_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }
}

/// A decoded message record borrowing the bytes it was decoded from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageView<'a> {
    pub flags: u16,
    pub store_ts_ms: u64,
    pub born_ts_ms: u64,
    pub tag_hash: u64,
    /// `(queue id, queue offset)` pairs, 12 bytes each, still encoded.
    queues_raw: &'a [u8],
    /// Keys, still encoded.
    keys_raw: &'a [u8],
    key_count: u16,
    /// Byte range of the properties within the record.
    pub properties: std::ops::Range<usize>,
    /// Byte range of the body within the record.
    pub body: std::ops::Range<usize>,
}

impl<'a> MessageView<'a> {
    /// `(queue id, queue offset)` of every queue the message was stored for.
    pub fn queues(&self) -> impl Iterator<Item = (u32, u64)> + 'a {
        self.queues_raw.chunks_exact(12).map(|c| {
            let mut r = Reader { buf: c, pos: 0 };
            (r.u32().unwrap_or(0), r.u64().unwrap_or(0))
        })
    }
    /// The message's index keys.
    pub fn keys(&self) -> impl Iterator<Item = &'a [u8]> + 'a {
        let mut r = Reader {
            buf: self.keys_raw,
            pos: 0,
        };
        (0..self.key_count).map_while(move |_| {
            let n = r.u16()? as usize;
            r.take(n)
        })
    }
}

/// A decoded ack record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckView<'a> {
    pub store_ts_ms: u64,
    pub queue: u32,
    ranges_raw: &'a [u8],
}

impl<'a> AckView<'a> {
    /// The acked half-open ranges of logical offsets.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64)> + 'a {
        self.ranges_raw.chunks_exact(16).map(|c| {
            let mut r = Reader { buf: c, pos: 0 };
            (r.u64().unwrap_or(0), r.u64().unwrap_or(0))
        })
    }
}

/// What a scan finds at a position of a segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A valid message record of `len` bytes.
    Message { len: u64, view: MessageView<'a> },
    /// A valid ack record of `len` bytes.
    Ack { len: u64, view: AckView<'a> },
    /// End-of-segment padding: nothing more in this segment.
    Padding,
    /// Zeroes: nothing was ever written here.
    Empty,
    /// A torn or corrupt record.
    Invalid(String),
}

/// Decodes the record at the start of `buf` (`buf` runs to the segment's end). Never
/// panics and never trusts a length it has not checked against `buf`.
pub fn decode(buf: &[u8]) -> Decoded<'_> {
    decode_with(buf, true)
}

/// As [`decode`] without the CRC check: for a scan that reads only the header fields of
/// most records (compaction looking for live ones) and verifies those it uses with
/// [`verify`]. Still never panics and never trusts an unchecked length.
pub fn decode_unverified(buf: &[u8]) -> Decoded<'_> {
    decode_with(buf, false)
}

/// Whether the CRC of the record `rec` (exactly one record's bytes) matches.
pub fn verify(rec: &[u8]) -> bool {
    match (rec.get(8..12), rec.get(HEADER_LEN..)) {
        (Some(crc), Some(payload)) => crc32c::crc32c(payload).to_le_bytes() == *crc,
        _ => false,
    }
}

fn decode_with(buf: &[u8], check_crc: bool) -> Decoded<'_> {
    let mut r = Reader { buf, pos: 0 };
    let (Some(len), Some(magic)) = (r.u32(), r.u32()) else {
        return if buf.iter().all(|b| *b == 0) {
            Decoded::Empty
        } else {
            Decoded::Invalid("truncated header".into())
        };
    };
    if len == 0 && magic == 0 {
        return Decoded::Empty;
    }
    if magic == MAGIC_END_OF_SEGMENT {
        return if len as usize == buf.len() {
            Decoded::Padding
        } else {
            Decoded::Invalid(format!("padding of {len} bytes where {} remain", buf.len()))
        };
    }
    if magic != MAGIC_MESSAGE && magic != MAGIC_ACK {
        return Decoded::Invalid(format!("bad magic {magic:#010x}"));
    }
    let len = len as usize;
    if len < HEADER_LEN {
        return Decoded::Invalid(format!("length {len} shorter than a header"));
    }
    let Some(rec) = buf.get(..len) else {
        return Decoded::Invalid(format!("length {len} runs past the segment end"));
    };
    let Some(crc) = r.u32() else {
        return Decoded::Invalid("truncated header".into());
    };
    let payload = rec.get(HEADER_LEN..).unwrap_or_default();
    if check_crc && crc32c::crc32c(payload) != crc {
        return Decoded::Invalid("checksum mismatch".into());
    }
    let parsed = if magic == MAGIC_MESSAGE {
        parse_message(rec).map(|view| Decoded::Message {
            len: len as u64,
            view,
        })
    } else {
        parse_ack(rec).map(|view| Decoded::Ack {
            len: len as u64,
            view,
        })
    };
    parsed.unwrap_or_else(|| Decoded::Invalid("fields overrun the record".into()))
}

fn parse_message(rec: &[u8]) -> Option<MessageView<'_>> {
    let mut r = Reader {
        buf: rec,
        pos: HEADER_LEN,
    };
    let flags = r.u16()?;
    let store_ts_ms = r.u64()?;
    let born_ts_ms = r.u64()?;
    let tag_hash = r.u64()?;
    let nq = r.u16()? as usize;
    let queues_raw = r.take(nq.checked_mul(12)?)?;
    let key_count = r.u16()?;
    let keys_start = r.pos;
    for _ in 0..key_count {
        let n = r.u16()? as usize;
        r.take(n)?;
    }
    let keys_raw = rec.get(keys_start..r.pos)?;
    let plen = r.u32()? as usize;
    let pstart = r.pos;
    r.take(plen)?;
    let blen = r.u32()? as usize;
    let bstart = r.pos;
    r.take(blen)?;
    if r.pos != rec.len() {
        return None;
    }
    Some(MessageView {
        flags,
        store_ts_ms,
        born_ts_ms,
        tag_hash,
        queues_raw,
        keys_raw,
        key_count,
        properties: pstart..pstart + plen,
        body: bstart..bstart + blen,
    })
}

fn parse_ack(rec: &[u8]) -> Option<AckView<'_>> {
    let mut r = Reader {
        buf: rec,
        pos: HEADER_LEN,
    };
    let _flags = r.u16()?;
    let store_ts_ms = r.u64()?;
    let queue = r.u32()?;
    let n = r.u32()? as usize;
    let ranges_raw = r.take(n.checked_mul(16)?)?;
    if r.pos != rec.len() {
        return None;
    }
    Some(AckView {
        store_ts_ms,
        queue,
        ranges_raw,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encode(msg: &NewMessage<'_>, offs: &[u64]) -> Vec<u8> {
        let mut buf = vec![0u8; message_len(msg).unwrap()];
        encode_message(&mut buf, msg, 42, offs).unwrap();
        buf
    }

    #[test]
    fn message_round_trip() {
        let keys: [&[u8]; 2] = [b"id-1", b""];
        let msg = NewMessage {
            queues: &[7, 9],
            flags: FLAG_PERSISTENT,
            born_ts_ms: 41,
            tag_hash: 0,
            keys: &keys,
            properties: b"props",
            body: b"hello",
        };
        let buf = encode(&msg, &[100, 200]);
        let Decoded::Message { len, view } = decode(&buf) else {
            panic!("not a message")
        };
        assert_eq!(len as usize, buf.len());
        assert_eq!(view.flags, FLAG_PERSISTENT);
        assert_eq!((view.store_ts_ms, view.born_ts_ms), (42, 41));
        assert_eq!(view.queues().collect::<Vec<_>>(), vec![(7, 100), (9, 200)]);
        assert_eq!(view.keys().collect::<Vec<_>>(), keys.to_vec());
        assert_eq!(&buf[view.properties.clone()], b"props");
        assert_eq!(&buf[view.body.clone()], b"hello");
    }

    #[test]
    fn ack_padding_and_empty() {
        let mut buf = vec![0u8; ack_len(2)];
        encode_ack(&mut buf, 5, 3, &[(0, 4), (9, 10)]).unwrap();
        let Decoded::Ack { view, .. } = decode(&buf) else {
            panic!("not an ack")
        };
        assert_eq!(view.queue, 3);
        assert_eq!(view.ranges().collect::<Vec<_>>(), vec![(0, 4), (9, 10)]);

        let mut pad = vec![0u8; 100];
        encode_padding(&mut pad).unwrap();
        assert_eq!(decode(&pad), Decoded::Padding);
        assert!(matches!(decode(&pad[..50]), Decoded::Invalid(_)));
        assert_eq!(decode(&[0u8; 64]), Decoded::Empty);
        assert_eq!(decode(&[0u8; 3]), Decoded::Empty);
    }

    #[test]
    fn every_truncation_and_flip_is_detected() {
        let msg = NewMessage {
            queues: &[1],
            body: b"0123456789",
            ..Default::default()
        };
        let buf = encode(&msg, &[0]);
        for cut in 0..buf.len() {
            let mut torn = buf[..cut].to_vec();
            torn.resize(buf.len() + 16, 0);
            // a torn record followed by zeroes is either invalid or (cut inside the
            // length field with the rest zero) invalid too, never a message
            assert!(
                !matches!(decode(&torn[..]), Decoded::Message { .. }),
                "cut {cut}"
            );
        }
        for i in 0..buf.len() {
            for bit in 0..8 {
                let mut bad = buf.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    !matches!(decode(&bad), Decoded::Message { .. }),
                    "flip {i}/{bit}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn round_trips(
            queues in proptest::collection::vec(any::<u32>(), 1..5),
            keys in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..20), 0..4),
            props in proptest::collection::vec(any::<u8>(), 0..50),
            body in proptest::collection::vec(any::<u8>(), 0..300),
            flags in any::<u16>(),
        ) {
            let key_refs: Vec<&[u8]> = keys.iter().map(|k| k.as_slice()).collect();
            let offs: Vec<u64> = (0..queues.len() as u64).map(|i| i * 3).collect();
            let msg = NewMessage { queues: &queues, flags, born_ts_ms: 1, tag_hash: 0, keys: &key_refs, properties: &props, body: &body };
            let mut buf = encode(&msg, &offs);
            buf.extend_from_slice(&[0; 8]);
            let Decoded::Message { len, view } = decode(&buf) else { panic!("not a message") };
            prop_assert_eq!(len as usize, buf.len() - 8);
            prop_assert_eq!(view.queues().map(|q| q.0).collect::<Vec<_>>(), queues);
            prop_assert_eq!(view.keys().map(|k| k.to_vec()).collect::<Vec<_>>(), keys);
            prop_assert_eq!(&buf[view.body.clone()], &body[..]);
            prop_assert_eq!(&buf[view.properties.clone()], &props[..]);
        }
    }
}
