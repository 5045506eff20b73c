//! Header and argument values: AMQP 0-9-1 field tables as RabbitMQ uses them.
//!
//! Every protocol's headers and every declare/bind argument end up as a [`FieldTable`].
//! The variants follow RabbitMQ's reading of the 0-9-1 errata (type letters in
//! brackets): `t` bool, `b` i8, `B` u8, `s` i16, `u` u16, `I` i32, `i` u32, `l` i64,
//! `f` f32, `d` f64, `D` decimal, `S` long string, `T` timestamp, `F` table, `A` array,
//! `x` byte array, `V` void. [`FieldValue::ShortString`] has no RabbitMQ table letter
//! (the spec's `s` clashes with i16) but client libraries model it, so it is kept to
//! round-trip their values. There is no unsigned 64-bit variant: RabbitMQ has no letter
//! for it, so no AMQP peer can send one, and STOMP/MQTT headers are strings.
//!
//! Values compare with `==` structurally, floats by bit pattern (so `NaN == NaN` and a
//! table holding one can still be found and removed). Routing uses its own looser
//! comparison ([`FieldValue::loosely_equals`]) where RabbitMQ does.

use std::fmt;

use bytes::Bytes;

/// Maximum nesting of tables and arrays, counting the outermost table as 1.
///
/// Deeper values are refused when encoded and rejected when decoded.
pub const MAX_DEPTH: usize = 16;

/// An AMQP decimal: `value / 10^scale`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Decimal {
    /// Number of decimal digits after the point.
    pub scale: u8,
    /// The unscaled value.
    pub value: u32,
}

/// One header or argument value.
#[derive(Clone)]
pub enum FieldValue {
    /// `t`
    Bool(bool),
    /// `b`
    I8(i8),
    /// `B`
    U8(u8),
    /// `s` (RabbitMQ's reading)
    I16(i16),
    /// `u`
    U16(u16),
    /// `I`
    I32(i32),
    /// `i`
    U32(u32),
    /// `l`
    I64(i64),
    /// `f`
    F32(f32),
    /// `d`
    F64(f64),
    /// `D`
    Decimal(Decimal),
    /// A short string (at most 255 bytes on the AMQP wire; not enforced here).
    ShortString(Bytes),
    /// `S`: bytes, not necessarily UTF-8.
    LongString(Bytes),
    /// `T`: seconds since the Unix epoch.
    Timestamp(u64),
    /// `F`
    Table(FieldTable),
    /// `A`
    Array(Vec<FieldValue>),
    /// `x`
    ByteArray(Bytes),
    /// `V`: no value.
    Void,
}

/// The class of a value for RabbitMQ's headers-exchange comparison: integers of any
/// width compare with each other, as do both float widths and both string kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeClass {
    /// Bool.
    Bool,
    /// Any integer width.
    Int,
    /// f32 or f64.
    Float,
    /// Decimal.
    Decimal,
    /// Short or long string.
    String,
    /// Timestamp.
    Timestamp,
    /// Table.
    Table,
    /// Array.
    Array,
    /// Byte array.
    Bytes,
    /// Void.
    Void,
}

impl FieldValue {
    /// The value's comparison class (see [`TypeClass`]).
    pub fn type_class(&self) -> TypeClass {
        match self {
            FieldValue::Bool(_) => TypeClass::Bool,
            FieldValue::I8(_)
            | FieldValue::U8(_)
            | FieldValue::I16(_)
            | FieldValue::U16(_)
            | FieldValue::I32(_)
            | FieldValue::U32(_)
            | FieldValue::I64(_) => TypeClass::Int,
            FieldValue::F32(_) | FieldValue::F64(_) => TypeClass::Float,
            FieldValue::Decimal(_) => TypeClass::Decimal,
            FieldValue::ShortString(_) | FieldValue::LongString(_) => TypeClass::String,
            FieldValue::Timestamp(_) => TypeClass::Timestamp,
            FieldValue::Table(_) => TypeClass::Table,
            FieldValue::Array(_) => TypeClass::Array,
            FieldValue::ByteArray(_) => TypeClass::Bytes,
            FieldValue::Void => TypeClass::Void,
        }
    }

