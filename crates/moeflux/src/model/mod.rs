//! What a model is, independent of where it runs: the families' blocks as
//! weight descriptors (`attention`, `deltanet`, `mla`, `moe`), one layer type
//! (`layer`), one loader ([`Model::load`]), the rotary tables (`rope`), the
//! sequence state's host layout (`state`), the tensors each architecture
//! needs (`schema`), and the one layer stack every backend runs
//! (`forward`: the [`forward::BlockExecutor`] trait and its driver).

pub mod attention;
pub mod deltanet;
pub mod forward;
pub mod layer;
pub mod mla;
pub mod moe;
pub mod rope;
pub mod schema;
pub mod state;
pub mod timing;
pub mod trace;
pub mod weights;

use std::path::Path;

use crate::config::{Architecture, LayerKind, MlpKind, ModelConfig};
use crate::error::{Error, Result};
use crate::format::Manifest;
use attention::FullAttention;
use deltanet::{DeltaProjections, GatedDeltaNet};
use layer::{Layer, Mixer, Mlp};
use mla::MlaAttention;
use moe::{DenseMlp, ExpertLayout, MoeBlock};
use rope::Rope;
use schema::layer_prefix;
use state::{KvCache, LayerState, MlaCache, ModelState};
use weights::{DenseStore, LinearRef, VectorRef, Weights, WeightsLoader};

/// Which positions of an eval produce logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    Last,
    All,
    /// The last position's most likely token only (the first of equal
    /// largest logits: what greedy sampling picks), chosen where the logits
    /// are computed: on the GPU only the token id is copied back.
    Greedy,
}

/// A loaded model of any supported family.
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
    pub embed: LinearRef,
    pub lm_head: LinearRef,
    pub final_norm: VectorRef,
    pub layers: Vec<Layer>,
    pub rope: Rope,
}

