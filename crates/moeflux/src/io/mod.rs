//! Expert I/O: gets routed experts of the per-layer expert files
//! (`experts/layer_NNN.bin`, see [`crate::format`]) into memory.
//!
//! One expert is one contiguous, 4096-aligned extent. Three ways to get it:
//! * **mapped** (default): each file is mapped read-only once and compute
//!   reads the mapping. Fetching an expert checks whether its pages are
//!   resident (`mincore`, ~2 us) and only if not asks the kernel to read the
//!   extent in one request (`WILLNEED`) and map it (`MADV_POPULATE_READ`),
//!   on an I/O thread. With a warm page cache nothing is copied or waited
//!   for at all.
//! * **buffered**: `pread` through the page cache into an [`ExpertBuf`].
//! * **direct**: `pread` with `O_DIRECT` into an aligned [`ExpertBuf`],
//!   bypassing the page cache (for models far larger than RAM, where the
//!   cache only thrashes).
//!
//! [`ExpertStore::fetch`] issues all experts of a request at once on a
//! dedicated I/O thread pool (threads `moeflux-io-N`), separate from the
//! compute pool so that blocking reads never starve compute, and hands them
//! back one by one in the order they land, so compute can start on the first
//! while the rest are still in flight. There is no application-level cache
//! here: the OS page cache (mapped and buffered modes) or nothing (direct)
//! sits below; expert caching policy belongs to the caller.

mod buf;
pub mod procfs;
mod sys;

#[cfg(test)]
pub(crate) mod tests;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

pub use buf::ExpertBuf;
use memmap2::{Advice, Mmap};

use crate::error::{Error, Result};
use crate::format::{Manifest, EXPERT_ALIGN, MANIFEST_FILE};

/// How [`ExpertStore::open`] opens and reads the expert files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertStoreOptions {
    /// Bypass the page cache (`O_DIRECT`; `F_NOCACHE` on Apple). A file whose
    /// file system refuses it (EINVAL, e.g. older tmpfs) is read buffered
    /// instead; see [`ExpertStore::buffered_fallbacks`].
    pub direct_io: bool,
    /// Threads of the store's own I/O pool. Default 8: one per routed expert
    /// of a Qwen3.6-35B-A3B layer, enough to keep an NVMe queue busy.
    pub io_threads: usize,
    /// For buffered files, advise the kernel that access is random
    /// (`POSIX_FADV_RANDOM`; `F_RDAHEAD 0` on Apple). Expert reads are whole,
    /// exact extents picked by the router in no particular order: readahead
    /// past the end of an extent fetches bytes of the neighbouring expert
    /// that is unlikely to be used next, wasting device bandwidth and page
    /// cache on every miss. With the advice the kernel still reads the whole
    /// requested range in large requests, just nothing beyond it. Default on.
    pub fadvise_random: bool,
    /// Serve buffered (not direct) files from a read-only mapping instead of
    /// copying them into buffers. Default on. The files must not change
    /// while the store is open: a file found shrunk when experts are fetched
    /// fails that request with an error, but one truncated in the moment
    /// compute reads its experts still faults (SIGBUS). Off, every read is a
    /// `pread` and a truncated file is always an error.
    pub mmap: bool,
}

impl Default for ExpertStoreOptions {
    fn default() -> Self {
        ExpertStoreOptions {
            direct_io: false,
            io_threads: 8,
            fadvise_random: true,
            mmap: true,
        }
    }
}

/// Cumulative counters of an [`ExpertStore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStats {
    /// Expert extents read.
    pub reads: u64,
    /// Of those, extents of mapped layers found already in memory (no I/O).
    pub cached: u64,
    /// Bytes read (extents of [`ExpertStore::extent_bytes`] each).
    pub bytes: u64,
    /// Wall time spent inside read calls (`read_experts`, and
    /// [`ExpertStore::submit`] jobs from start to finish), summed over calls.
    pub busy_ns: u64,
    /// Read calls (batches) completed.
    pub calls: u64,
}

impl IoStats {
    /// Bytes per busy second, in GB/s (10^9), or 0 with no busy time.
    pub fn gb_per_s(&self) -> f64 {
        if self.busy_ns == 0 {
            0.0
        } else {
            self.bytes as f64 / self.busy_ns as f64
        }
    }

