//! Atomic file writes: a temporary file beside the target, fsync, rename,
//! fsync of the directory. Readers see the old file or the complete new one.
//!
//! The temporary file has an unpredictable name and is created exclusively
//! (`O_CREAT|O_EXCL`, which never follows a link), so a link planted in a
//! shared directory cannot redirect the write. A target that exists but is
//! not a regular file (a symlink, a device, a directory) is refused: the
//! rename would replace the link or device node itself, which is never what
//! the caller named.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// Errors unless `path` names a regular file or nothing (what
/// [`write_file_atomic`] may replace), so that a caller can refuse a bad
/// target before long work; returns its metadata when it exists.
pub fn check_target(path: &Path) -> Result<Option<std::fs::Metadata>> {
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    let ft = m.file_type();
    if ft.is_file() {
        return Ok(Some(m));
    }
    let what = if ft.is_symlink() {
        "is a symbolic link"
    } else if ft.is_dir() {
        "is a directory"
    } else {
        "is not a regular file (a device, FIFO or socket)"
    };
    Err(Error::Invalid(format!(
        "{}: {what}; refusing to replace it (name a regular file)",
        path.display()
    )))
}

/// Writes `path` through `write`; on any error the target is untouched and
/// the temporary file removed. A new file gets the usual mode (0666 less the
/// umask); a replaced file keeps its permission bits.
pub fn write_file_atomic(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::io::Result<()>,
) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::Invalid(format!("{}: not a file path", path.display())))?;
    let existing = check_target(path)?;
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".tmp-");
    let mut builder = tempfile::Builder::new();
    builder.prefix(&prefix);
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = existing
            .as_ref()
            .map_or(0o666, |m| m.permissions().mode() & 0o7777);
        builder.permissions(std::fs::Permissions::from_mode(mode));
    }
    let result = (|| -> std::io::Result<()> {
        let (file, tmp) = builder.tempfile_in(dir)?.into_parts();
        // `tmp` removes the file when dropped on an early return.
        let mut w = BufWriter::new(file);
        write(&mut w)?;
        w.flush()?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        drop(f);
        tmp.persist(path).map_err(|e| e.error)?;
        File::open(dir)?.sync_all()
    })();
    result.map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_or_leaves_untouched() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("out.bin");
        write_file_atomic(&p, |w| w.write_all(b"one")).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        let err = write_file_atomic(&p, |w| {
            w.write_all(b"partial")?;
            Err(std::io::Error::other("boom"))
        });
        assert!(err.is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "temp file left behind"
        );
    }

    /// A link planted at the old predictable temporary name (or any name)
    /// cannot redirect the write: the victim file is untouched.
    #[cfg(unix)]
    #[test]
    fn planted_links_do_not_redirect_the_write() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let p = d.path().join("out.bin");
        let planted = d
            .path()
            .join(format!(".out.bin.tmp-{}", std::process::id()));
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        write_file_atomic(&p, |w| w.write_all(b"new")).unwrap();
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
    }

    /// A symlink, a directory or a device at the target is refused with its
    /// name, and left as it was.
    #[cfg(unix)]
    #[test]
    fn refuses_targets_that_are_not_regular_files() {
        let d = tempfile::tempdir().unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"precious").unwrap();
        let link = d.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let sub = d.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        // A FIFO stands for devices (a test must not risk /dev/null).
        let fifo = d.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        for (target, says) in [
            (&link, "symbolic link"),
            (&sub, "directory"),
            (&fifo, "not a regular file"),
        ] {
            let e = write_file_atomic(target, |w| w.write_all(b"x"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&target.display().to_string()), "{e}");
            assert!(e.contains(says), "{e}");
        }
        let kind = |p: &Path| std::fs::symlink_metadata(p).unwrap().file_type();
        assert!(kind(&link).is_symlink());
        assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
        assert!(kind(&sub).is_dir());
        use std::os::unix::fs::FileTypeExt;
        assert!(kind(&fifo).is_fifo());
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            4,
            "temp file left"
        );
    }

    #[cfg(unix)]
    #[test]
    fn new_files_get_the_usual_mode_and_replaced_ones_keep_theirs() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("f");
        write_file_atomic(&p, |w| w.write_all(b"a")).unwrap();
        let plain = d.path().join("plain");
        File::create(&plain).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&p), mode(&plain), "the mode File::create gives");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        write_file_atomic(&p, |w| w.write_all(b"b")).unwrap();
        assert_eq!(mode(&p), 0o640);
    }
}
