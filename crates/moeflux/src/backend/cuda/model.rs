//! The Qwen3.5-MoE / Qwen3-Next hybrid on the GPU: the whole dense part and
//! the sequence state in VRAM, routed experts in the VRAM expert cache.
//!
//! The layer structure and the weights' locations come from the CPU model
//! ([`QwenHybrid`], loaded from the same directory); the dense file is
//! uploaded once as one buffer and every tensor is an offset into it. The
//! router's top-K runs on the host with the CPU code, so both backends pick
//! the same experts; everything else runs on the device.

use crate::config::{Architecture, ModelConfig};
use crate::error::{Error, Result};
use crate::io::ExpertStore;
use crate::model::deltanet::DeltaProjections;
use crate::model::moe::{ComponentLayout, MoeBlock};
use crate::model::qwen3_hybrid::{LogitsMode, Mixer, Mlp, QwenHybrid};
use crate::model::state::{KvCache, LayerState, LinearState, ModelState};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::weights::{DType, LinearRef};

use super::device::{
    args, begin_capture, copy_dtod, end_capture, zero_async, DevBuf, Gpu, PinnedArena,
    PinnedDownload,
};
use super::experts::{CachePolicy, CacheStats, ExpertCache};

/// A quantized matrix as the kernels take it (`struct QW`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Qw {
    w: u64,
    s: u64,
    b: u64,
    rows: i32,
    cols: i32,
    bits: i32,
    gs: i32,
    sf32: i32,
}

/// Where an expert's projections are inside its extent (`struct ExpertLayout`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ExpertLayoutC {
    gate_w: i64,
    gate_s: i64,
    gate_b: i64,
    up_w: i64,
    up_s: i64,
    up_b: i64,
    down_w: i64,
    down_s: i64,
    down_b: i64,
    inter: i32,
    hidden: i32,
    bits: i32,
    gs: i32,
    sf32: i32,
}

/// One expert of a layer's batch (`struct ExpertTask`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct ExpertTask {
    base: u64,
    first: i32,
    count: i32,
}

/// A linear layer on the device.
#[derive(Clone, Copy, Debug)]
enum DevLinear {
    Quant(Qw),
    Dense {
        w: u64,
        f32: i32,
        rows: i32,
        cols: i32,
    },
}

impl DevLinear {
    fn rows(&self) -> usize {
        match self {
            DevLinear::Quant(q) => q.rows as usize,
            DevLinear::Dense { rows, .. } => *rows as usize,
        }
    }
}

fn kernel_suffix(bits: i32) -> &'static str {
    match bits {
        4 => "b4",
        8 => "b8",
        2 => "b2",
        _ => "bx",
    }
}

struct GpuLinearAttn {
    proj: GpuDeltaProj,
    conv: DevBuf,
    a_log: DevBuf,
    dt_bias: DevBuf,
    norm: DevBuf,
    out: DevLinear,
}

enum GpuDeltaProj {
    Split {
        qkv: DevLinear,
        z: DevLinear,
        b: DevLinear,
        a: DevLinear,
    },
    Fused {
        qkvz: DevLinear,
        ba: DevLinear,
    },
}

struct GpuFullAttn {
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    q_norm: DevBuf,
    k_norm: DevBuf,
}

enum GpuMixer {
    Full(GpuFullAttn),
    Linear(GpuLinearAttn),
}

struct GpuShared {
    gate: DevLinear,
    up: DevLinear,
    down: DevLinear,
    gate_scalar: DevLinear,
}

// One value per layer: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum GpuMlp {
    Moe {
        router: DevLinear,
        shared: Option<GpuShared>,
        layout: ExpertLayoutC,
    },
    Dense {
        gate: DevLinear,
        up: DevLinear,
        down: DevLinear,
    },
}

struct GpuLayer {
    input_norm: DevBuf,
    post_norm: DevBuf,
    mixer: GpuMixer,
    mlp: GpuMlp,
}

/// KV cache of one full-attention layer; grows by doubling.
struct GpuKv {
    k: DevBuf,
    v: DevBuf,
    cap: usize,
    len: usize,
    row: usize,
}

struct GpuLinearState {
    conv: DevBuf,
    ssm: DevBuf,
}

enum GpuLayerState {
    Full(GpuKv),
    Linear(GpuLinearState),
}

/// Scratch buffers, grown on demand and reused across evals. Growth moves a
/// buffer, which invalidates a captured CUDA graph (`grew` tells).
#[derive(Default)]
struct Scratch {
    bufs: std::collections::HashMap<&'static str, DevBuf>,
    grew: bool,
}

impl Scratch {
    /// Device address of scratch buffer `name` holding at least `bytes`.
    fn get(&mut self, gpu: &Gpu, name: &'static str, bytes: usize) -> Result<u64> {
        let grow = self.bufs.get(name).is_none_or(|b| b.bytes() < bytes);
        if grow {
            // Round up so slowly growing sizes do not reallocate every time.
            let cap = bytes.max(256).next_power_of_two();
            gpu.sync()?;
            self.bufs.insert(name, DevBuf::zeros(gpu, cap)?);
            self.grew = true;
        }
        Ok(self.bufs[name].ptr())
    }
}

/// Options of the GPU backend.
#[derive(Debug, Clone)]
pub struct CudaOptions {
    /// Bytes of GPU memory for the expert cache; `None`: everything free
    /// after the dense weights, state and scratch, less a reserve. Never
    /// more than all experts take.
    pub gpu_memory: Option<u64>,
    pub cache_policy: CachePolicy,
    /// Replay decode steps as CUDA graphs when every expert is resident.
    pub graphs: bool,
    /// Bytes of host RAM to pin as the expert host tier (whole layers of
    /// the mapped expert files); only used when the VRAM cache cannot hold
    /// every expert.
    pub host_cache: Option<u64>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            gpu_memory: None,
            cache_policy: CachePolicy::default(),
            graphs: true,
            host_cache: None,
        }
    }
}

/// Memory kept free for scratch and the KV caches' growth when the expert
/// cache takes "everything else".
const RESERVE: usize = 3 << 30;

/// Up to this many tokens, the routed experts run per (token, slot) with
/// the router's choice read on the device; longer batches group tokens by
/// expert (each expert's weights read once) from a host copy of the choice.
const SLOT_PATH_MAX_TOKENS: usize = 2;