    /// Counters summed with `other`'s.
    pub fn plus(&self, other: &IoStats) -> IoStats {
        IoStats {
            reads: self.reads + other.reads,
            cached: self.cached + other.cached,
            bytes: self.bytes + other.bytes,
            busy_ns: self.busy_ns + other.busy_ns,
            calls: self.calls + other.calls,
        }
    }

    /// Counter differences `self - earlier` (saturating).
    pub fn since(&self, earlier: &IoStats) -> IoStats {
        IoStats {
            reads: self.reads.saturating_sub(earlier.reads),
            cached: self.cached.saturating_sub(earlier.cached),
            bytes: self.bytes.saturating_sub(earlier.bytes),
            busy_ns: self.busy_ns.saturating_sub(earlier.busy_ns),
            calls: self.calls.saturating_sub(earlier.calls),
        }
    }
}

#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    cached: AtomicU64,
    bytes: AtomicU64,
    busy_ns: AtomicU64,
    calls: AtomicU64,
}

impl Counters {
    /// Counts expert `id` of `lf` as read (`cached`: found in memory).
    fn landed(&self, lf: &LayerFile, id: usize, cached: bool) {
        lf.expert_reads[id].fetch_add(1, Ordering::Relaxed);
        self.reads.fetch_add(1, Ordering::Relaxed);
        self.cached.fetch_add(cached as u64, Ordering::Relaxed);
        self.bytes.fetch_add(lf.extent as u64, Ordering::Relaxed);
    }

    /// One expert of a fetch is done: counted if it landed, and once the
    /// fetch's last expert is done, the fetch and its time.
    fn one_done(&self, lf: &LayerFile, id: usize, ok: bool, left: &AtomicUsize, start: Instant) {
        if ok {
            self.landed(lf, id, false);
        }
        if left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.busy_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.calls.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One open expert file.
#[derive(Debug)]
struct LayerFile {
    layer: usize,
    path: PathBuf,
    file: File,
    num_experts: usize,
    stride: u64,
    /// `expert_bytes` rounded up to 4096: the bytes one read transfers.
    extent: usize,
    direct: bool,
    /// The whole file, mapped read-only (mapped mode).
    map: Option<Mmap>,
    /// Bytes of the file when it was opened (`num_experts * stride`).
    size: u64,
    /// Completed reads per expert: how popular each expert is (routing
    /// locality), for cache studies and the synthetic-model tests.
    expert_reads: Vec<AtomicU64>,
}

/// The routed experts of every MoE layer of a model directory, open for
/// reading. `Send + Sync`: share it by reference or in an `Arc`.
pub struct ExpertStore {
    /// Indexed by model layer; `None` for layers without routed experts.
    layers: Vec<Option<Arc<LayerFile>>>,
    pool: rayon::ThreadPool,
    counters: Arc<Counters>,
    fallbacks: Vec<PathBuf>,
    opts: ExpertStoreOptions,
    /// The experts' low-width copies, opened beside them for a GPU session
    /// that uploads misses at low width (`attach_low_width`).
    low_width: Option<Box<ExpertStore>>,
}

impl std::fmt::Debug for ExpertStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertStore")
            .field("layers", &self.layers.iter().flatten().count())
            .field("opts", &self.opts)
            .field("buffered_fallbacks", &self.fallbacks)
            .finish()
    }
}

