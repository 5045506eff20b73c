//! Authorisation, RabbitMQ's model: per user and vhost, three regular expressions on
//! resource names, `configure`, `write` and `read`.
//!
//! A connection that opened a vhost holds that user's [`VhostAccess`] for it (from
//! [`crate::Broker::vhost_access`]), and every adapter asks it before the core
//! operation, through the one-per-operation methods below, which encode RabbitMQ's
//! table (so AMQP, STOMP and MQTT are checked alike):
//!
//! | operation | configure | write | read |
//! |---|---|---|---|
//! | `queue.declare` (not passive) | queue | exchange (its DLX) | queue (with a DLX) |
//! | `queue.delete` | queue | | |
//! | `exchange.declare` (not passive) | exchange | exchange (its AE) | exchange (with an AE) |
//! | `exchange.delete` | exchange | | |
//! | `queue.bind` / `unbind` | | queue | exchange |
//! | `exchange.bind` / `unbind` | | destination | source |
//! | `basic.publish` | | exchange | |
//! | `basic.consume` / `get`, `queue.purge` | | | queue |
//!
//! Passive declares need no permission. The default exchange is named `amq.default`
//! for matching.
//!
//! Topic permissions (RabbitMQ's `topic_permissions`) narrow this further for topic
//! exchanges: with an entry for (user, vhost, exchange), a publish's routing key must
//! match its `write` pattern and a binding's key its `read` pattern (an MQTT
//! subscription's filter, as a routing key, included). Without an entry, any key. A pattern matches anywhere in the name unless anchored (`^...$`), as
//! RabbitMQ's `re:run`; an empty pattern matches nothing (RabbitMQ's special case).
//!
//! `{username}`, `{vhost}` and (MQTT) `{client_id}` in a topic pattern are replaced by
//! the connection's values, escaped, as RabbitMQ expands them (RabbitMQ inserts them
//! unescaped; a client id is chosen by the client, so here it is matched literally).
//!
//! Patterns are compiled once, at startup, into DFAs (`regex-automata`): matching is
//! linear in the name and never backtracks; a pattern whose automaton would exceed
//! [`Pattern::SIZE_LIMIT`] is refused at startup.

use std::fmt;
use std::sync::Arc;

use regex_automata::dfa::{dense, sparse, Automaton};
use regex_automata::Input;

use crate::error::{CoreError, ResourceKind};
use crate::reserved;
use crate::routing::ExchangeKind;
use crate::value::FieldTable;
use crate::vhost::Vhost;

/// The kind of access an operation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Create, delete or change a resource.
    Configure,
    /// Put messages into it (publish to an exchange, bind to a queue).
    Write,
    /// Take messages out (consume, get, purge a queue; bind from an exchange).
    Read,
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Access::Configure => "configure",
            Access::Write => "write",
            Access::Read => "read",
        })
    }
}

/// A permission pattern that does not compile.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid regular expression {pattern:?}: {reason}")]
pub struct PatternError {
    /// The pattern.
    pub pattern: String,
    /// The compiler's message.
    pub reason: String,
}

/// A compiled permission pattern. Cheap to clone.
#[derive(Clone)]
pub struct Pattern {
    source: Arc<str>,
    /// `None`: the empty pattern, which matches nothing; or a topic pattern still
    /// holding `{client_id}`, which matches nothing until
    /// [`Pattern::with_client_id`] fills it in.
    dfa: Option<Arc<Dfa>>,
    /// The source holds `{client_id}` (topic patterns only).
    per_client: bool,
}

/// A compiled pattern: dense (shared by every connection of a user) or sparse (one
/// connection's, with its client id).
enum Dfa {
    Dense(dense::DFA<Vec<u32>>),
    Sparse(sparse::DFA<Vec<u8>>),
}

/// The placeholder a topic pattern names the MQTT client id with.
pub const CLIENT_ID_VAR: &str = "{client_id}";

