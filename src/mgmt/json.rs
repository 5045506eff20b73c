//! JSON forms of the core's values, in RabbitMQ's management API shapes: argument and
//! header tables, message properties, and the request-field readers that accept what
//! RabbitMQ accepts (`rabbitmqadmin` sends booleans and numbers as strings).

use base64::Engine;
use serde_json::{Map, Number, Value};
use triad_core::{FieldTable, FieldValue, Properties};

/// A field value as JSON (RabbitMQ shows strings and byte arrays as strings).
pub fn value_json(v: &FieldValue) -> Value {
    match v {
        FieldValue::Bool(b) => Value::Bool(*b),
        FieldValue::I8(x) => (*x).into(),
        FieldValue::U8(x) => (*x).into(),
        FieldValue::I16(x) => (*x).into(),
        FieldValue::U16(x) => (*x).into(),
        FieldValue::I32(x) => (*x).into(),
        FieldValue::U32(x) => (*x).into(),
        FieldValue::I64(x) => (*x).into(),
        FieldValue::F32(x) => Number::from_f64(f64::from(*x)).map_or(Value::Null, Value::Number),
        FieldValue::F64(x) => Number::from_f64(*x).map_or(Value::Null, Value::Number),
        FieldValue::Decimal(d) => {
            let v = f64::from(d.value) / 10f64.powi(i32::from(d.scale));
            Number::from_f64(v).map_or(Value::Null, Value::Number)
        }
        FieldValue::ShortString(b) | FieldValue::LongString(b) | FieldValue::ByteArray(b) => {
            Value::String(String::from_utf8_lossy(b).into_owned())
        }
        FieldValue::Timestamp(t) => (*t).into(),
        FieldValue::Table(t) => table_json(t),
        FieldValue::Array(a) => Value::Array(a.iter().map(value_json).collect()),
        FieldValue::Void => Value::Null,
    }
}

/// A table as a JSON object.
pub fn table_json(t: &FieldTable) -> Value {
    let mut m = Map::new();
    for (k, v) in t.iter() {
        m.insert(k.to_owned(), value_json(v));
    }
    Value::Object(m)
}

/// A JSON value as a field value: integers as `long` (I64), other numbers as `double`,
/// strings as long strings, `null` as void.
pub fn json_value(v: &Value) -> Result<FieldValue, String> {
    Ok(match v {
        Value::Null => FieldValue::Void,
        Value::Bool(b) => FieldValue::Bool(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => FieldValue::I64(i),
            (None, Some(f)) if n.is_f64() => FieldValue::F64(f),
            _ => return Err(format!("number {n} is out of range")),
        },
        Value::String(s) => FieldValue::LongString(bytes::Bytes::copy_from_slice(s.as_bytes())),
        Value::Array(a) => FieldValue::Array(a.iter().map(json_value).collect::<Result<_, _>>()?),
        Value::Object(_) => FieldValue::Table(json_table(v)?),
    })
}

/// A JSON object (or `null` / absent: empty) as a field table, no deeper than the
/// core's bound.
pub fn json_table(v: &Value) -> Result<FieldTable, String> {
    let mut t = FieldTable::new();
    match v {
        Value::Null => {}
        Value::Object(m) => {
            for (k, v) in m {
                t.push(k.clone(), json_value(v)?);
            }
        }
        _ => return Err("arguments must be a JSON object".into()),
    }
    if t.depth() > triad_core::value::MAX_DEPTH {
        return Err(format!(
            "nested deeper than {} levels",
            triad_core::value::MAX_DEPTH
        ));
    }
    Ok(t)
}

/// Message properties as RabbitMQ's API shows them (only those set).
pub fn properties_json(p: &Properties) -> Value {
    let mut m = Map::new();
    let mut s = |k: &str, v: &Option<String>| {
        if let Some(v) = v {
            m.insert(k.into(), Value::String(v.clone()));
        }
    };
    s("content_type", &p.content_type);
    s("content_encoding", &p.content_encoding);
    s("correlation_id", &p.correlation_id);
    s("reply_to", &p.reply_to);
    s("expiration", &p.expiration);
    s("message_id", &p.message_id);
    s("type", &p.message_type);
    s("user_id", &p.user_id);
    s("app_id", &p.app_id);
    s("cluster_id", &p.cluster_id);
    if let Some(h) = &p.headers {
        m.insert("headers".into(), table_json(h));
    }
    if let Some(d) = p.delivery_mode {
        m.insert("delivery_mode".into(), d.into());
    }
    if let Some(x) = p.priority {
        m.insert("priority".into(), x.into());
    }
    if let Some(t) = p.timestamp {
        m.insert("timestamp".into(), t.into());
    }
    Value::Object(m)
}

/// Message properties from a publish request; an unknown property is an error, as in
/// RabbitMQ.
pub fn json_properties(v: &Value) -> Result<Properties, String> {
    let mut p = Properties::default();
    let Some(m) = v.as_object() else {
        return match v {
            Value::Null => Ok(p),
            _ => Err("properties must be a JSON object".into()),
        };
    };
    for (k, v) in m {
        let string = || -> Result<Option<String>, String> {
            match v {
                Value::String(s) => Ok(Some(s.clone())),
                Value::Number(n) => Ok(Some(n.to_string())),
                _ => Err(format!("property {k} must be a string")),
            }
        };
        let small = |max: u64| -> Result<Option<u8>, String> {
            let n = uint(v).ok_or_else(|| format!("property {k} must be a number"))?;
            u8::try_from(n)
                .ok()
                .filter(|x| u64::from(*x) <= max)
                .map(Some)
                .ok_or_else(|| format!("property {k} out of range"))
        };
        match k.as_str() {
            "content_type" => p.content_type = string()?,
            "content_encoding" => p.content_encoding = string()?,
            "correlation_id" => p.correlation_id = string()?,
            "reply_to" => p.reply_to = string()?,
            "expiration" => p.expiration = string()?,
            "message_id" => p.message_id = string()?,
            "type" => p.message_type = string()?,
            "user_id" => p.user_id = string()?,
            "app_id" => p.app_id = string()?,
            "cluster_id" => p.cluster_id = string()?,
            "headers" => p.headers = Some(json_table(v)?),
            "delivery_mode" => p.delivery_mode = small(2)?,
            "priority" => p.priority = small(255)?,
            "timestamp" => {
                p.timestamp = Some(uint(v).ok_or("property timestamp must be a number")?)
            }
            other => return Err(format!("unknown message property '{other}'")),
        }
    }
    Ok(p)
}

