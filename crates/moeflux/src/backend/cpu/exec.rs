//! The CPU's [`BlockExecutor`]: one batch's residual stream, normed copy and
//! block-output scratch in host memory, the sequence state, and the expert
//! streaming of the MoE blocks.

use crate::backend::cpu::experts::ExpertRun;
use crate::backend::cpu::qmatmul::{dequantize_row, matmul};
use crate::backend::cpu::{attention, deltanet, mla, moe, ops};
use crate::error::{Error, Result};
use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::forward::{Activation, BlockExecutor};
use crate::model::mla::MlaAttention;
use crate::model::moe::{DenseMlp, MoeBlock};
use crate::model::rope::softmax_scale;
use crate::model::state::{LayerState, ModelState};
use crate::model::timing::PhaseTimes;
use crate::model::weights::{LinearRef, VectorRef};
use crate::model::{LogitsMode, Model};

/// One eval of `n` tokens at positions `start..` on the CPU.
pub struct CpuExecutor<'a> {
    model: &'a Model,
    state: &'a mut ModelState,
    run: ExpertRun<'a>,
    times: &'a mut PhaseTimes,
    start: usize,
    n: usize,
    mode: LogitsMode,
    /// Residual stream, normed copy and a block's output, `[n, hidden]` each.
    x: Vec<f32>,
    xn: Vec<f32>,
    r: Vec<f32>,
    logits: Vec<f32>,
}

impl<'a> CpuExecutor<'a> {
    pub fn new(
        model: &'a Model,
        state: &'a mut ModelState,
        run: ExpertRun<'a>,
        times: &'a mut PhaseTimes,
        start: usize,
        n: usize,
        mode: LogitsMode,
    ) -> Self {
        let h = model.config.hidden_size;
        CpuExecutor {
            model,
            state,
            run,
            times,
            start,
            n,
            mode,
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
        let m = self.model;
        let Some(LayerState::Full(kv)) = self.state.layers.get_mut(layer) else {
            return Err(Self::state_error(layer, "a KV cache"));
        };
        attention::forward(
            a,
            &m.weights,
            &m.config,
            &m.rope,
            &self.xn,
            self.n,
            self.start,
            kv,
            &mut self.r,
        );
        self.add_output();
        Ok(())
    }

    fn gated_deltanet(&mut self, layer: usize, g: &GatedDeltaNet) -> Result<()> {
        let m = self.model;
        let Some(LayerState::Linear(s)) = self.state.layers.get_mut(layer) else {
            return Err(Self::state_error(layer, "a GatedDeltaNet state"));
        };
        deltanet::forward(g, &m.weights, &m.config, &self.xn, self.n, s, &mut self.r);
        self.add_output();
        Ok(())
    }

    fn mla(&mut self, layer: usize, a: &MlaAttention) -> Result<()> {
        let m = self.model;
        let Some(LayerState::Mla(cache)) = self.state.layers.get_mut(layer) else {
            return Err(Self::state_error(layer, "an MLA cache"));
        };
        let mla_dims = crate::model::mla::mla_of(&m.config)?;
        let scale = softmax_scale(&mla_dims, &m.config.rope);
        mla::forward(
            a,
            &m.weights,
            &m.config,
            &m.rope,
            scale,
            &self.xn,
            self.n,
            self.start,
            cache,
            &mut self.r,
        )?;
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
        let rows = match self.mode {
            LogitsMode::All => 0..self.n,
            LogitsMode::Last => self.n - 1..self.n,
        };
        let m = rows.len();
        let mut normed = vec![0.0f32; m * h];
        ops::rms_norm_rows(
            &self.x[rows.start * h..rows.end * h],
            w.vector(final_norm),
            c.rms_norm_eps,
            &mut normed,
        );
        self.logits = vec![0.0f32; m * c.vocab_size];
        matmul(&w.view(lm_head), &normed, m, &mut self.logits);
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
