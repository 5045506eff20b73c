//! Half-message (transactional) publishing with check-back, RocketMQ's model
//! (`TransactionalMessageServiceImpl`, its half topic `RMQ_SYS_TRANS_HALF_TOPIC` and op
//! topic `RMQ_SYS_TRANS_OP_HALF_TOPIC`), built on the store's own queues and acks.
//!
//! - A publish whose headers carry `x-txn: half` is a *half message*: it is appended to
//!   the vhost's half queue, a store queue named [`HALF_QUEUE`] that no exchange routes
//!   to and no client can consume, with the exchange and routing key it was published
//!   with in its envelope. It is durable (the publisher's confirm or receipt waits for
//!   the `fsync`) and invisible. Its `message-id` identifies it (required).
//! - A publish to exchange [`TXN_EXCHANGE`] with `x-txn: commit` or `x-txn: rollback`
//!   and the half message's id (the `message-id` property, or else the routing key: STOMP's
//!   `SEND /txn/<id>`) resolves it. Commit routes the stored message through its
//!   original exchange and routing key, as a publish by the committer (who needs write
//!   permission there; so does a rollback). Rollback discards it. Either way the half
//!   queue's entry is acked, and the confirm waits for that ack's record on disk.
//! - Unresolved after `check_timeout`, the broker publishes a check message (empty body,
//!   `x-txn: check`, the half message's `message-id` and `correlation-id`, its exchange
//!   and routing key in `x-txn-exchange` / `x-txn-routing-key`, the attempt number in
//!   `x-txn-check-count`) to the half message's `reply-to`: an AMQP queue name, a direct
//!   reply-to name, or a STOMP destination (`/queue/Q`, `/amq/queue/Q`,
//!   `/reply-queue/Q`, `/topic/K`, `/exchange/X/K`). After `check_max` checks with no
//!   answer it is rolled back. A half message without `reply-to` gets no checks and is
//!   rolled back after the same time.
//!
//! Durable state is the ordered log RocketMQ keeps in its two topics, here the
//! commitlog: one record per half message (the message itself) and one ack record per
//! commit or rollback. A commit appends the routed copy, then the ack; the copy is
//! indexed under a key naming the half entry ([`commit_key`]), so recovery, which finds
//! every unacked half entry, acks the ones whose copy exists (a crash between the two
//! records) instead of offering them again: a committed message is delivered once.
//!
//! Memory: per pending half message, one entry in each of two hash maps (id → offset,
//! offset → timer state and id, so a rollback needs no read) and one in a FIFO of due
//! times: about 100 bytes plus the id twice.
//! No timer per message: [`Txn::tick`] pops the FIFO's due head (its times are in
//! order, since every deadline is `now + check_timeout`). At most
//! [`MAX_PENDING`] half messages wait per vhost. The check count is stored as the half
//! queue entry's delivery count ([`triad_store::returns`]: one small metadata-journal
//! record per tick that sends checks, for all of them; deleted with the resolution), so
//! after a restart a pending half message goes on from the checks it had, its next one
//! due one `check_timeout` after the start.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use triad_store::record::{NewMessage, FLAG_PERSISTENT};
use triad_store::store::{QueueId, Store};

use crate::access::VhostAccess;
use crate::envelope;
use crate::error::{CoreError, ResourceKind};
use crate::message::Properties;
use crate::queue::now_ms;
use crate::value::{FieldTable, FieldValue};
use crate::vhost::{Publish, Published, Vhost};

/// The exchange a commit or rollback is published to.
pub const TXN_EXCHANGE: &str = "amq.triad.txn";
/// The header that marks a half message, a commit, a rollback or a check.
pub const TXN_HEADER: &str = "x-txn";
/// The store queue of a vhost's half messages (reserved: see [`crate::reserved`]).
pub const HALF_QUEUE: &str = "amq.triad.txn.half";
/// Half messages that may wait for their resolution in one vhost; past it a half
/// publish is refused (precondition failed).
pub const MAX_PENDING: usize = 1_000_000;
/// Longest message-id of a half message (the store's index key limit).
pub const MAX_ID: usize = 1024;
/// Due half messages handled per tick (the rest wait for the next one).
const TICK_BATCH: usize = 4096;