/// Output rows per block of the quantized product kernels for rows of
/// `cols` codes of `bits` bits: 8 warps in groups of 4 rows; for one token
/// the warps of a group split the row (`col_split` in kernels.cu).
fn rows_per_block(cols: usize, bits: usize, one_token: bool) -> usize {
    let units = cols * bits / 128;
    let split = match units {
        _ if !one_token => 1,
        256.. => 8,
        128.. => 4,
        64.. => 2,
        _ => 1,
    };
    4 * 8 / split
}

/// Chunks of a warp in the activation-stationary one-token kernels
/// (`QMV_NC` in kernels.cu).
const QMV_CHUNKS: usize = 8;

/// Output rows per block of the activation-stationary one-token kernels
/// (`qmv_geom` in kernels.cu) for rows of `cols` codes of `bits` bits and
/// `chunks` chunks per warp, or `None` when the matrix does not fit their
/// layout: 2/4/8-bit codes, a 16-byte lane chunk inside one quantization
/// group, rows of a multiple of 512 bytes or a power of two of bytes below.
fn qmv_rows_per_block(cols: usize, bits: usize, gs: usize, chunks: usize) -> Option<usize> {
    if !matches!(bits, 2 | 4 | 8)
        || !gs.is_multiple_of(128 / bits)
        || !(cols * bits).is_multiple_of(8)
    {
        return None;
    }
    let rb = cols * bits / 8;
    if rb >= 512 {
        if !rb.is_multiple_of(512) {
            return None;
        }
        let parts = (rb / 512).min(8);
        let parts = 1 << parts.ilog2();
        Some(8 / parts * chunks)
    } else if rb >= 16 && rb.is_power_of_two() {
        Some(8 * chunks * (512 / rb))
    } else {
        None
    }
}

/// The activation-stationary one-token product kernel for `bits`.
fn qmv_kernel(bits: i32) -> &'static str {
    match bits {
        4 => "qmv_b4",
        8 => "qmv_b8",
        _ => "qmv_b2",
    }
}

/// Rows per block of [`qmv_kernel`] for `q`, when it fits (see
/// [`qmv_rows_per_block`]; the codes must also be 16-byte aligned).
fn qmv_fit(q: &Qw) -> Option<usize> {
    if !q.w.is_multiple_of(16) {
        return None;
    }
    qmv_rows_per_block(q.cols as usize, q.bits as usize, q.gs as usize, QMV_CHUNKS)
}

/// Products of one launch: the `qmv` code width (`None`: the general
/// kernels) and each matrix with its rows per block.
type LaunchGroup<'a> = (Option<i32>, Vec<(Qw, &'a Mm, usize)>);

/// A matrix product of a [`CudaModel::matmuls`] group: `out (+)= x W^T`.
#[derive(Clone, Copy)]
struct Mm {
    w: DevLinear,
    out: u64,
    accumulate: bool,
}

fn mm(w: DevLinear, out: u64) -> Mm {
    Mm {
        w,
        out,
        accumulate: false,
    }
}

/// `struct MultiMatmul` of the kernels.
#[repr(C)]
#[derive(Clone, Copy)]
struct MultiMatmul {
    q: [Qw; 4],
    out: [u64; 4],
    first_block: [i32; 5],
    count: i32,
    accumulate: i32,
}

/// A captured decode step and the buffer layout it was captured with.
struct DecodeGraph {
    graph: cudarc::driver::CudaGraph,
    epoch: u64,
}

pub struct CudaModel {
    gpu: Gpu,
    config: ModelConfig,
    opts: CudaOptions,
    _dense: DevBuf,
    layers: Vec<GpuLayer>,
    embed: Qw,
    lm_head: DevLinear,
    final_norm: DevBuf,
    inv_freq: DevBuf,
    state: Vec<GpuLayerState>,
    cache: Option<ExpertCache>,
    scratch: Scratch,
    arena: PinnedArena,
    logits_host: PinnedDownload,
    /// The position of the eval's first token, on the device (kernels read
    /// it so a captured graph serves every position).
    pos: DevBuf,
    /// Bumped whenever a buffer a graph may have captured moves.
    epoch: u64,
    /// The epoch of the last eager decode step that allocated nothing: a
    /// graph captured now would stay valid.
    stable_epoch: Option<u64>,
    graph: Option<DecodeGraph>,
    /// Layers and bytes of expert files pinned in host RAM.
    host_tier: (usize, u64),
}

fn unsupported(what: String) -> Error {
    Error::Gpu(format!("the GPU backend cannot run this model: {what}"))
}

