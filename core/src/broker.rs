//! The broker: users, vhosts, connections, and the periodic timers (TTL, `x-expires`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use serde::{Deserialize, Serialize};
use triad_store::journal::{key_parts, KeyBuilder, MetaOp};
use triad_store::store::Store;

use crate::access::{Permission, TopicPermission, VhostAccess};
use crate::alarm::Alarms;
use crate::auth::AuthDb;
use crate::conns::Registry;
use crate::error::CoreError;
use crate::link::{Authenticated, Credentials, Link, LoginRefused, LoginStage, Peer, Protocol};
use crate::password::PasswordHash;
use crate::throttle::LoginThrottle;
use crate::vhost::Vhost;
use crate::ResourceKind;

/// Identifies a client connection (any protocol) for exclusive queues.
pub type ConnectionId = u64;

/// A configured user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserConfig {
    /// Login name.
    pub name: String,
    /// Salted hash of the password (never the password itself).
    pub password_hash: PasswordHash,
    /// Free-form tags (`administrator`, `monitoring`, ...), as RabbitMQ's.
    pub tags: Vec<String>,
}

impl UserConfig {
    /// A user whose password is hashed here (the default user's, from the config).
    pub fn with_password(name: &str, password: &str) -> UserConfig {
        UserConfig {
            name: name.to_owned(),
            password_hash: PasswordHash::new(password)
                .unwrap_or_else(|_| PasswordHash::with_salt(fallback_salt(), password)),
            tags: Vec::new(),
        }
    }
}

/// A salt when the system's random generator fails (it does not on Linux): still
/// different per process, so equal passwords do not give equal hashes across runs.
fn fallback_salt() -> [u8; 4] {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(u64::from(std::process::id()));
    let v = h.finish().to_le_bytes();
    [v[0], v[1], v[2], v[3]]
}

/// Core settings.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Users allowed to log in.
    pub users: Vec<UserConfig>,
    /// Users who may log in from loopback addresses only (RabbitMQ's `loopback_users`).
    pub loopback_users: Vec<String>,
    /// What each user may do in each vhost; a user with no entry for a vhost cannot
    /// open it.
    pub permissions: Vec<Permission>,
    /// Routing-key patterns per user, vhost and topic exchange.
    pub topic_permissions: Vec<TopicPermission>,
    /// The vhost that always exists.
    pub default_vhost: String,
    /// More vhosts created at startup (idempotent).
    pub vhosts: Vec<String>,
    /// Open connections per user over all protocols; 0 = unlimited.
    pub max_connections_per_user: u32,
    /// Per-user limits (RabbitMQ's `rabbitmqctl set_user_limits`), by user name; a
    /// user's `max_connections` overrides `max_connections_per_user`.
    pub user_limits: HashMap<String, UserLimits>,
    /// Queues per vhost; 0 = unlimited. A declare past it is
    /// [`CoreError::PreconditionFailed`] (RabbitMQ's vhost `max-queues`).
    pub max_queues_per_vhost: usize,
    /// Largest message body accepted (default 128 MiB, RabbitMQ's).
    pub max_message_size: usize,
    /// Ready entries a queue keeps in memory; the rest wait in the store.
    pub queue_window: usize,
    /// The configuration's default user and its plaintext password, whose hash is made
    /// with a fresh salt at each start: [`crate::auth::AuthDb`] checks whether the
    /// password it seeded last time still verifies, to tell whether the file changed.
    pub default_password: Option<(String, String)>,
    /// Half messages' check-back ([`crate::txn`]).
    pub txn: crate::txn::TxnConfig,
    /// What expiry decisions read the time from (TTL, `x-expires`, retry back-off,
    /// delays, check-backs, stream age): the system clock but in tests.
    pub clock: crate::Clock,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            users: vec![UserConfig::with_password("guest", "guest")],
            loopback_users: vec!["guest".into()],
            permissions: vec![Permission::full("guest", "/")],
            topic_permissions: Vec::new(),
            default_vhost: "/".into(),
            vhosts: Vec::new(),
            max_connections_per_user: 0,
            user_limits: HashMap::new(),
            max_queues_per_vhost: 0,
            max_message_size: 128 << 20,
            queue_window: 2048,
            default_password: None,
            txn: crate::txn::TxnConfig::default(),
            clock: crate::Clock::system(),
        }
    }
}

