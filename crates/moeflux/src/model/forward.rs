//! The one layer stack every backend runs. A backend implements
//! [`BlockExecutor`] — one method per block, each reading and writing the
//! backend's own buffers for the batch being evaluated: the residual stream
//! `x`, its normed copy `xn`, and the logits — and [`forward`] drives it
//! through the model: embedding, per layer RMSNorm, the layer's token mixer,
//! RMSNorm and its MLP, then the final norm and the LM head.
//!
//! A batch may hold several sequences ([`Segment`]s): the rows of each are
//! contiguous, the mixers run per sequence on its own state and positions,
//! and everything else (norms, projections, MLPs and the experts of MoE
//! blocks) runs once over all rows, so one pass over a layer's weights and
//! one fetch of each chosen expert serve every sequence of the step.

use std::ops::Range;
use std::time::Instant;

use crate::error::Result;
use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::layer::{Mixer, Mlp};
use crate::model::mla::MlaAttention;
use crate::model::moe::{DenseMlp, MoeBlock};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::trace::Trace;
use crate::model::weights::{LinearRef, VectorRef};
use crate::model::{LogitsMode, Model};

/// One sequence's share of a batch: its rows, the position of its first
/// row, and which of its rows produce logits (`None`: none, e.g. a prefill
/// chunk that is not the prompt's last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub rows: Range<usize>,
    pub start: usize,
    pub logits: Option<LogitsMode>,
}

impl Segment {
    /// The one segment of a single-sequence eval of `n` tokens.
    pub fn single(n: usize, start: usize, mode: LogitsMode) -> Segment {
        Segment {
            rows: 0..n,
            start,
            logits: Some(mode),
        }
    }

    /// The rows of this segment whose logits are computed.
    pub fn logit_rows(&self) -> Range<usize> {
        match self.logits {
            None => self.rows.end..self.rows.end,
            Some(LogitsMode::All) => self.rows.clone(),
            Some(LogitsMode::Last | LogitsMode::Greedy) => self.rows.end - 1..self.rows.end,
        }
    }
}

/// What a forward pass gives back for one segment.
#[derive(Debug, Clone, PartialEq)]
pub enum SegmentOutput {
    /// The logits of its logit rows, `[rows, vocab]` (empty for none).
    Logits(Vec<f32>),
    /// [`LogitsMode::Greedy`]: its last row's most likely token; `None`
    /// when that row's logits are not all finite.
    Token(Option<u32>),
}

impl SegmentOutput {
    /// `logits` as `mode` asks for them (Greedy: reduced to the token).
    pub fn from_logits(logits: Vec<f32>, mode: Option<LogitsMode>) -> SegmentOutput {
        if mode == Some(LogitsMode::Greedy) {
            let finite = logits.iter().all(|x| x.is_finite());
            SegmentOutput::Token(finite.then(|| crate::sample::argmax(&logits) as u32))
        } else {
            SegmentOutput::Logits(logits)
        }
    }
}

/// Every row whose logits a batch computes, in segment order (the order
/// the logits come back in).
pub fn logit_rows(segs: &[Segment]) -> Vec<usize> {
    segs.iter().flat_map(|s| s.logit_rows()).collect()
}

/// A buffer of the executor's batch that can be read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// The residual stream `x`, `[tokens, hidden]`.
    Hidden,
    /// The last RMSNorm's output `xn`, `[tokens, hidden]`.
    Normed,
    /// The logits of the rows the eval asked for, `[rows, vocab]`.
    Logits,
}

