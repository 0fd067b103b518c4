//! Session snapshots of recent conversations at message boundaries, so that
//! a follow-up turn prefills only its new tokens even when other
//! conversations ran in between.
//!
//! An entry is a complete [`moeflux::Session::state_save`] snapshot
//! (attention KV caches *and* GatedDeltaNet conv/recurrent states) keyed by
//! the tokens it holds. A hit is restored with `state_load`: recurrent
//! state cannot be truncated to an earlier position, so reuse only ever
//! starts from a state saved exactly at that position. Entries live in RAM
//! within a byte budget; the least recently used ones spill to an optional
//! directory (with its own budget), and beyond that are dropped.
//!
//! Several servers may share the spill directory: each writes into its own
//! `moeflux-prefix-<pid>-<random>/` inside it, locked (`flock`) while the
//! server lives; at start a server removes only the subdirectories whose
//! lock nobody holds (left by a server that died). A spill file starts
//! with the tokens it was saved after, checked when it is read back: a
//! file that is missing, short, or of another prefix is dropped (a miss),
//! never loaded.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct PrefixCacheOptions {
    /// Bytes of snapshots kept in RAM; 0 keeps none in RAM.
    pub ram_bytes: u64,
    /// Where snapshots evicted from RAM go (none: they are dropped).
    pub disk_dir: Option<PathBuf>,
    /// Bytes of snapshots kept in `disk_dir`.
    pub disk_bytes: u64,
}

/// Counters for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub entries: usize,
    pub ram_bytes: u64,
    pub disk_bytes: u64,
}

enum Stored {
    /// Shared so that a hit is not a copy of a possibly large snapshot.
    Ram(Arc<[u8]>),
    Disk(PathBuf),
}

struct Entry {
    tokens: Vec<u32>,
    data: Stored,
    size: u64,
    last_used: u64,
}

pub struct PrefixCache {
    opts: PrefixCacheOptions,
    /// This server's own subdirectory of `disk_dir`, and its lock (held
    /// while the file is open).
    spill_dir: Option<(PathBuf, File)>,
    entries: Vec<Entry>,
    clock: u64,
    files: u64,
    stats: PrefixCacheStats,
}

/// Entries are matched by a linear scan; more than this are not worth it.
const MAX_ENTRIES: usize = 256;
const FILE_PREFIX: &str = "moeflux-prefix-";
const LOCK_FILE: &str = "lock";
/// The start of a spill file, then the token count (u64), the tokens (u32
/// each) and the snapshot's length (u64), little-endian, then the snapshot.
const MAGIC: &[u8; 8] = b"MFXPFX1\n";

impl PrefixCache {
    /// Creates the spill directory if one is set, removes what servers no
    /// longer running left there, and makes this server's own
    /// subdirectory.
    pub fn new(opts: PrefixCacheOptions) -> std::io::Result<PrefixCache> {
        let mut spill_dir = None;
        if let Some(dir) = &opts.disk_dir {
            std::fs::create_dir_all(dir)?;
            for e in std::fs::read_dir(dir)?.flatten() {
                let path = e.path();
                if e.file_name().to_string_lossy().starts_with(FILE_PREFIX)
                    && path.is_dir()
                    && is_abandoned(&path)
                {
                    let _ = std::fs::remove_dir_all(&path);
                }
            }
            let own = dir.join(format!(
                "{FILE_PREFIX}{}-{:016x}",
                std::process::id(),
                crate::random_u64()
            ));
            std::fs::create_dir(&own)?;
            let lock = File::create(own.join(LOCK_FILE))?;
            lock.try_lock().map_err(|e| match e {
                std::fs::TryLockError::Error(e) => e,
                std::fs::TryLockError::WouldBlock => {
                    std::io::Error::other("a fresh spill directory is locked by another process")
                }
            })?;
            spill_dir = Some((own, lock));
        }
        Ok(PrefixCache {
            opts,
            spill_dir,
            entries: Vec::new(),
            clock: 0,
            files: 0,
            stats: PrefixCacheStats::default(),
        })
    }

