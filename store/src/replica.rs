//! Replication's two store-side pieces (issue 18; the protocol is the `triad-cluster`
//! crate's):
//!
//! - [`ReplicaGate`], on a leader: what a commitlog append's [`crate::flush::Durable`]
//!   also waits for in `replication.mode = sync` (the offset `min_insync` replicas hold on
//!   disk, or a refusal while too few are in sync), and the signal that wakes the
//!   leader's senders when the log grows. A store opened without one (no `[cluster]`)
//!   pays one `OnceLock` load per append and per durability poll.
//! - [`ReplicaStore`], on a follower: the data directory's commitlog and metadata journal
//!   written as raw bytes at the leader's offsets and journal positions, and made
//!   durable before they are acknowledged. No consume queue, index or checkpoint is kept:
//!   opening the directory as a broker (promotion) recovers them from the log. The
//!   segments the leader's retention and compaction deleted are deleted here too, once
//!   what let the leader delete them is durable here ([`ReplicaStore::note_retained`]).

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::commitlog::CommitLog;
use crate::error::{Result, StoreError};
use crate::file::{lock_dir, parse_offset_name, sync_dir, write_atomic};
use crate::journal::MetaJournal;

/// The largest snapshot a follower accepts from its leader.
pub const MAX_SNAPSHOT: u64 = 1 << 32;

#[derive(Debug, Default)]
struct GateState {
    /// Every commitlog byte below this is on disk on enough replicas.
    replicated: u64,
    /// Set while fewer than `min_insync` replicas are in sync: waits above `replicated`
    /// fail with this reason.
    refusing: Option<String>,
    /// Set when this node stopped being the leader (its lease is gone): every wait fails,
    /// whatever its offset and mode, for good.
    fenced: Option<String>,
    wakers: Vec<(u64, Waker)>,
}

/// See the module docs. Shared by the store (appends and their durability) and the
/// cluster's leader (which moves it as followers acknowledge).
#[derive(Debug)]
pub struct ReplicaGate {
    /// Whether durabilities wait for replicas (`replication.mode = sync`).
    sync: bool,
    /// Set by [`ReplicaGate::arm`] once the broker has started: until then durabilities
    /// do not wait (the broker's own start-up records, such as an MQTT state migration,
    /// must not need followers that have not connected yet; no client is served before).
    armed: std::sync::atomic::AtomicBool,
    /// [`ReplicaGate::fence`] was called (the reason is in the state).
    fenced: std::sync::atomic::AtomicBool,
    /// The highest commitlog end appended (for the senders).
    written: AtomicU64,
    /// Senders waiting in [`ReplicaGate::wait_appended`].
    sleepers: AtomicUsize,
    /// `GateState::replicated`, readable without the lock (deliveries' fast path).
    replicated_hint: AtomicU64,
    /// The lowest commitlog end a connected follower holds (`u64::MAX`: none connected):
    /// retention deletes and compacts no segment past it ([`ReplicaGate::retention_floor`]).
    floor: AtomicU64,
    state: Mutex<GateState>,
    /// Blocking durability waiters.
    progress: Condvar,
    /// Senders waiting for appends.
    work: Condvar,
}

