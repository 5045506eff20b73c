//! State shared by all MQTT connections of a broker: the client-id registry (session
//! takeover), per-vhost retained messages and persistent-session subscriptions, QoS 2
//! identifiers carried between connections of a persistent session, and the `$SYS`
//! counters.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use triad_core::{Broker, ConnectionId, CoreError, Properties, Publish, Vhost};
use triad_store::flush::Durable;

use crate::durable::DurableLog;
use crate::retained::RetainedStore;
use crate::session::Carry;
use crate::topic::topic_to_routing_key;

/// The queue that holds a vhost's persistent-session subscriptions.
pub const SESSIONS_QUEUE: &str = "mqtt-sessions";

/// Subscriptions of persistent sessions (clean session 0), by client id: filter →
/// granted QoS. Stored as JSON in a [`DurableLog`].
#[derive(Debug)]
pub struct SessionStore {
    map: Mutex<HashMap<String, BTreeMap<String, u8>>>,
    log: DurableLog,
}

impl SessionStore {
    fn open(vhost: Arc<Vhost>, conn: ConnectionId) -> Result<SessionStore, CoreError> {
        let (log, entries) = DurableLog::open(vhost, SESSIONS_QUEUE, conn)?;
        let mut map = HashMap::new();
        for e in entries {
            match serde_json::from_slice::<BTreeMap<String, u8>>(&e.value) {
                Ok(subs) => {
                    map.insert(e.key, subs);
                }
                Err(err) => {
                    tracing::warn!(client = e.key, error = %err, "dropping an unreadable MQTT session")
                }
            }
        }
        Ok(SessionStore {
            map: Mutex::new(map),
            log,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, BTreeMap<String, u8>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stored subscriptions of `client`.
    pub fn get(&self, client: &str) -> Option<BTreeMap<String, u8>> {
        self.lock().get(client).cloned()
    }

    /// Stores the subscriptions of `client`; completes once on disk.
    pub fn save(
        &self,
        client: &str,
        subs: &BTreeMap<String, u8>,
    ) -> Result<Option<Durable>, CoreError> {
        let json = serde_json::to_vec(subs)
            .map_err(|e| CoreError::Internal(format!("encoding a session: {e}")))?;
        let mut g = self.lock();
        let d = self.log.put(client, Bytes::from(json), 0)?;
        g.insert(client.to_string(), subs.clone());
        Ok(d)
    }

    /// Forgets `client`.
    pub fn remove(&self, client: &str) {
        let mut g = self.lock();
        if g.remove(client).is_some() {
            self.log.delete(client);
        }
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
    /// Cancelled to make the connection close (a new one took its client id).
    pub kick: CancellationToken,
    /// Cancelled by the connection once it has cleaned up.
    pub done: CancellationToken,
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
    clients: Mutex<HashMap<(String, String), LiveClient>>,
    carry: Mutex<HashMap<(String, String), Carry>>,
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
            carry: Mutex::new(HashMap::new()),
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
        Ok(vs)
    }

    /// Registers a connection under a client id; returns the one it replaces.
    pub(crate) fn register(&self, vhost: &str, client: &str, me: LiveClient) -> Option<LiveClient> {
        lock(&self.clients).insert((vhost.to_string(), client.to_string()), me)
    }

    /// Removes a connection's registration if it is still its own.
    pub(crate) fn unregister(&self, vhost: &str, client: &str, conn: ConnectionId) {
        let mut g = lock(&self.clients);
        let key = (vhost.to_string(), client.to_string());
        if g.get(&key).is_some_and(|c| c.conn == conn) {
            g.remove(&key);
        }
    }

    /// Whether a client id is connected.
    pub fn is_connected(&self, vhost: &str, client: &str) -> bool {
        lock(&self.clients).contains_key(&(vhost.to_string(), client.to_string()))
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
