//! Where a batch's forward pass runs, and each sequence's state: on the
//! CPU (state in host memory) or on a GPU (state in VRAM, copied to the
//! host only for checkpoints and snapshots, in the same layout).

use std::borrow::Cow;

use crate::backend::cpu::exec::CpuExecutor;
use crate::backend::cpu::experts::ExpertRun;
use crate::backend::cpu::repack::RepackedExperts;
use crate::backend::cuda::group::{CudaGroup, GroupSegment, GroupState};
use crate::backend::prefetch::PrefetchStats;
use crate::error::{Error, Result};
use crate::io::{ExpertBuf, ExpertStore};
use crate::model::forward::{self, Segment, SegmentOutput};
use crate::model::state::{LayerState, ModelState, RewindState};
use crate::model::timing::PhaseTimes;
use crate::model::trace::Trace;
use crate::model::Model;

pub(crate) enum Engine {
    Cpu {
        /// Reusable expert read buffers.
        bufs: Vec<ExpertBuf>,
        /// MXFP4 experts interleaved in RAM at load (`--cpu-repack`).
        repacked: Option<RepackedExperts>,
    },
    Cuda(Box<CudaGroup>),
}

/// One sequence's state, where its engine keeps it.
pub(crate) enum SeqState {
    Cpu(ModelState),
    Cuda(GroupState),
}

/// What a forward pass needs besides the engine.
pub(crate) struct ForwardCtx<'a> {
    pub model: &'a Model,
    pub store: &'a ExpertStore,
    pub pool: &'a rayon::ThreadPool,
    pub k: usize,
    pub prefetch: bool,
    pub prefetch_stats: &'a mut PrefetchStats,
    pub times: &'a mut PhaseTimes,
}

impl Engine {
    /// A new, empty sequence state.
    pub fn new_state(&self, model: &Model) -> Result<SeqState> {
        match self {
            Engine::Cpu { .. } => Ok(SeqState::Cpu(model.new_state())),
            Engine::Cuda(m) => Ok(SeqState::Cuda(m.new_state(model)?)),
        }
    }

    /// Evaluates `tokens`, the rows of `segs` in order, segment `i` on
    /// `states[i]` (each segment's state is on this engine); with `trace`,
    /// records every block's output. Returns each segment's output (its
    /// logit rows' logits, or its greedy token), in order.
    pub fn forward(
        &mut self,
        cx: ForwardCtx<'_>,
        states: Vec<&mut SeqState>,
        segs: Vec<Segment>,
        tokens: &[u32],
        trace: Option<&mut Trace>,
    ) -> Result<Vec<SegmentOutput>> {
        match self {
            Engine::Cpu { bufs, repacked } => {
                let run = ExpertRun {
                    store: cx.store,
                    bufs,
                    k: cx.k,
                    prefetch: cx.prefetch,
                    pending: None,
                    stats: cx.prefetch_stats,
                    repacked: repacked.as_ref(),
                };
                let states = states
                    .into_iter()
                    .map(|s| match s {
                        SeqState::Cpu(s) => s,
                        SeqState::Cuda(_) => unreachable!("a GPU state on the CPU engine"),
                    })
                    .collect();
                let model = cx.model;
                let rows: Vec<usize> = segs.iter().map(|s| s.logit_rows().len()).collect();
                let modes: Vec<_> = segs.iter().map(|s| s.logits).collect();
                let logits = cx.pool.install(|| {
                    let mut ex = CpuExecutor::new(model, states, segs, run, cx.times);
                    forward::forward(model, &mut ex, tokens, trace)?;
                    Ok::<_, Error>(ex.into_logits())
                })?;
                let parts = split_rows(logits, &rows, model.config.vocab_size);
                Ok(parts
                    .into_iter()
                    .zip(modes)
                    .map(|(l, mode)| SegmentOutput::from_logits(l, mode))
                    .collect())
            }
            Engine::Cuda(m) => {
                let segs = states
                    .into_iter()
                    .zip(segs)
                    .map(|(s, seg)| match s {
                        SeqState::Cuda(state) => GroupSegment { state, seg },
                        SeqState::Cpu(_) => unreachable!("a host state on the GPU engine"),
                    })
                    .collect();
                m.forward(
                    cx.model, cx.store, cx.pool, cx.k, tokens, segs, cx.times, trace,
                )
            }
        }
    }