impl CudaModel {
    /// Uploads `model`'s dense weights and sets up state and the expert
    /// cache; when every expert fits in the cache's budget, uploads them all
    /// now.
    pub fn new(
        gpu: Gpu,
        model: &QwenHybrid,
        store: &ExpertStore,
        opts: &CudaOptions,
    ) -> Result<CudaModel> {
        gpu.bind()?;
        let c = model.config.clone();
        for (what, v) in [
            ("head_dim", c.head_dim),
            ("linear key head dim", c.linear.key_head_dim),
            ("linear value head dim", c.linear.value_head_dim),
        ] {
            if v % 32 != 0 || v > 256 {
                return Err(unsupported(format!(
                    "{what} {v} (multiples of 32 up to 256)"
                )));
            }
        }
        if c.linear.conv_kernel > 9 {
            return Err(unsupported(format!("conv kernel {}", c.linear.conv_kernel)));
        }
        if c.moe.num_experts > 1024 || c.moe.num_experts_per_tok > 32 {
            return Err(unsupported(format!(
                "{} experts, {} per token (at most 1024 and 32)",
                c.moe.num_experts, c.moe.num_experts_per_tok
            )));
        }
        let dense = DevBuf::from_slice(&gpu, model.dense.file_bytes())?;
        let base = dense.ptr();
        let lin = |l: &LinearRef| dev_linear(base, l);
        let vec = |v: &[f32]| DevBuf::from_slice(&gpu, v);
        let mut layers = Vec::with_capacity(model.layers.len());
        let mut max_extent = 0usize;
        for l in &model.layers {
            let mixer = match &l.mixer {
                Mixer::Full(a) => GpuMixer::Full(GpuFullAttn {
                    q: lin(&a.q_proj),
                    k: lin(&a.k_proj),
                    v: lin(&a.v_proj),
                    o: lin(&a.o_proj),
                    q_norm: vec(&a.q_norm)?,
                    k_norm: vec(&a.k_norm)?,
                }),
                Mixer::Linear(g) => GpuMixer::Linear(GpuLinearAttn {
                    proj: match &g.proj {
                        DeltaProjections::Split { qkv, z, b, a } => GpuDeltaProj::Split {
                            qkv: lin(qkv),
                            z: lin(z),
                            b: lin(b),
                            a: lin(a),
                        },
                        DeltaProjections::Fused { qkvz, ba } => GpuDeltaProj::Fused {
                            qkvz: lin(qkvz),
                            ba: lin(ba),
                        },
                    },
                    conv: vec(&g.conv)?,
                    a_log: vec(&g.a_log)?,
                    dt_bias: vec(&g.dt_bias)?,
                    norm: vec(&g.norm)?,
                    out: lin(&g.out_proj),
                }),
            };
            let mlp = match &l.mlp {
                Mlp::Moe(m) => {
                    max_extent = max_extent.max(m.experts.extent);
                    GpuMlp::Moe {
                        router: lin(&m.router),
                        shared: m.shared.as_ref().map(|s| GpuShared {
                            gate: lin(&s.gate),
                            up: lin(&s.up),
                            down: lin(&s.down),
                            gate_scalar: lin(&s.gate_scalar),
                        }),
                        layout: expert_layout(m)?,
                    }
                }
                Mlp::Dense(m) => GpuMlp::Dense {
                    gate: lin(&m.gate),
                    up: lin(&m.up),
                    down: lin(&m.down),
                },
            };
            layers.push(GpuLayer {
                input_norm: vec(&l.input_norm)?,
                post_norm: vec(&l.post_norm)?,
                mixer,
                mlp,
            });
        }
        let embed = match lin(&model.embed) {
            DevLinear::Quant(q) => q,
            DevLinear::Dense { .. } => {
                return Err(unsupported("an unquantized embedding".into()));
            }
        };
        let inv_freq = DevBuf::from_slice(&gpu, &model.rope.inv_freq)?;
        let pos = DevBuf::zeros(&gpu, 8)?;
        let mut m = CudaModel {
            config: c,
            opts: opts.clone(),
            _dense: dense,
            layers,
            embed,
            lm_head: lin(&model.lm_head),
            final_norm: vec(&model.final_norm)?,
            inv_freq,
            state: Vec::new(),
            cache: None,
            scratch: Scratch::default(),
            arena: PinnedArena::new(),
            logits_host: PinnedDownload::default(),
            pos,
            epoch: 0,
            stable_epoch: None,
            graph: None,
            host_tier: (0, 0),
            gpu,
        };
        m.state = m.new_state()?;
        if max_extent > 0 {
            let e = m.config.moe.num_experts;
            let all = store.layers().count() * e * max_extent;
            let budget = match opts.gpu_memory {
                Some(b) => b as usize,
                None => m.gpu.free_bytes()?.saturating_sub(RESERVE),
            }
            .min(all);
            let mut cache = ExpertCache::new(&m.gpu, budget, max_extent, e, opts.cache_policy)?;
            if !cache.preload_all(&m.gpu, store, m.layers.len(), e)? {
                if let Some(host) = opts.host_cache {
                    m.host_tier = cache.pin_host_tier(&m.gpu, store, host)?;
                }
            }
            m.cache = Some(cache);
        }
        Ok(m)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.as_ref().map(|c| c.stats).unwrap_or_default()
    }

    /// Layers and bytes of expert files pinned in host RAM (`--host-cache`).
    pub fn host_tier(&self) -> (usize, u64) {
        self.host_tier
    }

