//! TLS records after the handshake, for TLS 1.3 (RFC 8446 §5.2 and §4.6.3: application
//! data, alerts and key updates) and TLS 1.2 (RFC 5246 §6.2.3.3 with AES-GCM, RFC 5288,
//! and ChaCha20-Poly1305, RFC 7905), encrypted and decrypted with ring's AEADs, holding
//! about 250 bytes per connection while idle.
//!
//! rustls runs the handshake ([`super::stream`]). Once it is done, the connection is
//! handed to [`Records`]: rustls gives the sequence numbers and the
//! current keys (`dangerous_into_kernel_connection`, the API meant for kernel TLS),
//! and [`CaptureSecrets`] has kept the two application traffic secrets, which the key
//! schedule needs for key updates. rustls' connection is then dropped: its state
//! (1 KiB), and the two expanded AES-GCM keys (about 560 B each) that its record layer
//! keeps for the life of the connection, were most of what an idle TLS connection cost.
//! Here the expanded keys are built when a record is sealed or opened and dropped when
//! the connection waits ([`Records::release`]); an idle connection keeps only the
//! secrets, the raw keys and the sequence numbers.
//!
//! rustls' kernel connection would handle key updates for us, but it holds about
//! 900 B (its QUIC state is inline), as much as what this module saves.
//!
//! A TLS 1.2 connection needs no secrets beyond the keys and IVs rustls extracts: TLS
//! 1.2 has no key update. The differences from TLS 1.3 that matter here: the record's
//! outer type is its real type; AES-GCM records carry an 8-byte explicit nonce (ours is
//! the IV XOR the sequence number, as rustls does); the additional data is the sequence
//! number, type, version and plaintext length; and a key that reaches its record limit
//! ends the connection with close_notify instead of moving on (as rustls does).
//!
//! What the peer may send after the handshake, and what happens:
//! - application data: decrypted into the caller's buffer (at most 32 empty records in
//!   a row);
//! - `close_notify`: end of file; anything after it is ignored; `user_canceled` is
//!   ignored (RFC 8446 §6.1); any other alert ends the connection;
//! - `KeyUpdate`: the receive key moves on, and with `update_requested` ours too (after
//!   our own `KeyUpdate` is sent under the old key);
//! - TLS 1.2 only: a warning alert is ignored (4 per connection, as rustls and
//!   BoringSSL allow); a `ClientHello` (renegotiation) gets a `no_renegotiation`
//!   warning once, and ends the connection the second time (as rustls);
//! - anything else (other handshake messages, `change_cipher_spec`, plaintext records,
//!   a record over 2^14 + 256 bytes (TLS 1.2: + 2048), a record that fails to decrypt):
//!   a fatal alert, sent, and an error.
//!
//! Before an AES-GCM key has sealed 2^24 records (the confidentiality limit rustls
//! uses) we send a `KeyUpdate` (TLS 1.3) or close the connection (TLS 1.2).

use std::cell::RefCell;
use std::io;

use ring::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use rustls::{ConnectionTrafficSecrets, KeyLog};

/// Bytes of a record header.
const HEADER: usize = 5;
/// The largest plaintext in a record (RFC 8446 §5.1).
pub const MAX_PLAINTEXT: usize = 1 << 14;
/// The largest ciphertext in a record (RFC 8446 §5.2): plaintext, content type, padding
/// and tag.
pub const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// The largest TLS 1.2 ciphertext (RFC 5246 §6.2.3).
const MAX_CIPHERTEXT_12: usize = MAX_PLAINTEXT + 2048;
const TAG: usize = 16;
/// The explicit nonce in front of a TLS 1.2 AES-GCM record (RFC 5288 §3).
const EXPLICIT_NONCE: usize = 8;

const APPLICATION_DATA: u8 = 23;
const HANDSHAKE: u8 = 22;
const ALERT: u8 = 21;
const KEY_UPDATE: u8 = 24;
const CLIENT_HELLO: u8 = 1;

const WARNING: u8 = 1;
const FATAL: u8 = 2;

const CLOSE_NOTIFY: u8 = 0;
const UNEXPECTED_MESSAGE: u8 = 10;
const BAD_RECORD_MAC: u8 = 20;
const RECORD_OVERFLOW: u8 = 22;
const ILLEGAL_PARAMETER: u8 = 47;
const DECODE_ERROR: u8 = 50;
const USER_CANCELED: u8 = 90;
const NO_RENEGOTIATION: u8 = 100;

/// Warning alerts a TLS 1.2 peer may send in the life of a connection (rustls' and
/// BoringSSL's `kMaxWarningAlerts`).
const WARNINGS_ALLOWED: u8 = 4;
/// Renegotiation attempts answered with a warning; the next one is fatal (rustls).
const RENEGOTIATIONS_ALLOWED: u8 = 1;
/// Empty application-data records in a row (rustls' limit).
const EMPTIES_ALLOWED: u8 = 32;

/// Records an AES-GCM key seals before we move to the next one.
const GCM_RECORD_LIMIT: u64 = 1 << 24;

/// The protocol version of a connection's records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Version {
    Tls12,
    Tls13,
}

/// A cipher suite's record protection this module carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Suite {
    Aes128Gcm,
    Aes256Gcm,
    Chacha20Poly1305,
}