impl ReplicaGate {
    /// A gate; with `sync`, durabilities are refused until [`ReplicaGate::set`] says
    /// enough replicas are in sync.
    pub fn new(sync: bool) -> Arc<ReplicaGate> {
        Arc::new(ReplicaGate {
            sync,
            armed: std::sync::atomic::AtomicBool::new(false),
            fenced: std::sync::atomic::AtomicBool::new(false),
            written: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            replicated_hint: AtomicU64::new(0),
            floor: AtomicU64::new(u64::MAX),
            state: Mutex::new(GateState {
                replicated: 0,
                refusing: sync.then(|| "no replica is in sync yet".to_string()),
                fenced: None,
                wakers: Vec::new(),
            }),
            progress: Condvar::new(),
            work: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether durabilities wait on this gate.
    pub fn is_sync(&self) -> bool {
        self.sync
    }

    /// From now on (sync mode) durabilities wait for replicas: call before serving
    /// clients.
    pub fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    fn gates(&self) -> bool {
        (self.sync && self.armed.load(Ordering::SeqCst)) || self.fenced.load(Ordering::SeqCst)
    }

    /// Fencing (a leader that lost its lease): from now on every durability wait, pending
    /// or new, in sync or async mode, fails with [`StoreError::NotEnoughReplicas`]
    /// (`reason`), so nothing more is confirmed. There is no way back: the node leaves
    /// the leader role.
    pub fn fence(&self, reason: &str) {
        let mut st = self.lock();
        st.fenced = Some(format!("fenced: {reason}"));
        self.fenced.store(true, Ordering::SeqCst);
        let ready: Vec<Waker> = st.wakers.drain(..).map(|(_, w)| w).collect();
        drop(st);
        self.progress.notify_all();
        for w in ready {
            w.wake();
        }
    }

    /// Whether [`ReplicaGate::fence`] was called.
    pub fn is_fenced(&self) -> bool {
        self.fenced.load(Ordering::SeqCst)
    }

    /// The store appended up to `end` (called on every append).
    pub fn appended(&self, end: u64) {
        self.written.fetch_max(end, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            drop(self.lock());
            self.work.notify_all();
        }
    }

    /// The highest commitlog end appended so far (as told by the store).
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::SeqCst)
    }

    /// Waits until the log end passes `seen` or `timeout` passes; returns the end.
    pub fn wait_appended(&self, seen: u64, timeout: Duration) -> u64 {
        let st = self.lock();
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let w = self.written.load(Ordering::SeqCst);
        let w = if w > seen {
            w
        } else {
            drop(
                self.work
                    .wait_timeout(st, timeout)
                    .unwrap_or_else(|e| e.into_inner()),
            );
            self.written.load(Ordering::SeqCst)
        };
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        w
    }

    /// The cluster's verdict: bytes below `replicated` are on enough replicas; with
    /// `refusing`, waits above it fail (too few replicas in sync), without, they wait.
    pub fn set(&self, replicated: u64, refusing: Option<String>) {
        let mut st = self.lock();
        st.replicated = st.replicated.max(replicated);
        self.replicated_hint.store(st.replicated, Ordering::SeqCst);
        st.refusing = refusing;
        let ready: Vec<Waker> = if st.refusing.is_some() {
            st.wakers.drain(..).map(|(_, w)| w).collect()
        } else {
            let r = st.replicated;
            let mut ready = Vec::new();
            st.wakers.retain(|(o, w)| {
                if *o <= r {
                    ready.push(w.clone());
                    false
                } else {
                    true
                }
            });
            ready
        };
        drop(st);
        self.progress.notify_all();
        for w in ready {
            w.wake();
        }
    }

    /// The leader's view of its connected followers: the lowest commitlog end one of
    /// them holds durably (`None`: no follower connected).
    pub fn set_retention_floor(&self, lowest: Option<u64>) {
        self.floor
            .store(lowest.unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Retention deletes or compacts only segments that end at or below this: a
    /// connected follower, in sync or catching up, still reads the rest from this log
    /// (were they gone, it would be refused and need a fresh copy). A follower that is
    /// not connected holds nothing: the leader's disk stays bounded by live data, and a
    /// follower away for long may then have to start again from an empty directory.
    pub fn retention_floor(&self) -> u64 {
        self.floor.load(Ordering::SeqCst)
    }

    /// Where the gate stands: (replicated offset, refusal).
    pub fn state(&self) -> (u64, Option<String>) {
        let st = self.lock();
        (st.replicated, st.refusing.clone())
    }

    fn verdict(&self, st: &GateState, offset: u64) -> Option<Result<()>> {
        if let Some(why) = &st.fenced {
            return Some(Err(StoreError::NotEnoughReplicas(why.clone())));
        }
        if !self.gates() || st.replicated >= offset {
            return Some(Ok(()));
        }
        st.refusing
            .as_ref()
            .map(|why| Err(StoreError::NotEnoughReplicas(why.clone())))
    }

    /// For deliveries in sync mode (a consumer sees a message only once `min_insync`
    /// replicas hold it, as its confirm waits for): whether the commitlog up to `end` is
    /// replicated enough. If not, `waker` (when given) is woken once it is, or when the
    /// gate refuses or fences (the caller then looks again). Never blocks; one atomic
    /// load when `end` is already below the replicated offset.
    pub fn reached_or_wake(&self, end: u64, waker: Option<Waker>) -> bool {
        if !self.gates() {
            return true;
        }
        let fenced = self.fenced.load(Ordering::SeqCst);
        if !fenced && self.replicated_hint.load(Ordering::SeqCst) >= end {
            return true;
        }
        let mut st = self.lock();
        if st.fenced.is_none() && st.replicated >= end {
            return true;
        }
        if let Some(w) = waker {
            st.wakers.push((end, w));
        }
        false
    }

    /// Whether `offset` is replicated enough (never blocks).
    pub fn reached(&self, offset: u64) -> bool {
        if !self.gates() {
            return true;
        }
        let st = self.lock();
        st.fenced.is_none() && st.replicated >= offset
    }

    pub(crate) fn poll(&self, offset: u64, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if !self.gates() {
            return Poll::Ready(Ok(()));
        }
        let mut st = self.lock();
        if let Some(v) = self.verdict(&st, offset) {
            return Poll::Ready(v);
        }
        if let Some(slot) = st
            .wakers
            .iter_mut()
            .find(|(o, w)| *o == offset && w.will_wake(cx.waker()))
        {
            slot.1 = cx.waker().clone();
        } else {
            st.wakers.push((offset, cx.waker().clone()));
        }
        Poll::Pending
    }

    pub(crate) fn wait(&self, offset: u64) -> Result<()> {
        let mut st = self.lock();
        loop {
            if let Some(v) = self.verdict(&st, offset) {
                return v;
            }
            st = self.progress.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// In-flight snapshot transfer: (position, declared length, bytes so far).
type SnapshotInProgress = (u64, u64, Vec<u8>);

/// The leader's segment list, and its ends read after it; see
/// [`ReplicaStore::note_retained`].
#[derive(Debug)]
struct Retained {
    log_end: u64,
    journal_pos: u64,
    segments: Vec<u64>,
}

/// A follower's copy of its leader's commitlog and metadata journal; see the module docs.
pub struct ReplicaStore {
    log: CommitLog,
    meta_dir: PathBuf,
    /// The journal file appended to, and the position where it starts.
    journal: File,
    journal_path: PathBuf,
    journal_pos: u64,
    /// What the last [`ReplicaStore::sync`] made durable.
    log_synced: u64,
    journal_synced: u64,
    snapshot: Option<SnapshotInProgress>,
    /// The leader's deletions not applied yet, oldest first (at most two: a newer one
    /// replaces the second, so the first is applied however often they come).
    retained: std::collections::VecDeque<Retained>,
    _lock: File,
}

impl std::fmt::Debug for ReplicaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaStore")
            .field("log_end", &self.log.end())
            .field("journal_pos", &self.journal_pos)
            .finish()
    }
}

impl ReplicaStore {
    /// Opens (creating) the data directory `dir` as a follower: takes its lock (a broker
    /// cannot open it meanwhile), marks it unclean (a broker opening it later runs the
    /// full recovery), cuts torn tails of the log and the journal.
    pub fn open(dir: &Path, segment_size: u64) -> Result<ReplicaStore> {
        let lock = lock_dir(dir)?;
        let abort = dir.join("abort");
        File::create(&abort)
            .and_then(|f| f.sync_all())
            .map_err(StoreError::at(&abort))?;
        // A checkpoint would let a broker skip the replay that rebuilds what a follower
        // does not keep (an earlier standalone life of this directory wrote it).
        let ckpt = dir.join("checkpoint");
        if ckpt.exists() {
            return Err(StoreError::Invalid(format!(
                "{} holds a checkpoint: this data directory was a broker's; a follower \
                 starts from an empty directory or a follower's",
                dir.display()
            )));
        }
        sync_dir(dir)?;

        let meta_dir = dir.join("meta");
        // the journal's own open cuts a torn tail and drops superseded files
        let journal_pos = MetaJournal::open(&meta_dir, u64::MAX)?.position().0;
        let base = list(&meta_dir, "journal-")?.into_iter().max().unwrap_or(0);
        let (jname, _) = crate::journal::file_names(base);
        let journal_path = meta_dir.join(jname);
        let journal = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&journal_path)
            .map_err(StoreError::at(&journal_path))?;

        let log = CommitLog::open(&dir.join("commitlog"), segment_size)?;
        log.recover(0, true, false, |_, _| Ok(()))?;
        let log_synced = log.end();
        Ok(ReplicaStore {
            log,
            meta_dir,
            journal,
            journal_path,
            journal_pos,
            log_synced,
            journal_synced: journal_pos,
            snapshot: None,
            retained: Default::default(),
            _lock: lock,
        })
    }

    /// The commitlog end (written; durable after [`ReplicaStore::sync`]).
    pub fn log_end(&self) -> u64 {
        self.log.end()
    }

    /// The first commitlog offset held.
    pub fn log_start(&self) -> u64 {
        self.log.min_offset()
    }

    /// The journal position (written; durable after [`ReplicaStore::sync`]).
    pub fn journal_pos(&self) -> u64 {
        self.journal_pos
    }

    /// The segment size the log was opened with.
    pub fn segment_size(&self) -> u64 {
        self.log.segment_size()
    }

    /// Writes the leader's commitlog bytes at `offset` (see [`CommitLog::write_raw`]:
    /// gaps and differing overlaps are refused).
    pub fn write_log(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        self.log.write_raw(offset, data)
    }

    /// Cuts the commitlog at `offset` (a divergent suffix of an older term; see the
    /// cluster crate's epoch history). Durable once this returns.
    pub fn truncate_log(&mut self, offset: u64) -> Result<()> {
        self.retained.clear();
        self.log.truncate(offset)?;
        self.log_synced = self.log_synced.min(self.log.end());
        Ok(())
    }

    /// Drops the whole journal copy (it holds records of an older term that the leader
    /// does not have): every journal and snapshot file goes, and the copy starts again at
    /// position 0 (the leader ships its snapshot, then the records after it). Durable
    /// once this returns.
    pub fn reset_journal(&mut self) -> Result<()> {
        self.snapshot = None;
        self.retained.clear();
        for prefix in ["journal-", "snapshot-"] {
            for p in list(&self.meta_dir, prefix)? {
                let path = self.meta_dir.join(format!("{prefix}{p:020}"));
                std::fs::remove_file(&path).map_err(StoreError::at(&path))?;
            }
        }
        let (jname, _) = crate::journal::file_names(0);
        let jpath = self.meta_dir.join(jname);
        let journal = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&jpath)
            .map_err(StoreError::at(&jpath))?;
        journal.sync_all().map_err(StoreError::at(&jpath))?;
        sync_dir(&self.meta_dir)?;
        self.journal = journal;
        self.journal_path = jpath;
        self.journal_pos = 0;
        self.journal_synced = 0;
        Ok(())
    }

    /// Appends the leader's journal bytes at `pos`, which must be this copy's position
    /// (anything else is refused: the leader ships from the position the follower
    /// states).
    pub fn write_journal(&mut self, pos: u64, data: &[u8]) -> Result<()> {
        if pos != self.journal_pos {
            return Err(StoreError::Invalid(format!(
                "replicated journal bytes at {pos}, but this copy ends at {}",
                self.journal_pos
            )));
        }
        self.journal
            .write_all(data)
            .map_err(StoreError::at(&self.journal_path))?;
        self.journal_pos += data.len() as u64;
        Ok(())
    }

    /// One piece of the leader's snapshot at journal position `pos` (`total` bytes in
    /// all, this piece at `offset`). Once complete it is installed: written atomically,
    /// a fresh journal started at `pos`, and every older journal and snapshot removed.
    /// Returns whether it was installed.
    pub fn snapshot_chunk(
        &mut self,
        pos: u64,
        offset: u64,
        total: u64,
        data: &[u8],
    ) -> Result<bool> {
        if total > MAX_SNAPSHOT {
            return Err(StoreError::TooLarge {
                size: total,
                max: MAX_SNAPSHOT,
            });
        }
        if offset == 0 {
            self.snapshot = Some((pos, total, Vec::new()));
        }
        let Some((p, t, buf)) = self.snapshot.as_mut() else {
            return Err(StoreError::Invalid(
                "snapshot piece without its start".into(),
            ));
        };
        if *p != pos || *t != total || buf.len() as u64 != offset {
            return Err(StoreError::Invalid(format!(
                "snapshot piece at {offset} of {total} for position {pos} does not follow \
                 the previous piece"
            )));
        }
        if offset + data.len() as u64 > total {
            return Err(StoreError::Invalid("snapshot piece past its length".into()));
        }
        buf.extend_from_slice(data);
        if (buf.len() as u64) < total {
            return Ok(false);
        }
        let Some((pos, _, bytes)) = self.snapshot.take() else {
            return Ok(false);
        };
        let (jname, sname) = crate::journal::file_names(pos);
        write_atomic(&self.meta_dir.join(sname), &bytes)?;
        let jpath = self.meta_dir.join(jname);
        let journal = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&jpath)
            .map_err(StoreError::at(&jpath))?;
        journal.sync_all().map_err(StoreError::at(&jpath))?;
        sync_dir(&self.meta_dir)?;
        for (prefix, keep) in [("journal-", pos), ("snapshot-", pos)] {
            for p in list(&self.meta_dir, prefix)? {
                if p != keep {
                    let path = self.meta_dir.join(format!("{prefix}{p:020}"));
                    std::fs::remove_file(&path).map_err(StoreError::at(&path))?;
                }
            }
        }
        sync_dir(&self.meta_dir)?;
        let journal = OpenOptions::new()
            .append(true)
            .open(&jpath)
            .map_err(StoreError::at(&jpath))?;
        self.journal = journal;
        self.journal_path = jpath;
        self.journal_pos = pos;
        self.journal_synced = pos;
        Ok(true)
    }

    /// The leader's retention or compaction deleted segments: `segments` is every one it
    /// holds (ascending), listed before it read its ends `log_end` and `journal_pos`.
    /// Once this copy holds both durably (a compaction's copies are below that end, and
    /// the ack states journaled at the checkpoint that let the segments go are below
    /// that position), [`ReplicaStore::sync`] deletes each sealed segment here that
    /// starts below the list's last entry and is not in it, so that a promotion's replay
    /// (from the log's start: see `CommitLog::recover`) finds what the leader's would.
    /// Notices from an earlier connection are dropped ([`ReplicaStore::forget_retained`]).
    pub fn note_retained(&mut self, segments: Vec<u64>, log_end: u64, journal_pos: u64) {
        if !segments.is_sorted_by(|a, b| a < b) {
            tracing::warn!("replica: a segment list out of order from the leader; ignored");
            return;
        }
        if self.retained.len() >= 2 {
            self.retained.pop_back();
        }
        self.retained.push_back(Retained {
            log_end,
            journal_pos,
            segments,
        });
    }

    /// Drops the leader's deletions not applied yet (a new connection, perhaps to a
    /// new leader, sends its own).
    pub fn forget_retained(&mut self) {
        self.retained.clear();
    }

    /// Applies the deletion notices this copy now holds durably enough for; returns
    /// the segments deleted.
    fn apply_retained(&mut self) -> Result<usize> {
        let mut deleted = 0;
        while let Some(n) = self.retained.front() {
            if self.log_synced < n.log_end || self.journal_synced < n.journal_pos {
                break;
            }
            let Some(n) = self.retained.pop_front() else {
                break;
            };
            let Some(&last) = n.segments.last() else {
                continue;
            };
            for seg in self.log.segment_list() {
                let start = seg.start();
                if start < last
                    && seg.end() <= self.log_synced
                    && n.segments.binary_search(&start).is_err()
                {
                    // the segment holding the end stays (delete_segment refuses it)
                    deleted += usize::from(self.log.delete_segment(start)?);
                }
            }
        }
        if deleted > 0 {
            tracing::info!(
                segments = deleted,
                first = self.log.min_offset(),
                "replica: deleted the segments the leader's retention deleted"
            );
        }
        Ok(deleted)
    }

    /// Makes everything written durable (`fdatasync` of the journal, `msync` of the new
    /// log bytes) and returns the durable (commitlog end, journal position): what the
    /// follower acknowledges. Then deletes what the leader's deletions now allow
    /// ([`ReplicaStore::note_retained`]). An error is fatal for this copy.
    pub fn sync(&mut self) -> Result<(u64, u64)> {
        if self.journal_synced < self.journal_pos {
            self.journal
                .sync_data()
                .map_err(|e| StoreError::Fatal(format!("{}: {e}", self.journal_path.display())))?;
            self.journal_synced = self.journal_pos;
        }
        let end = self.log.end();
        if self.log_synced < end {
            self.log.flush(self.log_synced, end)?;
            self.log_synced = end;
        }
        if !self.retained.is_empty() {
            self.apply_retained()?;
        }
        Ok((self.log_synced, self.journal_synced))
    }
}

/// What a broker derives from its two logs (rebuilt by recovery's full replay).
const DERIVED: [&str; 4] = ["consumequeue", "sharedcq", "index", "timer"];

/// Demotion (a leader's data directory about to be a follower's): removes what a broker
/// derives from the logs (consume queues, the index, delayed-message timers) and, last,
/// its checkpoint, so that a later promotion replays the whole log, as from a follower's
/// copy. The two logs stay. Returns whether there was a broker's state to drop. Takes
/// the directory's lock while it works (fails if a broker or follower holds it).
pub fn drop_broker_state(dir: &Path) -> Result<bool> {
    let ckpt = dir.join("checkpoint");
    if !ckpt.exists() {
        return Ok(false);
    }
    let _lock = lock_dir(dir)?;
    // marked unclean first: a promotion after a crash in here runs the full recovery
    let abort = dir.join("abort");
    File::create(&abort)
        .and_then(|f| f.sync_all())
        .map_err(StoreError::at(&abort))?;
    for d in DERIVED {
        let p = dir.join(d);
        match std::fs::remove_dir_all(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io(&p, e)),
        }
    }
    sync_dir(dir)?;
    // the checkpoint last: until it is gone, a restart drops the state again
    std::fs::remove_file(&ckpt).map_err(StoreError::at(&ckpt))?;
    sync_dir(dir)?;
    Ok(true)
}

