//! Atomic file writes: a temporary file beside the target, fsync, rename,
//! fsync of the directory. Readers see the old file or the complete new one.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::{Error, Result};

/// Writes `path` through `write`; on any error the target is untouched and
/// the temporary file removed.
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
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| -> std::io::Result<()> {
        let mut w = BufWriter::new(File::create(&tmp)?);
        write(&mut w)?;
        w.flush()?;
        let f = w.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(path, e)
    })
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
}