/// `value` as a regular expression matching exactly it: every character the regex
/// syntax gives a meaning to is escaped (a user name, vhost or client id put into a
/// pattern is matched literally, so a client id `.*` cannot widen it).
pub fn escape_regex(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 8);
    for c in value.chars() {
        if matches!(
            c,
            '\\' | '.'
                | '+'
                | '*'
                | '?'
                | '('
                | ')'
                | '|'
                | '['
                | ']'
                | '{'
                | '}'
                | '^'
                | '$'
                | '#'
                | '&'
                | '-'
                | '~'
        ) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl fmt::Debug for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pattern({:?})", self.source)
    }
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Pattern) -> bool {
        self.source == other.source
    }
}
impl Eq for Pattern {}

impl Pattern {
    /// Largest automaton (bytes) a pattern may compile to.
    pub const SIZE_LIMIT: usize = 4 << 20;

    /// Compiles `pattern`.
    pub fn new(pattern: &str) -> Result<Pattern, PatternError> {
        Pattern::build(pattern, false)
    }

    /// Compiles `pattern` into a dense DFA (fastest to match; several KB), or with
    /// `sparse` a sparse one (about a tenth of that: what a pattern compiled per
    /// connection uses).
    fn build(pattern: &str, sparse: bool) -> Result<Pattern, PatternError> {
        if pattern.is_empty() {
            return Ok(Pattern {
                source: Arc::from(""),
                dfa: None,
                per_client: false,
            });
        }
        let dfa = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .dfa_size_limit(Some(Self::SIZE_LIMIT))
                    .determinize_size_limit(Some(Self::SIZE_LIMIT)),
            )
            .build(pattern)
            .map_err(|e| PatternError {
                pattern: pattern.to_owned(),
                reason: e.to_string(),
            })?;
        let dfa = if sparse {
            Dfa::Sparse(dfa.to_sparse().map_err(|e| PatternError {
                pattern: pattern.to_owned(),
                reason: e.to_string(),
            })?)
        } else {
            Dfa::Dense(dfa)
        };
        Ok(Pattern {
            source: Arc::from(pattern),
            dfa: Some(Arc::new(dfa)),
            per_client: false,
        })
    }

    /// A topic pattern holding `{client_id}`: checked now (compiled with a sample
    /// client id), compiled per connection by [`Pattern::with_client_id`]; until then
    /// it matches nothing (AMQP and STOMP connections have no client id).
    fn per_client(pattern: &str) -> Result<Pattern, PatternError> {
        Pattern::new(&pattern.replace(CLIENT_ID_VAR, "client-1")).map_err(|e| PatternError {
            pattern: pattern.to_owned(),
            reason: e.reason,
        })?;
        Ok(Pattern {
            source: Arc::from(pattern),
            dfa: None,
            per_client: true,
        })
    }

    /// Whether the pattern waits for a client id.
    pub fn is_per_client(&self) -> bool {
        self.per_client
    }

    /// This pattern for one connection's client id (escaped); a pattern without
    /// `{client_id}` is returned as it is. One that does not compile with it (past
    /// [`Pattern::SIZE_LIMIT`]) matches nothing. Compiled to a sparse DFA: about 0.6 KB
    /// for `^devices\.{client_id}\.` and a 21-byte id, against 4.5 KB dense.
    pub fn with_client_id(&self, client_id: &str) -> Pattern {
        if !self.per_client {
            return self.clone();
        }
        let expanded = self.source.replace(CLIENT_ID_VAR, &escape_regex(client_id));
        Pattern::build(&expanded, true).unwrap_or_else(|e| {
            tracing::info!(pattern = %self.source, error = %e.reason, "topic pattern refused for this client id");
            Pattern {
                source: Arc::from(expanded.as_str()),
                dfa: None,
                per_client: false,
            }
        })
    }

    /// `.*`: everything.
    pub fn all() -> Pattern {
        // A constant pattern that always compiles; the fallback is never taken.
        Pattern::new(".*").unwrap_or(Pattern {
            source: Arc::from(".*"),
            dfa: None,
            per_client: false,
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.source
    }

    /// Whether the pattern matches somewhere in `name`.
    pub fn is_match(&self, name: &str) -> bool {
        let input = Input::new(name).earliest(true);
        // A search error (a pattern the DFA cannot finish on this input) denies.
        let found = match self.dfa.as_deref() {
            None => return false,
            Some(Dfa::Dense(d)) => d.try_search_fwd(&input),
            Some(Dfa::Sparse(d)) => d.try_search_fwd(&input),
        };
        matches!(found, Ok(Some(_)))
    }
}

/// One `[[permissions]]` entry: what `user` may do in `vhost`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permission {
    /// The user.
    pub user: String,
    /// The vhost.
    pub vhost: String,
    /// Resources it may create, delete and change.
    pub configure: Pattern,
    /// Resources it may write to.
    pub write: Pattern,
    /// Resources it may read from.
    pub read: Pattern,
}

