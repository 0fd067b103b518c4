//! A model on the GPU: the whole dense part and the sequence state in VRAM,
//! routed experts in the VRAM expert cache. [`CudaModel`] holds what the
//! device keeps — the dense file uploaded once as one buffer (every matrix
//! an offset into it), the model's vector arena as another, the rotary
//! table, the state, the expert cache, scratch — and runs the one layer
//! stack (`model::forward`) through its [`BlockExecutor`], with CUDA-graph
//! replay of decode steps when every expert is resident. The blocks' kernels
//! are in `attention.rs`, `deltanet.rs`, `mla.rs` and `moe.rs`.
//!
//! Routers run on the device with the CPU's rules (ties to the lower index),
//! so both backends pick the same experts.

use std::ops::Range;
use std::sync::Arc;

use crate::backend::cpu::qmatmul::Activations;
use crate::backend::prefetch::Prefetch;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::io::ExpertStore;
use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::forward::{self, Activation, BlockExecutor, Segment, SegmentOutput};
use crate::model::layer::Mixer;
use crate::model::mla::MlaAttention;
use crate::model::moe::{DenseMlp, MoeBlock};
use crate::model::state::{ModelState, RewindState};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::trace::Trace;
use crate::model::weights::{LinearRef, VectorRef};
use crate::model::{LogitsMode, Model};

use super::abi::Qw;
use super::device::{args, begin_capture, end_capture, DevBuf, Gpu, PinnedArena, PinnedDownload};
use super::experts::{CachePolicy, CacheStats, ExpertCache, HostTier, HostTierInfo};
use super::gds::{self, Gds, GdsFiles, GdsReader};
use super::linear::{dev_linear, matmuls, mm, rms_norm, DevLinear};
use super::mla::MlaParams;
use super::nccl::Comm;
use super::shard::Shard;
use super::state::{GpuLayerState, GpuState};
use super::token_split::{row, RowSplit};
use super::{attention, deltanet, mla, moe, support};

/// Where a model's weights are on the device: the dense file (matrices by
/// [`LinearRef`]) and the vector arena (by [`VectorRef`]).
#[derive(Clone, Copy, Debug)]
pub(super) struct DevWeights {
    /// The device address file offset 0 maps to.
    base: u64,
    /// The arena's first float.
    floats: u64,
}

impl DevWeights {
    pub fn lin(&self, l: &LinearRef) -> DevLinear {
        dev_linear(self.base, l)
    }

    pub fn vec(&self, v: VectorRef) -> u64 {
        self.floats + 4 * v.offset as u64
    }
}

/// Scratch buffers, grown on demand and reused across evals. Growth moves a
/// buffer, which invalidates a captured CUDA graph (`grew` tells).
#[derive(Default)]
pub(super) struct Scratch {
    bufs: std::collections::HashMap<&'static str, DevBuf>,
    grew: bool,
}

impl Scratch {
    /// Device address of scratch buffer `name` holding at least `bytes`.
    pub fn get(&mut self, gpu: &Gpu, name: &'static str, bytes: usize) -> Result<u64> {
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

/// What a block's kernels use besides its own weights.
pub(super) struct Ctx<'a> {
    pub gpu: &'a Gpu,
    pub config: &'a ModelConfig,
    pub weights: DevWeights,
    /// The shape and scales of the MLA layers (the DeepSeek-V3 family).
    pub mla: Option<MlaParams>,
    pub scratch: &'a mut Scratch,
    /// The state of the sequence whose rows a mixer is evaluating.
    pub state: &'a GpuState,
    /// Device address of that sequence's first position in the eval
    /// (kernels read it, so a captured graph serves every position).
    pub pos: u64,
    /// That first position on the host: only for sizing what batches use
    /// (one-token steps are captured and replayed at other positions).
    pub start: usize,
    /// Device address of the rotary inverse frequencies (f64).
    pub inv_freq: u64,
    /// YaRN's magnitude factor of the rotated channels (`Rope::mscale`).
    pub rope_mscale: f32,
    /// Device address of the eval's sequence table: per layer and segment
    /// the two state buffers of the segment's sequence
    /// (`GpuLayerState::buffers`), read by decode batches' kernels.
    pub seq_tab: u64,
    /// Device address of the row masks (`RowCache::mask`) per layer and
    /// segment, after the buffers in the same table.
    pub ring_tab: u64,
    /// Segments in the eval (the table's row length).
    pub segments: usize,
    pub cache: Option<&'a mut ExpertCache>,
    pub arena: &'a mut PinnedArena,
    pub store: &'a ExpertStore,
    /// Routed experts per token.
    pub k: usize,
    /// `CudaOptions::prefetch`.
    pub prefetch: bool,
    /// `CudaOptions::cpu_experts`, and the threads that compute them.
    pub cpu_experts: usize,
    pub pool: &'a rayon::ThreadPool,
    /// The model's host weights: the per-expert bias tables of experts the
    /// host computes (gpt-oss).
    pub host_weights: &'a crate::model::weights::Weights,
    /// Pinned memory for what the host reads back mid-step.
    pub downloads: &'a mut PinnedDownload,
    /// In a multi-GPU group: this GPU's experts and its communicator.
    pub ep: Option<&'a Ep>,
    /// A long batch of a group, split by tokens: the rows whose per-token
    /// work each GPU does (`token_split.rs`).
    pub split: Option<RowSplit>,
}

impl Ctx<'_> {
    /// The rows of an `n`-row eval whose per-token work this GPU does.
    pub fn own_rows(&self, n: usize) -> Range<usize> {
        self.split.as_ref().map_or(0..n, RowSplit::own)
    }

    /// In a batch split by tokens, once each GPU has computed its own rows
    /// of `bufs` (`(address, floats per row)`): every row on every GPU.
    pub fn share_rows(&self, bufs: &[(u64, usize)]) -> Result<()> {
        let (Some(split), Some(ep)) = (&self.split, self.ep) else {
            return Ok(());
        };
        let g = self.gpu;
        let n = split.rows.last().map_or(0, |r| r.end);
        g.profiled(
            || {
                let widths: Vec<String> = bufs.iter().map(|b| b.1.to_string()).collect();
                format!("nccl_share_rows [{n}x({})]", widths.join("+"))
            },
            || ep.comm.share_rows(bufs, &split.rows, &g.stream),
        )
    }
}

