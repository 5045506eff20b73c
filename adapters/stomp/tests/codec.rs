#![allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
//! The pure codec: wire vectors from `tests/wire/`, every frame type, escaping, limits,
//! split-anywhere equivalence, and property tests (no panics on arbitrary bytes,
//! `decode(encode(f)) == f`).

use bytes::{Bytes, BytesMut};
use proptest::prelude::*;
use triad_stomp::codec::{
    decode, decode_with, encode, encode_with, DecodeError, Decoder, Dialect, Limits,
};
use triad_stomp::{Command, Frame};

fn unescape(s: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' {
            match b[i + 1] {
                b'n' => out.push(b'\n'),
                b'r' => out.push(b'\r'),
                b'0' => out.push(0),
                b'\\' => out.push(b'\\'),
                b'x' => {
                    out.push(u8::from_str_radix(&s[i + 2..i + 4], 16).unwrap());
                    i += 2;
                }
                c => panic!("bad escape \\{} in vector", c as char),
            }
            i += 2;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

fn error_name(e: &DecodeError) -> &'static str {
    match e {
        DecodeError::FrameTooLarge { .. } => "FrameTooLarge",
        DecodeError::TooManyHeaders { .. } => "TooManyHeaders",
        DecodeError::HeaderTooLong { .. } => "HeaderTooLong",
        DecodeError::UnknownCommand(_) => "UnknownCommand",
        DecodeError::MalformedHeader => "MalformedHeader",
        DecodeError::BadEscape(_) => "BadEscape",
        DecodeError::BadContentLength => "BadContentLength",
        DecodeError::MissingNul => "MissingNul",
        DecodeError::NotUtf8 => "NotUtf8",
        DecodeError::BadEol => "BadEol",
    }
}

struct Vector {
    rule: String,
    dialect: Dialect,
    limits: Limits,
    input: Vec<u8>,
    frames: Vec<Frame>,
    error: Option<String>,
    rest: Vec<u8>,
}

fn load_vectors() -> Vec<Vector> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/wire");
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "vec"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for block in text.split("\n\n").filter(|b| !b.trim().is_empty()) {
            let mut v = Vector {
                rule: String::new(),
                dialect: Dialect::V12,
                limits: Limits::AUTHENTICATED,
                input: Vec::new(),
                frames: Vec::new(),
                error: None,
                rest: Vec::new(),
            };
            for line in block.lines() {
                let (k, val) = line
                    .split_once(": ")
                    .unwrap_or((line.trim_end_matches(':'), ""));
                match k {
                    "rule" => {
                        v.rule = format!("{}: {val}", f.file_name().unwrap().to_string_lossy())
                    }
                    "dialect" => {
                        v.dialect = match val {
                            "1.0" => Dialect::V10,
                            "1.1" => Dialect::V11,
                            _ => Dialect::V12,
                        }
                    }
                    "limits" => {
                        if val == "unauthenticated" {
                            v.limits = Limits::UNAUTHENTICATED
                        }
                    }
                    "input" => v.input.extend(unescape(val)),
                    "frame" => v
                        .frames
                        .push(Frame::new(Command::parse(val.as_bytes()).unwrap())),
                    "header" => {
                        let (n, hv) = val.split_once('=').unwrap();
                        let n = String::from_utf8(unescape(n)).unwrap();
                        let hv = String::from_utf8(unescape(hv)).unwrap();
                        v.frames.last_mut().unwrap().push(n, hv);
                    }
                    "body" => v.frames.last_mut().unwrap().body = Bytes::from(unescape(val)),
                    "error" => v.error = Some(val.to_string()),
                    "rest" => v.rest = unescape(val),
                    other => panic!("unknown key {other} in {}", f.display()),
                }
            }
            assert!(!v.rule.is_empty(), "vector without rule in {}", f.display());
            out.push(v);
        }
    }
    out
}

/// Decodes everything; returns the frames, the error if any, and what was left.
fn run(
    input: &[u8],
    limits: &Limits,
    dialect: Dialect,
) -> (Vec<Frame>, Option<DecodeError>, Vec<u8>) {
    let mut buf = BytesMut::from(input);
    let mut frames = Vec::new();
    loop {
        match decode_with(&mut buf, limits, dialect) {
            Ok(Some(f)) => frames.push(f),
            Ok(None) => return (frames, None, buf.to_vec()),
            Err(e) => return (frames, Some(e), buf.to_vec()),
        }
    }
}