impl Permission {
    /// `.*` `.*` `.*`.
    pub fn full(user: &str, vhost: &str) -> Permission {
        Permission {
            user: user.to_owned(),
            vhost: vhost.to_owned(),
            configure: Pattern::all(),
            write: Pattern::all(),
            read: Pattern::all(),
        }
    }
}

/// One `[[topic_permissions]]` entry: routing keys `user` may publish with (`write`)
/// and bind with (`read`) on the topic exchange `exchange` of `vhost`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicPermission {
    /// The user.
    pub user: String,
    /// The vhost.
    pub vhost: String,
    /// The topic exchange.
    pub exchange: String,
    /// Routing keys it may publish with.
    pub write: Pattern,
    /// Binding keys it may bind (subscribe) with.
    pub read: Pattern,
}

impl TopicPermission {
    /// Compiles a topic pattern: `{username}` and `{vhost}` are replaced first (as
    /// RabbitMQ does, but escaped: matched literally), and `""` means `^$` (RabbitMQ's
    /// reading for topic patterns). A pattern with `{client_id}` is checked now and
    /// compiled per MQTT connection ([`VhostAccess::for_client`]); for a connection
    /// without a client id (AMQP, STOMP) it matches nothing.
    pub fn pattern(p: &str, user: &str, vhost: &str) -> Result<Pattern, PatternError> {
        let expanded = p
            .replace("{username}", &escape_regex(user))
            .replace("{vhost}", &escape_regex(vhost));
        if expanded.is_empty() {
            Pattern::new("^$")
        } else if expanded.contains(CLIENT_ID_VAR) {
            Pattern::per_client(&expanded)
        } else {
            Pattern::new(&expanded)
        }
    }
}

/// A user's rights in one vhost: what a connection that opened it checks against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VhostAccess {
    perm: Permission,
    topics: Vec<TopicPermission>,
}

/// The name the default exchange is matched and reported under.
pub const DEFAULT_EXCHANGE: &str = "amq.default";

impl VhostAccess {
    /// The rights `perm` gives.
    pub fn new(perm: Permission) -> VhostAccess {
        VhostAccess {
            perm,
            topics: Vec::new(),
        }
    }

    /// With topic permissions (those for this user and vhost are kept).
    pub fn with_topics(mut self, topics: &[TopicPermission]) -> VhostAccess {
        self.topics = topics
            .iter()
            .filter(|t| t.user == self.perm.user && t.vhost == self.perm.vhost)
            .cloned()
            .collect();
        self
    }

    /// These rights for the MQTT client `client_id`: its topic patterns with
    /// `{client_id}` compiled for it. `None` when none has the variable (use these
    /// rights as they are: nothing is allocated per connection). Costs one automaton
    /// per such pattern per connection, built once at CONNECT.
    pub fn for_client(&self, client_id: &str) -> Option<VhostAccess> {
        if !self
            .topics
            .iter()
            .any(|t| t.write.is_per_client() || t.read.is_per_client())
        {
            return None;
        }
        let topics = self
            .topics
            .iter()
            .map(|t| TopicPermission {
                write: t.write.with_client_id(client_id),
                read: t.read.with_client_id(client_id),
                ..t.clone()
            })
            .collect();
        Some(VhostAccess {
            perm: self.perm.clone(),
            topics,
        })
    }

    /// Full rights (tests, internal users).
    pub fn full(user: &str, vhost: &str) -> VhostAccess {
        VhostAccess::new(Permission::full(user, vhost))
    }

    /// The user.
    pub fn user(&self) -> &str {
        &self.perm.user
    }