impl Suite {
    fn aead(self) -> &'static aead::Algorithm {
        match self {
            Suite::Aes128Gcm => &aead::AES_128_GCM,
            Suite::Aes256Gcm => &aead::AES_256_GCM,
            Suite::Chacha20Poly1305 => &aead::CHACHA20_POLY1305,
        }
    }

    fn hkdf(self) -> hkdf::Algorithm {
        match self {
            Suite::Aes256Gcm => hkdf::HKDF_SHA384,
            Suite::Aes128Gcm | Suite::Chacha20Poly1305 => hkdf::HKDF_SHA256,
        }
    }

    fn hash_len(self) -> usize {
        match self {
            Suite::Aes256Gcm => 48,
            Suite::Aes128Gcm | Suite::Chacha20Poly1305 => 32,
        }
    }

    fn record_limit(self) -> u64 {
        match self {
            Suite::Aes128Gcm | Suite::Aes256Gcm => GCM_RECORD_LIMIT,
            Suite::Chacha20Poly1305 => u64::MAX,
        }
    }

    fn of(keys: &ConnectionTrafficSecrets) -> Option<Suite> {
        match keys {
            ConnectionTrafficSecrets::Aes128Gcm { .. } => Some(Suite::Aes128Gcm),
            ConnectionTrafficSecrets::Aes256Gcm { .. } => Some(Suite::Aes256Gcm),
            ConnectionTrafficSecrets::Chacha20Poly1305 { .. } => Some(Suite::Chacha20Poly1305),
            _ => None,
        }
    }

    /// TLS 1.2 AES-GCM records carry an explicit nonce.
    fn explicit_nonce(self, version: Version) -> usize {
        match (version, self) {
            (Version::Tls12, Suite::Aes128Gcm | Suite::Aes256Gcm) => EXPLICIT_NONCE,
            _ => 0,
        }
    }
}

/// The key and IV rustls extracted.
fn key_iv(keys: &ConnectionTrafficSecrets) -> Option<(&[u8], &[u8])> {
    match keys {
        ConnectionTrafficSecrets::Aes128Gcm { key, iv }
        | ConnectionTrafficSecrets::Aes256Gcm { key, iv }
        | ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => {
            Some((key.as_ref(), iv.as_ref()))
        }
        _ => None,
    }
}

/// A traffic secret (32 or 48 bytes), kept inline.
#[derive(Clone, Copy)]
pub struct Secret {
    bytes: [u8; 48],
    len: u8,
}

impl Secret {
    fn new(bytes: &[u8]) -> Option<Secret> {
        let mut s = Secret {
            bytes: [0; 48],
            len: u8::try_from(bytes.len()).ok()?,
        };
        s.bytes.get_mut(..bytes.len())?.copy_from_slice(bytes);
        Some(s)
    }

