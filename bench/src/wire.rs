//! Byte-level helpers the hand-written protocol clients share: a growable read buffer over
//! a socket's read half, and big-endian encoding/decoding.

use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::tcp::OwnedReadHalf;

/// Bytes read from a socket and not yet consumed: `buf[start..end]`.
pub struct ReadBuf {
    pub rd: OwnedReadHalf,
    pub buf: Vec<u8>,
    pub start: usize,
    pub end: usize,
}

impl ReadBuf {
    pub fn new(rd: OwnedReadHalf) -> ReadBuf {
        ReadBuf::with_capacity(rd, 256 << 10)
    }

    /// Starts with `cap` bytes of buffer (it grows for larger frames).
    pub fn with_capacity(rd: OwnedReadHalf, cap: usize) -> ReadBuf {
        ReadBuf {
            rd,
            buf: vec![0; cap.max(16)],
            start: 0,
            end: 0,
        }
    }

    pub fn data(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    pub fn consume(&mut self, n: usize) {
        self.start += n;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// Reads more (at least one byte); room for at least `want` unconsumed bytes is made
    /// first. Cancel-safe. EOF is an error.
    pub async fn fill(&mut self, want: usize) -> Result<(), String> {
        if self.start > 0 && (self.end == self.buf.len() || self.start + want > self.buf.len()) {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.start + want > self.buf.len() || self.end == self.buf.len() {
            let n = (self.start + want).max(self.buf.len() * 2);
            self.buf.resize(n, 0);
        }
        match self.rd.read(&mut self.buf[self.end..]).await {
            Ok(0) => Err("connection closed by the broker".into()),
            Ok(n) => {
                self.end += n;
                Ok(())
            }
            Err(e) => Err(format!("read: {e}")),
        }
    }

    /// `fill` with a time limit.
    pub async fn fill_within(&mut self, want: usize, t: Duration) -> Result<(), String> {
        tokio::time::timeout(t, self.fill(want))
            .await
            .map_err(|_| format!("no answer from the broker within {t:?}"))?
    }
}

/// A cursor over a received payload.
pub struct Rd<'a>(pub &'a [u8]);

impl<'a> Rd<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated frame".into());
        }
        let (h, t) = self.0.split_at(n);
        self.0 = t;
        Ok(h)
    }
    pub fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, String> {
        let b = self.take(2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self) -> Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_be_bytes(a))
    }
    /// AMQP shortstr (u8 length).
    pub fn shortstr(&mut self) -> Result<&'a [u8], String> {
        let n = self.u8()? as usize;
        self.take(n)
    }
    /// AMQP longstr / table (u32 length).
    pub fn longstr(&mut self) -> Result<&'a [u8], String> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor() {
        let b = [1u8, 0, 2, 0, 0, 0, 3, 2, b'h', b'i', 0, 0, 0, 1, b'x'];
        let mut r = Rd(&b);
        assert_eq!(r.u8(), Ok(1));
        assert_eq!(r.u16(), Ok(2));
        assert_eq!(r.u32(), Ok(3));
        assert_eq!(r.shortstr(), Ok(&b"hi"[..]));
        assert_eq!(r.longstr(), Ok(&b"x"[..]));
        assert!(r.u8().is_err());
    }
}
