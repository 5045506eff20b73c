//! State shared by all MQTT connections of a broker: the client-id registry (session
//! takeover), per-vhost retained messages and persistent-session subscriptions, QoS 2
//! identifiers carried between connections of a persistent session, and the `$SYS`
//! counters.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use triad_core::Durability;
use triad_core::{
    Broker, Clock, ConnectionId, CoreError, FieldTable, Properties, Publish, QueueDeclare, Vhost,
};

use crate::durable::DurableLog;
use crate::retained::RetainedStore;
use crate::session::Carry;
use crate::topic::{parse_shared, topic_to_routing_key, SharedFilter};

/// The queue a shared subscription's group takes its messages from: one per (vhost,
/// group, filter). The group holds no `/`, so the name is unambiguous.
pub fn shared_queue_name(s: SharedFilter<'_>) -> String {
    format!("mqtt-shared-{}/{}", s.group, s.filter)
}

/// The queue that holds a vhost's persistent-session subscriptions (a name reserved to
/// the broker).
pub const SESSIONS_QUEUE: &str = "amq.triad.mqtt.sessions";
/// Where versions before issue 14 kept them (taken over once at start).
pub const LEGACY_SESSIONS_QUEUE: &str = "mqtt-sessions";

/// One persistent session as stored: its owner, its subscriptions and, while its client
/// is away, when it left.
#[derive(Debug, Clone, Default)]
struct Stored {
    /// The user who created it; `None` for a session stored before owners were kept
    /// (the first user to connect to it then owns it).
    owner: Option<Box<str>>,
    subs: BTreeMap<String, u8>,
    /// Stream subscriptions (`$stream/...` → granted QoS); their positions are the
    /// streams' stored consumer offsets ([`crate::stream::consumer_name`]).
    streams: BTreeMap<String, u8>,
    /// Ms since the Unix epoch, by the broker's clock, at which the client disconnected;
    /// 0 while it is connected (or for sessions stored before `session_expiry` was turned
    /// on).
    disconnected_at: u64,
}

/// Persistent sessions (clean session 0), by client id: the owner and filter → granted
/// QoS, as JSON (`{"user": ..., "subs": {...}, "streams": {...}}`, `streams` only when
/// there are any; older entries are the bare `subs` map)
/// in a [`DurableLog`] entry whose `meta` is the time the client disconnected (see
/// [`Stored::disconnected_at`]), kept only with `session_expiry`.
#[derive(Debug)]
pub struct SessionStore {
    map: Mutex<HashMap<String, Stored>>,
    log: DurableLog,
    vhost: Arc<Vhost>,
}

