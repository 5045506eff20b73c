//! The core's compact storage encoding of values (not a wire format: nothing outside
//! Triad reads it). Used by [`crate::message::Properties::encode`].
//!
//! Lengths and counts are LEB128 varints; integers are fixed-width big-endian. Every
//! length and count is checked against the remaining input before anything is
//! allocated, and nesting is bounded by [`MAX_DEPTH`], so decoding arbitrary bytes
//! returns an error rather than panicking or allocating without bound.

use bytes::Bytes;

use crate::error::CoreError;
use crate::value::{Decimal, FieldTable, FieldValue, MAX_DEPTH};

const TAG_VOID: u8 = 0;
const TAG_BOOL: u8 = 1;
const TAG_I8: u8 = 2;
const TAG_U8: u8 = 3;
const TAG_I16: u8 = 4;
const TAG_U16: u8 = 5;
const TAG_I32: u8 = 6;
const TAG_U32: u8 = 7;
const TAG_I64: u8 = 8;
const TAG_F32: u8 = 9;
const TAG_F64: u8 = 10;
const TAG_DECIMAL: u8 = 11;
const TAG_SHORT_STRING: u8 = 12;
const TAG_LONG_STRING: u8 = 13;
const TAG_TIMESTAMP: u8 = 14;
const TAG_TABLE: u8 = 15;
const TAG_ARRAY: u8 = 16;
const TAG_BYTE_ARRAY: u8 = 17;

const TOO_DEEP: &str = "tables and arrays nested deeper than MAX_DEPTH";

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    put_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

/// Encodes a table; `depth` is the number of containers already around it.
pub(crate) fn put_table(out: &mut Vec<u8>, t: &FieldTable, depth: usize) -> Result<(), CoreError> {
    let depth = depth + 1;
    if depth > MAX_DEPTH {
        return Err(CoreError::LimitExceeded(TOO_DEEP));
    }
    put_varint(out, t.len() as u64);
    for (name, value) in t.iter() {
        put_bytes(out, name.as_bytes());
        put_value(out, value, depth)?;
    }
    Ok(())
}

