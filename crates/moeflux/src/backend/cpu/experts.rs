//! What the CPU's MoE blocks of one forward pass share: the expert store,
//! the pool of read buffers, the experts per token, and the speculative
//! prefetch in flight (see [`crate::backend::prefetch`]; on the CPU it is
//! off unless asked for, and counted in [`PrefetchStats`]).

use crate::backend::cpu::repack::RepackedExperts;
use crate::backend::prefetch::PrefetchStats;
use crate::error::Result;
use crate::io::{ExpertBuf, ExpertStore, Fetch};

/// Experts of one layer fetched ahead, still in flight or landed.
pub struct Prefetched {
    pub layer: usize,
    pub ids: Vec<usize>,
    pub fetch: Fetch,
}

/// The expert-side state of one forward pass.
pub struct ExpertRun<'a> {
    pub store: &'a ExpertStore,
    /// Reusable read buffers (unused for mapped layers).
    pub bufs: &'a mut Vec<ExpertBuf>,
    /// Routed experts per token.
    pub k: usize,
    /// Fetch the next MoE layer's experts ahead.
    pub prefetch: bool,
    pub pending: Option<Prefetched>,
    pub stats: &'a mut PrefetchStats,
    /// Layers whose experts are held interleaved in RAM (not fetched).
    pub repacked: Option<&'a RepackedExperts>,
}

impl ExpertRun<'_> {
    /// Starts fetching `ids` of `layer`, with `extent`-byte buffers from the
    /// pool unless the layer is mapped.
    pub fn start_fetch(&mut self, layer: usize, ids: &[usize], extent: usize) -> Result<Fetch> {
        let mut mine = Vec::new();
        if self.store.is_mapped(layer) != Some(true) {
            self.bufs.retain(|b| b.len() >= extent);
            while self.bufs.len() < ids.len() {
                self.bufs.push(ExpertBuf::new(extent));
            }
            mine = self.bufs.split_off(self.bufs.len() - ids.len());
        }
        self.store.fetch(layer, ids, mine)
    }

    /// Takes the prefetch made for `layer`, if any; an older one (for a
    /// layer that never came) is dropped.
    pub fn take_prefetch(&mut self, layer: usize) -> Option<Prefetched> {
        self.pending.take().filter(|p| p.layer == layer)
    }

    /// Counts a layer's use of its prefetch: `used` experts, of which those
    /// in `prefetched` were hits.
    pub fn count(&mut self, used: &[usize], prefetched: &[usize]) {
        self.stats.used += used.len() as u64;
        self.stats.hits += used.iter().filter(|e| prefetched.contains(e)).count() as u64;
    }
}
