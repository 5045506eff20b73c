//! Human units for configuration values: byte sizes (`"1 GiB"`, `"64 KiB"`, `16777216`)
//! and durations (`"200ms"`, `"5s"`, `"1m"`).
//!
//! Both parse from strings with [`str::parse`] and deserialize from a TOML string; a
//! [`ByteSize`] also accepts a plain non-negative integer (bytes). A duration needs a
//! unit: a bare `5` could mean seconds or milliseconds, so it is refused.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::de::{self, Deserialize, Deserializer, Visitor};

/// Why a size or duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    #[error("invalid {what} {input:?}: expected a number followed by a unit ({units})")]
    Malformed {
        what: &'static str,
        input: String,
        units: &'static str,
    },
    #[error("invalid {what} {input:?}: unknown unit {unit:?} (expected one of {units})")]
    UnknownUnit {
        what: &'static str,
        input: String,
        unit: String,
        units: &'static str,
    },
    #[error("invalid {what} {input:?}: too large")]
    Overflow { what: &'static str, input: String },
}

const SIZE_UNITS: &str = "B, KiB, MiB, GiB, TiB, KB, MB, GB, TB";
const DURATION_UNITS: &str = "us, ms, s, m, h";

/// A number of bytes, written as `"1 GiB"`, `"64 KiB"`, `"16MiB"`, `"1 MB"` (decimal
/// units are powers of 1000, binary ones powers of 1024) or a plain integer of bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn kib(n: u64) -> ByteSize {
        ByteSize(n << 10)
    }
    pub const fn mib(n: u64) -> ByteSize {
        ByteSize(n << 20)
    }
    pub const fn gib(n: u64) -> ByteSize {
        ByteSize(n << 30)
    }
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

impl fmt::Display for ByteSize {
    /// The largest binary unit that divides the value exactly: `1 GiB`, `1536 KiB`, `7 B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(&str, u32); 4] = [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)];
        for (name, shift) in UNITS {
            if self.0 != 0 && self.0.trailing_zeros() >= shift {
                return write!(f, "{} {name}", self.0 >> shift);
            }
        }
        write!(f, "{} B", self.0)
    }
}

impl FromStr for ByteSize {
    type Err = UnitError;

    fn from_str(input: &str) -> Result<ByteSize, UnitError> {
        let what = "size";
        let (number, unit) = split_number(input).ok_or_else(|| UnitError::Malformed {
            what,
            input: input.to_owned(),
            units: SIZE_UNITS,
        })?;
        let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1_000,
            "m" | "mb" => 1_000_000,
            "g" | "gb" => 1_000_000_000,
            "t" | "tb" => 1_000_000_000_000,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "tib" => 1 << 40,
            _ => {
                return Err(UnitError::UnknownUnit {
                    what,
                    input: input.to_owned(),
                    unit: unit.to_owned(),
                    units: SIZE_UNITS,
                })
            }
        };
        number
            .checked_mul(multiplier)
            .map(ByteSize)
            .ok_or_else(|| UnitError::Overflow {
                what,
                input: input.to_owned(),
            })
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<ByteSize, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(
                    f,
                    "a size such as \"64 KiB\" or \"1 GiB\", or an integer of bytes"
                )
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size {v}: must not be negative")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// A duration written with a unit: `"500us"`, `"200ms"`, `"5s"`, `"1m"`, `"1h"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn millis(n: u64) -> HumanDuration {
        HumanDuration(Duration::from_millis(n))
    }
    pub const fn secs(n: u64) -> HumanDuration {
        HumanDuration(Duration::from_secs(n))
    }
    pub const fn get(self) -> Duration {
        self.0
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.subsec_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else {
            write!(f, "{}us", d.as_micros())
        }
    }
}

impl FromStr for HumanDuration {
    type Err = UnitError;

    fn from_str(input: &str) -> Result<HumanDuration, UnitError> {
        let what = "duration";
        let malformed = || UnitError::Malformed {
            what,
            input: input.to_owned(),
            units: DURATION_UNITS,
        };
        let (number, unit) = split_number(input).ok_or_else(malformed)?;
        let (per_unit, scale): (fn(u64) -> Duration, u64) = match unit.to_ascii_lowercase().as_str()
        {
            "" => return Err(malformed()),
            "us" | "µs" => (Duration::from_micros, 1),
            "ms" => (Duration::from_millis, 1),
            "s" | "sec" | "secs" => (Duration::from_secs, 1),
            "m" | "min" | "mins" => (Duration::from_secs, 60),
            "h" | "hour" | "hours" => (Duration::from_secs, 3600),
            _ => {
                return Err(UnitError::UnknownUnit {
                    what,
                    input: input.to_owned(),
                    unit: unit.to_owned(),
                    units: DURATION_UNITS,
                })
            }
        };
        number
            .checked_mul(scale)
            .map(|n| HumanDuration(per_unit(n)))
            .ok_or_else(|| UnitError::Overflow {
                what,
                input: input.to_owned(),
            })
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<HumanDuration, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a duration with a unit, such as \"200ms\" or \"5s\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

/// Splits `" 64 KiB "` into `(64, "KiB")`; `None` if there are no leading digits or the
/// number does not fit in a `u64`.
fn split_number(input: &str) -> Option<(u64, &str)> {
    let s = input.trim();
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return None;
    }
    let (number, rest) = s.split_at(digits);
    Some((number.parse().ok()?, rest.trim_start()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let ok = [
            ("0", 0),
            ("4096", 4096),
            ("1 GiB", 1 << 30),
            ("64 KiB", 64 << 10),
            ("16MiB", 16 << 20),
            ("  2 kib ", 2048),
            ("1 MB", 1_000_000),
            ("10 B", 10),
        ];
        for (s, n) in ok {
            assert_eq!(s.parse::<ByteSize>(), Ok(ByteSize(n)), "{s}");
        }
        for s in ["", "GiB", "1 GiBs", "1.5 GiB", "-1", "99999999999999 TiB"] {
            assert!(s.parse::<ByteSize>().is_err(), "{s}");
        }
        let e = "1 GIGS".parse::<ByteSize>().unwrap_err().to_string();
        assert!(e.contains("unknown unit \"GIGS\""), "{e}");
    }

    #[test]
    fn durations() {
        let ok = [
            ("200ms", Duration::from_millis(200)),
            ("5s", Duration::from_secs(5)),
            ("5 s", Duration::from_secs(5)),
            ("2m", Duration::from_secs(120)),
            ("1h", Duration::from_secs(3600)),
            ("0s", Duration::ZERO),
            ("250us", Duration::from_micros(250)),
        ];
        for (s, d) in ok {
            assert_eq!(s.parse::<HumanDuration>(), Ok(HumanDuration(d)), "{s}");
        }
        for s in ["", "5", "s", "5 fortnights", "1.5s"] {
            assert!(s.parse::<HumanDuration>().is_err(), "{s}");
        }
    }

    #[test]
    fn display_round_trips() {
        for n in [0, 7, 1024, 1536 << 10, 1 << 30, 3 << 40] {
            let s = ByteSize(n).to_string();
            assert_eq!(s.parse::<ByteSize>(), Ok(ByteSize(n)), "{s}");
        }
        for d in [
            Duration::ZERO,
            Duration::from_millis(200),
            Duration::from_secs(60),
            Duration::from_micros(3),
        ] {
            let s = HumanDuration(d).to_string();
            assert_eq!(s.parse::<HumanDuration>(), Ok(HumanDuration(d)), "{s}");
        }
    }
}