    /// The vhost.
    pub fn vhost(&self) -> &str {
        &self.perm.vhost
    }

    /// Whether `access` to the `kind` resource `name` is granted; refusals are
    /// [`CoreError::AccessRefused`] with RabbitMQ's text.
    pub fn check(&self, access: Access, kind: ResourceKind, name: &str) -> Result<(), CoreError> {
        if kind == ResourceKind::Queue {
            self.not_reserved(name)?;
        }
        let name = if kind == ResourceKind::Exchange && name.is_empty() {
            DEFAULT_EXCHANGE
        } else {
            name
        };
        let pattern = match access {
            Access::Configure => &self.perm.configure,
            Access::Write => &self.perm.write,
            Access::Read => &self.perm.read,
        };
        if pattern.is_match(name) {
            return Ok(());
        }
        tracing::debug!(
            user = %self.perm.user,
            vhost = %self.perm.vhost,
            %access,
            %kind,
            name,
            "access refused"
        );
        Err(CoreError::AccessRefused(format!(
            "{access} access to {kind} '{name}' in vhost '{}' refused for user '{}'",
            self.perm.vhost, self.perm.user
        )))
    }

    /// Refuses a queue name the broker keeps for itself ([`crate::reserved`]), whatever
    /// the user's permissions.
    fn not_reserved(&self, queue: &str) -> Result<(), CoreError> {
        if !reserved::is_reserved_queue(queue) {
            return Ok(());
        }
        tracing::debug!(user = %self.perm.user, vhost = %self.perm.vhost, queue, "reserved queue name refused");
        Err(CoreError::AccessRefused(format!(
            "queue name '{queue}' in vhost '{}' is reserved for the broker",
            self.perm.vhost
        )))
    }

    /// A passive `queue.declare`: no permission is needed, but a reserved name is not
    /// there for clients.
    pub fn queue_declare_passive(&self, name: &str) -> Result<(), CoreError> {
        self.not_reserved(name)
    }

    /// `queue.declare` (not passive) of `name` with `arguments`.
    pub fn queue_declare(&self, name: &str, arguments: &FieldTable) -> Result<(), CoreError> {
        self.check(Access::Configure, ResourceKind::Queue, name)?;
        if let Some(dlx) = arguments
            .get("x-dead-letter-exchange")
            .and_then(|v| v.as_str())
        {
            self.check(Access::Write, ResourceKind::Exchange, dlx)?;
            self.check(Access::Read, ResourceKind::Queue, name)?;
        }
        Ok(())
    }

    /// `queue.delete`.
    pub fn queue_delete(&self, name: &str) -> Result<(), CoreError> {
        self.check(Access::Configure, ResourceKind::Queue, name)
    }

    /// `exchange.declare` (not passive) of `name` with `arguments`.
    pub fn exchange_declare(&self, name: &str, arguments: &FieldTable) -> Result<(), CoreError> {
        self.check(Access::Configure, ResourceKind::Exchange, name)?;
        if let Some(ae) = arguments.get("alternate-exchange").and_then(|v| v.as_str()) {
            self.check(Access::Write, ResourceKind::Exchange, ae)?;
            self.check(Access::Read, ResourceKind::Exchange, name)?;
        }
        Ok(())
    }

    /// `exchange.delete`.
    pub fn exchange_delete(&self, name: &str) -> Result<(), CoreError> {
        self.check(Access::Configure, ResourceKind::Exchange, name)
    }

    /// `queue.bind` and `queue.unbind`.
    pub fn queue_bind(&self, queue: &str, exchange: &str) -> Result<(), CoreError> {
        self.check(Access::Write, ResourceKind::Queue, queue)?;
        self.check(Access::Read, ResourceKind::Exchange, exchange)
    }

    /// `exchange.bind` and `exchange.unbind`.
    pub fn exchange_bind(&self, destination: &str, source: &str) -> Result<(), CoreError> {
        self.check(Access::Write, ResourceKind::Exchange, destination)?;
        self.check(Access::Read, ResourceKind::Exchange, source)
    }