/// Feeds `input` one byte at a time to one resuming [`Decoder`], as a connection reads.
fn run_bytewise(
    input: &[u8],
    limits: &Limits,
    dialect: Dialect,
) -> (Vec<Frame>, Option<DecodeError>) {
    let mut buf = BytesMut::new();
    let mut frames = Vec::new();
    let mut decoder = Decoder::default();
    for b in input {
        buf.extend_from_slice(&[*b]);
        loop {
            match decoder.decode(&mut buf, limits, dialect) {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(e) => return (frames, Some(e)),
            }
        }
    }
    (frames, None)
}

#[test]
fn wire_vectors() {
    let vectors = load_vectors();
    assert!(vectors.len() >= 20, "only {} vectors", vectors.len());
    for v in &vectors {
        let (frames, err, rest) = run(&v.input, &v.limits, v.dialect);
        assert_eq!(frames, v.frames, "{}", v.rule);
        assert_eq!(
            err.as_ref().map(error_name),
            v.error.as_deref(),
            "{}",
            v.rule
        );
        if v.error.is_none() {
            assert_eq!(rest, v.rest, "{}", v.rule);
        }
        // split at every byte: same frames, same verdict
        let (frames2, err2) = run_bytewise(&v.input, &v.limits, v.dialect);
        assert_eq!(frames2, v.frames, "bytewise: {}", v.rule);
        assert_eq!(
            err2.as_ref().map(error_name),
            v.error.as_deref(),
            "bytewise: {}",
            v.rule
        );
    }
}

fn sample_frames() -> Vec<Frame> {
    vec![
        Frame::new(Command::Connect)
            .with("accept-version", "1.0,1.1,1.2")
            .with("host", "localhost")
            .with("login", "guest")
            .with("passcode", "gu\\est"),
        Frame::new(Command::Stomp).with("accept-version", "1.2"),
        Frame::new(Command::Connected)
            .with("version", "1.2")
            .with("heart-beat", "0,0"),
        Frame::new(Command::Send)
            .with("destination", "/queue/a")
            .with("weird:name", "line1\nline2\r\\")
            .with_body(Bytes::from_static(b"a\0b")),
        Frame::new(Command::Subscribe)
            .with("id", "0")
            .with("destination", "/topic/x.*")
            .with("ack", "client"),
        Frame::new(Command::Unsubscribe).with("id", "0"),
        Frame::new(Command::Ack).with("id", "m1"),
        Frame::new(Command::Nack).with("id", "m1"),
        Frame::new(Command::Begin).with("transaction", "t"),
        Frame::new(Command::Commit).with("transaction", "t"),
        Frame::new(Command::Abort).with("transaction", "t"),
        Frame::new(Command::Disconnect).with("receipt", "77"),
        Frame::new(Command::Message)
            .with("subscription", "0")
            .with("message-id", "x")
            .with_body("hello"),
        Frame::new(Command::Receipt).with("receipt-id", "77"),
        Frame::new(Command::Error)
            .with("message", "bad")
            .with_body("details\n"),
    ]
}

/// What decoding an encoded frame yields: the frame plus the content-length header
/// `encode` adds to frames with a body.
fn expected(f: &Frame) -> Frame {
    let mut e = f.clone();
    if !f.body.is_empty() && !f.has("content-length") {
        e.push("content-length", f.body.len().to_string());
    }
    e
}