/// A GPU's part in an expert-parallel group: the routed experts it owns
/// (it caches, uploads and computes only those) and its communicator (the
/// MoE layers' partial outputs are summed across the group).
pub struct Ep {
    pub shard: Shard,
    pub comm: Comm,
    /// On the device: [`Shard::owned_mask`] (set when the model is loaded).
    pub own: Option<DevBuf>,
    /// Every GPU of the group holds every routed expert
    /// ([`CudaOptions::replicate_experts`]): steps of a few tokens run on
    /// each GPU alone, the same arithmetic as one GPU, with no all-reduce,
    /// and so do batches split by tokens, each on its own rows; the others
    /// split the experts by `shard`.
    pub replicated: bool,
}

impl Ep {
    /// Whether `ep` (none: one GPU) is the group's lead, which runs the
    /// shared expert in sharded layers and counts the group's cache uses.
    pub fn leads(ep: Option<&Ep>) -> bool {
        ep.is_none_or(|ep| ep.shard.rank == 0)
    }
}

/// Experts at least this large are prefetched by `Prefetch::Auto`. On the
/// H100, Qwen3.6-35B-A3B widths (1.77 MB experts) decode 35% faster with
/// prefetch from the host tier, the demo model (28 KB) ~15% slower: its
/// copies take less time than the extra router launches (PERFORMANCE.md).
pub const PREFETCH_AUTO_MIN_EXTENT: usize = 256 << 10;

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
    /// Bytes of host RAM to pin as the expert host tier (the mapped expert
    /// files when they all fit, else that many bytes of expert slots; see
    /// `host_tier.rs`); only used when the VRAM cache cannot hold every
    /// expert.
    pub host_cache: Option<u64>,
    /// Upload the next MoE layer's likely experts (its router on the
    /// current layer's input) while a layer computes; from the host tier
    /// only.
    pub prefetch: Prefetch,
    /// At most this many of a layer's experts that are neither in VRAM
    /// nor on their way are computed by the host from the pinned host tier
    /// (one token at a time), beside the copies of the rest.
    pub cpu_experts: usize,
    /// Several GPUs: when the expert-cache budget of every GPU holds every
    /// routed expert, each GPU loads them all and runs the steps of a few
    /// tokens (decode) alone, so they need no all-reduce and run at one
    /// GPU's speed, and prefill batches split by tokens run their MLPs on
    /// each GPU's own rows. `false`: each GPU holds only its shard.
    pub replicate_experts: bool,
    /// Misses read from files opened with `O_DIRECT` go straight to VRAM
    /// through cuFile (GPUDirect Storage); see `gds.rs`.
    pub gds: Gds,
    /// How the products of 4-bit affine matrices (decode and prefill) take
    /// their activations: exact f32, or rounded to 8 bits per 32 inputs as
    /// the CPU's `Activations::Q8` rounds them (routers stay exact).
    pub activations: Activations,
    /// With low-width misses (the store has the copies attached): only
    /// experts every token of the step weighs below this travel as copies
    /// (misses, and the prefetch's predicted experts by their predicted
    /// weight).
    pub low_width_below: Option<f32>,
    /// Run a MoE block's shared expert of a few tokens on a second stream,
    /// beside its router, top-K and routed experts, so its two products
    /// leave the step's chain of dependent launches (the same values;
    /// `MOEFLUX_CUDA_SIDE_STREAM=0` turns it off to compare).
    pub side_stream: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            gpu_memory: None,
            cache_policy: CachePolicy::default(),
            graphs: true,
            prefetch: Prefetch::Auto,
            cpu_experts: 0,
            host_cache: None,
            replicate_experts: true,
            gds: Gds::Auto,
            activations: Activations::F32,
            low_width_below: None,
            side_stream: true,
        }
    }
}

/// What the GPUs of a group set up once and share.
#[derive(Default)]
pub struct GroupShared {
    /// The host tier, once a GPU has pinned it.
    pub host: Option<(HostTier, HostTierInfo)>,
    /// The expert files registered with cuFile, once a GPU has.
    pub gds: Option<Arc<GdsFiles>>,
}

/// Memory kept free for scratch and the attention caches' growth when the
/// expert cache takes "everything else".
const RESERVE: usize = 3 << 30;

/// Logits per block of the device's greedy pick (`argmax_parts`): a large
/// vocabulary is read by up to 64 blocks.
const ARGMAX_SPAN: usize = 4096;

/// A captured decode step and the buffer layout it was captured with.
struct DecodeGraph {
    graph: SendGraph,
    epoch: u64,
    /// The sequence states whose buffers it writes, one token each.
    states: Vec<u64>,
    /// The GPU workspace it used (`Gpu::workspace_ptr`; a later batch may
    /// have grown, and so moved, it).
    workspace: u64,
    /// Whether it picks greedy tokens (`argmax_parts`/`argmax_merge` after
    /// the LM head).
    picks: bool,
}

/// A captured graph that may move to the thread driving its GPU in a group.
struct SendGraph(cudarc::driver::CudaGraph);

// SAFETY: CUDA graph handles belong to the context, not to a thread; the
// graph is launched and dropped only by whoever holds the `CudaModel`
// (`&mut`), after binding the context to that thread.
unsafe impl Send for SendGraph {}

/// One sequence's rows of a GPU eval and its state.
pub struct GpuSegment<'s> {
    pub state: &'s mut GpuState,
    pub seg: Segment,
}

/// Positions the `pos` buffer holds (one per segment of an eval) before it
/// grows, and segments the sequence table holds.
const POS_SLOTS: usize = 64;

/// Decode steps of at most this many sequences are captured as graphs in a
/// group of GPUs (the MoE blocks' per-slot path, which keeps the router's
/// choice on the device, takes up to 16 tokens); one GPU groups larger
/// batches by expert on the device too, and captures up to [`POS_SLOTS`].
const GRAPH_MAX_SEQUENCES: usize = 16;