    pub fn enabled(&self) -> bool {
        self.opts.ram_bytes > 0 || (self.opts.disk_dir.is_some() && self.opts.disk_bytes > 0)
    }

    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            entries: self.entries.len(),
            ..self.stats
        }
    }

    /// Length of the longest cached prefix of `prompt` no longer than
    /// `max_len` (without loading it).
    pub fn longest(&self, prompt: &[u32], max_len: usize) -> usize {
        self.best(prompt, max_len)
            .map_or(0, |i| self.entries[i].tokens.len())
    }

    fn best(&self, prompt: &[u32], max_len: usize) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() <= max_len && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i)
    }

    /// The snapshot of the longest cached prefix of `prompt` (at most
    /// `max_len` tokens) and its length. Counts a hit or a miss.
    pub fn get(&mut self, prompt: &[u32], max_len: usize) -> Option<(usize, Arc<[u8]>)> {
        let Some(i) = self.best(prompt, max_len) else {
            self.stats.misses += 1;
            return None;
        };
        self.clock += 1;
        self.entries[i].last_used = self.clock;
        let bytes = match &self.entries[i].data {
            Stored::Ram(b) => b.clone(),
            Stored::Disk(path) => match read(path, &self.entries[i].tokens) {
                Ok(b) => b.into(),
                Err(_) => {
                    self.remove(i);
                    self.stats.misses += 1;
                    return None;
                }
            },
        };
        self.stats.hits += 1;
        Some((self.entries[i].tokens.len(), bytes))
    }

    /// Counts a lookup the cache could not improve on.
    pub fn note_miss(&mut self) {
        self.stats.misses += 1;
    }

    /// Drops the entry of exactly these tokens (its snapshot did not load,
    /// or a job that started from it failed).
    pub fn discard(&mut self, tokens: &[u32]) {
        if let Some(i) = self.entries.iter().position(|e| e.tokens == tokens) {
            self.remove(i);
        }
    }

    /// Whether exactly these tokens are cached.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// Adds the snapshot of the state after `tokens`, evicting the least
    /// recently used entries (to disk, then out) to stay within budget.
    pub fn insert(&mut self, tokens: Vec<u32>, snapshot: Vec<u8>) {
        if tokens.is_empty() || !self.enabled() {
            return;
        }
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.tokens == tokens) {
            e.last_used = self.clock;
            return;
        }
        let size = snapshot.len() as u64;
        self.entries.push(Entry {
            tokens,
            data: Stored::Ram(snapshot.into()),
            size,
            last_used: self.clock,
        });
        self.stats.ram_bytes += size;
        if size > self.opts.ram_bytes {
            // Larger than the RAM budget: straight to disk, or not kept,
            // rather than evicting everything else for it.
            self.spill(self.entries.len() - 1);
        }
        self.enforce();
    }

    fn enforce(&mut self) {
        while self.stats.ram_bytes > self.opts.ram_bytes {
            let Some(i) = self.lru(|s| matches!(s, Stored::Ram(_))) else {
                break;
            };
            self.spill(i);
        }
        while self.stats.disk_bytes > self.opts.disk_bytes || self.entries.len() > MAX_ENTRIES {
            let disk = self.lru(|s| matches!(s, Stored::Disk(_)));
            let Some(i) = disk.or_else(|| self.lru(|_| true)) else {
                break;
            };
            self.remove(i);
        }
    }

    fn lru(&self, pick: impl Fn(&Stored) -> bool) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| pick(&e.data))
            .min_by_key(|(_, e)| e.last_used)
            .map(|(i, _)| i)
    }

    /// Moves entry `i` from RAM to the spill directory, or drops it.
    fn spill(&mut self, i: usize) {
        let Stored::Ram(bytes) = &self.entries[i].data else {
            return;
        };
        let size = self.entries[i].size;
        let written = match &self.spill_dir {
            Some((dir, _)) if size <= self.opts.disk_bytes => {
                self.files += 1;
                let path = dir.join(format!("{}.snap", self.files));
                write(&path, &self.entries[i].tokens, bytes)
                    .ok()
                    .map(|()| path)
            }
            _ => None,
        };
        self.stats.ram_bytes -= size;
        match written {
            Some(path) => {
                self.entries[i].data = Stored::Disk(path);
                self.stats.disk_bytes += size;
            }
            None => {
                self.entries.swap_remove(i);
            }
        }
    }

    fn remove(&mut self, i: usize) {
        let e = self.entries.swap_remove(i);
        match e.data {
            Stored::Ram(_) => self.stats.ram_bytes -= e.size,
            Stored::Disk(path) => {
                self.stats.disk_bytes -= e.size;
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

/// Whether nobody holds the lock of a server's spill subdirectory.
fn is_abandoned(dir: &Path) -> bool {
    match File::open(dir.join(LOCK_FILE)) {
        Ok(f) => f.try_lock().is_ok(),
        // No lock file: a server that died while making the directory.
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

fn write(path: &Path, tokens: &[u32], bytes: &[u8]) -> moeflux::Result<()> {
    moeflux::fsutil::write_file_atomic(path, |w| {
        w.write_all(MAGIC)?;
        w.write_all(&(tokens.len() as u64).to_le_bytes())?;
        for t in tokens {
            w.write_all(&t.to_le_bytes())?;
        }
        w.write_all(&(bytes.len() as u64).to_le_bytes())?;
        w.write_all(bytes)
    })
}

/// The snapshot of a spill file, if the file is whole and was saved after
/// exactly `tokens`.
fn read(path: &Path, tokens: &[u32]) -> std::io::Result<Vec<u8>> {
    let bad = |what: &str| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {what}", path.display()),
        )
    };
    let mut f = std::io::BufReader::new(File::open(path)?);
    let mut word = [0u8; 8];
    f.read_exact(&mut word)?;
    if &word != MAGIC {
        return Err(bad("not a moeflux prefix snapshot"));
    }
    f.read_exact(&mut word)?;
    if u64::from_le_bytes(word) != tokens.len() as u64 {
        return Err(bad("saved after another prefix"));
    }
    let mut t = [0u8; 4];
    for &want in tokens {
        f.read_exact(&mut t)?;
        if u32::from_le_bytes(t) != want {
            return Err(bad("saved after another prefix"));
        }
    }
    f.read_exact(&mut word)?;
    let len = u64::from_le_bytes(word);
    let mut data = Vec::new();
    f.take(len.saturating_add(1)).read_to_end(&mut data)?;
    if data.len() as u64 != len {
        return Err(bad("the snapshot is cut short or too long"));
    }
    Ok(data)
}

impl Drop for PrefixCache {
    fn drop(&mut self) {
        if let Some((dir, _lock)) = &self.spill_dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(ram: u64, dir: Option<&Path>, disk: u64) -> PrefixCache {
        PrefixCache::new(PrefixCacheOptions {
            ram_bytes: ram,
            disk_dir: dir.map(Path::to_path_buf),
            disk_bytes: disk,
        })
        .unwrap()
    }

    #[test]
    fn longest_prefix_wins_within_max_len() {
        let mut c = cache(1000, None, 0);
        c.insert(vec![1, 2], vec![12; 10]);
        c.insert(vec![1, 2, 3, 4], vec![34; 10]);
        c.insert(vec![9], vec![9; 10]);
        assert_eq!(
            c.get(&[1, 2, 3, 4, 5], 10),
            Some((4, vec![34u8; 10].into()))
        );
        // The whole prompt is not a usable prefix when capped below it.
        assert_eq!(c.get(&[1, 2, 3, 4], 3), Some((2, vec![12u8; 10].into())));
        assert_eq!(c.get(&[1, 3], 10), None);
        assert_eq!(c.longest(&[1, 2, 3, 4, 0], 10), 4);
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries, s.ram_bytes), (2, 1, 3, 30));
    }

    #[test]
    fn ram_budget_evicts_least_recently_used() {
        let mut c = cache(25, None, 0);
        c.insert(vec![1], vec![0; 10]);
        c.insert(vec![2], vec![0; 10]);
        assert!(c.get(&[1, 5], 9).is_some()); // [1] is now the most recent
        c.insert(vec![3], vec![0; 10]);
        assert!(c.contains(&[1]) && c.contains(&[3]) && !c.contains(&[2]));
        assert_eq!(c.stats().ram_bytes, 20);
        // Too big for the budget at all: not kept.
        c.insert(vec![4], vec![0; 30]);
        assert!(!c.contains(&[4]));
        assert!(c.contains(&[1]) && c.contains(&[3]));
        assert_eq!(c.stats().ram_bytes, 20);
    }

    #[test]
    fn spills_to_disk_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cache(10, Some(dir.path()), 25);
        c.insert(vec![1], vec![1; 10]);
        c.insert(vec![2], vec![2; 10]); // [1] spills
        c.insert(vec![3], vec![3; 10]); // [2] spills
        c.insert(vec![4], vec![4; 10]); // [3] spills, [1] dropped from disk
        let s = c.stats();
        assert_eq!((s.entries, s.ram_bytes, s.disk_bytes), (3, 10, 20));
        assert!(!c.contains(&[1]));
        assert_eq!(c.get(&[2, 0], 5), Some((1, vec![2u8; 10].into())));
        assert_eq!(c.get(&[4], 5), Some((1, vec![4u8; 10].into())));
        let own = std::fs::read_dir(dir.path())
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        let files = std::fs::read_dir(&own).unwrap().count();
        assert_eq!(files, 3); // two snapshots and the lock
        drop(c);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    fn spill_files(dir: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for sub in std::fs::read_dir(dir).unwrap().flatten() {
            for f in std::fs::read_dir(sub.path()).unwrap().flatten() {
                if f.path().extension().is_some_and(|e| e == "snap") {
                    out.push(f.path());
                }
            }
        }
        out.sort();
        out
    }

    /// Two caches on one directory keep apart; one starting does not
    /// remove the other's files, but does remove a dead server's.
    #[test]
    fn shared_directory_is_not_clobbered() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join(format!("{FILE_PREFIX}1-dead"));
        std::fs::create_dir(&stale).unwrap();
        std::fs::write(stale.join(LOCK_FILE), b"").unwrap();
        std::fs::write(stale.join("1.snap"), b"old").unwrap();
        let mut a = cache(0, Some(dir.path()), 100);
        assert!(!stale.exists());
        a.insert(vec![1], vec![1; 10]);
        let mut b = cache(0, Some(dir.path()), 100);
        b.insert(vec![2], vec![2; 10]);
        assert_eq!(spill_files(dir.path()).len(), 2);
        assert_eq!(a.get(&[1, 0], 5), Some((1, vec![1u8; 10].into())));
        assert_eq!(b.get(&[2, 0], 5), Some((1, vec![2u8; 10].into())));
        drop(a);
        assert_eq!(b.get(&[2, 0], 5), Some((1, vec![2u8; 10].into())));
    }

    /// A spill file of another prefix, or cut short, is dropped, not
    /// returned.
    #[test]
    fn mismatched_or_short_spill_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = cache(0, Some(dir.path()), 100);
        c.insert(vec![1, 2], vec![1; 10]);
        c.insert(vec![3, 4], vec![2; 10]);
        let files = spill_files(dir.path());
        // The first now holds the second's prefix; the second is cut short.
        let y = std::fs::read(&files[1]).unwrap();
        std::fs::write(&files[0], &y).unwrap();
        std::fs::write(&files[1], &y[..y.len() - 1]).unwrap();
        assert_eq!(c.get(&[1, 2, 9], 5), None);
        assert_eq!(c.get(&[3, 4, 9], 5), None);
        assert_eq!(c.stats().entries, 0);
        assert!(spill_files(dir.path()).is_empty());
    }

    #[test]
    fn disabled_cache_keeps_nothing() {
        let mut c = cache(0, None, 0);
        assert!(!c.enabled());
        c.insert(vec![1], vec![0; 1]);
        assert_eq!(c.stats().entries, 0);
        assert!(c.get(&[1, 2], 5).is_none());
    }
}