/// An unsigned integer given as a number or a decimal string.
pub fn uint(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// A boolean given as `true`/`false` or the strings `"true"`/`"false"`.
pub fn boolean(v: Option<&Value>, default: bool) -> Result<bool, String> {
    match v {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(other) => Err(format!("{other} is not a boolean")),
    }
}

/// A string field; `None` when absent.
pub fn string<'a>(body: &'a Value, key: &str) -> Result<Option<&'a str>, String> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(format!("{key} must be a string")),
    }
}

/// Tags as a list or RabbitMQ's older comma-separated string.
pub fn tags(v: Option<&Value>) -> Result<Vec<String>, String> {
    let list: Vec<String> = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => s.split(',').map(|t| t.trim().to_owned()).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(|s| s.trim().to_owned()))
            .collect::<Option<_>>()
            .ok_or("tags must be strings")?,
        Some(_) => return Err("tags must be a list or a comma-separated string".into()),
    };
    Ok(list.into_iter().filter(|t| !t.is_empty()).collect())
}

/// A message body as the API shows it: text when it is UTF-8 (`encoding = auto`),
/// else base64.
pub fn payload(body: &[u8], force_base64: bool) -> (String, &'static str) {
    match (force_base64, std::str::from_utf8(body)) {
        (false, Ok(s)) => (s.to_owned(), "string"),
        _ => (
            base64::engine::general_purpose::STANDARD.encode(body),
            "base64",
        ),
    }
}

/// Keeps only the listed columns of a listed object (`columns=a,b.c`), as RabbitMQ does.
pub fn pick(v: Value, columns: &[Vec<String>]) -> Value {
    let Value::Object(mut m) = v else {
        return v;
    };
    let mut out = Map::new();
    for path in columns {
        let Some((first, rest)) = path.split_first() else {
            continue;
        };
        if rest.is_empty() {
            if let Some(x) = m.remove(first) {
                out.insert(first.clone(), x);
            }
            continue;
        }
        let Some(inner) = m.get(first) else {
            continue;
        };
        let picked = pick(inner.clone(), &[rest.to_vec()]);
        match (out.get_mut(first), picked) {
            (Some(Value::Object(have)), Value::Object(add)) => have.extend(add),
            (_, picked) => {
                out.insert(first.clone(), picked);
            }
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_round_trip_through_json() {
        let v = json!({"x-max-length": 10, "x-overflow": "reject-publish", "f": 1.5,
                       "b": true, "n": null, "a": [1, "x"], "t": {"k": "v"}});
        let t = json_table(&v).expect("table");
        assert_eq!(t.get("x-max-length"), Some(&FieldValue::I64(10)));
        assert_eq!(table_json(&t), v);
        assert!(json_table(&json!([1])).is_err());
        assert!(json_table(&json!({"x": 18446744073709551615u64})).is_err());
        let mut deep = json!(1);
        for _ in 0..20 {
            deep = json!({ "d": deep });
        }
        assert!(json_table(&deep).is_err());
    }

    #[test]
    fn properties_round_trip_and_unknown_ones_are_refused() {
        let v = json!({"delivery_mode": 2, "headers": {"h": 1}, "content_type": "text/plain",
                       "priority": "5", "type": "t"});
        let p = json_properties(&v).expect("properties");
        assert_eq!(p.delivery_mode, Some(2));
        assert_eq!(p.priority, Some(5));
        assert_eq!(p.message_type.as_deref(), Some("t"));
        let back = properties_json(&p);
        assert_eq!(back["headers"], json!({"h": 1}));
        assert!(json_properties(&json!({"delivery_mode": 3})).is_err());
        assert!(json_properties(&json!({"colour": "red"})).is_err());
    }

    #[test]
    fn reads_what_rabbitmqadmin_sends() {
        assert_eq!(boolean(Some(&json!("true")), false), Ok(true));
        assert_eq!(boolean(None, true), Ok(true));
        assert!(boolean(Some(&json!(1)), true).is_err());
        assert_eq!(uint(&json!("3")), Some(3));
        assert_eq!(
            tags(Some(&json!("administrator, monitoring"))).expect("tags"),
            ["administrator", "monitoring"]
        );
        assert!(tags(Some(&json!(""))).expect("tags").is_empty());
        assert_eq!(payload(b"hi", false), ("hi".into(), "string"));
        assert_eq!(payload(&[0xff], false).1, "base64");
    }

    #[test]
    fn picks_columns() {
        let v = json!({"name": "q", "messages": 3, "message_stats": {"publish": 1, "ack": 2}});
        let cols = vec![
            vec!["name".to_string()],
            vec!["message_stats".to_string(), "ack".to_string()],
        ];
        assert_eq!(
            pick(v, &cols),
            json!({"name": "q", "message_stats": {"ack": 2}})
        );
    }
}
