//! Raw bytes into the replication protocol's frame decoder (`triad_cluster::codec`), and
//! frames built from the input through encode and decode.
//!
//! Byte 0 picks the mode and the limit: bit 7 set builds one frame from the bytes after
//! byte 1 (kind, then its fields) and checks `decode(encode(f)) == f`, whole and split;
//! clear, the rest is a stream (limit: bit 0 clear the default `MAX_FRAME`, set a small
//! 64 bytes, so the refusal of a declared length over the limit is reached). Byte 1 is a
//! split point. Checks: no panic; every decoded frame re-encodes and decodes to itself;
//! the stream split in two decodes to the same frames and ends the same way.
#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use triad_cluster::codec::{decode, encode, EpochEntry, Frame, MAX_FRAME, MAX_NODE_ID};

const WIDE: usize = u32::MAX as usize;

fn run(parts: &[&[u8]], max: usize) -> (Vec<Frame>, bool) {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for part in parts {
        buf.extend_from_slice(part);
        loop {
            match decode(&mut buf, max) {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(_) => return (frames, true),
            }
        }
    }
    (frames, false)
}

/// Reads the fields of one frame from `b` (missing bytes read as zeros).
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u8(&mut self) -> u8 {
        let (v, rest) = self
            .0
            .split_first()
            .map(|(v, r)| (*v, r))
            .unwrap_or((0, &[]));
        self.0 = rest;
        v
    }
    fn u64(&mut self) -> u64 {
        let mut a = [0u8; 8];
        for x in a.iter_mut() {
            *x = self.u8();
        }
        u64::from_be_bytes(a)
    }
    /// A string of at most `max` bytes, cut at a character boundary.
    fn string(&mut self, max: usize) -> String {
        let n = usize::from(self.u8()).min(max).min(self.0.len());
        let (s, rest) = self.0.split_at(n);
        self.0 = rest;
        String::from_utf8_lossy(s)
            .chars()
            .take(max)
            .collect::<String>()
    }
    fn data(&mut self) -> Bytes {
        Bytes::copy_from_slice(std::mem::take(&mut self.0))
    }
}

fn build(b: &[u8]) -> Frame {
    let mut f = Fields(b);
    match f.u8() % 9 {
        0 => {
            let version = u16::from(f.u8()) << 8 | u16::from(f.u8());
            let mut node = f.string(MAX_NODE_ID);
            while node.len() > MAX_NODE_ID {
                node.pop();
            }
            Frame::Hello {
                version,
                node,
                epoch: f.u64(),
                log_end: f.u64(),
                journal_pos: f.u64(),
                segment_size: f.u64(),
            }
        }
        1 => {
            let node = f.string(usize::MAX);
            let epoch = f.u64();
            let (log_from, journal_from) = (f.u64(), f.u64());
            // within MAX_HISTORY, which the encoder keeps (the last entries) and the
            // decoder enforces
            let history = (0..f.u8() % 8)
                .map(|_| EpochEntry {
                    epoch: f.u64(),
                    log_start: f.u64(),
                    journal_start: f.u64(),
                })
                .collect();
            Frame::Welcome {
                node,
                epoch,
                log_from,
                journal_from,
                history,
            }
        }
        2 => Frame::Refused {
            reason: f.string(usize::MAX),
        },
        3 => Frame::Log {
            offset: f.u64(),
            data: f.data(),
        },
        4 => Frame::Journal {
            pos: f.u64(),
            data: f.data(),
        },
        5 => Frame::Snapshot {
            pos: f.u64(),
            offset: f.u64(),
            total: f.u64(),
            data: f.data(),
        },
        6 => Frame::Heartbeat {
            log_end: f.u64(),
            journal_pos: f.u64(),
        },
        7 => Frame::Ack {
            log_durable: f.u64(),
            journal_durable: f.u64(),
        },
        _ => {
            let (log_end, journal_pos) = (f.u64(), f.u64());
            // ascending, as the decoder requires
            let mut at = 0u64;
            let mut segments = (0..f.u8() % 16)
                .map(|_| {
                    at = at.saturating_add(u64::from(f.u8()) + 1);
                    at
                })
                .collect::<Vec<u64>>();
            segments.dedup(); // saturated at the top
            Frame::Retained {
                log_end,
                journal_pos,
                segments,
            }
        }
    }
}

fn round_trip(f: &Frame) -> BytesMut {
    let mut b = BytesMut::new();
    encode(f, &mut b);
    let wire = b.clone();
    let again = decode(&mut b, WIDE)
        .expect("an encoded frame decodes")
        .expect("an encoded frame is complete");
    assert!(
        b.is_empty(),
        "an encoded frame decodes to exactly one frame"
    );
    assert_eq!(&again, f, "decode(encode(f)) == f");
    wire
}

fuzz_target!(|data: &[u8]| {
    let (Some(&cfg), Some(&split)) = (data.first(), data.get(1)) else {
        return;
    };
    let rest = data.get(2..).unwrap_or_default();
    if cfg & 0x80 != 0 {
        let f = build(rest);
        let wire = round_trip(&f);
        let k = wire.len() * usize::from(split) / 255;
        let (a, b) = wire.split_at(k.min(wire.len()));
        assert_eq!(run(&[a, b], WIDE), (vec![f], false), "split encoded frame");
        return;
    }
    let max = if cfg & 1 == 0 { MAX_FRAME } else { 64 };
    let whole = run(&[rest], max);
    for f in &whole.0 {
        round_trip(f);
    }
    let k = rest.len() * usize::from(split) / 255;
    let (a, b) = rest.split_at(k.min(rest.len()));
    assert_eq!(
        run(&[a, b], max),
        whole,
        "the stream split in two decodes the same"
    );
});