pub struct CudaModel {
    gpu: Gpu,
    config: ModelConfig,
    opts: CudaOptions,
    /// `opts.prefetch` resolved for this model and cache.
    prefetch: bool,
    _dense: DevBuf,
    _floats: DevBuf,
    weights: DevWeights,
    mla: Option<MlaParams>,
    /// The rotary inverse frequencies (f64): the model's table (YaRN for
    /// the DeepSeek family).
    inv_freq: DevBuf,
    rope_mscale: f32,
    moe_layers: usize,
    cache: Option<ExpertCache>,
    scratch: Scratch,
    arena: PinnedArena,
    logits_host: PinnedDownload,
    /// The MoE layers' router choices (and inputs) read by the host.
    route_host: PinnedDownload,
    /// Per segment of the eval, the position of its first token, on the
    /// device.
    pos: DevBuf,
    /// Per layer and segment, the segment's state buffers (`Ctx::seq_tab`),
    /// then the row masks of its attention caches (`Ctx::ring_tab`).
    seq_tab: DevBuf,
    /// Bumped whenever a buffer a graph may have captured moves.
    epoch: u64,
    /// The epoch and states of the last eager decode step that allocated
    /// nothing: a graph captured now would stay valid.
    stable_epoch: Option<(u64, Vec<u64>)>,
    graph: Option<DecodeGraph>,
    /// What the host tier holds.
    host_tier: HostTierInfo,
    /// Whether misses from the files go through cuFile, when any are read
    /// with `O_DIRECT` and not every expert is resident.
    gds: Option<gds::Choice>,
    /// In a multi-GPU group: this GPU's shard and communicator.
    ep: Option<Ep>,
}

