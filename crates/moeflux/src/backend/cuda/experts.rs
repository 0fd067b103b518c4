//! The VRAM expert cache: a fixed number of expert-sized slots in one device
//! allocation, filled on demand from the expert files through pinned staging
//! buffers on the copy stream.
//!
//! Replacement is LFU with dynamic aging (LFU-DA) by default: a slot's
//! priority is the priority of the last evicted slot plus the number of
//! times its expert was used since it came in, so experts that are popular
//! stay while the aging floor lets a once-popular expert leave eventually.
//! LRU is there to compare against (`CachePolicy::Lru`).

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::io::{ExpertBuf, ExpertStore};

use super::device::{copy_htod_async, stream_wait, DevBuf, Gpu, Pinned};

/// How the cache picks the slot to overwrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Least frequently used with dynamic aging.
    #[default]
    LfuDa,
    /// Least recently used.
    Lru,
}

impl CachePolicy {
    pub fn parse(s: &str) -> Option<CachePolicy> {
        match s {
            "lfu" | "lfu-da" => Some(CachePolicy::LfuDa),
            "lru" => Some(CachePolicy::Lru),
            _ => None,
        }
    }
}

/// Cumulative counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Experts a layer needed that were resident.
    pub hits: u64,
    /// Experts that had to be read and uploaded.
    pub misses: u64,
    pub uploaded_bytes: u64,
}

impl CacheStats {
    /// Counts since `earlier`.
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            uploaded_bytes: self.uploaded_bytes - earlier.uploaded_bytes,
        }
    }

    pub fn plus(&self, o: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            uploaded_bytes: self.uploaded_bytes + o.uploaded_bytes,
        }
    }

    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }
}

/// Staging buffers reused for uploads (a wave of reads at a time).
const STAGING: usize = 16;

/// A host buffer registered as pinned; the registration is dropped first.
struct Staged {
    pin: Pinned,
    buf: ExpertBuf,
}

impl Staged {
    fn new(gpu: &Gpu, extent: usize) -> Result<Staged> {
        let mut buf = ExpertBuf::new(extent);
        let pin = Pinned::register(gpu, buf.as_bytes_mut())?;
        Ok(Staged { pin, buf })
    }
}

pub struct ExpertCache {
    slots: DevBuf,
    extent: usize,
    n_slots: usize,
    owner: Vec<Option<(usize, usize)>>,
    index: HashMap<(usize, usize), usize>,
    policy: CachePolicy,
    prio: Vec<f64>,
    uses: Vec<u64>,
    floor: f64,
    clock: u64,
    staging: Vec<Staged>,
    /// Once every expert is resident: per model layer, `num_experts` device
    /// addresses (the router kernel looks experts up here, no host trip).
    table: Option<(DevBuf, usize)>,
    pub stats: CacheStats,
}

impl ExpertCache {
    /// `budget` bytes of slots of `extent` bytes each; at least `min_slots`
    /// (every expert one layer may need at once) must fit.
    pub fn new(
        gpu: &Gpu,
        budget: usize,
        extent: usize,
        min_slots: usize,
        policy: CachePolicy,
    ) -> Result<ExpertCache> {
        let n_slots = budget / extent;
        if n_slots < min_slots {
            return Err(Error::Gpu(format!(
                "the GPU expert cache needs room for at least {min_slots} experts of {} MB \
                 ({:.2} GB); {:.2} GB was given (raise --gpu-memory or free GPU memory)",
                extent as f64 / 1e6,
                (min_slots * extent) as f64 / 1e9,
                budget as f64 / 1e9
            )));
        }
        let slots = DevBuf::zeros(gpu, n_slots * extent)?;
        let staging = (0..STAGING)
            .map(|_| Staged::new(gpu, extent))
            .collect::<Result<Vec<_>>>()?;
        Ok(ExpertCache {
            slots,
            extent,
            n_slots,
            owner: vec![None; n_slots],
            index: HashMap::new(),
            policy,
            prio: vec![0.0; n_slots],
            uses: vec![0; n_slots],
            floor: 0.0,
            clock: 0,
            staging,
            table: None,
            stats: CacheStats::default(),
        })
    }

    /// Uploads every expert of `layers` (when they all fit) and builds the
    /// address table, so decode never leaves the GPU. Returns whether it
    /// did.
    pub fn preload_all(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        num_layers: usize,
        num_experts: usize,
    ) -> Result<bool> {
        let layers: Vec<usize> = store.layers().collect();
        if layers.len() * num_experts > self.n_slots {
            return Ok(false);
        }
        let all: Vec<usize> = (0..num_experts).collect();
        let mut table = vec![0u64; num_layers * num_experts];
        for &l in &layers {
            let ptrs = self.ensure(gpu, store, l, &all)?;
            table[l * num_experts..(l + 1) * num_experts].copy_from_slice(&ptrs);
        }
        gpu.copy
            .synchronize()
            .map_err(|e| Error::Gpu(format!("expert upload: {e}")))?;
        self.stats = CacheStats::default();
        self.table = Some((DevBuf::from_slice(gpu, &table)?, num_experts));
        Ok(true)
    }

