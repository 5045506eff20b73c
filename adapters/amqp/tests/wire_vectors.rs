//! Wire vectors under tests/wire/amqp: hex frames with the decode outcome expected.
//! Format: `# comment` lines (the first names the spec rule), one `expect: ok` or
//! `expect: error <reply-code>` line, then hex bytes (whitespace ignored).
#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]

use bytes::BytesMut;
use triad_amqp::codec::{decode, Limits};

fn parse(text: &str) -> (String, Vec<u8>) {
    let mut expect = String::new();
    let mut hex = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if let Some(e) = line.strip_prefix("expect:") {
            expect = e.trim().to_owned();
        } else {
            hex.extend(line.chars().filter(|c| !c.is_whitespace()));
        }
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    (expect, bytes)
}

#[test]
fn wire_vectors_decode_as_tagged() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/wire/amqp");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("hex") {
            continue;
        }
        n += 1;
        let (expect, bytes) = parse(&std::fs::read_to_string(&path).unwrap());
        let mut buf = BytesMut::from(&bytes[..]);
        let limits = Limits { frame_max: 131072 };
        let mut outcome = Ok(());
        loop {
            match decode(&mut buf, &limits) {
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => {
                    outcome = Err(e.reply_code());
                    break;
                }
            }
        }
        match expect.as_str() {
            "ok" => {
                assert_eq!(outcome, Ok(()), "{}", path.display());
                assert!(buf.is_empty(), "{}: trailing bytes", path.display());
            }
            e => {
                let code: u16 = e.strip_prefix("error ").unwrap().parse().unwrap();
                assert_eq!(outcome, Err(code), "{}", path.display());
            }
        }
    }
    assert!(n >= 5);
}