/// Where the dense file starts in its VRAM buffer: shifted so that the data
/// section (after the 8-byte header length and the JSON header) is 256-byte
/// aligned. Tensor offsets are absolute file offsets, and the one-token
/// kernels need 16-byte aligned codes; without the shift their alignment
/// would hang on the header's length, which changes with the tensor count
/// (a Cogito-V2 model cut to 8 layers lost every `qmv` kernel that way).
fn dense_pad(file: &[u8]) -> usize {
    let header = file
        .get(..8)
        .map_or(0, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    let data_start = 8 + header as usize;
    (256 - data_start % 256) % 256
}

/// The dense file in VRAM (see [`dense_pad`]) and the device address that
/// file offset 0 maps to.
fn upload_dense(gpu: &Gpu, file: &[u8]) -> Result<(DevBuf, u64)> {
    let pad = dense_pad(file);
    let buf = DevBuf::zeros(gpu, pad + file.len())?;
    buf.upload_at(pad, file)?;
    let base = buf.ptr() + pad as u64;
    Ok((buf, base))
}

impl CudaModel {
    /// Uploads `model`'s dense weights and sets up state and the expert
    /// cache; when every expert fits in the cache's budget, uploads them all
    /// now. A model the kernels cannot take is `Error::Unsupported` before
    /// anything is uploaded.
    pub fn new(
        gpu: Gpu,
        model: &Model,
        store: &ExpertStore,
        opts: &CudaOptions,
    ) -> Result<CudaModel> {
        CudaModel::new_in_group(gpu, model, store, opts, None, &mut GroupShared::default())
    }

    /// [`CudaModel::new`] for one GPU of a multi-GPU group (`ep`): only the
    /// experts its shard owns are cached. `shared`: what an earlier GPU of
    /// the group set up (the host tier, pinned once; the cuFile
    /// registrations), or empty for this GPU to set it up when it needs it.
    pub fn new_in_group(
        gpu: Gpu,
        model: &Model,
        store: &ExpertStore,
        opts: &CudaOptions,
        ep: Option<Ep>,
        shared: &mut GroupShared,
    ) -> Result<CudaModel> {
        support::check(model)?;
        gpu.bind()?;
        let mut gpu = gpu;
        gpu.q8 = opts.activations == Activations::Q8;
        gpu.side_stream = opts.side_stream
            && std::env::var_os("MOEFLUX_CUDA_SIDE_STREAM").is_none_or(|v| v != "0");
        let c = model.config.clone();
        let mut ep = ep;
        if let Some(ep) = &mut ep {
            let mask = ep.shard.owned_mask(c.moe.num_experts);
            ep.own = Some(DevBuf::from_slice(&gpu, &mask)?);
        }
        let (dense, base) = upload_dense(&gpu, model.weights.dense.file_bytes())?;
        let floats = DevBuf::from_slice(&gpu, model.weights.arena())?;
        let weights = DevWeights {
            base,
            floats: floats.ptr(),
        };
        let has_mla = model
            .layers
            .iter()
            .any(|l| matches!(l.mixer, Mixer::Mla(_)));
        let mla = has_mla
            .then(|| MlaParams::new(&c, &model.rope))
            .transpose()?;
        let max_extent = model
            .layers
            .iter()
            .filter_map(|l| l.mlp.moe())
            .map(|b| b.experts.extent)
            .max()
            .unwrap_or(0);
        let mut m = CudaModel {
            config: c,
            opts: opts.clone(),
            prefetch: false,
            _dense: dense,
            _floats: floats,
            weights,
            mla,
            inv_freq: DevBuf::from_slice(&gpu, &model.rope.inv_freq)?,
            rope_mscale: model.rope.mscale,
            moe_layers: model.moe_layers(),
            cache: None,
            scratch: Scratch::default(),
            arena: PinnedArena::new(),
            logits_host: PinnedDownload::default(),
            route_host: PinnedDownload::default(),
            pos: DevBuf::zeros(&gpu, 8 * POS_SLOTS)?,
            seq_tab: DevBuf::zeros(&gpu, 24 * POS_SLOTS * model.layers.len())?,
            epoch: 0,
            stable_epoch: None,
            graph: None,
            host_tier: HostTierInfo::default(),
            gds: None,
            ep,
            gpu,
        };
        if max_extent > 0 {
            let e = m.config.moe.num_experts;
            let every = store.layers().count() * e;
            let budget = match opts.gpu_memory {
                Some(b) => b as usize,
                None => m.gpu.free_bytes()?.saturating_sub(RESERVE),
            };
            // A group's GPUs each hold every expert when each can (the
            // group then agrees: `CudaGroup::new` / `new_dist`).
            if let Some(ep) = &mut m.ep {
                ep.replicated = opts.replicate_experts && budget >= every * max_extent;
            }
            let (owned, per_layer) = match &m.ep {
                Some(ep) if !ep.replicated => {
                    (ep.shard.owned_total(), ep.shard.max_owned_per_layer())
                }
                _ => (every, e),
            };
            let budget = budget.min(owned * max_extent);
            let mut cache =
                ExpertCache::new(&m.gpu, budget, max_extent, per_layer, opts.cache_policy)?;
            let shard =
                m.ep.as_ref()
                    .filter(|ep| !ep.replicated)
                    .map(|ep| &ep.shard);
            let owns = |l: usize, x: usize| shard.is_none_or(|s| s.owns(l, x));
            if !cache.preload_all(&m.gpu, store, model.layers.len(), e, owns)? {
                if let Some(ep) = &mut m.ep {
                    ep.replicated = false;
                }
                if store.low_width().is_some() {
                    let without = model
                        .layers
                        .iter()
                        .filter_map(|l| l.mlp.moe())
                        .find(|b| b.low_width.is_none());
                    if let Some(b) = without {
                        return Err(Error::Invalid(format!(
                            "--low-width-misses: MoE layer {} has no low-width copies of its \
                             experts",
                            b.layer
                        )));
                    }
                    cache.use_low_width_misses(opts.low_width_below);
                }
                match (opts.host_cache, shared.host.as_ref()) {
                    (Some(_), Some((tier, counts))) => {
                        cache.share_host_tier(tier.clone());
                        m.host_tier = *counts;
                    }
                    (Some(budget), None) => {
                        m.host_tier = cache.pin_host_tier(&m.gpu, store, budget)?;
                        shared.host = Some((cache.host_tier(), m.host_tier));
                    }
                    (None, _) => {}
                }
                m.gds = m.read_through_cufile(&mut cache, store, shared)?;
                m.prefetch = match opts.prefetch {
                    Prefetch::On => true,
                    Prefetch::Off => false,
                    Prefetch::Auto => {
                        m.host_tier.is_some() && max_extent >= PREFETCH_AUTO_MIN_EXTENT
                    }
                };
            }
            m.cache = Some(cache);
        }
        Ok(m)
    }

    /// Decides `opts.gds` for a cache that reads misses from the files and
    /// sets cuFile up when it is used; `None` when no file is read with
    /// `O_DIRECT`.
    fn read_through_cufile(
        &self,
        cache: &mut ExpertCache,
        store: &ExpertStore,
        shared: &mut GroupShared,
    ) -> Result<Option<gds::Choice>> {
        if !store.layers().any(|l| store.is_direct(l) == Some(true)) {
            if self.opts.gds == Gds::On {
                return Err(Error::Invalid(
                    "--gds on reads expert files opened with O_DIRECT: add --direct-io \
                     (or the file system refused direct I/O)"
                        .into(),
                ));
            }
            return Ok(None);
        }
        let choice = gds::choose(self.opts.gds)?;
        if !matches!(choice, gds::Choice::Use(_)) {
            return Ok(Some(choice));
        }
        let files = match &shared.gds {
            Some(f) => Arc::clone(f),
            None => match GdsFiles::register(store) {
                Ok(f) => {
                    let f = Arc::new(f);
                    shared.gds = Some(Arc::clone(&f));
                    f
                }
                // `auto`: a file system cuFile cannot take is read the plain way.
                Err(e) if self.opts.gds == Gds::Auto => {
                    return Ok(Some(gds::Choice::Plain(Some(e.to_string()))))
                }
                Err(e) => {
                    return Err(Error::Gpu(format!(
                        "--gds on: {e} (--gds off reads the plain way)"
                    )))
                }
            },
        };
        cache.use_gds(GdsReader {
            files,
            ctx: Arc::clone(&self.gpu.ctx),
        });
        Ok(Some(choice))
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Whether misses read from the files go through cuFile (see
    /// [`CudaOptions::gds`]); `None` when none are read with `O_DIRECT`.
    pub fn gds(&self) -> Option<&gds::Choice> {
        self.gds.as_ref()
    }

    /// In a group: whether this GPU holds every routed expert and runs the
    /// steps of a few tokens alone (`Ep::replicated`).
    pub fn replicated(&self) -> bool {
        self.ep.as_ref().is_some_and(|ep| ep.replicated)
    }

    /// Sets what the group agreed on: a GPU that holds every expert in a
    /// group where another GPU could not shards its work like the others
    /// (its table then also holds experts it does not own, which the
    /// combine's mask leaves out).
    pub fn set_replicated(&mut self, agreed: bool) {
        if let Some(ep) = &mut self.ep {
            ep.replicated &= agreed;
        }
    }

    /// `--dist-init`: whether every rank of the group holds every expert,
    /// by an all-reduce of one flag over the group's communicator.
    pub fn all_ranks_replicate(&self) -> Result<bool> {
        let Some(ep) = &self.ep else {
            return Ok(false);
        };
        self.gpu.bind()?;
        let flag = DevBuf::from_slice(&self.gpu, &[f32::from(u8::from(ep.replicated))])?;
        ep.comm
            .all_reduce_f32(flag.ptr(), flag.ptr(), 1, &self.gpu.stream)?;
        self.gpu.sync()?;
        let mut sum = [0.0f32];
        flag.download(&mut sum)?;
        Ok(sum[0] as usize == ep.shard.world)
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.as_ref().map(|c| c.stats).unwrap_or_default()
    }

    /// What the host tier (`--host-cache`) holds.
    pub fn host_tier(&self) -> HostTierInfo {
        self.host_tier
    }

    /// Whether decode steps upload predicted experts ahead.
    pub fn prefetching(&self) -> bool {
        self.prefetch
    }

    /// Whether the expert cache uploads misses as low-width copies.
    pub fn low_width_misses(&self) -> bool {
        self.cache.as_ref().is_some_and(|c| c.uploads_low_width())
    }

    /// Expert slots in VRAM.
    pub fn cache_slots(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.slots())
    }

    /// A new, empty sequence state (its row caches grow as it does).
    pub fn new_state(&self, model: &Model) -> Result<GpuState> {
        self.gpu.bind()?;
        let c = &self.config;
        let layers = model
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Full(a) => attention::new_kv(&self.gpu, c, a.window),
                Mixer::Linear(_) => deltanet::new_state(&self.gpu, c),
                Mixer::Mla(_) => mla::new_cache(&self.gpu, self.mla.as_ref().expect("MLA layers")),
            })
            .collect::<Result<_>>()?;
        Ok(GpuState::new(layers))
    }

    /// Forgets a sequence: empty attention caches, zero recurrent states
    /// (in place: buffers keep their addresses and capacity).
    pub fn clear(&mut self, state: &mut GpuState) -> Result<()> {
        self.gpu.bind()?;
        state.clear(&self.gpu)
    }

    /// A host copy of a sequence state (same layout as the CPU backend's).
    pub fn download_state(&self, state: &GpuState) -> Result<ModelState> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        state.download()
    }

    /// What a checkpoint keeps: the linear-attention states and the window
    /// layers' visible rows.
    pub fn rewind_state(&self, state: &GpuState) -> Result<RewindState> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        state.rewind_state()
    }

    /// Replaces a state with a host copy (from `download_state` or a
    /// snapshot of either backend).
    pub fn upload_state(&mut self, state: &mut GpuState, s: &ModelState) -> Result<()> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        if state.upload(&self.gpu, s)? {
            self.epoch += 1;
        }
        Ok(())
    }

    /// Returns to position `pos` (see `GpuState::rewind`).
    pub fn rewind(
        &mut self,
        state: &mut GpuState,
        pos: usize,
        from: Option<&RewindState>,
    ) -> Result<()> {
        self.gpu.bind()?;
        self.gpu.sync()?;
        if state.rewind(&self.gpu, pos, from)? {
            self.epoch += 1;
        }
        Ok(())
    }

    /// Evaluates `tokens` of `model` (the one this was built from), the
    /// rows of `segs` in order, each segment on its sequence's state, and
    /// returns the logits of each segment's logit rows, a vector per segment.
    /// The mixers run per segment; everything else once over all rows.
    /// `pool`: the threads that compute the experts the host takes
    /// (`cpu_experts`). With `trace`, every block's output is read back
    /// (eagerly, no graph).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        model: &Model,
        store: &ExpertStore,
        pool: &rayon::ThreadPool,
        k: usize,
        tokens: &[u32],
        mut segs: Vec<GpuSegment<'_>>,
        times: &mut PhaseTimes,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<SegmentOutput>> {
        self.gpu.bind()?;
        let mut clock = std::time::Instant::now();
        let n = tokens.len();
        for s in &mut segs {
            if s.state
                .grow_for_eval(&self.gpu, s.seg.start, s.seg.rows.len())?
            {
                self.epoch += 1;
            }
        }
        let layers = model.layers.len();
        if segs.len() > self.pos.bytes() / 8 {
            let slots = segs.len().next_power_of_two();
            self.pos = DevBuf::zeros(&self.gpu, 8 * slots)?;
            self.seq_tab = DevBuf::zeros(&self.gpu, 24 * slots * layers)?;
            self.epoch += 1;
        }
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let d_ids = self.scratch.get(&self.gpu, "ids", 4 * n)?;
        self.arena.reset();
        self.arena.upload(&self.gpu, d_ids, &ids)?;
        let starts: Vec<i64> = segs.iter().map(|s| s.seg.start as i64).collect();
        self.arena.upload(&self.gpu, self.pos.ptr(), &starts)?;
        if segs.len() > 1 {
            let mut table = vec![0u64; 3 * layers * segs.len()];
            let (bufs, masks) = table.split_at_mut(2 * layers * segs.len());
            for (j, s) in segs.iter().enumerate() {
                for (i, l) in s.state.layers.iter().enumerate() {
                    let at = i * segs.len() + j;
                    bufs[2 * at..2 * at + 2].copy_from_slice(&l.buffers());
                    masks[at] = l.row_mask() as u64;
                }
            }
            self.arena.upload(&self.gpu, self.seq_tab.ptr(), &table)?;
        }
        let resident = self.cache.as_ref().is_none_or(|c| c.all_resident());
        // Decode steps (one token per sequence, its logits) replay a graph
        // captured for the same sequences, in the same order.
        let graph_max = if self.ep.is_none() && moe::device_grouping() {
            POS_SLOTS
        } else {
            GRAPH_MAX_SEQUENCES
        };
        let decode = segs.len() <= graph_max
            && segs.iter().all(|s| {
                s.seg.rows.len() == 1
                    && matches!(s.seg.logits, Some(LogitsMode::Last | LogitsMode::Greedy))
            });
        // A group's all-reduces are captured too (`MOEFLUX_EP_GRAPHS=0`
        // runs its steps eagerly).
        let graphs = self.opts.graphs && (self.ep.is_none() || ep_graphs());
        let graphable = graphs && decode && resident && trace.is_none();
        let states: Vec<u64> = segs.iter().map(|s| s.state.id).collect();
        let modes: Vec<_> = segs
            .iter()
            .map(|s| (s.seg.logit_rows().len(), s.seg.logits))
            .collect();
        let picks = picks_tokens(segs.iter().map(|s| &s.seg));
        let stable = self
            .stable_epoch
            .as_ref()
            .is_some_and(|(e, s)| *e == self.epoch && *s == states);
        if graphable && !self.graph_valid(&states, picks) && stable {
            // Capturing only records the step (the replay below runs and
            // counts it).
            let counted = self.cache.as_ref().map(|c| c.stats);
            begin_capture(&self.gpu)?;
            let recorded = self.layers_forward(
                model,
                store,
                pool,
                k,
                tokens,
                &segs,
                &mut PhaseTimes::default(),
                None,
            );
            let graph = end_capture(&self.gpu, recorded)?;
            if let (Some(c), Some(s)) = (self.cache.as_mut(), counted) {
                c.stats = s;
            }
            if self.scratch.grew {
                // Allocated during capture: the layout moved, the graph is
                // stale; run eagerly.
                self.scratch.grew = false;
                self.epoch += 1;
            } else {
                self.graph = Some(DecodeGraph {
                    graph: SendGraph(graph),
                    epoch: self.epoch,
                    states: states.clone(),
                    workspace: self.gpu.workspace_ptr(),
                    picks,
                });
            }
        }
        if graphable && self.graph_valid(&states, picks) {
            let g = self.graph.as_ref().expect("checked above");
            g.graph
                .0
                .launch()
                .map_err(|e| Error::Gpu(format!("CUDA graph launch: {e}")))?;
            // In a group, the lead counts the group's uses (as eager steps do).
            let uses = (n * k * self.moe_layers) as u64;
            let counts = Ep::leads(self.ep.as_ref());
            if let Some(c) = self.cache.as_mut().filter(|_| counts) {
                c.count_hits(uses);
            }
            self.gpu.sync()?;
            lap(&mut clock, &mut times.gpu_graph);
        } else {
            self.scratch.grew = false;
            let before = self.epoch;
            self.layers_forward(model, store, pool, k, tokens, &segs, times, trace)?;
            if self.scratch.grew {
                self.scratch.grew = false;
                self.epoch += 1;
            }
            if graphable && self.epoch == before {
                self.stable_epoch = Some((self.epoch, states));
            }
            clock = std::time::Instant::now();
        }
        self.download_outputs(&modes, picks, clock, times)
    }

    /// Whether the captured decode graph matches the current buffers,
    /// writes `states` and picks greedy tokens as asked (`picks`).
    fn graph_valid(&self, states: &[u64], picks: bool) -> bool {
        self.graph.as_ref().is_some_and(|g| {
            g.epoch == self.epoch
                && g.states == states
                && g.workspace == self.gpu.workspace_ptr()
                && g.picks == picks
        })
    }

    /// Each segment's output, from its `(logit rows, mode)`: the logits of
    /// its rows straight into a vector, or (Greedy) its row's token from
    /// "picks" (one wait for all).
    fn download_outputs(
        &mut self,
        modes: &[(usize, Option<LogitsMode>)],
        picks: bool,
        mut clock: std::time::Instant,
        times: &mut PhaseTimes,
    ) -> Result<Vec<SegmentOutput>> {
        let v = self.config.vocab_size;
        let m: usize = modes.iter().map(|&(r, _)| r).sum();
        let logits = self.scratch.get(&self.gpu, "logits", 4 * m * v)?;
        let tokens = if picks {
            self.scratch.get(&self.gpu, "picks", 4 * m)?
        } else {
            0
        };
        let mut at = 0;
        let runs: Vec<(u64, usize)> = modes
            .iter()
            .map(|&(r, mode)| {
                let run = if mode == Some(LogitsMode::Greedy) {
                    (tokens + 4 * at as u64, 1)
                } else {
                    (logits + (4 * at * v) as u64, r * v)
                };
                at += r;
                run
            })
            .collect();
        let got: Vec<Vec<f32>> = self.logits_host.download_runs(&self.gpu, &runs)?;
        lap(&mut clock, &mut times.lm_head);
        Ok(got
            .into_iter()
            .zip(modes)
            .map(|(vals, &(_, mode))| {
                if mode == Some(LogitsMode::Greedy) {
                    // argmax_merge's i32, -1 for a row that is not all finite.
                    let id = vals[0].to_bits() as i32;
                    SegmentOutput::Token(u32::try_from(id).ok())
                } else {
                    SegmentOutput::Logits(vals)
                }
            })
            .collect())
    }

    /// The layer stack over `tokens` (segment `i`'s first position at
    /// `pos + 8 i` on the device, the ids on the device too); logits of the
    /// segments' logit rows land in the "logits" scratch buffer.
    #[allow(clippy::too_many_arguments)]
    fn layers_forward(
        &mut self,
        model: &Model,
        store: &ExpertStore,
        pool: &rayon::ThreadPool,
        k: usize,
        tokens: &[u32],
        segs: &[GpuSegment<'_>],
        times: &mut PhaseTimes,
        trace: Option<&mut Trace>,
    ) -> Result<()> {
        let n = tokens.len();
        let h = self.config.hidden_size;
        let g = &self.gpu;
        let seqs: Vec<SeqRows> = segs
            .iter()
            .enumerate()
            .map(|(i, s)| SeqRows {
                state: &*s.state,
                index: i,
                pos: self.pos.ptr() + 8 * i as u64,
                seg: s.seg.clone(),
            })
            .collect();
        let first = seqs.first().ok_or(Error::EmptyTokens)?;
        // A trace reads whole activations: it is not split.
        let split = self
            .ep
            .as_ref()
            .filter(|_| trace.is_none())
            .and_then(|ep| RowSplit::for_batch(n, ep.comm.world, ep.comm.rank, ep.replicated));
        let cx = Ctx {
            gpu: g,
            config: &self.config,
            weights: self.weights,
            mla: self.mla,
            scratch: &mut self.scratch,
            state: first.state,
            pos: first.pos,
            start: first.seg.start,
            inv_freq: self.inv_freq.ptr(),
            rope_mscale: self.rope_mscale,
            seq_tab: self.seq_tab.ptr(),
            ring_tab: self.seq_tab.ptr() + (16 * model.layers.len() * segs.len()) as u64,
            segments: segs.len(),
            cache: self.cache.as_mut(),
            arena: &mut self.arena,
            store,
            k,
            prefetch: self.prefetch,
            cpu_experts: self.opts.cpu_experts,
            pool,
            host_weights: &model.weights,
            downloads: &mut self.route_host,
            ep: self.ep.as_ref(),
            split,
        };
        let ids = cx.scratch.get(g, "ids", 4 * n)?;
        let x = cx.scratch.get(g, "x", 4 * n * h)?;
        let xn = cx.scratch.get(g, "xn", 4 * n * h)?;
        let mut step = GpuStep {
            cx,
            n,
            seqs,
            ids,
            x,
            xn,
            times,
            combine: None,
        };
        forward::forward(model, &mut step, tokens, trace)?;
        step.flush()
    }
}