    fn get(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

/// The client and server application traffic secrets of the handshake in progress on
/// this thread, as rustls derives them (see [`CaptureSecrets`]).
#[derive(Clone, Copy, Default)]
pub struct Captured {
    client: Option<Secret>,
    server: Option<Secret>,
}

impl Captured {
    /// Both secrets were seen.
    pub fn complete(&self) -> bool {
        self.client.is_some() && self.server.is_some()
    }
}

thread_local! {
    static CAPTURING: RefCell<Option<Captured>> = const { RefCell::new(None) };
}

/// A [`KeyLog`] that keeps the first application traffic secrets of the handshake being
/// processed on the calling thread, while [`capture`] runs: rustls derives them inside
/// `process_tls_records`, a synchronous call, so a thread-local slot set around that
/// call belongs to exactly one connection. Nothing is written anywhere.
#[derive(Debug)]
pub struct CaptureSecrets;

const CLIENT_TRAFFIC_SECRET_0: &str = "CLIENT_TRAFFIC_SECRET_0";
const SERVER_TRAFFIC_SECRET_0: &str = "SERVER_TRAFFIC_SECRET_0";

impl KeyLog for CaptureSecrets {
    fn will_log(&self, label: &str) -> bool {
        matches!(label, CLIENT_TRAFFIC_SECRET_0 | SERVER_TRAFFIC_SECRET_0)
    }

    fn log(&self, label: &str, _client_random: &[u8], secret: &[u8]) {
        CAPTURING.with(|slot| {
            if let Some(c) = slot.borrow_mut().as_mut() {
                match label {
                    CLIENT_TRAFFIC_SECRET_0 => c.client = Secret::new(secret),
                    SERVER_TRAFFIC_SECRET_0 => c.server = Secret::new(secret),
                    _ => {}
                }
            }
        });
    }
}

/// Runs `f` (a call into rustls' handshake) with this thread's capture slot set, and
/// adds what it captured to `into`.
pub fn capture<R>(into: &mut Captured, f: impl FnOnce() -> R) -> R {
    CAPTURING.with(|slot| *slot.borrow_mut() = Some(Captured::default()));
    let r = f();
    if let Some(got) = CAPTURING.with(|slot| slot.borrow_mut().take()) {
        into.client = got.client.or(into.client);
        into.server = got.server.or(into.server);
    }
    r
}

/// HKDF-Expand-Label(secret, label, "", out.len()) (RFC 8446 §7.1).
fn expand_label(alg: hkdf::Algorithm, secret: &[u8], label: &[u8], out: &mut [u8]) -> Option<()> {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let length = u16::try_from(out.len()).ok()?.to_be_bytes();
    let label_len = [u8::try_from(6 + label.len()).ok()?];
    let info: [&[u8]; 5] = [&length, &label_len, b"tls13 ", label, &[0]];
    let prk = hkdf::Prk::new_less_safe(alg, secret);
    prk.expand(&info, Len(out.len())).ok()?.fill(out).ok()
}

/// One direction: its secret (TLS 1.3), the key and IV, the sequence number, and the
/// expanded key while the connection is busy.
struct Direction {
    secret: Secret,
    key: [u8; 32],
    iv: [u8; 12],
    seq: u64,
    aead: Option<Box<LessSafeKey>>,
}

impl Direction {
    fn new(suite: Suite, secret: Secret, seq: u64) -> Option<Direction> {
        let mut d = Direction {
            secret,
            key: [0; 32],
            iv: [0; 12],
            seq,
            aead: None,
        };
        let key_len = suite.aead().key_len();
        expand_label(
            suite.hkdf(),
            secret.get(),
            b"key",
            d.key.get_mut(..key_len)?,
        )?;
        expand_label(suite.hkdf(), secret.get(), b"iv", &mut d.iv)?;
        Some(d)
    }

    /// TLS 1.2: the key and IV rustls derived from the key block (for AES-GCM the IV is
    /// the 4-byte salt and an 8-byte start for our explicit nonces).
    fn from_keys(key: &[u8], iv: &[u8], seq: u64) -> Option<Direction> {
        let mut d = Direction {
            secret: Secret {
                bytes: [0; 48],
                len: 0,
            },
            key: [0; 32],
            iv: [0; 12],
            seq,
            aead: None,
        };
        d.key.get_mut(..key.len())?.copy_from_slice(key);
        if iv.len() != d.iv.len() {
            return None;
        }
        d.iv.copy_from_slice(iv);
        Some(d)
    }

    /// The next generation of keys (RFC 8446 §7.2), sequence number 0.
    fn updated(&self, suite: Suite) -> Option<Direction> {
        let mut bytes = [0u8; 48];
        let out = bytes.get_mut(..suite.hash_len())?;
        expand_label(suite.hkdf(), self.secret.get(), b"traffic upd", out)?;
        Direction::new(suite, Secret::new(out)?, 0)
    }

    fn key(&mut self, suite: Suite) -> io::Result<&LessSafeKey> {
        if self.aead.is_none() {
            let raw = &self.key[..suite.aead().key_len()];
            let unbound = UnboundKey::new(suite.aead(), raw).map_err(|_| internal("AEAD key"))?;
            self.aead = Some(Box::new(LessSafeKey::new(unbound)));
        }
        self.aead.as_deref().ok_or_else(|| internal("AEAD key"))
    }

    /// This record's sequence number and nonce (the IV XOR the sequence number), and
    /// the number moves on.
    fn next(&mut self) -> io::Result<(u64, [u8; 12])> {
        let seq = self.seq;
        let mut n = self.iv;
        for (b, s) in n[4..].iter_mut().zip(seq.to_be_bytes()) {
            *b ^= s;
        }
        self.seq = seq
            .checked_add(1)
            .ok_or_else(|| internal("TLS sequence number exhausted"))?;
        Ok((seq, n))
    }
}

/// TLS 1.2 additional data (RFC 5246 §6.2.3.3): sequence number, type, version and
/// plaintext length.
fn aad12(seq: u64, typ: u8, version: [u8; 2], len: usize) -> io::Result<[u8; 13]> {
    let mut a = [0u8; 13];
    a[..8].copy_from_slice(&seq.to_be_bytes());
    a[8] = typ;
    a[9..11].copy_from_slice(&version);
    let len = u16::try_from(len).map_err(|_| internal("record too long"))?;
    a[11..].copy_from_slice(&len.to_be_bytes());
    Ok(a)
}

fn internal(what: &str) -> io::Error {
    io::Error::other(format!("TLS record layer: {what}"))
}

/// What the records read so far amount to.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Read {
    /// Bytes of `incoming` consumed (whole records).
    pub consumed: usize,
    /// The peer sent close_notify.
    pub closed: bool,
}

/// A TLS connection's record protection after the handshake.
pub struct Records {
    version: Version,
    suite: Suite,
    rx: Direction,
    tx: Direction,
    /// A handshake message split across records (only a KeyUpdate, 5 bytes, is allowed).
    hs: [u8; 5],
    hs_len: u8,
    /// close_notify received: later records are ignored.
    closed: bool,
    /// A fatal alert was sent or received: nothing more is sealed or opened.
    failed: bool,
    /// What a TLS 1.2 peer may still send: warning alerts and renegotiation attempts.
    warnings_left: u8,
    renegotiations_left: u8,
    /// Empty application-data records received in a row.
    empties: u8,
}

impl Records {
    fn with(version: Version, suite: Suite, rx: Direction, tx: Direction) -> Records {
        Records {
            version,
            suite,
            rx,
            tx,
            hs: [0; 5],
            hs_len: 0,
            closed: false,
            failed: false,
            warnings_left: WARNINGS_ALLOWED,
            renegotiations_left: RENEGOTIATIONS_ALLOWED,
            empties: 0,
        }
    }