/// One user's limits (RabbitMQ's user limits). `None`: not set. [`UserLimits::UNLIMITED`]
/// lifts a limit (RabbitMQ's negative value); 0 refuses every connection or channel,
/// as RabbitMQ.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UserLimits {
    /// Connections open at once over all protocols (`max-connections`); overrides
    /// `max_connections_per_user`.
    pub max_connections: Option<u32>,
    /// Channels open at once over all the user's connections (`max-channels`): AMQP
    /// channels, and one per STOMP or MQTT connection (as RabbitMQ counts the channel
    /// its STOMP and MQTT plugins open per connection).
    pub max_channels: Option<u32>,
}

impl UserLimits {
    /// No limit.
    pub const UNLIMITED: u32 = u32::MAX;

    fn limit(v: Option<u32>) -> Option<u32> {
        v.filter(|n| *n != Self::UNLIMITED)
    }
}

/// Open connections and channels per user, and the per-user limits: shared by the
/// broker and every [`ConnectionSlot`] / [`ChannelSlot`]. Channels are counted only for
/// users with a `max_channels` limit.
#[derive(Debug, Default)]
struct UserCounts {
    conns: Mutex<HashMap<String, u32>>,
    channels: Mutex<HashMap<String, u32>>,
    /// In force: the configuration's, then the management API's changes
    /// ([`crate::user_limits`]).
    limits: std::sync::RwLock<HashMap<String, UserLimits>>,
    /// Held by a change of limits across its journal write, so that changes go one at a
    /// time while logins and channel opens (which read `limits`) never wait for the disk.
    changing: std::sync::Mutex<()>,
}

impl UserCounts {
    /// Counts a channel of `user` against its `max_channels`; `Ok(false)` when the
    /// user has no such limit (nothing counted).
    fn take_channel(&self, user: &str) -> Result<bool, CoreError> {
        let Some(max) = self
            .limits
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(user)
            .and_then(|l| UserLimits::limit(l.max_channels))
        else {
            return Ok(false);
        };
        let mut g = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        let n = g.entry(user.to_string()).or_insert(0);
        if *n >= max {
            if *n == 0 {
                g.remove(user);
            }
            drop(g);
            tracing::info!(user, max, "channel limit reached for user");
            return Err(CoreError::NotAllowed(format!(
                "number of channels opened for user '{user}' has reached the maximum allowed user limit of ({max})"
            )));
        }
        *n += 1;
        Ok(true)
    }

    fn give_channel(&self, user: &str) {
        let mut g = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = g.get_mut(user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                g.remove(user);
            }
        }
    }
}

/// An AMQP channel counted against its user's `max_channels`; dropping it gives the
/// slot back.
#[derive(Debug)]
pub struct ChannelSlot {
    user: Box<str>,
    counts: Arc<UserCounts>,
}

impl Drop for ChannelSlot {
    fn drop(&mut self) {
        self.counts.give_channel(&self.user);
    }
}

/// An authenticated user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
    /// Its tags.
    pub tags: Vec<String>,
}

/// The vhost list as an earlier version kept it (one document); moved into the journal.
#[derive(Serialize, Deserialize, Default)]
struct VhostList {
    vhosts: Vec<String>,
}

const LEGACY_VHOSTS: &str = "vhosts";
/// Journal key tag of a vhost (`V` + its name); the value is empty.
const TAG_VHOST: u8 = b'V';

fn vhost_key(name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_VHOST).part(name.as_bytes()).build()
}

