//! Raw bytes into the commitlog record decoder, as recovery scans a segment.
//!
//! Byte 0 picks the mode: as is (a torn or corrupt tail), or with the length and
//! CRC32C patched in so that the fields behind the checksum are reached. Checks: no
//! panic; every field iterator stays inside the record; a decoded message re-encodes
//! to exactly the record's bytes; and so does a decoded ack.
#![no_main]

use libfuzzer_sys::fuzz_target;
use triad_store::record::{self, Decoded, NewMessage, HEADER_LEN, MAX_KEYS};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut buf = rest.to_vec();
    if mode & 1 == 1 && buf.len() >= HEADER_LEN {
        // a well-formed header for the whole input (or a prefix of it)
        let len = if mode & 2 == 2 {
            buf.len()
        } else {
            HEADER_LEN + usize::from(mode >> 2) * buf.len() / 64 % (buf.len() - HEADER_LEN + 1)
        };
        buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
        let crc = crc32c::crc32c(&buf[HEADER_LEN..len]);
        buf[8..12].copy_from_slice(&crc.to_le_bytes());
    }
    match record::decode(&buf) {
        Decoded::Message { len, view } => {
            let rec = &buf[..len as usize];
            let (queues, offsets): (Vec<u32>, Vec<u64>) = view.queues().unzip();
            let keys: Vec<&[u8]> = view.keys().collect();
            let props = &rec[view.properties.clone()];
            let body = &rec[view.body.clone()];
            if keys.len() > MAX_KEYS {
                return; // decodable, but more keys than the writer ever writes
            }
            let msg = NewMessage {
                queues: &queues,
                flags: view.flags,
                born_ts_ms: view.born_ts_ms,
                tag_hash: view.tag_hash,
                keys: &keys,
                properties: props,
                body,
            };
            let n = record::message_len(&msg).expect("a decoded message has a length");
            assert_eq!(n, rec.len(), "re-encoded length");
            let mut out = vec![0u8; n];
            record::encode_message(&mut out, &msg, view.store_ts_ms, &offsets)
                .expect("a decoded message re-encodes");
            assert_eq!(out, rec, "a decoded message re-encodes to its record");
        }
        Decoded::Ack { len, view } => {
            let rec = &buf[..len as usize];
            let ranges: Vec<(u64, u64)> = view.ranges().collect();
            let mut out = vec![0u8; record::ack_len(ranges.len())];
            record::encode_ack(&mut out, view.store_ts_ms, view.queue, &ranges)
                .expect("a decoded ack re-encodes");
            // the flags field is written as 0 by the encoder and ignored by the decoder
            if rec.get(12..14) == Some(&[0, 0]) {
                assert_eq!(out, rec, "a decoded ack re-encodes to its record");
            }
        }
        Decoded::Padding | Decoded::Empty | Decoded::Invalid(_) => {}
    }
});