    /// TLS 1.3, from rustls' extracted keys and sequence numbers and the captured
    /// secrets; `None` if they do not belong together (the keys derived from the
    /// secrets must be the ones rustls used).
    pub fn tls13(
        rx: (u64, ConnectionTrafficSecrets),
        tx: (u64, ConnectionTrafficSecrets),
        captured: Captured,
    ) -> Option<Records> {
        let suite = Suite::of(&rx.1)?;
        let rxd = Direction::new(suite, captured.client?, rx.0)?;
        let txd = Direction::new(suite, captured.server?, tx.0)?;
        let same = |d: &Direction, s: &ConnectionTrafficSecrets| {
            key_iv(s).is_some_and(|(key, iv)| d.key.get(..key.len()) == Some(key) && d.iv == iv)
        };
        if !same(&rxd, &rx.1) || !same(&txd, &tx.1) {
            return None;
        }
        Some(Records::with(Version::Tls13, suite, rxd, txd))
    }

    /// TLS 1.2, from rustls' extracted keys and sequence numbers; `None` for a suite
    /// this module does not carry, or keys of the wrong size.
    pub fn tls12(
        rx: (u64, ConnectionTrafficSecrets),
        tx: (u64, ConnectionTrafficSecrets),
    ) -> Option<Records> {
        let suite = Suite::of(&rx.1)?;
        if Suite::of(&tx.1)? != suite {
            return None;
        }
        let direction = |(seq, keys): &(u64, ConnectionTrafficSecrets)| {
            let (key, iv) = key_iv(keys)?;
            if key.len() != suite.aead().key_len() {
                return None;
            }
            Direction::from_keys(key, iv, *seq)
        };
        let (rxd, txd) = (direction(&rx)?, direction(&tx)?);
        Some(Records::with(Version::Tls12, suite, rxd, txd))
    }

    /// The connection waits: the expanded keys go; the next record rebuilds them.
    pub fn release(&mut self) {
        self.rx.aead = None;
        self.tx.aead = None;
    }

    /// Whether the expanded keys are held (tests).
    #[cfg(test)]
    pub fn keys_expanded(&self) -> bool {
        self.rx.aead.is_some() || self.tx.aead.is_some()
    }

    /// Opens every whole record at the start of `incoming`: application data is added
    /// to `plain`, replies (a KeyUpdate) to `outgoing`. On an error, a fatal alert is in
    /// `outgoing`.
    pub fn read(
        &mut self,
        incoming: &mut [u8],
        plain: &mut Vec<u8>,
        outgoing: &mut Vec<u8>,
    ) -> io::Result<Read> {
        let mut read = Read::default();
        while !self.closed && !self.failed {
            let rest = &mut incoming[read.consumed..];
            let Some(header) = rest.get(..HEADER) else {
                break;
            };
            let typ = header[0];
            let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
            let (typ_ok, max) = match self.version {
                Version::Tls13 => (typ == APPLICATION_DATA, MAX_CIPHERTEXT),
                Version::Tls12 => (
                    matches!(typ, APPLICATION_DATA | ALERT | HANDSHAKE),
                    MAX_CIPHERTEXT_12,
                ),
            };
            if !typ_ok {
                return Err(self.fatal(UNEXPECTED_MESSAGE, "unprotected record", outgoing));
            }
            if len > max {
                return Err(self.fatal(RECORD_OVERFLOW, "record too long", outgoing));
            }
            let Some(record) = rest.get_mut(..HEADER + len) else {
                break;
            };
            read.consumed += HEADER + len;
            match self.version {
                Version::Tls13 => self.open(record, plain, outgoing)?,
                Version::Tls12 => self.open12(record, plain, outgoing)?,
            }
        }
        read.closed = self.closed;
        Ok(read)
    }

