//! Where a session's forward pass runs, and its sequence state: on the CPU
//! (state in host memory) or on a GPU (state in VRAM, copied to the host
//! only for checkpoints and snapshots, in the same layout).

use std::borrow::Cow;

use crate::backend::cpu::exec::CpuExecutor;
use crate::backend::cpu::experts::ExpertRun;
use crate::backend::cuda::model::CudaModel;
use crate::backend::prefetch::PrefetchStats;
use crate::error::Result;
use crate::io::{ExpertBuf, ExpertStore};
use crate::model::forward;
use crate::model::state::{LinearState, ModelState};
use crate::model::timing::PhaseTimes;
use crate::model::trace::Trace;
use crate::model::{LogitsMode, Model};

pub(crate) enum Engine {
    Cpu {
        state: ModelState,
        /// Reusable expert read buffers.
        bufs: Vec<ExpertBuf>,
    },
    Cuda(Box<CudaModel>),
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
    /// Evaluates `tokens` at positions `start..`; with `trace`, records
    /// every block's output.
    pub fn forward(
        &mut self,
        cx: ForwardCtx<'_>,
        tokens: &[u32],
        start: usize,
        mode: LogitsMode,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<f32>> {
        match self {
            Engine::Cpu { state, bufs } => {
                let run = ExpertRun {
                    store: cx.store,
                    bufs,
                    k: cx.k,
                    prefetch: cx.prefetch,
                    pending: None,
                    stats: cx.prefetch_stats,
                };
                let (model, n) = (cx.model, tokens.len());
                cx.pool.install(|| {
                    let mut ex = CpuExecutor::new(model, state, run, cx.times, start, n, mode);
                    forward::forward(model, &mut ex, tokens, trace)?;
                    Ok(ex.into_logits())
                })
            }
            Engine::Cuda(m) => m.forward(
                cx.model, cx.store, cx.pool, cx.k, tokens, start, mode, cx.times, trace,
            ),
        }
    }

    /// Empties the state (position 0).
    pub fn clear(&mut self) -> Result<()> {
        match self {
            Engine::Cpu { state, .. } => {
                state.clear();
                Ok(())
            }
            Engine::Cuda(m) => m.clear(),
        }
    }

    /// Copies of the linear-attention states, in layer order.
    pub fn linear_states(&self) -> Result<Vec<LinearState>> {
        match self {
            Engine::Cpu { state, .. } => Ok(state.linear_states()),
            Engine::Cuda(m) => m.linear_states(),
        }
    }

    /// Keeps `pos` positions of the attention layers and installs `linear`.
    pub fn rewind(&mut self, pos: usize, linear: &[LinearState]) -> Result<()> {
        match self {
            Engine::Cpu { state, .. } => {
                state.rewind(pos, linear);
                Ok(())
            }
            Engine::Cuda(m) => m.rewind(pos, linear),
        }
    }

    /// The whole state in host memory.
    pub fn host_state(&self) -> Result<Cow<'_, ModelState>> {
        match self {
            Engine::Cpu { state, .. } => Ok(Cow::Borrowed(state)),
            Engine::Cuda(m) => Ok(Cow::Owned(m.download_state()?)),
        }
    }

    /// Replaces the state (validated by the caller).
    pub fn set_state(&mut self, new: ModelState) -> Result<()> {
        match self {
            Engine::Cpu { state, .. } => {
                *state = new;
                Ok(())
            }
            Engine::Cuda(m) => m.upload_state(&new),
        }
    }
}
