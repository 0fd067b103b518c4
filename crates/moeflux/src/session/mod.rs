//! `Session`: one sequence over one model — eval, position, truncation,
//! checkpoints and snapshots; `Batch` (`batch.rs`): several sequences over
//! one model, evaluated together.

mod batch;
mod engine;
pub mod snapshot;

use std::path::Path;

pub use crate::backend::cpu::qmatmul::Activations;
pub use crate::backend::cpu::repack::Repack;
pub use crate::backend::cuda::gds::Gds;
pub use crate::backend::cuda::rendezvous::DistInit;
pub use crate::backend::cuda::GpuSelection;
use crate::backend::cuda::{CachePolicy, CacheStats};
pub use crate::backend::prefetch::Prefetch;
use crate::backend::prefetch::PrefetchStats;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::io::{ExpertStore, IoStats};
pub use crate::model::timing::PhaseTimes;
pub use crate::model::trace::{Trace, TraceEntry};
pub use crate::model::LogitsMode;
pub use batch::{Batch, Output, SeqId, Work};

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
    /// GPU backend: which GPUs (`--gpus`). Several form an expert-parallel
    /// group: the dense model and the sequence state on each, the routed
    /// experts sharded between them, NCCL summing each MoE layer's output.
    /// Anything but the default needs a GPU: with `Backend::Auto` it is an
    /// error, not a fallback to the CPU, when they cannot be used.
    pub gpus: GpuSelection,
    /// GPU backend: this process is one rank of a group of processes
    /// (`--dist-init`), on one GPU (`gpus` names it; default: GPU `rank`
    /// modulo the host's GPUs). Every rank must evaluate the same tokens.
    pub dist: Option<DistInit>,
    /// GPU backend: bytes of GPU memory for the routed-expert cache
    /// (`None`: all that is free after the dense weights, less a reserve).
    pub gpu_memory: Option<u64>,
    /// GPU backend: which cached expert to replace.
    pub cache_policy: CachePolicy,
    /// GPU backend: replay decode steps as CUDA graphs (when every expert
    /// is resident).
    pub cuda_graphs: bool,
    /// GPU backend: a decode step's shared experts on a second stream,
    /// beside the router and routed experts (the same values; on by
    /// default).
    pub cuda_side_stream: bool,
    /// GPU backend: bytes of host RAM to pin for routed experts the VRAM
    /// cache cannot hold (whole layers of the mapped expert files), so
    /// misses cross PCIe at full speed.
    pub host_cache: Option<u64>,
    /// GPU backend with a host tier: at most this many of a layer's
    /// experts that are neither in VRAM nor being uploaded are computed by
    /// the CPU instead (see `CudaOptions::cpu_experts`).
    pub cpu_experts: usize,
    /// GPU backend, several GPUs: when every GPU can hold every routed
    /// expert, each does (see `CudaOptions::replicate_experts`); `false`
    /// always shards them.
    pub replicate_experts: bool,
    /// GPU backend with `direct_io`: read expert misses from the files
    /// straight into VRAM through cuFile (GPUDirect Storage; see
    /// `CudaOptions::gds`).
    pub gds: Gds,
    /// CPU products: exact f32 activations (the default) or activations
    /// rounded to 8 bits per group of 32 for 4/8-bit affine and MXFP4
    /// weights (faster one-token products; the accuracy cost is in
    /// docs/PERFORMANCE.md). Set on this session's compute threads only.
    pub cpu_activations: Activations,
    /// GPU backend: the same choice for the products of 4-bit affine
    /// matrices (routers stay exact), computed with `dp4a` for 1-15 tokens
    /// and on int8 tensor cores for more (prefill).
    pub gpu_activations: Activations,
    /// CPU backend: when to hold 4-bit experts interleaved in RAM (faster
    /// 8-bit-activation products, same bits; see
    /// [`crate::backend::cpu::repack`]).
    pub cpu_repack: Repack,
    /// Use the model's low-width copies of its routed experts (`moeflux
    /// convert --low-width-copies`) in place of the experts, on every
    /// backend: fewer bytes per expert read, uploaded and cached, at a
    /// quality cost (`moeflux perplexity --kl` measures it).
    pub low_width_experts: bool,
    /// GPU backend: keep the expert cache's experts at full width but
    /// upload a miss as its low-width copy (fewer bytes over PCIe on the
    /// critical path). Predicted experts the prefetch uploads from the host
    /// tier travel at full width and replace the low copies they find, so
    /// the experts in use settle at full width. A miss's width depends on
    /// what the cache held, so results are not reproducible step for step
    /// as with full-width experts.
    pub low_width_misses: bool,
    /// With `low_width_misses`: the experts whose routing weight (the
    /// largest a token of the step gives the expert, as the combine
    /// applies it) is below this travel as copies, misses and the
    /// prefetch's predicted experts alike (the latter where the host tier
    /// pins the copies); the rest are uploaded at full width and replace a
    /// copy found in VRAM (the importance rule of HOBBIT). `None`: every
    /// miss travels as a copy, every prefetch at full width.
    pub low_width_below: Option<f32>,
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
            gpus: GpuSelection::First,
            dist: None,
            gpu_memory: None,
            cache_policy: CachePolicy::default(),
            cuda_graphs: true,
            cuda_side_stream: true,
            host_cache: None,
            cpu_experts: 0,
            replicate_experts: true,
            gds: Gds::Auto,
            cpu_activations: Activations::F32,
            gpu_activations: Activations::F32,
            cpu_repack: Repack::Auto,
            low_width_experts: false,
            low_width_misses: false,
            low_width_below: None,
        }
    }
}

