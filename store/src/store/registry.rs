//! The queue registry: every queue's id, vhost, name and directory. A durable queue is
//! one journal record (`Q` + id, JSON [`QueueRecord`]) and the id ceiling another (`N`);
//! transient queues are never journaled, only the ceiling, in blocks, so that ids are
//! never reused. [`load_registry`] reads it at open (importing an earlier version's
//! registry document once); [`Inner::create_queue`] and [`Inner::delete_queue`] change
//! it; [`remove_orphans`] deletes consume-queue directories no queue owns.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::checkpoint::ack_key;
use super::open::open_cq;
use super::{lock, Inner, QueueId, QueueState};
use crate::ack::AckState;
use crate::error::{Result, StoreError};
use crate::flush::Durable;
use crate::journal::{MetaJournal, MetaOp};
use crate::meta::MetaStore;

/// A queue's registry record (the value of its `Q` key in the journal, JSON).
#[derive(Serialize, Deserialize, Clone, Debug)]
pub(super) struct QueueRecord {
    pub(super) id: QueueId,
    pub(super) vhost: String,
    pub(super) name: String,
    pub(super) durable: bool,
    pub(super) dir: String,
}

/// The queue registry as an earlier version kept it: one JSON document rewritten whole
/// on every change. Read once at start, moved into the journal, then removed.
#[derive(Serialize, Deserialize, Default, Clone, Debug)]
pub(super) struct Registry {
    pub(super) next_id: QueueId,
    pub(super) queues: Vec<QueueRecord>,
}

const LEGACY_REGISTRY: &str = "store-queues";
/// Transient queue ids are reserved in blocks of this many (one journal record each).
const ID_BLOCK: QueueId = 1024;
/// Journal key tag of a durable queue's record (`Q` + big-endian id).
const TAG_QUEUE: u8 = b'Q';
/// Journal key of the id ceiling: no id at or above it was ever handed out.
const KEY_NEXT_ID: &[u8] = b"N";

fn queue_key(id: QueueId) -> Vec<u8> {
    let mut k = vec![TAG_QUEUE];
    k.extend_from_slice(&id.to_be_bytes());
    k
}

/// The durable queues and the id ceiling, from the journal (importing an earlier
/// version's registry document the first time).
pub(super) fn load_registry(journal: &MetaJournal, meta: &MetaStore) -> Result<Registry> {
    if let Some(legacy) = meta.get::<Registry>(LEGACY_REGISTRY)? {
        if journal.get(KEY_NEXT_ID)?.is_none() {
            let mut ops = Vec::with_capacity(legacy.queues.len() + 1);
            for q in legacy.queues.iter().filter(|q| q.durable) {
                ops.push(MetaOp::put(queue_key(q.id), encode_queue_record(q)?));
            }
            ops.push(MetaOp::put(
                KEY_NEXT_ID.to_vec(),
                legacy.next_id.to_le_bytes().to_vec(),
            ));
            journal.commit(ops)?;
            tracing::info!(
                queues = legacy.queues.len(),
                "store: moved the queue registry document into the metadata journal"
            );
        }
        meta.delete(LEGACY_REGISTRY)?;
    }
    let next_id = journal
        .get(KEY_NEXT_ID)?
        .and_then(|v| v.as_slice().try_into().ok().map(u32::from_le_bytes))
        .unwrap_or(0);
    let mut queues = Vec::new();
    for (k, v) in journal.scan(&[TAG_QUEUE])? {
        let rec: QueueRecord = serde_json::from_slice(&v).map_err(|e| StoreError::Corrupt {
            path: PathBuf::from("meta/journal"),
            offset: 0,
            reason: format!("queue record {k:?}: {e}"),
        })?;
        queues.push(rec);
    }
    Ok(Registry { next_id, queues })
}

fn encode_queue_record(q: &QueueRecord) -> Result<Vec<u8>> {
    serde_json::to_vec(q).map_err(|e| StoreError::Invalid(format!("queue record: {e}")))
}

/// The id ceiling on disk and the next id to hand out.
pub(super) struct RegState {
    /// The id ceiling recorded in the journal.
    next_id: QueueId,
    next_free: QueueId,
    /// (vhost, name) → id of every registered queue, durable or not.
    pub(super) by_name: HashMap<(String, String), QueueId>,
}

impl RegState {
    /// The registry as loaded at open.
    pub(super) fn new(registry: &Registry) -> RegState {
        RegState {
            next_free: registry.next_id,
            by_name: registry
                .queues
                .iter()
                .map(|q| ((q.vhost.clone(), q.name.clone()), q.id))
                .collect(),
            next_id: registry.next_id,
        }
    }
}

/// A file-system-safe, reversible name: bytes outside `[A-Za-z0-9_-]` (and a leading
/// dot) are percent-encoded; very long names are cut and suffixed with the queue id.
fn dir_name(name: &str, id: Option<QueueId>) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && !out.is_empty()) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push('%');
    }
    match id {
        Some(id) if out.len() > 200 => format!("{}~{id}", out.get(..180).unwrap_or("")),
        _ => out,
    }
}