impl ExpertStore {
    /// Opens `experts/layer_NNN.bin` of every MoE layer in `manifest`.
    ///
    /// Checks the manifest's expert layout (stride a non-zero multiple of
    /// 4096, `0 < expert_bytes <= stride`, at least one expert, no layer
    /// twice) and that every file is exactly `num_experts * stride` bytes.
    /// With `direct_io`, a file whose file system refuses direct I/O is
    /// opened buffered and listed in [`ExpertStore::buffered_fallbacks`].
    pub fn open(model_dir: &Path, manifest: &Manifest, opts: &ExpertStoreOptions) -> Result<Self> {
        if opts.io_threads == 0 {
            return Err(Error::Invalid(
                "ExpertStoreOptions::io_threads must be at least 1".into(),
            ));
        }
        let manifest_path = model_dir.join(MANIFEST_FILE);
        let mut layers: Vec<Option<Arc<LayerFile>>> = Vec::new();
        let mut fallbacks = Vec::new();
        for el in &manifest.experts {
            let bad = |reason: String| {
                Error::format(
                    &manifest_path,
                    format!("experts of layer {}: {reason}", el.layer),
                )
            };
            if el.stride == 0 || el.stride % EXPERT_ALIGN as u64 != 0 {
                return Err(bad(format!(
                    "stride {} is not a positive multiple of {EXPERT_ALIGN}",
                    el.stride
                )));
            }
            if el.expert_bytes == 0 || el.expert_bytes > el.stride {
                return Err(bad(format!(
                    "expert_bytes {} is not in 1..={} (the stride)",
                    el.expert_bytes, el.stride
                )));
            }
            if el.num_experts == 0 {
                return Err(bad("num_experts is 0".into()));
            }
            // Bounded before it sizes the layer table (an untrusted manifest
            // could otherwise ask for petabytes).
            if el.layer >= crate::config::MAX_LAYERS {
                return Err(bad(format!(
                    "layer index {} is out of range (at most {} layers)",
                    el.layer,
                    crate::config::MAX_LAYERS
                )));
            }
            if layers.get(el.layer).is_some_and(Option::is_some) {
                return Err(bad("layer listed twice".into()));
            }
            let expected = (el.num_experts as u64)
                .checked_mul(el.stride)
                .filter(|&b| usize::try_from(b).is_ok())
                .ok_or_else(|| bad("num_experts * stride overflows".into()))?;
            let extent = usize::try_from(el.expert_bytes.next_multiple_of(EXPERT_ALIGN as u64))
                .map_err(|_| bad("expert_bytes does not fit in memory".into()))?;

            let path = crate::format::resolve_in_dir(
                model_dir,
                &el.file,
                &format!("experts of layer {}: file", el.layer),
            )?;
            let (mut file, mut direct) = open_file(&path, opts)?;
            let actual = file.metadata().map_err(|e| Error::io(&path, e))?.len();
            if actual != expected {
                return Err(Error::format(
                    &path,
                    format!(
                        "expert file is {actual} bytes, expected {expected} \
                         ({} experts x stride {}) for layer {}",
                        el.num_experts, el.stride, el.layer
                    ),
                ));
            }
            if direct {
                // Some file systems accept O_DIRECT at open and refuse the
                // first read; find out now rather than mid-decode.
                match probe_direct(&file) {
                    Ok(()) => {}
                    Err(e) if sys::direct_refused(&e) => {
                        file = sys::open_buffered(&path).map_err(|e| Error::io(&path, e))?;
                        advise(&file, &path, opts)?;
                        direct = false;
                    }
                    Err(e) => return Err(Error::io(&path, e)),
                }
            }
            if opts.direct_io && !direct {
                fallbacks.push(path.clone());
            }
            let map = if opts.mmap && !direct {
                // SAFETY: read-only shared mapping of a file the store owns;
                // the model directory must not be modified while it is open
                // (documented on `ExpertStoreOptions::mmap`).
                // No MADV_RANDOM: it would also turn off fault-around, which
                // maps 16 resident pages per fault on first touch.
                Some(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?)
            } else {
                None
            };
            if layers.len() <= el.layer {
                layers.resize_with(el.layer + 1, || None);
            }
            layers[el.layer] = Some(Arc::new(LayerFile {
                layer: el.layer,
                path,
                file,
                num_experts: el.num_experts,
                stride: el.stride,
                extent,
                direct,
                map,
                size: expected,
                expert_reads: (0..el.num_experts).map(|_| AtomicU64::new(0)).collect(),
            }));
        }

        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.io_threads)
            .thread_name(|i| format!("moeflux-io-{i}"))
            .build()
            .map_err(|e| Error::Invalid(format!("cannot start the expert I/O threads: {e}")))?;
        Ok(ExpertStore {
            layers,
            pool,
            counters: Arc::new(Counters::default()),
            fallbacks,
            opts: opts.clone(),
            low_width: None,
        })
    }

    /// Keeps `copies` (a store of this model's low-width copies, opened
    /// from the manifest's `low_width_experts`) beside the experts.
    pub fn attach_low_width(&mut self, copies: ExpertStore) {
        self.low_width = Some(Box::new(copies));
    }

    /// The low-width copies attached by [`ExpertStore::attach_low_width`].
    pub fn low_width(&self) -> Option<&ExpertStore> {
        self.low_width.as_deref()
    }

    /// Reads experts `ids` of MoE layer `layer` (the model layer index) into
    /// `bufs[i]`, one buffer per id, each at least
    /// [`ExpertStore::extent_bytes`] long. All reads are issued at once on the
    /// store's I/O pool; returns when every one has landed. Ids may repeat
    /// and come in any order. The first `extent_bytes(layer)` bytes of each
    /// buffer are overwritten (the tail past `expert_bytes` holds whatever
    /// padding the file has, zeros as written by `convert`).
    pub fn read_experts(&self, layer: usize, ids: &[usize], bufs: &mut [ExpertBuf]) -> Result<()> {
        let lf = self.check_request(layer, ids, bufs)?;
        if ids.is_empty() {
            return Ok(());
        }
        let counters = &*self.counters;
        self.pool.install(|| read_batch(lf, ids, bufs, counters))
    }

    /// Starts getting experts `ids` of `layer` and returns at once; the
    /// returned [`Fetch`] hands each expert back as it lands. A mapped layer
    /// ([`ExpertStore::is_mapped`]) takes no buffers (`bufs` empty) and its
    /// bytes are read with [`ExpertStore::mapped`]; other layers take one
    /// buffer per id, at least [`ExpertStore::extent_bytes`] long, returned
    /// with the expert. Ids may repeat and come in any order.
    pub fn fetch(&self, layer: usize, ids: &[usize], bufs: Vec<ExpertBuf>) -> Result<Fetch> {
        let lf = self.layer(layer).ok_or_else(|| no_layer(layer))?;
        if lf.map.is_some() {
            if !bufs.is_empty() {
                return Err(Error::Invalid(format!(
                    "fetch: layer {layer} is mapped and takes no buffers, got {}",
                    bufs.len()
                )));
            }
            self.check_ids(lf, ids)?;
            check_not_shrunk(lf, ids)?;
        } else {
            self.check_request(layer, ids, &bufs)?;
        }
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        let left = Arc::new(AtomicUsize::new(ids.len()));
        let mut bufs = bufs.into_iter();
        for (index, &id) in ids.iter().enumerate() {
            if let Some(map) = &lf.map {
                // Resident already: hand it out now, no I/O thread needed.
                let off = id * lf.stride as usize;
                if sys::resident(&map[off..off + lf.extent]) {
                    let c = &self.counters;
                    c.landed(lf, id, true);
                    if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                        c.calls.fetch_add(1, Ordering::Relaxed);
                    }
                    let _ = tx.send(Landed {
                        index,
                        buf: None,
                        result: Ok(()),
                    });
                    continue;
                }
            }
            let (lf, tx, left) = (Arc::clone(lf), tx.clone(), Arc::clone(&left));
            let counters = Arc::clone(&self.counters);
            let mut buf = bufs.next();
            self.pool.spawn(move || {
                let result = match &mut buf {
                    Some(b) => read_extent(&lf, id, &mut b.as_bytes_mut()[..lf.extent]),
                    None => populate(&lf, id),
                };
                counters.one_done(&lf, id, result.is_ok(), &left, start);
                // The receiver may be gone (the caller gave up): nothing to do.
                let _ = tx.send(Landed { index, buf, result });
            });
        }
        Ok(Fetch {
            rx,
            left: ids.len(),
        })
    }

    /// [`ExpertStore::fetch`] of a layer read with `O_DIRECT`, into memory
    /// the caller addresses (device memory, by GPUDirect Storage): expert
    /// `ids[i]`'s extent is read by `reader` to `dsts[i]` on the I/O pool.
    /// The [`Landed`] experts carry no buffer.
    pub fn fetch_to(
        &self,
        layer: usize,
        ids: &[usize],
        dsts: &[u64],
        reader: Arc<dyn ExtentReader>,
    ) -> Result<Fetch> {
        let lf = self.layer(layer).ok_or_else(|| no_layer(layer))?;
        self.check_ids(lf, ids)?;
        if !lf.direct {
            return Err(Error::Invalid(format!(
                "fetch_to: layer {layer} is not read with O_DIRECT ({})",
                lf.path.display()
            )));
        }
        if ids.len() != dsts.len() {
            return Err(Error::Invalid(format!(
                "fetch_to: {} expert ids but {} destinations",
                ids.len(),
                dsts.len()
            )));
        }
        let (tx, rx) = mpsc::channel();
        let start = Instant::now();
        let left = Arc::new(AtomicUsize::new(ids.len()));
        for (index, (&id, &dst)) in ids.iter().zip(dsts).enumerate() {
            let (lf, tx, left) = (Arc::clone(lf), tx.clone(), Arc::clone(&left));
            let counters = Arc::clone(&self.counters);
            let reader = Arc::clone(&reader);
            self.pool.spawn(move || {
                let result = read_fully(&lf, id, lf.extent, |done, offset| {
                    reader.read(&lf.file, dst + done as u64, lf.extent - done, offset)
                });
                counters.one_done(&lf, id, result.is_ok(), &left, start);
                let _ = tx.send(Landed {
                    index,
                    buf: None,
                    result,
                });
            });
        }
        Ok(Fetch {
            rx,
            left: ids.len(),
        })
    }

    /// The open expert file of `layer` when it is read with `O_DIRECT`
    /// (GPUDirect Storage registers it).
    pub fn direct_file(&self, layer: usize) -> Option<&File> {
        self.layer(layer).filter(|l| l.direct).map(|l| &l.file)
    }

    /// Counts experts `ids` of `layer` as read from memory without a fetch
    /// (a caller that holds copies of them, `backend::cpu::repack`), so the
    /// statistics still show every expert a step used.
    pub fn count_held(&self, layer: usize, ids: &[usize]) {
        if let Some(lf) = self.layer(layer) {
            for &id in ids.iter().filter(|&&id| id < lf.num_experts) {
                self.counters.landed(lf, id, true);
            }
        }
    }

    /// Whether experts of `layer` are served from a mapping (see
    /// [`ExpertStore::fetch`]); `None` if the layer has no routed experts.
    pub fn is_mapped(&self, layer: usize) -> Option<bool> {
        self.layer(layer).map(|l| l.map.is_some())
    }

    /// The extent of expert `id` of a mapped `layer`, `None` when the layer
    /// is not mapped or `id` out of range. Fetch it first: touching pages
    /// that are not resident stalls on the disk one page at a time.
    pub fn mapped(&self, layer: usize, id: usize) -> Option<&[u8]> {
        let lf = self.layer(layer)?;
        let map = lf.map.as_ref()?;
        (id < lf.num_experts).then(|| {
            let off = id * lf.stride as usize;
            &map[off..off + lf.extent]
        })
    }

    /// The whole expert file of a mapped `layer` (`None` when not mapped).
    pub fn mapping(&self, layer: usize) -> Option<&[u8]> {
        self.layer(layer)?.map.as_deref()
    }

    /// Bytes of one expert extent of `layer` (`expert_bytes` rounded up to
    /// 4096): the length an [`ExpertBuf`] for this layer must have at least.
    ///
    /// # Panics
    /// If `layer` has no routed experts in this store.
    pub fn extent_bytes(&self, layer: usize) -> usize {
        self.layer(layer)
            .unwrap_or_else(|| panic!("layer {layer} has no routed experts in the expert store"))
            .extent
    }

    /// Number of experts of `layer`, or `None` if it has no routed experts.
    pub fn num_experts(&self, layer: usize) -> Option<usize> {
        self.layer(layer).map(|l| l.num_experts)
    }

    /// Bytes of all expert extents of all layers (what a cache holding
    /// every expert needs).
    pub fn total_bytes(&self) -> u64 {
        self.layers
            .iter()
            .flatten()
            .map(|l| (l.num_experts * l.extent) as u64)
            .sum()
    }

    /// Model layer indices that have routed experts, ascending.
    pub fn layers(&self) -> impl Iterator<Item = usize> + '_ {
        self.layers.iter().flatten().map(|l| l.layer)
    }

    /// Whether reads of `layer` bypass the page cache; `None` if the layer
    /// has no routed experts.
    pub fn is_direct(&self, layer: usize) -> Option<bool> {
        self.layer(layer).map(|l| l.direct)
    }

    /// Files opened buffered although `direct_io` was asked for (their file
    /// system refused direct I/O).
    pub fn buffered_fallbacks(&self) -> &[PathBuf] {
        &self.fallbacks
    }

    pub fn options(&self) -> &ExpertStoreOptions {
        &self.opts
    }

    /// Cumulative counters since open or the last [`ExpertStore::reset_stats`].
    pub fn stats(&self) -> IoStats {
        let c = &self.counters;
        IoStats {
            reads: c.reads.load(Ordering::Relaxed),
            cached: c.cached.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            busy_ns: c.busy_ns.load(Ordering::Relaxed),
            calls: c.calls.load(Ordering::Relaxed),
        }
    }

    /// Completed reads of each expert of `layer` since open or the last
    /// [`ExpertStore::reset_stats`], indexed by expert; `None` if the layer
    /// has no routed experts. When tokens are evaluated one at a time this
    /// is how often the router chose each expert (a batch reads an expert
    /// once for all its tokens).
    pub fn expert_reads(&self, layer: usize) -> Option<Vec<u64>> {
        self.layer(layer).map(|l| {
            l.expert_reads
                .iter()
                .map(|r| r.load(Ordering::Relaxed))
                .collect()
        })
    }

    pub fn reset_stats(&self) {
        for lf in self.layers.iter().flatten() {
            for r in &lf.expert_reads {
                r.store(0, Ordering::Relaxed);
            }
        }
        let c = &self.counters;
        c.reads.store(0, Ordering::Relaxed);
        c.cached.store(0, Ordering::Relaxed);
        c.bytes.store(0, Ordering::Relaxed);
        c.busy_ns.store(0, Ordering::Relaxed);
        c.calls.store(0, Ordering::Relaxed);
    }

    /// Drops every expert file's pages from the page cache
    /// (`posix_fadvise(POSIX_FADV_DONTNEED)`, after unmapping them from this
    /// process in mapped mode), for cold-cache measurements.
    /// A no-op where the advice does not exist.
    pub fn evict_page_cache(&self) -> Result<()> {
        for lf in self.layers.iter().flatten() {
            if let Some(map) = &lf.map {
                // Mapped pages stay cached: unmap them from this process
                // first. SAFETY: on a shared read-only file mapping,
                // MADV_DONTNEED only drops page-table entries; later reads
                // fault the (unchanged) file contents back in.
                unsafe { map.unchecked_advise(memmap2::UncheckedAdvice::DontNeed) }
                    .map_err(|e| Error::io(&lf.path, e))?;
            }
            sys::evict(&lf.file).map_err(|e| Error::io(&lf.path, e))?;
        }
        Ok(())
    }

    /// Sequential read bandwidth of the expert files' file system in GB/s:
    /// up to `max_bytes` of the largest expert file read with `O_DIRECT` in
    /// 8 MiB requests, one stream per I/O thread (the same queue depth the
    /// expert reads get). The yardstick for the expert bandwidth a decode
    /// achieves. `Ok(None)` where the file system refuses direct I/O.
    pub fn sequential_direct_gb_s(&self, max_bytes: u64) -> Result<Option<f64>> {
        const CHUNK: usize = 8 << 20;
        let Some(lf) = self
            .layers
            .iter()
            .flatten()
            .max_by_key(|l| l.num_experts as u64 * l.stride)
        else {
            return Ok(None);
        };
        let file = match sys::open_direct(&lf.path) {
            Ok(f) => f,
            Err(e) if sys::direct_refused(&e) => return Ok(None),
            Err(e) => return Err(Error::io(&lf.path, e)),
        };
        let size = (lf.num_experts as u64 * lf.stride).min(max_bytes);
        let chunks = (size / CHUNK as u64).max(1) as usize;
        let streams = self.opts.io_threads.min(chunks);
        let first_err: Mutex<Option<Error>> = Mutex::new(None);
        let start = Instant::now();
        let total = AtomicU64::new(0);
        self.pool.scope(|s| {
            for stream in 0..streams {
                let (file, first_err, total) = (&file, &first_err, &total);
                s.spawn(move |_| {
                    let mut buf = ExpertBuf::new(CHUNK);
                    for c in (stream..chunks).step_by(streams) {
                        match file.read_at(buf.as_bytes_mut(), (c * CHUNK) as u64) {
                            Ok(n) => {
                                total.fetch_add(n as u64, Ordering::Relaxed);
                            }
                            Err(e) => {
                                let mut slot = first_err.lock().unwrap_or_else(|p| p.into_inner());
                                slot.get_or_insert(Error::io(&lf.path, e));
                                return;
                            }
                        }
                    }
                });
            }
        });
        let secs = start.elapsed().as_secs_f64();
        if let Some(e) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        Ok(Some(total.into_inner() as f64 / secs / 1e9))
    }

    fn layer(&self, layer: usize) -> Option<&Arc<LayerFile>> {
        self.layers.get(layer).and_then(Option::as_ref)
    }

    fn check_ids(&self, lf: &LayerFile, ids: &[usize]) -> Result<()> {
        match ids.iter().find(|&&id| id >= lf.num_experts) {
            Some(id) => Err(Error::Invalid(format!(
                "expert {id} of layer {} does not exist ({} experts in {})",
                lf.layer,
                lf.num_experts,
                lf.path.display()
            ))),
            None => Ok(()),
        }
    }

    fn check_request(
        &self,
        layer: usize,
        ids: &[usize],
        bufs: &[ExpertBuf],
    ) -> Result<&Arc<LayerFile>> {
        let lf = self.layer(layer).ok_or_else(|| no_layer(layer))?;
        self.check_ids(lf, ids)?;
        if ids.len() != bufs.len() {
            return Err(Error::Invalid(format!(
                "read_experts: {} expert ids but {} buffers",
                ids.len(),
                bufs.len()
            )));
        }
        for (i, buf) in bufs.iter().enumerate() {
            if buf.len() < lf.extent {
                return Err(Error::Invalid(format!(
                    "read_experts: buffer {i} holds {} bytes, layer {layer} needs {}",
                    buf.len(),
                    lf.extent
                )));
            }
        }
        Ok(lf)
    }
}