    /// `basic.publish` (STOMP SEND, MQTT PUBLISH).
    pub fn publish(&self, exchange: &str) -> Result<(), CoreError> {
        self.check(Access::Write, ResourceKind::Exchange, exchange)
    }

    /// `basic.publish` with its routing key: [`VhostAccess::publish`] plus, on a topic
    /// exchange with a topic permission, its `write` pattern on the key.
    /// Through the default exchange, the key names a queue: a reserved one is refused;
    /// so is a reserved topic ([`crate::reserved`]).
    pub fn publish_to(&self, vhost: &Vhost, exchange: &str, key: &str) -> Result<(), CoreError> {
        self.publish(exchange)?;
        if exchange.is_empty() {
            self.not_reserved(key)?;
        }
        if reserved::is_reserved_topic(exchange, key) {
            tracing::debug!(user = %self.perm.user, vhost = %self.perm.vhost, exchange, key, "reserved topic refused");
            return Err(CoreError::AccessRefused(format!(
                "write access to topic '{key}' in exchange '{exchange}' in vhost '{}' refused: reserved for the broker",
                self.perm.vhost
            )));
        }
        self.topic(vhost, exchange, key, Access::Write)
    }

    /// `queue.bind` / `unbind` with its key: [`VhostAccess::queue_bind`] plus, on a
    /// topic exchange with a topic permission, its `read` pattern on the key.
    pub fn queue_bind_key(
        &self,
        vhost: &Vhost,
        queue: &str,
        exchange: &str,
        key: &str,
    ) -> Result<(), CoreError> {
        self.queue_bind(queue, exchange)?;
        self.topic(vhost, exchange, key, Access::Read)
    }

    /// `exchange.bind` / `unbind` with its key: [`VhostAccess::exchange_bind`] plus, when
    /// the source is a topic exchange with a topic permission, its `read` pattern on the
    /// key (RabbitMQ's `binding_action` checks it for exchange and queue bindings alike).
    pub fn exchange_bind_key(
        &self,
        vhost: &Vhost,
        destination: &str,
        source: &str,
        key: &str,
    ) -> Result<(), CoreError> {
        self.exchange_bind(destination, source)?;
        self.topic(vhost, source, key, Access::Read)
    }

    fn topic(
        &self,
        vhost: &Vhost,
        exchange: &str,
        key: &str,
        access: Access,
    ) -> Result<(), CoreError> {
        let Some(t) = self.topics.iter().find(|t| t.exchange == exchange) else {
            return Ok(());
        };
        if vhost.exchange_kind(exchange) != Some(ExchangeKind::Topic) {
            return Ok(());
        }
        let pattern = if access == Access::Write {
            &t.write
        } else {
            &t.read
        };
        if pattern.is_match(key) {
            return Ok(());
        }
        tracing::debug!(user = %self.perm.user, vhost = %self.perm.vhost, %access, exchange, key, "topic access refused");
        Err(CoreError::AccessRefused(format!(
            "{access} access to topic '{key}' in exchange '{exchange}' in vhost '{}' refused for user '{}'",
            self.perm.vhost, self.perm.user
        )))
    }

