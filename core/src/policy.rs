//! Policies, as RabbitMQ's (`rabbit_policy`): a named rule in a vhost with a `pattern`
//! (an unanchored regex over queue names), `apply-to`, a `priority` and a `definition`
//! of queue settings. Of the policies whose pattern matches a queue, the one with the
//! highest priority applies (ties: the first by name); only one applies.
//!
//! **Definition keys** Triad implements: `message-ttl`, `expires`, `max-length`,
//! `max-length-bytes`, `overflow`, `dead-letter-exchange`, `dead-letter-routing-key`.
//! Any other key is refused naming it, never stored and ignored. `max-priority` is
//! refused as RabbitMQ does: a queue's priority levels are fixed when it is declared
//! ("priority declaration using policies is not supported by design").
//!
//! **Precedence** (RabbitMQ's `rabbit_amqqueue_process:process_args_policy`): when a
//! queue argument and the policy both set a value, the smaller one wins for
//! `expires`, `message-ttl`, `max-length` and `max-length-bytes`; the queue argument
//! wins for `overflow`, `dead-letter-exchange` and `dead-letter-routing-key`.
//!
//! **`apply-to`**: `all`, `queues` and `classic_queues` match classic queues (every Triad
//! queue but a stream); `exchanges` matches exchanges, for which Triad has no policy
//! key, so such a policy changes nothing (as a queue key on an exchange in RabbitMQ).
//! No policy applies to a stream queue (`x-queue-type=stream`): it is not a classic
//! queue, and none of the keys above means anything to a stream, so a stream never
//! shows an effective policy. `quorum_queues` and `streams` are refused: Triad has no
//! quorum queues, and a stream's retention is set by its arguments.
//!
//! **Cost**: a vhost's policies are a short list sorted by priority; a queue declare
//! walks that list (not the vhost's queues). Setting or deleting a policy walks the
//! vhost's queues once. A queue holds one `Arc` of its effective settings.
//!
//! **Persistence**: one metadata-journal record per policy, key `p` + vhost + name,
//! value the JSON of [`PolicyDoc`]; written before the change takes effect.

use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use triad_store::journal::{key_parts, KeyBuilder, MetaJournal, MetaOp};

use crate::access::Pattern;
use crate::error::CoreError;
use crate::queue::{Overflow, QueueArgs};
use crate::value::FieldTable;

/// Journal key tag of a policy.
const TAG_POLICY: u8 = b'p';

fn policy_key(vhost: &str, name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_POLICY)
        .part(vhost.as_bytes())
        .part(name.as_bytes())
        .build()
}

/// The journal prefix of every policy in `vhost`.
pub(crate) fn vhost_prefix(vhost: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_POLICY).part(vhost.as_bytes()).build()
}

fn bad(msg: String) -> CoreError {
    CoreError::PreconditionFailed(msg)
}

/// What a policy applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyTo {
    /// Queues and exchanges.
    All,
    /// Queues.
    Queues,
    /// Classic queues (every Triad queue but a stream).
    ClassicQueues,
    /// Exchanges.
    Exchanges,
}

impl ApplyTo {
    /// RabbitMQ's name.
    pub fn as_str(self) -> &'static str {
        match self {
            ApplyTo::All => "all",
            ApplyTo::Queues => "queues",
            ApplyTo::ClassicQueues => "classic_queues",
            ApplyTo::Exchanges => "exchanges",
        }
    }

    fn parse(s: &str) -> Result<ApplyTo, CoreError> {
        Ok(match s {
            "all" => ApplyTo::All,
            "queues" => ApplyTo::Queues,
            "classic_queues" => ApplyTo::ClassicQueues,
            "exchanges" => ApplyTo::Exchanges,
            "streams" => {
                return Err(bad(
                    "apply-to 'streams' is not supported: a stream's retention is set by its x-max-age and x-max-length-bytes arguments".to_string(),
                ))
            }
            "quorum_queues" => {
                return Err(bad(format!(
                    "apply-to '{s}' is not supported: Triad has no {}",
                    s.replace('_', " ")
                )))
            }
            other => {
                return Err(bad(format!(
                "'{other}' is not a valid apply-to value (all, queues, classic_queues, exchanges)"
            )))
            }
        })
    }

    fn queues(self) -> bool {
        self != ApplyTo::Exchanges
    }
}