/// How one backend evaluates each block on the batch it holds. Mixers and
/// MLPs add their output to `x`; their input is `xn`.
pub trait BlockExecutor {
    /// `x` = the rows of `table` for the batch's tokens.
    fn embed(&mut self, table: &LinearRef, tokens: &[u32]) -> Result<()>;
    /// `xn` = RMSNorm(`x`) scaled by `weight`.
    fn norm(&mut self, weight: VectorRef) -> Result<()>;
    /// Grouped-query attention of `layer`; its KV cache takes the batch.
    fn full_attention(&mut self, layer: usize, a: &FullAttention) -> Result<()>;
    /// GatedDeltaNet of `layer`; its conv and recurrent states advance.
    fn gated_deltanet(&mut self, layer: usize, g: &GatedDeltaNet) -> Result<()>;
    /// Multi-head latent attention of `layer`; its latent cache takes the batch.
    fn mla(&mut self, layer: usize, a: &MlaAttention) -> Result<()>;
    /// A dense SwiGLU MLP.
    fn dense_mlp(&mut self, layer: usize, m: &DenseMlp) -> Result<()>;
    /// A mixture-of-experts block; `next` is the next MoE layer, whose
    /// experts a prefetching backend may start fetching.
    fn moe(&mut self, m: &MoeBlock, next: Option<&MoeBlock>) -> Result<()>;
    /// The final RMSNorm and the LM head of the rows the eval asked for.
    fn logits(&mut self, final_norm: VectorRef, lm_head: &LinearRef) -> Result<()>;
    /// A host copy of one of the batch's buffers (tracing).
    fn read(&mut self, what: Activation) -> Result<Vec<f32>>;
    /// Where block times accumulate.
    fn times(&mut self) -> &mut PhaseTimes;
}

/// Evaluates the batch `ex` holds through every layer of `model`; the
/// logits land in the executor. With `trace`, every block's output is
/// recorded (the mixers' and MLPs' as what they added to `x`).
pub fn forward(
    model: &Model,
    ex: &mut impl BlockExecutor,
    tokens: &[u32],
    mut trace: Option<&mut Trace>,
) -> Result<()> {
    let mut clock = Instant::now();
    ex.embed(&model.embed, tokens)?;
    lap(&mut clock, &mut ex.times().embed_norm);
    let mut x = match trace.as_deref_mut() {
        Some(t) => Some(t.record_hidden(ex, None, "embed")?),
        None => None,
    };
    for (i, layer) in model.layers.iter().enumerate() {
        ex.norm(layer.input_norm)?;
        lap(&mut clock, &mut ex.times().embed_norm);
        if let Some(t) = trace.as_deref_mut() {
            t.record(ex, Some(i), "attn_norm", Activation::Normed)?;
        }
        let mixer = match &layer.mixer {
            Mixer::Full(a) => {
                ex.full_attention(i, a)?;
                "full_attention"
            }
            Mixer::Linear(g) => {
                ex.gated_deltanet(i, g)?;
                "gated_deltanet"
            }
            Mixer::Mla(a) => {
                ex.mla(i, a)?;
                "mla"
            }
        };
        lap(&mut clock, &mut ex.times().attention);
        if let (Some(t), Some(before)) = (trace.as_deref_mut(), x.as_mut()) {
            t.record_delta(ex, i, mixer, before)?;
        }
        ex.norm(layer.post_norm)?;
        lap(&mut clock, &mut ex.times().embed_norm);
        if let Some(t) = trace.as_deref_mut() {
            t.record(ex, Some(i), "mlp_norm", Activation::Normed)?;
        }
        let mlp = match &layer.mlp {
            Mlp::Moe(m) => {
                // Times its own phases.
                ex.moe(m, model.next_moe(i))?;
                clock = Instant::now();
                "moe"
            }
            Mlp::Dense(d) => {
                ex.dense_mlp(i, d)?;
                lap(&mut clock, &mut ex.times().shared_mlp);
                "dense_mlp"
            }
        };
        if let (Some(t), Some(before)) = (trace.as_deref_mut(), x.as_mut()) {
            t.record_delta(ex, i, mlp, before)?;
        }
    }
    ex.logits(model.final_norm, &model.lm_head)?;
    lap(&mut clock, &mut ex.times().lm_head);
    if let Some(t) = trace {
        t.record(ex, None, "logits", Activation::Logits)?;
    }
    Ok(())
}
