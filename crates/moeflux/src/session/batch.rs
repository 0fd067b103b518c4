//! `Batch`: several sequences over one loaded model. Each sequence has
//! its own position, KV / MLA latent caches, GatedDeltaNet states,
//! checkpoints and snapshots; one [`Batch::step`] evaluates chunks of any
//! of them together, so the layers' weights are read once for all of them
//! and every MoE layer fetches each chosen expert once per step, whoever
//! chose it. A sequence's logits do not depend on what else is in the step
//! (on the CPU they are bit-identical to evaluating it alone).
//! [`super::Session`] is a batch of one sequence.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::backend::cpu::qmatmul::set_thread_activations;
use crate::backend::cpu::qmatmul::Activations;
use crate::backend::cpu::repack::{Repack, RepackedExperts};
use crate::backend::cuda::gds::{Choice, Gds};
use crate::backend::cuda::group::open_gpus;
use crate::backend::cuda::GpuSelection;
use crate::backend::cuda::{support, CacheStats, CudaGroup, CudaOptions};
use crate::backend::prefetch::PrefetchStats;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::format::{Manifest, MANIFEST_FILE};
use crate::io::{ExpertStore, ExpertStoreOptions, IoStats};
use crate::model::forward::{Segment, SegmentOutput};
use crate::model::state::RewindState;
use crate::model::timing::PhaseTimes;
use crate::model::trace::Trace;
use crate::model::{LogitsMode, Model};

use super::engine::{Engine, ForwardCtx, SeqState};
use super::snapshot;
use super::{Backend, Prefetch, SessionOptions};

/// A sequence of a [`Batch`]. Ids are never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(u64);

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sequence {}", self.0)
    }
}

/// One sequence's part of a [`Batch::step`]: `tokens` after its current
/// position, and which of them produce logits (`None`: none, e.g. a
/// prefill chunk that is not the prompt's last).
#[derive(Debug, Clone, Copy)]
pub struct Work<'t> {
    pub seq: SeqId,
    pub tokens: &'t [u32],
    pub logits: Option<LogitsMode>,
}

/// What [`Batch::step`] gives back for one [`Work`] item.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    /// The logits its [`LogitsMode`] asked for: `[vocab]` per logit row
    /// (empty for `logits: None`).
    Logits(Vec<f32>),
    /// [`LogitsMode::Greedy`]: the most likely next token.
    Token(u32),
}

impl Output {
    /// The logits (empty for a token).
    pub fn into_logits(self) -> Vec<f32> {
        match self {
            Output::Logits(l) => l,
            Output::Token(_) => Vec::new(),
        }
    }

    /// The greedy token, if that is what was asked for.
    pub fn token(&self) -> Option<u32> {
        match self {
            Output::Token(t) => Some(*t),
            Output::Logits(_) => None,
        }
    }
}

/// One sequence: its state on the engine, its tokens and checkpoints.
struct Sequence {
    state: SeqState,
    tokens: Vec<u32>,
    /// What returning to a position needs (linear-layer states, window
    /// layers' rows), by position; `checkpoint_order` keeps use order
    /// (last = newest).
    checkpoints: BTreeMap<usize, RewindState>,
    checkpoint_order: Vec<usize>,
    /// Set when an eval failed midway: the state is then inconsistent until
    /// `clear`, `restore_to`, `truncate` or `state_load`.
    poisoned: bool,
}

impl Sequence {
    fn touch(&mut self, pos: usize) {
        self.checkpoint_order.retain(|&p| p != pos);
        self.checkpoint_order.push(pos);
    }

    fn forget_checkpoints(&mut self) {
        self.checkpoints.clear();
        self.checkpoint_order.clear();
    }
}

pub struct Batch {
    dir: PathBuf,
    model: Model,
    store: ExpertStore,
    pool: rayon::ThreadPool,
    engine: Engine,
    /// What `Backend::Auto` chose, or why it fell back to the CPU.
    backend_note: String,
    /// Why `Backend::Auto` runs on the CPU although a GPU backend exists:
    /// the GPU backend cannot run this model.
    unsupported_on_gpu: Option<String>,
    k_active: usize,
    max_context: usize,
    max_checkpoints: usize,
    fingerprint: u64,
    decode_bytes_per_token: u64,
    times: PhaseTimes,
    prefetch: bool,
    prefetch_stats: PrefetchStats,
    seqs: BTreeMap<SeqId, Sequence>,
    next_id: u64,
}