    /// Opens one record (header included) in place.
    fn open(
        &mut self,
        record: &mut [u8],
        plain: &mut Vec<u8>,
        outgoing: &mut Vec<u8>,
    ) -> io::Result<()> {
        let (header, body) = record.split_at_mut(HEADER);
        let suite = self.suite;
        let (_, nonce) = self.rx.next()?;
        let opened = self
            .rx
            .key(suite)?
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&*header),
                body,
            )
            .map(|p| p.len());
        let Ok(opened) = opened else {
            return Err(self.fatal(BAD_RECORD_MAC, "record failed to decrypt", outgoing));
        };
        let opened = &body[..opened];
        // TLSInnerPlaintext: content, content type, zero padding.
        let Some(end) = opened.iter().rposition(|&b| b != 0) else {
            return Err(self.fatal(UNEXPECTED_MESSAGE, "record without content type", outgoing));
        };
        let typ = opened[end];
        let content = &opened[..end];
        if content.len() > MAX_PLAINTEXT {
            return Err(self.fatal(RECORD_OVERFLOW, "plaintext too long", outgoing));
        }
        if self.hs_len > 0 && typ != HANDSHAKE {
            return Err(self.fatal(UNEXPECTED_MESSAGE, "handshake message cut short", outgoing));
        }
        match typ {
            APPLICATION_DATA => self.data(content, plain, outgoing)?,
            ALERT => match content {
                [_, CLOSE_NOTIFY] => self.closed = true,
                [_, USER_CANCELED] => {}
                [_, desc] => {
                    self.failed = true;
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        format!("peer sent TLS alert {desc}"),
                    ));
                }
                _ => return Err(self.fatal(DECODE_ERROR, "malformed alert", outgoing)),
            },
            HANDSHAKE if !content.is_empty() => {
                let content = content.to_vec();
                self.handshake(&content, outgoing)?;
            }
            _ => return Err(self.fatal(UNEXPECTED_MESSAGE, "unexpected record type", outgoing)),
        }
        Ok(())
    }

    /// Application data, bounding empty records in a row.
    fn data(
        &mut self,
        content: &[u8],
        plain: &mut Vec<u8>,
        outgoing: &mut Vec<u8>,
    ) -> io::Result<()> {
        if content.is_empty() {
            self.empties += 1;
            if self.empties > EMPTIES_ALLOWED {
                return Err(self.fatal(UNEXPECTED_MESSAGE, "too many empty records", outgoing));
            }
        } else {
            self.empties = 0;
            plain.extend_from_slice(content);
        }
        Ok(())
    }

    /// Opens one TLS 1.2 record (header included) in place.
    fn open12(
        &mut self,
        record: &mut [u8],
        plain: &mut Vec<u8>,
        outgoing: &mut Vec<u8>,
    ) -> io::Result<()> {
        let (header, body) = record.split_at_mut(HEADER);
        let (typ, version) = (header[0], [header[1], header[2]]);
        let suite = self.suite;
        let explicit = suite.explicit_nonce(Version::Tls12);
        let Some(len) = body.len().checked_sub(explicit + TAG) else {
            return Err(self.fatal(BAD_RECORD_MAC, "record too short", outgoing));
        };
        let (seq, mut nonce) = self.rx.next()?;
        if explicit > 0 {
            // The salt, then the nonce the peer chose (RFC 5288 §3).
            nonce[4..].copy_from_slice(&body[..EXPLICIT_NONCE]);
        }
        let aad = aad12(seq, typ, version, len)?;
        let opened = self
            .rx
            .key(suite)?
            .open_within(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                body,
                explicit..,
            )
            .map(|p| p.len());
        if opened.is_err() {
            return Err(self.fatal(BAD_RECORD_MAC, "record failed to decrypt", outgoing));
        }
        if len > MAX_PLAINTEXT {
            return Err(self.fatal(RECORD_OVERFLOW, "plaintext too long", outgoing));
        }
        let content = &body[..len];
        match typ {
            APPLICATION_DATA => self.data(content, plain, outgoing)?,
            ALERT => match *content {
                [_, CLOSE_NOTIFY] => self.closed = true,
                [WARNING, _] if self.warnings_left > 0 => self.warnings_left -= 1,
                [WARNING, _] => {
                    return Err(self.fatal(UNEXPECTED_MESSAGE, "too many warning alerts", outgoing))
                }
                [FATAL, desc] => {
                    self.failed = true;
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        format!("peer sent TLS alert {desc}"),
                    ));
                }
                [_, _] => return Err(self.fatal(ILLEGAL_PARAMETER, "alert level", outgoing)),
                _ => return Err(self.fatal(DECODE_ERROR, "malformed alert", outgoing)),
            },
            // A renegotiation: refused with a warning once, as rustls does.
            HANDSHAKE if content.first() == Some(&CLIENT_HELLO) && self.renegotiations_left > 0 => {
                self.renegotiations_left -= 1;
                self.seal(ALERT, &[WARNING, NO_RENEGOTIATION], outgoing)?;
            }
            _ => return Err(self.fatal(UNEXPECTED_MESSAGE, "unexpected record", outgoing)),
        }
        Ok(())
    }

    /// Post-handshake messages from a client: only KeyUpdate.
    fn handshake(&mut self, mut content: &[u8], outgoing: &mut Vec<u8>) -> io::Result<()> {
        while !content.is_empty() {
            let have = usize::from(self.hs_len);
            let take = content.len().min(self.hs.len() - have);
            self.hs[have..have + take].copy_from_slice(&content[..take]);
            content = &content[take..];
            self.hs_len += take as u8;
            if self.hs[0] != KEY_UPDATE {
                return Err(self.fatal(UNEXPECTED_MESSAGE, "handshake message", outgoing));
            }
            if usize::from(self.hs_len) < self.hs.len() {
                break;
            }
            if self.hs[1..4] != [0, 0, 1] {
                return Err(self.fatal(DECODE_ERROR, "malformed KeyUpdate", outgoing));
            }
            let requested = match self.hs[4] {
                0 => false,
                1 => true,
                _ => return Err(self.fatal(ILLEGAL_PARAMETER, "KeyUpdate request", outgoing)),
            };
            self.hs_len = 0;
            // A key change ends the record (RFC 8446 §5.1).
            if !content.is_empty() {
                return Err(self.fatal(UNEXPECTED_MESSAGE, "data after KeyUpdate", outgoing));
            }
            self.rx = self
                .rx
                .updated(self.suite)
                .ok_or_else(|| internal("key update"))?;
            if requested {
                self.update_tx(outgoing)?;
            }
        }
        Ok(())
    }

    /// Sends KeyUpdate(update_not_requested) under the current key, then moves to the
    /// next one.
    fn update_tx(&mut self, outgoing: &mut Vec<u8>) -> io::Result<()> {
        self.seal(HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 0], outgoing)?;
        self.tx = self
            .tx
            .updated(self.suite)
            .ok_or_else(|| internal("key update"))?;
        Ok(())
    }

    /// Encrypts `data` into `outgoing` as application data records.
    pub fn write(&mut self, data: &[u8], outgoing: &mut Vec<u8>) -> io::Result<()> {
        if self.failed {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let overhead = match self.version {
            Version::Tls13 => HEADER + 1 + TAG,
            Version::Tls12 => HEADER + self.suite.explicit_nonce(Version::Tls12) + TAG,
        };
        outgoing.reserve(data.len() + data.len().div_ceil(MAX_PLAINTEXT) * overhead);
        for chunk in data.chunks(MAX_PLAINTEXT) {
            self.seal(APPLICATION_DATA, chunk, outgoing)?;
        }
        Ok(())
    }

    /// Our close_notify.
    pub fn close_notify(&mut self, outgoing: &mut Vec<u8>) -> io::Result<()> {
        if self.failed {
            return Ok(());
        }
        self.seal(ALERT, &[1, CLOSE_NOTIFY], outgoing)
    }

    /// One record of `typ` carrying `content` (at most [`MAX_PLAINTEXT`]).
    fn seal(&mut self, typ: u8, content: &[u8], outgoing: &mut Vec<u8>) -> io::Result<()> {
        if self.version == Version::Tls12 {
            return self.seal12(typ, content, outgoing);
        }
        if typ != HANDSHAKE && self.tx.seq >= self.suite.record_limit() - 1 {
            self.update_tx(outgoing)?;
        }
        let len = content.len() + 1 + TAG;
        let len16 = u16::try_from(len).map_err(|_| internal("record too long"))?;
        let start = outgoing.len();
        outgoing.extend_from_slice(&[APPLICATION_DATA, 3, 3]);
        outgoing.extend_from_slice(&len16.to_be_bytes());
        outgoing.extend_from_slice(content);
        outgoing.push(typ);
        let suite = self.suite;
        let (_, nonce) = self.tx.next()?;
        let (header, body) = outgoing[start..].split_at_mut(HEADER);
        let tag = self
            .tx
            .key(suite)?
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&*header),
                body,
            )
            .map_err(|_| internal("seal"))?;
        outgoing.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// One TLS 1.2 record. A key at its record limit ends the connection: TLS 1.2 has
    /// no key update, so the last record it seals is our close_notify (as rustls).
    fn seal12(&mut self, typ: u8, content: &[u8], outgoing: &mut Vec<u8>) -> io::Result<()> {
        if self.tx.seq >= self.suite.record_limit() - 1 {
            if !self.failed {
                self.failed = true;
                self.seal12_now(ALERT, &[WARNING, CLOSE_NOTIFY], outgoing)?;
            }
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "TLS 1.2 key used up: connection closed",
            ));
        }
        self.seal12_now(typ, content, outgoing)
    }

    fn seal12_now(&mut self, typ: u8, content: &[u8], outgoing: &mut Vec<u8>) -> io::Result<()> {
        let suite = self.suite;
        let explicit = suite.explicit_nonce(Version::Tls12);
        let len = explicit + content.len() + TAG;
        let len16 = u16::try_from(len).map_err(|_| internal("record too long"))?;
        let (seq, nonce) = self.tx.next()?;
        let aad = aad12(seq, typ, [3, 3], content.len())?;
        outgoing.extend_from_slice(&[typ, 3, 3]);
        outgoing.extend_from_slice(&len16.to_be_bytes());
        // Our explicit nonce is the IV's last 8 bytes XOR the sequence number (unique
        // per key, as RFC 5288 asks).
        outgoing.extend_from_slice(&nonce[12 - explicit..]);
        let start = outgoing.len();
        outgoing.extend_from_slice(content);
        let tag = self
            .tx
            .key(suite)?
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                &mut outgoing[start..],
            )
            .map_err(|_| internal("seal"))?;
        outgoing.extend_from_slice(tag.as_ref());
        Ok(())
    }

    /// Queues a fatal alert (best effort) and returns the error to report.
    fn fatal(&mut self, desc: u8, what: &str, outgoing: &mut Vec<u8>) -> io::Error {
        if !self.failed {
            let _ = self.seal(ALERT, &[2, desc], outgoing);
            self.failed = true;
        }
        io::Error::new(io::ErrorKind::InvalidData, format!("TLS: {what}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(suite: Suite) -> (Records, Records) {
        let c = Secret::new(&[7u8; 48][..suite.hash_len()]).expect("secret");
        let s = Secret::new(&[9u8; 48][..suite.hash_len()]).expect("secret");
        let make = |rx: Secret, tx: Secret| {
            Records::with(
                Version::Tls13,
                suite,
                Direction::new(suite, rx, 0).expect("rx"),
                Direction::new(suite, tx, 0).expect("tx"),
            )
        };
        // The "client" reads what the server sends and the other way round.
        (make(c, s), make(s, c))
    }

    /// A TLS 1.2 pair: the server's (rx, tx) are the client's (tx, rx).
    fn pair12(suite: Suite) -> (Records, Records) {
        let key_len = suite.aead().key_len();
        let dir = |k: u8, seq| Direction::from_keys(&[k; 32][..key_len], &[k ^ 0x55; 12], seq);
        let make = |rx: u8, tx: u8| {
            Records::with(
                Version::Tls12,
                suite,
                dir(rx, 3).expect("rx"),
                dir(tx, 3).expect("tx"),
            )
        };
        (make(1, 2), make(2, 1))
    }

    #[test]
    fn tls12_round_trip_alerts_and_renegotiation() {
        for suite in [Suite::Aes128Gcm, Suite::Aes256Gcm, Suite::Chacha20Poly1305] {
            let (mut server, mut client) = pair12(suite);
            let explicit = suite.explicit_nonce(Version::Tls12);
            let mut wire = Vec::new();
            let big: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
            server.write(&big, &mut wire).expect("write");
            assert_eq!(wire.len(), big.len() + 3 * (HEADER + explicit + TAG));
            assert_eq!(wire[0], APPLICATION_DATA, "TLS 1.2 records show their type");
            let (mut plain, mut out) = (Vec::new(), Vec::new());
            let r = client.read(&mut wire, &mut plain, &mut out).expect("read");
            assert_eq!((r.consumed, r.closed), (wire.len(), false));
            assert_eq!(plain, big);
            // Warning alerts are ignored, four of them.
            for _ in 0..WARNINGS_ALLOWED {
                let mut wire = Vec::new();
                client.seal(ALERT, &[WARNING, 42], &mut wire).expect("seal");
                server
                    .read(&mut wire, &mut plain, &mut out)
                    .expect("ignored");
            }
            // A renegotiation gets a no_renegotiation warning, once.
            let mut wire = Vec::new();
            client
                .seal(HANDSHAKE, &[CLIENT_HELLO, 0, 0, 0], &mut wire)
                .expect("seal");
            let mut reply = Vec::new();
            server
                .read(&mut wire, &mut plain, &mut reply)
                .expect("refused");
            plain.clear();
            let mut seen = Vec::new();
            // The client reads the warning: ignored.
            client
                .read(&mut reply, &mut seen, &mut out)
                .expect("warning");
            assert!(seen.is_empty());
            let mut wire = Vec::new();
            client.write(b"still here", &mut wire).expect("write");
            server.read(&mut wire, &mut plain, &mut out).expect("read");
            assert_eq!(plain, b"still here");
            let mut wire = Vec::new();
            client
                .seal(HANDSHAKE, &[CLIENT_HELLO, 0, 0, 0], &mut wire)
                .expect("seal");
            assert!(server.read(&mut wire, &mut plain, &mut out).is_err());

            let (mut server, mut client) = pair12(suite);
            let mut wire = Vec::new();
            server.close_notify(&mut wire).expect("close");
            let r = client.read(&mut wire, &mut plain, &mut out).expect("close");
            assert!(r.closed);
            let _ = &mut server;
        }
    }

    #[test]
    fn tls12_garbage_and_used_up_keys() {
        let (mut server, mut client) = pair12(Suite::Aes128Gcm);
        let (mut plain, mut out) = (Vec::new(), Vec::new());
        let mut wire = Vec::new();
        server.write(b"hello", &mut wire).expect("write");
        let last = wire.len() - 1;
        wire[last] ^= 1;
        let err = client
            .read(&mut wire, &mut plain, &mut out)
            .expect_err("tampered");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(!out.is_empty(), "a bad_record_mac alert is queued");

        // Shorter than the explicit nonce and tag.
        let (_, mut client) = pair12(Suite::Aes128Gcm);
        let mut short = vec![APPLICATION_DATA, 3, 3, 0, 10];
        short.extend_from_slice(&[0; 10]);
        assert!(client.read(&mut short, &mut plain, &mut out).is_err());
        // change_cipher_spec after the handshake.
        let (_, mut client) = pair12(Suite::Aes128Gcm);
        let mut ccs = vec![20, 3, 3, 0, 1, 1];
        assert!(client.read(&mut ccs, &mut plain, &mut out).is_err());
        // Too many empty records.
        let (mut server, mut client) = pair12(Suite::Chacha20Poly1305);
        let mut wire = Vec::new();
        for _ in 0..=EMPTIES_ALLOWED {
            server.seal(APPLICATION_DATA, &[], &mut wire).expect("seal");
        }
        assert!(client.read(&mut wire, &mut plain, &mut out).is_err());

        // At the record limit the key seals a close_notify and nothing more.
        let (mut server, mut client) = pair12(Suite::Aes256Gcm);
        server.tx.seq = GCM_RECORD_LIMIT - 1;
        client.rx.seq = GCM_RECORD_LIMIT - 1;
        let mut wire = Vec::new();
        let err = server.write(b"x", &mut wire).expect_err("used up");
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
        let r = client.read(&mut wire, &mut plain, &mut out).expect("close");
        assert!(r.closed);
        assert!(server.write(b"y", &mut wire).is_err());
    }

    #[test]
    fn expand_label_matches_rfc8448() {
        // RFC 8448 §3, server handshake traffic secret -> key and iv (SHA-256).
        let secret: Vec<u8> = (0..32)
            .map(|i| {
                u8::from_str_radix(
                    &"b67b7d690cc16c4e75e54213cb2d37b4e9c912bcded9105d42befd59d391ad38"
                        [2 * i..2 * i + 2],
                    16,
                )
                .expect("hex")
            })
            .collect();
        let mut key = [0u8; 16];
        let mut iv = [0u8; 12];
        expand_label(hkdf::HKDF_SHA256, &secret, b"key", &mut key).expect("key");
        expand_label(hkdf::HKDF_SHA256, &secret, b"iv", &mut iv).expect("iv");
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        assert_eq!(hex(&key), "3fce516009c21727d0f2e4e86ee403bc");
        assert_eq!(hex(&iv), "5d313eb2671276ee13000b30");
    }

    #[test]
    fn round_trip_key_updates_and_close() {
        for suite in [Suite::Aes128Gcm, Suite::Aes256Gcm, Suite::Chacha20Poly1305] {
            let (mut server, mut client) = pair(suite);
            let mut wire = Vec::new();
            let big: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
            server.write(&big, &mut wire).expect("write");
            assert_eq!(wire.len(), big.len() + 3 * (HEADER + 1 + TAG));
            let mut plain = Vec::new();
            let mut out = Vec::new();
            let r = client.read(&mut wire, &mut plain, &mut out).expect("read");
            assert_eq!((r.consumed, r.closed), (wire.len(), false));
            assert_eq!(plain, big);
            // The client asks for a key update; the server answers with its own and
            // both directions move on.
            let mut wire = Vec::new();
            client
                .seal(HANDSHAKE, &[KEY_UPDATE, 0, 0, 1, 1], &mut wire)
                .expect("seal");
            client.tx = client.tx.updated(suite).expect("next");
            let (rx0, tx0) = (server.rx.key, server.tx.key);
            let mut reply = Vec::new();
            server
                .read(&mut wire, &mut plain, &mut reply)
                .expect("read");
            assert_ne!(server.rx.key, rx0);
            assert_ne!(server.tx.key, tx0);
            let rx0 = client.rx.key;
            client.read(&mut reply, &mut plain, &mut out).expect("ku");
            assert_ne!(
                client.rx.key, rx0,
                "the server's KeyUpdate moved the client on"
            );
            let mut wire = Vec::new();
            client.write(b"after", &mut wire).expect("write");
            plain.clear();
            server.read(&mut wire, &mut plain, &mut out).expect("read");
            assert_eq!(plain, b"after");
            server.release();
            let mut wire = Vec::new();
            server.close_notify(&mut wire).expect("close");
            let r = client.read(&mut wire, &mut plain, &mut out).expect("close");
            assert!(r.closed);
        }
    }

    #[test]
    fn partial_records_wait_and_garbage_is_fatal() {
        let (mut server, mut client) = pair(Suite::Aes128Gcm);
        let mut wire = Vec::new();
        server.write(b"hello", &mut wire).expect("write");
        let (mut plain, mut out) = (Vec::new(), Vec::new());
        let mut first = wire[..10].to_vec();
        let r = client
            .read(&mut first, &mut plain, &mut out)
            .expect("partial");
        assert_eq!(r.consumed, 0);
        wire[12] ^= 1;
        let err = client
            .read(&mut wire, &mut plain, &mut out)
            .expect_err("tampered");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(!out.is_empty(), "a bad_record_mac alert is queued");
        assert!(client.write(b"x", &mut out).is_err());

        let (_, mut client) = pair(Suite::Aes128Gcm);
        let mut plaintext_record = vec![HANDSHAKE, 3, 3, 0, 1, 0];
        assert!(client
            .read(&mut plaintext_record, &mut plain, &mut out)
            .is_err());
        let (_, mut client) = pair(Suite::Aes128Gcm);
        let mut huge = vec![APPLICATION_DATA, 3, 3, 0xff, 0xff];
        assert!(client.read(&mut huge, &mut plain, &mut out).is_err());
    }

    #[test]
    fn other_handshake_messages_and_alerts_end_the_connection() {
        let (mut server, mut client) = pair(Suite::Aes128Gcm);
        let (mut plain, mut out) = (Vec::new(), Vec::new());
        let mut wire = Vec::new();
        // A NewSessionTicket from the "client" side is not allowed at a server.
        client
            .seal(HANDSHAKE, &[4, 0, 0, 0], &mut wire)
            .expect("seal");
        assert!(server.read(&mut wire, &mut plain, &mut out).is_err());

        let (mut server, mut client) = pair(Suite::Aes128Gcm);
        let mut wire = Vec::new();
        client
            .seal(ALERT, &[1, USER_CANCELED], &mut wire)
            .expect("seal");
        client.seal(ALERT, &[2, 40], &mut wire).expect("seal");
        let err = server
            .read(&mut wire, &mut plain, &mut out)
            .expect_err("handshake_failure alert");
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
    }

    #[test]
    fn gcm_keys_move_on_before_their_record_limit() {
        let (mut server, mut client) = pair(Suite::Aes128Gcm);
        server.tx.seq = GCM_RECORD_LIMIT - 1;
        client.rx.seq = GCM_RECORD_LIMIT - 1;
        let mut wire = Vec::new();
        server.write(b"x", &mut wire).expect("write");
        assert_eq!(server.tx.seq, 1, "a KeyUpdate went first, then one record");
        let (mut plain, mut out) = (Vec::new(), Vec::new());
        client.read(&mut wire, &mut plain, &mut out).expect("read");
        assert_eq!(plain, b"x");
    }
}
