//! Per-user limits (`max-connections`, `max-channels`, RabbitMQ's user limits) as they
//! change at run time (the management API's `/api/user-limits`) and survive a restart:
//! each change is one record in the metadata journal.
//!
//! Journal keys (see `triad_store::journal`):
//!
//! | key | value |
//! |---|---|
//! | `L` + user | JSON `{"max-connections": n, "max-channels": n}` (only the limits set; -1 = unlimited) |
//! | `l` + user | the configuration's `[[users]]` limits seeded last time, same JSON |
//!
//! Seeding follows [`crate::auth`]: a user's limits in the configuration file are
//! written at start when they are new or changed since they were last seeded; otherwise
//! what the API set since wins. Memory: one small map entry per user with a limit.

use std::collections::HashMap;

use serde_json::{Map, Value};
use triad_store::journal::{key_parts, KeyBuilder, MetaOp};
use triad_store::store::Store;

use crate::broker::UserLimits;
use crate::error::CoreError;

const TAG_LIMITS: u8 = b'L';
const TAG_SEED: u8 = b'l';

/// The limit names, as RabbitMQ spells them.
pub const MAX_CONNECTIONS: &str = "max-connections";
/// See [`MAX_CONNECTIONS`].
pub const MAX_CHANNELS: &str = "max-channels";

fn key(tag: u8, user: &str) -> Vec<u8> {
    KeyBuilder::new(tag).part(user.as_bytes()).build()
}

fn wire(v: Option<u32>) -> Option<i64> {
    v.map(|n| {
        if n == UserLimits::UNLIMITED {
            -1
        } else {
            i64::from(n)
        }
    })
}

/// A limit's value from RabbitMQ's integer: negative = unlimited; at most `u32::MAX - 1`.
pub fn from_wire(n: i64) -> Result<u32, CoreError> {
    if n < 0 {
        return Ok(UserLimits::UNLIMITED);
    }
    u32::try_from(n)
        .ok()
        .filter(|n| *n != UserLimits::UNLIMITED)
        .ok_or_else(|| CoreError::PreconditionFailed(format!("limit {n} is too large")))
}

/// The limits that are set, as RabbitMQ's JSON object (`{"max-connections": 10}`).
pub fn to_json(l: &UserLimits) -> Map<String, Value> {
    let mut m = Map::new();
    if let Some(n) = wire(l.max_connections) {
        m.insert(MAX_CONNECTIONS.into(), n.into());
    }
    if let Some(n) = wire(l.max_channels) {
        m.insert(MAX_CHANNELS.into(), n.into());
    }
    m
}

fn from_json(v: &[u8]) -> Result<UserLimits, CoreError> {
    let bad = || CoreError::InvalidEncoding("stored user limits");
    let m: Map<String, Value> = serde_json::from_slice(v).map_err(|_| bad())?;
    let get = |name: &str| -> Result<Option<u32>, CoreError> {
        match m.get(name) {
            None => Ok(None),
            Some(v) => Ok(Some(from_wire(v.as_i64().ok_or_else(bad)?)?)),
        }
    };
    Ok(UserLimits {
        max_connections: get(MAX_CONNECTIONS)?,
        max_channels: get(MAX_CHANNELS)?,
    })
}

fn bytes(l: &UserLimits) -> Vec<u8> {
    serde_json::to_vec(&Value::Object(to_json(l))).unwrap_or_default()
}

/// Seeds `configured` into the journal (what changed since it was last seeded) and
/// returns every user's limits in force.
pub(crate) fn load(
    store: &Store,
    configured: &HashMap<String, UserLimits>,
) -> Result<HashMap<String, UserLimits>, CoreError> {
    let j = store.journal();
    let mut ops = Vec::new();
    for (user, l) in configured {
        let v = bytes(l);
        let seed = key(TAG_SEED, user);
        if j.get(&seed)?.as_deref() != Some(v.as_slice()) {
            ops.push(MetaOp::put(key(TAG_LIMITS, user), v.clone()));
            ops.push(MetaOp::put(seed, v));
        }
    }
    j.commit(ops)?;
    let mut out = HashMap::new();
    for (k, v) in j.scan(&[TAG_LIMITS])? {
        let parts = k.get(1..).and_then(key_parts);
        let Some([user]) = parts.as_deref() else {
            return Err(CoreError::InvalidEncoding("stored user limits key"));
        };
        let l = from_json(&v)?;
        if l != UserLimits::default() {
            out.insert(String::from_utf8_lossy(user).into_owned(), l);
        }
    }
    Ok(out)
}

/// Journals `user`'s limits (none set: the record is removed) and waits for the disk.
pub(crate) fn store(store: &Store, user: &str, l: &UserLimits) -> Result<(), CoreError> {
    let op = if *l == UserLimits::default() {
        MetaOp::delete(key(TAG_LIMITS, user))
    } else {
        MetaOp::put(key(TAG_LIMITS, user), bytes(l))
    };
    store.journal().commit(vec![op])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_values_as_rabbitmq() {
        assert_eq!(from_wire(-1).unwrap(), UserLimits::UNLIMITED);
        assert_eq!(from_wire(0).unwrap(), 0);
        assert_eq!(from_wire(10).unwrap(), 10);
        assert!(from_wire(i64::from(u32::MAX)).is_err());
        let l = UserLimits {
            max_connections: Some(UserLimits::UNLIMITED),
            max_channels: Some(5),
        };
        let j = to_json(&l);
        assert_eq!(j.get(MAX_CONNECTIONS), Some(&Value::from(-1)));
        assert_eq!(j.get(MAX_CHANNELS), Some(&Value::from(5)));
        assert_eq!(from_json(&bytes(&l)).unwrap(), l);
    }
}
