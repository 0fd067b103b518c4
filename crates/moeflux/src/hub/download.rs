//! Downloading a snapshot's files into the cache: several at once, each
//! into `blobs/<etag>.incomplete`, resumed with a `Range` request after a
//! dropped connection (in this run or the next), renamed to its blob when
//! complete and linked into `snapshots/<commit>/`.

use std::io::{Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use ureq::http::StatusCode;

use crate::error::{Error, Result};

use super::cache::RepoCache;
use super::http::{Client, FileMeta, GetFail};

/// What one [`fetch`] did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Fetched {
    /// Files whose bytes were downloaded (not found in the cache).
    pub files: usize,
    /// Bytes received.
    pub bytes: u64,
}

pub(crate) struct Fetcher<'a> {
    pub client: &'a Client,
    pub cache: &'a RepoCache,
    pub repo: &'a str,
    pub commit: &'a str,
    pub parallel: usize,
    pub retries: u32,
    pub cancel: Option<&'a AtomicBool>,
    /// `(bytes done, bytes total)` of this fetch, from worker threads.
    pub progress: &'a (dyn Fn(u64, u64) + Sync),
}

/// A failure worth resuming after (the connection), or not (the disk, a
/// refusal, cancellation).
enum Fail {
    Retry(Error),
    Fatal(Error),
}

impl Fetcher<'_> {
    /// Makes `files` present in `snapshots/<commit>/`; a file already linked
    /// there costs no request.
    pub fn fetch(&self, files: &[String]) -> Result<Fetched> {
        let snapshot = self.cache.snapshot(self.commit);
        let todo: Vec<&String> = files
            .iter()
            .filter(|f| !snapshot.join(f).is_file())
            .collect();
        if todo.is_empty() {
            return Ok(Fetched::default());
        }
        let metas = par_map(&todo, self.parallel, |f| {
            self.check_cancel()?;
            let m = self.client.file_meta(self.repo, self.commit, f)?;
            match &m.commit {
                Some(c) if c != self.commit => Err(Error::Hub {
                    repo: self.repo.into(),
                    reason: format!(
                        "asked for `{f}` at commit {}, the Hub answered with commit {c}",
                        self.commit
                    ),
                }),
                _ => Ok(m),
            }
        })?;

        // Blobs already whole (another revision, another tool) are linked;
        // partial ones count as done so far.
        let mut total = 0u64;
        let mut done = 0u64;
        for m in &metas {
            if self.cache.blob(&m.etag).is_file() {
                continue;
            }
            total += m.size;
            let part = std::fs::metadata(self.cache.incomplete(&m.etag)).map_or(0, |x| x.len());
            done += part.min(m.size);
        }
        let blobs = self.cache.root.join("blobs");
        if total > done {
            crate::convert::output::check_space(&blobs.join("x"), total - done)?;
        }
        std::fs::create_dir_all(&blobs).map_err(|e| Error::io(&blobs, e))?;
        let done = AtomicU64::new(done);
        let received = AtomicU64::new(0);
        let downloaded = AtomicUsize::new(0);
        (self.progress)(done.load(Ordering::Relaxed), total);
        let items: Vec<(&String, &FileMeta)> = todo.iter().copied().zip(&metas).collect();
        par_map(&items, self.parallel, |(f, m)| {
            if !self.cache.blob(&m.etag).is_file() {
                let counted = |n: i64| {
                    if n >= 0 {
                        received.fetch_add(n as u64, Ordering::Relaxed);
                        let d = done.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
                        (self.progress)(d, total);
                    } else {
                        done.fetch_sub(n.unsigned_abs(), Ordering::Relaxed);
                    }
                };
                if self.download(f, m, &counted)? {
                    downloaded.fetch_add(1, Ordering::Relaxed);
                }
            }
            self.cache.link(self.commit, f, &m.etag)?;
            Ok(())
        })?;
        Ok(Fetched {
            files: downloaded.into_inner(),
            bytes: received.into_inner(),
        })
    }

    fn check_cancel(&self) -> Result<()> {
        match self.cancel {
            Some(c) if c.load(Ordering::Relaxed) => Err(Error::Cancelled),
            _ => Ok(()),
        }
    }

    /// Downloads one blob under its lock; false when another process
    /// finished it meanwhile.
    fn download(&self, file: &str, m: &FileMeta, counted: &(dyn Fn(i64) + Sync)) -> Result<bool> {
        let _lock = self.cache.lock(&m.etag)?;
        let blob = self.cache.blob(&m.etag);
        if blob.is_file() {
            return Ok(false);
        }
        let part = self.cache.incomplete(&m.etag);
        let mut failures = 0u32;
        loop {
            self.check_cancel()?;
            let have = std::fs::metadata(&part).map_or(0, |x| x.len());
            if have == m.size {
                break;
            }
            match self.transfer(file, m, &part, have, counted) {
                Ok(()) => {}
                Err(Fail::Fatal(e)) => return Err(e),
                Err(Fail::Retry(e)) => {
                    if failures >= self.retries {
                        return Err(e);
                    }
                    failures += 1;
                    let ms = (250u64 << failures.min(5)).min(8000);
                    std::thread::sleep(Duration::from_millis(ms));
                }
            }
        }
        let f = std::fs::File::open(&part).map_err(|e| Error::io(&part, e))?;
        f.sync_all()
            .map_err(|e| write_error(self.repo, file, &part, e))?;
        std::fs::rename(&part, &blob).map_err(|e| Error::io(&blob, e))?;
        Ok(true)
    }

    /// One request: appends to `part` from byte `have` (or rewrites it when
    /// the server sends the whole file).
    fn transfer(
        &self,
        file: &str,
        m: &FileMeta,
        part: &Path,
        have: u64,
        counted: &(dyn Fn(i64) + Sync),
    ) -> std::result::Result<(), Fail> {
        let hub = |reason: String| Error::Hub {
            repo: self.repo.into(),
            reason,
        };
        if have > m.size {
            // Not this blob's bytes (a different file under the same name).
            std::fs::remove_file(part).map_err(|e| Fail::Fatal(Error::io(part, e)))?;
            counted(-(have as i64));
            return Err(Fail::Retry(hub(format!(
                "`{file}`: stale partial download removed"
            ))));
        }
        let resp = self
            .client
            .get_from(self.repo, file, &m.url, have)
            .map_err(|e| match e {
                GetFail::Network(e) => Fail::Retry(e),
                GetFail::Refused(e) => Fail::Fatal(e),
            })?;
        let mut opts = std::fs::OpenOptions::new();
        let start = match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                let cr = resp
                    .headers()
                    .get("content-range")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("");
                if !cr.starts_with(&format!("bytes {have}-")) {
                    return Err(Fail::Fatal(hub(format!(
                        "`{file}`: asked for bytes {have}- and got Content-Range `{cr}`"
                    ))));
                }
                opts.append(true);
                have
            }
            StatusCode::RANGE_NOT_SATISFIABLE => {
                std::fs::remove_file(part).map_err(|e| Fail::Fatal(Error::io(part, e)))?;
                counted(-(have as i64));
                return Err(Fail::Retry(hub(format!(
                    "`{file}`: the server refused to resume at byte {have}"
                ))));
            }
            _ => {
                // The whole file: start over.
                counted(-(have as i64));
                opts.write(true).truncate(true);
                0
            }
        };
        let mut out = opts
            .create(true)
            .open(part)
            .map_err(|e| Fail::Fatal(write_error(self.repo, file, part, e)))?;
        let mut body = resp.into_body().into_reader();
        let mut buf = vec![0u8; 1 << 20];
        let mut at = start;
        loop {
            if let Err(e) = self.check_cancel() {
                return Err(Fail::Fatal(e));
            }
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(Fail::Retry(hub(format!(
                        "connection lost while downloading `{file}` at byte {at} of {}: {e}",
                        m.size
                    ))))
                }
            };
            if at + n as u64 > m.size {
                return Err(Fail::Fatal(hub(format!(
                    "`{file}`: the server sent more than its {} bytes",
                    m.size
                ))));
            }
            out.write_all(&buf[..n])
                .map_err(|e| Fail::Fatal(write_error(self.repo, file, part, e)))?;
            at += n as u64;
            counted(n as i64);
        }
        if at < m.size {
            return Err(Fail::Retry(hub(format!(
                "connection closed while downloading `{file}` at byte {at} of {}",
                m.size
            ))));
        }
        Ok(())
    }
}

