//! The Qwen3.5-MoE / Qwen3-Next hybrid: GatedDeltaNet and gated full
//! attention layers, each followed by a sparse MoE block (or a dense MLP).

use std::path::Path;

use crate::backend::cpu::ops::{self, RopeTable};
use crate::backend::cpu::qmatmul::{dequantize_row, matmul};
use crate::config::{LayerKind, MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::format::Manifest;
use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::experts::ExpertRun;
use crate::model::moe::{DenseMlp, ExpertLayout, MoeBlock};
use crate::model::schema::layer_prefix;
use crate::model::state::{KvCache, LayerState, ModelState};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::weights::{DenseStore, LinearRef};

pub enum Mixer {
    Full(FullAttention),
    Linear(GatedDeltaNet),
}

// One value per layer: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Mlp {
    Moe(MoeBlock),
    Dense(DenseMlp),
}

pub struct Layer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub mlp: Mlp,
}

pub struct QwenHybrid {
    pub config: ModelConfig,
    pub dense: DenseStore,
    pub embed: LinearRef,
    pub lm_head: LinearRef,
    pub final_norm: Vec<f32>,
    pub layers: Vec<Layer>,
    pub rope: RopeTable,
}

/// Which positions of an eval produce logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    Last,
    All,
}

impl QwenHybrid {
    pub fn load(dir: &Path, manifest: &Manifest, config: ModelConfig) -> Result<Self> {
        let manifest_path = dir.join(crate::format::MANIFEST_FILE);
        let dense = DenseStore::open(dir, manifest)?;
        dense.validate_schema(&config)?;
        let (h, v) = (config.hidden_size, config.vocab_size);
        let embed = dense.linear("model.embed_tokens", v, h)?;
        let lm_head = if config.tie_word_embeddings {
            embed
        } else {
            dense.linear("lm_head", v, h)?
        };
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = layer_prefix(i);
            let mixer = match config.layer_kinds[i] {
                LayerKind::FullAttention => Mixer::Full(FullAttention::load(&dense, &config, &p)?),
                LayerKind::LinearAttention => {
                    Mixer::Linear(GatedDeltaNet::load(&dense, &config, &p)?)
                }
                LayerKind::Mla => {
                    return Err(Error::format(
                        &manifest_path,
                        format!("layer {i} is MLA, which the Qwen layer stack does not run"),
                    ))
                }
            };
            let mlp = match config.mlp_kinds[i] {
                MlpKind::Moe => {
                    let el = manifest.expert_layer(i).ok_or_else(|| {
                        Error::format(
                            &manifest_path,
                            format!("no routed experts listed for MoE layer {i}"),
                        )
                    })?;
                    let layout = ExpertLayout::from_manifest(el, &config, &manifest_path)?;
                    Mlp::Moe(MoeBlock::load(&dense, &config, &p, i, layout)?)
                }
                MlpKind::Dense => Mlp::Dense(DenseMlp::load(&dense, &config, &p)?),
            };
            layers.push(Layer {
                input_norm: dense.floats(&format!("{p}input_layernorm.weight"), &[h])?,
                post_norm: dense.floats(&format!("{p}post_attention_layernorm.weight"), &[h])?,
                mixer,
                mlp,
            });
        }
        Ok(QwenHybrid {
            final_norm: dense.floats("model.norm.weight", &[h])?,
            rope: RopeTable::new(config.rope.rotary_dim, config.rope.theta),
            config,
            dense,
            embed,
            lm_head,
            layers,
        })
    }

    /// The first MoE block after layer `i`.
    fn next_moe(&self, i: usize) -> Option<&MoeBlock> {
        self.layers[i + 1..].iter().find_map(|l| match &l.mlp {
            Mlp::Moe(m) => Some(m),
            Mlp::Dense(_) => None,
        })
    }

    pub fn new_state(&self) -> ModelState {
        let kv_row = self.config.num_kv_heads * self.config.head_dim;
        ModelState {
            layers: self
                .layers
                .iter()
                .map(|l| match l.mixer {
                    Mixer::Full(_) => LayerState::Full(KvCache::new(kv_row)),
                    Mixer::Linear(_) => LayerState::Linear(GatedDeltaNet::new_state(&self.config)),
                })
                .collect(),
        }
    }

    /// Evaluates `tokens` at positions `start..`, layer by layer over the
    /// whole batch, and returns logits `[rows, vocab]` for the last token or
    /// for every token.
    pub fn forward(
        &self,
        run: &mut ExpertRun<'_>,
        state: &mut ModelState,
        tokens: &[u32],
        start: usize,
        mode: LogitsMode,
        times: &mut PhaseTimes,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        let mut clock = std::time::Instant::now();
        let (n, h) = (tokens.len(), c.hidden_size);
        let d = &self.dense;
        let mut x = embed_tokens(d, &self.embed, tokens, h);
        let mut xn = vec![0.0f32; n * h];
        let mut r = vec![0.0f32; n * h];
        for (i, (layer, ls)) in self.layers.iter().zip(state.layers.iter_mut()).enumerate() {
            ops::rms_norm_rows(&x, &layer.input_norm, c.rms_norm_eps, &mut xn);
            lap(&mut clock, &mut times.embed_norm);
            match (&layer.mixer, ls) {
                (Mixer::Full(a), LayerState::Full(kv)) => {
                    a.forward(d, c, &self.rope, &xn, n, start, kv, &mut r)
                }
                (Mixer::Linear(g), LayerState::Linear(s)) => g.forward(d, c, &xn, n, s, &mut r),
                _ => unreachable!("state built from the same layer list"),
            }
            ops::add_inplace(&mut x, &r);
            lap(&mut clock, &mut times.attention);
            let half = MlpHalf {
                mlp: &layer.mlp,
                post_norm: &layer.post_norm,
                next: self.next_moe(i),
            };
            half.forward(d, c, run, n, &mut x, &mut xn, &mut r, &mut clock, times)?;
        }
        let logits = final_logits(d, c, &self.final_norm, &self.lm_head, &x, n, mode);
        lap(&mut clock, &mut times.lm_head);
        Ok(logits)
    }
}

/// The MLP half of a layer, the same in every layer stack: post-attention
/// RMSNorm, the MLP (dense or mixture of experts), its output added to `x`.
pub(crate) struct MlpHalf<'a> {
    pub mlp: &'a Mlp,
    pub post_norm: &'a [f32],
    /// The next MoE block (its router drives speculative prefetch).
    pub next: Option<&'a MoeBlock>,
}

impl MlpHalf<'_> {
    /// `xn` and `r` are scratch of `x`'s size; `clock` is the caller's
    /// phase clock.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
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
pub(crate) fn embed_tokens(
    d: &DenseStore,
    embed: &LinearRef,
    tokens: &[u32],
    h: usize,
) -> Vec<f32> {
    let embed = d.view(embed);
    let mut x = vec![0.0f32; tokens.len() * h];
    for (row, &tok) in x.chunks_exact_mut(h).zip(tokens) {
        dequantize_row(&embed, tok as usize, row);
    }
    x
}

/// Final RMSNorm and LM head over the rows of `x` (`[n, hidden]`) that
/// `mode` asks for: logits `[rows, vocab]`.
pub(crate) fn final_logits(
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
