//! Users, permissions and topic permissions that change at run time (the management
//! API) and survive a restart: each change is one record in the metadata journal.
//!
//! Journal keys (see `triad_store::journal`):
//!
//! | key | value |
//! |---|---|
//! | `U` + user | JSON `{"password_hash", "tags"}` |
//! | `P` + user + vhost | JSON `{"configure", "write", "read"}` |
//! | `T` + user + vhost + exchange | JSON `{"write", "read"}` |
//! | `s` + kind byte + the entity's key parts | the configuration entry last seeded |
//!
//! **Seeding from the configuration file.** At every start each user and permission the
//! configuration names is compared with the copy of it seeded last time (`s` keys): when
//! the configuration entry is new or changed since then it is written (so editing the
//! file still takes effect); when it is what was seeded before, the journal's current
//! state wins, so a password changed or a user deleted through the API stays so. A data
//! directory from before this journal has no `s` keys: the configuration seeds it.
//!
//! Memory: one entry per user and per (user, vhost) permission, each with the compiled
//! patterns of [`VhostAccess`]; lookups at login are one hash-map probe under a read
//! lock. Not on any message path.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use serde::{Deserialize, Serialize};
use triad_store::journal::{key_parts, KeyBuilder, MetaJournal, MetaOp};
use triad_store::store::Store;

use crate::access::{Pattern, Permission, TopicPermission, VhostAccess};
use crate::broker::{CoreConfig, UserConfig};
use crate::error::CoreError;
use crate::password::PasswordHash;

const TAG_USER: u8 = b'U';
const TAG_PERMISSION: u8 = b'P';
const TAG_TOPIC: u8 = b'T';
const TAG_SEED: u8 = b's';

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug, Clone)]
struct UserRecord {
    password_hash: String,
    #[serde(default)]
    tags: Vec<String>,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug, Clone)]
struct PermRecord {
    configure: String,
    write: String,
    read: String,
}

#[derive(Serialize, Deserialize, PartialEq, Eq, Debug, Clone)]
struct TopicRecord {
    write: String,
    read: String,
}

fn user_key(name: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_USER).part(name.as_bytes()).build()
}

fn perm_key(user: &str, vhost: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_PERMISSION)
        .part(user.as_bytes())
        .part(vhost.as_bytes())
        .build()
}

fn topic_key(user: &str, vhost: &str, exchange: &str) -> Vec<u8> {
    KeyBuilder::new(TAG_TOPIC)
        .part(user.as_bytes())
        .part(vhost.as_bytes())
        .part(exchange.as_bytes())
        .build()
}

fn seed_key(entity_key: &[u8]) -> Vec<u8> {
    let mut k = vec![TAG_SEED];
    k.extend_from_slice(entity_key);
    k
}

fn json<T: Serialize>(v: &T) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

fn no_user(name: &str) -> CoreError {
    CoreError::PreconditionFailed(format!("no_such_user: '{name}'"))
}

fn corrupt(what: &str) -> CoreError {
    CoreError::Internal(format!("malformed {what} record in the metadata journal"))
}

/// A user as listed (never the password itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserEntry {
    /// Name.
    pub name: String,
    /// RabbitMQ's base64 salted SHA-256 hash.
    pub password_hash: String,
    /// Tags.
    pub tags: Vec<String>,
}

/// A permission as listed: the three patterns' sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionEntry {
    /// User.
    pub user: String,
    /// Vhost.
    pub vhost: String,
    /// Configure pattern.
    pub configure: String,
    /// Write pattern.
    pub write: String,
    /// Read pattern.
    pub read: String,
}

/// A topic permission as listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicPermissionEntry {
    /// User.
    pub user: String,
    /// Vhost.
    pub vhost: String,
    /// Topic exchange.
    pub exchange: String,
    /// Publish pattern source.
    pub write: String,
    /// Bind pattern source.
    pub read: String,
}

