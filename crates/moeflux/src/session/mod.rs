//! `Session`: one sequence over one model — eval, position, truncation,
//! checkpoints and snapshots.

mod engine;
pub mod snapshot;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::backend::cuda::{support, CachePolicy, CacheStats, CudaModel, CudaOptions, Gpu};
pub use crate::backend::prefetch::Prefetch;
use crate::backend::prefetch::PrefetchStats;
use crate::config::{LayerKind, ModelConfig};
use crate::error::{Error, Result};
use crate::format::MANIFEST_FILE;
use crate::io::{ExpertStore, ExpertStoreOptions, IoStats};
use crate::model::state::LinearState;
pub use crate::model::timing::PhaseTimes;
pub use crate::model::trace::{Trace, TraceEntry};
pub use crate::model::LogitsMode;
use crate::model::Model;
use engine::{Engine, ForwardCtx};

#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// Compute threads; `None` uses every core.
    pub threads: Option<usize>,
    /// Routed experts per token, at most the model's `num_experts_per_tok`;
    /// fewer is faster and lowers quality.
    pub experts_per_token: Option<usize>,
    /// Read experts with O_DIRECT (bypassing the page cache).
    pub direct_io: bool,
    /// Without `direct_io`: serve experts from a read-only mapping of the
    /// expert files (no copies) rather than reading them into buffers.
    pub mmap: bool,
    /// Threads issuing expert reads.
    pub io_threads: usize,
    /// Checkpoints kept; the least recently used is dropped beyond this.
    pub max_checkpoints: usize,
    /// Longest sequence allowed; `None` uses `max_position_embeddings`.
    pub max_context: Option<usize>,
    /// Fetch the experts the next MoE layer's router would pick for the
    /// current hidden state while the current layer computes (see
    /// [`crate::backend::prefetch`]; on the GPU, uploads from the host tier).
    pub prefetch: Prefetch,
    /// Where the forward pass runs.
    pub backend: Backend,
    /// GPU backend: bytes of GPU memory for the routed-expert cache
    /// (`None`: all that is free after the dense weights, less a reserve).
    pub gpu_memory: Option<u64>,
    /// GPU backend: which cached expert to replace.
    pub cache_policy: CachePolicy,
    /// GPU backend: replay decode steps as CUDA graphs (when every expert
    /// is resident).
    pub cuda_graphs: bool,
    /// GPU backend: bytes of host RAM to pin for routed experts the VRAM
    /// cache cannot hold (whole layers of the mapped expert files), so
    /// misses cross PCIe at full speed.
    pub host_cache: Option<u64>,
    /// GPU backend with a host tier: at most this many of a layer's
    /// experts that are neither in VRAM nor being uploaded are computed by
    /// the CPU instead (see `CudaOptions::cpu_experts`).
    pub cpu_experts: usize,
}

/// Where a session computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// The GPU when a CUDA driver and device are present, else the CPU.
    Auto,
    #[default]
    Cpu,
    /// An NVIDIA GPU through CUDA; an error when none can be used.
    Cuda,
}

impl Backend {
    pub fn parse(s: &str) -> Option<Backend> {
        match s {
            "auto" => Some(Backend::Auto),
            "cpu" => Some(Backend::Cpu),
            "cuda" | "gpu" => Some(Backend::Cuda),
            _ => None,
        }
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            threads: None,
            experts_per_token: None,
            direct_io: false,
            mmap: true,
            io_threads: 8,
            max_checkpoints: 8,
            max_context: None,
            prefetch: Prefetch::Auto,
            backend: Backend::Cpu,
            gpu_memory: None,
            cache_policy: CachePolicy::default(),
            cuda_graphs: true,
            host_cache: None,
            cpu_experts: 0,
        }
    }
}

pub struct Session {
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
    tokens: Vec<u32>,
    k_active: usize,
    max_context: usize,
    max_checkpoints: usize,
    /// Linear-layer states by position; the Vec keeps use order (last = newest).
    checkpoints: BTreeMap<usize, Vec<LinearState>>,
    checkpoint_order: Vec<usize>,
    fingerprint: u64,
    decode_bytes_per_token: u64,
    /// Set when an eval failed midway: the state is then inconsistent until
    /// `clear`, `restore_to`, `truncate` or `state_load`.
    poisoned: bool,
    times: PhaseTimes,
    prefetch: bool,
    prefetch_stats: PrefetchStats,
}

