//! MQTT topic names and filters, and their mapping onto AMQP routing keys (RabbitMQ's
//! MQTT plugin convention, so a topic published over MQTT reaches AMQP and STOMP
//! subscribers of `amq.topic` and back).
//!
//! # The mapping
//!
//! | MQTT | routing key on `amq.topic` |
//! |---|---|
//! | level separator `/` | `.` |
//! | `.` inside a level | `/` |
//! | `+` (one level) | `*` |
//! | `#` (any number of levels) | `#` |
//!
//! So `sensors/room.1/temp` ⇄ `sensors.room/1.temp`. The map swaps `/` and `.`, which
//! makes it reversible for every topic name: [`routing_key_to_topic`] of
//! [`topic_to_routing_key`] is the identity. Empty levels are kept (`/a` ⇄ `.a`).
//!
//! One ambiguity remains, as in RabbitMQ: an MQTT level that is literally `*` becomes
//! the AMQP single-word wildcard in a binding. The adapter re-checks every delivery
//! against the client's MQTT filters with the MQTT rules ([`filter_matches`]), so such
//! a binding never delivers a message the MQTT filter does not match; likewise a filter
//! starting with a wildcard never receives `$`-topics [MQTT-4.7.2-1], although the
//! topic exchange would route them.

/// A shared subscription's filter, `$share/<group>/<filter>` (MQTT 5's syntax, which
/// Mosquitto 2, EMQX and HiveMQ accept from MQTT 3.1.1 clients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedFilter<'a> {
    /// The group: the members of one group take turns.
    pub group: &'a str,
    /// The filter matched against topics.
    pub filter: &'a str,
}

/// Where a shared subscription's syntax starts.
pub const SHARE_PREFIX: &str = "$share/";

/// Whether `f` is written as a shared subscription (`$share` or `$share/...`): such a
/// filter is either a valid [`SharedFilter`] or refused, never taken as a plain filter.
pub fn is_shared(f: &str) -> bool {
    f == "$share" || f.starts_with(SHARE_PREFIX)
}

/// Where a delayed publish's topic starts (EMQX's `$delayed/<seconds>/<topic>`).
pub const DELAYED_PREFIX: &str = "$delayed/";

/// The longest delay a `$delayed/` topic takes, in seconds (EMQX's: 4294967 s).
pub const MAX_DELAY_SECS: u64 = 4_294_967;

/// Parses a PUBLISH topic `$delayed/<seconds>/<topic>` (EMQX): `None` for a topic not
/// starting with `$delayed/`; `Some(Err(why))` when the seconds are not a number up to
/// [`MAX_DELAY_SECS`] or the topic after them is empty or holds a wildcard.
pub fn parse_delayed(topic: &str) -> Option<Result<(u64, &str), &'static str>> {
    let rest = topic.strip_prefix(DELAYED_PREFIX)?;
    let Some((secs, topic)) = rest.split_once('/') else {
        return Some(Err("$delayed topic without a topic after the delay"));
    };
    let Some(secs) = secs
        .parse::<u64>()
        .ok()
        .filter(|s| *s <= MAX_DELAY_SECS && !secs.starts_with('+'))
    else {
        return Some(Err(
            "$delayed topic's delay is not a number of seconds up to 4294967",
        ));
    };
    if topic.is_empty() || topic.contains(['+', '#']) {
        return Some(Err("$delayed topic's topic is empty or holds a wildcard"));
    }
    Some(Ok((secs, topic)))
}

/// Parses `$share/<group>/<filter>`: `None` for a filter not written as a shared
/// subscription; `Some(Err(()))` when the group is empty or holds `+` or `#`, or the
/// filter is missing or invalid.
pub fn parse_shared(f: &str) -> Option<Result<SharedFilter<'_>, ()>> {
    if !is_shared(f) {
        return None;
    }
    let rest = f.strip_prefix(SHARE_PREFIX).unwrap_or("");
    let Some((group, filter)) = rest.split_once('/') else {
        return Some(Err(()));
    };
    if group.is_empty() || group.contains(['+', '#']) || !valid_filter(filter) {
        return Some(Err(()));
    }
    Some(Ok(SharedFilter { group, filter }))
}

/// Whether `f` is a valid topic filter [MQTT-4.7.1-2], [MQTT-4.7.1-3].
pub fn valid_filter(f: &str) -> bool {
    if f.is_empty() || f.len() > u16::MAX as usize {
        return false;
    }
    let levels: Vec<&str> = f.split('/').collect();
    let n = levels.len();
    levels.iter().enumerate().all(|(i, l)| match *l {
        "#" => i + 1 == n,
        "+" => true,
        l => !l.contains(['+', '#']),
    })
}

/// Whether topic name `topic` matches filter `filter` (both assumed valid), with the
/// `$` rule: a filter starting with a wildcard does not match a topic starting
/// with `$`.
pub fn filter_matches(filter: &str, topic: &str) -> bool {
    if topic.starts_with('$') && filter.starts_with(['+', '#']) {
        return false;
    }
    let mut t = topic.split('/');
    for f in filter.split('/') {
        match f {
            "#" => return true,
            "+" => {
                if t.next().is_none() {
                    return false;
                }
            }
            lit => {
                if t.next() != Some(lit) {
                    return false;
                }
            }
        }
    }
    t.next().is_none()
}