    /// RabbitMQ's headers-exchange equality: same [`TypeClass`] and equal value, so
    /// `I32(1)` equals `I64(1)` and `F32(0.5)` equals `F64(0.5)`, but `I64(1)` does not
    /// equal `F64(1.0)` or `LongString("1")`. Tables and arrays compare exactly.
    pub fn loosely_equals(&self, other: &FieldValue) -> bool {
        if self.type_class() != other.type_class() {
            return false;
        }
        match self.type_class() {
            TypeClass::Int => self.as_i64() == other.as_i64(),
            TypeClass::Float => match (self.as_f64(), other.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => false,
            },
            TypeClass::String => self.as_bytes() == other.as_bytes(),
            _ => self == other,
        }
    }

    /// The value as a bool, for [`FieldValue::Bool`].
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            FieldValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The value as an `i64`, for every integer variant.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            FieldValue::I8(v) => Some(i64::from(v)),
            FieldValue::U8(v) => Some(i64::from(v)),
            FieldValue::I16(v) => Some(i64::from(v)),
            FieldValue::U16(v) => Some(i64::from(v)),
            FieldValue::I32(v) => Some(i64::from(v)),
            FieldValue::U32(v) => Some(i64::from(v)),
            FieldValue::I64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a non-negative integer, for integer variants holding one.
    /// Arguments such as `x-message-ttl` and `x-max-length` are read with this.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i64().and_then(|v| u64::try_from(v).ok())
    }

    /// The value as an `f64`, for the float variants.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            FieldValue::F32(v) => Some(f64::from(v)),
            FieldValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The raw bytes of a short string, long string or byte array.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            FieldValue::ShortString(b) | FieldValue::LongString(b) | FieldValue::ByteArray(b) => {
                Some(b)
            }
            _ => None,
        }
    }

    /// A short or long string that is valid UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            FieldValue::ShortString(b) | FieldValue::LongString(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The nested table, for [`FieldValue::Table`].
    pub fn as_table(&self) -> Option<&FieldTable> {
        match self {
            FieldValue::Table(t) => Some(t),
            _ => None,
        }
    }

    /// The elements, for [`FieldValue::Array`].
    pub fn as_array(&self) -> Option<&[FieldValue]> {
        match self {
            FieldValue::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Whether this is [`FieldValue::Void`].
    pub fn is_void(&self) -> bool {
        matches!(self, FieldValue::Void)
    }

    /// Nesting depth: 0 for scalars, 1 + the deepest element for tables and arrays.
    pub fn depth(&self) -> usize {
        match self {
            FieldValue::Table(t) => t.depth(),
            FieldValue::Array(a) => 1 + a.iter().map(FieldValue::depth).max().unwrap_or(0),
            _ => 0,
        }
    }
}

impl PartialEq for FieldValue {
    fn eq(&self, other: &Self) -> bool {
        use FieldValue::*;
        match (self, other) {
            (Bool(a), Bool(b)) => a == b,
            (I8(a), I8(b)) => a == b,
            (U8(a), U8(b)) => a == b,
            (I16(a), I16(b)) => a == b,
            (U16(a), U16(b)) => a == b,
            (I32(a), I32(b)) => a == b,
            (U32(a), U32(b)) => a == b,
            (I64(a), I64(b)) => a == b,
            (F32(a), F32(b)) => a.to_bits() == b.to_bits(),
            (F64(a), F64(b)) => a.to_bits() == b.to_bits(),
            (Decimal(a), Decimal(b)) => a == b,
            (ShortString(a), ShortString(b)) => a == b,
            (LongString(a), LongString(b)) => a == b,
            (Timestamp(a), Timestamp(b)) => a == b,
            (Table(a), Table(b)) => a == b,
            (Array(a), Array(b)) => a == b,
            (ByteArray(a), ByteArray(b)) => a == b,
            (Void, Void) => true,
            _ => false,
        }
    }
}

impl Eq for FieldValue {}

impl fmt::Debug for FieldValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FieldValue::Bool(v) => write!(f, "Bool({v})"),
            FieldValue::I8(v) => write!(f, "I8({v})"),
            FieldValue::U8(v) => write!(f, "U8({v})"),
            FieldValue::I16(v) => write!(f, "I16({v})"),
            FieldValue::U16(v) => write!(f, "U16({v})"),
            FieldValue::I32(v) => write!(f, "I32({v})"),
            FieldValue::U32(v) => write!(f, "U32({v})"),
            FieldValue::I64(v) => write!(f, "I64({v})"),
            FieldValue::F32(v) => write!(f, "F32({v:?})"),
            FieldValue::F64(v) => write!(f, "F64({v:?})"),
            FieldValue::Decimal(d) => write!(f, "Decimal({}e-{})", d.value, d.scale),
            FieldValue::ShortString(b) => write!(f, "ShortString({b:?})"),
            FieldValue::LongString(b) => write!(f, "LongString({b:?})"),
            FieldValue::Timestamp(v) => write!(f, "Timestamp({v})"),
            FieldValue::Table(t) => write!(f, "Table({t:?})"),
            FieldValue::Array(a) => f.debug_tuple("Array").field(a).finish(),
            FieldValue::ByteArray(b) => write!(f, "ByteArray({b:?})"),
            FieldValue::Void => f.write_str("Void"),
        }
    }
}