#[test]
fn every_frame_type_round_trips_and_splits_anywhere() {
    let frames = sample_frames();
    assert_eq!(frames.len(), Command::ALL.len());
    let mut wire = BytesMut::new();
    for f in &frames {
        encode(f, &mut wire);
        wire.extend_from_slice(b"\n"); // a heart-beat between frames
    }
    let want: Vec<Frame> = frames.iter().map(expected).collect();
    let (got, err, rest) = run(&wire, &Limits::AUTHENTICATED, Dialect::V12);
    assert!(err.is_none());
    assert!(rest.is_empty());
    assert_eq!(got, want);
    for split in 0..wire.len() {
        let mut buf = BytesMut::from(&wire[..split]);
        let mut got = Vec::new();
        while let Some(f) = decode(&mut buf, &Limits::AUTHENTICATED).unwrap() {
            got.push(f);
        }
        buf.extend_from_slice(&wire[split..]);
        while let Some(f) = decode(&mut buf, &Limits::AUTHENTICATED).unwrap() {
            got.push(f);
        }
        assert_eq!(got, want, "split at {split}");
        // and resuming across the split, as a connection does
        let mut decoder = Decoder::default();
        let mut buf = BytesMut::from(&wire[..split]);
        let mut got = Vec::new();
        while let Some(f) = decoder
            .decode(&mut buf, &Limits::AUTHENTICATED, Dialect::V12)
            .unwrap()
        {
            got.push(f);
        }
        buf.extend_from_slice(&wire[split..]);
        while let Some(f) = decoder
            .decode(&mut buf, &Limits::AUTHENTICATED, Dialect::V12)
            .unwrap()
        {
            got.push(f);
        }
        assert_eq!(got, want, "resumed across a split at {split}");
    }
}

#[test]
fn connect_frames_are_not_escaped_on_the_wire() {
    let mut out = BytesMut::new();
    encode(
        &Frame::new(Command::Connected).with("server", "a:b\\c"),
        &mut out,
    );
    assert_eq!(&out[..], b"CONNECTED\nserver:a:b\\c\n\n\0");
    let mut out = BytesMut::new();
    encode(
        &Frame::new(Command::Message).with("k", "a:b\\c\n"),
        &mut out,
    );
    assert_eq!(&out[..], b"MESSAGE\nk:a\\cb\\\\c\\n\n\n\0");
    let mut out = BytesMut::new();
    encode_with(
        &Frame::new(Command::Message).with("k", "a:b\n"),
        &mut out,
        Dialect::V10,
    );
    assert_eq!(&out[..], b"MESSAGE\nk:a:b\n\n\0");
}

/// Regression (found by `fuzz/` target `stomp_decode`): a header name holding a CR
/// that 1.1 cannot escape was written with the CR dropped, so `conte\rnt-length`
/// (sent escaped by a 1.2 publisher) reached a 1.1 subscriber as a second
/// `content-length`; the first one wins, so the body could end early and its rest be
/// read as further frames.
#[test]
fn unescapable_bytes_in_names_never_make_another_header() {
    // the fuzzer's input, minimized: decodes under 1.1, re-encodes, decodes again
    let input = b"SEND\nconte\r\rnt-length:\r\rtA\rbx\n\n\0";
    let mut buf = BytesMut::from(&input[..]);
    let f = decode_with(&mut buf, &Limits::AUTHENTICATED, Dialect::V11)
        .unwrap()
        .unwrap();
    let mut wire = BytesMut::new();
    encode_with(&f, &mut wire, Dialect::V11);
    let again = decode_with(&mut wire, &Limits::AUTHENTICATED, Dialect::V11)
        .unwrap()
        .unwrap();
    assert_eq!(again.header("content-length"), None);
    // a frame smuggled in a body after an injected `content-length:0`
    for (dialect, name) in [
        (Dialect::V11, "conte\rnt-length"),
        (Dialect::V10, "conte\nnt-length"),
        (Dialect::V10, "content-length:"),
    ] {
        let f = Frame::new(Command::Message)
            .with(name, "0")
            .with_body(&b"\0MESSAGE\nsmuggled:1\n\n"[..]);
        let mut wire = BytesMut::new();
        encode_with(&f, &mut wire, dialect);
        let mut frames = Vec::new();
        while let Some(f) = decode_with(&mut wire, &Limits::AUTHENTICATED, dialect).unwrap() {
            frames.push(f);
        }
        assert_eq!(frames.len(), 1, "{name:?} under {dialect:?}: {frames:?}");
        assert_eq!(&frames[0].body[..], &b"\0MESSAGE\nsmuggled:1\n\n"[..]);
    }
}

