//! The destination directory, written atomically: everything goes into a
//! sibling temporary directory `.<name>.tmp-<pid>` on the same file system,
//! files and directories are fsynced, and the directory is renamed into
//! place. On error or cancellation the temporary directory is removed and
//! the destination is untouched. A temporary directory left by a process
//! that died (killed, power loss) is removed by the next run for the same
//! destination, once its pid is no longer alive.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};

/// Refuses an existing destination (unless `force`) and a destination that
/// is, or contains, `src` (replacing it would delete the source).
pub fn check_destination(dst: &Path, force: bool, src: Option<&Path>) -> Result<()> {
    let exists = dst.symlink_metadata().is_ok();
    if exists && !force {
        return Err(Error::DestinationExists {
            path: dst.to_path_buf(),
        });
    }
    let Some(src) = src else {
        return Ok(());
    };
    let Ok(s) = src.canonicalize() else {
        return Ok(()); // opening the source reports it
    };
    let d = if exists {
        dst.canonicalize().ok()
    } else {
        let parent = match dst.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        match (parent.canonicalize(), dst.file_name()) {
            (Ok(p), Some(n)) => Some(p.join(n)),
            _ => None,
        }
    };
    if let Some(d) = d {
        if s.starts_with(&d) {
            return Err(Error::Invalid(format!(
                "destination {} is or contains the source {}",
                dst.display(),
                src.display()
            )));
        }
    }
    Ok(())
}

/// Refuses to start when the destination's file system has less than
/// `needed` bytes free (better than failing hours into a large model).
pub fn check_space(dst: &Path, needed: u64) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let (parent, _) = split_dst(dst)?;
    // The nearest existing ancestor (the parent may be created later).
    let mut dir = parent.as_path();
    while dir.symlink_metadata().is_err() {
        match dir.parent() {
            Some(p) if !p.as_os_str().is_empty() => dir = p,
            _ => {
                dir = Path::new(".");
                break;
            }
        }
    }
    let Ok(c) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return Ok(());
    };
    // SAFETY: statvfs fills the zeroed struct; `c` is a valid C string.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Ok(()); // cannot tell; the writes will report a full disk
    }
    let avail = (st.f_bavail as u64).saturating_mul(st.f_frsize as u64);
    if avail < needed {
        return Err(Error::Invalid(format!(
            "{}: not enough free space: the model needs {needed} bytes, {avail} are available",
            dir.display()
        )));
    }
    Ok(())
}

fn split_dst(dst: &Path) -> Result<(PathBuf, String)> {
    let name = dst
        .file_name()
        .ok_or_else(|| {
            Error::Invalid(format!(
                "{}: destination needs a directory name",
                dst.display()
            ))
        })?
        .to_string_lossy()
        .into_owned();
    let parent = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, name))
}

/// The temporary directory; removed on drop unless committed.
pub struct TempDir {
    pub path: PathBuf,
    parent: PathBuf,
    name: String,
    committed: bool,
}

impl TempDir {
    pub fn create(dst: &Path) -> Result<Self> {
        let (parent, name) = split_dst(dst)?;
        std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
        // pid, plus a counter for several conversions in one process.
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let suffix = match n {
            0 => format!("{}", std::process::id()),
            _ => format!("{}-{n}", std::process::id()),
        };
        remove_stale(&parent, &name);
        let path = parent.join(format!(".{name}.tmp-{suffix}"));
        if path.symlink_metadata().is_ok() {
            // Left by an earlier run of a process that had our pid.
            std::fs::remove_dir_all(&path).map_err(|e| Error::io(&path, e))?;
        }
        std::fs::create_dir(&path).map_err(|e| Error::io(&path, e))?;
        Ok(TempDir {
            path,
            parent,
            name,
            committed: false,
        })
    }