macro_rules! from_scalar {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for FieldValue {
            fn from(v: $t) -> Self {
                FieldValue::$v(v)
            }
        })*
    };
}

from_scalar!(
    bool => Bool, i8 => I8, u8 => U8, i16 => I16, u16 => U16, i32 => I32, u32 => U32,
    i64 => I64, f32 => F32, f64 => F64, Decimal => Decimal, FieldTable => Table,
    Vec<FieldValue> => Array,
);

impl From<&str> for FieldValue {
    /// A long string, as RabbitMQ uses for every string header.
    fn from(v: &str) -> Self {
        FieldValue::LongString(Bytes::copy_from_slice(v.as_bytes()))
    }
}

impl From<String> for FieldValue {
    /// A long string, as RabbitMQ uses for every string header.
    fn from(v: String) -> Self {
        FieldValue::LongString(Bytes::from(v))
    }
}

/// An ordered table of named values.
///
/// Order is preserved as given, because clients compare tables they sent with what
/// they get back and RabbitMQ's `x-death` header relies on it. Names are normally
/// unique; if a peer sent duplicates, [`FieldTable::get`] returns the first.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct FieldTable {
    entries: Vec<(String, FieldValue)>,
}

impl FieldTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table has no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The first value with this name.
    pub fn get(&self, name: &str) -> Option<&FieldValue> {
        self.entries.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    /// Whether a value with this name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.get(name).is_some()
    }

    /// Sets `name` to `value`: replaces the first entry with that name in place, or
    /// appends. Returns the previous value.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        value: impl Into<FieldValue>,
    ) -> Option<FieldValue> {
        let name = name.into();
        let value = value.into();
        match self.entries.iter_mut().find(|(n, _)| *n == name) {
            Some((_, slot)) => Some(std::mem::replace(slot, value)),
            None => {
                self.entries.push((name, value));
                None
            }
        }
    }

    /// Appends an entry without looking for an existing one (decoders use this to keep
    /// exactly what the peer sent).
    pub fn push(&mut self, name: impl Into<String>, value: impl Into<FieldValue>) {
        self.entries.push((name.into(), value.into()));
    }

    /// Removes every entry with this name, returning the first removed value.
    pub fn remove(&mut self, name: &str) -> Option<FieldValue> {
        let mut first = None;
        let mut kept = Vec::with_capacity(self.entries.len());
        for (n, v) in self.entries.drain(..) {
            if n == name {
                if first.is_none() {
                    first = Some(v);
                }
            } else {
                kept.push((n, v));
            }
        }
        self.entries = kept;
        first
    }

    /// Entries in order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &FieldValue)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), v))
    }

    /// Nesting depth: 1 + the deepest value.
    pub fn depth(&self) -> usize {
        1 + self
            .entries
            .iter()
            .map(|(_, v)| v.depth())
            .max()
            .unwrap_or(0)
    }

    /// A string argument (short or long string, UTF-8).
    pub fn get_str(&self, name: &str) -> Option<&str> {
        self.get(name).and_then(FieldValue::as_str)
    }

    /// An integer argument of any width.
    pub fn get_i64(&self, name: &str) -> Option<i64> {
        self.get(name).and_then(FieldValue::as_i64)
    }
}