/// Settings (`[txn]` in the configuration).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnConfig {
    /// A half message unresolved this long gets a check message, and again after each
    /// further period (default 6 s, RocketMQ's `transactionTimeOut`).
    pub check_timeout: Duration,
    /// Checks sent before an unresolved half message is rolled back (default 15,
    /// RocketMQ's `transactionCheckMax`).
    pub check_max: u32,
}

impl Default for TxnConfig {
    fn default() -> Self {
        TxnConfig {
            check_timeout: Duration::from_secs(6),
            check_max: 15,
        }
    }
}

/// What an `x-txn` header asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnOp {
    /// Store as a half message.
    Half,
    /// Commit a half message.
    Commit,
    /// Roll a half message back.
    Rollback,
}

impl TxnOp {
    /// The `x-txn` header of `props`, if any. A value other than `half`, `commit` or
    /// `rollback` (`check` included: only the broker sends those) is refused.
    pub fn of(props: &Properties) -> Result<Option<TxnOp>, CoreError> {
        let Some(v) = props.headers.as_ref().and_then(|h| h.get(TXN_HEADER)) else {
            return Ok(None);
        };
        match v.as_str() {
            Some(s) if s.eq_ignore_ascii_case("half") => Ok(Some(TxnOp::Half)),
            Some(s) if s.eq_ignore_ascii_case("commit") => Ok(Some(TxnOp::Commit)),
            Some(s) if s.eq_ignore_ascii_case("rollback") => Ok(Some(TxnOp::Rollback)),
            _ => Err(CoreError::PreconditionFailed(format!(
                "header {TXN_HEADER} must be half, commit or rollback, not {v:?}"
            ))),
        }
    }
}

/// Whether a publish is one this module handles (to [`TXN_EXCHANGE`], or with an
/// `x-txn` header).
pub fn is_txn(p: &Publish) -> bool {
    p.exchange == TXN_EXCHANGE
        || p.properties
            .headers
            .as_ref()
            .is_some_and(|h| h.contains(TXN_HEADER))
}

/// Publishes `p` for a connection (or the management API) with rights `access`, which
/// the caller has already checked for `p`'s exchange and routing key (all but
/// [`TXN_EXCHANGE`], whose commits and rollbacks [`Txn`] checks against the half
/// message's own exchange): half messages, commits and rollbacks to the vhost's
/// [`Txn`], the rest to [`Vhost::publish`]. Every publish path that can carry
/// `x-txn` goes through here, so none accepts it and ignores it.
pub fn publish(vh: &Vhost, access: &VhostAccess, p: Publish) -> Result<Published, CoreError> {
    if is_txn(&p) {
        return vh.txn().publish(vh, access, p);
    }
    vh.publish(p)
}

/// The index key under which a commit's routed copy is stored: names the half entry.
pub fn commit_key(queue: QueueId, logical: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(16);
    k.extend_from_slice(b"\0txn");
    k.extend_from_slice(&queue.to_be_bytes());
    k.extend_from_slice(&logical.to_be_bytes());
    k
}

/// Where a check for `reply_to` goes: `(exchange, routing key)`. STOMP destinations
/// (RabbitMQ's STOMP plugin stores them as they are in `reply-to`) are read as that
/// plugin reads them; anything else is a queue name on the default exchange (an AMQP
/// reply queue or a direct reply-to name).
pub fn reply_target(reply_to: &str) -> (String, String) {
    for prefix in ["/queue/", "/amq/queue/", "/reply-queue/"] {
        if let Some(q) = reply_to.strip_prefix(prefix) {
            return (String::new(), q.to_string());
        }
    }
    if let Some(k) = reply_to.strip_prefix("/topic/") {
        return ("amq.topic".to_string(), k.to_string());
    }
    if let Some(rest) = reply_to.strip_prefix("/exchange/") {
        let (x, k) = rest.split_once('/').unwrap_or((rest, ""));
        return (x.to_string(), k.to_string());
    }
    (String::new(), reply_to.to_string())
}

#[derive(Debug, Clone)]
struct Pending {
    /// Its message-id (the key in `by_id`), so a rollback needs no read of the record.
    id: Arc<str>,
    /// Where the record was when the half message was stored (compaction may move it:
    /// reads go through [`Store::read_entry`]).
    commit_offset: u64,
    /// When its next check (or its rollback) is due.
    due_ms: u64,
    /// Checks sent so far.
    checks: u32,
}