/// One expert of a [`Fetch`], landed.
#[derive(Debug)]
pub struct Landed {
    /// Position of the expert in the ids given to [`ExpertStore::fetch`].
    pub index: usize,
    /// The buffer holding it (`None` for mapped layers).
    pub buf: Option<ExpertBuf>,
    pub result: Result<()>,
}

/// Reads file bytes into memory the process cannot address as a slice
/// (device memory), for [`ExpertStore::fetch_to`].
pub trait ExtentReader: Send + Sync {
    /// Reads up to `len` bytes at `offset` of `file` to address `dst`;
    /// returns the bytes read (0 at the end of the file).
    fn read(&self, file: &File, dst: u64, len: usize, offset: u64) -> std::io::Result<usize>;
}

/// Experts being fetched by [`ExpertStore::fetch`]. Dropping it early is
/// fine: reads still in flight finish and free their buffers.
#[derive(Debug)]
pub struct Fetch {
    rx: mpsc::Receiver<Landed>,
    left: usize,
}

impl Fetch {
    /// Blocks until the next expert lands; `None` once all have been handed
    /// out.
    pub fn next_landed(&mut self) -> Option<Landed> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        Some(
            self.rx
                .recv()
                .expect("expert I/O job ended without reporting (it panicked)"),
        )
    }

    /// Experts not handed out yet.
    pub fn remaining(&self) -> usize {
        self.left
    }
}

