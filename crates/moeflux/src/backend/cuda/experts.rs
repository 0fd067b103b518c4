//! The VRAM expert cache: a fixed number of expert-sized slots in one device
//! allocation, filled on demand on the copy stream from the host tier
//! (`host_tier.rs`) when there is one, else from the expert files through
//! pinned staging buffers, or by cuFile straight into the slots (`gds.rs`).
//! Which slot to overwrite is `slots.rs`'s policy.
//!
//! With low-width misses (`--low-width-misses`), a miss is uploaded as the
//! expert's low-width copy and its slot marked low; the prefetch uploads
//! predicted experts at full width and replaces the low copies it finds,
//! so the critical path carries the small copies and the experts in use
//! settle at full width. A slot holds either width (a copy is smaller than
//! the expert); the MoE block runs each width's slots with its own layout.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::io::{ExpertBuf, ExpertStore};

use super::device::{copy_htod_async, stream_wait, DevBuf, Gpu, Pinned};
use super::gds::GdsReader;
use super::host_tier::{serve, Claim, PinnedArena, Source};
use super::read_ahead::ReadAhead;
pub use super::slots::CachePolicy;
use super::slots::Slots;

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
    /// Of the misses, those copied from the pinned host tier.
    pub host_hits: u64,
    /// Of the misses, those read from the expert files (the page cache or
    /// the disk), and their bytes.
    pub file_reads: u64,
    pub file_bytes: u64,
    /// Of the file reads, experts read a layer ahead on a predicted choice
    /// (`--prefetch` without a host tier), and those a layer then used.
    pub ahead_reads: u64,
    pub ahead_used: u64,
    /// File bytes the layers needed: the misses read when asked for, plus
    /// read-ahead experts once used (what a perfect predictor reads).
    pub needed_file_bytes: u64,
    /// Batches of misses read from the files (one per layer that missed),
    /// and the nanoseconds from issuing each to its last expert landing.
    pub read_batches: u64,
    pub read_ns: u64,
    /// Nanoseconds `ensure` waited for a layer's read-ahead to land and
    /// upload.
    pub ahead_wait_ns: u64,
    /// Of the misses, those uploaded as low-width copies
    /// (`--low-width-misses`).
    pub low_misses: u64,
    /// Of the hits, those on a slot holding a low-width copy.
    pub low_hits: u64,
    /// Low-width copies a prefetch replaced with the full-width expert.
    pub promoted: u64,
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
            host_hits: self.host_hits - earlier.host_hits,
            file_reads: self.file_reads - earlier.file_reads,
            file_bytes: self.file_bytes - earlier.file_bytes,
            ahead_reads: self.ahead_reads - earlier.ahead_reads,
            ahead_used: self.ahead_used - earlier.ahead_used,
            needed_file_bytes: self.needed_file_bytes - earlier.needed_file_bytes,
            read_batches: self.read_batches - earlier.read_batches,
            read_ns: self.read_ns - earlier.read_ns,
            ahead_wait_ns: self.ahead_wait_ns - earlier.ahead_wait_ns,
            low_misses: self.low_misses - earlier.low_misses,
            low_hits: self.low_hits - earlier.low_hits,
            promoted: self.promoted - earlier.promoted,
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
            host_hits: self.host_hits + o.host_hits,
            file_reads: self.file_reads + o.file_reads,
            file_bytes: self.file_bytes + o.file_bytes,
            ahead_reads: self.ahead_reads + o.ahead_reads,
            ahead_used: self.ahead_used + o.ahead_used,
            needed_file_bytes: self.needed_file_bytes + o.needed_file_bytes,
            read_batches: self.read_batches + o.read_batches,
            read_ns: self.read_ns + o.read_ns,
            ahead_wait_ns: self.ahead_wait_ns + o.ahead_wait_ns,
            low_misses: self.low_misses + o.low_misses,
            low_hits: self.low_hits + o.low_hits,
            promoted: self.promoted + o.promoted,
        }
    }

    /// A miss read from the files and uploaded, `bytes` long.
    fn count_miss_read(&mut self, bytes: u64) {
        self.uploaded_bytes += bytes;
        self.file_reads += 1;
        self.file_bytes += bytes;
        self.needed_file_bytes += bytes;
    }

    pub fn hit_rate(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| self.hits as f64 / n as f64)
    }

    /// The share of expert uses computed with a low-width copy
    /// (`--low-width-misses`).
    pub fn low_width_share(&self) -> Option<f64> {
        let n = self.hits + self.misses;
        (n > 0).then(|| (self.low_hits + self.low_misses) as f64 / n as f64)
    }
}

/// Where `ensure` put an expert: its slot's device address, and whether
/// the slot holds the expert's low-width copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resident {
    pub ptr: u64,
    pub low: bool,
}

/// Staging buffers reused for uploads (a wave of reads at a time).
const STAGING: usize = 16;

