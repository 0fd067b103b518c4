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
    entries: Vec<Entry>,
    clock: u64,
    files: u64,
    stats: PrefixCacheStats,
}

/// Entries are matched by a linear scan; more than this are not worth it.
const MAX_ENTRIES: usize = 256;
const FILE_PREFIX: &str = "moeflux-prefix-";

impl PrefixCache {
    /// Creates the spill directory if one is set and removes snapshots a
    /// previous server left there.
    pub fn new(opts: PrefixCacheOptions) -> std::io::Result<PrefixCache> {
        if let Some(dir) = &opts.disk_dir {
            std::fs::create_dir_all(dir)?;
            for e in std::fs::read_dir(dir)?.flatten() {
                if e.file_name().to_string_lossy().starts_with(FILE_PREFIX) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(PrefixCache {
            opts,
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
            Stored::Disk(path) => match std::fs::read(path) {
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
        let written = match &self.opts.disk_dir {
            Some(dir) if size <= self.opts.disk_bytes => {
                self.files += 1;
                let path = dir.join(format!("{FILE_PREFIX}{}.snap", self.files));
                write(&path, bytes).ok().map(|()| path)
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

fn write(path: &Path, bytes: &[u8]) -> moeflux::Result<()> {
    moeflux::fsutil::write_file_atomic(path, |w| std::io::Write::write_all(w, bytes))
}

impl Drop for PrefixCache {
    fn drop(&mut self) {
        for e in &self.entries {
            if let Stored::Disk(path) = &e.data {
                let _ = std::fs::remove_file(path);
            }
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
        let files = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(files, 2);
        drop(c);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
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
