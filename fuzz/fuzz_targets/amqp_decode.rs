//! Raw bytes into the AMQP 0-9-1 frame decoder (after the protocol header).
//!
//! Byte 0 picks the limits (before tune: 8 KiB; after: 128 KiB), byte 1 a split point;
//! the rest is the stream. Checks: no panic; every decoded frame re-encodes to bytes
//! that decode and re-encode to the same bytes (a fixpoint: amq-protocol's tables may
//! hold NaN, so frames are compared by their encoding); the stream split in two at
//! the chosen point decodes to the same frames and ends the same way.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use triad_amqp::codec::{decode, encode, Frame, Limits};

const WIDE: Limits = Limits {
    frame_max: u32::MAX,
};

fn enc(f: &Frame) -> Option<Vec<u8>> {
    let mut out = BytesMut::new();
    encode(f, &mut out).ok()?;
    Some(out.to_vec())
}

/// Decodes `parts` fed one after another: the frames' encodings, and whether it ended
/// in an error.
fn run(parts: &[&[u8]], limits: &Limits) -> (Vec<Option<Vec<u8>>>, bool) {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    for part in parts {
        buf.extend_from_slice(part);
        loop {
            match decode(&mut buf, limits) {
                Ok(Some(f)) => frames.push(enc(&f)),
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
    let limits = if cfg & 1 == 0 {
        Limits::PRE_TUNE
    } else {
        Limits { frame_max: 131_072 }
    };
    let whole = run(&[stream], &limits);
    for bytes in whole.0.iter().flatten() {
        let mut b = BytesMut::from(&bytes[..]);
        let again = decode(&mut b, &WIDE)
            .expect("a re-encoded frame decodes")
            .expect("a re-encoded frame is complete");
        assert!(
            b.is_empty(),
            "a re-encoded frame decodes to exactly one frame"
        );
        assert_eq!(enc(&again).as_ref(), Some(bytes), "encode/decode fixpoint");
    }
    let k = stream.len() * usize::from(split) / 255;
    let (a, b) = stream.split_at(k.min(stream.len()));
    assert_eq!(
        run(&[a, b], &limits),
        whole,
        "split at {k} decodes differently"
    );
});