fn no_layer(layer: usize) -> Error {
    Error::Invalid(format!(
        "layer {layer} has no routed experts in the expert store"
    ))
}

/// Fails when the mapped file of `lf` has shrunk since it was opened
/// (truncated under a running process): touching a mapped page past the new
/// end of file would kill the process with SIGBUS, so the request fails
/// instead. One `fstat` per fetch. What remains is the window between this
/// check (and `MADV_POPULATE_READ`, which reports such pages as EFAULT) and
/// the compute that reads the experts; with `mmap` off, reads are `pread`s
/// and a truncated file is always an error, never a signal.
fn check_not_shrunk(lf: &LayerFile, ids: &[usize]) -> Result<()> {
    let now = lf
        .file
        .metadata()
        .map_err(|e| Error::io(&lf.path, e))?
        .len();
    if now < lf.size {
        return Err(Error::format(
            &lf.path,
            format!(
                "expert file is now {now} bytes, {} when opened: cannot read experts {ids:?} \
                 of layer {} (the model directory was modified while loaded)",
                lf.size, lf.layer
            ),
        ));
    }
    Ok(())
}

/// Brings expert `id` of a mapped layer into memory: one readahead request
/// for the whole extent, then its page-table entries (`MADV_POPULATE_READ`,
/// Linux 5.14+; elsewhere, or where refused, one read per page).
fn populate(lf: &LayerFile, id: usize) -> Result<()> {
    let map = lf.map.as_ref().expect("populate on a mapped layer");
    let off = id * lf.stride as usize;
    let err = |e: std::io::Error| {
        Error::io(
            &lf.path,
            std::io::Error::new(
                e.kind(),
                format!("mapping expert {id} of layer {}: {e}", lf.layer),
            ),
        )
    };
    sys::will_need(&lf.file, off as u64, lf.extent as u64).map_err(err)?;
    // Pages past a shrunk end of file fail with EFAULT here, not SIGBUS.
    #[cfg(target_os = "linux")]
    if !sys::populate_refused() {
        match map.advise_range(Advice::PopulateRead, off, lf.extent) {
            Ok(()) => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(err(e)),
        }
    }
    let page = &map[off..off + lf.extent];
    let mut sum = 0u8;
    for p in page.iter().step_by(EXPERT_ALIGN) {
        // SAFETY: a valid reference into the mapping; volatile so the read
        // (which faults the page in) is not optimised away.
        sum ^= unsafe { std::ptr::read_volatile(p) };
    }
    std::hint::black_box(sum);
    Ok(())
}