/// A policy's definition: the queue settings it sets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyDef {
    /// `message-ttl`, ms.
    pub message_ttl: Option<u64>,
    /// `expires`, ms (at least 1).
    pub expires: Option<u64>,
    /// `max-length`.
    pub max_length: Option<u64>,
    /// `max-length-bytes`.
    pub max_length_bytes: Option<u64>,
    /// `overflow`.
    pub overflow: Option<Overflow>,
    /// `dead-letter-exchange`.
    pub dead_letter_exchange: Option<String>,
    /// `dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `delivery-limit`.
    pub delivery_limit: Option<u64>,
}

fn overflow_name(o: Overflow) -> &'static str {
    match o {
        Overflow::DropHead => "drop-head",
        Overflow::RejectPublish => "reject-publish",
        Overflow::RejectPublishDlx => "reject-publish-dlx",
    }
}

impl PolicyDef {
    /// Validates a definition (RabbitMQ's `rabbit_policies` checks). An unknown key, a
    /// key Triad does not implement, or an empty definition is an error naming it.
    pub fn parse(def: &Map<String, Value>) -> Result<PolicyDef, CoreError> {
        if def.is_empty() {
            return Err(bad("no policy provided: the definition is empty".into()));
        }
        let mut d = PolicyDef::default();
        let uint = |k: &str, v: &Value, min: u64| -> Result<u64, CoreError> {
            v.as_u64().filter(|n| *n >= min).ok_or_else(|| {
                bad(format!(
                    "{v} is not a valid {k} (an integer of at least {min})"
                ))
            })
        };
        let text = |k: &str, v: &Value| -> Result<String, CoreError> {
            v.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad(format!("{v} is not a valid {k} (a string)")))
        };
        for (k, v) in def {
            match k.as_str() {
                "message-ttl" => d.message_ttl = Some(uint(k, v, 0)?),
                "expires" => d.expires = Some(uint(k, v, 1)?),
                "max-length" => d.max_length = Some(uint(k, v, 0)?),
                "max-length-bytes" => d.max_length_bytes = Some(uint(k, v, 0)?),
                "overflow" => {
                    d.overflow = Some(match v.as_str() {
                        Some("drop-head") => Overflow::DropHead,
                        Some("reject-publish") => Overflow::RejectPublish,
                        Some("reject-publish-dlx") => Overflow::RejectPublishDlx,
                        _ => {
                            return Err(bad(format!(
                                "{v} is not a valid overflow value (drop-head, reject-publish, reject-publish-dlx)"
                            )))
                        }
                    })
                }
                "dead-letter-exchange" => d.dead_letter_exchange = Some(text(k, v)?),
                "dead-letter-routing-key" => d.dead_letter_routing_key = Some(text(k, v)?),
                "delivery-limit" => d.delivery_limit = Some(uint(k, v, 0)?),
                "max-priority" => {
                    return Err(bad(
                        "max-priority cannot be set by a policy (as in RabbitMQ, a queue's priorities are fixed when it is declared): declare the queue with x-max-priority".into(),
                    ))
                }
                other => {
                    return Err(bad(format!(
                        "policy definition key '{other}' is not supported by Triad (supported: message-ttl, expires, max-length, max-length-bytes, overflow, dead-letter-exchange, dead-letter-routing-key, delivery-limit)"
                    )))
                }
            }
        }
        Ok(d)
    }

    /// The definition as RabbitMQ shows it.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.to_owned(), v);
            }
        };
        put("message-ttl", self.message_ttl.map(Value::from));
        put("expires", self.expires.map(Value::from));
        put("max-length", self.max_length.map(Value::from));
        put("max-length-bytes", self.max_length_bytes.map(Value::from));
        put("overflow", self.overflow.map(|o| overflow_name(o).into()));
        put(
            "dead-letter-exchange",
            self.dead_letter_exchange.clone().map(Value::from),
        );
        put(
            "dead-letter-routing-key",
            self.dead_letter_routing_key.clone().map(Value::from),
        );
        put("delivery-limit", self.delivery_limit.map(Value::from));
        Value::Object(m)
    }

    /// The settings of a queue declared with `declared` (parsed from `arguments`)
    /// under this policy, by RabbitMQ's precedence (see the module docs).
    pub fn effective(&self, declared: &QueueArgs, arguments: &FieldTable) -> QueueArgs {
        let min = |a: Option<u64>, p: Option<u64>| match (a, p) {
            (Some(a), Some(p)) => Some(a.min(p)),
            (a, p) => a.or(p),
        };
        QueueArgs {
            message_ttl: min(declared.message_ttl, self.message_ttl),
            expires: min(declared.expires, self.expires),
            max_length: min(declared.max_length, self.max_length),
            max_length_bytes: min(declared.max_length_bytes, self.max_length_bytes),
            overflow: if arguments.get("x-overflow").is_some() {
                declared.overflow
            } else {
                self.overflow.unwrap_or(declared.overflow)
            },
            dead_letter_exchange: declared
                .dead_letter_exchange
                .clone()
                .or_else(|| self.dead_letter_exchange.clone()),
            dead_letter_routing_key: declared
                .dead_letter_routing_key
                .clone()
                .or_else(|| self.dead_letter_routing_key.clone()),
            max_priority: declared.max_priority,
            single_active_consumer: declared.single_active_consumer,
            // RabbitMQ: the lower of the argument and the policy
            delivery_limit: min(declared.delivery_limit, self.delivery_limit),
            retry_backoff: declared.retry_backoff.clone(),
        }
    }
}

