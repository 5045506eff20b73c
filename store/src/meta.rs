//! Small JSON metadata documents, one file each under `meta/`, written atomically:
//! temp file, fsync, rename, directory fsync. A reader sees the old or the new
//! document, never a mix.
//!
//! Earlier versions kept their metadata here: the store's queue registry
//! (`store-queues`), the core's vhost list (`vhosts`) and one topology document per
//! vhost. Metadata now lives in the [`crate::journal`]; the store and the core read these
//! documents once at start, move what they hold into the journal and delete them.
//! Nothing new is written here.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Result, StoreError};
use crate::file::write_atomic;

/// The `meta/` directory.
#[derive(Debug, Clone)]
pub struct MetaStore {
    dir: PathBuf,
}

impl MetaStore {
    /// Opens `dir`, creating it, and removes temp files a crash left behind.
    pub fn open(dir: &Path) -> Result<MetaStore> {
        std::fs::create_dir_all(dir).map_err(StoreError::at(dir))?;
        for entry in std::fs::read_dir(dir).map_err(StoreError::at(dir))? {
            let entry = entry.map_err(StoreError::at(dir))?;
            if entry.file_name().to_string_lossy().ends_with(".tmp") {
                let p = entry.path();
                std::fs::remove_file(&p).map_err(StoreError::at(&p))?;
            }
        }
        Ok(MetaStore {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, name: &str) -> Result<PathBuf> {
        let ok = !name.is_empty()
            && !name.starts_with('.')
            && name.len() <= 200
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !ok {
            return Err(StoreError::Invalid(format!("bad metadata name {name:?}")));
        }
        Ok(self.dir.join(format!("{name}.json")))
    }

    /// Replaces document `name` with `value`, durably.
    pub fn put<T: Serialize>(&self, name: &str, value: &T) -> Result<()> {
        let path = self.path(name)?;
        let bytes = serde_json::to_vec_pretty(value)
            .map_err(|e| StoreError::Invalid(format!("cannot encode {name}: {e}")))?;
        write_atomic(&path, &bytes)
    }

    /// Document `name`, or `None` when it was never written.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>> {
        let path = self.path(name)?;
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io(&path, e)),
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| StoreError::Corrupt {
                path,
                offset: e.column() as u64,
                reason: e.to_string(),
            })
    }

    /// Removes document `name` (no error when it is absent).
    pub fn delete(&self, name: &str) -> Result<()> {
        let path = self.path(name)?;
        match std::fs::remove_file(&path) {
            Ok(()) => crate::file::sync_dir(&self.dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(&path, e)),
        }
    }

    /// Names of all documents, sorted.
    pub fn list(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(StoreError::at(&self.dir))? {
            let entry = entry.map_err(StoreError::at(&self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(stem) = name.strip_suffix(".json") {
                names.push(stem.to_string());
            }
        }
        names.sort();
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn put_get_delete_list() {
        let dir = tempfile::tempdir().unwrap();
        let m = MetaStore::open(dir.path()).unwrap();
        assert_eq!(m.get::<BTreeMap<String, u32>>("queues").unwrap(), None);
        let mut v = BTreeMap::new();
        v.insert("q1".to_string(), 7u32);
        m.put("queues", &v).unwrap();
        m.put("users", &vec!["guest"]).unwrap();
        assert_eq!(m.get::<BTreeMap<String, u32>>("queues").unwrap(), Some(v));
        assert_eq!(m.list().unwrap(), vec!["queues", "users"]);
        m.delete("queues").unwrap();
        m.delete("queues").unwrap();
        assert_eq!(m.list().unwrap(), vec!["users"]);
    }

    #[test]
    fn rejects_path_names_and_reports_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let m = MetaStore::open(dir.path()).unwrap();
        assert!(m.put("../x", &1).is_err());
        assert!(m.put(".hidden", &1).is_err());
        std::fs::write(dir.path().join("bad.json"), b"{not json").unwrap();
        assert!(matches!(
            m.get::<u32>("bad"),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn removes_stale_temp_files() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("queues.json.tmp"), b"half").unwrap();
        let m = MetaStore::open(dir.path()).unwrap();
        assert!(!dir.path().join("queues.json.tmp").exists());
        assert!(m.list().unwrap().is_empty());
    }
}