#[derive(Default)]
struct State {
    users: BTreeMap<String, UserConfig>,
    perms: BTreeMap<(String, String), PermRecord>,
    topics: BTreeMap<(String, String, String), TopicRecord>,
    /// Compiled rights per (user, vhost), rebuilt for the pair a change touches.
    access: std::collections::HashMap<(String, String), Arc<VhostAccess>>,
}

impl State {
    fn compile(&mut self, user: &str, vhost: &str) -> Result<(), CoreError> {
        let k = (user.to_owned(), vhost.to_owned());
        let Some(p) = self.perms.get(&k) else {
            self.access.remove(&k);
            return Ok(());
        };
        let pat = |s: &str| {
            Pattern::new(s).map_err(|e| {
                CoreError::PreconditionFailed(format!("invalid pattern '{s}': {}", e.reason))
            })
        };
        let perm = Permission {
            user: user.to_owned(),
            vhost: vhost.to_owned(),
            configure: pat(&p.configure)?,
            write: pat(&p.write)?,
            read: pat(&p.read)?,
        };
        let mut topics = Vec::new();
        for ((u, v, x), t) in self
            .topics
            .range((user.to_owned(), vhost.to_owned(), String::new())..)
        {
            if u != user || v != vhost {
                break;
            }
            let tp = |s: &str| {
                TopicPermission::pattern(s, user, vhost).map_err(|e| {
                    CoreError::PreconditionFailed(format!(
                        "invalid topic pattern '{s}': {}",
                        e.reason
                    ))
                })
            };
            topics.push(TopicPermission {
                user: user.to_owned(),
                vhost: vhost.to_owned(),
                exchange: x.clone(),
                write: tp(&t.write)?,
                read: tp(&t.read)?,
            });
        }
        self.access
            .insert(k, Arc::new(VhostAccess::new(perm).with_topics(&topics)));
        Ok(())
    }
}

/// The broker's users and rights, persisted in the metadata journal.
pub struct AuthDb {
    store: Arc<Store>,
    state: RwLock<State>,
}

impl std::fmt::Debug for AuthDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthDb").finish_non_exhaustive()
    }
}

/// Whether a configuration entry changed since it was last seeded.
fn seed_changed(seeds: &BTreeMap<Vec<u8>, Vec<u8>>, key: &[u8], now: &[u8]) -> bool {
    seeds.get(&seed_key(key)).map(Vec::as_slice) != Some(now)
}

/// The journal writes that seed what the configuration names and changed since the last
/// start: each entry and its seed record (what was seeded, to compare with next time).
fn seed_ops(seeds: &BTreeMap<Vec<u8>, Vec<u8>>, cfg: &CoreConfig) -> Vec<MetaOp> {
    let mut ops = Vec::new();
    for u in &cfg.users {
        let key = user_key(&u.name);
        let rec = UserRecord {
            password_hash: u.password_hash.to_base64(),
            tags: u.tags.clone(),
        };
        // The default user's hash is made at each start with a fresh salt: what is
        // compared for it is whether the password seeded last time still verifies.
        let seeded_same = match (&cfg.default_password, seeds.get(&seed_key(&key))) {
            (Some((name, pass)), Some(prev)) if name == &u.name => {
                serde_json::from_slice::<UserRecord>(prev).is_ok_and(|p| {
                    p.tags == u.tags
                        && PasswordHash::parse(&p.password_hash).is_ok_and(|h| h.verify(pass))
                })
            }
            _ => !seed_changed(seeds, &key, &json(&rec)),
        };
        if !seeded_same {
            ops.push(MetaOp::put(key.clone(), json(&rec)));
            ops.push(MetaOp::put(seed_key(&key), json(&rec)));
        }
    }
    for p in &cfg.permissions {
        let key = perm_key(&p.user, &p.vhost);
        let rec = PermRecord {
            configure: p.configure.as_str().to_owned(),
            write: p.write.as_str().to_owned(),
            read: p.read.as_str().to_owned(),
        };
        let v = json(&rec);
        if seed_changed(seeds, &key, &v) {
            ops.push(MetaOp::put(key.clone(), v.clone()));
            ops.push(MetaOp::put(seed_key(&key), v));
        }
    }
    for t in &cfg.topic_permissions {
        let key = topic_key(&t.user, &t.vhost, &t.exchange);
        let rec = TopicRecord {
            write: t.write.as_str().to_owned(),
            read: t.read.as_str().to_owned(),
        };
        let v = json(&rec);
        if seed_changed(seeds, &key, &v) {
            ops.push(MetaOp::put(key.clone(), v.clone()));
            ops.push(MetaOp::put(seed_key(&key), v));
        }
    }
    ops
}