    /// Renames the finished directory to `dst`; with `force` an existing
    /// `dst` is renamed aside first and deleted after.
    pub fn commit(mut self, dst: &Path, force: bool) -> Result<()> {
        fsync_dir(&self.path)?;
        if dst.symlink_metadata().is_ok() {
            if !force {
                return Err(Error::DestinationExists {
                    path: dst.to_path_buf(),
                });
            }
            let old = self
                .parent
                .join(format!(".{}.old-{}", self.name, std::process::id()));
            if old.symlink_metadata().is_ok() {
                remove_any(&old)?;
            }
            std::fs::rename(dst, &old).map_err(|e| Error::io(dst, e))?;
            if let Err(e) = std::fs::rename(&self.path, dst) {
                let _ = std::fs::rename(&old, dst);
                return Err(Error::io(dst, e));
            }
            self.committed = true;
            fsync_dir(&self.parent)?;
            remove_any(&old)?;
        } else {
            std::fs::rename(&self.path, dst).map_err(|e| Error::io(dst, e))?;
            self.committed = true;
        }
        fsync_dir(&self.parent)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// Removes `.{name}.tmp-PID[-N]` directories in `parent` whose process is
/// gone. Best effort: what cannot be read or removed is left; a pid that is
/// alive (ours, or another user's: `EPERM`) is never touched.
fn remove_stale(parent: &Path, name: &str) {
    let prefix = format!(".{name}.tmp-");
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(rest) = file_name.to_str().and_then(|f| f.strip_prefix(&prefix)) else {
            continue;
        };
        let pid = rest.split_once('-').map_or(rest, |(p, _)| p);
        let Ok(pid) = pid.parse::<libc::pid_t>() else {
            continue;
        };
        let is_dir = entry.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if is_dir && pid > 0 && !process_alive(pid) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether a process `pid` exists (`kill(pid, 0)`: only `ESRCH` means no).
fn process_alive(pid: libc::pid_t) -> bool {
    if pid == std::process::id() as libc::pid_t {
        return true;
    }
    // SAFETY: signal 0 sends nothing; it only checks the pid.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

fn remove_any(p: &Path) -> Result<()> {
    let r = if p.symlink_metadata().map(|m| m.is_dir()).unwrap_or(false) {
        std::fs::remove_dir_all(p)
    } else {
        std::fs::remove_file(p)
    };
    r.map_err(|e| Error::io(p, e))
}

pub fn fsync_dir(p: &Path) -> Result<()> {
    File::open(p)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(p, e))
}

/// Writes and fsyncs a small file.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(bytes).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

/// Copies and fsyncs a file.
pub fn copy_file(from: &Path, to: &Path) -> Result<()> {
    let bytes = std::fs::read(from).map_err(|e| Error::io(from, e))?;
    write_file(to, &bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_check() {
        let t = tempfile::tempdir().unwrap();
        let dst = t.path().join("not/yet/there/model");
        check_space(&dst, 1).unwrap();
        let e = check_space(&dst, u64::MAX).unwrap_err().to_string();
        assert!(e.contains("not enough free space"), "{e}");
    }

    #[test]
    fn temp_dir_is_removed_unless_committed() {
        let t = tempfile::tempdir().unwrap();
        let dst = t.path().join("m");
        let tmp = TempDir::create(&dst).unwrap();
        let p = tmp.path.clone();
        std::fs::write(p.join("x"), b"1").unwrap();
        drop(tmp);
        assert!(!p.exists() && !dst.exists());
        let tmp = TempDir::create(&dst).unwrap();
        std::fs::write(tmp.path.join("x"), b"2").unwrap();
        tmp.commit(&dst, false).unwrap();
        assert_eq!(std::fs::read(dst.join("x")).unwrap(), b"2");
        // Forced replacement of an existing directory.
        let tmp = TempDir::create(&dst).unwrap();
        std::fs::write(tmp.path.join("y"), b"3").unwrap();
        assert!(matches!(
            TempDir::create(&dst).unwrap().commit(&dst, false),
            Err(Error::DestinationExists { .. })
        ));
        tmp.commit(&dst, true).unwrap();
        assert!(dst.join("y").exists() && !dst.join("x").exists());
        let names: Vec<_> = std::fs::read_dir(t.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "leftovers beside the destination");
    }

    #[test]
    fn stale_temp_dirs_of_dead_processes_are_removed() {
        let t = tempfile::tempdir().unwrap();
        let dst = t.path().join("m");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let stale = [format!(".m.tmp-{dead}"), format!(".m.tmp-{dead}-3")];
        // pid 1 is alive; another destination's and a plain file are not ours.
        let kept = [".m.tmp-1", ".other.tmp-999999999", ".m.tmp-notapid"];
        for n in stale.iter().map(String::as_str).chain(kept) {
            std::fs::create_dir(t.path().join(n)).unwrap();
            std::fs::write(t.path().join(n).join("part"), b"x").unwrap();
        }
        let tmp = TempDir::create(&dst).unwrap();
        for n in &stale {
            assert!(!t.path().join(n).exists(), "{n} left");
        }
        for n in kept {
            assert!(t.path().join(n).exists(), "{n} removed");
        }
        drop(tmp);
    }
}