/// A policy's journal record.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct PolicyDoc {
    /// The regex.
    pub pattern: String,
    /// `apply-to`.
    #[serde(rename = "apply-to")]
    pub apply_to: String,
    /// Priority.
    pub priority: i64,
    /// The definition as given (validated).
    pub definition: Map<String, Value>,
}

/// A policy, validated.
#[derive(Debug)]
pub struct Policy {
    /// Name.
    pub name: String,
    /// Vhost.
    pub vhost: String,
    /// The regex over names.
    pub pattern: Pattern,
    /// What it applies to.
    pub apply_to: ApplyTo,
    /// Higher wins.
    pub priority: i64,
    /// The settings.
    pub definition: PolicyDef,
}

impl Policy {
    /// Validates a policy.
    pub fn new(vhost: &str, name: &str, doc: &PolicyDoc) -> Result<Policy, CoreError> {
        if name.is_empty() || name.len() > 255 {
            return Err(bad("a policy name must be 1 to 255 bytes long".into()));
        }
        let pattern = Pattern::new(&doc.pattern)
            .map_err(|e| bad(format!("invalid pattern '{}': {}", e.pattern, e.reason)))?;
        Ok(Policy {
            name: name.to_owned(),
            vhost: vhost.to_owned(),
            pattern,
            apply_to: ApplyTo::parse(&doc.apply_to)?,
            priority: doc.priority,
            definition: PolicyDef::parse(&doc.definition)?,
        })
    }

    /// Whether it applies to queue `name`.
    pub fn matches_queue(&self, name: &str) -> bool {
        self.apply_to.queues() && self.pattern.is_match(name)
    }

    /// As RabbitMQ lists it.
    pub fn to_json(&self) -> Value {
        serde_json::json!({
            "vhost": self.vhost,
            "name": self.name,
            "pattern": self.pattern.as_str(),
            "apply-to": self.apply_to.as_str(),
            "definition": self.definition.to_json(),
            "priority": self.priority,
        })
    }

    fn doc(&self) -> PolicyDoc {
        PolicyDoc {
            pattern: self.pattern.as_str().to_owned(),
            apply_to: self.apply_to.as_str().to_owned(),
            priority: self.priority,
            definition: match self.definition.to_json() {
                Value::Object(m) => m,
                _ => Map::new(),
            },
        }
    }
}