/// Reads the journal's users into `st`.
fn load_users(j: &MetaJournal, st: &mut State) -> Result<(), CoreError> {
    for (k, v) in j.scan(&[TAG_USER])? {
        let parts = k
            .get(1..)
            .and_then(key_parts)
            .ok_or_else(|| corrupt("user"))?;
        let [name] = parts.as_slice() else {
            return Err(corrupt("user"));
        };
        let name = String::from_utf8_lossy(name).into_owned();
        let rec: UserRecord = serde_json::from_slice(&v).map_err(|_| corrupt("user"))?;
        let hash = PasswordHash::parse(&rec.password_hash).map_err(|_| corrupt("user"))?;
        st.users.insert(
            name.clone(),
            UserConfig {
                name,
                password_hash: hash,
                tags: rec.tags,
            },
        );
    }
    Ok(())
}

/// Reads the journal's vhost permissions into `st` (compiled afterwards).
fn load_permissions(j: &MetaJournal, st: &mut State) -> Result<(), CoreError> {
    for (k, v) in j.scan(&[TAG_PERMISSION])? {
        let parts = k
            .get(1..)
            .and_then(key_parts)
            .ok_or_else(|| corrupt("permission"))?;
        let [user, vhost] = parts.as_slice() else {
            return Err(corrupt("permission"));
        };
        let rec: PermRecord = serde_json::from_slice(&v).map_err(|_| corrupt("permission"))?;
        st.perms.insert(
            (
                String::from_utf8_lossy(user).into_owned(),
                String::from_utf8_lossy(vhost).into_owned(),
            ),
            rec,
        );
    }
    Ok(())
}

/// Reads the journal's topic permissions into `st`.
fn load_topic_permissions(j: &MetaJournal, st: &mut State) -> Result<(), CoreError> {
    for (k, v) in j.scan(&[TAG_TOPIC])? {
        let parts = k
            .get(1..)
            .and_then(key_parts)
            .ok_or_else(|| corrupt("topic permission"))?;
        let [user, vhost, exchange] = parts.as_slice() else {
            return Err(corrupt("topic permission"));
        };
        let rec: TopicRecord =
            serde_json::from_slice(&v).map_err(|_| corrupt("topic permission"))?;
        let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        st.topics.insert((s(user), s(vhost), s(exchange)), rec);
    }
    Ok(())
}

