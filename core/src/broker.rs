//! The broker: users, vhosts, connections, and the periodic timers (TTL, `x-expires`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use triad_store::store::Store;

use crate::alarm::Alarms;
use crate::error::CoreError;
use crate::vhost::Vhost;
use crate::ResourceKind;

/// Identifies a client connection (any protocol) for exclusive queues.
pub type ConnectionId = u64;

/// A configured user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserConfig {
    /// Login name.
    pub name: String,
    /// Password.
    pub password: String,
}

/// Core settings.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    /// Users allowed to log in.
    pub users: Vec<UserConfig>,
    /// Users who may log in from loopback addresses only (RabbitMQ's `loopback_users`).
    pub loopback_users: Vec<String>,
    /// The vhost that always exists.
    pub default_vhost: String,
    /// Largest message body accepted.
    pub max_message_size: usize,
    /// Ready entries a queue keeps in memory; the rest wait in the store.
    pub queue_window: usize,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            users: vec![UserConfig {
                name: "guest".into(),
                password: "guest".into(),
            }],
            loopback_users: vec!["guest".into()],
            default_vhost: "/".into(),
            max_message_size: 16 << 20,
            queue_window: 2048,
        }
    }
}

/// An authenticated user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// Login name.
    pub name: String,
}

#[derive(Serialize, Deserialize, Default)]
struct VhostList {
    vhosts: Vec<String>,
}

const VHOSTS: &str = "vhosts";

/// The broker core.
pub struct Broker {
    store: Arc<Store>,
    cfg: CoreConfig,
    vhosts: RwLock<HashMap<String, Arc<Vhost>>>,
    next_conn: AtomicU64,
    alarms: tokio::sync::watch::Sender<Alarms>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl Broker {
    /// Loads every vhost's durable topology and queues from the store.
    pub fn open(store: Arc<Store>, cfg: CoreConfig) -> Result<Arc<Broker>, CoreError> {
        let mut list: VhostList = store.meta().get(VHOSTS)?.unwrap_or_default();
        if !list.vhosts.contains(&cfg.default_vhost) {
            list.vhosts.push(cfg.default_vhost.clone());
            store.meta().put(VHOSTS, &list)?;
        }
        let mut vhosts = HashMap::new();
        for name in &list.vhosts {
            let vh = Vhost::open(name, store.clone(), cfg.queue_window, cfg.max_message_size)?;
            vhosts.insert(name.clone(), vh);
        }
        // store queues of vhosts that no longer exist
        for q in store.queues() {
            if !vhosts.contains_key(&q.vhost) {
                store.delete_queue(q.id)?;
            }
        }
        Ok(Arc::new(Broker {
            store,
            cfg,
            vhosts: RwLock::new(vhosts),
            next_conn: AtomicU64::new(1),
            alarms: tokio::sync::watch::Sender::new(Alarms::default()),
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

    /// Checks a login. Refused logins get [`CoreError::AccessRefused`].
    pub fn authenticate(&self, user: &str, pass: &str, peer: IpAddr) -> Result<User, CoreError> {
        let ok =
            self.cfg.users.iter().any(|u| {
                u.name == user && constant_time_eq(u.password.as_bytes(), pass.as_bytes())
            });
        if !ok {
            return Err(CoreError::AccessRefused(format!(
                "login refused for user '{user}': invalid credentials"
            )));
        }
        if self.cfg.loopback_users.iter().any(|u| u == user) && !peer.is_loopback() {
            return Err(CoreError::AccessRefused(format!(
                "user '{user}' can only connect via localhost"
            )));
        }
        Ok(User {
            name: user.to_string(),
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
        )?;
        vhosts.insert(name.to_string(), vh.clone());
        let mut names: Vec<String> = vhosts.keys().cloned().collect();
        names.sort();
        self.store
            .meta()
            .put(VHOSTS, &VhostList { vhosts: names })?;
        Ok(vh)
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
        self.next_conn.fetch_add(1, Ordering::Relaxed)
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

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