    /// Empties `state` (position 0).
    pub fn clear(&mut self, state: &mut SeqState) -> Result<()> {
        match (self, state) {
            (Engine::Cpu { .. }, SeqState::Cpu(s)) => {
                s.clear();
                Ok(())
            }
            (Engine::Cuda(m), SeqState::Cuda(s)) => m.clear(s),
            _ => unreachable!("a state on another engine"),
        }
    }

    /// What returning to the current position later needs (a checkpoint):
    /// the linear-attention states and the sliding-window layers' rows.
    pub fn rewind_state(&self, state: &SeqState) -> Result<RewindState> {
        match (self, state) {
            (Engine::Cpu { .. }, SeqState::Cpu(s)) => Ok(s.rewind_state()),
            (Engine::Cuda(m), SeqState::Cuda(s)) => m.rewind_state(s),
            _ => unreachable!("a state on another engine"),
        }
    }

    /// Whether the attention caches alone can return to `pos` (a sliding
    /// window may have dropped rows `pos` needs).
    pub fn can_truncate(&self, state: &SeqState, pos: usize) -> bool {
        match state {
            SeqState::Cpu(s) => s.can_truncate(pos),
            SeqState::Cuda(s) => s.can_truncate(pos),
        }
    }

    /// Returns to `pos`: attention caches keep `pos` positions (window
    /// layers whose rows are gone take `from`'s), linear layers take
    /// `from`'s states (see [`ModelState::rewind`]).
    pub fn rewind(
        &mut self,
        state: &mut SeqState,
        pos: usize,
        from: Option<&RewindState>,
    ) -> Result<()> {
        match (self, state) {
            (Engine::Cpu { .. }, SeqState::Cpu(s)) => s.rewind(pos, from),
            (Engine::Cuda(m), SeqState::Cuda(s)) => m.rewind(s, pos, from),
            _ => unreachable!("a state on another engine"),
        }
    }

    /// Per layer, the rows its attention cache takes: allocated in VRAM
    /// (`GpuState::row_capacity`) or held in host memory; `None` for a
    /// linear layer.
    pub fn cache_rows(&self, state: &SeqState) -> Vec<Option<usize>> {
        match state {
            SeqState::Cpu(s) => s
                .layers
                .iter()
                .map(|l| match l {
                    LayerState::Full(kv) => Some(kv.held()),
                    LayerState::Mla(m) => Some(m.len()),
                    LayerState::Linear(_) => None,
                })
                .collect(),
            SeqState::Cuda(s) => s.row_capacity(),
        }
    }

    /// The whole state in host memory.
    pub fn host_state<'s>(&self, state: &'s SeqState) -> Result<Cow<'s, ModelState>> {
        match (self, state) {
            (Engine::Cpu { .. }, SeqState::Cpu(s)) => Ok(Cow::Borrowed(s)),
            (Engine::Cuda(m), SeqState::Cuda(s)) => Ok(Cow::Owned(m.download_state(s)?)),
            _ => unreachable!("a state on another engine"),
        }
    }

    /// Replaces `state` (validated by the caller).
    pub fn set_state(&mut self, state: &mut SeqState, new: ModelState) -> Result<()> {
        match (self, state) {
            (Engine::Cpu { .. }, SeqState::Cpu(s)) => {
                *s = new;
                Ok(())
            }
            (Engine::Cuda(m), SeqState::Cuda(s)) => m.upload_state(s, &new),
            _ => unreachable!("a state on another engine"),
        }
    }
}

/// `logits` (`[rows, vocab]`) cut into one vector per segment of `rows`
/// rows each; a single segment's is `logits` itself (no copy on the
/// one-sequence decode path).
fn split_rows(logits: Vec<f32>, rows: &[usize], vocab: usize) -> Vec<Vec<f32>> {
    if rows.len() == 1 {
        return vec![logits];
    }
    let mut at = 0;
    rows.iter()
        .map(|&m| {
            let part = logits[at * vocab..(at + m) * vocab].to_vec();
            at += m;
            part
        })
        .collect()
}