    /// `basic.consume`, `basic.get` and `queue.purge`.
    pub fn consume(&self, queue: &str) -> Result<(), CoreError> {
        self.check(Access::Read, ResourceKind::Queue, queue)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::value::FieldValue;

    fn access(c: &str, w: &str, r: &str) -> VhostAccess {
        VhostAccess::new(Permission {
            user: "alice".into(),
            vhost: "/".into(),
            configure: Pattern::new(c).unwrap(),
            write: Pattern::new(w).unwrap(),
            read: Pattern::new(r).unwrap(),
        })
    }

    #[test]
    fn patterns_search_unanchored_like_re_run() {
        let p = Pattern::new("^alice-.*").unwrap();
        assert!(p.is_match("alice-q"));
        assert!(p.is_match("alice-"));
        assert!(!p.is_match("bob-alice-q"));
        let p = Pattern::new("alice").unwrap();
        assert!(p.is_match("bob-alice-q"), "unanchored: matches anywhere");
        let p = Pattern::new("^$").unwrap();
        assert!(p.is_match(""));
        assert!(!p.is_match("x"));
        let p = Pattern::new("").unwrap();
        assert!(!p.is_match(""), "empty pattern denies everything");
        assert!(!p.is_match("x"));
        assert!(Pattern::all().is_match(""));
        assert!(Pattern::all().is_match("amq.default"));
        let p = Pattern::new("^(q1|q2)$").unwrap();
        assert!(p.is_match("q2") && !p.is_match("q3") && !p.is_match("q12"));
        let p = Pattern::new("^amq\\.gen-").unwrap();
        assert!(p.is_match("amq.gen-abc") && !p.is_match("amqXgen-abc"));
        assert!(Pattern::new("é.*").unwrap().is_match("xéy"));
    }

    #[test]
    fn bad_patterns_are_refused() {
        let e = Pattern::new("(unclosed").unwrap_err();
        assert_eq!(e.pattern, "(unclosed");
        assert!(Pattern::new("[z-a]").is_err());
    }

    #[test]
    fn rabbitmq_table() {
        let a = access(
            "^alice-",
            "^(alice-|amq\\.default$|x$)",
            "^(alice-|amq\\.topic$)",
        );
        assert!(a.queue_declare("alice-q", &FieldTable::new()).is_ok());
        let e = a.queue_declare("bob-q", &FieldTable::new()).unwrap_err();
        assert_eq!(
            e,
            CoreError::AccessRefused(
                "configure access to queue 'bob-q' in vhost '/' refused for user 'alice'".into()
            )
        );
        // with a dead-letter exchange: write on it too
        let mut args = FieldTable::new();
        args.insert(
            "x-dead-letter-exchange",
            FieldValue::LongString("dlx".into()),
        );
        assert!(a.queue_declare("alice-q", &args).is_err());
        args.insert("x-dead-letter-exchange", FieldValue::LongString("x".into()));
        assert!(a.queue_declare("alice-q", &args).is_ok());
        // publish: write on the exchange, the default one as amq.default
        assert!(a.publish("").is_ok());
        assert!(a.publish("amq.topic").is_err());
        // bind: write on the queue, read on the exchange
        assert!(a.queue_bind("alice-q", "amq.topic").is_ok());
        assert!(a.queue_bind("bob-q", "amq.topic").is_err());
        assert!(a.queue_bind("alice-q", "amq.fanout").is_err());
        assert!(a.exchange_bind("x", "amq.topic").is_ok());
        assert!(a.exchange_bind("amq.topic", "x").is_err());
        // consume / get / purge: read on the queue
        assert!(a.consume("alice-q").is_ok());
        assert!(a.consume("bob-q").is_err());
        assert!(a.queue_delete("alice-q").is_ok());
        assert!(a.exchange_delete("x").is_err());
        let e = a.publish("").err();
        assert!(e.is_none());
        let e = access("", "", "").publish("").unwrap_err();
        assert!(e.to_string().contains("exchange 'amq.default'"), "{e}");
    }

    #[test]
    fn topic_permissions_narrow_topic_exchanges_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut sc = triad_store::store::StoreConfig::new(dir.path());
        sc.segment_size = 1 << 20;
        let store = std::sync::Arc::new(triad_store::store::Store::open(sc).unwrap());
        let broker = crate::Broker::open(store, crate::CoreConfig::default()).unwrap();
        let vh = broker.vhost("/").unwrap();
        let topic = |ex: &str, w: &str, r: &str| TopicPermission {
            user: "alice".into(),
            vhost: "/".into(),
            exchange: ex.into(),
            write: TopicPermission::pattern(w, "alice", "/").unwrap(),
            read: TopicPermission::pattern(r, "alice", "/").unwrap(),
        };
        let a = access(".*", ".*", ".*").with_topics(&[
            topic("amq.topic", "^{username}\\.", "^(public|{username})\\."),
            // amq.direct is not a topic exchange: its entry is never consulted
            topic("amq.direct", "^$", "^$"),
            // another user's entry is not kept
            TopicPermission {
                user: "bob".into(),
                ..topic("amq.fanout", "", "")
            },
        ]);
        assert!(a.publish_to(&vh, "amq.topic", "alice.x").is_ok());
        let e = a.publish_to(&vh, "amq.topic", "bob.x").unwrap_err();
        assert_eq!(
            e.to_string(),
            "access refused: write access to topic 'bob.x' in exchange 'amq.topic' in vhost '/' refused for user 'alice'"
        );
        assert!(a.queue_bind_key(&vh, "q", "amq.topic", "public.#").is_ok());
        assert!(a.queue_bind_key(&vh, "q", "amq.topic", "alice.*").is_ok());
        assert!(a.queue_bind_key(&vh, "q", "amq.topic", "#").is_err());
        assert!(a.publish_to(&vh, "amq.direct", "anything").is_ok());
        assert!(a.publish_to(&vh, "", "q").is_ok());
        // names the broker keeps for itself, whatever the permissions
        let r = "amq.triad.mqtt.retained";
        assert!(a.publish_to(&vh, "", r).is_err());
        assert!(a.queue_declare_passive(r).is_err());
        assert!(a.queue_declare(r, &FieldTable::new()).is_err());
        assert!(a.queue_bind_key(&vh, r, "amq.topic", "#").is_err());
        assert!(a.consume(r).is_err());
        assert!(a.queue_delete(r).is_err());
        assert!(a
            .publish_to(&vh, "amq.topic", "$SYS.broker.uptime")
            .is_err());
        assert!(a.queue_declare_passive("q").is_ok());
        // "" is ^$ for topic patterns: only the empty key
        let b = access(".*", ".*", ".*").with_topics(&[topic("amq.topic", "", "")]);
        assert!(b.publish_to(&vh, "amq.topic", "").is_ok());
        assert!(b.publish_to(&vh, "amq.topic", "a").is_err());
    }