#[derive(Default)]
struct State {
    /// message-id → the half queue's logical offset.
    by_id: HashMap<Box<str>, u64>,
    /// logical offset → timer state.
    by_offset: HashMap<u64, Pending>,
    /// `(due, logical offset)` in due order; an entry whose `due` no longer matches
    /// `by_offset` (resolved, or checked again since) is skipped.
    due: VecDeque<(u64, u64)>,
}

/// A vhost's half messages; see the module docs.
pub struct Txn {
    cfg: TxnConfig,
    /// The broker's clock: when check-backs are due.
    clock: crate::Clock,
    store: Arc<Store>,
    queue: QueueId,
    state: Mutex<State>,
}

impl std::fmt::Debug for Txn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Txn")
            .field("queue", &self.queue)
            .field("pending", &self.pending())
            .finish()
    }
}

/// What a tick does to one due half message.
enum Due {
    Check(u32),
    Rollback(Arc<str>),
}

impl Txn {
    /// Opens vhost `vhost`'s half queue and recovers its pending half messages: every
    /// unacked entry, except those whose commit's copy is in the log (acked now).
    pub(crate) fn open(
        store: Arc<Store>,
        vhost: &str,
        cfg: TxnConfig,
        clock: crate::Clock,
    ) -> Result<Txn, CoreError> {
        let queue = store.create_queue(vhost, HALF_QUEUE, true)?;
        let txn = Txn {
            cfg,
            clock,
            store,
            queue,
            state: Mutex::new(State::default()),
        };
        txn.recover(vhost)?;
        Ok(txn)
    }