impl SessionStore {
    fn open(vhost: Arc<Vhost>, conn: ConnectionId) -> Result<SessionStore, CoreError> {
        let (log, entries) =
            DurableLog::open(vhost.clone(), SESSIONS_QUEUE, LEGACY_SESSIONS_QUEUE, conn)?;
        let mut map = HashMap::new();
        for e in entries {
            match decode_stored(&e.value) {
                Ok((owner, subs, streams)) => {
                    let disconnected_at = u64::try_from(e.meta).unwrap_or(0);
                    map.insert(
                        e.key,
                        Stored {
                            owner,
                            subs,
                            streams,
                            disconnected_at,
                        },
                    );
                }
                Err(err) => {
                    tracing::warn!(client = e.key, error = %err, "dropping an unreadable MQTT session")
                }
            }
        }
        Ok(SessionStore {
            map: Mutex::new(map),
            log,
            vhost,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Stored>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(
        &self,
        g: &mut HashMap<String, Stored>,
        client: &str,
        stored: Stored,
    ) -> Result<Option<Durability>, CoreError> {
        let json = match &stored.owner {
            Some(user) if stored.streams.is_empty() => serde_json::to_vec(&serde_json::json!({
                "user": &**user,
                "subs": &stored.subs,
            })),
            Some(user) => serde_json::to_vec(&serde_json::json!({
                "user": &**user,
                "subs": &stored.subs,
                "streams": &stored.streams,
            })),
            None => serde_json::to_vec(&stored.subs),
        }
        .map_err(|e| CoreError::Internal(format!("encoding a session: {e}")))?;
        let meta = i64::try_from(stored.disconnected_at).unwrap_or(i64::MAX);
        let d = self.log.put(client, Bytes::from(json), meta)?;
        g.insert(client.to_string(), stored);
        Ok(d)
    }

    /// The stored subscriptions of `client`.
    pub fn get(&self, client: &str) -> Option<BTreeMap<String, u8>> {
        self.lock().get(client).map(|s| s.subs.clone())
    }

    /// The stored stream subscriptions of `client` (filter, granted QoS).
    pub fn streams(&self, client: &str) -> Vec<(String, u8)> {
        self.lock().get(client).map_or_else(Vec::new, |s| {
            s.streams.iter().map(|(f, q)| (f.clone(), *q)).collect()
        })
    }

    /// Whether `user` may use the stored session of `client`: there is none, or it is
    /// theirs, or it predates owners (it is then theirs from the next save).
    pub fn may_use(&self, client: &str, user: &str) -> bool {
        match self.lock().get(client) {
            Some(Stored {
                owner: Some(owner), ..
            }) => **owner == *user,
            _ => true,
        }
    }

    /// Stores the subscriptions of `client` (connected), owned by `user`; completes once
    /// on disk.
    pub fn save(
        &self,
        client: &str,
        user: &str,
        subs: &BTreeMap<String, u8>,
        streams: BTreeMap<String, u8>,
    ) -> Result<Option<Durability>, CoreError> {
        let mut g = self.lock();
        self.put(
            &mut g,
            client,
            Stored {
                owner: Some(Box::from(user)),
                subs: subs.clone(),
                streams,
                disconnected_at: 0,
            },
        )
    }

    /// Records `user` as the owner of `client`'s session unless it already is (one
    /// write when a session is created or an ownerless one is claimed).
    pub fn claim(&self, client: &str, user: &str) -> Result<Option<Durability>, CoreError> {
        let mut g = self.lock();
        let stored = match g.get(client) {
            Some(s) if s.owner.as_deref() == Some(user) => return Ok(None),
            Some(s) => Stored {
                owner: Some(Box::from(user)),
                ..s.clone()
            },
            None => Stored {
                owner: Some(Box::from(user)),
                ..Stored::default()
            },
        };
        self.put(&mut g, client, stored)
    }

    /// Every (shared queue, client) a stored session is a member of.
    fn shared_members(&self) -> Vec<(String, String)> {
        let g = self.lock();
        let mut out = Vec::new();
        for (client, st) in g.iter() {
            for f in st.subs.keys() {
                if let Some(Ok(sh)) = parse_shared(f) {
                    out.push((shared_queue_name(sh), client.clone()));
                }
            }
        }
        out
    }

    /// Persistent sessions stored (connected or not).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets `client`, and the positions of its stream subscriptions.
    pub fn remove(&self, client: &str) {
        let mut g = self.lock();
        if let Some(s) = g.remove(client) {
            self.log.delete(client);
            drop(g);
            for f in s.streams.keys() {
                crate::stream::forget_position(&self.vhost, client, f);
            }
        }
    }

    /// Records that `client` disconnected at `at` (ms since the epoch), storing an entry
    /// with no subscriptions if it had none, so that the session can expire.
    fn mark_disconnected(&self, client: &str, at: u64) -> Result<(), CoreError> {
        let mut g = self.lock();
        let stored = g.get(client).cloned().unwrap_or_default();
        self.put(
            &mut g,
            client,
            Stored {
                disconnected_at: at,
                ..stored
            },
        )
        .map(drop)
    }

    /// Records that `client` is connected again (one write, only if it was marked away).
    fn mark_connected(&self, client: &str) -> Result<(), CoreError> {
        let mut g = self.lock();
        let stored = match g.get(client) {
            Some(s) if s.disconnected_at != 0 => s.clone(),
            _ => return Ok(()),
        };
        self.put(
            &mut g,
            client,
            Stored {
                disconnected_at: 0,
                ..stored
            },
        )
        .map(drop)
    }

    /// When `client` disconnected, if it is stored as away.
    fn disconnected_at(&self, client: &str) -> Option<u64> {
        self.lock()
            .get(client)
            .map(|s| s.disconnected_at)
            .filter(|t| *t != 0)
    }

    /// Sessions to put on the expiry timer when the store is opened: those stored as
    /// away, and, counted from `now`, those stored as connected whose client is not
    /// (the broker stopped while they were connected, or they were stored before
    /// `session_expiry` was on). The latter are stamped in memory only, so an expiry is
    /// never earlier than its due time, at worst later.
    fn away(&self, now: u64, connected: impl Fn(&str) -> bool) -> Vec<(String, u64)> {
        let mut g = self.lock();
        let mut out = Vec::new();
        for (client, s) in g.iter_mut() {
            if connected(client) {
                continue;
            }
            if s.disconnected_at == 0 {
                s.disconnected_at = now;
            }
            out.push((client.clone(), s.disconnected_at));
        }
        out
    }
}

/// Filter → granted QoS.
type Subs = BTreeMap<String, u8>;

/// Decodes a stored session: `{"user": ..., "subs": {...}, "streams": {...}}`
/// (`streams` optional), or an older entry's bare `subs` map (no owner).
fn decode_stored(json: &[u8]) -> serde_json::Result<(Option<Box<str>>, Subs, Subs)> {
    let mut v: serde_json::Value = serde_json::from_slice(json)?;
    let owner = v.get("user").and_then(|u| u.as_str()).map(Box::<str>::from);
    let mut streams = Subs::new();
    if owner.is_some() {
        if let Some(s) = v.get_mut("streams").map(serde_json::Value::take) {
            streams = serde_json::from_value(s)?;
        }
        v = v
            .get_mut("subs")
            .map(serde_json::Value::take)
            .unwrap_or_default();
    }
    let subs = serde_json::from_value(v)?;
    Ok((owner, subs, streams))
}

/// A persistent session's due time on the expiry timer.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Due {
    /// ms since the epoch.
    at: u64,
    vhost: String,
    client: String,
    /// The disconnect this entry was made for: a later connect or disconnect makes
    /// the entry stale (it is then skipped when it comes due).
    disconnected_at: u64,
}

/// `session_expiry`: the due times of disconnected persistent sessions, earliest first.
/// Each disconnect pushes one entry and each due entry is looked at once, so the work is
/// O(log n) per disconnect and O(1) per expiring session; no scan of all sessions.
#[derive(Debug)]
struct Expiry {
    after: Duration,
    heap: Mutex<BinaryHeap<Reverse<Due>>>,
    wake: Notify,
}

impl Expiry {
    fn push(&self, vhost: &str, client: &str, disconnected_at: u64, at: u64) {
        lock(&self.heap).push(Reverse(Due {
            at,
            vhost: vhost.to_string(),
            client: client.to_string(),
            disconnected_at,
        }));
        self.wake.notify_one();
    }

    fn after_ms(&self) -> u64 {
        u64::try_from(self.after.as_millis()).unwrap_or(u64::MAX)
    }
}

/// What MQTT keeps per vhost.
#[derive(Debug)]
pub struct VhostState {
    /// The vhost.
    pub vhost: Arc<Vhost>,
    /// Its retained messages.
    pub retained: RetainedStore,
    /// Its persistent sessions' subscriptions.
    pub sessions: SessionStore,
}

/// A connected client, for takeover.
#[derive(Debug, Clone)]
pub(crate) struct LiveClient {
    pub conn: ConnectionId,
    /// The user connected under the client id (`None`: the broker itself, expiring it).
    pub user: Option<Arc<str>>,
    /// Cancelled to make the connection close (a new one took its client id).
    pub kick: CancellationToken,
}

/// The key of a connected client id: the vhost's length, the vhost and the client id in
/// one allocation (a map entry costs 56 bytes and one string, where a `(String, String)`
/// key cost 88 bytes and two).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ClientKey(Box<str>);

impl ClientKey {
    pub(crate) fn new(vhost: &str, client: &str) -> ClientKey {
        ClientKey(format!("{}:{vhost}{client}", vhost.len()).into_boxed_str())
    }
}

/// `$SYS` counters.
#[derive(Debug)]
pub struct Stats {
    started: Instant,
    /// Clients connected now.
    pub connected: AtomicU64,
    /// PUBLISH packets received.
    pub received: AtomicU64,
    /// PUBLISH packets sent.
    pub sent: AtomicU64,
}

/// State shared by every MQTT connection of one broker.
#[derive(Debug)]
pub struct MqttState {
    broker: Arc<Broker>,
    conn: ConnectionId,
    vhosts: Mutex<HashMap<String, Arc<VhostState>>>,
    clients: Mutex<HashMap<ClientKey, LiveClient>>,
    /// Connections taken over that have not finished cleaning up yet, and the wake-up
    /// of the connections waiting for them (one for the whole broker: a connection costs
    /// nothing here unless it is being taken over).
    finishing: Mutex<HashSet<ConnectionId>>,
    finished: Notify,
    /// Shared subscriptions: the client ids that are members, per (vhost, shared queue):
    /// connected clients and persistent sessions (connected or not). The queue is
    /// deleted with its last member.
    shared: Mutex<HashMap<(String, String), HashSet<String>>>,
    carry: Mutex<HashMap<(String, String), Carry>>,
    /// Set by [`MqttState::spawn_session_expiry`].
    expiry: OnceLock<Arc<Expiry>>,
    /// Counters for `$SYS`.
    pub stats: Stats,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl MqttState {
    /// Opens the MQTT state of `broker`: the default vhost's retained messages and
    /// sessions are loaded now (other vhosts on first use).
    pub fn new(broker: Arc<Broker>) -> Result<Arc<MqttState>, CoreError> {
        let conn = broker.next_connection_id();
        let st = Arc::new(MqttState {
            broker,
            conn,
            vhosts: Mutex::new(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            finishing: Mutex::new(HashSet::new()),
            finished: Notify::new(),
            shared: Mutex::new(HashMap::new()),
            carry: Mutex::new(HashMap::new()),
            expiry: OnceLock::new(),
            stats: Stats {
                started: Instant::now(),
                connected: AtomicU64::new(0),
                received: AtomicU64::new(0),
                sent: AtomicU64::new(0),
            },
        });
        let default = st.broker.default_vhost().to_string();
        st.vhost_state(&default)?;
        Ok(st)
    }

    /// The broker.
    pub fn broker(&self) -> &Arc<Broker> {
        &self.broker
    }

    /// The broker's clock, which session expiry reads (`CoreConfig::clock`).
    fn clock(&self) -> &Clock {
        &self.broker.config().clock
    }

    /// Ms since the Unix epoch by the broker's clock (disconnect times are persisted,
    /// so this is wall-clock time that survives a restart).
    fn now_ms(&self) -> u64 {
        self.clock().now_ms()
    }

    /// The MQTT state of a vhost, opened on first use.
    pub fn vhost_state(&self, name: &str) -> Result<Arc<VhostState>, CoreError> {
        let mut g = lock(&self.vhosts);
        if let Some(v) = g.get(name) {
            return Ok(v.clone());
        }
        let vhost = self.broker.vhost(name)?;
        let vs = Arc::new(VhostState {
            retained: RetainedStore::open(vhost.clone(), self.conn)?,
            sessions: SessionStore::open(vhost.clone(), self.conn)?,
            vhost,
        });
        g.insert(name.to_string(), vs.clone());
        drop(g);
        {
            // the persistent sessions' shared-subscription memberships
            let mut sh = lock(&self.shared);
            for (qname, client) in vs.sessions.shared_members() {
                sh.entry((name.to_string(), qname))
                    .or_default()
                    .insert(client);
            }
        }
        self.schedule_away(&vs);
        Ok(vs)
    }

    /// Makes `client` a member of the shared subscription `sh`: declares its queue
    /// (durable when `durable`, i.e. the first member to need it is a persistent
    /// session) and binds it to `amq.topic` with `key` if this is the first member or
    /// the queue is gone, under the lock that [`MqttState::leave_shared`] deletes it
    /// under. The caller checked the permissions. Returns what the binding's journal
    /// record completes with.
    pub(crate) fn join_shared(
        &self,
        vhost: &Vhost,
        qname: &str,
        key: &str,
        client: &str,
        durable: bool,
    ) -> Result<Durability, CoreError> {
        let mut g = lock(&self.shared);
        if vhost.queue(qname).is_none() {
            // the binding's journal record, after this one, covers both
            drop(vhost.declare_queue_deferred(QueueDeclare {
                name: qname.to_string(),
                durable,
                conn: self.conn,
                ..Default::default()
            })?);
        }
        let bound = vhost.bind_queue_deferred(
            qname,
            "amq.topic",
            key,
            &FieldTable::default(),
            self.conn,
        )?;
        g.entry((vhost.name().to_string(), qname.to_string()))
            .or_default()
            .insert(client.to_string());
        Ok(bound)
    }

    /// `client` leaves the shared subscription queue `qname`; the last member to leave
    /// deletes it (with what it still holds, as an unsubscribe drops what was queued).
    pub(crate) fn leave_shared(&self, vhost: &Vhost, qname: &str, client: &str) {
        let mut g = lock(&self.shared);
        let key = (vhost.name().to_string(), qname.to_string());
        let Some(members) = g.get_mut(&key) else {
            return;
        };
        members.remove(client);
        if !members.is_empty() {
            return;
        }
        g.remove(&key);
        if vhost.queue(qname).is_some() {
            if let Err(e) = vhost.delete_queue(qname, false, false, self.conn) {
                tracing::warn!(queue = qname, error = %e, "cannot delete a shared subscription's queue");
            }
        }
    }

    /// Retained messages and persistent sessions over the vhosts MQTT has opened
    /// (`/metrics`): O(vhosts), each a length under its lock.
    pub fn totals(&self) -> (usize, usize) {
        let vhosts: Vec<Arc<VhostState>> = lock(&self.vhosts).values().cloned().collect();
        vhosts.iter().fold((0, 0), |(r, s), vs| {
            (r + vs.retained.len(), s + vs.sessions.len())
        })
    }

    /// Members of a shared subscription queue (tests and the management view).
    pub fn shared_members(&self, vhost: &str, qname: &str) -> usize {
        lock(&self.shared)
            .get(&(vhost.to_string(), qname.to_string()))
            .map_or(0, HashSet::len)
    }

    /// Puts a vhost's away sessions on the expiry timer (when it is on).
    fn schedule_away(&self, vs: &VhostState) {
        let Some(ex) = self.expiry.get() else { return };
        let name = vs.vhost.name().to_string();
        let away = vs
            .sessions
            .away(self.now_ms(), |c| self.is_connected(&name, c));
        for (client, t) in away {
            ex.push(&name, &client, t, t.saturating_add(ex.after_ms()));
        }
    }

    /// A persistent session's client connected: it no longer expires.
    pub(crate) fn session_connected(&self, vs: &VhostState, client: &str) {
        if self.expiry.get().is_none() {
            return;
        }
        if let Err(e) = vs.sessions.mark_connected(client) {
            tracing::warn!(client, error = %e, "cannot store the MQTT session as connected");
        }
    }

    /// A persistent session's client disconnected: with `session_expiry`, the time is
    /// stored with the session and the session goes on the expiry timer.
    pub(crate) fn session_disconnected(&self, vs: &VhostState, client: &str) {
        let Some(ex) = self.expiry.get() else { return };
        let now = self.now_ms();
        if let Err(e) = vs.sessions.mark_disconnected(client, now) {
            tracing::warn!(client, error = %e, "cannot store the MQTT session's disconnect time");
        }
        ex.push(
            vs.vhost.name(),
            client,
            now,
            now.saturating_add(ex.after_ms()),
        );
    }

    /// Turns `session_expiry` on: a persistent session whose client stays away longer
    /// than `after` is removed with its queue and subscriptions (Mosquitto's
    /// `persistent_client_expiration`). Sessions already stored are scheduled from
    /// their stored disconnect time. Runs until `shutdown`, holding the state weakly.
    pub fn spawn_session_expiry(
        self: &Arc<Self>,
        after: Duration,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let expiry = Arc::new(Expiry {
            after,
            heap: Mutex::new(BinaryHeap::new()),
            wake: Notify::new(),
        });
        if self.expiry.set(expiry.clone()).is_ok() {
            // a manual clock's advance may make a session due: look again
            let ex = Arc::downgrade(&expiry);
            self.clock().on_advance(move || {
                if let Some(ex) = ex.upgrade() {
                    ex.wake.notify_one();
                }
            });
        }
        let opened: Vec<Arc<VhostState>> = lock(&self.vhosts).values().cloned().collect();
        for vs in &opened {
            self.schedule_away(vs);
        }
        let me: Weak<MqttState> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(st) = me.upgrade() else { return };
                let Some(ex) = st.expiry.get().cloned() else {
                    return;
                };
                let now = st.now_ms();
                let due = {
                    let mut heap = lock(&ex.heap);
                    match heap.peek() {
                        Some(Reverse(d)) if d.at <= now => heap.pop().map(|Reverse(d)| d),
                        _ => None,
                    }
                };
                if let Some(d) = due {
                    st.expire(d);
                    continue;
                }
                let wait = lock(&ex.heap)
                    .peek()
                    .map(|Reverse(d)| Duration::from_millis(d.at.saturating_sub(now)))
                    .unwrap_or(Duration::from_secs(60))
                    .min(Duration::from_secs(60));
                let woken = ex.wake.notified();
                drop(st);
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = woken => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        })
    }

    /// Removes a due session unless it is stale (its client came back, or it was
    /// removed) or its client is connected.
    fn expire(&self, d: Due) {
        let Ok(vs) = self.vhost_state(&d.vhost) else {
            return;
        };
        if vs.sessions.disconnected_at(&d.client) != Some(d.disconnected_at) {
            return; // stale
        }
        // Hold the client id while removing: a client connecting now waits for this
        // (as for a takeover) and then finds no session.
        let me = LiveClient {
            conn: self.conn,
            user: None,
            kick: CancellationToken::new(),
        };
        let key = ClientKey::new(&d.vhost, &d.client);
        {
            let mut g = lock(&self.clients);
            if g.contains_key(&key) {
                // a connection still holds the id: connected again (its disconnect
                // reschedules), or on its way out; look again in a second
                drop(g);
                if let Some(ex) = self.expiry.get() {
                    ex.push(&d.vhost, &d.client, d.disconnected_at, self.now_ms() + 1000);
                }
                return;
            }
            g.insert(key, me);
        }
        if vs.sessions.disconnected_at(&d.client) == Some(d.disconnected_at) {
            let qname = format!("mqtt-subscription-{}", d.client);
            match vs.vhost.delete_queue(&qname, false, false, self.conn) {
                Ok(dropped) => tracing::info!(
                    client = d.client,
                    vhost = d.vhost,
                    messages = dropped,
                    "MQTT session expired"
                ),
                Err(e) => {
                    tracing::warn!(client = d.client, error = %e, "cannot delete an expired MQTT session's queue")
                }
            }
            self.leave_all_shared(&vs, &d.client);
            vs.sessions.remove(&d.client);
            self.take_carry(&d.vhost, &d.client);
        }
        self.unregister(&d.vhost, &d.client, self.conn);
        self.finish(self.conn);
    }

    /// A stored session goes (expired, or discarded by a clean-session CONNECT): it
    /// leaves the shared subscriptions it was a member of.
    pub(crate) fn leave_all_shared(&self, vs: &VhostState, client: &str) {
        let Some(subs) = vs.sessions.get(client) else {
            return;
        };
        for f in subs.keys() {
            if let Some(Ok(sh)) = parse_shared(f) {
                self.leave_shared(&vs.vhost, &shared_queue_name(sh), client);
            }
        }
    }

    /// Registers a connection under a client id; returns the one it replaces (to be
    /// taken over). `Err`: the id is connected as another user, and is left alone.
    pub(crate) fn register(
        &self,
        vhost: &str,
        client: &str,
        me: LiveClient,
    ) -> Result<Option<LiveClient>, ()> {
        let mut g = lock(&self.clients);
        let key = ClientKey::new(vhost, client);
        if let Some(cur) = g.get(&key) {
            if cur.user.is_some() && me.user.is_some() && cur.user != me.user {
                return Err(());
            }
        }
        let prev = g.insert(key, me);
        if let Some(p) = &prev {
            // under the clients lock: it cannot have finished before it is noted
            lock(&self.finishing).insert(p.conn);
        }
        Ok(prev)
    }

    /// Removes a connection's registration if it is still its own.
    pub(crate) fn unregister(&self, vhost: &str, client: &str, conn: ConnectionId) {
        self.unregister_key(&ClientKey::new(vhost, client), conn);
    }

    /// [`MqttState::unregister`] by the key the connection registered with.
    pub(crate) fn unregister_key(&self, key: &ClientKey, conn: ConnectionId) {
        let mut g = lock(&self.clients);
        if g.get(key).is_some_and(|c| c.conn == conn) {
            g.remove(key);
        }
    }

    /// Whether `conn` is being taken over: another connection with its client id waits
    /// for it to finish ([`MqttState::finished`]).
    pub(crate) fn being_taken_over(&self, conn: ConnectionId) -> bool {
        lock(&self.finishing).contains(&conn)
    }

    /// A connection has cleaned up (after [`MqttState::unregister`]): wakes a
    /// connection waiting to take its client id over.
    pub(crate) fn finish(&self, conn: ConnectionId) {
        if lock(&self.finishing).remove(&conn) {
            self.finished.notify_waiters();
        }
    }

    /// Waits until the connection `conn`, taken over, has cleaned up.
    pub(crate) async fn finished(&self, conn: ConnectionId) {
        loop {
            let woken = self.finished.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if !lock(&self.finishing).contains(&conn) {
                return;
            }
            woken.await;
        }
    }

    /// Whether a client id is connected.
    pub fn is_connected(&self, vhost: &str, client: &str) -> bool {
        lock(&self.clients).contains_key(&ClientKey::new(vhost, client))
    }

    pub(crate) fn put_carry(&self, vhost: &str, client: &str, c: Carry) {
        lock(&self.carry).insert((vhost.to_string(), client.to_string()), c);
    }

    pub(crate) fn take_carry(&self, vhost: &str, client: &str) -> Carry {
        lock(&self.carry)
            .remove(&(vhost.to_string(), client.to_string()))
            .unwrap_or_default()
    }

    /// Publishes the `$SYS/broker/...` topics once, as Mosquitto does: retained (in
    /// memory only) and routed to current subscribers, at QoS 0.
    pub fn publish_sys(&self) {
        let Ok(vs) = self.vhost_state(self.broker.default_vhost()) else {
            return;
        };
        let s = &self.stats;
        let topics = [
            (
                "$SYS/broker/version",
                format!("triad {}", env!("CARGO_PKG_VERSION")),
            ),
            (
                "$SYS/broker/uptime",
                format!("{} seconds", s.started.elapsed().as_secs()),
            ),
            (
                "$SYS/broker/clients/connected",
                s.connected.load(Ordering::Relaxed).to_string(),
            ),
            (
                "$SYS/broker/messages/received",
                s.received.load(Ordering::Relaxed).to_string(),
            ),
            (
                "$SYS/broker/messages/sent",
                s.sent.load(Ordering::Relaxed).to_string(),
            ),
        ];
        for (topic, value) in topics {
            let body = Bytes::from(value);
            if let Err(e) = vs.retained.set(topic, body.clone(), 0, false) {
                tracing::debug!(error = %e, "$SYS retain failed");
            }
            let _ = vs.vhost.publish(Publish {
                exchange: "amq.topic".into(),
                routing_key: topic_to_routing_key(topic),
                mandatory: false,
                properties: Properties {
                    delivery_mode: Some(1),
                    ..Default::default()
                },
                body,
                conn: self.conn,
            });
        }
    }

    /// Publishes `$SYS` every `every` until `shutdown` (holding the state weakly).
    pub fn spawn_sys(
        self: &Arc<Self>,
        every: Duration,
        shutdown: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        let me: Weak<MqttState> = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                match me.upgrade() {
                    Some(s) => s.publish_sys(),
                    None => return,
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(every) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_sessions_with_and_without_an_owner() {
        let (owner, subs, streams) =
            decode_stored(br#"{"user":"alice","subs":{"a/#":1}}"#).unwrap();
        assert_eq!(owner.as_deref(), Some("alice"));
        assert_eq!(subs.get("a/#"), Some(&1));
        assert!(streams.is_empty());
        let (_, subs, streams) =
            decode_stored(br#"{"user":"bob","subs":{},"streams":{"$stream/first/a":1}}"#).unwrap();
        assert!(subs.is_empty());
        assert_eq!(streams.get("$stream/first/a"), Some(&1));
        // before owners were kept: the bare map
        let (owner, subs, _) = decode_stored(br#"{"x/+":2}"#).unwrap();
        assert_eq!(owner, None);
        assert_eq!(subs.get("x/+"), Some(&2));
        // a filter named "user" in an old entry is a filter, not an owner
        let (owner, subs, _) = decode_stored(br#"{"user":1}"#).unwrap();
        assert_eq!(owner, None);
        assert_eq!(subs.get("user"), Some(&1));
        assert!(decode_stored(b"[1]").is_err());
    }
}