    #[test]
    fn client_id_username_and_vhost_variables() {
        let dir = tempfile::tempdir().unwrap();
        let mut sc = triad_store::store::StoreConfig::new(dir.path());
        sc.segment_size = 1 << 20;
        let store = std::sync::Arc::new(triad_store::store::Store::open(sc).unwrap());
        let broker = crate::Broker::open(store, crate::CoreConfig::default()).unwrap();
        let vh = broker.vhost("/").unwrap();
        let user = "a.b";
        let topic = TopicPermission {
            user: user.into(),
            vhost: "/".into(),
            exchange: "amq.topic".into(),
            write: TopicPermission::pattern("^dev\\.{client_id}\\.", user, "/").unwrap(),
            read: TopicPermission::pattern("^(u\\.{username}|v\\.{vhost})\\.", user, "/").unwrap(),
        };
        let a = VhostAccess::new(Permission::full(user, "/")).with_topics(&[topic]);
        // without a client id (AMQP, STOMP): a `{client_id}` pattern matches nothing
        assert!(a.publish_to(&vh, "amq.topic", "dev.c1.x").is_err());
        assert!(a.publish_to(&vh, "amq.topic", "dev.{client_id}.x").is_err());
        // values are matched literally: `a.b` does not match `aXb`
        assert!(a.queue_bind_key(&vh, "q", "amq.topic", "u.a.b.#").is_ok());
        assert!(a.queue_bind_key(&vh, "q", "amq.topic", "u.aXb.#").is_err());
        assert!(a.queue_bind_key(&vh, "q", "amq.topic", "v./.#").is_ok());
        let c = a.for_client("c1").unwrap();
        assert!(c.publish_to(&vh, "amq.topic", "dev.c1.x").is_ok());
        assert!(c.publish_to(&vh, "amq.topic", "dev.c2.x").is_err());
        // a client id cannot widen the pattern
        let evil = a.for_client(".*").unwrap();
        assert!(evil.publish_to(&vh, "amq.topic", "dev.c1.x").is_err());
        assert!(evil.publish_to(&vh, "amq.topic", "dev..*.x").is_ok());
        // rights without the variable are shared, not copied per connection
        let plain = access(".*", ".*", ".*");
        assert!(plain.for_client("c1").is_none());
        // a bad pattern with the variable is refused up front
        assert!(TopicPermission::pattern("^{client_id}(", "u", "/").is_err());
    }
}
