//! The Qwen3.5-MoE / Qwen3-Next hybrid: GatedDeltaNet and gated full
//! attention layers, each followed by a sparse MoE block (or a dense MLP).

use std::path::Path;

use crate::backend::cpu::ops::RopeTable;
use crate::config::{LayerKind, MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::format::Manifest;
use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::experts::ExpertRun;
use crate::model::moe::{DenseMlp, ExpertLayout, MoeBlock};
use crate::model::schema::layer_prefix;
use crate::model::stack::{Stack, StackLayer};
use crate::model::state::{KvCache, LayerState, ModelState};
use crate::model::timing::PhaseTimes;
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

impl StackLayer for Layer {
    fn frame(&self) -> (&[f32], &[f32], &Mlp) {
        (&self.input_norm, &self.post_norm, &self.mlp)
    }
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
        let (d, c) = (&self.dense, &self.config);
        let stack = Stack {
            dense: d,
            config: c,
            embed: &self.embed,
            final_norm: &self.final_norm,
            lm_head: &self.lm_head,
        };
        stack.forward(&self.layers, tokens, mode, run, times, |i, xn, n, r| {
            match (&self.layers[i].mixer, &mut state.layers[i]) {
                (Mixer::Full(a), LayerState::Full(kv)) => {
                    a.forward(d, c, &self.rope, xn, n, start, kv, r)
                }
                (Mixer::Linear(g), LayerState::Linear(s)) => g.forward(d, c, xn, n, s, r),
                _ => unreachable!("state built from the same layer list"),
            }
            Ok(())
        })
    }
}