/// Issues one read per id on the current (I/O) pool and waits for all.
fn read_batch(lf: &LayerFile, ids: &[usize], bufs: &mut [ExpertBuf], c: &Counters) -> Result<()> {
    let start = Instant::now();
    let first_err: Mutex<Option<Error>> = Mutex::new(None);
    rayon::scope(|s| {
        for (&id, buf) in ids.iter().zip(bufs.iter_mut()) {
            let first_err = &first_err;
            s.spawn(move |_| {
                let dst = &mut buf.as_bytes_mut()[..lf.extent];
                match read_extent(lf, id, dst) {
                    Ok(()) => c.landed(lf, id, false),
                    Err(e) => {
                        let mut slot = first_err.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(e);
                    }
                }
            });
        }
    });
    c.busy_ns
        .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    c.calls.fetch_add(1, Ordering::Relaxed);
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// `pread`s expert `id` in full, continuing after short reads and retrying
/// on EINTR.
fn read_extent(lf: &LayerFile, id: usize, dst: &mut [u8]) -> Result<()> {
    read_fully(lf, id, dst.len(), |done, offset| {
        lf.file.read_at(&mut dst[done..], offset)
    })
}

/// Reads the `len` bytes of expert `id` by `read(done, file_offset)` (the
/// bytes read, 0 at the end of the file), continuing after short reads and
/// retrying on EINTR; errors name the file, layer, expert and offset.
fn read_fully(
    lf: &LayerFile,
    id: usize,
    len: usize,
    mut read: impl FnMut(usize, u64) -> std::io::Result<usize>,
) -> Result<()> {
    let base = id as u64 * lf.stride;
    let mut done = 0usize;
    while done < len {
        let offset = base + done as u64;
        match read(done, offset) {
            Ok(0) => {
                return Err(Error::format(
                    &lf.path,
                    format!(
                        "unexpected end of file reading expert {id} of layer {} at offset {offset} \
                         ({done} of {len} bytes read)",
                        lf.layer,
                    ),
                ))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                let kind = e.kind();
                return Err(Error::io(
                    &lf.path,
                    std::io::Error::new(
                        kind,
                        format!(
                            "reading expert {id} of layer {} at offset {offset}{}: {e}",
                            lf.layer,
                            if lf.direct { " (O_DIRECT)" } else { "" }
                        ),
                    ),
                ));
            }
        }
    }
    Ok(())
}

fn open_file(path: &Path, opts: &ExpertStoreOptions) -> Result<(File, bool)> {
    if opts.direct_io {
        match sys::open_direct(path) {
            Ok(f) => return Ok((f, true)),
            Err(e) if sys::direct_refused(&e) => {}
            Err(e) => return Err(Error::io(path, e)),
        }
    }
    let f = sys::open_buffered(path).map_err(|e| Error::io(path, e))?;
    advise(&f, path, opts)?;
    Ok((f, false))
}

fn advise(f: &File, path: &Path, opts: &ExpertStoreOptions) -> Result<()> {
    if opts.fadvise_random {
        sys::advise_random(f).map_err(|e| Error::io(path, e))?;
    }
    Ok(())
}

/// One aligned 4096-byte read at offset 0 through a direct descriptor.
fn probe_direct(f: &File) -> std::io::Result<()> {
    let mut b = ExpertBuf::new(EXPERT_ALIGN);
    f.read_at(b.as_bytes_mut(), 0).map(|_| ())
}