fn put_value(out: &mut Vec<u8>, v: &FieldValue, depth: usize) -> Result<(), CoreError> {
    match v {
        FieldValue::Void => out.push(TAG_VOID),
        FieldValue::Bool(b) => out.extend_from_slice(&[TAG_BOOL, u8::from(*b)]),
        FieldValue::I8(x) => {
            out.push(TAG_I8);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::U8(x) => out.extend_from_slice(&[TAG_U8, *x]),
        FieldValue::I16(x) => {
            out.push(TAG_I16);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::U16(x) => {
            out.push(TAG_U16);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::I32(x) => {
            out.push(TAG_I32);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::U32(x) => {
            out.push(TAG_U32);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::I64(x) => {
            out.push(TAG_I64);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::F32(x) => {
            out.push(TAG_F32);
            out.extend_from_slice(&x.to_bits().to_be_bytes());
        }
        FieldValue::F64(x) => {
            out.push(TAG_F64);
            out.extend_from_slice(&x.to_bits().to_be_bytes());
        }
        FieldValue::Decimal(d) => {
            out.extend_from_slice(&[TAG_DECIMAL, d.scale]);
            out.extend_from_slice(&d.value.to_be_bytes());
        }
        FieldValue::ShortString(b) => {
            out.push(TAG_SHORT_STRING);
            put_bytes(out, b);
        }
        FieldValue::LongString(b) => {
            out.push(TAG_LONG_STRING);
            put_bytes(out, b);
        }
        FieldValue::Timestamp(x) => {
            out.push(TAG_TIMESTAMP);
            out.extend_from_slice(&x.to_be_bytes());
        }
        FieldValue::Table(t) => {
            out.push(TAG_TABLE);
            put_table(out, t, depth)?;
        }
        FieldValue::Array(a) => {
            let depth = depth + 1;
            if depth > MAX_DEPTH {
                return Err(CoreError::LimitExceeded(TOO_DEEP));
            }
            out.push(TAG_ARRAY);
            put_varint(out, a.len() as u64);
            for v in a {
                put_value(out, v, depth)?;
            }
        }
        FieldValue::ByteArray(b) => {
            out.push(TAG_BYTE_ARRAY);
            put_bytes(out, b);
        }
    }
    Ok(())
}

/// A bounds-checked cursor over stored bytes.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
}

const TRUNCATED: CoreError = CoreError::InvalidEncoding("truncated");

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], CoreError> {
        if n > self.buf.len() {
            return Err(TRUNCATED);
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], CoreError> {
        let b = self.take(N)?;
        <[u8; N]>::try_from(b).map_err(|_| TRUNCATED)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, CoreError> {
        Ok(u8::from_be_bytes(self.array()?))
    }

    pub(crate) fn u16(&mut self) -> Result<u16, CoreError> {
        Ok(u16::from_be_bytes(self.array()?))
    }

    fn u32(&mut self) -> Result<u32, CoreError> {
        Ok(u32::from_be_bytes(self.array()?))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, CoreError> {
        Ok(u64::from_be_bytes(self.array()?))
    }

    pub(crate) fn varint(&mut self) -> Result<u64, CoreError> {
        let mut v: u64 = 0;
        for i in 0..10 {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if i == 9 && b > 1 {
                return Err(CoreError::InvalidEncoding("varint overflow"));
            }
            v |= bits << (7 * i);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(CoreError::InvalidEncoding("varint overflow"))
    }

    /// A count or length, checked to be at most the remaining input (every element
    /// takes at least one byte), so it is safe to allocate.
    pub(crate) fn len(&mut self) -> Result<usize, CoreError> {
        let n = self.varint()?;
        match usize::try_from(n) {
            Ok(n) if n <= self.remaining() => Ok(n),
            _ => Err(TRUNCATED),
        }
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], CoreError> {
        let n = self.len()?;
        self.take(n)
    }

    pub(crate) fn string(&mut self) -> Result<String, CoreError> {
        let b = self.bytes()?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| CoreError::InvalidEncoding("string is not UTF-8"))
    }

    /// Decodes a table; `depth` is the number of containers already around it.
    pub(crate) fn table(&mut self, depth: usize) -> Result<FieldTable, CoreError> {
        let depth = depth + 1;
        if depth > MAX_DEPTH {
            return Err(CoreError::InvalidEncoding(TOO_DEEP));
        }
        let n = self.len()?;
        let mut t = FieldTable::new();
        for _ in 0..n {
            let name = self.string()?;
            let value = self.value(depth)?;
            t.push(name, value);
        }
        Ok(t)
    }

    fn value(&mut self, depth: usize) -> Result<FieldValue, CoreError> {
        let tag = self.u8()?;
        Ok(match tag {
            TAG_VOID => FieldValue::Void,
            TAG_BOOL => match self.u8()? {
                0 => FieldValue::Bool(false),
                1 => FieldValue::Bool(true),
                _ => return Err(CoreError::InvalidEncoding("bool is not 0 or 1")),
            },
            TAG_I8 => FieldValue::I8(i8::from_be_bytes(self.array()?)),
            TAG_U8 => FieldValue::U8(self.u8()?),
            TAG_I16 => FieldValue::I16(i16::from_be_bytes(self.array()?)),
            TAG_U16 => FieldValue::U16(self.u16()?),
            TAG_I32 => FieldValue::I32(i32::from_be_bytes(self.array()?)),
            TAG_U32 => FieldValue::U32(self.u32()?),
            TAG_I64 => FieldValue::I64(i64::from_be_bytes(self.array()?)),
            TAG_F32 => FieldValue::F32(f32::from_bits(self.u32()?)),
            TAG_F64 => FieldValue::F64(f64::from_bits(self.u64()?)),
            TAG_DECIMAL => {
                let scale = self.u8()?;
                let value = self.u32()?;
                FieldValue::Decimal(Decimal { scale, value })
            }
            TAG_SHORT_STRING => FieldValue::ShortString(Bytes::copy_from_slice(self.bytes()?)),
            TAG_LONG_STRING => FieldValue::LongString(Bytes::copy_from_slice(self.bytes()?)),
            TAG_TIMESTAMP => FieldValue::Timestamp(self.u64()?),
            TAG_TABLE => FieldValue::Table(self.table(depth)?),
            TAG_ARRAY => {
                let depth = depth + 1;
                if depth > MAX_DEPTH {
                    return Err(CoreError::InvalidEncoding(TOO_DEEP));
                }
                let n = self.len()?;
                let mut a = Vec::with_capacity(n);
                for _ in 0..n {
                    a.push(self.value(depth)?);
                }
                FieldValue::Array(a)
            }
            TAG_BYTE_ARRAY => FieldValue::ByteArray(Bytes::copy_from_slice(self.bytes()?)),
            _ => return Err(CoreError::InvalidEncoding("unknown value tag")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_round_trip_and_overflow() {
        for v in [0u64, 1, 127, 128, 300, u32::MAX as u64, u64::MAX] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            assert_eq!(Reader::new(&out).varint(), Ok(v));
        }
        let too_long = [0xffu8; 11];
        assert!(Reader::new(&too_long).varint().is_err());
        let overflow = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
        assert!(Reader::new(&overflow).varint().is_err());
    }

    #[test]
    fn huge_declared_length_is_refused_before_allocating() {
        let mut out = Vec::new();
        put_varint(&mut out, u64::MAX >> 1);
        assert_eq!(Reader::new(&out).bytes(), Err(TRUNCATED));
        let mut out = vec![];
        put_varint(&mut out, 1 << 40);
        assert!(Reader::new(&out).table(0).is_err());
    }

    #[test]
    fn depth_bound_on_both_sides() {
        let mut v = FieldValue::I8(1);
        for _ in 0..MAX_DEPTH - 1 {
            v = FieldValue::Array(vec![v]);
        }
        let ok: FieldTable = [("k", v.clone())].into_iter().collect();
        assert_eq!(ok.depth(), MAX_DEPTH);
        let mut out = Vec::new();
        put_table(&mut out, &ok, 0).unwrap();
        assert_eq!(Reader::new(&out).table(0).unwrap(), ok);

        let deep: FieldTable = [("k", FieldValue::Array(vec![v]))].into_iter().collect();
        assert_eq!(
            put_table(&mut Vec::new(), &deep, 0),
            Err(CoreError::LimitExceeded(TOO_DEEP))
        );
        // Hand-build an over-deep encoding: nested single-element arrays.
        let mut raw = vec![1u8, 1, b'k'];
        for _ in 0..MAX_DEPTH + 2 {
            raw.extend_from_slice(&[TAG_ARRAY, 1]);
        }
        raw.push(TAG_VOID);
        assert_eq!(
            Reader::new(&raw).table(0),
            Err(CoreError::InvalidEncoding(TOO_DEEP))
        );
    }
}