impl AuthDb {
    /// Loads the journal's users and rights, seeding what the configuration names and
    /// changed since the last start (see the module docs). Call before the journal's
    /// start-up state is released.
    pub fn open(store: Arc<Store>, cfg: &CoreConfig) -> Result<AuthDb, CoreError> {
        let j = store.journal();
        let seeds: BTreeMap<Vec<u8>, Vec<u8>> = j.scan(&[TAG_SEED])?.into_iter().collect();
        j.commit(seed_ops(&seeds, cfg))?;

        let mut st = State::default();
        load_users(j, &mut st)?;
        load_permissions(j, &mut st)?;
        load_topic_permissions(j, &mut st)?;
        let pairs: Vec<(String, String)> = st.perms.keys().cloned().collect();
        for (u, v) in pairs {
            st.compile(&u, &v)?;
        }
        Ok(AuthDb {
            store,
            state: RwLock::new(st),
        })
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Journals `ops` and waits until they are on disk (the caller holds the write
    /// lock, so changes reach the journal in the order they are applied).
    fn commit(&self, ops: Vec<MetaOp>) -> Result<(), CoreError> {
        self.store.journal().commit(ops)?;
        Ok(())
    }

    /// A user by name.
    pub fn user(&self, name: &str) -> Option<UserConfig> {
        self.read().users.get(name).cloned()
    }

    /// Every user, by name.
    pub fn users(&self) -> Vec<UserEntry> {
        self.read()
            .users
            .values()
            .map(|u| UserEntry {
                name: u.name.clone(),
                password_hash: u.password_hash.to_base64(),
                tags: u.tags.clone(),
            })
            .collect()
    }

    /// Creates or replaces a user.
    pub fn put_user(&self, user: UserConfig) -> Result<(), CoreError> {
        if user.name.is_empty() || user.name.len() > 255 {
            return Err(CoreError::PreconditionFailed(
                "user names are 1 to 255 bytes".into(),
            ));
        }
        let rec = UserRecord {
            password_hash: user.password_hash.to_base64(),
            tags: user.tags.clone(),
        };
        let mut st = self.write();
        self.commit(vec![MetaOp::put(user_key(&user.name), json(&rec))])?;
        st.users.insert(user.name.clone(), user);
        Ok(())
    }

    /// Deletes a user and its permissions; `false` when there was no such user.
    pub fn delete_user(&self, name: &str) -> Result<bool, CoreError> {
        let mut st = self.write();
        if !st.users.contains_key(name) {
            return Ok(false);
        }
        let prefix = |tag| KeyBuilder::new(tag).part(name.as_bytes()).build();
        self.commit(vec![
            MetaOp::delete(user_key(name)),
            MetaOp::delete_prefix(prefix(TAG_PERMISSION)),
            MetaOp::delete_prefix(prefix(TAG_TOPIC)),
        ])?;
        st.users.remove(name);
        st.perms.retain(|(u, _), _| u != name);
        st.topics.retain(|(u, _, _), _| u != name);
        st.access.retain(|(u, _), _| u != name);
        Ok(true)
    }

    /// The rights of `user` in `vhost`, if it has any.
    pub fn access(&self, user: &str, vhost: &str) -> Option<Arc<VhostAccess>> {
        self.read()
            .access
            .get(&(user.to_owned(), vhost.to_owned()))
            .cloned()
    }

    /// Every permission, by user then vhost.
    pub fn permissions(&self) -> Vec<PermissionEntry> {
        self.read()
            .perms
            .iter()
            .map(|((u, v), p)| PermissionEntry {
                user: u.clone(),
                vhost: v.clone(),
                configure: p.configure.clone(),
                write: p.write.clone(),
                read: p.read.clone(),
            })
            .collect()
    }

    /// Sets what `user` may do in `vhost` (patterns are checked first).
    pub fn set_permission(&self, p: PermissionEntry) -> Result<(), CoreError> {
        let rec = PermRecord {
            configure: p.configure,
            write: p.write,
            read: p.read,
        };
        for s in [&rec.configure, &rec.write, &rec.read] {
            Pattern::new(s).map_err(|e| {
                CoreError::PreconditionFailed(format!("invalid pattern '{s}': {}", e.reason))
            })?;
        }
        let mut st = self.write();
        if !st.users.contains_key(&p.user) {
            return Err(no_user(&p.user));
        }
        self.commit(vec![MetaOp::put(perm_key(&p.user, &p.vhost), json(&rec))])?;
        st.perms.insert((p.user.clone(), p.vhost.clone()), rec);
        st.compile(&p.user, &p.vhost)
    }

    /// Removes what `user` may do in `vhost`; `false` when it had nothing there.
    pub fn clear_permission(&self, user: &str, vhost: &str) -> Result<bool, CoreError> {
        let mut st = self.write();
        let k = (user.to_owned(), vhost.to_owned());
        if !st.perms.contains_key(&k) {
            return Ok(false);
        }
        self.commit(vec![MetaOp::delete(perm_key(user, vhost))])?;
        st.perms.remove(&k);
        st.compile(user, vhost)?;
        Ok(true)
    }

    /// Every topic permission.
    pub fn topic_permissions(&self) -> Vec<TopicPermissionEntry> {
        self.read()
            .topics
            .iter()
            .map(|((u, v, x), t)| TopicPermissionEntry {
                user: u.clone(),
                vhost: v.clone(),
                exchange: x.clone(),
                write: t.write.clone(),
                read: t.read.clone(),
            })
            .collect()
    }

    /// Sets a topic permission (patterns are checked first).
    pub fn set_topic_permission(&self, t: TopicPermissionEntry) -> Result<(), CoreError> {
        for s in [&t.write, &t.read] {
            TopicPermission::pattern(s, &t.user, &t.vhost).map_err(|e| {
                CoreError::PreconditionFailed(format!("invalid topic pattern '{s}': {}", e.reason))
            })?;
        }
        let rec = TopicRecord {
            write: t.write,
            read: t.read,
        };
        let mut st = self.write();
        if !st.users.contains_key(&t.user) {
            return Err(no_user(&t.user));
        }
        self.commit(vec![MetaOp::put(
            topic_key(&t.user, &t.vhost, &t.exchange),
            json(&rec),
        )])?;
        st.topics
            .insert((t.user.clone(), t.vhost.clone(), t.exchange), rec);
        st.compile(&t.user, &t.vhost)
    }

    /// Removes the topic permissions of `user` in `vhost` (one exchange's, or all);
    /// `false` when there were none.
    pub fn clear_topic_permissions(
        &self,
        user: &str,
        vhost: &str,
        exchange: Option<&str>,
    ) -> Result<bool, CoreError> {
        let mut st = self.write();
        let keys: Vec<_> = st
            .topics
            .keys()
            .filter(|(u, v, x)| u == user && v == vhost && exchange.is_none_or(|e| e == x))
            .cloned()
            .collect();
        if keys.is_empty() {
            return Ok(false);
        }
        let ops = keys
            .iter()
            .map(|(u, v, x)| MetaOp::delete(topic_key(u, v, x)))
            .collect();
        self.commit(ops)?;
        for k in keys {
            st.topics.remove(&k);
        }
        st.compile(user, vhost)?;
        Ok(true)
    }

    /// Removes every permission in `vhost` (the vhost was deleted).
    pub fn vhost_deleted(&self, vhost: &str) -> Result<(), CoreError> {
        let mut st = self.write();
        let mut ops = Vec::new();
        for (u, v) in st.perms.keys().filter(|(_, v)| v == vhost) {
            ops.push(MetaOp::delete(perm_key(u, v)));
        }
        for (u, v, x) in st.topics.keys().filter(|(_, v, _)| v == vhost) {
            ops.push(MetaOp::delete(topic_key(u, v, x)));
        }
        self.commit(ops)?;
        st.perms.retain(|(_, v), _| v != vhost);
        st.topics.retain(|(_, v, _), _| v != vhost);
        st.access.retain(|(_, v), _| v != vhost);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use triad_store::store::{Store, StoreConfig};

    fn open_store(dir: &std::path::Path) -> Arc<Store> {
        Arc::new(Store::open(StoreConfig::new(dir)).expect("store"))
    }

    fn cfg() -> CoreConfig {
        CoreConfig {
            users: vec![UserConfig::with_password("guest", "guest")],
            default_password: Some(("guest".into(), "guest".into())),
            ..CoreConfig::default()
        }
    }

    #[test]
    fn runtime_changes_survive_reopen_and_config_seeds_only_what_changed() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open_store(dir.path());
            let db = AuthDb::open(Arc::clone(&store), &cfg()).unwrap();
            assert!(db.user("guest").is_some());
            assert!(db.access("guest", "/").is_some());
            db.put_user(UserConfig::with_password("alice", "pw"))
                .unwrap();
            db.set_permission(PermissionEntry {
                user: "alice".into(),
                vhost: "/".into(),
                configure: "^a-.*".into(),
                write: ".*".into(),
                read: "".into(),
            })
            .unwrap();
            db.set_topic_permission(TopicPermissionEntry {
                user: "alice".into(),
                vhost: "/".into(),
                exchange: "amq.topic".into(),
                write: "^x\\.{client_id}\\.".into(),
                read: ".*".into(),
            })
            .unwrap();
            // guest's password changed through the API
            let mut g = UserConfig::with_password("guest", "secret");
            g.tags = vec!["administrator".into()];
            db.put_user(g).unwrap();
        }
        let store = open_store(dir.path());
        let db = AuthDb::open(Arc::clone(&store), &cfg()).unwrap();
        let alice = db.user("alice").expect("alice persisted");
        assert!(alice.password_hash.verify("pw"));
        let a = db.access("alice", "/").expect("permission persisted");
        assert!(a.queue_declare("a-1", &Default::default()).is_ok());
        assert!(a.queue_declare("b-1", &Default::default()).is_err());
        assert_eq!(db.topic_permissions().len(), 1);
        // the stored pattern keeps its variable: compiled per client id
        let other = tempfile::tempdir().unwrap();
        let broker = crate::Broker::open(open_store(other.path()), cfg()).unwrap();
        let vh = broker.vhost("/").unwrap();
        assert!(
            a.publish_to(&vh, "amq.topic", "x.c1.t").is_err(),
            "no client id"
        );
        let c1 = a.for_client("c1").unwrap();
        assert!(c1.publish_to(&vh, "amq.topic", "x.c1.t").is_ok());
        assert!(c1.publish_to(&vh, "amq.topic", "x.c2.t").is_err());
        // a bad one is refused before it is stored
        assert!(db
            .set_topic_permission(TopicPermissionEntry {
                user: "alice".into(),
                vhost: "/".into(),
                exchange: "amq.topic".into(),
                write: "^{client_id}(".into(),
                read: ".*".into(),
            })
            .is_err());
        // the configuration did not change: the API's password stays
        let g = db.user("guest").unwrap();
        assert!(g.password_hash.verify("secret"));
        assert_eq!(g.tags, vec!["administrator".to_string()]);
        assert!(db.delete_user("alice").unwrap());
        assert!(db.access("alice", "/").is_none());
        assert!(db.topic_permissions().is_empty());
        assert!(!db.delete_user("alice").unwrap());
        drop(db);
        drop(store);
        // the configuration's default password changed: it is seeded again
        let store = open_store(dir.path());
        let mut c = cfg();
        c.users = vec![UserConfig::with_password("guest", "new")];
        c.default_password = Some(("guest".into(), "new".into()));
        let db = AuthDb::open(Arc::clone(&store), &c).unwrap();
        assert!(db.user("guest").unwrap().password_hash.verify("new"));
        assert!(db.user("alice").is_none(), "a deleted user stays deleted");
    }

    #[test]
    fn refuses_bad_patterns_and_unknown_users() {
        let dir = tempfile::tempdir().unwrap();
        let store = open_store(dir.path());
        let db = AuthDb::open(Arc::clone(&store), &cfg()).unwrap();
        let bad = PermissionEntry {
            user: "guest".into(),
            vhost: "/".into(),
            configure: "(".into(),
            write: ".*".into(),
            read: ".*".into(),
        };
        assert!(matches!(
            db.set_permission(bad),
            Err(CoreError::PreconditionFailed(_))
        ));
        let nobody = PermissionEntry {
            user: "nobody".into(),
            vhost: "/".into(),
            configure: ".*".into(),
            write: ".*".into(),
            read: ".*".into(),
        };
        assert!(matches!(
            db.set_permission(nobody),
            Err(CoreError::PreconditionFailed(_))
        ));
        assert!(db.clear_permission("guest", "/").unwrap());
        assert!(db.access("guest", "/").is_none());
        assert!(!db.clear_permission("guest", "/").unwrap());
    }
}
