//! The CPU's [`BlockExecutor`]: one batch's residual stream, normed copy and
//! block-output scratch in host memory, the state of each sequence in the
//! batch, and the expert streaming of the MoE blocks.

use crate::backend::cpu::experts::ExpertRun;
use crate::backend::cpu::qmatmul::{dequantize_row, matmul};
use crate::backend::cpu::{attention, deltanet, mla, moe, ops, SeqRows};
use crate::error::{Error, Result};
use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::forward::{logit_rows, Activation, BlockExecutor, Segment};
use crate::model::mla::MlaAttention;
use crate::model::moe::{DenseMlp, MoeBlock};
use crate::model::rope::softmax_scale;
use crate::model::state::{LayerState, ModelState};
use crate::model::timing::PhaseTimes;
use crate::model::weights::{LinearRef, VectorRef};
use crate::model::Model;

/// One eval on the CPU of `n` tokens: the rows of one or more sequences,
/// each with its state.
pub struct CpuExecutor<'a> {
    model: &'a Model,
    /// Per segment, the state of its sequence.
    states: Vec<&'a mut ModelState>,
    segs: Vec<Segment>,
    run: ExpertRun<'a>,
    times: &'a mut PhaseTimes,
    n: usize,
    /// Residual stream, normed copy and a block's output, `[n, hidden]` each.
    x: Vec<f32>,
    xn: Vec<f32>,
    r: Vec<f32>,
    logits: Vec<f32>,
}

impl<'a> CpuExecutor<'a> {
    /// `segs` cover the batch's rows in order; `states[i]` is segment `i`'s.
    pub fn new(
        model: &'a Model,
        states: Vec<&'a mut ModelState>,
        segs: Vec<Segment>,
        run: ExpertRun<'a>,
        times: &'a mut PhaseTimes,
    ) -> Self {
        let h = model.config.hidden_size;
        let n = segs.last().map_or(0, |s| s.rows.end);
        debug_assert_eq!(states.len(), segs.len());
        CpuExecutor {
            model,
            states,
            segs,
            run,
            times,
            n,
            x: vec![0.0; n * h],
            xn: vec![0.0; n * h],
            r: vec![0.0; n * h],
            logits: Vec::new(),
        }
    }

    /// The logits `[rows, vocab]` of the last [`BlockExecutor::logits`].
    pub fn into_logits(self) -> Vec<f32> {
        self.logits
    }

    fn state_error(layer: usize, what: &str) -> Error {
        Error::Invalid(format!("layer {layer}: state is not {what}"))
    }

    /// `x += r` (the block's output joins the residual stream).
    fn add_output(&mut self) {
        ops::add_inplace(&mut self.x, &self.r);
    }
}

/// Per segment, its rows and its sequence's state of `layer`, taken by
/// `pick`.
fn layer_states<'s, S>(
    states: &'s mut [&mut ModelState],
    segs: &[Segment],
    layer: usize,
    what: &str,
    pick: impl Fn(&mut LayerState) -> Option<&mut S>,
) -> Result<Vec<SeqRows<'s, S>>> {
    states
        .iter_mut()
        .zip(segs)
        .map(|(st, seg)| {
            let state = st
                .layers
                .get_mut(layer)
                .and_then(&pick)
                .ok_or_else(|| CpuExecutor::state_error(layer, what))?;
            Ok(SeqRows {
                rows: seg.rows.clone(),
                start: seg.start,
                state,
            })
        })
        .collect()
}