pub(super) fn queue_dir(root: &Path, q: &QueueRecord) -> PathBuf {
    root.join(dir_name(&q.vhost, None)).join(&q.dir)
}

pub(super) fn remove_dir_if_exists(p: &Path) -> Result<()> {
    match std::fs::remove_dir_all(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(StoreError::io(p, e)),
    }
}

/// Removes consume-queue directories no registered queue owns (a crash between
/// unregistering a queue and deleting its files).
pub(super) fn remove_orphans(root: &Path, reg: &Registry) -> Result<()> {
    let Ok(vhosts) = std::fs::read_dir(root) else {
        return Ok(());
    };
    let known: std::collections::HashSet<PathBuf> =
        reg.queues.iter().map(|q| queue_dir(root, q)).collect();
    for vh in vhosts.flatten() {
        let Ok(qs) = std::fs::read_dir(vh.path()) else {
            continue;
        };
        for q in qs.flatten() {
            if !known.contains(&q.path()) {
                tracing::info!(path = %q.path().display(), "store: removing an orphaned consume queue");
                remove_dir_if_exists(&q.path())?;
            }
        }
    }
    Ok(())
}

impl Inner {
    pub(super) fn create_queue(
        &self,
        vhost: &str,
        name: &str,
        durable: bool,
    ) -> Result<(QueueId, Durable)> {
        if name.is_empty() {
            return Err(StoreError::Invalid("empty queue name".into()));
        }
        let mut reg = lock(&self.registry);
        let key = (vhost.to_string(), name.to_string());
        if let Some(id) = reg.by_name.get(&key) {
            return Ok((*id, Durable::ready()));
        }
        let id = reg.next_free;
        let next_free = id
            .checked_add(1)
            .ok_or_else(|| StoreError::Invalid("queue ids exhausted".into()))?;
        let rec = QueueRecord {
            id,
            vhost: vhost.to_string(),
            name: name.to_string(),
            durable,
            dir: dir_name(name, Some(id)),
        };
        let qdir = queue_dir(&self.cfg.dir.join("consumequeue"), &rec);
        remove_dir_if_exists(&qdir)?;
        let cq = open_cq(&qdir, &self.cfg, &self.shared, &rec, &[], 0)?;
        // A durable queue is one journal record. Transient ones never are (they vanish at
        // the next start, and their leftover files are removed as orphans); only the id
        // ceiling is, in blocks, so ids are never reused.
        let mut ops = Vec::new();
        if durable {
            ops.push(MetaOp::put(queue_key(id), encode_queue_record(&rec)?));
        }
        let mut ceiling = reg.next_id;
        if next_free > ceiling {
            ceiling = if durable {
                next_free
            } else {
                next_free.saturating_add(ID_BLOCK)
            };
            ops.push(MetaOp::put(
                KEY_NEXT_ID.to_vec(),
                ceiling.to_le_bytes().to_vec(),
            ));
        }
        let done = if ops.is_empty() {
            Durable::ready()
        } else {
            self.journal.append(ops)?
        };
        reg.next_id = ceiling;
        reg.next_free = next_free;
        reg.by_name.insert(key, id);
        self.queues
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                id,
                Arc::new(QueueState {
                    rec,
                    dir: qdir,
                    cq,
                    ack: Mutex::new(AckState::new(0)),
                    delivered: AtomicU64::new(0),
                    dirty: AtomicBool::new(false),
                }),
            );
        Ok((id, done))
    }

    pub(super) fn delete_queue(&self, queue: QueueId) -> Result<()> {
        // The registry lock is held until the files are gone: a queue declared again under
        // the same name may get the same directory.
        let mut reg = lock(&self.registry);
        let Ok(q) = self.queue(queue) else {
            return Err(StoreError::NotFound(format!("queue {queue}")));
        };
        // The record first, durably: a crash before it leaves the queue whole.
        self.journal
            .append(vec![
                MetaOp::delete(queue_key(queue)),
                MetaOp::delete(ack_key(queue)),
                MetaOp::delete_prefix(crate::returns::queue_prefix(queue)),
            ])?
            .wait()?;
        let key = (q.rec.vhost.clone(), q.rec.name.clone());
        if reg.by_name.get(&key) == Some(&queue) {
            reg.by_name.remove(&key);
        }
        drop(q);
        // Take it out under the writer lock so no append is half-way into it.
        let q = {
            let _w = self.writer();
            self.queues
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&queue)
        };
        if let Some(q) = q {
            remove_dir_if_exists(&q.dir)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dir_names_are_safe() {
        assert_eq!(dir_name("/", None), "%2F");
        assert_eq!(dir_name("orders.v1", None), "orders.v1");
        assert_eq!(dir_name("..", None), "%2E.");
        assert_eq!(dir_name("", None), "%");
        assert_eq!(dir_name("a b/c", None), "a%20b%2Fc");
        let long = "x".repeat(300);
        assert_eq!(dir_name(&long, Some(7)).len(), 182);
    }
}