/// The vhosts in the journal (importing an earlier version's list the first time).
fn stored_vhosts(store: &Store) -> Result<Vec<String>, CoreError> {
    if let Some(legacy) = store.meta().get::<VhostList>(LEGACY_VHOSTS)? {
        let ops = legacy
            .vhosts
            .iter()
            .map(|v| MetaOp::put(vhost_key(v), Vec::new()))
            .collect();
        store.journal().commit(ops)?;
        store.meta().delete(LEGACY_VHOSTS)?;
    }
    Ok(store
        .journal()
        .scan(&[TAG_VHOST])?
        .into_iter()
        .filter_map(|(k, _)| {
            let parts = k.get(1..).and_then(key_parts)?;
            let [name] = parts.as_slice() else {
                return None;
            };
            Some(String::from_utf8_lossy(name).into_owned())
        })
        .collect())
}

/// The broker core.
pub struct Broker {
    store: Arc<Store>,
    cfg: CoreConfig,
    vhosts: RwLock<HashMap<String, Arc<Vhost>>>,
    next_conn: AtomicU64,
    alarms: tokio::sync::watch::Sender<Alarms>,
    /// Users and rights, changed at run time and persisted in the journal.
    auth: AuthDb,
    /// Open client connections (the management API's `/api/connections`).
    conns: Arc<Registry>,
    /// Open connections (and limited users' channels) per user, and the user limits.
    user_conns: Arc<UserCounts>,
    /// Failed logins per source address and user name.
    logins: LoginThrottle,
}

/// A connection counted against its user's connection limit (and, for STOMP and MQTT,
/// its channel limit); dropping it gives the slots back. Adapters keep it as long as
/// the connection is open.
#[derive(Debug)]
pub struct ConnectionSlot {
    user: Box<str>,
    counts: Arc<UserCounts>,
    /// Holds one of the user's channels (a STOMP or MQTT connection of a user with
    /// `max_channels`).
    channel: bool,
}

impl ConnectionSlot {
    /// The user's name.
    pub fn user(&self) -> &str {
        &self.user
    }