    fn recover(&self, vhost: &str) -> Result<(), CoreError> {
        let due = self.clock.now_ms().saturating_add(self.timeout_ms());
        let mut committed = Vec::new();
        let mut dropped = Vec::new();
        let mut checks: HashMap<u64, u32> = self
            .store
            .take_delivery_counts(self.queue)
            .into_iter()
            .collect();
        let mut st = self.lock();
        let mut from = 0;
        loop {
            let batch = self.store.unacked_from(self.queue, from, 1024)?;
            let Some(&last) = batch.last() else { break };
            for l in batch {
                let Some((entry, rec)) = self.store.read_queue(self.queue, l)? else {
                    continue;
                };
                if !self
                    .store
                    .lookup_key(&commit_key(self.queue, l), 1)?
                    .is_empty()
                {
                    committed.push(l);
                    continue;
                }
                let id = envelope::decode(&rec.properties)
                    .ok()
                    .and_then(|(_, _, p)| p.message_id)
                    .filter(|id| !id.is_empty());
                let Some(id) = id else {
                    dropped.push(l);
                    continue;
                };
                // one id, two half messages: only a crash between a commit and a new
                // half with the same id can leave that; the newer one stays
                let id: Arc<str> = id.into();
                if let Some(old) = st.by_id.insert(Box::from(&*id), l) {
                    st.by_offset.remove(&old);
                    dropped.push(old);
                }
                st.by_offset.insert(
                    l,
                    Pending {
                        id,
                        commit_offset: entry.commit_offset,
                        due_ms: due,
                        checks: checks.remove(&l).unwrap_or(0),
                    },
                );
                st.due.push_back((due, l));
            }
            from = last.saturating_add(1);
        }
        let pending = st.by_id.len();
        drop(st);
        // counts of half messages resolved (or dropped) before their count was deleted
        let mut stale: Vec<u64> = checks.into_keys().collect();
        stale.extend_from_slice(&committed);
        stale.extend_from_slice(&dropped);
        drop(self.store.drop_delivery_counts(self.queue, &stale)?);
        if !committed.is_empty() || !dropped.is_empty() {
            let mut acks = committed.clone();
            acks.extend_from_slice(&dropped);
            self.store.ack(self.queue, &acks)?.wait()?;
        }
        if pending + committed.len() + dropped.len() > 0 {
            tracing::info!(
                vhost,
                pending,
                committed = committed.len(),
                dropped = dropped.len(),
                "half messages recovered"
            );
        }
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn timeout_ms(&self) -> u64 {
        u64::try_from(self.cfg.check_timeout.as_millis()).unwrap_or(u64::MAX)
    }

    /// Half messages waiting for their resolution.
    pub fn pending(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Whether a half message with this id is pending.
    pub fn is_pending(&self, id: &str) -> bool {
        self.lock().by_id.contains_key(id)
    }

    /// Handles a publish [`is_txn`] picked, by a connection with rights `access`.
    pub(crate) fn publish(
        &self,
        vh: &Vhost,
        access: &VhostAccess,
        p: Publish,
    ) -> Result<Published, CoreError> {
        let op = TxnOp::of(&p.properties)?;
        match (p.exchange == TXN_EXCHANGE, op) {
            // the caller checked the right to publish to its exchange ([`publish`])
            (false, Some(TxnOp::Half)) => self.half(vh, p),
            (true, Some(op @ (TxnOp::Commit | TxnOp::Rollback))) => {
                let id = match (p.properties.message_id.as_deref(), p.routing_key.as_str()) {
                    (Some(id), rk) if !id.is_empty() && (rk.is_empty() || rk == id) => id,
                    (Some(id), rk) if !id.is_empty() => {
                        return Err(CoreError::PreconditionFailed(format!(
                            "message-id '{id}' and routing key '{rk}' name different half messages"
                        )))
                    }
                    (_, rk) if !rk.is_empty() => rk,
                    _ => {
                        return Err(CoreError::PreconditionFailed(format!(
                            "{TXN_HEADER}: {} needs the half message's message-id",
                            if op == TxnOp::Commit { "commit" } else { "rollback" }
                        )))
                    }
                };
                self.resolve(vh, access, id, op == TxnOp::Commit, p.conn)
            }
            (true, _) => Err(CoreError::PreconditionFailed(format!(
                "exchange '{TXN_EXCHANGE}' takes only {TXN_HEADER}: commit or {TXN_HEADER}: rollback"
            ))),
            (false, _) => Err(CoreError::PreconditionFailed(format!(
                "{TXN_HEADER}: commit and rollback are published to exchange '{TXN_EXCHANGE}'"
            ))),
        }
    }

    /// Stores a half message.
    fn half(&self, vh: &Vhost, p: Publish) -> Result<Published, CoreError> {
        let id = match p.properties.message_id.as_deref() {
            Some(id) if !id.is_empty() => id,
            _ => {
                return Err(CoreError::PreconditionFailed(format!(
                    "a half message ({TXN_HEADER}: half) needs a message-id"
                )))
            }
        };
        if id.len() > MAX_ID {
            return Err(CoreError::PreconditionFailed(format!(
                "a half message's message-id is at most {MAX_ID} bytes"
            )));
        }
        // delivered when committed: a delay would be ignored (RocketMQ has no delayed
        // transactional messages either)
        if let Some(h) = p.properties.headers.as_ref() {
            for name in ["x-delay", "x-delay-level"] {
                if h.contains(name) {
                    return Err(CoreError::PreconditionFailed(format!(
                        "{name} cannot be used on a half message ({TXN_HEADER}: half): it is delivered when committed"
                    )));
                }
            }
        }
        vh.check_size(&p)?;
        // the exchange must exist now (and take publishes), as for any publish
        vh.check_publishable(&p.exchange)?;
        let env = envelope::encode(&p.exchange, &p.routing_key, &p.properties)?;
        let mut st = self.lock();
        if st.by_id.contains_key(id) {
            return Err(CoreError::PreconditionFailed(format!(
                "a half message with message-id '{id}' is already pending"
            )));
        }
        if st.by_id.len() >= MAX_PENDING {
            return Err(CoreError::PreconditionFailed(format!(
                "{MAX_PENDING} half messages are pending in this vhost"
            )));
        }
        let key: [&[u8]; 1] = [id.as_bytes()];
        let appended = self.store.append(&NewMessage {
            queues: &[self.queue],
            flags: FLAG_PERSISTENT,
            born_ts_ms: now_ms(),
            tag_hash: 0,
            keys: &key,
            properties: &env,
            body: &p.body,
        })?;
        let Some(&(_, logical)) = appended.queue_offsets.first() else {
            return Err(CoreError::Internal("half message not queued".into()));
        };
        let due = self.clock.now_ms().saturating_add(self.timeout_ms());
        st.by_id.insert(id.into(), logical);
        st.by_offset.insert(
            logical,
            Pending {
                id: id.into(),
                commit_offset: appended.commit_offset,
                due_ms: due,
                checks: 0,
            },
        );
        st.due.push_back((due, logical));
        drop(st);
        Ok(Published::held(appended.durable.into()))
    }

    /// Takes half message `id` out of the pending set: its offset and the record, once
    /// `access` may write to its exchange with its routing key.
    fn take(
        &self,
        vh: &Vhost,
        access: &VhostAccess,
        id: &str,
    ) -> Result<(u64, u32, String, String, Properties, Bytes), CoreError> {
        let not_found = || CoreError::NotFound {
            kind: ResourceKind::HalfMessage,
            name: id.to_string(),
        };
        let (logical, pend) = {
            let st = self.lock();
            let l = *st.by_id.get(id).ok_or_else(not_found)?;
            let pend = st.by_offset.get(&l).ok_or_else(not_found)?;
            (l, pend.commit_offset)
        };
        let rec = self.store.read_entry(self.queue, logical, pend)?;
        let (exchange, rk, props) = envelope::decode(&rec.properties)?;
        access.publish_to(vh, &exchange, &rk)?;
        let mut st = self.lock();
        if st.by_id.get(id) != Some(&logical) {
            // resolved meanwhile
            return Err(not_found());
        }
        st.by_id.remove(id);
        let checks = st.by_offset.remove(&logical).map_or(0, |p| p.checks);
        Ok((logical, checks, exchange, rk, props, rec.body))
    }

    /// Puts back a half message [`Txn::take`] took whose commit failed.
    fn put_back(&self, id: &str, logical: u64, checks: u32) {
        if let Ok(Some((entry, _))) = self.store.read_queue(self.queue, logical) {
            let due = self.clock.now_ms().saturating_add(self.timeout_ms());
            let mut st = self.lock();
            st.by_id.insert(id.into(), logical);
            st.by_offset.insert(
                logical,
                Pending {
                    id: id.into(),
                    commit_offset: entry.commit_offset,
                    due_ms: due,
                    checks,
                },
            );
            st.due.push_back((due, logical));
        }
    }

    /// Commits or rolls back half message `id`.
    fn resolve(
        &self,
        vh: &Vhost,
        access: &VhostAccess,
        id: &str,
        commit: bool,
        conn: crate::ConnectionId,
    ) -> Result<Published, CoreError> {
        let (logical, checks, exchange, rk, mut props, body) = self.take(vh, access, id)?;
        let mut published = Published {
            routed: true,
            rejected: false,
            durable: None,
            backpressure: None,
            queues: 0,
        };
        if commit {
            if let Some(h) = props.headers.as_mut() {
                h.remove(TXN_HEADER);
                if h.is_empty() {
                    props.headers = None;
                }
            }
            let key = commit_key(self.queue, logical);
            match vh.publish_committed(&exchange, &rk, props, &body, &key, conn) {
                Ok(p) => published = p,
                Err(e) => {
                    // e.g. its exchange was deleted since: still pending, to be rolled
                    // back (or committed once the exchange is back)
                    self.put_back(id, logical, checks);
                    return Err(e);
                }
            }
        }
        // after the copy in the log: durable ack ⇒ durable copy
        let ack = self.store.ack(self.queue, &[logical])?;
        if checks > 0 {
            drop(self.store.drop_delivery_counts(self.queue, &[logical])?);
        }
        published.durable = Some(ack.into());
        Ok(published)
    }

    /// Sends the checks that are due and rolls back what had its last check.
    pub(crate) fn tick(&self, vh: &Vhost) {
        let now = self.clock.now_ms();
        let mut work = Vec::new();
        // check counts to store, and those of rolled-back messages to forget
        let (mut counted, mut forget) = (Vec::new(), Vec::new());
        {
            let mut st = self.lock();
            let timeout = self.timeout_ms();
            while work.len() < TICK_BATCH {
                let Some(&(due, l)) = st.due.front() else {
                    break;
                };
                if due > now {
                    break;
                }
                st.due.pop_front();
                let Some(p) = st.by_offset.get_mut(&l) else {
                    continue;
                };
                if p.due_ms != due {
                    continue;
                }
                if p.checks >= self.cfg.check_max {
                    // the id is kept with the offset: the rollback needs no read, so an
                    // unreadable record is still acked and its id leaves the pending set
                    let id = p.id.clone();
                    if p.checks > 0 {
                        forget.push(l);
                    }
                    st.by_offset.remove(&l);
                    if st.by_id.get(&*id) == Some(&l) {
                        st.by_id.remove(&*id);
                    }
                    work.push((l, Due::Rollback(id)));
                } else {
                    p.checks += 1;
                    p.due_ms = now.saturating_add(timeout);
                    let (checks, next) = (p.checks, p.due_ms);
                    counted.push((l, checks));
                    st.due.push_back((next, l));
                    work.push((l, Due::Check(checks)));
                }
            }
        }
        // one journal record for the tick's checks, written before they go out (a count
        // lost to a crash is one check too many after the restart, never one too few)
        if let Err(e) = self.store.put_delivery_counts(self.queue, &counted) {
            tracing::warn!(vhost = vh.name(), error = %e, "storing half message check counts failed");
        }
        for (l, what) in work {
            let n = match what {
                Due::Rollback(id) => {
                    tracing::debug!(
                        vhost = vh.name(),
                        id = &*id,
                        "half message unresolved after its last check: rolled back"
                    );
                    if let Err(e) = self.store.ack(self.queue, &[l]) {
                        tracing::warn!(vhost = vh.name(), error = %e, "half message rollback failed");
                    }
                    continue;
                }
                Due::Check(n) => n,
            };
            // an unreadable record gets no check; it stays pending and is rolled back
            // (acked) after its last one
            let rec = match self.store.read_queue(self.queue, l) {
                Ok(Some((_, rec))) => rec,
                other => {
                    tracing::warn!(vhost = vh.name(), offset = l, result = ?other.err(), "half message unreadable");
                    continue;
                }
            };
            let Ok((exchange, rk, props)) = envelope::decode(&rec.properties) else {
                continue;
            };
            let id = props.message_id.clone().unwrap_or_default();
            self.send_check(vh, &id, &exchange, &rk, &props, n);
        }
        // after the rollbacks' acks (a crash in between leaves a count that the next
        // start finds acked and deletes)
        if let Err(e) = self.store.drop_delivery_counts(self.queue, &forget) {
            tracing::warn!(vhost = vh.name(), error = %e, "forgetting half message check counts failed");
        }
    }

    fn send_check(
        &self,
        vh: &Vhost,
        id: &str,
        exchange: &str,
        rk: &str,
        half: &Properties,
        n: u32,
    ) {
        let Some(reply_to) = half.reply_to.as_deref().filter(|r| !r.is_empty()) else {
            return;
        };
        let (to_exchange, to_key) = reply_target(reply_to);
        let mut headers = FieldTable::new();
        headers.insert(TXN_HEADER, "check");
        headers.insert("x-txn-check-count", FieldValue::I64(i64::from(n)));
        headers.insert("x-txn-exchange", exchange);
        headers.insert("x-txn-routing-key", rk);
        let properties = Properties {
            message_id: Some(id.to_string()),
            correlation_id: Some(
                half.correlation_id
                    .clone()
                    .unwrap_or_else(|| id.to_string()),
            ),
            headers: Some(headers),
            ..Properties::default()
        };
        let res = vh.publish(Publish {
            exchange: to_exchange,
            routing_key: to_key,
            mandatory: false,
            properties,
            body: Bytes::new(),
            conn: 0,
        });
        match res {
            Ok(p) if p.routed => {
                tracing::debug!(
                    vhost = vh.name(),
                    id,
                    reply_to,
                    check = n,
                    "half message check sent"
                )
            }
            Ok(_) => {
                tracing::debug!(
                    vhost = vh.name(),
                    id,
                    reply_to,
                    check = n,
                    "half message check unroutable"
                )
            }
            Err(e) => {
                tracing::debug!(vhost = vh.name(), id, reply_to, error = %e, "half message check failed")
            }
        }
    }

    /// The vhost is deleted: so is its half queue.
    pub(crate) fn delete(&self) -> Result<(), CoreError> {
        let mut st = self.lock();
        *st = State::default();
        drop(st);
        self.store.delete_queue(self.queue)?;
        Ok(())
    }
}

/// A batch (AMQP `tx.commit`, STOMP `COMMIT`) may not hold half messages, commits or
/// rollbacks.
pub fn refuse_in_batch(batch: &[Publish]) -> Result<(), CoreError> {
    if batch.iter().any(is_txn) {
        return Err(CoreError::PreconditionFailed(format!(
            "{TXN_HEADER} (half messages, commit, rollback) inside a transaction is not supported"
        )));
    }
    Ok(())
}
