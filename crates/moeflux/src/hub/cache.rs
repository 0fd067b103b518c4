//! The Hugging Face cache layout, exactly as `huggingface_hub` writes it,
//! so Python tools and moeflux share one copy of every file:
//!
//! ```text
//! <cache>/models--ORG--NAME/blobs/<etag>                  the bytes
//! <cache>/models--ORG--NAME/blobs/<etag>.incomplete       a download under way (resumed)
//! <cache>/models--ORG--NAME/snapshots/<commit>/<file>  -> ../../blobs/<etag>
//! <cache>/models--ORG--NAME/refs/<revision>               the commit, no newline
//! <cache>/.locks/models--ORG--NAME/<etag>.lock            flock while downloading
//! ```

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

use super::spec::{is_commit, RepoSpec};

pub struct RepoCache {
    pub root: PathBuf,
    locks: PathBuf,
}

/// An exclusive `flock` on a blob's lock file (the lock `huggingface_hub`'s
/// `filelock` takes), released when dropped.
pub struct BlobLock {
    _file: File,
}

impl RepoCache {
    pub fn new(cache_dir: &Path, spec: &RepoSpec) -> Self {
        let folder = spec.cache_folder();
        RepoCache {
            root: cache_dir.join(&folder),
            locks: cache_dir.join(".locks").join(folder),
        }
    }

    pub fn blob(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(etag)
    }

    pub fn incomplete(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(format!("{etag}.incomplete"))
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    /// The commit `rev` names in the cache: itself when it is a commit id,
    /// else what `refs/<rev>` holds.
    pub fn resolve_ref(&self, rev: &str) -> Result<Option<String>> {
        if is_commit(rev) {
            return Ok(Some(rev.to_string()));
        }
        let path = self.root.join("refs").join(rev);
        match std::fs::read_to_string(&path) {
            Ok(t) if is_commit(t.trim()) => Ok(Some(t.trim().to_string())),
            Ok(_) => Err(Error::format(&path, "does not hold a commit id")),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(&path, e)),
        }
    }

    /// Records that `rev` is at `commit` (nothing for a commit id itself).
    pub fn write_ref(&self, rev: &str, commit: &str) -> Result<()> {
        if rev == commit {
            return Ok(());
        }
        let path = self.root.join("refs").join(rev);
        let dir = path.parent().expect("refs/<rev> has a parent");
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        crate::fsutil::write_file_atomic(&path, |w| {
            use std::io::Write;
            w.write_all(commit.as_bytes())
        })
    }

    /// Points `snapshots/<commit>/<file>` at `blobs/<etag>` with a relative
    /// link (replacing an older one atomically); returns the link's path.
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf> {
        let pointer = self.snapshot(commit).join(file);
        let dir = pointer.parent().expect("a snapshot file has a parent");
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let ups = 2 + file.matches('/').count();
        let target = format!("{}blobs/{etag}", "../".repeat(ups));
        let tmp = dir.join(format!(
            ".{}.link-{}",
            pointer.file_name().unwrap().to_string_lossy(),
            std::process::id()
        ));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp).map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &pointer).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            Error::io(&pointer, e)
        })?;
        Ok(pointer)
    }

    /// Waits for, then holds, the lock of `etag`'s blob.
    pub fn lock(&self, etag: &str) -> Result<BlobLock> {
        std::fs::create_dir_all(&self.locks).map_err(|e| Error::io(&self.locks, e))?;
        let path = self.locks.join(format!("{etag}.lock"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        loop {
            // SAFETY: flock on a descriptor this function owns.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } == 0 {
                return Ok(BlobLock { _file: file });
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(Error::io(&path, e));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_and_links() {
        let d = tempfile::tempdir().unwrap();
        let spec = RepoSpec::parse("org/name").unwrap();
        let c = RepoCache::new(d.path(), &spec);
        assert_eq!(c.root, d.path().join("models--org--name"));
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(c.root.join("blobs")).unwrap();
        std::fs::write(c.blob("e1"), "x").unwrap();
        let p = c.link(commit, "sub/dir/f.json", "e1").unwrap();
        assert_eq!(
            std::fs::read_link(&p).unwrap(),
            PathBuf::from("../../../../blobs/e1")
        );
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "x");
        let p = c.link(commit, "config.json", "e1").unwrap();
        assert_eq!(
            std::fs::read_link(&p).unwrap(),
            PathBuf::from("../../blobs/e1")
        );

        assert_eq!(c.resolve_ref("main").unwrap(), None);
        c.write_ref("main", commit).unwrap();
        assert_eq!(
            std::fs::read_to_string(c.root.join("refs/main")).unwrap(),
            commit
        );
        assert_eq!(c.resolve_ref("main").unwrap().as_deref(), Some(commit));
        assert_eq!(c.resolve_ref(commit).unwrap().as_deref(), Some(commit));
        c.write_ref(commit, commit).unwrap();
        assert!(!c.root.join("refs").join(commit).exists());
        let _l = c.lock("e1").unwrap();
        assert!(d.path().join(".locks/models--org--name/e1.lock").is_file());
    }
}