/// A vhost's policies, highest priority first (then by name).
#[derive(Debug, Default)]
pub struct Policies {
    list: RwLock<Vec<Arc<Policy>>>,
    /// Serialises changes (held while a change walks the queues; taken before the
    /// vhost's queue map lock, never after it).
    changing: Mutex<()>,
}

fn order(list: &mut [Arc<Policy>]) {
    list.sort_by(|a, b| b.priority.cmp(&a.priority).then(a.name.cmp(&b.name)));
}

impl Policies {
    /// Loads `vhost`'s policies from the journal.
    pub(crate) fn load(journal: &MetaJournal, vhost: &str) -> Result<Policies, CoreError> {
        let mut list = Vec::new();
        for (k, v) in journal.scan(&vhost_prefix(vhost))? {
            let parts = k.get(1..).and_then(key_parts);
            let Some([_, name]) = parts.as_deref() else {
                return Err(CoreError::Internal(
                    "malformed policy key in the metadata journal".into(),
                ));
            };
            let name = String::from_utf8_lossy(name).into_owned();
            let doc: PolicyDoc = serde_json::from_slice(&v).map_err(|_| {
                CoreError::Internal("malformed policy record in the metadata journal".into())
            })?;
            list.push(Arc::new(Policy::new(vhost, &name, &doc)?));
        }
        order(&mut list);
        Ok(Policies {
            list: RwLock::new(list),
            changing: Mutex::new(()),
        })
    }