/// One sequence over one model: a [`Batch`] holding one sequence.
pub struct Session {
    batch: Batch,
    id: SeqId,
}

impl Session {
    /// Opens a model directory written by `moeflux convert`.
    pub fn open(dir: &Path, opts: SessionOptions) -> Result<Self> {
        let mut batch = Batch::open(dir, opts)?;
        let id = batch.add_sequence()?;
        Ok(Session { batch, id })
    }

    /// The batch behind this session (the model, its store and engine).
    pub fn batch(&self) -> &Batch {
        &self.batch
    }

    /// The batch behind this session and the session's sequence in it, to
    /// add more sequences over the same loaded model.
    pub fn into_batch(self) -> (Batch, SeqId) {
        (self.batch, self.id)
    }

    pub fn config(&self) -> &ModelConfig {
        self.batch.config()
    }

    pub fn model_dir(&self) -> &Path {
        self.batch.model_dir()
    }

    pub fn vocab_size(&self) -> usize {
        self.batch.vocab_size()
    }

    /// Routed experts evaluated per token.
    pub fn experts_per_token(&self) -> usize {
        self.batch.experts_per_token()
    }

    /// Number of tokens evaluated so far (the next token's position).
    pub fn position(&self) -> usize {
        self.tokens().len()
    }

    /// Per layer, the rows its attention cache takes in memory: on the GPU
    /// the rows allocated (a sliding-window layer's ring: bounded by its
    /// window and the largest chunk evaluated), on the CPU the rows held;
    /// `None` for a linear-attention layer.
    pub fn cache_rows(&self) -> Vec<Option<usize>> {
        self.batch
            .cache_rows(self.id)
            .expect("the session's own sequence")
    }

    /// The longest sequence this session accepts (`SessionOptions::max_context`).
    pub fn max_context(&self) -> usize {
        self.batch.max_context()
    }

    /// The tokens evaluated so far.
    pub fn tokens(&self) -> &[u32] {
        self.batch
            .tokens(self.id)
            .expect("the session's own sequence")
    }

    /// Weight bytes one decoded token reads (dense weights plus the routed
    /// experts at the session's experts per token).
    pub fn decode_bytes_per_token(&self) -> u64 {
        self.batch.decode_bytes_per_token()
    }

    /// Whether routed experts are served from a mapping of the expert files.
    pub fn experts_mapped(&self) -> bool {
        self.batch.experts_mapped()
    }

    /// Where this session computes (see [`Batch::backend`]).
    pub fn backend(&self) -> &str {
        self.batch.backend()
    }

    /// See [`Batch::shared_seed`].
    pub fn shared_seed(&self) -> Option<u64> {
        self.batch.shared_seed()
    }

    /// See [`Batch::gpu_unsupported`].
    pub fn gpu_unsupported(&self) -> Option<&str> {
        self.batch.gpu_unsupported()
    }

    /// Whether the forward pass runs on a GPU.
    pub fn on_gpu(&self) -> bool {
        self.batch.on_gpu()
    }

    /// GPU expert cache: hits, misses, bytes uploaded (zero on the CPU).
    pub fn gpu_cache_stats(&self) -> CacheStats {
        self.batch.gpu_cache_stats()
    }

    /// See [`Batch::gpu_bandwidths`].
    pub fn gpu_bandwidths(&self) -> Result<Option<(f64, f64)>> {
        self.batch.gpu_bandwidths()
    }