impl fmt::Debug for FieldTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.entries.iter().map(|(n, v)| (n, v)))
            .finish()
    }
}

impl<N: Into<String>, V: Into<FieldValue>> FromIterator<(N, V)> for FieldTable {
    fn from_iter<I: IntoIterator<Item = (N, V)>>(iter: I) -> Self {
        FieldTable {
            entries: iter
                .into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
        }
    }
}

impl IntoIterator for FieldTable {
    type Item = (String, FieldValue);
    type IntoIter = std::vec::IntoIter<(String, FieldValue)>;

    fn into_iter(self) -> Self::IntoIter {
        self.entries.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_preserves_order_and_replaces_in_place() {
        let mut t = FieldTable::new();
        t.insert("b", 1i32);
        t.insert("a", "x");
        t.insert("c", true);
        assert_eq!(t.insert("a", 2i64), Some(FieldValue::from("x")));
        let names: Vec<_> = t.iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["b", "a", "c"]);
        assert_eq!(t.get_i64("a"), Some(2));
        assert_eq!(t.remove("b"), Some(FieldValue::I32(1)));
        assert_eq!(t.len(), 2);
        assert!(!t.contains("b"));
    }

    #[test]
    fn get_returns_first_duplicate() {
        let mut t = FieldTable::new();
        t.push("k", 1u8);
        t.push("k", 2u8);
        assert_eq!(t.get("k"), Some(&FieldValue::U8(1)));
        assert_eq!(t.remove("k"), Some(FieldValue::U8(1)));
        assert!(t.is_empty());
    }

    #[test]
    fn accessors() {
        assert_eq!(
            FieldValue::U32(u32::MAX).as_i64(),
            Some(i64::from(u32::MAX))
        );
        assert_eq!(FieldValue::I8(-1).as_u64(), None);
        assert_eq!(FieldValue::I16(7).as_u64(), Some(7));
        assert_eq!(FieldValue::F32(0.5).as_f64(), Some(0.5));
        assert_eq!(FieldValue::from("hé").as_str(), Some("hé"));
        assert_eq!(
            FieldValue::LongString(Bytes::from_static(b"\xff")).as_str(),
            None
        );
        assert_eq!(
            FieldValue::ByteArray(Bytes::from_static(b"\xff")).as_bytes(),
            Some(&b"\xff"[..])
        );
        assert_eq!(FieldValue::Timestamp(3).as_i64(), None);
        assert!(FieldValue::Void.is_void());
    }

    #[test]
    fn equality_is_bitwise_for_floats() {
        assert_eq!(FieldValue::F64(f64::NAN), FieldValue::F64(f64::NAN));
        assert_ne!(FieldValue::F64(0.0), FieldValue::F64(-0.0));
        assert_ne!(FieldValue::I32(1), FieldValue::I64(1));
    }

    #[test]
    fn loose_equality_follows_type_classes() {
        assert!(FieldValue::I32(1).loosely_equals(&FieldValue::I64(1)));
        assert!(FieldValue::U8(200).loosely_equals(&FieldValue::I16(200)));
        assert!(FieldValue::F32(0.5).loosely_equals(&FieldValue::F64(0.5)));
        assert!(!FieldValue::I64(1).loosely_equals(&FieldValue::F64(1.0)));
        assert!(!FieldValue::I64(1).loosely_equals(&FieldValue::from("1")));
        assert!(FieldValue::ShortString(Bytes::from_static(b"a"))
            .loosely_equals(&FieldValue::from("a")));
        assert!(
            !FieldValue::from("a").loosely_equals(&FieldValue::ByteArray(Bytes::from_static(b"a")))
        );
    }

    #[test]
    fn depth_counts_containers() {
        let inner: FieldTable = [("x", FieldValue::Array(vec![FieldValue::I8(1)]))]
            .into_iter()
            .collect();
        let outer: FieldTable = [("t", FieldValue::Table(inner))].into_iter().collect();
        assert_eq!(outer.depth(), 3);
        assert_eq!(FieldTable::new().depth(), 1);
    }
}