/// Whether a multi-GPU group's decode steps are captured as CUDA graphs,
/// NCCL's all-reduces included (the default; `MOEFLUX_EP_GRAPHS=0` turns
/// them off while `--no-cuda-graphs` still keeps one GPU's).
fn ep_graphs() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_EP_GRAPHS").map_or(true, |v| v != "0"))
}

/// Whether any of `segs` asks for its greedy token (then every logit row's
/// is picked on the device, after the LM head).
fn picks_tokens<'s>(mut segs: impl Iterator<Item = &'s Segment>) -> bool {
    segs.any(|s| s.logits == Some(LogitsMode::Greedy))
}

/// One sequence's share of a GPU eval: its state, its segment's index,
/// the device address of its first position, its rows.
pub(super) struct SeqRows<'a> {
    pub state: &'a GpuState,
    pub index: usize,
    pub pos: u64,
    pub seg: Segment,
}

/// How a mixer runs its per-sequence part over a share of the eval.
pub(super) enum MixerRun<'s, 'a> {
    /// Consecutive sequences of one token each: one launch per kernel over
    /// all of them, each row finding its state in the sequence table.
    Decode(&'s [SeqRows<'a>]),
    /// One sequence's rows.
    One(&'s SeqRows<'a>),
}

impl MixerRun<'_, '_> {
    /// The sequences in `seqs` split into decode batches (at least two
    /// one-token sequences in a row) and single sequences, in row order.
    pub fn split<'s, 'a>(seqs: &'s [SeqRows<'a>]) -> Vec<MixerRun<'s, 'a>> {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < seqs.len() {
            let len = seqs[i..]
                .iter()
                .take_while(|s| s.seg.rows.len() == 1)
                .count();
            if len >= 2 {
                runs.push(MixerRun::Decode(&seqs[i..i + len]));
                i += len;
            } else {
                runs.push(MixerRun::One(&seqs[i]));
                i += 1;
            }
        }
        runs
    }
}

