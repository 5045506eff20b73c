//! Password hashes in RabbitMQ's format (`rabbit_password_hashing_sha256`, the default
//! since 3.6): `base64(salt ++ sha256(salt ++ utf8(password)))` with a random 4-byte
//! salt. A hash made by `rabbitmqctl` (or exported in a RabbitMQ definitions file)
//! verifies here, and `triad hash-password` makes hashes RabbitMQ accepts.

use std::fmt;

use base64::Engine as _;
use ring::digest::{digest, SHA256, SHA256_OUTPUT_LEN};
use ring::rand::{SecureRandom, SystemRandom};

const SALT_LEN: usize = 4;
const ENCODED_LEN: usize = SALT_LEN + SHA256_OUTPUT_LEN;

/// Why a `password_hash` was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    /// Not base64.
    #[error("not base64")]
    NotBase64,
    /// Base64 of the wrong length: RabbitMQ's SHA-256 hashes decode to 36 bytes.
    #[error(
        "decodes to {0} bytes; a salted SHA-256 hash is 36 (base64 of 4-byte salt ++ SHA-256)"
    )]
    WrongLength(usize),
    /// The system's random number generator failed (making a new hash only).
    #[error("no random salt: the system random number generator failed")]
    Random,
}

/// A salted SHA-256 password hash. Its `Debug` does not show the digest.
#[derive(Clone, PartialEq, Eq)]
pub struct PasswordHash {
    salt: [u8; SALT_LEN],
    digest: [u8; SHA256_OUTPUT_LEN],
}

impl fmt::Debug for PasswordHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PasswordHash(..)")
    }
}

impl PasswordHash {
    /// Hashes `password` with a fresh random salt.
    pub fn new(password: &str) -> Result<PasswordHash, HashError> {
        let mut salt = [0u8; SALT_LEN];
        SystemRandom::new()
            .fill(&mut salt)
            .map_err(|_| HashError::Random)?;
        Ok(PasswordHash::with_salt(salt, password))
    }

    /// Hashes `password` with the given salt.
    pub fn with_salt(salt: [u8; SALT_LEN], password: &str) -> PasswordHash {
        let mut input = Vec::with_capacity(SALT_LEN + password.len());
        input.extend_from_slice(&salt);
        input.extend_from_slice(password.as_bytes());
        let mut d = [0u8; SHA256_OUTPUT_LEN];
        d.copy_from_slice(digest(&SHA256, &input).as_ref());
        PasswordHash { salt, digest: d }
    }

    /// Reads a hash in RabbitMQ's base64 form.
    pub fn parse(encoded: &str) -> Result<PasswordHash, HashError> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|_| HashError::NotBase64)?;
        let (salt, d) = bytes
            .split_first_chunk::<SALT_LEN>()
            .ok_or(HashError::WrongLength(bytes.len()))?;
        let digest: [u8; SHA256_OUTPUT_LEN] = d
            .try_into()
            .map_err(|_| HashError::WrongLength(bytes.len()))?;
        Ok(PasswordHash {
            salt: *salt,
            digest,
        })
    }

    /// RabbitMQ's base64 form.
    pub fn to_base64(&self) -> String {
        let mut b = Vec::with_capacity(ENCODED_LEN);
        b.extend_from_slice(&self.salt);
        b.extend_from_slice(&self.digest);
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    /// Whether `password` is the one hashed; the digests are compared in constant time.
    pub fn verify(&self, password: &str) -> bool {
        let other = PasswordHash::with_salt(self.salt, password);
        constant_time_eq(&self.digest, &other.digest)
    }
}

/// Compares two equal-length digests without an early exit.
fn constant_time_eq(a: &[u8; SHA256_OUTPUT_LEN], b: &[u8; SHA256_OUTPUT_LEN]) -> bool {
    let diff = a
        .iter()
        .zip(b.iter())
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worked example of RabbitMQ's "Credentials and Passwords" guide
    /// ("Computing Password Hash"): salt 908D C60A, password `test12`.
    #[test]
    fn rabbitmq_documented_vector() {
        let h = PasswordHash::parse("kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR")
            .expect("parses");
        assert!(h.verify("test12"));
        assert!(!h.verify("test13"));
        assert!(!h.verify(""));
        let made = PasswordHash::with_salt([0x90, 0x8d, 0xc6, 0x0a], "test12");
        assert_eq!(
            made.to_base64(),
            "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"
        );
    }

    #[test]
    fn new_hashes_are_salted_and_verify() {
        let a = PasswordHash::new("secret").expect("random");
        let b = PasswordHash::new("secret").expect("random");
        assert!(a.verify("secret") && b.verify("secret"));
        assert!(!a.verify("Secret"));
        // 4-byte salts collide once in 2^32: equal here means no randomness
        assert_ne!(a.to_base64(), b.to_base64());
        let back = PasswordHash::parse(&a.to_base64()).expect("round trip");
        assert_eq!(back, a);
        assert!(!format!("{a:?}").contains(&a.to_base64()));
    }

    #[test]
    fn bad_hashes_are_refused() {
        assert_eq!(PasswordHash::parse("guest"), Err(HashError::NotBase64));
        assert_eq!(
            PasswordHash::parse("Z3Vlc3Q="),
            Err(HashError::WrongLength(5))
        );
        assert_eq!(PasswordHash::parse(""), Err(HashError::WrongLength(0)));
    }
}