/// Appends `level` to `out` with every `from` written as `to` (no allocation).
fn map_level(out: &mut String, level: &str, from: char, to: char) {
    out.extend(level.chars().map(|c| if c == from { to } else { c }));
}

/// MQTT topic name (or filter) → AMQP routing key (or binding key).
pub fn topic_to_routing_key(topic: &str) -> String {
    let mut out = String::with_capacity(topic.len());
    for (i, level) in topic.split('/').enumerate() {
        if i > 0 {
            out.push('.');
        }
        match level {
            "+" => out.push('*'),
            l => map_level(&mut out, l, '.', '/'),
        }
    }
    out
}

/// AMQP routing key → MQTT topic name.
pub fn routing_key_to_topic(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for (i, word) in key.split('.').enumerate() {
        if i > 0 {
            out.push('/');
        }
        map_level(&mut out, word, '/', '.');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delayed_topics() {
        assert_eq!(parse_delayed("a/b"), None);
        assert_eq!(parse_delayed("$delayed/15/a/b"), Some(Ok((15, "a/b"))));
        assert_eq!(parse_delayed("$delayed/0/x"), Some(Ok((0, "x"))));
        assert_eq!(
            parse_delayed("$delayed/4294967/x"),
            Some(Ok((4_294_967, "x")))
        );
        for bad in [
            "$delayed/",
            "$delayed/15",
            "$delayed/15/",
            "$delayed/x/a",
            "$delayed/-1/a",
            "$delayed/+1/a",
            "$delayed/4294968/a",
            "$delayed/1/a/+",
            "$delayed/1/#",
        ] {
            assert!(matches!(parse_delayed(bad), Some(Err(_))), "{bad}");
        }
    }
    use proptest::prelude::*;

    #[test]
    fn filters_are_validated() {
        for ok in [
            "a", "a/b", "+", "#", "a/+/c", "a/#", "+/+", "/", "/a", "$SYS/#",
        ] {
            assert!(valid_filter(ok), "{ok}");
        }
        for bad in ["", "a/#/b", "a+", "a/b#", "#/a", "++", "a/+b"] {
            assert!(!valid_filter(bad), "{bad}");
        }
    }

    #[test]
    fn shared_filters_are_parsed() {
        assert_eq!(parse_shared("a/b"), None);
        assert_eq!(parse_shared("$SYS/#"), None);
        assert_eq!(parse_shared("$sharex/a"), None);
        assert_eq!(
            parse_shared("$share/g1/a/+/#"),
            Some(Ok(SharedFilter {
                group: "g1",
                filter: "a/+/#"
            }))
        );
        assert_eq!(
            parse_shared("$share/g/$SYS/#").unwrap().unwrap().filter,
            "$SYS/#"
        );
        for bad in [
            "$share",
            "$share/",
            "$share//a",
            "$share/g",
            "$share/g/",
            "$share/g+/a",
            "$share/g#/a",
            "$share/+/a",
            "$share/g/a/#/b",
            "$share/g/a+",
        ] {
            assert_eq!(parse_shared(bad), Some(Err(())), "{bad}");
        }
    }

    #[test]
    fn matching_follows_the_spec() {
        let yes = [
            ("a/b/c", "a/b/c"),
            ("a/+/c", "a/b/c"),
            ("a/#", "a/b/c"),
            ("a/#", "a"), // [MQTT-4.7.1-2]: # includes the parent level
            ("#", "a/b"),
            ("+/+", "/a"),
            ("+", ""),
            ("$SYS/#", "$SYS/broker/uptime"),
            ("$SYS/+/uptime", "$SYS/broker/uptime"),
        ];
        for (f, t) in yes {
            assert!(filter_matches(f, t), "{f} ~ {t}");
        }
        let no = [
            ("a/b", "a/b/c"),
            ("a/+", "a/b/c"),
            ("a/+", "a"),
            ("+", "/a"),
            ("#", "$SYS/broker"),
            ("+/broker", "$SYS/broker"),
            ("a/b/c", "a/b"),
        ];
        for (f, t) in no {
            assert!(!filter_matches(f, t), "{f} !~ {t}");
        }
    }

    #[test]
    fn mapping_examples() {
        assert_eq!(topic_to_routing_key("a/b/c"), "a.b.c");
        assert_eq!(topic_to_routing_key("a/+/#"), "a.*.#");
        assert_eq!(topic_to_routing_key("room.1/t"), "room/1.t");
        assert_eq!(topic_to_routing_key("/a"), ".a");
        assert_eq!(routing_key_to_topic("room/1.t"), "room.1/t");
        assert_eq!(routing_key_to_topic("a.b.c"), "a/b/c");
    }

    proptest! {
        #[test]
        fn mapping_is_reversible(t in "[a-z./$ ]{0,24}") {
            prop_assert_eq!(routing_key_to_topic(&topic_to_routing_key(&t)), t);
        }
    }
}