impl Ctx<'_> {
    /// Device address of layer `layer`'s sequence-table entries for the
    /// decode batch `run` (from its first segment's on), or `None` when a
    /// sequence's state of that layer is not of the mixer's kind (`fits`).
    pub fn decode_table(
        &self,
        layer: usize,
        run: &[SeqRows],
        fits: impl Fn(&GpuLayerState) -> bool,
    ) -> Option<u64> {
        let ok = run
            .iter()
            .all(|sq| sq.state.layers.get(layer).is_some_and(&fits));
        let first = run.first()?;
        ok.then(|| self.seq_tab + 16 * (layer * self.segments + first.index) as u64)
    }

    /// Device address of layer `layer`'s row masks for the decode batch
    /// `run` (the entries beside `decode_table`'s).
    pub fn decode_masks(&self, layer: usize, run: &[SeqRows]) -> u64 {
        let first = run.first().map_or(0, |s| s.index);
        self.ring_tab + 8 * (layer * self.segments + first) as u64
    }
}

/// One eval's batch on the GPU: the [`BlockExecutor`] the layer stack
/// drives, its `x` and `xn` device buffers of `n` rows.
struct GpuStep<'a, 'b> {
    cx: Ctx<'a>,
    n: usize,
    /// The batch's sequences, in row order.
    seqs: Vec<SeqRows<'a>>,
    /// Device addresses of the token ids and the two activations.
    ids: u64,
    x: u64,
    xn: u64,
    times: &'b mut PhaseTimes,
    /// The last MoE block's combine into `x`, launched by the next
    /// operation (with the norm when that is a norm of its rows).
    combine: Option<moe::PendingCombine>,
}