/// A write failure; a full disk says what to do about it.
pub(crate) fn write_error(repo: &str, file: &str, path: &Path, e: std::io::Error) -> Error {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        return Error::Hub {
            repo: repo.into(),
            reason: format!(
                "disk full while downloading `{file}` to {}: free space or point HF_HUB_CACHE \
                 at a larger disk (the partial download is kept and resumes next time)",
                path.display()
            ),
        };
    }
    Error::io(path, e)
}

/// `f` over `items` on up to `n` threads; the first error (in item order)
/// stops the others from starting new items.
fn par_map<T: Sync, R: Send>(
    items: &[T],
    n: usize,
    f: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let slots: Mutex<Vec<Option<Result<R>>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..n.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= items.len() || stop.load(Ordering::Relaxed) {
                    break;
                }
                let r = f(&items[i]);
                if r.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                slots.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(r);
            });
        }
    });
    let slots = slots.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::with_capacity(items.len());
    let mut first_err = None;
    for r in slots.into_iter().flatten() {
        match r {
            Ok(v) => out.push(v),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None if out.len() == items.len() => Ok(out),
        None => unreachable!("a worker stopped only after an error"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_disk_is_named() {
        let e = write_error(
            "o/n",
            "model.safetensors",
            Path::new("/c/blobs/x.incomplete"),
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        )
        .to_string();
        assert!(
            e.contains("disk full while downloading `model.safetensors`"),
            "{e}"
        );
        assert!(e.contains("HF_HUB_CACHE"), "{e}");
        let e = write_error(
            "o/n",
            "f",
            Path::new("/p"),
            std::io::Error::from_raw_os_error(libc::EACCES),
        );
        assert!(matches!(e, Error::Io { .. }));
    }

    #[test]
    fn par_map_keeps_order_and_reports_the_first_error() {
        let v: Vec<u32> = (0..20).collect();
        assert_eq!(
            par_map(&v, 4, |x| Ok(x * 2)).unwrap(),
            (0..20).map(|x| x * 2).collect::<Vec<_>>()
        );
        let e = par_map(&v, 1, |&x| {
            if x >= 3 {
                Err(Error::Invalid(format!("{x}")))
            } else {
                Ok(x)
            }
        });
        assert_eq!(e.unwrap_err().to_string(), "3");
        assert!(par_map(&Vec::<u32>::new(), 4, |x| Ok(*x))
            .unwrap()
            .is_empty());
    }
}
