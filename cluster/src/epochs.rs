//! A node's epoch history (Kafka's leader-epoch cache): for each leader term this copy
//! of the logs has seen, where the term began in the commitlog and the journal. Kept in
//! the data directory's `epochs` file, one `epoch log_start journal_start` line per
//! term, oldest first.
//!
//! - A node elected leader appends its term (its log end and journal position at
//!   election, before it writes anything) and fsyncs before serving.
//! - A follower says the last epoch it has seen in `Hello`; the leader answers where that
//!   epoch ended in its own logs ([`EpochHistory::end_of`]): the start of the first later
//!   term. What the follower holds past that point was written in an older term by a
//!   leader that lost it, and the follower truncates it before following; it then adopts
//!   the leader's history ([`EpochHistory::replace`]), after the truncation is durable.
//!
//! At most [`crate::codec::MAX_HISTORY`] entries are kept (the oldest dropped): a
//! follower whose epoch predates them all is truncated to the oldest start kept, which
//! is safe, only slower.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::codec::{EpochEntry, MAX_HISTORY};

/// The history file's name in the data directory.
pub const FILE: &str = "epochs";

/// See the module docs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EpochHistory {
    entries: Vec<EpochEntry>,
}

#[derive(Debug, thiserror::Error)]
pub enum EpochError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: line {line} is not `epoch log_start journal_start` in increasing order")]
    Malformed { path: PathBuf, line: usize },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> EpochError + '_ {
    move |source| EpochError::Io {
        path: path.to_owned(),
        source,
    }
}

fn sync_dir(dir: &Path) -> Result<(), EpochError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

impl EpochHistory {
    /// Reads `dir`'s history (empty when there is none). A last line cut short by a
    /// crash during an append is ignored.
    pub fn load(dir: &Path) -> Result<EpochHistory, EpochError> {
        let path = dir.join(FILE);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(&path)(e)),
        };
        let whole = match text.rfind('\n') {
            Some(i) => &text[..=i],
            None => "",
        };
        let mut entries: Vec<EpochEntry> = Vec::new();
        for (i, line) in whole.lines().enumerate() {
            let bad = || EpochError::Malformed {
                path: path.clone(),
                line: i + 1,
            };
            let mut f = line.split(' ').map(|w| w.parse::<u64>());
            let (Some(Ok(epoch)), Some(Ok(log_start)), Some(Ok(journal_start)), None) =
                (f.next(), f.next(), f.next(), f.next())
            else {
                return Err(bad());
            };
            if entries.last().is_some_and(|l| l.epoch >= epoch) {
                return Err(bad());
            }
            entries.push(EpochEntry {
                epoch,
                log_start,
                journal_start,
            });
        }
        let skip = entries.len().saturating_sub(MAX_HISTORY);
        entries.drain(..skip);
        Ok(EpochHistory { entries })
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> &[EpochEntry] {
        &self.entries
    }

    /// The last epoch seen (0: none).
    pub fn last_epoch(&self) -> u64 {
        self.entries.last().map_or(0, |e| e.epoch)
    }

    /// Appends a new term (its epoch above every one held) to `dir`'s file and fsyncs
    /// it (and the directory when the file is new).
    pub fn append(&mut self, dir: &Path, e: EpochEntry) -> Result<(), EpochError> {
        let path = dir.join(FILE);
        if self.entries.last().is_some_and(|l| l.epoch >= e.epoch) {
            return Err(EpochError::Malformed {
                path,
                line: self.entries.len() + 1,
            });
        }
        let new = !path.exists();
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(io(&path))?;
        f.write_all(format!("{} {} {}\n", e.epoch, e.log_start, e.journal_start).as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(io(&path))?;
        if new {
            sync_dir(dir)?;
        }
        self.entries.push(e);
        if self.entries.len() > MAX_HISTORY {
            self.entries.remove(0);
        }
        Ok(())
    }

    /// Replaces `dir`'s history with `entries` (the leader's), atomically.
    pub fn replace(&mut self, dir: &Path, entries: &[EpochEntry]) -> Result<(), EpochError> {
        if self.entries == entries {
            return Ok(());
        }
        let path = dir.join(FILE);
        let tmp = dir.join(format!("{FILE}.tmp"));
        let mut text = String::new();
        for e in entries {
            text.push_str(&format!(
                "{} {} {}\n",
                e.epoch, e.log_start, e.journal_start
            ));
        }
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(io(&path))?;
        sync_dir(dir)?;
        self.entries = entries.to_vec();
        Ok(())
    }

    /// Where a copy that last saw epoch `epoch` must be cut, as (commitlog offset,
    /// journal position): the start of the first term after `epoch` in this history;
    /// `None` when no later term is known (the copy's bytes are this history's).
    pub fn end_of(&self, epoch: u64) -> Option<(u64, u64)> {
        self.entries
            .iter()
            .find(|e| e.epoch > epoch)
            .map(|e| (e.log_start, e.journal_start))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(epoch: u64, log_start: u64, journal_start: u64) -> EpochEntry {
        EpochEntry {
            epoch,
            log_start,
            journal_start,
        }
    }

    #[test]
    fn appended_terms_survive_a_reload_and_answer_where_an_epoch_ended() {
        let d = tempfile::tempdir().unwrap();
        let mut h = EpochHistory::load(d.path()).unwrap();
        assert_eq!(h.last_epoch(), 0);
        assert_eq!(h.end_of(0), None);
        h.append(d.path(), e(3, 0, 0)).unwrap();
        h.append(d.path(), e(7, 1000, 40)).unwrap();
        h.append(d.path(), e(12, 5000, 90)).unwrap();
        // epochs only grow
        assert!(h.append(d.path(), e(12, 6000, 90)).is_err());
        let h = EpochHistory::load(d.path()).unwrap();
        assert_eq!(h.entries(), &[e(3, 0, 0), e(7, 1000, 40), e(12, 5000, 90)]);
        assert_eq!(h.last_epoch(), 12);
        // a copy from before any term: cut at the first term's start
        assert_eq!(h.end_of(0), Some((0, 0)));
        // epoch 3 ended where 7 began; 5 (a term this node never saw) too
        assert_eq!(h.end_of(3), Some((1000, 40)));
        assert_eq!(h.end_of(5), Some((1000, 40)));
        assert_eq!(h.end_of(7), Some((5000, 90)));
        // the current term, or a later one: nothing known to cut
        assert_eq!(h.end_of(12), None);
        assert_eq!(h.end_of(13), None);
    }

    #[test]
    fn a_torn_last_line_is_ignored_and_a_bad_one_refused_and_replace_is_whole() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(FILE), "3 0 0\n7 100 4\n9 20").unwrap();
        let mut h = EpochHistory::load(d.path()).unwrap();
        assert_eq!(h.entries(), &[e(3, 0, 0), e(7, 100, 4)]);
        h.replace(d.path(), &[e(2, 0, 0), e(9, 50, 1)]).unwrap();
        assert_eq!(
            EpochHistory::load(d.path()).unwrap().entries(),
            &[e(2, 0, 0), e(9, 50, 1)]
        );
        for bad in ["3 0\n", "3 0 0 1\n", "x 0 0\n", "5 0 0\n5 1 1\n"] {
            std::fs::write(d.path().join(FILE), bad).unwrap();
            assert!(EpochHistory::load(d.path()).is_err(), "{bad:?}");
        }
    }
}