impl Model {
    /// Loads the model in `dir` (its dense weights checked against the
    /// schema, its expert layout against the manifest).
    pub fn load(dir: &Path, manifest: &Manifest, config: ModelConfig) -> Result<Self> {
        let manifest_path = dir.join(crate::format::MANIFEST_FILE);
        manifest.check(&manifest_path, &config)?;
        // Every family is a stack of the one layer type; what a family needs
        // beyond its config's layer and MLP kinds is said here.
        match config.arch {
            Architecture::Qwen3_5Moe
            | Architecture::Qwen3Next
            | Architecture::Qwen3Moe
            | Architecture::Glm4Moe
            | Architecture::GptOss => {
                if config.layer_kinds.contains(&LayerKind::Mla) {
                    return Err(Error::format(
                        &manifest_path,
                        format!("{} has no MLA layers", config.arch.model_type()),
                    ));
                }
            }
            Architecture::DeepseekV3 | Architecture::KimiK2 | Architecture::KimiK25 => {
                mla::mla_of(&config)?;
            }
        }
        let dense = DenseStore::open(dir, manifest)?;
        dense.validate_schema(&config)?;
        let mut w = WeightsLoader::new(dense);
        let (h, v) = (config.hidden_size, config.vocab_size);
        let embed = w.linear("model.embed_tokens", v, h)?;
        let lm_head = if config.tie_word_embeddings {
            embed
        } else {
            w.linear("lm_head", v, h)?
        };
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = layer_prefix(i);
            let input_norm = w.vector(&format!("{p}input_layernorm.weight"), &[h])?;
            let mixer = match config.layer_kinds[i] {
                LayerKind::FullAttention => Mixer::Full(FullAttention::load(
                    &mut w,
                    &config,
                    &p,
                    config.attention_window[i],
                )?),
                LayerKind::LinearAttention => {
                    Mixer::Linear(GatedDeltaNet::load(&mut w, &config, &p)?)
                }
                LayerKind::Mla => Mixer::Mla(MlaAttention::load(&mut w, &config, &p)?),
            };
            let post_norm = w.vector(&format!("{p}post_attention_layernorm.weight"), &[h])?;
            let mlp = match config.mlp_kinds[i] {
                MlpKind::Moe => {
                    let el = manifest.expert_layer(i).ok_or_else(|| {
                        Error::format(
                            &manifest_path,
                            format!("no routed experts listed for MoE layer {i}"),
                        )
                    })?;
                    let layout = ExpertLayout::from_manifest(el, &config, &manifest_path)?;
                    let mut block = MoeBlock::load(&mut w, &config, &p, i, layout)?;
                    block.low_width = manifest
                        .low_width_layer(i)
                        .map(|l| ExpertLayout::from_manifest(l, &config, &manifest_path))
                        .transpose()?;
                    Mlp::Moe(block)
                }
                MlpKind::Dense => Mlp::Dense(DenseMlp::load(&mut w, &config, &p)?),
            };
            layers.push(Layer {
                input_norm,
                mixer,
                post_norm,
                mlp,
            });
        }
        let final_norm = w.vector("model.norm.weight", &[h])?;
        Ok(Model {
            rope: Rope::new(&config.rope),
            config,
            weights: w.finish(),
            embed,
            lm_head,
            final_norm,
            layers,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The manifest (size-checked) and config of the model in `dir`, which
    /// must name the same architecture.
    pub fn read_dir(dir: &Path) -> Result<(Manifest, ModelConfig)> {
        let manifest_path = dir.join(crate::format::MANIFEST_FILE);
        let manifest = Manifest::read(&manifest_path)?;
        let config = ModelConfig::from_dir(dir)?;
        if manifest.architecture != config.arch.model_type() {
            return Err(Error::format(
                &manifest_path,
                format!(
                    "architecture `{}` disagrees with config.json model_type `{}`",
                    manifest.architecture,
                    config.arch.model_type()
                ),
            ));
        }
        Ok((manifest, config))
    }

    /// Checks that the model in `dir` can load, without loading it for use:
    /// the manifest and config.json agree, every dense tensor matches the
    /// manifest, the file and the architecture's schema (dtype, shape, byte
    /// range), every expert layout fits its extent, and every expert file
    /// lies inside `dir` with exactly the size the manifest implies; the
    /// same for the experts' low-width copies. Returns what it read (for
    /// `inspect`).
    pub fn check_dir(dir: &Path) -> Result<(Manifest, ModelConfig)> {
        let (manifest, config) = Self::read_dir(dir)?;
        let copies = manifest.copies_as_experts();
        // The experts, then their low-width copies (if any) in their place.
        for m in std::iter::once(&manifest).chain((!copies.experts.is_empty()).then_some(&copies)) {
            Model::load(dir, m, config.clone())?;
            crate::io::ExpertStore::open(
                dir,
                m,
                &crate::io::ExpertStoreOptions {
                    mmap: false,
                    io_threads: 1,
                    ..Default::default()
                },
            )?;
        }
        Ok((manifest, config))
    }

    /// An empty sequence state: a KV cache per full-attention layer, a
    /// latent cache per MLA layer, zero GatedDeltaNet states.
    pub fn new_state(&self) -> ModelState {
        let c = &self.config;
        ModelState {
            layers: self
                .layers
                .iter()
                .map(|l| match &l.mixer {
                    Mixer::Full(a) => {
                        LayerState::Full(KvCache::new(c.num_kv_heads * c.head_dim, a.window))
                    }
                    Mixer::Linear(_) => LayerState::Linear(GatedDeltaNet::new_state(c)),
                    Mixer::Mla(_) => {
                        let m = c.mla.expect("checked at load");
                        LayerState::Mla(MlaCache::new(m.kv_lora_rank, m.qk_rope_head_dim))
                    }
                })
                .collect(),
        }
    }

    /// The first MoE layer after layer `i` (its router drives prefetch).
    pub fn next_moe(&self, i: usize) -> Option<&MoeBlock> {
        self.layers[i + 1..].iter().find_map(|l| l.mlp.moe())
    }

    /// The dense linears a step multiplies by (not the routers, the
    /// embedding or an LM head tied to it, or MLA's projections): what a
    /// CPU session may interleave
    /// (`Weights::interleave_affine`).
    pub fn dense_products(&self) -> Vec<LinearRef> {
        let mut v = Vec::new();
        if self.lm_head.weight.offset != self.embed.weight.offset {
            v.push(self.lm_head);
        }
        for l in &self.layers {
            match &l.mixer {
                Mixer::Full(a) => v.extend([a.q_proj, a.k_proj, a.v_proj, a.o_proj]),
                Mixer::Linear(d) => {
                    match &d.proj {
                        DeltaProjections::Split { qkv, z, b, a } => v.extend([*qkv, *z, *b, *a]),
                        DeltaProjections::Fused { qkvz, ba } => v.extend([*qkvz, *ba]),
                    }
                    v.push(d.out_proj);
                }
                Mixer::Mla(_) => {}
            }
            let mlp = match &l.mlp {
                Mlp::Dense(d) => Some(d),
                Mlp::Moe(b) => b.shared.as_ref().map(|s| &s.mlp),
            };
            v.extend(mlp.iter().flat_map(|d| [d.gate, d.up, d.down]));
        }
        v
    }

    /// Number of MoE layers.
    pub fn moe_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.mlp.moe().is_some()).count()
    }
}
