//! The VRAM expert cache: a fixed number of expert-sized slots in one device
//! allocation, filled on demand from the expert files through pinned staging
//! buffers on the copy stream.
//!
//! Replacement is LFU with dynamic aging (LFU-DA) by default: a slot's
//! priority is the priority of the last evicted slot plus the number of
//! times its expert was used since it came in, so experts that are popular
//! stay while the aging floor lets a once-popular expert leave eventually.
//! LRU is there to compare against (`CachePolicy::Lru`).

use std::collections::{BTreeSet, HashMap};

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
    /// Experts uploaded ahead on a predicted choice (`--prefetch`).
    pub prefetched: u64,
    /// Of those, the ones a layer then used.
    pub prefetch_hits: u64,
    /// Missing experts the host computed instead of uploading them.
    pub cpu_computed: u64,
}

impl CacheStats {
    /// Counts since `earlier`.
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            uploaded_bytes: self.uploaded_bytes - earlier.uploaded_bytes,
            prefetched: self.prefetched - earlier.prefetched,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            cpu_computed: self.cpu_computed - earlier.cpu_computed,
        }
    }

    pub fn plus(&self, o: &CacheStats) -> CacheStats {
        CacheStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            uploaded_bytes: self.uploaded_bytes + o.uploaded_bytes,
            prefetched: self.prefetched + o.prefetched,
            prefetch_hits: self.prefetch_hits + o.prefetch_hits,
            cpu_computed: self.cpu_computed + o.cpu_computed,
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

/// Per model layer, the registration pinning its mapped expert file
/// (portable, so every GPU of the process copies from it).
pub type HostTier = std::sync::Arc<Vec<Option<Pinned>>>;

pub struct ExpertCache {
    slots: DevBuf,
    extent: usize,
    n_slots: usize,
    owner: Vec<Option<(usize, usize)>>,
    index: HashMap<(usize, usize), usize>,
    policy: CachePolicy,
    prio: Vec<u64>,
    uses: Vec<u64>,
    /// Occupied slots by (priority, slot): the first is the next victim.
    order: BTreeSet<(u64, usize)>,
    /// Slots holding nothing.
    free: Vec<usize>,
    floor: u64,
    clock: u64,
    staging: Vec<Staged>,
    /// The host tier: per model layer, the registration that pins its
    /// mapped expert file (misses of such layers are copied straight from
    /// it at full PCIe speed); shared by the GPUs of a group.
    host: HostTier,
    /// Once every expert is resident: per model layer, `num_experts` device
    /// addresses (the router kernel looks experts up here, no host trip).
    table: Option<(DevBuf, usize)>,
    /// Slots the last `ensure` handed out: the compute stream may still be
    /// reading them, so a prefetch must not overwrite them.
    in_use: Vec<usize>,
    /// Slots filled by a prefetch and not used since.
    prefetched: Vec<bool>,
    /// Prefetch copies the compute stream has not been ordered after yet.
    copies_pending: bool,
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
            prio: vec![0; n_slots],
            uses: vec![0; n_slots],
            order: BTreeSet::new(),
            free: (0..n_slots).rev().collect(),
            floor: 0,
            clock: 0,
            staging,
            host: HostTier::default(),
            table: None,
            in_use: Vec::new(),
            prefetched: vec![false; n_slots],
            copies_pending: false,
            stats: CacheStats::default(),
        })
    }

    /// Uploads every expert of every layer that `owns(layer, expert)` (all
    /// of them on one GPU; a GPU's shard in a group) when they all fit, and
    /// builds the address table (0 for experts another GPU owns, which the
    /// per-slot kernels skip), so decode never leaves the GPU. Returns
    /// whether it did.
    pub fn preload_all(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        num_layers: usize,
        num_experts: usize,
        owns: impl Fn(usize, usize) -> bool,
    ) -> Result<bool> {
        let layers: Vec<(usize, Vec<usize>)> = store
            .layers()
            .map(|l| (l, (0..num_experts).filter(|&e| owns(l, e)).collect()))
            .collect();
        if layers.iter().map(|(_, ids)| ids.len()).sum::<usize>() > self.n_slots {
            return Ok(false);
        }
        let mut table = vec![0u64; num_layers * num_experts];
        for (l, ids) in &layers {
            let ptrs = self.ensure(gpu, store, *l, ids)?;
            for (&e, p) in ids.iter().zip(ptrs) {
                table[l * num_experts + e] = p;
            }
        }
        gpu.copy
            .synchronize()
            .map_err(|e| Error::Gpu(format!("expert upload: {e}")))?;
        self.stats = CacheStats::default();
        self.table = Some((DevBuf::from_slice(gpu, &table)?, num_experts));
        Ok(true)
    }

    /// Whether every expert is resident (the address table exists).
    pub fn all_resident(&self) -> bool {
        self.table.is_some()
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

    /// Counts a use of occupied slot `s` and updates its priority.
    fn touch(&mut self, s: usize) {
        self.order.remove(&(self.prio[s], s));
        self.clock += 1;
        self.uses[s] += 1;
        self.prio[s] = match self.policy {
            CachePolicy::LfuDa => self.floor + self.uses[s],
            CachePolicy::Lru => self.clock,
        };
        self.order.insert((self.prio[s], s));
    }

    /// A slot to overwrite: an empty one, else the lowest priority one not
    /// in `busy` (used by the current call); it is left empty.
    fn take_victim(&mut self, busy: &[bool]) -> usize {
        if let Some(s) = self.free.pop() {
            return s;
        }
        let &(p, s) = self
            .order
            .iter()
            .find(|(_, s)| !busy[*s])
            .expect("ids.len() <= n_slots leaves a slot this call does not use");
        self.order.remove(&(p, s));
        if let Some(old) = self.owner[s].take() {
            self.index.remove(&old);
        }
        self.prefetched[s] = false;
        if self.policy == CachePolicy::LfuDa {
            self.floor = p;
        }
        s
    }

    /// Forgets what slot `s` holds.
    fn invalidate(&mut self, s: usize) {
        self.prefetched[s] = false;
        if let Some(k) = self.owner[s].take() {
            self.index.remove(&k);
            self.order.remove(&(self.prio[s], s));
            self.free.push(s);
        }
    }

    /// Pins the mapped expert files of as many layers as fit in `budget`
    /// bytes (in layer order) as the host tier; returns the layers and
    /// bytes pinned. Needs the store opened with mappings.
    pub fn pin_host_tier(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        budget: u64,
    ) -> Result<(usize, u64)> {
        let (mut layers, mut bytes) = (0, 0u64);
        let mut host: Vec<Option<Pinned>> = Vec::new();
        for l in store.layers() {
            let Some(map) = store.mapping(l) else {
                break;
            };
            if bytes + map.len() as u64 > budget {
                break;
            }
            let pin = Pinned::register_read_only(gpu, map).map_err(|e| {
                Error::Gpu(format!(
                    "pinning the expert file of layer {l} ({:.2} GB) as the host tier: {e} \
                     (lower --host-cache, or raise the locked-memory limit)",
                    map.len() as f64 / 1e9
                ))
            })?;
            if host.len() <= l {
                host.resize_with(l + 1, || None);
            }
            host[l] = Some(pin);
            layers += 1;
            bytes += map.len() as u64;
        }
        self.host = HostTier::new(host);
        Ok((layers, bytes))
    }

    /// The host tier, to share with another GPU's cache.
    pub fn host_tier(&self) -> HostTier {
        self.host.clone()
    }

    /// Uses a host tier another GPU's cache pinned.
    pub fn share_host_tier(&mut self, tier: HostTier) {
        self.host = tier;
    }

    /// Whether `layer`'s expert files are pinned in host RAM.
    pub fn host_pinned(&self, layer: usize) -> bool {
        self.host.get(layer).is_some_and(|p| p.is_some())
    }

    /// Whether expert `e` of `layer` has a slot (resident, or a prefetch
    /// on its way).
    pub fn is_resident(&self, layer: usize, e: usize) -> bool {
        self.index.contains_key(&(layer, e))
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
                    if std::mem::take(&mut self.prefetched[s]) {
                        self.stats.prefetch_hits += 1;
                    }
                }
                None => misses.push(i),
            }
        }
        // Hits first (so a victim is never one this call uses).
        let mut busy = vec![false; self.n_slots];
        for &s in slot_of.iter().filter(|&&s| s != usize::MAX) {
            busy[s] = true;
            self.touch(s);
        }
        for &i in &misses {
            let victim = self.take_victim(&busy);
            busy[victim] = true;
            self.uses[victim] = 0;
            self.owner[victim] = Some((layer, ids[i]));
            self.index.insert((layer, ids[i]), victim);
            self.touch(victim);
            slot_of[i] = victim;
            self.stats.misses += 1;
        }
        if misses.is_empty() && self.copies_pending {
            // Hits may be prefetches still on their way.
            stream_wait(&gpu.stream, &gpu.copy)?;
        }
        // Misses are ordered after every earlier copy, prefetches included.
        self.upload(gpu, store, layer, ids, &misses, &slot_of)?;
        self.copies_pending = false;
        self.in_use = slot_of.clone();
        Ok(slot_of.iter().map(|&s| self.slot_ptr(s)).collect())
    }

    /// Starts uploading experts `ids` of `layer` that are not resident, on
    /// a predicted choice, without making the compute stream wait: the next
    /// `ensure` orders it after them. Only for host-tier layers (a copy
    /// straight from pinned memory; staging reads would block the host).
    /// Never overwrites the slots the last `ensure` handed out. Returns how
    /// many uploads it started.
    pub fn prefetch(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
    ) -> Result<usize> {
        if !self.host_pinned(layer) || self.table.is_some() {
            return Ok(0);
        }
        let mut busy = vec![false; self.n_slots];
        for &s in &self.in_use {
            busy[s] = true;
        }
        let mut room = self.n_slots - self.in_use.len();
        let mut started = 0;
        for &e in ids {
            if room == 0 {
                break;
            }
            if self.index.contains_key(&(layer, e)) {
                continue;
            }
            let s = self.take_victim(&busy);
            busy[s] = true;
            room -= 1;
            self.uses[s] = 0;
            self.owner[s] = Some((layer, e));
            self.index.insert((layer, e), s);
            self.touch(s);
            self.prefetched[s] = true;
            let src = store.mapped(layer, e).expect("host-tier layers are mapped");
            // SAFETY: the mapping is pinned and read-only and outlives the
            // copy; slot `s` is not in use by queued compute (`in_use`), and
            // the next `ensure` orders the compute stream after this copy.
            unsafe { copy_htod_async(&gpu.copy, self.slot_ptr(s), src)? };
            self.stats.uploaded_bytes += self.extent as u64;
            self.stats.prefetched += 1;
            self.copies_pending = true;
            started += 1;
        }
        Ok(started)
    }

    /// Copies the missing experts to their slots on the copy stream: from
    /// the host tier directly, else read into pinned staging buffers a wave
    /// at a time (or, for a mapped store, from the mapping) and copied as
    /// each lands. The compute stream waits for the copies.
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
        if self.host_pinned(layer) {
            for &i in misses {
                let src = store
                    .mapped(layer, ids[i])
                    .expect("host-tier layers are mapped");
                // SAFETY: the mapping is pinned and read-only; it lives as
                // long as the store, which outlives the copy (the compute
                // stream waits for it below).
                unsafe { copy_htod_async(&gpu.copy, self.slot_ptr(slot_of[i]), src)? };
                self.stats.uploaded_bytes += extent as u64;
            }
            return stream_wait(&gpu.stream, &gpu.copy);
        }
        let mapped = store.is_mapped(layer) == Some(true);
        for wave in misses.chunks(STAGING) {
            let wave_ids: Vec<usize> = wave.iter().map(|&i| ids[i]).collect();
            let staged: Vec<Staged> = if mapped {
                Vec::new()
            } else {
                self.staging.drain(..wave.len()).collect()
            };
            let (pins, bufs): (Vec<Pinned>, Vec<ExpertBuf>) =
                staged.into_iter().map(|s| (s.pin, s.buf)).unzip();
            // The request is valid by construction (ids from the router, one
            // buffer each unless mapped), so the buffers come back.
            let mut fetch = store.fetch(layer, &wave_ids, bufs)?;
            let mut landed_bufs: Vec<Option<ExpertBuf>> = (0..wave.len()).map(|_| None).collect();
            let mut first_err = None;
            while let Some(l) = fetch.next_landed() {
                if let Err(e) = l.result {
                    first_err.get_or_insert(e);
                } else {
                    let dst = self.slot_ptr(slot_of[wave[l.index]]);
                    let src = match &l.buf {
                        Some(buf) => &buf.as_bytes()[..extent],
                        None => store
                            .mapped(layer, wave_ids[l.index])
                            .expect("a mapped layer serves its extents"),
                    };
                    // SAFETY: a staging buffer is pinned and not touched
                    // again until the copy stream is synchronised below; a
                    // mapping outlives the copy.
                    unsafe { copy_htod_async(&gpu.copy, dst, src)? };
                    self.stats.uploaded_bytes += extent as u64;
                }
                landed_bufs[l.index] = l.buf;
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
                    self.invalidate(slot_of[i]);
                }
                return Err(e);
            }
        }
        stream_wait(&gpu.stream, &gpu.copy)
    }
}
