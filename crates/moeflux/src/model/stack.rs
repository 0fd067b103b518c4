//! What every CPU layer stack shares around its token mixer: the embedding
//! head, per layer an input RMSNorm, the mixer's output added to the
//! residual stream, the MLP half (post-norm, dense or MoE MLP, residual),
//! and the final norm and LM head. The families differ only in the mixer.

use crate::backend::cpu::ops;
use crate::backend::cpu::qmatmul::{dequantize_row, matmul};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::experts::ExpertRun;
use crate::model::moe::MoeBlock;
use crate::model::qwen3_hybrid::{LogitsMode, Mlp};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::weights::{DenseStore, LinearRef};

/// A family's weights outside its layers.
pub(crate) struct Stack<'a> {
    pub dense: &'a DenseStore,
    pub config: &'a ModelConfig,
    pub embed: &'a LinearRef,
    pub final_norm: &'a [f32],
    pub lm_head: &'a LinearRef,
}

/// A layer's weights outside its mixer.
pub(crate) trait StackLayer {
    /// Input RMSNorm weight, post-attention RMSNorm weight, MLP.
    fn frame(&self) -> (&[f32], &[f32], &Mlp);
}

impl Stack<'_> {
    /// Evaluates `tokens` through `layers` and returns logits `[rows,
    /// vocab]` for the last token or all. `mixer(i, xn, n, r)` writes layer
    /// `i`'s token-mixer output for the normed input `xn` into `r`.
    pub fn forward(
        &self,
        layers: &[impl StackLayer],
        tokens: &[u32],
        mode: LogitsMode,
        run: &mut ExpertRun<'_>,
        times: &mut PhaseTimes,
        mut mixer: impl FnMut(usize, &[f32], usize, &mut [f32]) -> Result<()>,
    ) -> Result<Vec<f32>> {
        let (d, c) = (self.dense, self.config);
        let mut clock = std::time::Instant::now();
        let (n, h) = (tokens.len(), c.hidden_size);
        let mut x = embed_tokens(d, self.embed, tokens, h);
        let mut xn = vec![0.0f32; n * h];
        let mut r = vec![0.0f32; n * h];
        for (i, layer) in layers.iter().enumerate() {
            let (input_norm, post_norm, mlp) = layer.frame();
            ops::rms_norm_rows(&x, input_norm, c.rms_norm_eps, &mut xn);
            lap(&mut clock, &mut times.embed_norm);
            mixer(i, &xn, n, &mut r)?;
            ops::add_inplace(&mut x, &r);
            lap(&mut clock, &mut times.attention);
            let half = MlpHalf {
                mlp,
                post_norm,
                next: layers[i + 1..].iter().find_map(|l| match l.frame().2 {
                    Mlp::Moe(m) => Some(m),
                    Mlp::Dense(_) => None,
                }),
            };
            half.forward(d, c, run, n, &mut x, &mut xn, &mut r, &mut clock, times)?;
        }
        let logits = final_logits(d, c, self.final_norm, self.lm_head, &x, n, mode);
        lap(&mut clock, &mut times.lm_head);
        Ok(logits)
    }
}

/// The MLP half of a layer, the same in every layer stack: post-attention
/// RMSNorm, the MLP (dense or mixture of experts), its output added to `x`.
struct MlpHalf<'a> {
    mlp: &'a Mlp,
    post_norm: &'a [f32],
    /// The next MoE block (its router drives speculative prefetch).
    next: Option<&'a MoeBlock>,
}

impl MlpHalf<'_> {
    /// `xn` and `r` are scratch of `x`'s size; `clock` is the caller's
    /// phase clock.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        d: &DenseStore,
        c: &ModelConfig,
        run: &mut ExpertRun<'_>,
        n: usize,
        x: &mut [f32],
        xn: &mut [f32],
        r: &mut [f32],
        clock: &mut std::time::Instant,
        times: &mut PhaseTimes,
    ) -> Result<()> {
        ops::rms_norm_rows(x, self.post_norm, c.rms_norm_eps, xn);
        lap(clock, &mut times.embed_norm);
        match self.mlp {
            Mlp::Moe(m) => {
                // Times its own phases.
                m.forward(d, c, run, self.next, xn, n, r, times)?;
                *clock = std::time::Instant::now();
            }
            Mlp::Dense(m) => {
                m.forward(d, xn, n, r);
                lap(clock, &mut times.shared_mlp);
            }
        }
        ops::add_inplace(x, r);
        lap(clock, &mut times.embed_norm);
        Ok(())
    }
}

/// The embedding rows of `tokens`, `[tokens, h]` (the head of every layer
/// stack).
fn embed_tokens(d: &DenseStore, embed: &LinearRef, tokens: &[u32], h: usize) -> Vec<f32> {
    let embed = d.view(embed);
    let mut x = vec![0.0f32; tokens.len() * h];
    for (row, &tok) in x.chunks_exact_mut(h).zip(tokens) {
        dequantize_row(&embed, tok as usize, row);
    }
    x
}

/// Final RMSNorm and LM head over the rows of `x` (`[n, hidden]`) that
/// `mode` asks for: logits `[rows, vocab]`.
fn final_logits(
    d: &DenseStore,
    c: &ModelConfig,
    final_norm: &[f32],
    lm_head: &LinearRef,
    x: &[f32],
    n: usize,
    mode: LogitsMode,
) -> Vec<f32> {
    let h = c.hidden_size;
    let rows = match mode {
        LogitsMode::All => 0..n,
        LogitsMode::Last => n - 1..n,
    };
    let m = rows.len();
    let mut normed = vec![0.0f32; m * h];
    ops::rms_norm_rows(
        &x[rows.start * h..rows.end * h],
        final_norm,
        c.rms_norm_eps,
        &mut normed,
    );
    let mut logits = vec![0.0f32; m * c.vocab_size];
    matmul(&d.view(lm_head), &normed, m, &mut logits);
    logits
}
