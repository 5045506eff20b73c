//! Raw bytes into the MQTT 3.1.1 packet decoder.
//!
//! Byte 0 picks the limits (before CONNECT: 64 KiB; after: 16 MiB), byte 1 a split
//! point; the rest is the stream. Checks: no panic; `decode(encode(p)) == p` for every
//! decoded packet; the stream split in two decodes to the same packets and ends the
//! same way.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use triad_mqtt::codec::{decode, encode, Limits, Packet, MAX_REMAINING_LENGTH};

const WIDE: Limits = Limits {
    max_packet_size: MAX_REMAINING_LENGTH,
    max_filters: usize::MAX,
};

fn run(parts: &[&[u8]], limits: &Limits) -> (Vec<Packet>, bool) {
    let mut buf = BytesMut::new();
    let mut packets = Vec::new();
    for part in parts {
        buf.extend_from_slice(part);
        loop {
            match decode(&mut buf, limits) {
                Ok(Some(p)) => packets.push(p),
                Ok(None) => break,
                Err(_) => return (packets, true),
            }
        }
    }
    (packets, false)
}

fuzz_target!(|data: &[u8]| {
    let (Some(&cfg), Some(&split)) = (data.first(), data.get(1)) else {
        return;
    };
    let stream = data.get(2..).unwrap_or_default();
    let limits = Limits {
        max_packet_size: if cfg & 1 == 0 { 64 << 10 } else { 16 << 20 },
        max_filters: 1024,
    };
    let whole = run(&[stream], &limits);
    for p in &whole.0 {
        let mut b = BytesMut::new();
        encode(p, &mut b);
        let again = decode(&mut b, &WIDE)
            .expect("a re-encoded packet decodes")
            .expect("a re-encoded packet is complete");
        assert!(
            b.is_empty(),
            "a re-encoded packet decodes to exactly one packet"
        );
        assert_eq!(&again, p, "decode(encode(p)) == p");
    }
    let k = stream.len() * usize::from(split) / 255;
    let (a, b) = stream.split_at(k.min(stream.len()));
    assert_eq!(
        run(&[a, b], &limits),
        whole,
        "split at {k} decodes differently"
    );
});