impl<'a> GpuStep<'a, '_> {
    /// Launches a held-back combine: every operation but a norm of its rows
    /// reads `x` after it.
    fn flush(&mut self) -> Result<()> {
        match self.combine.take() {
            Some(c) => c.launch(self.cx.gpu, None),
            None => Ok(()),
        }
    }

    /// Rows whose logits the eval computes.
    fn logit_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.seg.logit_rows().len()).sum()
    }

    /// `xn`, the row count and `x` of the rows whose norms and MLP this GPU
    /// computes (all of them unless the batch is split by tokens and every
    /// GPU holds every expert).
    fn mlp_rows(&self) -> (u64, usize, u64) {
        let h = self.cx.config.hidden_size;
        let rows = self.cx.split.as_ref().map_or(0..self.n, RowSplit::mlp_rows);
        (
            row(self.xn, rows.start, h),
            rows.len(),
            row(self.x, rows.start, h),
        )
    }

    /// After a mixer of a batch split by tokens whose experts are sharded:
    /// every GPU's output rows on every GPU (the MLP runs on all of them).
    fn share_mixer_rows(&self) -> Result<()> {
        match &self.cx.split {
            Some(s) if !s.experts_local => {
                self.cx.share_rows(&[(self.x, self.cx.config.hidden_size)])
            }
            _ => Ok(()),
        }
    }

    /// Runs a mixer per sequence (MLA: its absorbed products per
    /// sequence): `f(cx, xn, n, x)` on its rows, with the context's state,
    /// positions and share of a split its own.
    fn per_sequence(
        &mut self,
        mut f: impl FnMut(&mut Ctx<'a>, u64, usize, u64) -> Result<()>,
    ) -> Result<()> {
        let row = 4 * self.cx.config.hidden_size as u64;
        let whole = self.cx.split.take();
        let mut done = Ok(());
        for s in &self.seqs {
            self.cx.state = s.state;
            self.cx.pos = s.pos;
            self.cx.start = s.seg.start;
            self.cx.split = whole.as_ref().map(|w| w.within(&s.seg.rows));
            let off = s.seg.rows.start as u64 * row;
            done = f(&mut self.cx, self.xn + off, s.seg.rows.len(), self.x + off);
            if done.is_err() {
                break;
            }
        }
        self.cx.split = whole;
        done
    }
}

impl BlockExecutor for GpuStep<'_, '_> {
    fn embed(&mut self, table: &LinearRef, _tokens: &[u32]) -> Result<()> {
        self.flush()?;
        // The ids are on the device already (a captured graph reads them).
        let embed: Qw = match self.cx.weights.lin(table) {
            DevLinear::Quant(q) => q,
            DevLinear::Dense { .. } => {
                return Err(Error::Invalid("unquantized embedding on the GPU".into()))
            }
        };
        let (ids, x) = (self.ids, self.x);
        // SAFETY: `qgather_rows` in kernels/qmv.cu; ids and x hold n tokens.
        unsafe {
            self.cx.gpu.launch(
                "qgather_rows",
                (self.n as u32, 1, 1),
                256,
                0,
                &mut args!(embed, ids, x),
            )
        }
    }