#[test]
fn limits_apply_before_buffering() {
    let l = Limits::UNAUTHENTICATED;
    // a command line without end: refused once longer than the line limit
    let mut buf = BytesMut::from(vec![b'A'; l.max_header_len + 1].as_slice());
    assert!(matches!(
        decode(&mut buf, &l),
        Err(DecodeError::HeaderTooLong { .. })
    ));
    // a header line without end
    let mut v = b"SEND\nk:".to_vec();
    v.extend(vec![b'v'; l.max_header_len + 1]);
    assert!(matches!(
        decode(&mut BytesMut::from(v.as_slice()), &l),
        Err(DecodeError::HeaderTooLong { .. })
    ));
    // a body without content-length and without NUL: refused past max_frame
    let mut v = b"SEND\n\n".to_vec();
    v.extend(vec![b'x'; l.max_frame]);
    assert!(matches!(
        decode(&mut BytesMut::from(v.as_slice()), &l),
        Err(DecodeError::FrameTooLarge { .. })
    ));
    // just under the limit is fine
    let mut v = b"SEND\n\n".to_vec();
    v.extend(vec![b'x'; l.max_frame - 7]);
    v.push(0);
    assert!(decode(&mut BytesMut::from(v.as_slice()), &l)
        .unwrap()
        .is_some());
    // a declared length over the limit fails with only the head buffered
    let mut buf = BytesMut::from(&b"SEND\ncontent-length:99999999999\n\n"[..]);
    assert!(matches!(
        decode(&mut buf, &Limits::AUTHENTICATED),
        Err(DecodeError::FrameTooLarge { .. })
    ));
    let mut buf = BytesMut::from(&b"SEND\ncontent-length:999999999999999999999999\n\n"[..]);
    assert!(decode(&mut buf, &Limits::AUTHENTICATED).is_err());
}

#[test]
fn heartbeats_alone_are_consumed() {
    let mut buf = BytesMut::from(&b"\n\r\n\n"[..]);
    assert_eq!(decode(&mut buf, &Limits::AUTHENTICATED).unwrap(), None);
    assert!(buf.is_empty());
    let mut buf = BytesMut::from(&b"\n\r"[..]);
    assert_eq!(decode(&mut buf, &Limits::AUTHENTICATED).unwrap(), None);
    assert_eq!(&buf[..], b"\r");
}

fn header_text(escaped: bool) -> impl Strategy<Value = String> {
    if escaped {
        "[a-z:\\\\\n\r é-]{0,12}".boxed()
    } else {
        "[a-z\\\\ é-]{0,12}".boxed()
    }
}

fn arb_frame() -> impl Strategy<Value = Frame> {
    (0..Command::ALL.len())
        .prop_flat_map(|i| {
            let cmd = Command::ALL[i];
            let esc = cmd.escapes_headers();
            (
                Just(cmd),
                prop::collection::vec(
                    (
                        header_text(esc).prop_filter("reserved", |n| n != "content-length"),
                        header_text(esc),
                    ),
                    0..6,
                ),
                prop::collection::vec(any::<u8>(), 0..64),
            )
        })
        .prop_map(|(command, headers, body)| Frame {
            command,
            headers,
            body: Bytes::from(body),
        })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        for limits in [Limits::AUTHENTICATED, Limits::UNAUTHENTICATED] {
            for d in [Dialect::V10, Dialect::V11, Dialect::V12] {
                let _ = run(&bytes, &limits, d);
            }
        }
    }

    #[test]
    fn stompish_bytes_never_panic(parts in prop::collection::vec(
        prop::sample::select(vec![
            &b"SEND"[..], b"\n", b"\r\n", b"\0", b":", b"\\", b"\\n", b"\\c",
            b"content-length:", b"3", b"CONNECT", b"dest", b"\r",
        ]), 0..64)) {
        let bytes: Vec<u8> = parts.concat();
        let (frames, err, _) = run(&bytes, &Limits::AUTHENTICATED, Dialect::V12);
        let (frames2, err2) = run_bytewise(&bytes, &Limits::AUTHENTICATED, Dialect::V12);
        prop_assert_eq!(frames, frames2);
        prop_assert_eq!(err.is_some(), err2.is_some());
    }

    #[test]
    fn decode_encode_round_trip(frames in prop::collection::vec(arb_frame(), 1..4)) {
        let mut wire = BytesMut::new();
        for f in &frames {
            encode(f, &mut wire);
        }
        let want: Vec<Frame> = frames.iter().map(expected).collect();
        let (got, err, rest) = run(&wire, &Limits::AUTHENTICATED, Dialect::V12);
        prop_assert!(err.is_none(), "{:?}", err);
        prop_assert!(rest.is_empty());
        prop_assert_eq!(got, want);
    }
}