impl Session {
    /// Opens a model directory written by `moeflux convert`.
    pub fn open(dir: &Path, opts: SessionOptions) -> Result<Self> {
        let manifest_path = dir.join(MANIFEST_FILE);
        // Read (size-checked) and parsed before its bytes are hashed.
        let (manifest, config) = Model::read_dir(dir)?;
        let manifest_bytes =
            std::fs::read(&manifest_path).map_err(|e| Error::io(&manifest_path, e))?;
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
        let model = Model::load(dir, &manifest, config)?;
        // Whether the GPU backend takes this model is known without a GPU:
        // `cuda` fails with the reason, `auto` runs on the CPU and says why.
        let mut unsupported_on_gpu = None;
        let gpu = match opts.backend {
            Backend::Cpu => Err("CPU backend requested".to_string()),
            Backend::Cuda => {
                support::check(&model)?;
                Ok(Gpu::open()?)
            }
            Backend::Auto => match support::check(&model) {
                Ok(()) => Gpu::open().map_err(|e| e.to_string()),
                Err(e @ Error::Unsupported { .. }) => {
                    unsupported_on_gpu = Some(e.to_string());
                    Err(e.to_string())
                }
                Err(e) => return Err(e),
            },
        };
        let store = ExpertStore::open(
            dir,
            &manifest,
            &ExpertStoreOptions {
                direct_io: opts.direct_io,
                // The GPU uploads experts from pinned buffers: read into
                // them, unless the mapped files themselves are pinned.
                mmap: opts.mmap && (gpu.is_err() || opts.host_cache.is_some()),
                io_threads: opts.io_threads.max(1),
                ..Default::default()
            },
        )?;
        let (engine, backend_note) = match gpu {
            // Every family runs on the GPU (the CUDA model takes either).
            Ok(gpu) => {
                let mut note = format!("cuda: {}", gpu.info);
                let cuda = CudaOptions {
                    gpu_memory: opts.gpu_memory,
                    cache_policy: opts.cache_policy,
                    graphs: opts.cuda_graphs,
                    host_cache: opts.host_cache,
                    prefetch: opts.prefetch,
                    cpu_experts: opts.cpu_experts,
                };
                let m = CudaModel::new(gpu, &model, &store, &cuda)?;
                let (layers, bytes) = m.host_tier();
                if layers > 0 {
                    note.push_str(&format!(
                        "; host tier: experts of {layers} layers ({:.1} GB) pinned",
                        bytes as f64 / 1e9
                    ));
                    if m.prefetching() {
                        note.push_str(", predicted experts uploaded ahead");
                    }
                    if opts.cpu_experts > 0 {
                        note.push_str(&format!(
                            ", up to {} missing experts per layer computed on the CPU",
                            opts.cpu_experts
                        ));
                    }
                }
                (Engine::Cuda(Box::new(m)), note)
            }
            Err(why) => (
                Engine::Cpu {
                    state: model.new_state(),
                    bufs: Vec::new(),
                },
                match (opts.backend, &unsupported_on_gpu) {
                    (Backend::Auto, Some(_)) => format!("cpu ({why})"),
                    (Backend::Auto, None) => format!("cpu (no GPU: {why})"),
                    _ => "cpu".to_string(),
                },
            ),
        };
        let threads = opts.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("moeflux-compute-{i}"))
            .build()
            .map_err(|e| Error::Invalid(format!("cannot start {threads} compute threads: {e}")))?;
        let decode_bytes_per_token = manifest.decode_bytes_per_token(
            k_active,
            model.config().vocab_size,
            model.config().tie_word_embeddings,
        );
        Ok(Session {
            dir: dir.to_path_buf(),
            model,
            store,
            pool,
            engine,
            backend_note,
            unsupported_on_gpu,
            tokens: Vec::new(),
            k_active,
            max_context,
            max_checkpoints: opts.max_checkpoints,
            checkpoints: BTreeMap::new(),
            checkpoint_order: Vec::new(),
            fingerprint: crate::hash::fnv1a(&manifest_bytes),
            decode_bytes_per_token,
            poisoned: false,
            times: PhaseTimes::default(),
            // The CPU path prefetches only when asked (see `Prefetch::Auto`).
            prefetch: opts.prefetch == Prefetch::On,
            prefetch_stats: PrefetchStats::default(),
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

    /// Number of tokens evaluated so far (the next token's position).
    pub fn position(&self) -> usize {
        self.tokens.len()
    }

    /// The longest sequence this session accepts (`SessionOptions::max_context`).
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The tokens evaluated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
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

    /// Where this session computes: `cpu`, or `cuda: GPU 0 (...)`; for
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
            Engine::Cuda(m) => Ok(Some((m.gpu().hbm_read_gb_s()?, m.gpu().h2d_pinned_gb_s()?))),
            Engine::Cpu { .. } => Ok(None),
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

    /// Evaluates `tokens` after the current position as one batch and returns
    /// logits: `[vocab]` for `LogitsMode::Last`, `[tokens.len(), vocab]` for `All`.
    pub fn eval(&mut self, tokens: &[u32], mode: LogitsMode) -> Result<Vec<f32>> {
        self.eval_inner(tokens, mode, None)
    }

    /// [`Session::eval`] that also records every block's output (the
    /// embedding, per layer the norms and what the mixer and the MLP added
    /// to the residual stream, the logits) — to find the block where two
    /// backends, or the engine and an oracle, diverge. On the GPU a traced
    /// eval runs eagerly (no CUDA graph). [`Trace::write_dir`] saves it as
    /// `.npy` files.
    pub fn eval_traced(&mut self, tokens: &[u32], mode: LogitsMode) -> Result<(Vec<f32>, Trace)> {
        let rows = match mode {
            LogitsMode::All => tokens.len(),
            LogitsMode::Last => 1,
        };
        let mut trace = Trace::new(tokens.len(), rows);
        let logits = self.eval_inner(tokens, mode, Some(&mut trace))?;
        Ok((logits, trace))
    }

    fn eval_inner(
        &mut self,
        tokens: &[u32],
        mode: LogitsMode,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>> {
        if self.poisoned {
            return Err(Error::Invalid(
                "session state is invalid after a failed eval; call clear(), truncate() or restore_to()".into(),
            ));
        }
        if tokens.is_empty() {
            return Err(Error::EmptyTokens);
        }
        let vocab = self.vocab_size();
        if let Some((index, &token)) = tokens
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
        let end = self.position() + tokens.len();
        if end > self.max_context {
            return Err(Error::ContextFull {
                requested: end,
                limit: self.max_context,
            });
        }
        // A dense file truncated since open: an error, not a SIGBUS.
        self.model.weights.dense.check_unchanged()?;
        let start = self.position();
        let cx = ForwardCtx {
            model: &self.model,
            store: &self.store,
            pool: &self.pool,
            k: self.k_active,
            prefetch: self.prefetch,
            prefetch_stats: &mut self.prefetch_stats,
            times: &mut self.times,
        };
        let result = self.engine.forward(cx, tokens, start, mode, trace);
        match result {
            // One pass over the logits: weights that compute a NaN must stop
            // generation with an error, not sample garbage (or "eos").
            Ok(logits) if !all_finite(&logits) => {
                self.poisoned = true;
                let history: Vec<u32> = self.tokens.iter().chain(tokens).copied().collect();
                Err(self.non_finite_error(&history))
            }
            Ok(logits) => {
                self.tokens.extend_from_slice(tokens);
                Ok(logits)
            }
            Err(e) => {
                self.poisoned = true;
                Err(e)
            }
        }
    }

    /// The error for an eval whose logits are not finite, naming the first
    /// layer whose output is not: `history` (every token up to and
    /// including the failed eval's) is evaluated again from position 0, in
    /// chunks, with a checking [`Trace`], stopping at the first chunk that
    /// goes non-finite. Runs only on this error path; leaves the session
    /// poisoned (the caller clears or restores it).
    fn non_finite_error(&mut self, history: &[u32]) -> Error {
        // Bounds the host copies of the residual stream the check reads.
        const CHUNK: usize = 256;
        let mut found = None;
        let mut failed = None;
        if let Err(e) = self.engine.clear() {
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
            match self
                .engine
                .forward(cx, chunk, start, LogitsMode::Last, Some(&mut trace))
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

    /// Forgets everything: position 0, empty caches, no checkpoints.
    pub fn clear(&mut self) {
        // A device that fails here fails the next eval too; say so then.
        self.poisoned = self.engine.clear().is_err();
        self.tokens.clear();
        self.checkpoints.clear();
        self.checkpoint_order.clear();
    }

    /// Records the linear-attention state at the current position so that
    /// `truncate`/`restore_to` can return here. Returns the position.
    pub fn checkpoint(&mut self) -> usize {
        let pos = self.position();
        if !self.poisoned {
            let Ok(linear) = self.engine.linear_states() else {
                self.poisoned = true;
                return pos;
            };
            self.checkpoints.insert(pos, linear);
            self.touch(pos);
            while self.checkpoint_order.len() > self.max_checkpoints {
                let old = self.checkpoint_order.remove(0);
                self.checkpoints.remove(&old);
            }
        }
        pos
    }

    fn touch(&mut self, pos: usize) {
        self.checkpoint_order.retain(|&p| p != pos);
        self.checkpoint_order.push(pos);
    }

    /// Positions with a checkpoint, ascending.
    pub fn checkpoints(&self) -> Vec<usize> {
        self.checkpoints.keys().copied().collect()
    }

    /// Returns to a checkpointed position (or 0), dropping later checkpoints.
    pub fn restore_to(&mut self, pos: usize) -> Result<()> {
        if pos > self.position() {
            return Err(Error::PositionBeyondEnd {
                requested: pos,
                current: self.position(),
            });
        }
        if pos == 0 {
            self.clear();
            return Ok(());
        }
        if !self.has_linear_layers() {
            return self.rewind(pos, &[]);
        }
        let Some(linear) = self.checkpoints.get(&pos).cloned() else {
            return Err(Error::NoCheckpoint {
                requested: pos,
                available: self.checkpoints(),
            });
        };
        self.rewind(pos, &linear)?;
        self.touch(pos);
        Ok(())
    }

    fn has_linear_layers(&self) -> bool {
        self.model
            .config()
            .layer_kinds
            .contains(&LayerKind::LinearAttention)
    }

    fn rewind(&mut self, pos: usize, linear: &[LinearState]) -> Result<()> {
        if let Err(e) = self.engine.rewind(pos, linear) {
            self.poisoned = true;
            return Err(e);
        }
        self.tokens.truncate(pos);
        self.checkpoints.retain(|&p, _| p <= pos);
        let keep = &self.checkpoints;
        self.checkpoint_order.retain(|p| keep.contains_key(p));
        self.poisoned = false;
        Ok(())
    }

    /// Shortens the sequence to `n` tokens. Exact: attention layers drop
    /// rows; linear-attention layers restart from the nearest checkpoint at or
    /// before `n` and replay the tokens up to `n`.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n > self.position() {
            return Err(Error::PositionBeyondEnd {
                requested: n,
                current: self.position(),
            });
        }
        if n == self.position() && !self.poisoned {
            return Ok(());
        }
        if n == 0 || !self.has_linear_layers() {
            return self.restore_to(n);
        }
        let Some(&c) = self.checkpoints.range(..=n).next_back().map(|(p, _)| p) else {
            return Err(Error::NoCheckpoint {
                requested: n,
                available: self.checkpoints(),
            });
        };
        let replay = self.tokens[c..n].to_vec();
        self.restore_to(c)?;
        if !replay.is_empty() {
            self.eval(&replay, LogitsMode::Last)?;
        }
        Ok(())
    }

    /// Serializes the whole sequence state (see `snapshot` for the format).
    pub fn state_save(&self) -> Result<Vec<u8>> {
        if self.poisoned {
            return Err(Error::Invalid(
                "session state is invalid after a failed eval".into(),
            ));
        }
        Ok(snapshot::save(
            self.model.config(),
            self.fingerprint,
            &self.tokens,
            self.engine.host_state()?.as_ref(),
        ))
    }

    /// The largest snapshot [`state_save`](Self::state_save) can write for
    /// this session: one at the context limit. A file longer than this is
    /// no snapshot of this session, whatever it holds.
    pub fn max_snapshot_len(&self) -> u64 {
        snapshot::len_at(&self.model.new_state(), self.max_context)
    }

    /// Replaces the session state with a snapshot from `state_save`. The
    /// snapshot is validated completely first; on error nothing changes.
    /// Checkpoints are dropped (they belonged to the previous sequence).
    pub fn state_load(&mut self, bytes: &[u8]) -> Result<()> {
        let template = self.model.new_state();
        let (tokens, state) = snapshot::load(
            self.model.config(),
            self.fingerprint,
            self.max_context,
            &template,
            bytes,
        )
        .map_err(Error::Snapshot)?;
        self.engine.set_state(state)?;
        self.tokens = tokens;
        self.checkpoints.clear();
        self.checkpoint_order.clear();
        self.poisoned = false;
        Ok(())
    }
}

/// Whether every value is finite: one pass, in blocks whose inner loop has
/// no early exit so that it vectorizes (checked on every eval's logits).
fn all_finite(v: &[f32]) -> bool {
    v.chunks(256)
        .all(|c| c.iter().fold(true, |ok, x| ok & x.is_finite()))
}