impl BlockExecutor for CpuExecutor<'_> {
    fn embed(&mut self, table: &LinearRef, tokens: &[u32]) -> Result<()> {
        let h = self.model.config.hidden_size;
        let embed = self.model.weights.view(table);
        for (row, &tok) in self.x.chunks_exact_mut(h).zip(tokens) {
            dequantize_row(&embed, tok as usize, row);
        }
        Ok(())
    }

    fn norm(&mut self, weight: VectorRef) -> Result<()> {
        let w = self.model.weights.vector(weight);
        ops::rms_norm_rows(&self.x, w, self.model.config.rms_norm_eps, &mut self.xn);
        Ok(())
    }

    fn full_attention(&mut self, layer: usize, a: &FullAttention) -> Result<()> {
        let (m, n) = (self.model, self.n);
        let mut seqs = layer_states(
            &mut self.states,
            &self.segs,
            layer,
            "a KV cache",
            |l| match l {
                LayerState::Full(kv) => Some(kv),
                _ => None,
            },
        )?;
        attention::forward(
            a,
            &m.weights,
            &m.config,
            &m.rope,
            &self.xn,
            n,
            &mut seqs,
            &mut self.r,
        );
        self.add_output();
        Ok(())
    }

    fn gated_deltanet(&mut self, layer: usize, g: &GatedDeltaNet) -> Result<()> {
        let (m, n) = (self.model, self.n);
        let mut seqs = layer_states(
            &mut self.states,
            &self.segs,
            layer,
            "a GatedDeltaNet state",
            |l| match l {
                LayerState::Linear(s) => Some(s),
                _ => None,
            },
        )?;
        deltanet::forward(
            g,
            &m.weights,
            &m.config,
            &self.xn,
            n,
            &mut seqs,
            &mut self.r,
        );
        self.add_output();
        Ok(())
    }

    fn mla(&mut self, layer: usize, a: &MlaAttention) -> Result<()> {
        let m = self.model;
        let h = m.config.hidden_size;
        let mla_dims = crate::model::mla::mla_of(&m.config)?;
        let scale = softmax_scale(&mla_dims, &m.config.rope);
        let seqs = layer_states(
            &mut self.states,
            &self.segs,
            layer,
            "an MLA cache",
            |l| match l {
                LayerState::Mla(c) => Some(c),
                _ => None,
            },
        )?;
        // Per sequence: which of MLA's two forms runs depends on its own
        // chunk and context, as when it is evaluated alone.
        for s in seqs {
            let rows = s.rows.start * h..s.rows.end * h;
            mla::forward(
                a,
                &m.weights,
                &m.config,
                &m.rope,
                scale,
                &self.xn[rows.clone()],
                s.rows.len(),
                s.start,
                s.state,
                &mut self.r[rows],
            )?;
        }
        self.add_output();
        Ok(())
    }

    fn dense_mlp(&mut self, _layer: usize, d: &DenseMlp) -> Result<()> {
        moe::dense_forward(d, &self.model.weights, &self.xn, self.n, &mut self.r);
        self.add_output();
        Ok(())
    }

    fn moe(&mut self, b: &MoeBlock, next: Option<&MoeBlock>) -> Result<()> {
        let m = self.model;
        moe::forward(
            b,
            &m.weights,
            &m.config,
            &mut self.run,
            next,
            &self.xn,
            self.n,
            &mut self.r,
            self.times,
        )?;
        let clock = std::time::Instant::now();
        self.add_output();
        self.times.embed_norm += clock.elapsed();
        Ok(())
    }

    fn logits(&mut self, final_norm: VectorRef, lm_head: &LinearRef) -> Result<()> {
        let (c, w) = (&self.model.config, &self.model.weights);
        let h = c.hidden_size;
        let rows = logit_rows(&self.segs);
        let m = rows.len();
        let mut normed = vec![0.0f32; m * h];
        let norm = w.vector(final_norm);
        for (dst, &row) in normed.chunks_exact_mut(h).zip(&rows) {
            ops::rms_norm_rows(&self.x[row * h..(row + 1) * h], norm, c.rms_norm_eps, dst);
        }
        self.logits = vec![0.0f32; m * c.vocab_size];
        if m > 0 {
            matmul(&w.view(lm_head), &normed, m, &mut self.logits);
        }
        Ok(())
    }

    fn read(&mut self, what: Activation) -> Result<Vec<f32>> {
        Ok(match what {
            Activation::Hidden => self.x.clone(),
            Activation::Normed => self.xn.clone(),
            Activation::Logits => self.logits.clone(),
        })
    }

    fn times(&mut self) -> &mut PhaseTimes {
        self.times
    }
}
