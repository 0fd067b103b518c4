//! The DeepSeek-V3 family (`deepseek_v3`, `kimi_k2`; Cogito-V2 671B,
//! DeepSeek-V3/R1, Kimi-K2): MLA in every layer, then a dense SwiGLU MLP in
//! the first `first_k_dense_replace` layers and a `noaux_tc` MoE block (with
//! ungated shared experts) in the others. The MoE blocks are the same
//! expert-major, streaming [`MoeBlock`] the Qwen models use.

use std::path::Path;

use crate::config::{MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::format::Manifest;
use crate::model::experts::ExpertRun;
use crate::model::mla::MlaAttention;
use crate::model::moe::{DenseMlp, ExpertLayout, MoeBlock};
use crate::model::qwen3_hybrid::{LogitsMode, Mlp};
use crate::model::schema::layer_prefix;
use crate::model::stack::{Stack, StackLayer};
use crate::model::state::{LayerState, MlaCache, ModelState};
use crate::model::timing::PhaseTimes;
use crate::model::weights::{DenseStore, LinearRef};
use crate::model::yarn::{self, MlaRope};

pub struct DsLayer {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub attn: MlaAttention,
    pub mlp: Mlp,
}

impl StackLayer for DsLayer {
    fn frame(&self) -> (&[f32], &[f32], &Mlp) {
        (&self.input_norm, &self.post_norm, &self.mlp)
    }
}

pub struct DeepseekV3 {
    pub config: ModelConfig,
    pub dense: DenseStore,
    pub embed: LinearRef,
    pub lm_head: LinearRef,
    pub final_norm: Vec<f32>,
    pub layers: Vec<DsLayer>,
    pub rope: MlaRope,
    /// Softmax scale with YaRN's `mscale_all_dim` folded in.
    pub scale: f32,
}

impl DeepseekV3 {
    pub fn load(dir: &Path, manifest: &Manifest, config: ModelConfig) -> Result<Self> {
        let manifest_path = dir.join(crate::format::MANIFEST_FILE);
        let mla = config.mla.ok_or_else(|| {
            Error::format(&manifest_path, "DeepSeek-V3 config without an MLA shape")
        })?;
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
            layers.push(DsLayer {
                input_norm: dense.floats(&format!("{p}input_layernorm.weight"), &[h])?,
                post_norm: dense.floats(&format!("{p}post_attention_layernorm.weight"), &[h])?,
                attn: MlaAttention::load(&dense, &config, &p)?,
                mlp,
            });
        }
        Ok(DeepseekV3 {
            final_norm: dense.floats("model.norm.weight", &[h])?,
            rope: MlaRope::new(&config.rope),
            scale: yarn::softmax_scale(&mla, &config.rope),
            config,
            dense,
            embed,
            lm_head,
            layers,
        })
    }

    pub fn new_state(&self) -> ModelState {
        let m = self.config.mla.expect("checked at load");
        ModelState {
            layers: self
                .layers
                .iter()
                .map(|_| LayerState::Mla(MlaCache::new(m.kv_lora_rank, m.qk_rope_head_dim)))
                .collect(),
        }
    }

    /// Evaluates `tokens` at positions `start..` over the whole batch, layer
    /// by layer, and returns logits `[rows, vocab]` for the last token or all.
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
            let LayerState::Mla(cache) = &mut state.layers[i] else {
                return Err(Error::Invalid(format!(
                    "layer {i}: state is not an MLA cache"
                )));
            };
            self.layers[i]
                .attn
                .forward(d, c, &self.rope, self.scale, xn, n, start, cache, r)
        })
    }
}