    /// Counts an AMQP channel against the user's `max_channels` (checked before the
    /// channel is made); `None` when the user has no channel limit.
    pub fn open_channel(&self) -> Result<Option<ChannelSlot>, CoreError> {
        Ok(self.counts.take_channel(&self.user)?.then(|| ChannelSlot {
            user: self.user.clone(),
            counts: Arc::clone(&self.counts),
        }))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        if self.channel {
            self.counts.give_channel(&self.user);
        }
        let mut counts = self.counts.conns.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = counts.get_mut(&*self.user) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&*self.user);
            }
        }
    }
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl Broker {
    /// Loads every vhost's durable topology and queues from the store.
    pub fn open(store: Arc<Store>, cfg: CoreConfig) -> Result<Arc<Broker>, CoreError> {
        let mut list = stored_vhosts(&store)?;
        let mut added = Vec::new();
        for name in std::iter::once(&cfg.default_vhost).chain(&cfg.vhosts) {
            if !list.contains(name) {
                list.push(name.clone());
                added.push(MetaOp::put(vhost_key(name), Vec::new()));
            }
        }
        store.journal().commit(added)?;
        let auth = AuthDb::open(Arc::clone(&store), &cfg)?;
        let mut vhosts = HashMap::new();
        for name in &list {
            let vh = Vhost::open(
                name,
                store.clone(),
                cfg.queue_window,
                cfg.max_message_size,
                cfg.max_queues_per_vhost,
                cfg.txn,
                cfg.clock.clone(),
            )?;
            vhosts.insert(name.clone(), vh);
        }
        // store queues of vhosts that no longer exist
        for q in store.queues() {
            if !vhosts.contains_key(&q.vhost) {
                store.delete_queue(q.id)?;
            }
        }
        // read while the journal's state is still in memory (after, each read would go
        // back to its files)
        let user_conns = Arc::new(UserCounts {
            limits: std::sync::RwLock::new(crate::user_limits::load(&store, &cfg.user_limits)?),
            ..UserCounts::default()
        });
        // every entity is loaded: the journal's copy of the metadata is not needed in
        // memory any more (a vhost added later reads it back from the files)
        store.journal().release_state();
        Ok(Arc::new(Broker {
            store,
            cfg,
            vhosts: RwLock::new(vhosts),
            next_conn: AtomicU64::new(1),
            alarms: tokio::sync::watch::Sender::new(Alarms::default()),
            auth,
            conns: Arc::new(Registry::default()),
            user_conns,
            logins: LoginThrottle::default(),
        }))
    }

    /// The store underneath.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The settings.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Checks a login by password. An unknown user or a wrong password is
    /// [`CoreError::AccessRefused`]; a right password from a peer the user may not
    /// log in from (`loopback_users`) is [`CoreError::NotAllowed`], so that MQTT can
    /// answer 4 (bad user name or password) and 5 (not authorised) apart.
    ///
    /// While `peer` or `user` has too many failed logins waiting for their answer
    /// ([`crate::throttle`]), the attempt is refused the same way without the password
    /// being checked.
    pub fn authenticate(&self, user: &str, pass: &str, peer: IpAddr) -> Result<User, CoreError> {
        if !self.logins.admits(peer, user) {
            tracing::info!(%peer, user, "login attempt throttled: too many failed logins from this address or for this user");
            return Err(CoreError::AccessRefused(format!(
                "login refused for user '{user}': invalid credentials"
            )));
        }
        let found = self.auth.user(user);
        // An unknown user costs the same hash as a known one: no timing oracle for
        // which user names exist.
        let ok = match &found {
            Some(u) => u.password_hash.verify(pass),
            None => {
                let _ = std::hint::black_box(PasswordHash::with_salt([0; 4], pass));
                false
            }
        };
        match found {
            Some(u) if ok => self.admit(&u, peer),
            _ => Err(CoreError::AccessRefused(format!(
                "login refused for user '{user}': invalid credentials"
            ))),
        }
    }

    /// Logs a connection in and opens `vhost` for it: the credentials, then the user's
    /// permissions in the vhost, then a free connection slot. Every refusal is counted
    /// by the failed-login throttle, whichever step made it (a refusal made once the
    /// password was accepted must look like a bad password: same delay).
    pub fn login(
        &self,
        credentials: Credentials<'_>,
        peer: Peer,
        vhost: &str,
        proto: Protocol,
    ) -> Result<Link, LoginRefused> {
        let auth = self.check_credentials(credentials, peer)?;
        self.link(auth, vhost, proto)
            .map_err(|(stage, reason)| LoginRefused {
                reason,
                stage,
                hold: self.logins.failed(
                    peer.addr,
                    credentials.throttle_name(),
                    peer.failed_login_delay,
                ),
            })
    }

    /// The first half of [`Broker::login`], for a protocol that names the vhost later
    /// (AMQP's `connection.open`): checks the credentials only. A refusal is counted
    /// by the failed-login throttle.
    pub fn check_credentials(
        &self,
        credentials: Credentials<'_>,
        peer: Peer,
    ) -> Result<Authenticated, LoginRefused> {
        let checked = match credentials {
            Credentials::Password { user, password } => {
                self.authenticate(user, password, peer.addr)
            }
            Credentials::Certificate { user } => self.authenticate_external(user, peer.addr),
            Credentials::Anonymous { user: Some(user) } => {
                self.authenticate_anonymous(user, peer.addr)
            }
            Credentials::Anonymous { user: None } => Err(CoreError::AccessRefused(
                "anonymous login is not accepted from this peer".into(),
            )),
        };
        checked
            .map(|user| Authenticated {
                user,
                conn: peer.conn,
            })
            .map_err(|reason| LoginRefused {
                reason,
                stage: LoginStage::Credentials,
                hold: self.logins.failed(
                    peer.addr,
                    credentials.throttle_name(),
                    peer.failed_login_delay,
                ),
            })
    }

    /// The second half of [`Broker::login`]: opens `vhost` for a user whose
    /// credentials were accepted. [`CoreError::NotAllowed`] when the vhost does not
    /// exist, the user has no permissions in it, or is at its connection limit (AMQP
    /// 530 on `connection.open`); not counted as a failed login.
    pub fn open_link(
        &self,
        auth: Authenticated,
        vhost: &str,
        proto: Protocol,
    ) -> Result<Link, CoreError> {
        self.link(auth, vhost, proto).map_err(|(_, e)| e)
    }

    fn link(
        &self,
        auth: Authenticated,
        vhost: &str,
        proto: Protocol,
    ) -> Result<Link, (LoginStage, CoreError)> {
        let Authenticated { user, conn } = auth;
        let access = self
            .vhost_access(&user, vhost)
            .map_err(|e| (LoginStage::Vhost, e))?;
        let vh = self.vhost(vhost).map_err(|e| (LoginStage::Vhost, e))?;
        let slot = self
            .connection_slot(&user, proto)
            .map_err(|e| (LoginStage::ConnectionLimit, e))?;
        Ok(Link::new(vh, access, conn, proto, slot))
    }

    /// Logs a user in whose identity a verified TLS client certificate proves
    /// (SASL EXTERNAL, STOMP / MQTT `ssl_cert_login`): the user must exist; no password.
    pub(crate) fn authenticate_external(
        &self,
        user: &str,
        peer: IpAddr,
    ) -> Result<User, CoreError> {
        match self.auth.user(user) {
            Some(u) => self.admit(&u, peer),
            None => Err(CoreError::AccessRefused(format!(
                "login refused for certificate user '{user}': no such user"
            ))),
        }
    }

    /// An anonymous login (STOMP CONNECT without `login`, MQTT CONNECT without a user
    /// name) as `user`, which the shell chose by its `auth.anonymous` policy: the user
    /// must exist; no password is asked for, so none is checked (nor needs configuring).
    pub(crate) fn authenticate_anonymous(
        &self,
        user: &str,
        peer: IpAddr,
    ) -> Result<User, CoreError> {
        match self.auth.user(user) {
            Some(u) => self.admit(&u, peer),
            None => Err(CoreError::AccessRefused(format!(
                "anonymous login refused: no user '{user}'"
            ))),
        }
    }

    fn admit(&self, u: &UserConfig, peer: IpAddr) -> Result<User, CoreError> {
        if self.cfg.loopback_users.contains(&u.name) && !peer.is_loopback() {
            return Err(CoreError::NotAllowed(format!(
                "user '{}' can only connect via localhost",
                u.name
            )));
        }
        crate::conns::note_user(&u.name);
        Ok(User {
            name: u.name.clone(),
            tags: u.tags.clone(),
        })
    }

    /// Opening `vhost` as `user`: its rights there, or [`CoreError::NotAllowed`] when
    /// the vhost does not exist or the user has no permissions in it (AMQP 530 on
    /// connection.open, STOMP ERROR, MQTT CONNACK 5).
    pub(crate) fn vhost_access(
        &self,
        user: &User,
        vhost: &str,
    ) -> Result<Arc<VhostAccess>, CoreError> {
        let refused = || {
            tracing::info!(user = %user.name, vhost, "vhost access refused");
            CoreError::NotAllowed(format!(
                "access to vhost '{vhost}' refused for user '{}'",
                user.name
            ))
        };
        if !self.has_vhost(vhost) {
            return Err(refused());
        }
        let access = self.auth.access(&user.name, vhost).ok_or_else(refused)?;
        crate::conns::note_vhost(&user.name, vhost);
        Ok(access)
    }

    /// Counts a new connection of `user` against its connection limit (its
    /// `max_connections`, else `max_connections_per_user`) and, for STOMP and MQTT,
    /// one channel against its `max_channels`; [`CoreError::NotAllowed`] with
    /// RabbitMQ's text when the user is at a limit. O(1): two map lookups under short
    /// locks, before anything is allocated for the connection.
    pub(crate) fn connection_slot(
        &self,
        user: &User,
        proto: Protocol,
    ) -> Result<ConnectionSlot, CoreError> {
        let uc = &self.user_conns;
        let own = uc
            .limits
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&user.name)
            .copied()
            .unwrap_or_default();
        let max = match own.max_connections {
            Some(n) => UserLimits::limit(Some(n)),
            None => Some(self.cfg.max_connections_per_user).filter(|n| *n > 0),
        };
        let mut counts = uc.conns.lock().unwrap_or_else(|e| e.into_inner());
        let open = counts.get(&user.name).copied().unwrap_or(0);
        if let Some(max) = max.filter(|m| open >= *m) {
            drop(counts);
            tracing::info!(user = %user.name, open, max, "connection limit reached for user");
            return Err(CoreError::NotAllowed(format!(
                "connection refused for user '{}': user connection limit ({max}) is reached",
                user.name
            )));
        }
        // a STOMP or MQTT connection is one channel (RabbitMQ's plugins open one each)
        let channel = proto != Protocol::Amqp && uc.take_channel(&user.name)?;
        *counts.entry(user.name.clone()).or_insert(0) += 1;
        Ok(ConnectionSlot {
            user: Box::from(user.name.as_str()),
            counts: Arc::clone(uc),
            channel,
        })
    }

    /// The default vhost's name.
    pub fn default_vhost(&self) -> &str {
        &self.cfg.default_vhost
    }

    /// A vhost by name.
    pub fn vhost(&self, name: &str) -> Result<Arc<Vhost>, CoreError> {
        self.vhosts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
            .ok_or_else(|| CoreError::NotFound {
                kind: ResourceKind::Vhost,
                name: name.to_string(),
            })
    }

    /// Whether a vhost exists.
    pub fn has_vhost(&self, name: &str) -> bool {
        self.vhosts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name)
    }

    /// Creates a vhost (idempotent).
    pub fn add_vhost(&self, name: &str) -> Result<Arc<Vhost>, CoreError> {
        let mut vhosts = self.vhosts.write().unwrap_or_else(|e| e.into_inner());
        if let Some(v) = vhosts.get(name) {
            return Ok(v.clone());
        }
        let vh = Vhost::open(
            name,
            self.store.clone(),
            self.cfg.queue_window,
            self.cfg.max_message_size,
            self.cfg.max_queues_per_vhost,
            self.cfg.txn,
            self.cfg.clock.clone(),
        )?;
        self.store
            .journal()
            .commit(vec![MetaOp::put(vhost_key(name), Vec::new())])?;
        vhosts.insert(name.to_string(), vh.clone());
        Ok(vh)
    }

    /// Deletes a vhost with everything in it and every permission for it; the
    /// connections that opened it are closed. `false` when there was no such vhost.
    pub fn delete_vhost(&self, name: &str) -> Result<bool, CoreError> {
        let Some(vh) = self
            .vhosts
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name)
        else {
            return Ok(false);
        };
        self.store
            .journal()
            .commit(vec![MetaOp::delete(vhost_key(name))])?;
        vh.delete_everything()?;
        self.auth.vhost_deleted(name)?;
        for c in self.conns.list() {
            if c.login().and_then(|l| l.vhost).as_deref() == Some(name) {
                c.close();
            }
        }
        Ok(true)
    }

    /// Every vhost's name, sorted.
    pub fn vhost_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .vhosts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .cloned()
            .collect();
        v.sort_unstable();
        v
    }

    /// Watches the resource alarms (adapters block publishers while any is raised).
    pub fn alarms(&self) -> tokio::sync::watch::Receiver<Alarms> {
        self.alarms.subscribe()
    }

    /// The alarms now.
    pub fn current_alarms(&self) -> Alarms {
        *self.alarms.borrow()
    }

    /// Raises or clears alarms (the broker process's resource monitor).
    pub fn set_alarms(&self, alarms: Alarms) {
        let changed = self.alarms.send_if_modified(|a| {
            let changed = *a != alarms;
            *a = alarms;
            changed
        });
        if changed {
            match alarms.reason() {
                Some(r) => tracing::warn!(reason = r, "resource alarm raised: blocking publishers"),
                None => tracing::info!("resource alarms cleared: publishers unblocked"),
            }
        }
    }

    /// A fresh connection id.
    pub fn next_connection_id(&self) -> ConnectionId {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        crate::conns::note_core_id(id);
        id
    }

    /// Users and rights (the management API changes them at run time).
    pub fn auth(&self) -> &AuthDb {
        &self.auth
    }

    /// Open client connections.
    pub fn connections(&self) -> &Arc<Registry> {
        &self.conns
    }

    /// Every user's limits in force (RabbitMQ's user limits), by user name.
    pub fn user_limits(&self) -> Vec<(String, UserLimits)> {
        let mut v: Vec<(String, UserLimits)> = self
            .user_conns
            .limits
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(u, l)| (u.clone(), *l))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Sets (`Some`) or clears (`None`) one limit of `user`, by RabbitMQ's name
    /// (`max-connections`, `max-channels`), persisted before it returns. It applies to
    /// connections and channels opened from now on (as RabbitMQ: open ones stay).
    /// Returns whether that limit was set before.
    pub fn set_user_limit(
        &self,
        user: &str,
        name: &str,
        value: Option<u32>,
    ) -> Result<bool, CoreError> {
        Ok(self
            .set_user_limits(user, &[(name, value)])?
            .first()
            .copied()
            .unwrap_or(false))
    }

    /// [`Self::set_user_limit`] for several limits of `user` at once, in one journal
    /// record. Returns, for each, whether it was set before.
    pub fn set_user_limits(
        &self,
        user: &str,
        changes: &[(&str, Option<u32>)],
    ) -> Result<Vec<bool>, CoreError> {
        let _one = self
            .user_conns
            .changing
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut l = self.user_limits_of(user);
        let mut was = Vec::with_capacity(changes.len());
        for (name, value) in changes {
            let slot = match *name {
                crate::user_limits::MAX_CONNECTIONS => &mut l.max_connections,
                crate::user_limits::MAX_CHANNELS => &mut l.max_channels,
                other => {
                    return Err(CoreError::PreconditionFailed(format!(
                        "unknown user limit '{other}': max-connections or max-channels"
                    )))
                }
            };
            was.push(slot.is_some());
            *slot = *value;
        }
        self.put_user_limits(user, l)?;
        Ok(was)
    }

    /// A user was deleted: its limits go with it (as in RabbitMQ, where they are part of
    /// the user), so a user made later under the same name starts without them.
    pub fn clear_user_limits(&self, user: &str) -> Result<(), CoreError> {
        let _one = self
            .user_conns
            .changing
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if self.user_limits_of(user) != UserLimits::default() {
            self.put_user_limits(user, UserLimits::default())?;
        }
        Ok(())
    }

    fn user_limits_of(&self, user: &str) -> UserLimits {
        self.user_conns
            .limits
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(user)
            .copied()
            .unwrap_or_default()
    }

    /// Journals `user`'s limits (waiting for the disk), then puts them in force. The
    /// caller holds `changing`.
    fn put_user_limits(&self, user: &str, l: UserLimits) -> Result<(), CoreError> {
        crate::user_limits::store(&self.store, user, &l)?;
        let mut all = self
            .user_conns
            .limits
            .write()
            .unwrap_or_else(|e| e.into_inner());
        if l == UserLimits::default() {
            all.remove(user);
        } else {
            all.insert(user.to_string(), l);
        }
        Ok(())
    }

    /// A connection closed: its exclusive queues go.
    pub fn connection_closed(&self, conn: ConnectionId) {
        for vh in self.all_vhosts() {
            vh.connection_closed(conn);
        }
    }

    fn all_vhosts(&self) -> Vec<Arc<Vhost>> {
        self.vhosts
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// Periodic work: message TTL at queue heads and `x-expires`. Call every ~100 ms
    /// to 1 s (the binary runs it on an interval).
    pub fn tick(&self) {
        for vh in self.all_vhosts() {
            vh.tick();
        }
    }
}