/// A host buffer registered as pinned; the registration is dropped first.
pub(super) struct Staged {
    pub pin: Pinned,
    pub buf: ExpertBuf,
}

impl Staged {
    fn new(gpu: &Gpu, extent: usize) -> Result<Staged> {
        let mut buf = ExpertBuf::new(extent);
        let pin = Pinned::register(gpu, buf.as_bytes_mut())?;
        Ok(Staged { pin, buf })
    }
}

/// The host tier (`--host-cache`, see `host_tier.rs`).
#[derive(Default)]
pub enum Tier {
    #[default]
    None,
    /// Per model layer, the registration pinning its mapped expert file
    /// (portable, so every GPU of the process copies from it).
    Layers(Vec<Option<Pinned>>),
    /// Pinned expert slots, filled from the files on a miss.
    Arena(Mutex<PinnedArena>),
}

/// The host tier, shared by the GPUs of a group: the experts, and (for
/// `--low-width-misses`) per model layer the registration pinning its
/// mapped file of low-width copies.
#[derive(Default)]
pub struct HostTiers {
    pub full: Tier,
    pub low: Vec<Option<Pinned>>,
}

pub type HostTier = Arc<HostTiers>;

/// What a host tier holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostTierInfo {
    /// Layers whose expert files are pinned whole.
    pub layers: usize,
    /// Expert slots of an arena tier.
    pub slots: usize,
    /// Bytes of host RAM pinned.
    pub bytes: u64,
    /// Layers whose files of low-width copies are pinned whole (their
    /// bytes are in `bytes`).
    pub low_layers: usize,
}

impl HostTierInfo {
    pub fn is_some(&self) -> bool {
        self.bytes > 0
    }
}