    /// Every policy, highest priority first.
    pub fn list(&self) -> Vec<Arc<Policy>> {
        self.list.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The policy that applies to queue `name`, if any (a stream takes none: see
    /// [`crate::queue::Queue::policy`]).
    pub fn for_queue(&self, name: &str) -> Option<Arc<Policy>> {
        self.list
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|p| p.matches_queue(name))
            .cloned()
    }

    /// Takes the change lock.
    pub(crate) fn begin_change(&self) -> std::sync::MutexGuard<'_, ()> {
        self.changing.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds or replaces `p` once its record is on disk; `true` when it is new.
    pub(crate) fn put(&self, journal: &MetaJournal, p: Policy) -> Result<bool, CoreError> {
        journal.commit(vec![MetaOp::put(
            policy_key(&p.vhost, &p.name),
            serde_json::to_vec(&p.doc()).unwrap_or_default(),
        )])?;
        let mut list = self.list.write().unwrap_or_else(|e| e.into_inner());
        let before = list.len();
        list.retain(|x| x.name != p.name);
        let created = list.len() == before;
        list.push(Arc::new(p));
        order(&mut list);
        Ok(created)
    }

    /// Deletes policy `name` once that is on disk; `false` when there was none.
    pub(crate) fn delete(
        &self,
        journal: &MetaJournal,
        vhost: &str,
        name: &str,
    ) -> Result<bool, CoreError> {
        if !self
            .list
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .any(|p| p.name == name)
        {
            return Ok(false);
        }
        journal.commit(vec![MetaOp::delete(policy_key(vhost, name))])?;
        self.list
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| p.name != name);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::FieldValue;
    use serde_json::json;

    fn doc(pattern: &str, priority: i64, def: Value) -> PolicyDoc {
        PolicyDoc {
            pattern: pattern.into(),
            apply_to: "queues".into(),
            priority,
            definition: def.as_object().cloned().unwrap_or_default(),
        }
    }

    #[test]
    fn refuses_unknown_and_unsupported_keys_by_name() {
        let e = Policy::new("/", "p", &doc(".*", 0, json!({"ha-mode": "all"}))).unwrap_err();
        assert!(e.to_string().contains("'ha-mode'"), "{e}");
        let e = Policy::new("/", "p", &doc(".*", 0, json!({"max-priority": 5}))).unwrap_err();
        assert!(e.to_string().contains("max-priority"), "{e}");
        let e = Policy::new("/", "p", &doc(".*", 0, json!({}))).unwrap_err();
        assert!(e.to_string().contains("no policy provided"), "{e}");
        let e = Policy::new("/", "p", &doc(".*", 0, json!({"expires": 0}))).unwrap_err();
        assert!(e.to_string().contains("expires"), "{e}");
        let e = Policy::new("/", "p", &doc(".*", 0, json!({"max-length": -1}))).unwrap_err();
        assert!(e.to_string().contains("max-length"), "{e}");
        let e = Policy::new("/", "p", &doc(".*", 0, json!({"overflow": "x"}))).unwrap_err();
        assert!(e.to_string().contains("overflow"), "{e}");
        let mut d = doc(".*", 0, json!({"max-length": 1}));
        d.apply_to = "quorum_queues".into();
        assert!(Policy::new("/", "p", &d).is_err());
        let e = Policy::new("/", "p", &doc("(", 0, json!({"max-length": 1}))).unwrap_err();
        assert!(e.to_string().contains("invalid pattern"), "{e}");
    }

    #[test]
    fn round_trips_its_definition() {
        let def = json!({"message-ttl": 5, "expires": 7, "max-length": 1, "max-length-bytes": 2,
            "overflow": "reject-publish-dlx", "dead-letter-exchange": "dlx",
            "dead-letter-routing-key": "k"});
        let p = Policy::new("/", "p", &doc("^a", 3, def.clone())).unwrap();
        assert_eq!(p.definition.to_json(), def);
        let again = Policy::new("/", "p", &p.doc()).unwrap();
        assert_eq!(again.definition, p.definition);
        assert_eq!(p.to_json()["apply-to"], "queues");
    }

    #[test]
    fn arguments_win_as_in_rabbitmq() {
        let p = PolicyDef::parse(
            json!({"message-ttl": 100, "max-length": 10, "expires": 1000, "overflow": "reject-publish",
                "dead-letter-exchange": "pol", "dead-letter-routing-key": "polk"})
            .as_object()
            .unwrap(),
        )
        .unwrap();
        let mut t = FieldTable::new();
        t.insert("x-message-ttl", FieldValue::I32(50));
        t.insert("x-max-length", FieldValue::I32(20));
        t.insert("x-overflow", FieldValue::LongString("drop-head".into()));
        t.insert(
            "x-dead-letter-exchange",
            FieldValue::LongString("arg".into()),
        );
        let declared = QueueArgs::parse(&t).unwrap();
        let e = p.effective(&declared, &t);
        assert_eq!(e.message_ttl, Some(50)); // smaller wins
        assert_eq!(e.max_length, Some(10)); // smaller wins
        assert_eq!(e.expires, Some(1000)); // only the policy sets it
        assert_eq!(e.overflow, Overflow::DropHead); // the argument wins
        assert_eq!(e.dead_letter_exchange.as_deref(), Some("arg"));
        assert_eq!(e.dead_letter_routing_key.as_deref(), Some("polk"));
        let none = FieldTable::new();
        let e = p.effective(&QueueArgs::default(), &none);
        assert_eq!(e.overflow, Overflow::RejectPublish);
    }

    #[test]
    fn the_highest_priority_match_applies() {
        let ps = Policies::default();
        let mut list = vec![
            Arc::new(Policy::new("/", "low", &doc(".*", 0, json!({"max-length": 1}))).unwrap()),
            Arc::new(Policy::new("/", "high", &doc("^a", 5, json!({"max-length": 2}))).unwrap()),
            Arc::new(Policy::new("/", "b", &doc("^a", 5, json!({"max-length": 3}))).unwrap()),
        ];
        order(&mut list);
        *ps.list.write().unwrap() = list;
        assert_eq!(ps.for_queue("abc").unwrap().name, "b");
        assert_eq!(ps.for_queue("xyz").unwrap().name, "low");
        let mut ex = doc(".*", 9, json!({"max-length": 1}));
        ex.apply_to = "exchanges".into();
        let ex = Policy::new("/", "ex", &ex).unwrap();
        assert!(!ex.matches_queue("abc"));
    }
}