    /// See [`Batch::gpu_host_tier`].
    pub fn gpu_host_tier(&self) -> crate::backend::cuda::HostTierInfo {
        self.batch.gpu_host_tier()
    }

    /// Expert slots of the GPU expert cache (0 on the CPU).
    pub fn gpu_cache_slots(&self) -> usize {
        self.batch.gpu_cache_slots()
    }

    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.batch.threads()
    }

    /// The routed-expert store (for I/O measurements).
    pub fn expert_store(&self) -> &ExpertStore {
        self.batch.expert_store()
    }

    /// See [`Batch::evict_expert_cache`].
    pub fn evict_expert_cache(&self) -> Result<()> {
        self.batch.evict_expert_cache()
    }

    /// Speculative prefetch counters since open.
    pub fn prefetch_stats(&self) -> PrefetchStats {
        self.batch.prefetch_stats()
    }

    pub fn io_stats(&self) -> IoStats {
        self.batch.io_stats()
    }

    /// See [`Batch::expert_reads`].
    pub fn expert_reads(&self, layer: usize) -> Option<Vec<u64>> {
        self.batch.expert_reads(layer)
    }

    /// Wall time per forward phase, summed over every eval since open or
    /// the last `reset_times`.
    pub fn times(&self) -> PhaseTimes {
        self.batch.times()
    }

    pub fn reset_times(&mut self) {
        self.batch.reset_times()
    }

    /// Evaluates `tokens` after the current position as one batch and returns
    /// logits: `[vocab]` for `LogitsMode::Last`, `[tokens.len(), vocab]` for `All`.
    pub fn eval(&mut self, tokens: &[u32], mode: LogitsMode) -> Result<Vec<f32>> {
        self.batch.eval(self.id, tokens, mode)
    }

    /// Evaluates `tokens` after the current position and returns the most
    /// likely next token: what greedy sampling of [`Session::eval`]'s
    /// logits picks, without copying the logits back from a GPU.
    pub fn eval_greedy(&mut self, tokens: &[u32]) -> Result<u32> {
        self.batch.eval_greedy(self.id, tokens)
    }

    /// [`Session::eval`] that also records every block's output (the
    /// embedding, per layer the norms and what the mixer and the MLP added
    /// to the residual stream, the logits) — to find the block where two
    /// backends, or the engine and an oracle, diverge. On the GPU a traced
    /// eval runs eagerly (no CUDA graph). [`Trace::write_dir`] saves it as
    /// `.npy` files.
    pub fn eval_traced(&mut self, tokens: &[u32], mode: LogitsMode) -> Result<(Vec<f32>, Trace)> {
        self.batch.eval_traced(self.id, tokens, mode)
    }

    /// Forgets everything: position 0, empty caches, no checkpoints.
    pub fn clear(&mut self) {
        let _ = self.batch.clear(self.id);
    }

    /// Records the linear-attention state at the current position so that
    /// `truncate`/`restore_to` can return here. Returns the position.
    pub fn checkpoint(&mut self) -> usize {
        self.batch
            .checkpoint(self.id)
            .expect("the session's own sequence")
    }

    /// Positions with a checkpoint, ascending.
    pub fn checkpoints(&self) -> Vec<usize> {
        self.batch
            .checkpoints(self.id)
            .expect("the session's own sequence")
    }

    /// Returns to a checkpointed position (or 0), dropping later checkpoints.
    pub fn restore_to(&mut self, pos: usize) -> Result<()> {
        self.batch.restore_to(self.id, pos)
    }

    /// Shortens the sequence to `n` tokens. Exact: attention layers drop
    /// rows; linear-attention layers restart from the nearest checkpoint at or
    /// before `n` and replay the tokens up to `n`.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        self.batch.truncate(self.id, n)
    }

    /// Serializes the whole sequence state (see `snapshot` for the format).
    pub fn state_save(&self) -> Result<Vec<u8>> {
        self.batch.state_save(self.id)
    }

    /// The largest snapshot [`state_save`](Self::state_save) can write for
    /// this session: one at the context limit. A file longer than this is
    /// no snapshot of this session, whatever it holds.
    pub fn max_snapshot_len(&self) -> u64 {
        self.batch.max_snapshot_len()
    }

    /// Replaces the session state with a snapshot from `state_save`. The
    /// snapshot is validated completely first; on error nothing changes.
    /// Checkpoints are dropped (they belonged to the previous sequence).
    pub fn state_load(&mut self, bytes: &[u8]) -> Result<()> {
        self.batch.state_load(self.id, bytes)
    }
}
