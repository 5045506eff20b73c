//! Raw bytes into the STOMP frame decoder.
//!
//! Byte 0 picks the dialect (1.0, 1.1, 1.2) and the limits (before CONNECT or after),
//! byte 1 a split point; the rest is the stream. Checks: no panic; every decoded frame
//! re-encodes (under the same dialect) to bytes that decode and re-encode to the same
//! bytes (the encoder adds `content-length` and drops what CONNECT cannot escape, so
//! frames are compared by their encoding); the stream split in two, fed to one resuming
//! `Decoder` as a connection does, decodes to the same
//! frames and ends the same way.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use triad_stomp::codec::{decode_with, encode_with, Decoder, Dialect, Limits};
use triad_stomp::Frame;

const WIDE: Limits = Limits {
    max_frame: usize::MAX,
    max_headers: usize::MAX,
    max_header_len: usize::MAX,
};

fn enc(f: &Frame, d: Dialect) -> Vec<u8> {
    let mut out = BytesMut::new();
    encode_with(f, &mut out, d);
    out.to_vec()
}

/// Decodes the stream fed in `parts`, resuming across them as a connection does.
fn run(parts: &[&[u8]], limits: &Limits, d: Dialect) -> (Vec<Frame>, bool) {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut decoder = Decoder::default();
    for part in parts {
        buf.extend_from_slice(part);
        loop {
            match decoder.decode(&mut buf, limits, d) {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(_) => return (frames, true),
            }
        }
    }
    (frames, false)
}

fuzz_target!(|data: &[u8]| {
    let (Some(&cfg), Some(&split)) = (data.first(), data.get(1)) else {
        return;
    };
    let stream = data.get(2..).unwrap_or_default();
    let dialect = match cfg % 3 {
        0 => Dialect::V10,
        1 => Dialect::V11,
        _ => Dialect::V12,
    };
    let limits = if cfg & 0x80 == 0 {
        Limits::UNAUTHENTICATED
    } else {
        Limits::AUTHENTICATED
    };
    let whole = run(&[stream], &limits, dialect);
    for f in &whole.0 {
        let bytes = enc(f, dialect);
        let mut b = BytesMut::from(&bytes[..]);
        let again = decode_with(&mut b, &WIDE, dialect)
            .expect("a re-encoded frame decodes")
            .expect("a re-encoded frame is complete");
        assert!(
            b.is_empty(),
            "a re-encoded frame decodes to exactly one frame"
        );
        assert_eq!(enc(&again, dialect), bytes, "encode/decode fixpoint");
        assert_eq!((again.command, &again.body), (f.command, &f.body));
    }
    let k = stream.len() * usize::from(split) / 255;
    let (a, b) = stream.split_at(k.min(stream.len()));
    assert_eq!(
        run(&[a, b], &limits, dialect),
        whole,
        "split at {k} decodes differently"
    );
});
