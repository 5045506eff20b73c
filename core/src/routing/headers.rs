//! The headers exchange's matching rule, as RabbitMQ implements it.
//!
//! A binding's arguments are the pattern; the message's `headers` property is the
//! data; the routing key is ignored. The `x-match` argument picks the mode:
//!
//! - `all` (the default): every pattern entry must match;
//! - `any`: at least one pattern entry must match (so an empty pattern never matches);
//! - `all-with-x` / `any-with-x`: the same, but pattern entries whose names start with
//!   `x-` take part too. In `all` and `any` they are ignored. `x-match` itself is
//!   always ignored.
//!
//! An entry matches when the message has a header of that name and either the pattern
//! value is void (a presence check: any value matches) or both values are of the same
//! type class and equal ([`FieldValue::loosely_equals`]: integers of any width compare
//! with each other, `I64(1)` never equals `F64(1.0)` or `"1"`).

use crate::error::CoreError;
use crate::value::{FieldTable, FieldValue};

/// The binding argument selecting the match mode.
pub const X_MATCH: &str = "x-match";

/// A headers binding's match mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XMatch {
    /// Every non-`x-` entry must match.
    All,
    /// At least one non-`x-` entry must match.
    Any,
    /// Every entry except `x-match` must match.
    AllWithX,
    /// At least one entry except `x-match` must match.
    AnyWithX,
}

impl XMatch {
    fn from_value(v: &FieldValue) -> Option<XMatch> {
        match v.as_bytes()? {
            b"all" => Some(XMatch::All),
            b"any" => Some(XMatch::Any),
            b"all-with-x" => Some(XMatch::AllWithX),
            b"any-with-x" => Some(XMatch::AnyWithX),
            _ => None,
        }
    }

    /// The mode a binding's arguments ask for; missing or unrecognised means `all`
    /// (bindings are validated when created, see [`validate_binding_args`]).
    pub fn of(args: &FieldTable) -> XMatch {
        args.get(X_MATCH)
            .and_then(XMatch::from_value)
            .unwrap_or(XMatch::All)
    }

    fn with_x(self) -> bool {
        matches!(self, XMatch::AllWithX | XMatch::AnyWithX)
    }
}

/// Checks a headers binding's arguments as RabbitMQ does at bind time: `x-match`, if
/// present, must be a string naming one of the four modes.
pub fn validate_binding_args(args: &FieldTable) -> Result<(), CoreError> {
    let Some(v) = args.get(X_MATCH) else {
        return Ok(());
    };
    match v {
        FieldValue::LongString(_) | FieldValue::ShortString(_) => match XMatch::from_value(v) {
            Some(_) => Ok(()),
            None => Err(CoreError::PreconditionFailed(format!(
                "invalid x-match field value {v:?}; expected all, any, all-with-x, or any-with-x"
            ))),
        },
        other => Err(CoreError::PreconditionFailed(format!(
            "invalid x-match field type {other:?}; expected a string"
        ))),
    }
}

/// Whether a message with `headers` matches a binding with arguments `args`.
pub fn headers_match(args: &FieldTable, headers: Option<&FieldTable>) -> bool {
    let mode = XMatch::of(args);
    let want_all = matches!(mode, XMatch::All | XMatch::AllWithX);
    let mut any = false;
    for (name, pattern) in args.iter() {
        if name == X_MATCH || (!mode.with_x() && name.starts_with("x-")) {
            continue;
        }
        let matched = match headers.and_then(|h| h.get(name)) {
            None => false,
            Some(_) if pattern.is_void() => true,
            Some(value) => pattern.loosely_equals(value),
        };
        if matched {
            any = true;
            if !want_all {
                return true;
            }
        } else if want_all {
            return false;
        }
    }
    // all: every entry matched (vacuously true); any: none matched.
    want_all || any
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(entries: &[(&str, FieldValue)]) -> FieldTable {
        entries.iter().cloned().collect()
    }

    #[test]
    fn all_and_any() {
        let all = t(&[
            ("x-match", "all".into()),
            ("a", 1i32.into()),
            ("b", "x".into()),
        ]);
        let any = t(&[
            ("x-match", "any".into()),
            ("a", 1i32.into()),
            ("b", "x".into()),
        ]);
        let both = t(&[("b", "x".into()), ("a", 1i64.into()), ("c", true.into())]);
        let one = t(&[("a", 1u8.into())]);
        let wrong = t(&[("a", 2i32.into()), ("b", "y".into())]);
        assert!(headers_match(&all, Some(&both)));
        assert!(!headers_match(&all, Some(&one)));
        assert!(headers_match(&any, Some(&one)));
        assert!(!headers_match(&any, Some(&wrong)));
        assert!(!headers_match(&any, None));
        assert!(!headers_match(&all, None));
    }

    #[test]
    fn default_is_all_and_empty_patterns() {
        assert!(headers_match(&FieldTable::new(), None));
        assert!(headers_match(&t(&[("x-match", "all".into())]), None));
        assert!(!headers_match(&t(&[("x-match", "any".into())]), None));
        assert!(!headers_match(
            &t(&[("a", 1i32.into())]),
            Some(&t(&[("a", 2i32.into())]))
        ));
    }

    #[test]
    fn x_entries_ignored_unless_with_x() {
        let data = t(&[("x-a", "1".into())]);
        let all = t(&[("x-a", "2".into())]);
        assert!(
            headers_match(&all, Some(&data)),
            "x- entry ignored, all of nothing"
        );
        let any = t(&[("x-match", "any".into()), ("x-a", "1".into())]);
        assert!(
            !headers_match(&any, Some(&data)),
            "x- entry ignored, any of nothing"
        );
        let any_x = t(&[("x-match", "any-with-x".into()), ("x-a", "1".into())]);
        assert!(headers_match(&any_x, Some(&data)));
        let all_x = t(&[("x-match", "all-with-x".into()), ("x-a", "2".into())]);
        assert!(!headers_match(&all_x, Some(&data)));
    }

    #[test]
    fn void_is_presence_and_types_must_share_a_class() {
        let presence = t(&[("a", FieldValue::Void)]);
        assert!(headers_match(
            &presence,
            Some(&t(&[("a", "anything".into())]))
        ));
        assert!(!headers_match(&presence, Some(&t(&[("b", 1i32.into())]))));
        let one = t(&[("a", 1i32.into())]);
        assert!(!headers_match(&one, Some(&t(&[("a", 1.0f64.into())]))));
        assert!(!headers_match(&one, Some(&t(&[("a", "1".into())]))));
        assert!(headers_match(&one, Some(&t(&[("a", 1u16.into())]))));
    }

    #[test]
    fn validation() {
        assert!(validate_binding_args(&FieldTable::new()).is_ok());
        for mode in ["all", "any", "all-with-x", "any-with-x"] {
            assert!(validate_binding_args(&t(&[("x-match", mode.into())])).is_ok());
        }
        assert!(matches!(
            validate_binding_args(&t(&[("x-match", "some".into())])),
            Err(CoreError::PreconditionFailed(_))
        ));
        assert!(matches!(
            validate_binding_args(&t(&[("x-match", 1i32.into())])),
            Err(CoreError::PreconditionFailed(_))
        ));
    }
}