    /// Device address of layer `layer`'s row of the address table, once
    /// every expert is resident.
    pub fn table_row(&self, layer: usize) -> Option<u64> {
        self.table
            .as_ref()
            .map(|(t, e)| t.ptr() + (8 * layer * e) as u64)
    }

    /// Counts a resident layer's expert uses (the table path bypasses
    /// `ensure`).
    pub fn count_hits(&mut self, n: u64) {
        self.stats.hits += n;
    }

    pub fn slots(&self) -> usize {
        self.n_slots
    }

    fn slot_ptr(&self, s: usize) -> u64 {
        self.slots.ptr() + (s * self.extent) as u64
    }

    fn touch(&mut self, s: usize) {
        self.clock += 1;
        self.uses[s] += 1;
        self.prio[s] = match self.policy {
            CachePolicy::LfuDa => self.floor + self.uses[s] as f64,
            CachePolicy::Lru => self.clock as f64,
        };
    }

    /// Makes experts `ids` of `layer` resident and returns their device
    /// addresses; the compute stream is ordered after their uploads.
    pub fn ensure(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
    ) -> Result<Vec<u64>> {
        if ids.len() > self.n_slots {
            return Err(Error::Gpu(format!(
                "layer {layer} needs {} experts at once but the GPU cache holds {}",
                ids.len(),
                self.n_slots
            )));
        }
        let mut slot_of = vec![usize::MAX; ids.len()];
        let mut misses = Vec::new();
        for (i, &e) in ids.iter().enumerate() {
            match self.index.get(&(layer, e)) {
                Some(&s) => {
                    slot_of[i] = s;
                    self.stats.hits += 1;
                }
                None => misses.push(i),
            }
        }
        // Victims: lowest priority among slots this call does not use.
        let mut busy = vec![false; self.n_slots];
        for &s in slot_of.iter().filter(|&&s| s != usize::MAX) {
            busy[s] = true;
        }
        for &i in &misses {
            let victim = (0..self.n_slots)
                .filter(|&s| !busy[s])
                .min_by(|&a, &b| {
                    // Empty slots first, then the lowest priority.
                    let ka = (self.owner[a].is_some(), self.prio[a]);
                    let kb = (self.owner[b].is_some(), self.prio[b]);
                    ka.partial_cmp(&kb).expect("priorities are finite")
                })
                .expect("ids.len() <= n_slots leaves a free slot");
            if let Some(old) = self.owner[victim].take() {
                self.index.remove(&old);
                if self.policy == CachePolicy::LfuDa {
                    self.floor = self.prio[victim];
                }
            }
            busy[victim] = true;
            self.uses[victim] = 0;
            self.owner[victim] = Some((layer, ids[i]));
            self.index.insert((layer, ids[i]), victim);
            slot_of[i] = victim;
            self.stats.misses += 1;
        }
        for &s in &slot_of {
            self.touch(s);
        }
        self.upload(gpu, store, layer, ids, &misses, &slot_of)?;
        Ok(slot_of.iter().map(|&s| self.slot_ptr(s)).collect())
    }

    /// Reads the missing experts into the staging buffers a wave at a time
    /// and copies each to its slot on the copy stream as it lands.
    fn upload(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
        misses: &[usize],
        slot_of: &[usize],
    ) -> Result<()> {
        if misses.is_empty() {
            return Ok(());
        }
        let extent = store.extent_bytes(layer);
        for wave in misses.chunks(STAGING) {
            let wave_ids: Vec<usize> = wave.iter().map(|&i| ids[i]).collect();
            let staged: Vec<Staged> = self.staging.drain(..wave.len()).collect();
            let (pins, bufs): (Vec<Pinned>, Vec<ExpertBuf>) =
                staged.into_iter().map(|s| (s.pin, s.buf)).unzip();
            // The request is valid by construction (ids from the router, one
            // buffer each), so the buffers come back through `fetch`.
            let mut fetch = store.fetch(layer, &wave_ids, bufs)?;
            let mut landed_bufs: Vec<Option<ExpertBuf>> = (0..wave.len()).map(|_| None).collect();
            let mut first_err = None;
            while let Some(l) = fetch.next_landed() {
                let buf = l.buf.expect("the GPU opens the expert store unmapped");
                if let Err(e) = l.result {
                    first_err.get_or_insert(e);
                } else {
                    let dst = self.slot_ptr(slot_of[wave[l.index]]);
                    // SAFETY: the buffer is pinned and is not touched again
                    // until the copy stream is synchronised below.
                    unsafe { copy_htod_async(&gpu.copy, dst, &buf.as_bytes()[..extent])? };
                    self.stats.uploaded_bytes += extent as u64;
                }
                landed_bufs[l.index] = Some(buf);
            }
            gpu.copy
                .synchronize()
                .map_err(|e| Error::Gpu(format!("expert upload: {e}")))?;
            for (buf, pin) in landed_bufs.into_iter().zip(pins) {
                let buf = buf.expect("every fetched expert lands");
                self.staging.push(Staged { pin, buf });
            }
            if let Some(e) = first_err {
                // The slots meant for this wave hold nothing valid.
                for &i in wave {
                    let s = slot_of[i];
                    if let Some(k) = self.owner[s].take() {
                        self.index.remove(&k);
                    }
                }
                return Err(e);
            }
        }
        stream_wait(&gpu.stream, &gpu.copy)
    }
}