    /// Expert slots in VRAM.
    pub fn cache_slots(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.slots())
    }

    fn new_state(&self) -> Result<Vec<GpuLayerState>> {
        let c = &self.config;
        let l = &c.linear;
        self.layers
            .iter()
            .map(|layer| {
                Ok(match layer.mixer {
                    GpuMixer::Full(_) => {
                        let row = c.num_kv_heads * c.head_dim;
                        GpuLayerState::Full(GpuKv {
                            k: DevBuf::zeros(&self.gpu, 0)?,
                            v: DevBuf::zeros(&self.gpu, 0)?,
                            cap: 0,
                            len: 0,
                            row,
                        })
                    }
                    GpuMixer::Linear(_) => GpuLayerState::Linear(GpuLinearState {
                        conv: DevBuf::zeros(&self.gpu, 4 * (l.conv_kernel - 1) * l.conv_dim())?,
                        ssm: DevBuf::zeros(
                            &self.gpu,
                            4 * l.num_v_heads * l.value_head_dim * l.key_head_dim,
                        )?,
                    }),
                })
            })
            .collect()
    }

    /// Forgets the sequence: empty KV caches, zero recurrent states (in
    /// place: buffers keep their addresses and capacity).
    pub fn clear(&mut self) -> Result<()> {
        self.gpu.bind()?;
        for s in &mut self.state {
            match s {
                GpuLayerState::Full(kv) => kv.len = 0,
                GpuLayerState::Linear(ls) => {
                    zero_async(&self.gpu.stream, ls.conv.ptr(), ls.conv.bytes())?;
                    zero_async(&self.gpu.stream, ls.ssm.ptr(), ls.ssm.bytes())?;
                }
            }
        }
        self.gpu.sync()
    }

    /// A host copy of the sequence state (same layout as the CPU backend's).
    pub fn download_state(&self) -> Result<ModelState> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        let layers = self
            .state
            .iter()
            .map(|s| {
                Ok(match s {
                    GpuLayerState::Full(kv) => {
                        let mut k = vec![0.0f32; kv.len * kv.row];
                        let mut v = vec![0.0f32; kv.len * kv.row];
                        kv.k.download(&mut k)?;
                        kv.v.download(&mut v)?;
                        LayerState::Full(KvCache { k, v, row: kv.row })
                    }
                    GpuLayerState::Linear(ls) => LayerState::Linear(download_linear(ls)?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelState { layers })
    }

    /// The linear-attention states only (checkpoints).
    pub fn linear_states(&self) -> Result<Vec<LinearState>> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        self.state
            .iter()
            .filter_map(|s| match s {
                GpuLayerState::Linear(ls) => Some(download_linear(ls)),
                GpuLayerState::Full(_) => None,
            })
            .collect()
    }

    /// Replaces the state with a host copy (from `download_state` or a
    /// snapshot of either backend).
    pub fn upload_state(&mut self, s: &ModelState) -> Result<()> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        if s.layers.len() != self.state.len() {
            return Err(Error::Invalid(
                "state does not match the model's layers".into(),
            ));
        }
        for (dst, src) in self.state.iter_mut().zip(&s.layers) {
            match (dst, src) {
                (GpuLayerState::Full(kv), LayerState::Full(h)) => {
                    let rows = h.len();
                    if kv.reserve(&self.gpu, rows)? {
                        self.epoch += 1;
                    }
                    kv.k.upload(&h.k)?;
                    kv.v.upload(&h.v)?;
                    kv.len = rows;
                }
                (GpuLayerState::Linear(ls), LayerState::Linear(h)) => {
                    ls.conv.upload(&h.conv)?;
                    ls.ssm.upload(&h.ssm)?;
                }
                _ => {
                    return Err(Error::Invalid(
                        "state does not match the model's layers".into(),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Keeps the first `pos` KV rows and puts `linear` (one per linear
    /// layer, in order) into the linear layers.
    pub fn rewind(&mut self, pos: usize, linear: &[LinearState]) -> Result<()> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        let mut lin = linear.iter();
        for s in &mut self.state {
            match s {
                GpuLayerState::Full(kv) => kv.len = kv.len.min(pos),
                GpuLayerState::Linear(ls) => {
                    if let Some(h) = lin.next() {
                        ls.conv.upload(&h.conv)?;
                        ls.ssm.upload(&h.ssm)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Evaluates `tokens` at positions `start..` and returns logits like the
    /// CPU model.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        store: &ExpertStore,
        k: usize,
        tokens: &[u32],
        start: usize,
        mode: LogitsMode,
        times: &mut PhaseTimes,
    ) -> Result<Vec<f32>> {
        self.gpu.bind()?;
        let mut clock = std::time::Instant::now();
        let n = tokens.len();
        // The KV caches take the new rows (room made now, before any graph
        // replay that writes them).
        for s in &mut self.state {
            if let GpuLayerState::Full(kv) = s {
                if kv.len != start {
                    return Err(Error::Invalid(format!(
                        "GPU KV cache holds {} rows, eval starts at {start}",
                        kv.len
                    )));
                }
                if kv.reserve(&self.gpu, start + n)? {
                    self.epoch += 1;
                }
                kv.len = start + n;
            }
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let d_ids = self.scratch.get(&self.gpu, "ids", 4 * n)?;
        self.arena.reset();
        self.arena.upload(&self.gpu, d_ids, &ids)?;
        self.arena
            .upload(&self.gpu, self.pos.ptr(), &[start as i64])?;
        let resident = self.cache.as_ref().is_none_or(|c| c.all_resident());
        let graphable = self.opts.graphs && n == 1 && resident;
        let rows = match mode {
            LogitsMode::All => 0..n,
            LogitsMode::Last => n - 1..n,
        };
        let m = rows.len();
        if graphable && !self.graph_valid() && self.stable_epoch == Some(self.epoch) {
            begin_capture(&self.gpu)?;
            let recorded =
                self.layers_forward(store, k, n, rows.clone(), &mut PhaseTimes::default());
            let graph = end_capture(&self.gpu, recorded)?;
            if self.scratch.grew {
                // Allocated during capture: the layout moved, the graph is
                // stale; run eagerly.
                self.scratch.grew = false;
                self.epoch += 1;
            } else {
                self.graph = Some(DecodeGraph {
                    graph,
                    epoch: self.epoch,
                });
            }
        }
        if graphable && self.graph_valid() {
            let g = self.graph.as_ref().expect("checked above");
            g.graph
                .launch()
                .map_err(|e| Error::Gpu(format!("CUDA graph launch: {e}")))?;
            let uses = (k * self.moe_layers()) as u64;
            if let Some(c) = self.cache.as_mut() {
                c.count_hits(uses);
            }
            self.gpu.sync()?;
            lap(&mut clock, &mut times.gpu_graph);
        } else {
            self.scratch.grew = false;
            let before = self.epoch;
            self.layers_forward(store, k, n, rows, times)?;
            if self.scratch.grew {
                self.scratch.grew = false;
                self.epoch += 1;
            }
            if graphable && self.epoch == before {
                self.stable_epoch = Some(self.epoch);
            }
            clock = std::time::Instant::now();
        }
        self.download_logits(m, clock, times)
    }

    /// Whether the captured decode graph matches the current buffers.
    fn graph_valid(&self) -> bool {
        self.graph.as_ref().is_some_and(|g| g.epoch == self.epoch)
    }

    fn download_logits(
        &mut self,
        m: usize,
        mut clock: std::time::Instant,
        times: &mut PhaseTimes,
    ) -> Result<Vec<f32>> {
        let v = self.config.vocab_size;
        let logits = self.scratch.get(&self.gpu, "logits", 4 * m * v)?;
        let out = self.logits_host.download_f32(&self.gpu, logits, m * v)?;
        lap(&mut clock, &mut times.lm_head);
        Ok(out)
    }

    fn moe_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|l| matches!(l.mlp, GpuMlp::Moe { .. }))
            .count()
    }

    /// Every layer, the final norm and the LM head for `n` tokens whose ids
    /// and first position are on the device; logits of `rows` land in the
    /// "logits" scratch buffer.
    fn layers_forward(
        &mut self,
        store: &ExpertStore,
        k: usize,
        n: usize,
        rows: std::ops::Range<usize>,
        times: &mut PhaseTimes,
    ) -> Result<()> {
        let mut clock = std::time::Instant::now();
        let h = self.config.hidden_size;
        let g = &self.gpu;
        let s = &mut self.scratch;
        let d_ids = s.get(g, "ids", 4 * n)?;
        let x = s.get(g, "x", 4 * n * h)?;
        let xn = s.get(g, "xn", 4 * n * h)?;
        let embed = self.embed;
        // SAFETY (every launch below): arguments match the kernels in
        // kernels.cu and device buffers are sized for n tokens.
        unsafe {
            g.launch(
                "qgather_rows",
                (n as u32, 1, 1),
                256,
                0,
                &mut args!(embed, d_ids, x),
            )?
        };
        lap(&mut clock, &mut times.embed_norm);
        for i in 0..self.layers.len() {
            self.rms_norm(x, self.layers[i].input_norm.ptr(), n, h, xn)?;
            self.mixer(i, xn, n, x)?;
            self.rms_norm(x, self.layers[i].post_norm.ptr(), n, h, xn)?;
            lap(&mut clock, &mut times.attention);
            self.mlp(i, store, k, xn, n, x, times)?;
            clock = std::time::Instant::now();
        }
        let m = rows.len();
        let normed = self.scratch.get(&self.gpu, "normed", 4 * m * h)?;
        self.rms_norm(
            x + (4 * rows.start * h) as u64,
            self.final_norm.ptr(),
            m,
            h,
            normed,
        )?;
        let v = self.config.vocab_size;
        let logits = self.scratch.get(&self.gpu, "logits", 4 * m * v)?;
        self.matmuls(&[mm(self.lm_head, logits)], normed, m)?;
        lap(&mut clock, &mut times.lm_head);
        Ok(())
    }

    fn rms_norm(&self, x: u64, w: u64, rows: usize, width: usize, out: u64) -> Result<()> {
        let (wd, eps) = (width as i32, self.config.rms_norm_eps);
        unsafe {
            self.gpu.launch(
                "rms_norm",
                (rows as u32, 1, 1),
                1024,
                0,
                &mut args!(x, w, wd, eps, out),
            )
        }
    }

    fn swiglu(&self, gate: u64, up: u64, out: u64, n: usize) -> Result<()> {
        let nn = n as i64;
        let blocks = n.div_ceil(256).min(4096) as u32;
        unsafe {
            self.gpu.launch(
                "swiglu",
                (blocks, 1, 1),
                256,
                0,
                &mut args!(gate, up, out, nn),
            )
        }
    }

    /// Several products of the same input `x[n, cols]`: quantized ones four
    /// to a launch, dense ones one each.
    fn matmuls(&self, ops: &[Mm], x: u64, n: usize) -> Result<()> {
        let nn = n as i32;
        let ty = n.div_ceil(4).min(64) as u32;
        // One token: matrices that fit the activation-stationary kernels go
        // to them, grouped by code width; the rest to the general kernels.
        let mut groups: Vec<LaunchGroup> = Vec::new();
        for o in ops {
            let DevLinear::Quant(q) = o.w else { continue };
            let fit = if n == 1 { qmv_fit(&q) } else { None };
            let (key, rpb) = match fit {
                Some(rpb) => (Some(q.bits), rpb),
                None => (
                    None,
                    rows_per_block(q.cols as usize, q.bits as usize, n == 1),
                ),
            };
            match groups.iter_mut().find(|g| g.0 == key && g.1.len() < 4) {
                Some(g) => g.1.push((q, o, rpb)),
                None => groups.push((key, vec![(q, o, rpb)])),
            }
        }
        for (key, group) in &groups {
            let mut p = MultiMatmul {
                q: [group[0].0; 4],
                out: [0; 4],
                first_block: [0; 5],
                count: group.len() as i32,
                accumulate: 0,
            };
            let mut blocks = 0i32;
            for (j, (q, o, rpb)) in group.iter().enumerate() {
                p.q[j] = *q;
                p.out[j] = o.out;
                p.first_block[j] = blocks;
                p.accumulate |= (o.accumulate as i32) << j;
                blocks += (q.rows as usize).div_ceil(*rpb) as i32;
            }
            for j in group.len()..5 {
                p.first_block[j] = blocks;
            }
            unsafe {
                match key {
                    Some(bits) => self.gpu.launch(
                        qmv_kernel(*bits),
                        (blocks as u32, 1, 1),
                        256,
                        0,
                        &mut args!(p, x),
                    )?,
                    None => {
                        let kernel = if n == 1 { "qmatmul1" } else { "qmatmul" };
                        self.gpu.launch(
                            kernel,
                            (blocks as u32, ty, 1),
                            256,
                            0,
                            &mut args!(p, x, nn),
                        )?
                    }
                }
            };
        }
        for o in ops {
            if let DevLinear::Dense { w, f32, rows, cols } = o.w {
                let (acc, out) = (o.accumulate as i32, o.out);
                let blocks = (rows as usize).div_ceil(8) as u32;
                unsafe {
                    self.gpu.launch(
                        "dmatmul",
                        (blocks, n.min(64) as u32, 1),
                        256,
                        0,
                        &mut args!(w, f32, rows, cols, x, nn, acc, out),
                    )?
                };
            }
        }
        Ok(())
    }

    /// The token mixer of layer `i`, its output added to `x`.
    fn mixer(&mut self, i: usize, xn: u64, n: usize, x: u64) -> Result<()> {
        match &self.layers[i].mixer {
            GpuMixer::Full(_) => self.full_attention(i, xn, n, x),
            GpuMixer::Linear(_) => self.linear_attention(i, xn, n, x),
        }
    }

    fn full_attention(&mut self, i: usize, xn: u64, n: usize, x: u64) -> Result<()> {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let GpuMixer::Full(a) = &self.layers[i].mixer else {
            unreachable!("called for full attention layers")
        };
        let (wq, wk, wv, wo) = (a.q, a.k, a.v, a.o);
        let (qn, kn) = (a.q_norm.ptr(), a.k_norm.ptr());
        let g = &self.gpu;
        let s = &mut self.scratch;
        let qg = s.get(g, "qg", 4 * n * 2 * nh * hd)?;
        let k = s.get(g, "k", 4 * n * nkv * hd)?;
        let v = s.get(g, "v", 4 * n * nkv * hd)?;
        let q = s.get(g, "q", 4 * n * nh * hd)?;
        let gate = s.get(g, "gate", 4 * n * nh * hd)?;
        let attn = s.get(g, "attn", 4 * n * nh * hd)?;
        self.matmuls(&[mm(wq, qg), mm(wk, k), mm(wv, v)], xn, n)?;
        let half = (c.rope.rotary_dim / 2) as i32;
        let (nh_i, nkv_i, hd_i) = (nh as i32, nkv as i32, hd as i32);
        let (eps, ps) = (c.rms_norm_eps, c.rope.position_scale);
        let (inv_freq, pos) = (self.inv_freq.ptr(), self.pos.ptr());
        let GpuLayerState::Full(kv) = &self.state[i] else {
            unreachable!("state built from the same layer list")
        };
        let (kc, vc, row) = (kv.k.ptr(), kv.v.ptr(), kv.row as i32);
        let scale = 1.0 / (hd as f32).sqrt();
        let nn = n as i32;
        let append_blocks = (n * kv.row).div_ceil(256).min(1024) as u32;
        unsafe {
            self.gpu.launch(
                "attn_prep",
                ((nh + nkv) as u32, n as u32, 1),
                hd as u32,
                (4 * hd) as u32,
                &mut args!(qg, k, qn, kn, inv_freq, half, nh_i, nkv_i, hd_i, eps, pos, ps, q, gate),
            )?;
            self.gpu.launch(
                "kv_append",
                (append_blocks, 1, 1),
                256,
                0,
                &mut args!(k, v, kc, vc, row, pos, nn),
            )?;
            self.gpu.launch(
                "attention",
                (nh as u32, n as u32, 1),
                256,
                0,
                &mut args!(q, kc, vc, gate, nh_i, nkv_i, hd_i, pos, scale, attn),
            )?
        };
        self.matmuls(
            &[Mm {
                w: wo,
                out: x,
                accumulate: true,
            }],
            attn,
            n,
        )
    }

    fn linear_attention(&mut self, i: usize, xn: u64, n: usize, x: u64) -> Result<()> {
        let c = self.config.clone();
        let l = &c.linear;
        let (nk, nv, dk, dv) = (
            l.num_k_heads,
            l.num_v_heads,
            l.key_head_dim,
            l.value_head_dim,
        );
        let (kd, vd, cd) = (l.key_dim(), l.value_dim(), l.conv_dim());
        let g = &self.gpu;
        let s = &mut self.scratch;
        let mixed = s.get(g, "mixed", 4 * n * cd)?;
        let z = s.get(g, "z", 4 * n * vd)?;
        let b = s.get(g, "b", 4 * n * nv)?;
        let a = s.get(g, "a", 4 * n * nv)?;
        let y = s.get(g, "y", 4 * n * vd)?;
        let o = s.get(g, "o", 4 * n * vd)?;
        let GpuMixer::Linear(la) = &self.layers[i].mixer else {
            unreachable!("called for linear attention layers")
        };
        match la.proj {
            GpuDeltaProj::Split {
                qkv,
                z: zw,
                b: bw,
                a: aw,
            } => {
                self.matmuls(&[mm(qkv, mixed), mm(zw, z), mm(bw, b), mm(aw, a)], xn, n)?;
            }
            GpuDeltaProj::Fused { qkvz, ba } => {
                let s = &mut self.scratch;
                let fused = s.get(&self.gpu, "fused", 4 * n * (2 * kd + 2 * vd))?;
                let fba = s.get(&self.gpu, "fba", 4 * n * 2 * nv)?;
                self.matmuls(&[mm(qkvz, fused), mm(ba, fba)], xn, n)?;
                let r = (nv / nk) as i32;
                let (nk_i, dk_i, dv_i) = (nk as i32, dk as i32, dv as i32);
                unsafe {
                    self.gpu.launch(
                        "deltanet_split",
                        (nk as u32, n as u32, 1),
                        128,
                        0,
                        &mut args!(fused, fba, nk_i, dk_i, dv_i, r, mixed, z, b, a),
                    )?
                };
            }
        }
        let GpuMixer::Linear(la) = &self.layers[i].mixer else {
            unreachable!("called for linear attention layers")
        };
        let GpuLayerState::Linear(st) = &self.state[i] else {
            unreachable!("state built from the same layer list")
        };
        let (conv_state, ssm) = (st.conv.ptr(), st.ssm.ptr());
        let (conv_w, a_log, dt_bias, norm) = (
            la.conv.ptr(),
            la.a_log.ptr(),
            la.dt_bias.ptr(),
            la.norm.ptr(),
        );
        let out_w = la.out;
        let (cd_i, kk, nn) = (cd as i32, l.conv_kernel as i32, n as i32);
        let (nk_i, nv_i, dk_i, dv_i) = (nk as i32, nv as i32, dk as i32, dv as i32);
        unsafe {
            self.gpu.launch(
                "conv_silu",
                (cd.div_ceil(256) as u32, 1, 1),
                256,
                0,
                &mut args!(mixed, conv_w, conv_state, cd_i, kk, nn),
            )?;
            self.gpu.launch(
                "deltanet_qk_norm",
                ((2 * nk) as u32, n as u32, 1),
                dk as u32,
                0,
                &mut args!(mixed, nk_i, dk_i, cd_i),
            )?;
            self.gpu.launch(
                "delta_rule",
                (nv as u32, dv.div_ceil(32) as u32, 1),
                256,
                0,
                &mut args!(mixed, a, b, a_log, dt_bias, ssm, nn, nk_i, nv_i, dk_i, dv_i, y),
            )?;
            let eps = c.rms_norm_eps;
            self.gpu.launch(
                "gated_norm",
                (nv as u32, n as u32, 1),
                dv as u32,
                0,
                &mut args!(y, z, norm, eps, dv_i, o),
            )?;
        }
        self.matmuls(
            &[Mm {
                w: out_w,
                out: x,
                accumulate: true,
            }],
            o,
            n,
        )
    }

    /// The MLP of layer `i` (dense or mixture of experts), its output added
    /// to `x`.
    #[allow(clippy::too_many_arguments)]
    fn mlp(
        &mut self,
        i: usize,
        store: &ExpertStore,
        k: usize,
        xn: u64,
        n: usize,
        x: u64,
        times: &mut PhaseTimes,
    ) -> Result<()> {
        match &self.layers[i].mlp {
            GpuMlp::Dense { gate, up, down } => {
                let (gw, uw, dw) = (*gate, *up, *down);
                let inter = gw.rows();
                let s = &mut self.scratch;
                let gb = s.get(&self.gpu, "g", 4 * n * inter)?;
                let ub = s.get(&self.gpu, "u", 4 * n * inter)?;
                let act = s.get(&self.gpu, "act", 4 * n * inter)?;
                self.matmuls(&[mm(gw, gb), mm(uw, ub)], xn, n)?;
                self.swiglu(gb, ub, act, n * inter)?;
                self.matmuls(
                    &[Mm {
                        w: dw,
                        out: x,
                        accumulate: true,
                    }],
                    act,
                    n,
                )
            }
            GpuMlp::Moe { .. } => self.moe(i, store, k, xn, n, x, times),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        i: usize,
        store: &ExpertStore,
        k: usize,
        xn: u64,
        n: usize,
        x: u64,
        times: &mut PhaseTimes,
    ) -> Result<()> {
        let mut clock = std::time::Instant::now();
        let GpuMlp::Moe {
            router,
            shared,
            layout,
        } = &self.layers[i].mlp
        else {
            unreachable!("called for MoE layers")
        };
        let (router, layout) = (*router, *layout);
        let shared = shared
            .as_ref()
            .map(|s| (s.gate, s.up, s.down, s.gate_scalar));
        let (e, h) = (self.config.moe.num_experts, self.config.hidden_size);
        let (inter, bits) = (layout.inter as usize, layout.bits as usize);
        let g = &self.gpu;
        let s = &mut self.scratch;
        let logits_d = s.get(g, "router", 4 * n * e)?;
        let d_ids = s.get(g, "route_ids", 4 * n * k)?;
        let d_wts = s.get(g, "wts", 4 * n * k)?;
        let d_bases = s.get(g, "bases", 8 * n * k)?;
        let act = s.get(g, "eact", 4 * n * k * inter)?;
        let slot_out = s.get(g, "slot_out", 4 * n * k * h)?;

        // Router and shared expert: one launch for the products of xn.
        let (sy, sg) = match shared {
            Some((gate, up, down, gate_scalar)) => {
                let si = gate.rows();
                let s = &mut self.scratch;
                let gb = s.get(&self.gpu, "sg_g", 4 * n * si)?;
                let ub = s.get(&self.gpu, "sg_u", 4 * n * si)?;
                let sact = s.get(&self.gpu, "sg_act", 4 * n * si)?;
                let sy = s.get(&self.gpu, "sg_y", 4 * n * h)?;
                let sg = s.get(&self.gpu, "sg_s", 4 * n)?;
                self.matmuls(
                    &[
                        mm(router, logits_d),
                        mm(gate, gb),
                        mm(up, ub),
                        mm(gate_scalar, sg),
                    ],
                    xn,
                    n,
                )?;
                self.swiglu(gb, ub, sact, n * si)?;
                self.matmuls(&[mm(down, sy)], sact, n)?;
                (sy, sg)
            }
            None => {
                self.matmuls(&[mm(router, logits_d)], xn, n)?;
                (0u64, 0u64)
            }
        };
        lap(&mut clock, &mut times.shared_mlp);

        let table = self.cache.as_ref().and_then(|c| c.table_row(i));
        let slot_path = n <= SLOT_PATH_MAX_TOKENS;
        let route_table = if slot_path { table.unwrap_or(0) } else { 0 };
        let (nn, e_i, k_i) = (n as i32, e as i32, k as i32);
        let norm = self.config.moe.norm_topk_prob as i32;
        unsafe {
            self.gpu.launch(
                "moe_route",
                (n.div_ceil(4) as u32, 1, 1),
                128,
                0,
                &mut args!(
                    logits_d,
                    nn,
                    e_i,
                    k_i,
                    norm,
                    route_table,
                    d_ids,
                    d_wts,
                    d_bases
                ),
            )?
        };
        let sfx = kernel_suffix(layout.bits);
        // Per-slot kernels take one token: rows split across warps, or the
        // activation-stationary kernels when the layout fits them.
        let qmv = slot_path.then(|| qmv_slot_grids(&layout)).flatten();
        let (gate_up_blocks, down_blocks) = match qmv {
            Some(grids) => grids,
            None => (
                inter.div_ceil(rows_per_block(h, bits, slot_path)) as u32,
                h.div_ceil(rows_per_block(inter, bits, slot_path)) as u32,
            ),
        };
        let cache = self
            .cache
            .as_mut()
            .expect("MoE layers have an expert cache");
        if slot_path && table.is_some() {
            // Every expert resident: the router's choice never leaves the GPU.
            cache.count_hits((n * k) as u64);
        } else {
            // The host needs the choice to bring missing experts in.
            let mut ids = vec![0i32; n * k];
            self.gpu.sync()?;
            download_from(&self.gpu, d_ids, &mut ids)?;
            self.arena.reset();
            lap(&mut clock, &mut times.routing);
            let mut users: std::collections::BTreeMap<usize, Vec<i32>> = Default::default();
            for (j, &id) in ids.iter().enumerate() {
                users.entry(id as usize).or_default().push(j as i32);
            }
            let unique: Vec<usize> = users.keys().copied().collect();
            let ptrs = cache.ensure(&self.gpu, store, i, &unique)?;
            lap(&mut clock, &mut times.expert_io);
            if slot_path {
                let mut bases = vec![0u64; n * k];
                for (p, slots) in ptrs.iter().zip(users.values()) {
                    for &j in slots {
                        bases[j as usize] = *p;
                    }
                }
                self.arena.upload(&self.gpu, d_bases, &bases)?;
            } else {
                let mut slot_list: Vec<i32> = Vec::with_capacity(n * k);
                let mut tasks = Vec::with_capacity(unique.len());
                for (p, slots) in ptrs.iter().zip(users.values()) {
                    tasks.push(ExpertTask {
                        base: *p,
                        first: slot_list.len() as i32,
                        count: slots.len() as i32,
                    });
                    slot_list.extend(slots);
                }
                let s = &mut self.scratch;
                let d_tasks = s.get(&self.gpu, "tasks", std::mem::size_of_val(tasks.as_slice()))?;
                let d_slots = s.get(&self.gpu, "slots", 4 * slot_list.len())?;
                self.arena.upload(&self.gpu, d_tasks, &tasks)?;
                self.arena.upload(&self.gpu, d_slots, &slot_list)?;
                let n_tasks = tasks.len() as u32;
                unsafe {
                    self.gpu.launch(
                        &format!("moe_gate_up_{sfx}"),
                        (gate_up_blocks, n_tasks, 1),
                        256,
                        0,
                        &mut args!(d_tasks, layout, d_slots, k_i, xn, act),
                    )?;
                    self.gpu.launch(
                        &format!("moe_down_{sfx}"),
                        (down_blocks, n_tasks, 1),
                        256,
                        0,
                        &mut args!(d_tasks, layout, d_slots, act, slot_out),
                    )?;
                }
            }
        }
        if slot_path {
            let slots = (n * k) as u32;
            let (gate_up, down) = match qmv {
                Some(_) => qmv_slot_kernels(layout.bits),
                None => (
                    format!("moe_gate_up_slots_{sfx}"),
                    format!("moe_down_slots_{sfx}"),
                ),
            };
            unsafe {
                self.gpu.launch(
                    &gate_up,
                    (gate_up_blocks, slots, 1),
                    256,
                    0,
                    &mut args!(d_bases, layout, k_i, xn, act),
                )?;
                self.gpu.launch(
                    &down,
                    (down_blocks, slots, 1),
                    256,
                    0,
                    &mut args!(d_bases, layout, act, slot_out),
                )?;
            }
        }
        let h_i = h as i32;
        unsafe {
            self.gpu.launch(
                "moe_combine",
                (n as u32, h.div_ceil(256) as u32, 1),
                256,
                0,
                &mut args!(slot_out, d_wts, k_i, h_i, sy, sg, x),
            )?;
        }
        lap(&mut clock, &mut times.expert_compute);
        Ok(())
    }
}

impl GpuKv {
    /// Room for at least `rows` rows, keeping the existing ones; returns
    /// whether the buffers moved.
    fn reserve(&mut self, gpu: &Gpu, rows: usize) -> Result<bool> {
        if rows <= self.cap {
            return Ok(false);
        }
        let cap = rows.next_power_of_two().max(256);
        let bytes = 4 * cap * self.row;
        let (k, v) = (DevBuf::zeros(gpu, bytes)?, DevBuf::zeros(gpu, bytes)?);
        let used = 4 * self.len * self.row;
        copy_dtod(&gpu.stream, k.ptr(), self.k.ptr(), used)?;
        copy_dtod(&gpu.stream, v.ptr(), self.v.ptr(), used)?;
        gpu.sync()?;
        self.k = k;
        self.v = v;
        self.cap = cap;
        Ok(true)
    }
}

fn download_linear(ls: &GpuLinearState) -> Result<LinearState> {
    let mut conv = vec![0.0f32; ls.conv.bytes() / 4];
    let mut ssm = vec![0.0f32; ls.ssm.bytes() / 4];
    ls.conv.download(&mut conv)?;
    ls.ssm.download(&mut ssm)?;
    Ok(LinearState { conv, ssm })
}

fn download_from<T: Copy>(_gpu: &Gpu, src: u64, out: &mut [T]) -> Result<()> {
    // SAFETY: `src` is a device buffer holding at least `out`'s bytes.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(out, src) }
        .map_err(|e| Error::Gpu(format!("copy from GPU: {e}")))
}

fn dev_linear(base: u64, l: &LinearRef) -> DevLinear {
    let at = |loc: &crate::model::weights::TensorLoc| base + loc.offset as u64;
    match l.quant {
        Some((spec, s, b)) => DevLinear::Quant(Qw {
            w: at(&l.weight),
            s: at(&s),
            b: at(&b),
            rows: l.rows as i32,
            cols: l.cols as i32,
            bits: spec.bits as i32,
            gs: spec.group_size as i32,
            sf32: (s.dtype == DType::F32) as i32,
        }),
        None => DevLinear::Dense {
            w: at(&l.weight),
            f32: (l.weight.dtype == DType::F32) as i32,
            rows: l.rows as i32,
            cols: l.cols as i32,
        },
    }
}

/// Blocks of the activation-stationary per-slot kernels (gate/up, down)
/// when the experts' layout fits them (every piece 16-byte aligned; the
/// cache's slots are).
fn qmv_slot_grids(l: &ExpertLayoutC) -> Option<(u32, u32)> {
    let offsets = [l.gate_w, l.up_w, l.down_w];
    if offsets.iter().any(|o| o % 16 != 0) {
        return None;
    }
    let (h, inter) = (l.hidden as usize, l.inter as usize);
    let (bits, gs) = (l.bits as usize, l.gs as usize);
    let gate_up = qmv_rows_per_block(h, bits, gs, QMV_CHUNKS / 2)?;
    let down = qmv_rows_per_block(inter, bits, gs, QMV_CHUNKS)?;
    Some((inter.div_ceil(gate_up) as u32, h.div_ceil(down) as u32))
}

fn qmv_slot_kernels(bits: i32) -> (String, String) {
    let b = match bits {
        4 => "b4",
        8 => "b8",
        _ => "b2",
    };
    (format!("moe_gate_up_qmv_{b}"), format!("moe_down_qmv_{b}"))
}

fn expert_layout(m: &MoeBlock) -> Result<ExpertLayoutC> {
    let x = &m.experts;
    let same =
        |a: &ComponentLayout, b: &ComponentLayout| a.spec == b.spec && a.scales_f32 == b.scales_f32;
    if !same(&x.gate, &x.up) || !same(&x.gate, &x.down) {
        return Err(unsupported(format!(
            "layer {}: routed expert projections quantized differently",
            m.layer
        )));
    }
    Ok(ExpertLayoutC {
        gate_w: x.gate.weight as i64,
        gate_s: x.gate.scales as i64,
        gate_b: x.gate.biases as i64,
        up_w: x.up.weight as i64,
        up_s: x.up.scales as i64,
        up_b: x.up.biases as i64,
        down_w: x.down.weight as i64,
        down_s: x.down.scales as i64,
        down_b: x.down.biases as i64,
        inter: x.gate.rows as i32,
        hidden: x.gate.cols as i32,
        bits: x.gate.spec.bits as i32,
        gs: x.gate.spec.group_size as i32,
        sf32: x.gate.scales_f32 as i32,
    })
}

/// Architectures the GPU backend runs.
pub fn supports(arch: Architecture) -> bool {
    matches!(arch, Architecture::Qwen3_5Moe | Architecture::Qwen3Next)
}

#[cfg(test)]
mod tests {
    use super::qmv_rows_per_block;

    #[test]
    fn qmv_geometry_matches_the_kernel_layout() {
        // Long rows: 512-byte slices shared by up to 8 warps of a block.
        assert_eq!(qmv_rows_per_block(2048, 4, 64, 8), Some(32)); // 2 slices
        assert_eq!(qmv_rows_per_block(4096, 4, 64, 8), Some(16)); // 4 slices
        assert_eq!(qmv_rows_per_block(8192, 8, 64, 8), Some(8)); // 16 slices
        assert_eq!(qmv_rows_per_block(3072, 4, 64, 8), Some(32)); // 3 slices: 2 warps
        assert_eq!(qmv_rows_per_block(1024, 4, 64, 8), Some(64)); // one slice
                                                                  // Short rows: 512 / row bytes rows per chunk.
        assert_eq!(qmv_rows_per_block(512, 4, 64, 8), Some(128));
        assert_eq!(qmv_rows_per_block(64, 4, 64, 4), Some(32 * 16));
        // Not the layout: odd row bytes, a chunk across groups, other widths.
        assert_eq!(qmv_rows_per_block(2560, 4, 64, 8), None); // 1280 bytes
        assert_eq!(qmv_rows_per_block(768, 4, 64, 8), None); // 384 bytes
        assert_eq!(qmv_rows_per_block(2048, 2, 32, 8), None); // 64 codes > gs
        assert_eq!(qmv_rows_per_block(2048, 3, 64, 8), None);
        assert_eq!(qmv_rows_per_block(16, 4, 16, 8), None); // 8-byte rows
    }
}