    fn norm(&mut self, weight: VectorRef) -> Result<()> {
        let c = self.cx.config;
        let w = self.cx.weights.vec(weight);
        let (xn, m, x) = self.mlp_rows();
        if let Some(combine) = self.combine.take_if(|p| p.writes(x, m)) {
            return combine.launch(self.cx.gpu, Some((w, c.rms_norm_eps, xn)));
        }
        self.flush()?;
        rms_norm(self.cx.gpu, x, w, m, c.hidden_size, c.rms_norm_eps, xn)
    }

    fn full_attention(&mut self, layer: usize, a: &FullAttention) -> Result<()> {
        self.flush()?;
        attention::forward(&mut self.cx, layer, a, self.xn, self.n, self.x, &self.seqs)?;
        self.share_mixer_rows()
    }

    fn gated_deltanet(&mut self, layer: usize, g: &GatedDeltaNet) -> Result<()> {
        self.flush()?;
        deltanet::forward(&mut self.cx, layer, g, self.xn, self.n, self.x, &self.seqs)?;
        self.share_mixer_rows()
    }

    fn mla(&mut self, layer: usize, a: &MlaAttention) -> Result<()> {
        self.flush()?;
        self.per_sequence(|cx, xn, n, x| mla::forward(cx, layer, a, xn, n, x))?;
        self.share_mixer_rows()
    }

    fn dense_mlp(&mut self, _layer: usize, d: &DenseMlp) -> Result<()> {
        self.flush()?;
        let (xn, m, x) = self.mlp_rows();
        moe::dense_mlp(&mut self.cx, d, xn, m, x)
    }

    fn moe(&mut self, b: &MoeBlock, next: Option<&MoeBlock>) -> Result<()> {
        self.flush()?;
        let (xn, m, x) = self.mlp_rows();
        self.combine = moe::moe(&mut self.cx, b, next, xn, m, x, self.times)?;
        Ok(())
    }

    fn logits(&mut self, final_norm: VectorRef, lm_head: &LinearRef) -> Result<()> {
        self.flush()?;
        let m = self.logit_rows();
        let cx = &mut self.cx;
        let (g, c) = (cx.gpu, cx.config);
        let (h, v) = (c.hidden_size, c.vocab_size);
        if m == 0 {
            return Ok(());
        }
        // Split by tokens with every expert local, each GPU updated only
        // its own rows.
        if cx.split.as_ref().is_some_and(|s| s.experts_local) {
            cx.share_rows(&[(self.x, h)])?;
        }
        let normed = cx.scratch.get(g, "normed", 4 * m * h)?;
        let w = cx.weights;
        let mut at = 0;
        for s in &self.seqs {
            let rows = s.seg.logit_rows();
            if rows.is_empty() {
                continue;
            }
            let src = self.x + (4 * rows.start * h) as u64;
            let dst = normed + (4 * at * h) as u64;
            rms_norm(
                g,
                src,
                w.vec(final_norm),
                rows.len(),
                h,
                c.rms_norm_eps,
                dst,
            )?;
            at += rows.len();
        }
        let logits = cx.scratch.get(g, "logits", 4 * m * v)?;
        matmuls(g, &[mm(w.lin(lm_head), logits)], normed, m)?;
        if picks_tokens(self.seqs.iter().map(|s| &s.seg)) {
            let picks = cx.scratch.get(g, "picks", 4 * m)?;
            let parts = v.div_ceil(ARGMAX_SPAN).clamp(1, 64);
            let span = v.div_ceil(parts) as i32;
            let partials = cx.scratch.get(g, "argmax_parts", 12 * m * parts)?;
            let (pbest, pat, pbad) = (
                partials,
                partials + (4 * m * parts) as u64,
                partials + (8 * m * parts) as u64,
            );
            let (vv, parts_i) = (v as i32, parts as i32);
            // SAFETY: `argmax_parts` and `argmax_merge` in kernels/elementwise.cu;
            // logits hold m rows of v floats, the partials m * parts of each
            // kind, picks m ints.
            unsafe {
                g.launch(
                    "argmax_parts",
                    (parts as u32, m as u32, 1),
                    256,
                    0,
                    &mut args!(logits, vv, span, pbest, pat, pbad),
                )?;
                g.launch(
                    "argmax_merge",
                    (m as u32, 1, 1),
                    64,
                    0,
                    &mut args!(pbest, pat, pbad, parts_i, picks),
                )?;
            }
        }
        Ok(())
    }

    fn read(&mut self, what: Activation) -> Result<Vec<f32>> {
        self.flush()?;
        let c = self.cx.config;
        let (src, count) = match what {
            Activation::Hidden => (self.x, self.n * c.hidden_size),
            Activation::Normed => (self.xn, self.n * c.hidden_size),
            Activation::Logits => {
                let count = self.logit_rows() * c.vocab_size;
                let logits = self.cx.scratch.get(self.cx.gpu, "logits", 4 * count)?;
                (logits, count)
            }
        };
        self.cx.downloads.download_f32(self.cx.gpu, src, count)
    }

    fn times(&mut self) -> &mut PhaseTimes {
        self.times
    }
}

#[cfg(test)]
mod tests {
    use super::dense_pad;

    fn file(header_len: u64) -> Vec<u8> {
        let mut f = header_len.to_le_bytes().to_vec();
        f.resize(8 + header_len as usize + 64, b' ');
        f
    }

    #[test]
    fn the_data_section_lands_256_byte_aligned() {
        for h in [0u64, 8, 16, 248, 1000, 12_344, 65_536] {
            let pad = dense_pad(&file(h));
            assert!(pad < 256);
            assert_eq!((pad + 8 + h as usize) % 256, 0, "header {h}");
        }
        assert_eq!(dense_pad(&file(248)), 0);
        assert_eq!(dense_pad(&[]), 248);
    }
}