pub struct ExpertCache {
    slots: DevBuf,
    extent: usize,
    /// Which expert each slot holds, and the next victim.
    map: Slots,
    policy: CachePolicy,
    staging: Vec<Staged>,
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
    /// Arena slots that prefetch copies in flight read from: checked out
    /// until the copy stream is known to be done with them.
    held: Vec<(super::slots::Key, Claim<Pinned>)>,
    /// The next layer's predicted experts to read from the files once this
    /// layer's own reads are issued (`read_ahead`), and those reads.
    ahead_plan: Option<(usize, Vec<usize>)>,
    ahead: Option<ReadAhead>,
    /// Slots holding an expert read ahead from the files, not used since.
    ahead_slot: Vec<bool>,
    /// Misses of files read with `O_DIRECT` go straight to their slots
    /// through cuFile (`--gds`).
    gds: Option<Arc<GdsReader>>,
    /// Upload misses as the experts' low-width copies (`--low-width-misses`).
    low_misses: bool,
    /// Only those of misses the router weighs below this.
    low_below: Option<f32>,
    /// Slots holding a low-width copy.
    low: Vec<bool>,
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
            map: Slots::new(n_slots, policy),
            policy,
            staging,
            host: HostTier::default(),
            table: None,
            in_use: Vec::new(),
            prefetched: vec![false; n_slots],
            copies_pending: false,
            held: Vec::new(),
            ahead_plan: None,
            ahead: None,
            ahead_slot: vec![false; n_slots],
            gds: None,
            low_misses: false,
            low_below: None,
            low: vec![false; n_slots],
            stats: CacheStats::default(),
        })
    }

    /// From now on, uploads misses as the store's low-width copies (the
    /// store must have them attached); with `below`, only misses that
    /// the caller weighs below it (see [`ExpertCache::low_width_below`]).
    pub fn use_low_width_misses(&mut self, below: Option<f32>) {
        self.low_misses = true;
        self.low_below = below;
    }

    /// Whether misses are uploaded as low-width copies.
    pub fn uploads_low_width(&self) -> bool {
        self.low_misses
    }

    /// The routing weight from which a miss is uploaded at full width
    /// (`ensure`'s `full`), when low-width misses have one.
    pub fn low_width_below(&self) -> Option<f32> {
        self.low_below.filter(|_| self.low_misses)
    }

    /// Reads the misses of files opened with `O_DIRECT` through cuFile.
    pub fn use_gds(&mut self, reader: GdsReader) {
        self.gds = Some(Arc::new(reader));
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
        if layers.iter().map(|(_, ids)| ids.len()).sum::<usize>() > self.map.len() {
            return Ok(false);
        }
        let mut table = vec![0u64; num_layers * num_experts];
        for (l, ids) in &layers {
            let placed = self.ensure(gpu, store, *l, ids, &[])?;
            for (&e, r) in ids.iter().zip(placed) {
                table[l * num_experts + e] = r.ptr;
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
        self.map.len()
    }

    fn slot_ptr(&self, s: usize) -> u64 {
        self.slots.ptr() + (s * self.extent) as u64
    }

    /// An empty slot for a new expert, never one in `busy`.
    fn take_victim(&mut self, busy: &[bool]) -> usize {
        let s = self
            .map
            .take_victim(|s| busy[s])
            .expect("ids.len() <= n_slots leaves a slot this call does not use");
        self.prefetched[s] = false;
        self.ahead_slot[s] = false;
        self.low[s] = false;
        s
    }

    /// Forgets what slot `s` holds.
    fn invalidate(&mut self, s: usize) {
        self.prefetched[s] = false;
        self.ahead_slot[s] = false;
        self.low[s] = false;
        self.map.invalidate(s);
    }

    /// Sets up the host tier in `budget` bytes: when every expert file is
    /// mapped and they all fit, pins the mappings (misses are copied
    /// straight from them); else an arena of expert slots (at most one per
    /// expert) filled on misses. With low-width misses, the mapped files of
    /// the copies are pinned first when they fit (they serve the misses),
    /// and the experts get the rest. Returns what it holds.
    pub fn pin_host_tier(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        budget: u64,
    ) -> Result<HostTierInfo> {
        let copies = store.low_width().filter(|_| self.low_misses);
        let (low, low_bytes) = match copies.and_then(|c| mapped_bytes(c).map(|b| (c, b))) {
            Some((c, bytes)) if bytes <= budget => (pin_layers(gpu, c, "low-width copies")?, bytes),
            _ => (Vec::new(), 0),
        };
        let low_layers = low.iter().flatten().count();
        let budget = budget - low_bytes;
        if let Some(bytes) = mapped_bytes(store).filter(|&b| b <= budget) {
            let host = pin_layers(gpu, store, "expert file")?;
            let layers = host.iter().flatten().count();
            self.host = Arc::new(HostTiers {
                full: Tier::Layers(host),
                low,
            });
            return Ok(HostTierInfo {
                layers,
                slots: 0,
                bytes: bytes + low_bytes,
                low_layers,
            });
        }
        let experts: usize = store.layers().filter_map(|l| store.num_experts(l)).sum();
        let n = usize::try_from(budget / self.extent as u64)
            .unwrap_or(usize::MAX)
            .min(experts);
        if n == 0 {
            if low_layers > 0 {
                self.host = Arc::new(HostTiers {
                    full: Tier::None,
                    low,
                });
                return Ok(HostTierInfo {
                    bytes: low_bytes,
                    low_layers,
                    ..Default::default()
                });
            }
            return Err(Error::Invalid(format!(
                "--host-cache of {budget} bytes holds no expert ({:.2} MB each)",
                self.extent as f64 / 1e6
            )));
        }
        let bytes = (n * self.extent) as u64;
        let arena = PinnedArena::new(n, self.extent, self.policy, |buf| {
            Pinned::register_portable(gpu, buf.as_bytes_mut())
        })
        .map_err(|e| {
            Error::Gpu(format!(
                "pinning {n} expert slots ({:.2} GB) as the host tier: {e} \
                 (lower --host-cache, or raise the locked-memory limit)",
                bytes as f64 / 1e9
            ))
        })?;
        self.host = Arc::new(HostTiers {
            full: Tier::Arena(Mutex::new(arena)),
            low,
        });
        Ok(HostTierInfo {
            layers: 0,
            slots: n,
            bytes: bytes + low_bytes,
            low_layers,
        })
    }

    /// The host tier, to share with another GPU's cache.
    pub fn host_tier(&self) -> HostTier {
        self.host.clone()
    }

    /// Uses a host tier another GPU's cache set up.
    pub fn share_host_tier(&mut self, tier: HostTier) {
        self.host = tier;
    }

    /// Whether `layer`'s expert files are pinned whole in host RAM.
    pub fn host_pinned(&self, layer: usize) -> bool {
        matches!(&self.host.full, Tier::Layers(l) if l.get(layer).is_some_and(|p| p.is_some()))
    }

    /// Whether `layer`'s file of low-width copies is pinned whole.
    fn low_pinned(&self, layer: usize) -> bool {
        self.host.low.get(layer).is_some_and(|p| p.is_some())
    }

    /// Whether expert `e` of `layer` has a slot (resident, or a prefetch
    /// on its way).
    pub fn is_resident(&self, layer: usize, e: usize) -> bool {
        self.map.get((layer, e)).is_some()
    }

    /// Gives the arena slots that prefetch copies read from back, once the
    /// copy stream is done with them.
    fn release_held(&mut self, gpu: &Gpu) -> Result<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        gpu.copy
            .synchronize()
            .map_err(|e| Error::Gpu(format!("expert upload: {e}")))?;
        if let Tier::Arena(arena) = &self.host.full {
            let mut a = arena.lock().unwrap_or_else(|p| p.into_inner());
            for (key, claim) in self.held.drain(..) {
                a.check_in(key, claim, true);
            }
        }
        Ok(())
    }

    /// Makes experts `ids` of `layer` resident and returns where each is;
    /// the compute stream is ordered after their uploads. With low-width
    /// misses, `full[i]` asks for `ids[i]` at full width (missing `full`
    /// entries: no): its miss is uploaded as the expert, and a low-width
    /// copy of it already in a slot counts as a miss and is replaced there.
    pub fn ensure(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
        full: &[bool],
    ) -> Result<Vec<Resident>> {
        let n_slots = self.map.len();
        if ids.len() > n_slots {
            return Err(Error::Gpu(format!(
                "layer {layer} needs {} experts at once but the GPU cache holds {}",
                ids.len(),
                n_slots
            )));
        }
        self.release_held(gpu)?;
        self.land_read_ahead(gpu, store, layer, ids)?;
        let full_wanted = |i: usize| full.get(i).copied().unwrap_or(false);
        let mut slot_of = vec![usize::MAX; ids.len()];
        let mut misses = Vec::new();
        // Copies in a slot whose expert is wanted at full width.
        let mut replaced = Vec::new();
        for (i, &e) in ids.iter().enumerate() {
            match self.map.get((layer, e)) {
                Some(s) if self.low[s] && full_wanted(i) => {
                    slot_of[i] = s;
                    replaced.push(i);
                }
                Some(s) => {
                    slot_of[i] = s;
                    self.stats.hits += 1;
                    self.stats.low_hits += self.low[s] as u64;
                    if std::mem::take(&mut self.prefetched[s]) {
                        self.stats.prefetch_hits += 1;
                    }
                    if std::mem::take(&mut self.ahead_slot[s]) {
                        self.stats.ahead_used += 1;
                        self.stats.needed_file_bytes += store.extent_bytes(layer) as u64;
                    }
                }
                None => misses.push(i),
            }
        }
        // Hits first (so a victim is never one this call uses).
        let mut busy = vec![false; n_slots];
        for &s in slot_of.iter().filter(|&&s| s != usize::MAX) {
            busy[s] = true;
            self.map.touch(s);
        }
        for &i in &misses {
            let victim = self.take_victim(&busy);
            busy[victim] = true;
            self.map.assign(victim, (layer, ids[i]));
            self.low[victim] = self.low_misses && !full_wanted(i);
            slot_of[i] = victim;
            self.stats.low_misses += self.low[victim] as u64;
        }
        for &i in &replaced {
            self.low[slot_of[i]] = false;
        }
        misses.extend(replaced);
        self.stats.misses += misses.len() as u64;
        if misses.is_empty() && self.copies_pending {
            // Hits may be prefetches still on their way.
            stream_wait(&gpu.stream, &gpu.copy)?;
        }
        // Misses are ordered after every earlier copy, prefetches included;
        // the next layer's read-ahead starts once they are on their way
        // (here when there are none).
        if misses.is_empty() {
            self.start_read_ahead(gpu, store)?;
        }
        let (to_copy, to_expert): (Vec<usize>, Vec<usize>) =
            misses.iter().partition(|&&i| self.low[slot_of[i]]);
        if let Err(e) = self.upload(gpu, store, layer, ids, &to_expert, &slot_of) {
            for &i in &to_copy {
                self.invalidate(slot_of[i]);
            }
            return Err(e);
        }
        if !to_copy.is_empty() {
            let copies = store
                .low_width()
                .expect("low-width misses come with the copies attached");
            self.upload_low(gpu, copies, layer, ids, &to_copy, &slot_of)?;
        }
        self.start_read_ahead(gpu, store)?;
        self.copies_pending = false;
        self.in_use = slot_of.clone();
        Ok(slot_of
            .iter()
            .map(|&s| Resident {
                ptr: self.slot_ptr(s),
                low: self.low[s],
            })
            .collect())
    }

    /// Plans reading experts `ids` of `layer` (the next MoE layer's
    /// predicted choice) from the files, most wanted first: the reads start
    /// in the next `ensure`, right after its own, and land in VRAM slots
    /// when `layer`'s `ensure` comes. Only without a host tier (whose
    /// `prefetch` copies from pinned memory) and for files read into
    /// buffers (not mapped). Returns whether it planned.
    ///
    /// Measured slower on a disk that is bandwidth-bound (docs/PERFORMANCE.md,
    /// "The disk path"): a wrong guess costs disk time the layers need, and
    /// with a host tier it took the three-level decode from 28.4 to 21.3
    /// tok/s, so it is never on there and only on by `--prefetch on`.
    pub fn read_ahead(&mut self, store: &ExpertStore, layer: usize, ids: &[usize]) -> bool {
        let applies = self.table.is_none()
            && matches!(self.host.full, Tier::None)
            && store.is_mapped(layer) == Some(false);
        if applies {
            self.ahead_plan = Some((layer, ids.to_vec()));
        }
        applies
    }

    /// Issues the planned read-ahead: the planned experts that are not
    /// resident, one staging buffer each.
    fn start_read_ahead(&mut self, gpu: &Gpu, store: &ExpertStore) -> Result<()> {
        let Some((layer, ids)) = self.ahead_plan.take() else {
            return Ok(());
        };
        if self.ahead.is_some() {
            // An earlier one nobody landed (its layer never came): let it
            // finish and take its buffers back.
            self.drop_read_ahead();
        }
        let mut wanted: Vec<usize> = Vec::with_capacity(ids.len());
        for e in ids {
            if self.map.get((layer, e)).is_none() && !wanted.contains(&e) {
                wanted.push(e);
            }
        }
        if wanted.is_empty() {
            return Ok(());
        }
        while self.staging.len() < wanted.len() {
            self.staging.push(Staged::new(gpu, self.extent)?);
        }
        let staged = self.staging.split_off(self.staging.len() - wanted.len());
        self.ahead = ReadAhead::start(store, layer, wanted, staged);
        Ok(())
    }

    /// Waits for a read-ahead that is not for the layer asking and takes
    /// its buffers back.
    fn drop_read_ahead(&mut self) {
        if let Some(ahead) = self.ahead.take() {
            let back = ahead.finish(|_, _| {});
            self.staging.extend(back);
        }
    }

    /// Before `ensure` of `layer` looks up `ids`: the experts read ahead
    /// for `layer` go to VRAM slots (counted as prefetched), never to a
    /// slot queued compute may still read (`in_use`) or one `ids` hits.
    /// The copies are complete when this returns.
    fn land_read_ahead(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
    ) -> Result<()> {
        if self.ahead.as_ref().is_none_or(|a| a.layer != layer) {
            self.drop_read_ahead();
            return Ok(());
        }
        let ahead = self.ahead.take().expect("checked above");
        let t0 = Instant::now();
        let mut busy = vec![false; self.map.len()];
        for &s in &self.in_use {
            busy[s] = true;
        }
        for &e in ids {
            if let Some(s) = self.map.get((layer, e)) {
                busy[s] = true;
            }
        }
        let extent = store.extent_bytes(layer);
        let mut first_err = None;
        let mut copied = false;
        let back = ahead.finish(|e, bytes| {
            if first_err.is_some() || self.map.get((layer, e)).is_some() {
                return;
            }
            let Some(s) = self.map.take_victim(|s| busy[s]) else {
                return;
            };
            busy[s] = true;
            // SAFETY: the staging buffer is pinned and not reused before
            // the copy stream is synchronised below; slot `s` is neither
            // read by queued compute (`in_use`) nor one this call hits.
            match unsafe { copy_htod_async(&gpu.copy, self.slot_ptr(s), &bytes[..extent]) } {
                Ok(()) => {
                    self.map.assign(s, (layer, e));
                    self.low[s] = false;
                    self.prefetched[s] = true;
                    self.ahead_slot[s] = true;
                    let st = &mut self.stats;
                    st.prefetched += 1;
                    st.ahead_reads += 1;
                    st.file_reads += 1;
                    st.file_bytes += extent as u64;
                    st.uploaded_bytes += extent as u64;
                    copied = true;
                }
                Err(err) => {
                    self.map.release_empty(s);
                    first_err = Some(err);
                }
            }
        });
        let synced = if copied {
            gpu.copy
                .synchronize()
                .map_err(|e| Error::Gpu(format!("expert upload: {e}")))
        } else {
            Ok(())
        };
        self.staging.extend(back);
        self.stats.ahead_wait_ns += t0.elapsed().as_nanos() as u64;
        if let Some(e) = first_err.or(synced.err()) {
            // Whatever this read-ahead put in slots may be incomplete.
            let filled: Vec<usize> = (0..self.ahead_slot.len())
                .filter(|&s| self.ahead_slot[s])
                .collect();
            for s in filled {
                self.invalidate(s);
            }
            return Err(e);
        }
        Ok(())
    }

    /// Starts uploading experts `ids` of `layer` that are not resident, on
    /// a predicted choice, without making the compute stream wait: the next
    /// `ensure` orders it after them. Only from the host tier (a copy
    /// straight from pinned memory; reads from the files would block the
    /// host): a whole-layer tier's layers, an arena's held experts. Never
    /// overwrites the slots the last `ensure` handed out. With low-width
    /// misses, `as_copy[i]` lets `ids[i]` travel as its low-width copy
    /// where the host tier pins the copies (missing entries: no); an expert
    /// that may not and is held as its copy is uploaded at full width into
    /// its own slot. Returns how many uploads it started.
    pub fn prefetch(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
        as_copy: &[bool],
    ) -> Result<usize> {
        if self.table.is_some() {
            return Ok(0);
        }
        let arena = match &self.host.full {
            Tier::Arena(_) => true,
            Tier::Layers(_) if self.host_pinned(layer) => false,
            _ => return Ok(0),
        };
        let mut busy = vec![false; self.map.len()];
        for &s in &self.in_use {
            busy[s] = true;
        }
        let copies = store
            .low_width()
            .filter(|_| self.low_misses && self.low_pinned(layer));
        // Per wanted expert, the slot of the low copy it replaces (`None`:
        // a new slot, at most as many as are not in use) and whether it
        // travels as its copy.
        let mut room = self.map.len() - self.in_use.len();
        let mut wanted: Vec<(usize, Option<usize>, bool)> = Vec::new();
        for (i, &e) in ids.iter().enumerate() {
            let copy = copies.is_some() && as_copy.get(i).copied().unwrap_or(false);
            match self.map.get((layer, e)) {
                None if room > 0 => {
                    room -= 1;
                    wanted.push((e, None, copy));
                }
                Some(s) if self.low[s] && !copy && !busy[s] => wanted.push((e, Some(s), false)),
                _ => {}
            }
        }
        let wanted_ids: Vec<usize> = wanted.iter().map(|&(e, ..)| e).collect();
        // Per wanted expert, the pinned bytes to copy (and the arena claim
        // to hold until the copy is done; none for a copy).
        let host = Arc::clone(&self.host);
        let mut claims: Vec<Option<Claim<Pinned>>> = match &host.full {
            Tier::Arena(a) => {
                let keys: Vec<_> = wanted
                    .iter()
                    .filter(|w| !w.2)
                    .map(|w| (layer, w.0))
                    .collect();
                let mut a = a.lock().unwrap_or_else(|p| p.into_inner());
                let mut got = a.check_out(&keys, false).into_iter();
                wanted
                    .iter()
                    .map(|w| match w.2 {
                        true => None,
                        false => Some(got.next().expect("a claim per key")),
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        let mut started = 0;
        for (j, &(e, low_slot, copy)) in wanted.iter().enumerate() {
            let src: &[u8] = match copies.filter(|_| copy) {
                Some(c) => c.mapped(layer, e).expect("pinned copies are mapped"),
                None if arena => match claims[j].as_ref().and_then(|c| c.buf()) {
                    Some(buf) => &buf.as_bytes()[..store.extent_bytes(layer)],
                    None => continue,
                },
                None => store.mapped(layer, e).expect("host-tier layers are mapped"),
            };
            let s = match low_slot {
                Some(s) => {
                    self.low[s] = false;
                    self.stats.promoted += 1;
                    s
                }
                None => {
                    let s = self.take_victim(&busy);
                    self.map.assign(s, (layer, e));
                    self.low[s] = copy;
                    s
                }
            };
            busy[s] = true;
            self.prefetched[s] = true;
            // SAFETY: the source is pinned and outlives the copy (a mapping
            // lives as long as the store; an arena slot stays checked out in
            // `held` until `release_held` synchronised the copy stream);
            // slot `s` is not in use by queued compute (`in_use`; the steps
            // before it were synchronised when this layer's choice was
            // read), and the next `ensure` orders the compute stream after
            // this copy.
            if let Err(e) = unsafe { copy_htod_async(&gpu.copy, self.slot_ptr(s), src) } {
                self.invalidate(s);
                held_claims(&mut self.held, &mut claims, layer, &wanted_ids);
                return Err(e);
            }
            self.stats.uploaded_bytes += src.len() as u64;
            self.stats.prefetched += 1;
            self.copies_pending = true;
            started += 1;
        }
        held_claims(&mut self.held, &mut claims, layer, &wanted_ids);
        Ok(started)
    }

    /// Copies the missing experts to their slots on the copy stream: from
    /// the host tier when it has them, else read from the files (into an
    /// arena slot, or into pinned staging buffers a wave at a time, or for
    /// a mapped store from the mapping) and copied as each lands. The
    /// compute stream waits for the copies. On an error, the slots of the
    /// experts not uploaded are left empty.
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
        let host = Arc::clone(&self.host);
        match &host.full {
            Tier::Layers(_) if self.host_pinned(layer) => {
                self.upload_pinned(gpu, store, layer, ids, misses, slot_of)
            }
            Tier::Arena(arena) => {
                let miss_ids: Vec<usize> = misses.iter().map(|&i| ids[i]).collect();
                let dsts: Vec<u64> = misses.iter().map(|&i| self.slot_ptr(slot_of[i])).collect();
                let served = serve(
                    arena,
                    store,
                    layer,
                    &miss_ids,
                    // SAFETY: the buffer is a pinned arena slot, checked
                    // out until `serve` has waited for the copy stream.
                    |j, buf| unsafe {
                        copy_htod_async(&gpu.copy, dsts[j], &buf.as_bytes()[..extent])
                    },
                    || {
                        gpu.copy
                            .synchronize()
                            .map_err(|e| Error::Gpu(format!("expert upload: {e}")))
                    },
                );
                let served = match served {
                    Ok(s) => s,
                    Err(e) => {
                        for &i in misses {
                            self.invalidate(slot_of[i]);
                        }
                        return Err(e);
                    }
                };
                let mut rest = Vec::new();
                for (&i, from) in misses.iter().zip(&served.from) {
                    match from {
                        Source::Host => self.stats.host_hits += 1,
                        Source::File => {
                            self.stats.file_reads += 1;
                            self.stats.file_bytes += extent as u64;
                            self.stats.needed_file_bytes += extent as u64;
                        }
                        Source::Bypass => rest.push(i),
                        Source::Failed => self.invalidate(slot_of[i]),
                    }
                    if matches!(from, Source::Host | Source::File) {
                        self.stats.uploaded_bytes += extent as u64;
                    }
                }
                if let Some(e) = served.error {
                    for &i in &rest {
                        self.invalidate(slot_of[i]);
                    }
                    return Err(e);
                }
                self.upload_staged(gpu, store, layer, ids, &rest, slot_of, true)
            }
            _ => self.upload_staged(gpu, store, layer, ids, misses, slot_of, true),
        }
    }

    /// [`ExpertCache::upload`] of the misses as their low-width copies
    /// (`copies`): from their pinned files when the host tier holds them,
    /// else read from the files through the staging buffers.
    fn upload_low(
        &mut self,
        gpu: &Gpu,
        copies: &ExpertStore,
        layer: usize,
        ids: &[usize],
        misses: &[usize],
        slot_of: &[usize],
    ) -> Result<()> {
        if self.low_pinned(layer) {
            self.upload_pinned(gpu, copies, layer, ids, misses, slot_of)
        } else {
            self.upload_staged(gpu, copies, layer, ids, misses, slot_of, false)
        }
    }

    /// [`ExpertCache::upload`] from `store`'s mapping of `layer`, pinned
    /// whole in the host tier.
    fn upload_pinned(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
        misses: &[usize],
        slot_of: &[usize],
    ) -> Result<()> {
        let extent = store.extent_bytes(layer);
        for (n, &i) in misses.iter().enumerate() {
            let src = store
                .mapped(layer, ids[i])
                .expect("host-tier layers are mapped");
            // SAFETY: the mapping is pinned and read-only; it lives as long
            // as the store, which outlives the copy (the compute stream
            // waits for it below).
            let copied = unsafe { copy_htod_async(&gpu.copy, self.slot_ptr(slot_of[i]), src) };
            if let Err(e) = copied {
                for &i in &misses[n..] {
                    self.invalidate(slot_of[i]);
                }
                return Err(e);
            }
            self.stats.uploaded_bytes += extent as u64;
            self.stats.host_hits += 1;
        }
        stream_wait(&gpu.stream, &gpu.copy)
    }

    /// [`ExpertCache::upload`] through the staging buffers (or a mapping),
    /// or by cuFile when it is on and `by_gds` (it has the experts' files
    /// registered, not the low-width copies').
    #[allow(clippy::too_many_arguments)]
    fn upload_staged(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
        misses: &[usize],
        slot_of: &[usize],
        by_gds: bool,
    ) -> Result<()> {
        if misses.is_empty() {
            return Ok(());
        }
        if let Some(gds) = self
            .gds
            .clone()
            .filter(|_| by_gds && store.is_direct(layer) == Some(true))
        {
            return self.upload_gds(gpu, store, layer, ids, misses, slot_of, gds);
        }
        let extent = store.extent_bytes(layer);
        let mapped = store.is_mapped(layer) == Some(true);
        for (w, wave) in misses.chunks(STAGING).enumerate() {
            let wave_ids: Vec<usize> = wave.iter().map(|&i| ids[i]).collect();
            let staged: Vec<Staged> = if mapped {
                Vec::new()
            } else {
                while self.staging.len() < wave.len() {
                    self.staging.push(Staged::new(gpu, self.extent)?);
                }
                self.staging.drain(..wave.len()).collect()
            };
            let (pins, bufs): (Vec<Pinned>, Vec<ExpertBuf>) =
                staged.into_iter().map(|s| (s.pin, s.buf)).unzip();
            // The request is valid by construction (ids from the router, one
            // buffer each unless mapped), so the buffers come back; a mapped
            // file that shrank fails it as a whole.
            let read_start = Instant::now();
            let fetched = store.fetch(layer, &wave_ids, bufs);
            if w == 0 {
                // The next layer's guesses queue behind this layer's reads.
                self.start_read_ahead(gpu, store)?;
            }
            let mut first_err = None;
            let mut landed_bufs: Vec<Option<ExpertBuf>> = (0..wave.len()).map(|_| None).collect();
            match fetched {
                Err(e) => first_err = Some(e),
                Ok(mut fetch) => {
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
                            // SAFETY: a staging buffer is pinned and not
                            // touched again until the copy stream is
                            // synchronised below; a mapping outlives the copy.
                            match unsafe { copy_htod_async(&gpu.copy, dst, src) } {
                                Ok(()) => self.stats.count_miss_read(extent as u64),
                                Err(e) => {
                                    first_err.get_or_insert(e);
                                }
                            }
                        }
                        landed_bufs[l.index] = l.buf;
                    }
                    self.stats.read_batches += 1;
                    self.stats.read_ns += read_start.elapsed().as_nanos() as u64;
                }
            }
            let synced = gpu
                .copy
                .synchronize()
                .map_err(|e| Error::Gpu(format!("expert upload: {e}")));
            // The buffers that came back (all but those of a request that
            // failed as a whole, which `fetch` dropped).
            for (buf, pin) in landed_bufs.into_iter().zip(pins) {
                if let Some(buf) = buf {
                    self.staging.push(Staged { pin, buf });
                }
            }
            if let Some(e) = first_err.or(synced.err()) {
                // The slots of this wave and the later ones hold nothing
                // valid.
                for &i in &misses[w * STAGING..] {
                    self.invalidate(slot_of[i]);
                }
                return Err(e);
            }
        }
        stream_wait(&gpu.stream, &gpu.copy)
    }

    /// [`ExpertCache::upload`] by cuFile: every miss read from its file
    /// into its slot at once on the store's I/O threads; each read returns
    /// with the bytes in VRAM, so the compute stream has nothing to wait
    /// for.
    #[allow(clippy::too_many_arguments)]
    fn upload_gds(
        &mut self,
        gpu: &Gpu,
        store: &ExpertStore,
        layer: usize,
        ids: &[usize],
        misses: &[usize],
        slot_of: &[usize],
        reader: Arc<GdsReader>,
    ) -> Result<()> {
        let extent = store.extent_bytes(layer) as u64;
        let miss_ids: Vec<usize> = misses.iter().map(|&i| ids[i]).collect();
        let dsts: Vec<u64> = misses.iter().map(|&i| self.slot_ptr(slot_of[i])).collect();
        let read_start = Instant::now();
        let fetched = store.fetch_to(layer, &miss_ids, &dsts, reader);
        // The next layer's guesses queue behind this layer's reads.
        self.start_read_ahead(gpu, store)?;
        let mut first_err = None;
        match fetched {
            Err(e) => first_err = Some(e),
            Ok(mut fetch) => {
                while let Some(l) = fetch.next_landed() {
                    match l.result {
                        Ok(()) => self.stats.count_miss_read(extent),
                        Err(e) => {
                            first_err.get_or_insert(e);
                        }
                    }
                }
                self.stats.read_batches += 1;
                self.stats.read_ns += read_start.elapsed().as_nanos() as u64;
            }
        }
        match first_err {
            Some(e) => {
                // A failed read may have written part of its slot.
                for &i in misses {
                    self.invalidate(slot_of[i]);
                }
                Err(e)
            }
            None => Ok(()),
        }
    }
}

/// Bytes of `store`'s expert files when every layer is mapped.
fn mapped_bytes(store: &ExpertStore) -> Option<u64> {
    store
        .layers()
        .map(|l| store.mapping(l).map(|m| m.len() as u64))
        .sum()
}

/// Pins every layer's mapped file of `store` (`what` names them in an
/// error), indexed by model layer.
fn pin_layers(gpu: &Gpu, store: &ExpertStore, what: &str) -> Result<Vec<Option<Pinned>>> {
    let mut host: Vec<Option<Pinned>> = Vec::new();
    for l in store.layers() {
        let map = store.mapping(l).expect("every layer is mapped");
        let pin = Pinned::register_read_only(gpu, map).map_err(|e| {
            Error::Gpu(format!(
                "pinning the {what} of layer {l} ({:.2} GB) as the host tier: {e} \
                 (lower --host-cache, or raise the locked-memory limit)",
                map.len() as f64 / 1e9
            ))
        })?;
        if host.len() <= l {
            host.resize_with(l + 1, || None);
        }
        host[l] = Some(pin);
    }
    Ok(host)
}

/// Keeps a prefetch's arena claims (the hits; a bypass holds nothing) until
/// `release_held`.
fn held_claims(
    held: &mut Vec<(super::slots::Key, Claim<Pinned>)>,
    claims: &mut [Option<Claim<Pinned>>],
    layer: usize,
    wanted: &[usize],
) {
    for (c, &e) in claims.iter_mut().zip(wanted) {
        if let Some(c) = c.take().filter(|c| c.buf().is_some()) {
            held.push(((layer, e), c));
        }
    }
}

impl Drop for ExpertCache {
    /// Prefetch slots still checked out go back to a shared arena (another
    /// GPU of the group may outlive this one).
    fn drop(&mut self) {
        // Reads in flight write into pinned staging buffers: let them land.
        self.drop_read_ahead();
        if let Tier::Arena(arena) = &self.host.full {
            let mut a = arena.lock().unwrap_or_else(|p| p.into_inner());
            for (key, claim) in self.held.drain(..) {
                a.check_in(key, claim, true);
            }
        }
    }
}