/// What a snapshot of this model is bound to: its manifest's bytes, as
/// `convert` wrote them (low-width copies added later leave it unchanged,
/// so snapshots taken before stay loadable), and whether the session uses
/// those copies.
fn model_fingerprint(manifest: &Manifest, bytes: Vec<u8>, widths: Option<&str>) -> u64 {
    let bytes = if manifest.low_width_experts.is_empty() {
        bytes
    } else {
        let mut m = manifest.clone();
        m.low_width_experts.clear();
        m.file_text().into_bytes()
    };
    let h = crate::hash::fnv1a(&bytes);
    match widths {
        Some(tag) => h ^ crate::hash::fnv1a(tag.as_bytes()),
        None => h,
    }
}

impl Batch {
    /// Opens a model directory written by `moeflux convert`, with no
    /// sequence yet.
    pub fn open(dir: &Path, opts: SessionOptions) -> Result<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        // Read (size-checked) and parsed before its bytes are hashed.
        let (mut manifest, config) = Model::read_dir(dir)?;
        let manifest_bytes =
            std::fs::read(&manifest_path).map_err(|e| Error::io(&manifest_path, e))?;
        let widths = match (opts.low_width_experts, opts.low_width_misses) {
            (true, true) => {
                return Err(Error::Invalid(
                    "--low-width-experts and --low-width-misses exclude each other (every \
                     expert at low width, or only the GPU cache's misses)"
                        .into(),
                ))
            }
            (true, false) => Some("low-width experts"),
            (false, true) => Some("low-width misses"),
            (false, false) => None,
        };
        match opts.low_width_below {
            Some(w) if !opts.low_width_misses => {
                return Err(Error::Invalid(format!(
                    "a routing weight bound for low-width misses ({w}) needs --low-width-misses"
                )))
            }
            Some(w) if !(w > 0.0 && w.is_finite()) => {
                return Err(Error::Invalid(format!(
                    "the routing weight bound for low-width misses must be a positive number, \
                     got {w}"
                )))
            }
            _ => {}
        }
        let fingerprint = model_fingerprint(&manifest, manifest_bytes, widths);
        if widths.is_some() && manifest.low_width_experts.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: the model has no low-width copies of its experts (make them with \
                 `moeflux convert --low-width-copies 2 --model {}`)",
                dir.display(),
                dir.display()
            )));
        }
        if opts.low_width_experts {
            manifest.experts = std::mem::take(&mut manifest.low_width_experts);
        }
        let k_max = config.moe.num_experts_per_tok;
        let k_active = match opts.experts_per_token {
            None => k_max,
            Some(k) if k >= 1 && k <= k_max.max(1) => k,
            Some(k) => {
                return Err(Error::Invalid(format!(
                    "experts per token must be between 1 and the model's {k_max}, got {k}"
                )))
            }
        };
        let max_context = opts.max_context.unwrap_or(config.max_position_embeddings);
        let mut model = Model::load(dir, &manifest, config)?;
        // Whether the GPU backend takes this model is known without a GPU:
        // `cuda` fails with the reason, `auto` runs on the CPU and says why.
        let mut unsupported_on_gpu = None;
        // GPUs named with `--gpus` must be used: no CPU fallback.
        let explicit = opts.gpus.is_explicit() || opts.dist.is_some();
        if explicit && opts.backend == Backend::Cpu {
            let what = match &opts.dist {
                Some(_) => "--dist-init".to_string(),
                None => format!("--gpus {}", opts.gpus),
            };
            return Err(Error::Invalid(format!(
                "{what} needs the GPU backend, not --backend cpu"
            )));
        }
        // A rank of several processes runs on one GPU: the one named, else
        // GPU `rank` of this host's.
        let gpus = match (&opts.dist, &opts.gpus) {
            (Some(d), GpuSelection::First) => {
                let n = crate::backend::cuda::device::device_count()
                    .map_err(|e| Error::Gpu(format!("--dist-init: {e}")))?
                    .max(1);
                GpuSelection::List(vec![d.rank % n])
            }
            (Some(_), GpuSelection::List(l)) if l.len() == 1 => opts.gpus.clone(),
            (Some(_), g) => {
                return Err(Error::Invalid(format!(
                    "--dist-init runs one GPU per process; --gpus {g} names more"
                )))
            }
            (None, g) => g.clone(),
        };
        let gpu = match opts.backend {
            Backend::Cpu => Err("CPU backend requested".to_string()),
            Backend::Cuda => {
                support::check(&model)?;
                Ok(open_gpus(&gpus)?)
            }
            Backend::Auto if explicit => {
                support::check(&model)?;
                Ok(open_gpus(&gpus)?)
            }
            Backend::Auto => match support::check(&model) {
                Ok(()) => open_gpus(&gpus).map_err(|e| e.to_string()),
                Err(e @ Error::Unsupported { .. }) => {
                    unsupported_on_gpu = Some(e.to_string());
                    Err(e.to_string())
                }
                Err(e) => return Err(e),
            },
        };
        let store_opts = ExpertStoreOptions {
            direct_io: opts.direct_io,
            // The GPU uploads experts from pinned buffers: read into
            // them, unless the mapped files themselves are pinned.
            mmap: opts.mmap && (gpu.is_err() || opts.host_cache.is_some()),
            io_threads: opts.io_threads.max(1),
            ..Default::default()
        };
        let mut store = ExpertStore::open(dir, &manifest, &store_opts)?;
        if opts.low_width_misses {
            if let Err(why) = &gpu {
                return Err(Error::Invalid(format!(
                    "--low-width-misses uploads the GPU expert cache's misses at low width, but \
                     this session runs on the CPU ({why}); --low-width-experts runs every \
                     expert at low width on any backend"
                )));
            }
            let copies = manifest.copies_as_experts();
            store.attach_low_width(ExpertStore::open(dir, &copies, &store_opts)?);
        }
        let (engine, backend_note) = match gpu {
            // Every family runs on the GPU (the CUDA model takes either).
            Ok(gpus) => {
                let cuda = CudaOptions {
                    gpu_memory: opts.gpu_memory,
                    cache_policy: opts.cache_policy,
                    graphs: opts.cuda_graphs,
                    host_cache: opts.host_cache,
                    prefetch: opts.prefetch,
                    cpu_experts: opts.cpu_experts,
                    replicate_experts: opts.replicate_experts,
                    gds: opts.gds,
                    activations: opts.gpu_activations,
                    low_width_below: opts.low_width_below,
                    side_stream: opts.cuda_side_stream,
                };
                let m = match &opts.dist {
                    Some(d) => {
                        let gpu = gpus.into_iter().next().expect("one GPU per rank");
                        CudaGroup::new_dist(gpu, d, &model, &store, &cuda)?
                    }
                    None => CudaGroup::new(gpus, &model, &store, &cuda)?,
                };
                let mut note = format!("cuda: {}", m.describe());
                let nccl = || crate::backend::cuda::nccl::version();
                if let Some(d) = &opts.dist {
                    note.push_str(&format!(
                        "; rank {} of {} processes (tcp://{}), routed experts sharded, NCCL {}",
                        d.rank,
                        d.world,
                        d.addr,
                        nccl()?
                    ));
                } else if m.gpus() > 1 {
                    note.push_str(&format!(
                        "; routed experts sharded over {} GPUs, NCCL {}",
                        m.gpus(),
                        nccl()?
                    ));
                }
                if m.replicated() {
                    note.push_str(
                        "; every GPU holds every expert: steps of up to 16 tokens run \
                         on each GPU alone",
                    );
                }
                match m.gds() {
                    Some(Choice::Use(how)) => {
                        note.push_str(&format!("; misses read from the files by {how}"))
                    }
                    Some(Choice::Plain(Some(why))) => {
                        note.push_str(&format!("; GPUDirect Storage not used: {why}"))
                    }
                    _ => {}
                }
                if m.low_width_misses() {
                    note.push_str("; misses uploaded as the experts' low-width copies");
                }
                let tier = m.host_tier();
                if tier.is_some() {
                    let gb = tier.bytes as f64 / 1e9;
                    let mut held = Vec::new();
                    if tier.layers > 0 {
                        held.push(format!("the expert files of {} layers pinned", tier.layers));
                    }
                    if tier.slots > 0 {
                        held.push(format!(
                            "{} pinned expert slots, filled on misses",
                            tier.slots
                        ));
                    }
                    if tier.low_layers > 0 {
                        held.push(format!(
                            "the low-width copies of {} layers pinned",
                            tier.low_layers
                        ));
                    }
                    note.push_str(&format!("; host tier: {} ({gb:.1} GB)", held.join(", ")));
                    if m.prefetching() {
                        note.push_str(", predicted experts uploaded ahead");
                    }
                    // (The host computes experts from whole pinned layers only.)
                    if opts.cpu_experts > 0 && tier.layers > 0 {
                        note.push_str(&format!(
                            ", up to {} missing experts per layer computed on the CPU",
                            opts.cpu_experts
                        ));
                    }
                }
                (Engine::Cuda(Box::new(m)), note)
            }
            Err(_) if opts.gds == Gds::On => {
                return Err(Error::Invalid(
                    "--gds on reads experts into GPU memory: it needs the GPU backend".into(),
                ))
            }
            Err(why) => {
                // The 8-bit-activation products read interleaved 4-bit
                // weights faster (same bits); the copies are small next to
                // the experts.
                let dense = match (opts.cpu_activations, opts.cpu_repack) {
                    (Activations::Q8, Repack::Auto | Repack::On) => {
                        let linears = model.dense_products();
                        model.weights.interleave_affine(&linears)
                    }
                    _ => (0, 0),
                };
                let repacked = RepackedExperts::make(
                    opts.cpu_repack,
                    opts.cpu_activations,
                    opts.direct_io,
                    &model,
                    &store,
                )?;
                let mut note = match (opts.backend, &unsupported_on_gpu) {
                    (Backend::Auto, Some(_)) => format!("cpu ({why})"),
                    (Backend::Auto, None) => format!("cpu (no GPU: {why})"),
                    _ => "cpu".to_string(),
                };
                if dense.0 > 0 {
                    note.push_str(&format!(
                        "; {} dense 4-bit matrices interleaved ({:.1} GB)",
                        dense.0,
                        dense.1 as f64 / 1e9
                    ));
                }
                if let Some(r) = &repacked {
                    note.push_str(&format!(
                        "; routed experts interleaved in RAM ({:.1} GB, {:.1} s)",
                        r.bytes() as f64 / 1e9,
                        r.seconds()
                    ));
                }
                (
                    Engine::Cpu {
                        bufs: Vec::new(),
                        repacked,
                    },
                    note,
                )
            }
        };
        let threads = opts.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        let cpu_activations = opts.cpu_activations;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("moeflux-compute-{i}"))
            .start_handler(move |_| set_thread_activations(cpu_activations))
            .build()
            .map_err(|e| Error::Invalid(format!("cannot start {threads} compute threads: {e}")))?;
        let decode_bytes_per_token = manifest.decode_bytes_per_token(
            k_active,
            model.config().vocab_size,
            model.config().tie_word_embeddings,
        );
        Ok(Batch {
            dir: dir.to_path_buf(),
            model,
            store,
            pool,
            engine,
            backend_note,
            unsupported_on_gpu,
            k_active,
            max_context,
            max_checkpoints: opts.max_checkpoints,
            fingerprint,
            decode_bytes_per_token,
            times: PhaseTimes::default(),
            // The CPU path prefetches only when asked (see `Prefetch::Auto`).
            prefetch: opts.prefetch == Prefetch::On,
            prefetch_stats: PrefetchStats::default(),
            seqs: BTreeMap::new(),
            next_id: 0,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn model_dir(&self) -> &Path {
        &self.dir
    }

    pub fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    /// Routed experts evaluated per token.
    pub fn experts_per_token(&self) -> usize {
        self.k_active
    }

    /// The longest sequence a sequence of this batch may reach (`SessionOptions::max_context`).
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Weight bytes one decoded token reads (dense weights plus the routed
    /// experts at the session's experts per token).
    pub fn decode_bytes_per_token(&self) -> u64 {
        self.decode_bytes_per_token
    }

    /// Whether routed experts are served from a mapping of the expert files
    /// (see [`crate::io`]).
    pub fn experts_mapped(&self) -> bool {
        self.store
            .layers()
            .any(|l| self.store.is_mapped(l) == Some(true))
    }

    /// Where this batch computes: `cpu`, or `cuda: GPU 0 (...)`; for
    /// `Backend::Auto` on the CPU, also why no GPU was used.
    pub fn backend(&self) -> &str {
        &self.backend_note
    }

    /// With `Backend::Auto`: why the session runs on the CPU although this
    /// build has a GPU backend — it cannot run this model (the
    /// `Error::Unsupported` message). `None` otherwise.
    pub fn gpu_unsupported(&self) -> Option<&str> {
        self.unsupported_on_gpu.as_deref()
    }

    /// In a group of processes (`SessionOptions::dist`): the seed every
    /// process received from rank 0, for sampling the same tokens.
    pub fn shared_seed(&self) -> Option<u64> {
        match &self.engine {
            Engine::Cuda(m) => m.shared_seed(),
            Engine::Cpu { .. } => None,
        }
    }

    /// Whether the forward pass runs on a GPU.
    pub fn on_gpu(&self) -> bool {
        matches!(self.engine, Engine::Cuda(_))
    }

    /// GPU expert cache: hits, misses, bytes uploaded (zero on the CPU).
    pub fn gpu_cache_stats(&self) -> CacheStats {
        match &self.engine {
            Engine::Cuda(m) => m.cache_stats(),
            Engine::Cpu { .. } => CacheStats::default(),
        }
    }

    /// GPU memory read bandwidth and pinned host-to-GPU copy bandwidth in
    /// GB/s, measured now (`None` on the CPU).
    pub fn gpu_bandwidths(&self) -> Result<Option<(f64, f64)>> {
        match &self.engine {
            Engine::Cuda(m) => {
                let gpu = m.lead().gpu();
                Ok(Some((gpu.hbm_read_gb_s()?, gpu.h2d_pinned_gb_s()?)))
            }
            Engine::Cpu { .. } => Ok(None),
        }
    }

    /// What the GPU's pinned host tier holds (nothing on the CPU).
    pub fn gpu_host_tier(&self) -> crate::backend::cuda::HostTierInfo {
        match &self.engine {
            Engine::Cuda(m) => m.host_tier(),
            Engine::Cpu { .. } => Default::default(),
        }
    }

    /// Expert slots of the GPU expert cache (0 on the CPU).
    pub fn gpu_cache_slots(&self) -> usize {
        match &self.engine {
            Engine::Cuda(m) => m.cache_slots(),
            Engine::Cpu { .. } => 0,
        }
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The routed-expert store (for I/O measurements).
    pub fn expert_store(&self) -> &ExpertStore {
        &self.store
    }

    /// Drops the expert files from the page cache, for cold-start
    /// measurements (see [`ExpertStore::evict_page_cache`]).
    pub fn evict_expert_cache(&self) -> Result<()> {
        self.store.evict_page_cache()
    }

    /// Speculative prefetch counters since open.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.prefetch_stats
    }

    pub fn io_stats(&self) -> IoStats {
        self.store.stats()
    }

    /// Reads of each routed expert of `layer` since open (see
    /// [`ExpertStore::expert_reads`]); `None` for a layer without experts.
    pub fn expert_reads(&self, layer: usize) -> Option<Vec<u64>> {
        self.store.expert_reads(layer)
    }

    /// Wall time per forward phase, summed over every eval since open or
    /// the last `reset_times`.
    pub fn times(&self) -> PhaseTimes {
        self.times
    }

    pub fn reset_times(&mut self) {
        self.times = PhaseTimes::default();
    }

    /// A new, empty sequence (position 0). On the GPU its state takes VRAM
    /// as it grows (a sliding-window layer's only up to its ring: see
    /// [`Batch::cache_rows`]).
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        let state = self.engine.new_state(&self.model)?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(
            id,
            Sequence {
                state,
                tokens: Vec::new(),
                checkpoints: BTreeMap::new(),
                checkpoint_order: Vec::new(),
                poisoned: false,
            },
        );
        Ok(id)
    }

    /// Drops a sequence and its state; an unknown id is an error.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<()> {
        self.seqs
            .remove(&id)
            .map(drop)
            .ok_or_else(|| no_sequence(id))
    }

    /// The sequences held, ascending.
    pub fn sequences(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or_else(|| no_sequence(id))
    }

    fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence> {
        self.seqs.get_mut(&id).ok_or_else(|| no_sequence(id))
    }

    /// Tokens evaluated so far in `id` (its next token's position).
    pub fn position(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.tokens.len())
    }

    /// Per layer, the rows its attention cache takes in memory (see
    /// [`Engine::cache_rows`]).
    pub fn cache_rows(&self, id: SeqId) -> Result<Vec<Option<usize>>> {
        Ok(self.engine.cache_rows(&self.seq(id)?.state))
    }

    /// The tokens evaluated so far in `id`.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.tokens)
    }

    /// Evaluates `tokens` after `id`'s position (as [`Batch::step`] with
    /// this one sequence) and returns logits: `[vocab]` for
    /// `LogitsMode::Last`, `[tokens.len(), vocab]` for `All`
    /// (`LogitsMode::Greedy` gives a token: [`Batch::eval_greedy`]).
    pub fn eval(&mut self, id: SeqId, tokens: &[u32], mode: LogitsMode) -> Result<Vec<f32>> {
        if mode == LogitsMode::Greedy {
            return Err(Error::Invalid(
                "LogitsMode::Greedy gives a token, not logits: use eval_greedy".into(),
            ));
        }
        self.eval_output(id, tokens, mode).map(Output::into_logits)
    }

    /// Evaluates `tokens` after `id`'s position and returns the most likely
    /// next token (as greedy sampling of [`Batch::eval`]'s logits would,
    /// without copying the logits back from a GPU).
    pub fn eval_greedy(&mut self, id: SeqId, tokens: &[u32]) -> Result<u32> {
        let out = self.eval_output(id, tokens, LogitsMode::Greedy)?;
        Ok(out.token().expect("a greedy eval gives a token"))
    }

    fn eval_output(&mut self, id: SeqId, tokens: &[u32], mode: LogitsMode) -> Result<Output> {
        let work = [Work {
            seq: id,
            tokens,
            logits: Some(mode),
        }];
        self.step_inner(&work, None)?.remove(0)
    }

    /// [`Batch::eval`] that also records every block's output (see
    /// [`Trace`]). On the GPU a traced eval runs eagerly (no CUDA graph).
    pub fn eval_traced(
        &mut self,
        id: SeqId,
        tokens: &[u32],
        mode: LogitsMode,
    ) -> Result<(Vec<f32>, Trace)> {
        let rows = match mode {
            LogitsMode::All => tokens.len(),
            LogitsMode::Last => 1,
            LogitsMode::Greedy => {
                return Err(Error::Invalid(
                    "a traced eval returns logits: use LogitsMode::Last".into(),
                ))
            }
        };
        let mut trace = Trace::new(tokens.len(), rows);
        let work = [Work {
            seq: id,
            tokens,
            logits: Some(mode),
        }];
        let logits = self.step_inner(&work, Some(&mut trace))?.remove(0)?;
        Ok((logits.into_logits(), trace))
    }

    /// Evaluates every `work` item in one forward pass: per item, its
    /// tokens after its sequence's position. Returns per item its output
    /// (logits, `[vocab]` per logit row, empty for `logits: None`; or the
    /// token of `LogitsMode::Greedy`), or the error
    /// that item alone ended with (logits holding a NaN or an infinity:
    /// that sequence is poisoned, the others go on). The outer error is a
    /// refused step (unknown or repeated sequence, empty or out-of-range
    /// tokens, a sequence past its context, a poisoned sequence: nothing
    /// was evaluated) or a failed pass (every sequence of the step is then
    /// poisoned).
    pub fn step(&mut self, work: &[Work<'_>]) -> Result<Vec<Result<Output>>> {
        self.step_inner(work, None)
    }

    fn step_inner(
        &mut self,
        work: &[Work<'_>],
        trace: Option<&mut Trace>,
    ) -> Result<Vec<Result<Output>>> {
        if work.is_empty() {
            return Err(Error::EmptyTokens);
        }
        let vocab = self.vocab_size();
        let mut seen = HashSet::new();
        for w in work {
            let seq = self.seq(w.seq)?;
            if !seen.insert(w.seq) {
                return Err(Error::Invalid(format!("{} is twice in one step", w.seq)));
            }
            if seq.poisoned {
                return Err(Error::Invalid(format!(
                    "{}: state is invalid after a failed eval; call clear(), truncate() or restore_to()",
                    w.seq
                )));
            }
            if w.tokens.is_empty() {
                return Err(Error::EmptyTokens);
            }
            if let Some((index, &token)) = w
                .tokens
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= vocab)
            {
                return Err(Error::TokenOutOfRange {
                    token,
                    index,
                    vocab,
                });
            }
            let end = seq.tokens.len() + w.tokens.len();
            if end > self.max_context {
                return Err(Error::ContextFull {
                    requested: end,
                    limit: self.max_context,
                });
            }
        }
        // A dense file truncated since open: an error, not a SIGBUS.
        self.model.weights.dense.check_unchanged()?;

        let mut segs = Vec::with_capacity(work.len());
        let mut tokens = Vec::with_capacity(work.iter().map(|w| w.tokens.len()).sum());
        for w in work {
            let start = self.seqs[&w.seq].tokens.len();
            segs.push(Segment {
                rows: tokens.len()..tokens.len() + w.tokens.len(),
                start,
                logits: w.logits,
            });
            tokens.extend_from_slice(w.tokens);
        }
        let mut by_id: HashMap<SeqId, &mut Sequence> = self
            .seqs
            .iter_mut()
            .filter(|(id, _)| seen.contains(id))
            .map(|(id, s)| (*id, s))
            .collect();
        let states = work
            .iter()
            .map(|w| {
                let s = by_id.remove(&w.seq).expect("checked above");
                &mut s.state
            })
            .collect();
        let cx = ForwardCtx {
            model: &self.model,
            store: &self.store,
            pool: &self.pool,
            k: self.k_active,
            prefetch: self.prefetch,
            prefetch_stats: &mut self.prefetch_stats,
            times: &mut self.times,
        };
        let parts = match self.engine.forward(cx, states, segs, &tokens, trace) {
            Ok(l) => l,
            Err(e) => {
                for w in work {
                    self.seqs.get_mut(&w.seq).expect("checked above").poisoned = true;
                }
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(work.len());
        for (w, mine) in work.iter().zip(parts) {
            // Weights that compute a NaN must stop generation with an
            // error, not sample garbage (or "eos"): one pass over the
            // logits (the greedy pick checks its row where it is made).
            let mine = match mine {
                SegmentOutput::Logits(l) => all_finite(&l).then_some(Output::Logits(l)),
                SegmentOutput::Token(t) => t.map(Output::Token),
            };
            if let Some(mine) = mine {
                let s = self.seqs.get_mut(&w.seq).expect("checked above");
                s.tokens.extend_from_slice(w.tokens);
                out.push(Ok(mine));
            } else {
                let s = self.seqs.get_mut(&w.seq).expect("checked above");
                s.poisoned = true;
                let history: Vec<u32> = s.tokens.iter().chain(w.tokens).copied().collect();
                out.push(Err(self.non_finite_error(w.seq, &history)));
            }
        }
        Ok(out)
    }

    /// The error for an eval whose logits are not finite, naming the first
    /// layer whose output is not: `history` (every token up to and
    /// including the failed eval's) is evaluated again from position 0, in
    /// chunks, with a checking [`Trace`], stopping at the first chunk that
    /// goes non-finite. Runs only on this error path; leaves the sequence
    /// poisoned (the caller clears or restores it).
    fn non_finite_error(&mut self, id: SeqId, history: &[u32]) -> Error {
        // Bounds the host copies of the residual stream the check reads.
        const CHUNK: usize = 256;
        let mut found = None;
        let mut failed = None;
        let seq = self.seqs.get_mut(&id).expect("the caller's sequence");
        if let Err(e) = self.engine.clear(&mut seq.state) {
            failed = Some(e);
        }
        let mut start = 0;
        while failed.is_none() && found.is_none() && start < history.len() {
            let chunk = &history[start..(start + CHUNK).min(history.len())];
            let mut trace = Trace::checking(chunk.len(), 1);
            let cx = ForwardCtx {
                model: &self.model,
                store: &self.store,
                pool: &self.pool,
                k: self.k_active,
                prefetch: false,
                prefetch_stats: &mut self.prefetch_stats,
                times: &mut self.times,
            };
            let seg = Segment::single(chunk.len(), start, LogitsMode::Last);
            match self
                .engine
                .forward(cx, vec![&mut seq.state], vec![seg], chunk, Some(&mut trace))
            {
                Ok(_) => {
                    found = trace
                        .first_non_finite
                        .map(|(layer, block)| (layer, block, start, chunk.len()))
                }
                Err(e) => failed = Some(e),
            }
            start += chunk.len();
        }
        let at = |s: usize, n: usize| format!("within token positions {s}..{}", s + n);
        Error::NonFinite(match (found, failed) {
            (Some((Some(layer), block, s, n)), _) => format!(
                "layer {layer} ({block}) is the first whose output holds a NaN or an infinity \
                 ({}); the weights of layer {layer} are likely damaged",
                at(s, n)
            ),
            (Some((None, "embed", s, n)), _) => format!(
                "the token embedding holds a NaN or an infinity ({}); \
                 model.embed_tokens is likely damaged",
                at(s, n)
            ),
            (Some((None, block, s, n)), _) => format!(
                "the {block} are the first output holding a NaN or an infinity ({}): \
                 every layer's output was finite; model.norm or the LM head is likely damaged",
                at(s, n)
            ),
            (None, Some(e)) => {
                format!("the logits hold a NaN or an infinity (finding the layer failed: {e})")
            }
            (None, None) => "the logits hold a NaN or an infinity (not reproduced when \
                             evaluated again to find the layer)"
                .into(),
        })
    }

    /// Forgets everything of `id`: position 0, empty caches, no checkpoints.
    pub fn clear(&mut self, id: SeqId) -> Result<()> {
        let seq = self.seqs.get_mut(&id).ok_or_else(|| no_sequence(id))?;
        // A device that fails here fails the next eval too; say so then.
        seq.poisoned = self.engine.clear(&mut seq.state).is_err();
        seq.tokens.clear();
        seq.forget_checkpoints();
        Ok(())
    }

    /// Records what returning to `id`'s current position needs (its
    /// linear-attention states, the rows its sliding-window layers see
    /// from here) so that `truncate`/`restore_to` can return here. Returns
    /// the position.
    pub fn checkpoint(&mut self, id: SeqId) -> Result<usize> {
        let max = self.max_checkpoints;
        let seq = self.seqs.get_mut(&id).ok_or_else(|| no_sequence(id))?;
        let pos = seq.tokens.len();
        if !seq.poisoned {
            let Ok(saved) = self.engine.rewind_state(&seq.state) else {
                seq.poisoned = true;
                return Ok(pos);
            };
            seq.checkpoints.insert(pos, saved);
            seq.touch(pos);
            while seq.checkpoint_order.len() > max {
                let old = seq.checkpoint_order.remove(0);
                seq.checkpoints.remove(&old);
            }
        }
        Ok(pos)
    }

    /// Positions of `id` with a checkpoint, ascending.
    pub fn checkpoints(&self, id: SeqId) -> Result<Vec<usize>> {
        Ok(self.seq(id)?.checkpoints.keys().copied().collect())
    }

    /// Returns `id` to a checkpointed position (or 0), dropping later
    /// checkpoints. A model without linear-attention layers returns to any
    /// position whose rows its sliding-window layers still hold (every
    /// position without such layers) without a checkpoint.
    pub fn restore_to(&mut self, id: SeqId, pos: usize) -> Result<()> {
        let seq = self.seq(id)?;
        if pos > seq.tokens.len() {
            return Err(Error::PositionBeyondEnd {
                requested: pos,
                current: seq.tokens.len(),
            });
        }
        if pos == 0 {
            return self.clear(id);
        }
        if !self.has_linear_layers() && self.engine.can_truncate(&seq.state, pos) {
            return self.rewind(id, pos, None);
        }
        let Some(saved) = seq.checkpoints.get(&pos).cloned() else {
            return Err(Error::NoCheckpoint {
                requested: pos,
                available: self.checkpoints(id)?,
            });
        };
        self.rewind(id, pos, Some(&saved))?;
        self.seq_mut(id)?.touch(pos);
        Ok(())
    }

    fn has_linear_layers(&self) -> bool {
        self.model
            .config()
            .layer_kinds
            .contains(&LayerKind::LinearAttention)
    }

    fn rewind(&mut self, id: SeqId, pos: usize, from: Option<&RewindState>) -> Result<()> {
        let seq = self.seqs.get_mut(&id).ok_or_else(|| no_sequence(id))?;
        if let Err(e) = self.engine.rewind(&mut seq.state, pos, from) {
            seq.poisoned = true;
            return Err(e);
        }
        seq.tokens.truncate(pos);
        seq.checkpoints.retain(|&p, _| p <= pos);
        let keep = &seq.checkpoints;
        seq.checkpoint_order.retain(|p| keep.contains_key(p));
        seq.poisoned = false;
        Ok(())
    }

    /// Shortens `id` to `n` tokens. Exact: attention layers drop rows;
    /// linear-attention layers, and sliding-window layers that no longer
    /// hold the rows `n` needs, restart from the nearest checkpoint at or
    /// before `n` and replay the tokens up to `n`.
    pub fn truncate(&mut self, id: SeqId, n: usize) -> Result<()> {
        let seq = self.seq(id)?;
        let position = seq.tokens.len();
        if n > position {
            return Err(Error::PositionBeyondEnd {
                requested: n,
                current: position,
            });
        }
        if n == position && !seq.poisoned {
            return Ok(());
        }
        if n == 0 || (!self.has_linear_layers() && self.engine.can_truncate(&seq.state, n)) {
            return self.restore_to(id, n);
        }
        let Some(&c) = seq.checkpoints.range(..=n).next_back().map(|(p, _)| p) else {
            return Err(Error::NoCheckpoint {
                requested: n,
                available: self.checkpoints(id)?,
            });
        };
        let replay = seq.tokens[c..n].to_vec();
        self.restore_to(id, c)?;
        if !replay.is_empty() {
            self.eval(id, &replay, LogitsMode::Last)?;
        }
        Ok(())
    }

    /// Serializes `id`'s whole state (see `snapshot` for the format).
    pub fn state_save(&self, id: SeqId) -> Result<Vec<u8>> {
        let seq = self.seq(id)?;
        if seq.poisoned {
            return Err(Error::Invalid(format!(
                "{id}: state is invalid after a failed eval"
            )));
        }
        Ok(snapshot::save(
            self.model.config(),
            self.fingerprint,
            &seq.tokens,
            self.engine.host_state(&seq.state)?.as_ref(),
        ))
    }

    /// The largest snapshot [`state_save`](Self::state_save) can write for
    /// this model: one at the context limit. A file longer than this is
    /// no snapshot of it, whatever it holds.
    pub fn max_snapshot_len(&self) -> u64 {
        snapshot::len_at(&self.model.new_state(), self.max_context)
    }

    /// Replaces `id`'s state with a snapshot from `state_save` (of any
    /// sequence of this model, on either backend). The snapshot is
    /// validated completely first; on error nothing changes. Checkpoints
    /// are dropped (they belonged to the previous sequence).
    pub fn state_load(&mut self, id: SeqId, bytes: &[u8]) -> Result<()> {
        self.seq(id)?;
        let template = self.model.new_state();
        let (tokens, state) = snapshot::load(
            self.model.config(),
            self.fingerprint,
            self.max_context,
            &template,
            bytes,
        )
        .map_err(Error::Snapshot)?;
        let seq = self.seqs.get_mut(&id).expect("checked above");
        self.engine.set_state(&mut seq.state, state)?;
        seq.tokens = tokens;
        seq.forget_checkpoints();
        seq.poisoned = false;
        Ok(())
    }
}

fn no_sequence(id: SeqId) -> Error {
    Error::Invalid(format!("no {id} in this batch"))
}

/// Whether every value is finite: one pass, in blocks whose inner loop has
/// no early exit so that it vectorizes (checked on every eval's logits).
fn all_finite(v: &[f32]) -> bool {
    v.chunks(256)
        .all(|c| c.iter().fold(true, |ok, x| ok & x.is_finite()))
}