fn list(dir: &Path, prefix: &str) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(StoreError::at(dir))? {
        let entry = entry.map_err(StoreError::at(dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(p) = name.strip_prefix(prefix).and_then(parse_offset_name) {
            out.push(p);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{encode_message, message_len, NewMessage};

    /// A leader-side log with `n` records; returns it and the records' offsets.
    fn leader(dir: &Path, n: usize) -> (CommitLog, Vec<u64>) {
        let log = CommitLog::open(dir, 4096).unwrap();
        log.recover(0, false, false, |_, _| Ok(())).unwrap();
        let mut w = log.writer().unwrap();
        let mut offs = Vec::new();
        for i in 0..n {
            let body = vec![i as u8; 300];
            let msg = NewMessage {
                queues: &[1],
                body: &body,
                ..Default::default()
            };
            let len = message_len(&msg).unwrap() as u64;
            offs.push(
                log.append(&mut w, len, |b| encode_message(b, &msg, 7, &[i as u64]))
                    .unwrap(),
            );
            log.publish(&w);
        }
        (log, offs)
    }

    /// Copies the leader's log from the follower's end, in pieces of `chunk` bytes.
    fn ship(from: &CommitLog, to: &mut ReplicaStore, chunk: u64) {
        loop {
            let at = to.log_end();
            let b = from.read_raw(at, chunk).unwrap();
            if b.is_empty() {
                break;
            }
            to.write_log(at, &b).unwrap();
        }
    }

    #[test]
    fn a_copy_in_odd_pieces_across_segments_is_the_leaders_log_record_for_record() {
        let l = tempfile::tempdir().unwrap();
        let f = tempfile::tempdir().unwrap();
        let (log, offs) = leader(l.path(), 40);
        assert!(log.segment_list().len() > 2, "spans segments");
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        ship(&log, &mut r, 777);
        assert_eq!(r.log_end(), log.end());
        assert_eq!(r.sync().unwrap().0, log.end());
        drop(r);
        // what a promoted broker's recovery finds: every record, same offsets and bodies
        let copy = CommitLog::open(&f.path().join("commitlog"), 4096).unwrap();
        let mut seen = Vec::new();
        copy.recover(0, true, false, |off, _| {
            seen.push(off);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, offs);
        for (i, o) in offs.iter().enumerate() {
            assert_eq!(
                copy.read(*o).unwrap().body.as_ref(),
                &vec![i as u8; 300][..]
            );
        }
    }

    /// The leader's deletions are applied once this copy holds the log end and journal
    /// position read after the list, to sealed segments only, and not at all after a
    /// truncation; the copy with holes reopens whole.
    #[test]
    fn the_leaders_deleted_segments_go_here_once_its_ends_are_durable_here() {
        let l = tempfile::tempdir().unwrap();
        let f = tempfile::tempdir().unwrap();
        let (log, _) = leader(l.path(), 60);
        let starts: Vec<u64> = log.segment_list().iter().map(|s| s.start()).collect();
        assert!(starts.len() >= 5, "{starts:?}");
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        while r.log_end() < starts[4] {
            let at = r.log_end();
            r.write_log(at, &log.read_raw(at, starts[4] - at).unwrap())
                .unwrap();
        }
        let held = r.sync().unwrap().0;
        assert_eq!(held, starts[4]);
        // the leader deleted its first and third segments; its list, then its ends
        let list: Vec<u64> = starts
            .iter()
            .copied()
            .filter(|s| *s != starts[0] && *s != starts[2])
            .collect();
        // not yet: the journal position is not held here
        r.note_retained(list.clone(), log.end(), 1);
        r.sync().unwrap();
        assert_eq!(r.log.segment_list().len(), 4);
        // a truncation drops it
        r.truncate_log(held).unwrap();
        ship(&log, &mut r, 1 << 20);
        r.sync().unwrap();
        assert_eq!(r.log.segment_list().len(), starts.len());
        // the log end is not held yet: kept until it is
        r.note_retained(list.clone(), log.end() + 1, 0);
        r.sync().unwrap();
        assert_eq!(r.log.segment_list().len(), starts.len());
        r.forget_retained();
        r.note_retained(list.clone(), log.end(), 0);
        r.sync().unwrap();
        let now: Vec<u64> = r.log.segment_list().iter().map(|s| s.start()).collect();
        assert_eq!(now, list, "the first and third segments went, nothing else");
        drop(r);
        // reopened with its holes: nothing is cut, every remaining record is there
        let r = ReplicaStore::open(f.path(), 4096).unwrap();
        assert_eq!(r.log_end(), log.end());
        assert_eq!(r.log.segment_list().len(), list.len());
    }

    #[test]
    fn gaps_and_differing_overlaps_are_refused_agreeing_overlaps_skipped() {
        let l = tempfile::tempdir().unwrap();
        let f = tempfile::tempdir().unwrap();
        let (log, _) = leader(l.path(), 10);
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        let all = log.read_raw(0, 1000).unwrap();
        r.write_log(0, &all).unwrap();
        // a gap after the end
        let err = r.write_log(1001, b"x").unwrap_err();
        assert!(err.to_string().contains("gap"), "{err}");
        // an overlap that agrees (and extends) is fine
        let more = log.read_raw(500, 1000).unwrap();
        r.write_log(500, &more).unwrap();
        assert_eq!(r.log_end(), 1500);
        // one that differs is refused, and nothing moves
        let mut bad = log.read_raw(1000, 600).unwrap().to_vec();
        bad[10] ^= 1;
        let err = r.write_log(1000, &bad).unwrap_err();
        assert!(err.to_string().contains("differ"), "{err}");
        assert_eq!(r.log_end(), 1500);
    }

    #[test]
    fn a_torn_tail_is_cut_at_reopen_and_shipping_resumes_from_the_last_whole_record() {
        let l = tempfile::tempdir().unwrap();
        let f = tempfile::tempdir().unwrap();
        let (log, offs) = leader(l.path(), 30);
        {
            let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
            // half of the fourth record
            let upto = offs[3] + 100;
            let b = log.read_raw(0, upto).unwrap();
            r.write_log(0, &b).unwrap();
            r.sync().unwrap();
        }
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        assert_eq!(r.log_end(), offs[3], "cut back to the last whole record");
        ship(&log, &mut r, 1 << 20);
        assert_eq!(r.log_end(), log.end());
    }

    #[test]
    fn a_truncated_copy_takes_a_different_suffix_and_a_reset_journal_refills_from_zero() {
        let l = tempfile::tempdir().unwrap();
        let l2 = tempfile::tempdir().unwrap();
        let f = tempfile::tempdir().unwrap();
        // two leaders whose logs agree up to record 20, then differ
        let (log, offs) = leader(l.path(), 30);
        let (other, offs2) = leader(l2.path(), 20);
        assert_eq!(offs2[..], offs[..20]);
        assert_eq!(
            other.read_raw(0, 1 << 20).unwrap(),
            log.read_raw(0, other.end()).unwrap()
        );
        {
            let mut w = other.writer().unwrap();
            for i in 0..15u8 {
                let body = vec![200 + (i % 50); 500];
                let msg = NewMessage {
                    queues: &[2],
                    body: &body,
                    ..Default::default()
                };
                let len = message_len(&msg).unwrap() as u64;
                other
                    .append(&mut w, len, |b| encode_message(b, &msg, 9, &[0]))
                    .unwrap();
                other.publish(&w);
            }
        }
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        ship(&log, &mut r, 1000);
        r.sync().unwrap();
        // following the other leader from where they agree: refused until truncated
        let from = offs[20];
        let err = r
            .write_log(from, &other.read_raw(from, 4096).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("differ"), "{err}");
        r.truncate_log(from).unwrap();
        assert_eq!(r.log_end(), from);
        ship(&other, &mut r, 700);
        assert_eq!(r.sync().unwrap().0, other.end());
        drop(r);
        // reopened (recovery), the copy is the other leader's, record for record
        let r = ReplicaStore::open(f.path(), 4096).unwrap();
        assert_eq!(r.log_end(), other.end());
        let copy = CommitLog::open(&f.path().join("commitlog"), 4096).unwrap();
        drop(r);
        let mut theirs = Vec::new();
        other
            .recover(0, false, false, |o, _| {
                theirs.push(o);
                Ok(())
            })
            .unwrap();
        let mut mine = Vec::new();
        copy.recover(0, true, false, |o, _| {
            mine.push(o);
            Ok(())
        })
        .unwrap();
        assert_eq!(mine, theirs);

        // the journal: reset, then filled again from position 0
        use crate::journal::{MetaOp, RawJournal};
        let jl = tempfile::tempdir().unwrap();
        let j = MetaJournal::open(jl.path(), u64::MAX).unwrap();
        for i in 0..5u8 {
            j.commit(vec![MetaOp::put(vec![b'k', i], vec![i; 10])])
                .unwrap();
        }
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        let fill = |r: &mut ReplicaStore| {
            while let Some(RawJournal::Records { pos, bytes }) =
                j.read_raw(r.journal_pos(), 1000).unwrap()
            {
                r.write_journal(pos, &bytes).unwrap();
            }
            r.sync().unwrap();
        };
        r.write_journal(0, b"garbage of another term").unwrap();
        r.sync().unwrap();
        r.reset_journal().unwrap();
        assert_eq!(r.journal_pos(), 0);
        fill(&mut r);
        drop(r);
        let copy = MetaJournal::open(&f.path().join("meta"), u64::MAX).unwrap();
        assert_eq!(copy.scan(&[]).unwrap(), j.scan(&[]).unwrap());
    }

    #[test]
    fn a_leader_refuses_offsets_it_no_longer_holds() {
        let l = tempfile::tempdir().unwrap();
        let (log, _) = leader(l.path(), 40);
        let first = log.segment_list()[0].clone();
        assert!(log.delete_segment(first.start()).unwrap());
        let err = log.read_raw(10, 100).unwrap_err();
        assert!(matches!(err, StoreError::NotFound(_)), "{err}");
        assert!(log.read_raw(log.end(), 100).unwrap().is_empty());
    }

    #[test]
    fn journal_records_and_snapshots_ship_to_an_identical_journal() {
        use crate::journal::{MetaOp, RawJournal};
        let l = tempfile::tempdir().unwrap();
        let f = tempfile::tempdir().unwrap();
        // a tiny compaction threshold, so the journal is compacted as it goes
        let j = MetaJournal::open(l.path(), 512).unwrap();
        let mut r = ReplicaStore::open(f.path(), 4096).unwrap();
        let pull = |r: &mut ReplicaStore| {
            while let Some(raw) = j.read_raw(r.journal_pos(), 100).unwrap() {
                match raw {
                    RawJournal::Records { pos, bytes } => r.write_journal(pos, &bytes).unwrap(),
                    RawJournal::Snapshot { pos, bytes } => {
                        let total = bytes.len() as u64;
                        for (i, c) in bytes.chunks(64).enumerate() {
                            r.snapshot_chunk(pos, i as u64 * 64, total, c).unwrap();
                        }
                    }
                }
            }
            r.sync().unwrap();
        };
        for i in 0..5u32 {
            j.commit(vec![MetaOp::put(vec![b'k', i as u8], vec![1; 20])])
                .unwrap();
        }
        pull(&mut r);
        for i in 0..200u32 {
            j.commit(vec![MetaOp::put(
                vec![b'k', (i % 50) as u8],
                i.to_le_bytes().to_vec(),
            )])
            .unwrap();
        }
        j.commit(vec![MetaOp::delete(vec![b'k', 3])]).unwrap();
        // a follower far behind gets the snapshot first
        let f2 = tempfile::tempdir().unwrap();
        let mut r2 = ReplicaStore::open(f2.path(), 4096).unwrap();
        j.compact().unwrap();
        j.commit(vec![MetaOp::put(b"last".to_vec(), b"v".to_vec())])
            .unwrap();
        pull(&mut r);
        pull(&mut r2);
        let want = j.scan(&[]).unwrap();
        assert_eq!(r.journal_pos(), j.position().0);
        drop((r, r2));
        for d in [f.path(), f2.path()] {
            let copy = MetaJournal::open(&d.join("meta"), u64::MAX).unwrap();
            assert_eq!(copy.scan(&[]).unwrap(), want);
            assert_eq!(copy.position(), j.position());
        }
    }

    #[test]
    fn the_sync_gate_refuses_while_too_few_are_in_sync_and_completes_at_the_quorum() {
        let g = ReplicaGate::new(true);
        // not armed yet (the broker's start-up): nothing waits
        g.wait(10).unwrap();
        g.arm();
        assert!(matches!(g.wait(10), Err(StoreError::NotEnoughReplicas(_))));
        g.set(0, None);
        let t = {
            let g = g.clone();
            std::thread::spawn(move || g.wait(10))
        };
        g.set(5, None);
        assert!(!g.reached(10));
        g.set(10, None);
        t.join().unwrap().unwrap();
        // a wait in progress when the in-sync set shrinks fails
        let t = {
            let g = g.clone();
            std::thread::spawn(move || g.wait(20))
        };
        g.set(10, Some("follower b left".into()));
        assert!(matches!(
            t.join().unwrap(),
            Err(StoreError::NotEnoughReplicas(_))
        ));
        // below the replicated offset it is still durable
        g.wait(10).unwrap();
        // async mode never waits
        ReplicaGate::new(false).wait(u64::MAX).unwrap();
    }

    #[test]
    fn a_fenced_gate_fails_every_pending_and_new_wait_in_both_modes() {
        for sync in [true, false] {
            let g = ReplicaGate::new(sync);
            g.arm();
            g.set(100, None);
            let pending = {
                let g = g.clone();
                std::thread::spawn(move || g.wait(200))
            };
            // an async future pending on the gate is woken too
            let waker_hit = Arc::new(std::sync::atomic::AtomicBool::new(false));
            struct Flag(Arc<std::sync::atomic::AtomicBool>);
            impl std::task::Wake for Flag {
                fn wake(self: Arc<Self>) {
                    self.0.store(true, Ordering::SeqCst);
                }
            }
            let waker = Waker::from(Arc::new(Flag(waker_hit.clone())));
            let mut cx = Context::from_waker(&waker);
            if sync {
                assert!(g.poll(300, &mut cx).is_pending());
            }
            g.fence("the lease is gone");
            assert!(g.is_fenced());
            if sync {
                assert!(matches!(
                    pending.join().unwrap(),
                    Err(StoreError::NotEnoughReplicas(_))
                ));
                assert!(waker_hit.load(Ordering::SeqCst));
            } else {
                // async mode: that wait had nothing to wait for, so it either returned
                // before the fence or fails after it; never blocks
                let _ = pending.join().unwrap();
            }
            // new waits fail, below the replicated offset too, and whatever is set later
            g.set(u64::MAX, None);
            for off in [0, 50, 500] {
                let err = g.wait(off).unwrap_err();
                assert!(err.to_string().contains("lease is gone"), "{err}");
                assert!(!g.reached(off));
                assert!(matches!(
                    g.poll(off, &mut cx),
                    Poll::Ready(Err(StoreError::NotEnoughReplicas(_)))
                ));
            }
        }
    }
}
