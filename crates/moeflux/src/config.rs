//! `ModelConfig`: the model's shape, read at run time from `config.json` as
//! written by mlx-lm or Hugging Face (Qwen3.5's nested `text_config`, both
//! rope spellings, `layer_types` or `full_attention_interval`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Most layers a config may declare (the largest supported checkpoints have
/// about 100): tables indexed by layer are sized before anything else of a
/// model is known, so an untrusted count must not size them unchecked.
pub const MAX_LAYERS: usize = 4096;

/// Widest any dimension of a model may be, alone or as one side of a weight
/// matrix (`num_attention_heads * head_dim`, ...): 2^24. Every `rows * cols`
/// and its byte size then stays far from overflowing.
pub const MAX_DIM: usize = 1 << 24;

/// Largest `config.json` read (real ones are a few KB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

mod deepseek;
mod glm;
mod gpt_oss;
mod qwen;

/// Model families this build can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `qwen3_5_moe` (Qwen3.5-397B-A17B, Qwen3.6-35B-A3B): split GatedDeltaNet projections.
    Qwen3_5Moe,
    /// `qwen3_next` (Qwen3-Next-80B): fused per-key-head GatedDeltaNet projections.
    Qwen3Next,
    /// `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B/480B): GQA with
    /// q/k RMSNorm and no output gate, softmax top-K router, no shared expert.
    Qwen3Moe,
    /// `glm4_moe` (GLM-4.5, GLM-4.5-Air, GLM-4.6/4.7): GQA with q/k/v biases, optional
    /// q/k norm and partial rotary; DeepSeek's `noaux_tc` router and ungated shared
    /// experts; the first `first_k_dense_replace` layers dense.
    Glm4Moe,
    /// `deepseek_v3` (DeepSeek-V3/R1, Cogito-V2 671B): MLA in every layer, YaRN rotary,
    /// `noaux_tc` grouped sigmoid router, ungated shared experts, first layers dense.
    DeepseekV3,
    /// `kimi_k2`: the DeepSeek-V3 architecture under another name (mlx-lm maps it to
    /// `deepseek_v3`).
    KimiK2,
    /// `kimi_k25` (Kimi-K2.5's text model): DeepSeek-V3 under a nested `text_config`,
    /// its weights under `language_model.`.
    KimiK25,
    /// `gpt_oss` (gpt-oss-20b/120b): GQA with learned sinks, q/k/v/o biases,
    /// alternating sliding-window and full layers, YaRN rotary; top-K router over
    /// raw logits with a bias, experts with biases and a clamped SwiGLU.
    GptOss,
}

impl Architecture {
    pub const SUPPORTED: &'static str =
        "qwen3_5_moe, qwen3_next, qwen3_moe, glm4_moe, deepseek_v3, kimi_k2, kimi_k25, gpt_oss";

    pub fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "qwen3_5_moe" => Some(Self::Qwen3_5Moe),
            "qwen3_next" => Some(Self::Qwen3Next),
            "qwen3_moe" => Some(Self::Qwen3Moe),
            "glm4_moe" => Some(Self::Glm4Moe),
            "deepseek_v3" => Some(Self::DeepseekV3),
            "kimi_k2" => Some(Self::KimiK2),
            "kimi_k25" => Some(Self::KimiK25),
            "gpt_oss" => Some(Self::GptOss),
            _ => None,
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Self::Qwen3_5Moe => "qwen3_5_moe",
            Self::Qwen3Next => "qwen3_next",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Glm4Moe => "glm4_moe",
            Self::DeepseekV3 => "deepseek_v3",
            Self::KimiK2 => "kimi_k2",
            Self::KimiK25 => "kimi_k25",
            Self::GptOss => "gpt_oss",
        }
    }

    /// A number per family, stable across versions (snapshots record it).
    pub fn code(self) -> u64 {
        match self {
            Self::Qwen3_5Moe => 1,
            Self::Qwen3Next => 2,
            Self::DeepseekV3 => 3,
            Self::KimiK2 => 4,
            Self::Qwen3Moe => 5,
            Self::Glm4Moe => 6,
            Self::KimiK25 => 7,
            Self::GptOss => 8,
        }
    }

    /// The DeepSeek-V3 family (MLA attention, `noaux_tc` router).
    pub fn is_deepseek(self) -> bool {
        matches!(self, Self::DeepseekV3 | Self::KimiK2 | Self::KimiK25)
    }

    /// Checkpoints of this family keep the text model under `language_model.`
    /// (mlx-lm names: `language_model.model.layers.0...`); canonical names drop it.
    pub fn nests_language_model(self) -> bool {
        matches!(self, Self::Qwen3_5Moe | Self::KimiK25)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    LinearAttention,
    FullAttention,
    /// DeepSeek-V3 multi-head latent attention.
    Mla,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpKind {
    Moe,
    Dense,
}

/// How a quantized tensor's codes become weights: the `mode` of a
/// `moeflux.json` `quantized` entry or expert component `quant` (absent means
/// affine, so older manifests read unchanged).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum QuantMode {
    /// MLX affine: codes, scales and biases, `w = q * scale + bias`.
    #[default]
    Affine,
    /// MXFP4 as released: e2m1 codes and e8m0 scales, no biases.
    Mxfp4,
}

impl QuantMode {
    pub fn is_affine(&self) -> bool {
        *self == QuantMode::Affine
    }
}

/// Quantization parameters of one module. Unknown fields are refused rather
/// than ignored: a mode this build does not know must not be read as affine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuantSpec {
    pub bits: u32,
    pub group_size: usize,
    #[serde(default, skip_serializing_if = "QuantMode::is_affine")]
    pub mode: QuantMode,
}

impl QuantSpec {
    /// MLX affine with `bits` per weight in groups of `group_size`.
    pub const fn affine(bits: u32, group_size: usize) -> QuantSpec {
        QuantSpec {
            bits,
            group_size,
            mode: QuantMode::Affine,
        }
    }

    /// MXFP4: 4-bit e2m1 codes, one e8m0 scale per 32.
    pub const MXFP4: QuantSpec = QuantSpec {
        bits: 4,
        group_size: crate::quant::mxfp4::GROUP,
        mode: QuantMode::Mxfp4,
    };

    pub fn is_mxfp4(&self) -> bool {
        self.mode == QuantMode::Mxfp4
    }

    /// Whether rows of `cols` inputs fit: whole groups, and whole 32-code
    /// blocks (the kernels unpack codes of every width 32 at a time, which a
    /// group of 16 does not imply).
    pub fn check_cols(&self, cols: usize) -> std::result::Result<(), String> {
        if !cols.is_multiple_of(self.group_size) || !cols.is_multiple_of(32) {
            return Err(format!(
                "{cols} columns not divisible by group size {}{}",
                self.group_size,
                if self.group_size < 32 { " and 32" } else { "" }
            ));
        }
        Ok(())
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        match self.mode {
            QuantMode::Mxfp4 if *self == QuantSpec::MXFP4 => Ok(()),
            QuantMode::Mxfp4 => Err(format!(
                "mode mxfp4 needs bits 4 and group_size 32, not bits {} and group_size {}",
                self.bits, self.group_size
            )),
            QuantMode::Affine => {
                if !matches!(self.bits, 2 | 3 | 4 | 5 | 6 | 8) {
                    return Err(format!("unsupported bit width {}", self.bits));
                }
                // 16: GGUF's K-quants whose scales cover 16 values.
                if !matches!(self.group_size, 16 | 32 | 64 | 128) {
                    return Err(format!("unsupported group size {}", self.group_size));
                }
                Ok(())
            }
        }
    }
}

/// The `quantization` block: a default plus per-module overrides keyed by
/// module path as the source checkpoint names it. An override of `None`
/// means the module is not quantized.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantConfig {
    pub default: Option<QuantSpec>,
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl QuantConfig {
    /// Quantization of `module` (a path without `.weight`), trying the path as
    /// given and with/without the `language_model.` prefix mlx-lm adds for Qwen3.5.
    pub fn for_module(&self, module: &str) -> Option<QuantSpec> {
        let alt = match module.strip_prefix("language_model.") {
            Some(s) => s.to_string(),
            None => format!("language_model.{module}"),
        };
        for key in [module, alt.as_str()] {
            if let Some(o) = self.overrides.get(key) {
                return *o;
            }
        }
        self.default
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct LinearAttnConfig {
    /// `in_proj_qkvz` + `in_proj_ba` ordered per key head (Qwen3-Next) rather
    /// than `in_proj_qkv`, `_z`, `_b`, `_a` (Qwen3.5).
    pub fused_projections: bool,
    pub num_v_heads: usize,
    pub num_k_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub conv_kernel: usize,
}

impl LinearAttnConfig {
    pub fn key_dim(&self) -> usize {
        self.num_k_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_v_heads * self.value_head_dim
    }
    /// Channels of the causal conv1d: q, k and v concatenated.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// The flavour of a full-attention (GQA) layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionConfig {
    /// `q_proj` rows are per head `[q | gate]` and the output is scaled by
    /// `sigmoid(gate)` (Qwen3.5 / Qwen3-Next).
    pub output_gate: bool,
    /// Per-head RMSNorm of q and k before rotary (`q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// `q_proj`, `k_proj` and `v_proj` add a bias (GLM's `attention_bias`).
    pub qkv_bias: bool,
    /// `o_proj` adds a bias (gpt-oss).
    pub o_bias: bool,
    /// A learned logit per head (`self_attn.sinks`) joins every softmax
    /// without a value: attention may go "nowhere" (gpt-oss).
    pub sinks: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate: usize,
    /// Width of the shared expert (DeepSeek: `moe_intermediate_size * n_shared_experts`);
    /// 0 for none.
    pub shared_intermediate: usize,
    /// The shared expert is scaled by `sigmoid(shared_expert_gate x)` (Qwen3.5 /
    /// Qwen3-Next: `mlp.shared_expert.*`); otherwise added as is (DeepSeek, GLM:
    /// `mlp.shared_experts.*`).
    pub shared_gate: bool,
    pub norm_topk_prob: bool,
    pub router: RouterKind,
    /// The router adds a bias to its logits (gpt-oss `mlp.router.bias`).
    pub router_bias: bool,
    /// Each routed expert's projections add a bias (gpt-oss).
    pub expert_bias: bool,
    pub activation: ExpertActivation,
}

/// The gated activation of the routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum ExpertActivation {
    /// `silu(gate) * up`.
    #[default]
    Silu,
    /// gpt-oss: `(clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)` with
    /// `g = min(gate, limit)` (mlx-lm's `swiglu_oai`).
    SwigluOai { alpha: f32, limit: f32 },
}

/// How a MoE layer picks its experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterKind {
    /// Qwen: softmax over all experts, top-K, renormalised when `norm_topk_prob`.
    Softmax,
    /// DeepSeek-V3 / GLM `noaux_tc`: sigmoid scores; the correction bias is added for
    /// the choice only (top-2 sum per group, the best `topk_group` groups, top-K
    /// inside them); weights are the unbiased scores, renormalised when
    /// `norm_topk_prob`, times `routed_scaling_factor`.
    NoauxTc {
        n_group: usize,
        topk_group: usize,
        routed_scaling_factor: f32,
    },
    /// gpt-oss: the top-K raw logits, then a softmax over those K.
    TopKSoftmax,
}

/// DeepSeek-V3 multi-head latent attention shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Rank of the query compression (`q_a_proj`); `None`: a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed KV latent that is cached per token.
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl MlaConfig {
    /// Query/key width per head: the no-position part plus the rotary part.
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
    /// Floats cached per token per layer: the latent plus the shared rotary key.
    pub fn cache_row(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }
}

/// YaRN rotary scaling (`rope_scaling` of type `yarn` / `deepseek_yarn`), with
/// mlx-lm's `YarnRoPE` defaults for absent keys.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct YarnConfig {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Leading channels of each head that rotate (`head_dim * partial_rotary_factor`).
    pub rotary_dim: usize,
    /// Position multiplier (`1/factor` for `linear` scaling, else 1).
    pub position_scale: f64,
    /// Rotate interleaved pairs `(2i, 2i+1)` (mlx `traditional=True`, DeepSeek)
    /// instead of half-split pairs `(i, i + rotary_dim/2)` (Qwen).
    pub interleaved: bool,
    /// YaRN frequency interpolation and magnitude scaling (DeepSeek).
    pub yarn: Option<YarnConfig>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub layer_kinds: Vec<LayerKind>,
    pub mlp_kinds: Vec<MlpKind>,
    /// Per layer: attention sees only the last `w` positions (itself
    /// included) when `Some(w)` (gpt-oss's sliding layers); `None`: all.
    pub attention_window: Vec<Option<usize>>,
    /// Full-attention layers' flavour.
    pub attention: AttentionConfig,
    pub linear: LinearAttnConfig,
    pub moe: MoeConfig,
    pub rope: RopeConfig,
    /// MLA shape (DeepSeek-V3 family only).
    pub mla: Option<MlaConfig>,
    pub quantization: Option<QuantConfig>,
    /// End-of-sequence ids named in config.json (`eos_token_id`, scalar or list).
    pub eos_token_ids: Vec<u32>,
}

/// Field reader that names the file and field in every error.
struct Fields<'a> {
    path: &'a Path,
    /// Text fields (nested `text_config` when present) then the top level.
    layers: Vec<&'a Map<String, Value>>,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, reason: impl Into<String>) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            field: field.to_string(),
            reason: reason.into(),
        }
    }

    fn get(&self, field: &str) -> Option<&'a Value> {
        self.layers
            .iter()
            .find_map(|m| m.get(field).filter(|v| !v.is_null()))
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| {
                self.err(field, format!("expected a non-negative integer, got {v}"))
            }),
        }
    }

    fn usize(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?
            .ok_or_else(|| self.err(field, "missing"))
    }

    fn f64_opt(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected a number, got {v}"))),
        }
    }

    fn bool_opt(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(field, format!("expected true or false, got {v}"))),
        }
    }
}

/// `num_hidden_layers`: in 1..=[`MAX_LAYERS`], checked before per-layer
/// tables are built from it.
fn layer_count(f: &Fields) -> Result<usize> {
    let n = positive(f, "num_hidden_layers", f.usize("num_hidden_layers")?)?;
    if n > MAX_LAYERS {
        return Err(f.err(
            "num_hidden_layers",
            format!("{n} is more than the {MAX_LAYERS} layers supported"),
        ));
    }
    Ok(n)
}

fn positive(f: &Fields, field: &str, v: usize) -> Result<usize> {
    if v == 0 {
        return Err(f.err(field, "must be greater than zero"));
    }
    Ok(v)
}

/// What every grouped-query-attention family (Qwen, GLM) reads alike.
struct GqaShape {
    hidden_size: usize,
    num_layers: usize,
    num_attention_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    vocab_size: usize,
    rms_norm_eps: f32,
    intermediate_size: usize,
    max_position_embeddings: usize,
    tie_word_embeddings: bool,
}

impl GqaShape {
    /// `max_position_default`: the family's default when the field is absent.
    fn parse(f: &Fields, max_position_default: usize) -> Result<GqaShape> {
        let hidden_size = positive(f, "hidden_size", f.usize("hidden_size")?)?;
        let num_layers = layer_count(f)?;
        let num_attention_heads =
            positive(f, "num_attention_heads", f.usize("num_attention_heads")?)?;
        let num_kv_heads = positive(f, "num_key_value_heads", f.usize("num_key_value_heads")?)?;
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => positive(f, "head_dim", d)?,
            None => hidden_size / num_attention_heads,
        };
        if num_attention_heads % num_kv_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads {num_attention_heads}"),
            ));
        }
        Ok(GqaShape {
            hidden_size,
            num_layers,
            num_attention_heads,
            num_kv_heads,
            head_dim,
            vocab_size: positive(f, "vocab_size", f.usize("vocab_size")?)?,
            rms_norm_eps: f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32,
            intermediate_size: f.usize_opt("intermediate_size")?.unwrap_or(0),
            max_position_embeddings: f
                .usize_opt("max_position_embeddings")?
                .unwrap_or(max_position_default),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?.unwrap_or(false),
        })
    }
}

/// The MoE widths must be set where a layer is MoE, and top-K within the
/// experts; `intermediate_size` where a layer is dense.
fn check_mlp_widths(
    f: &Fields,
    mlp_kinds: &[MlpKind],
    moe: &MoeConfig,
    intermediate_size: usize,
    experts_field: &str,
) -> Result<()> {
    if mlp_kinds.contains(&MlpKind::Moe) {
        positive(f, experts_field, moe.num_experts)?;
        positive(f, "num_experts_per_tok", moe.num_experts_per_tok)?;
        positive(f, "moe_intermediate_size", moe.moe_intermediate)?;
        if moe.num_experts_per_tok > moe.num_experts {
            return Err(f.err(
                "num_experts_per_tok",
                format!(
                    "{} exceeds {experts_field} {}",
                    moe.num_experts_per_tok, moe.num_experts
                ),
            ));
        }
    }
    if mlp_kinds.contains(&MlpKind::Dense) {
        positive(f, "intermediate_size", intermediate_size)?;
    }
    Ok(())
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        Self::from_file(&dir.join("config.json"))
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::format::read_small_text(path, MAX_CONFIG_BYTES)?;
        let value: Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&value, path)
    }

    /// Parses a config already in memory; `path` is used for messages only.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let top = value.as_object().ok_or_else(|| Error::Config {
            path: path.to_path_buf(),
            field: "<root>".into(),
            reason: "expected a JSON object".into(),
        })?;
        let text = match top.get("text_config") {
            Some(Value::Object(m)) => Some(m),
            Some(Value::Null) | None => None,
            Some(_) => {
                return Err(Error::Config {
                    path: path.to_path_buf(),
                    field: "text_config".into(),
                    reason: "expected an object".into(),
                })
            }
        };
        let mut layers = Vec::new();
        if let Some(t) = text {
            layers.push(t);
        }
        layers.push(top);
        let f = Fields { path, layers };

        let model_type = top
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| f.err("model_type", "missing"))?;
        let arch =
            Architecture::from_model_type(model_type).ok_or_else(|| Error::UnsupportedModel {
                path: path.to_path_buf(),
                model_type: model_type.to_string(),
                supported: Architecture::SUPPORTED.to_string(),
            })?;
        let c = match arch {
            Architecture::Qwen3_5Moe | Architecture::Qwen3Next | Architecture::Qwen3Moe => {
                qwen::parse(&f, top, arch)
            }
            Architecture::Glm4Moe => glm::parse(&f, top),
            Architecture::DeepseekV3 | Architecture::KimiK2 | Architecture::KimiK25 => {
                deepseek::parse(&f, top, arch)
            }
            Architecture::GptOss => gpt_oss::parse(&f, top),
        }?;
        c.check_sizes(&f)?;
        Ok(c)
    }

    /// Every width, and every product of widths that is one side of a
    /// weight matrix, within [`MAX_DIM`] (checked multiplication: a hostile
    /// config must not overflow the shape arithmetic of the loader).
    fn check_sizes(&self, f: &Fields) -> Result<()> {
        let l = &self.linear;
        let mut dims: Vec<(&str, Option<usize>)> = vec![
            ("hidden_size", Some(self.hidden_size)),
            ("num_attention_heads", Some(self.num_attention_heads)),
            ("num_key_value_heads", Some(self.num_kv_heads)),
            ("head_dim", Some(self.head_dim)),
            ("vocab_size", Some(self.vocab_size)),
            ("intermediate_size", Some(self.intermediate_size)),
            ("num_experts", Some(self.moe.num_experts)),
            ("moe_intermediate_size", Some(self.moe.moe_intermediate)),
            (
                "shared_expert_intermediate_size",
                Some(self.moe.shared_intermediate),
            ),
            (
                "num_attention_heads * head_dim * 2",
                self.num_attention_heads
                    .checked_mul(self.head_dim)
                    .and_then(|x| x.checked_mul(2)),
            ),
            (
                "num_key_value_heads * head_dim",
                self.num_kv_heads.checked_mul(self.head_dim),
            ),
            ("linear_num_value_heads", Some(l.num_v_heads)),
            ("linear_num_key_heads", Some(l.num_k_heads)),
            ("linear_key_head_dim", Some(l.key_head_dim)),
            ("linear_value_head_dim", Some(l.value_head_dim)),
            ("linear_conv_kernel_dim", Some(l.conv_kernel)),
            (
                "2 * linear_num_key_heads * linear_key_head_dim + 2 * linear_num_value_heads * linear_value_head_dim",
                l.num_k_heads
                    .checked_mul(l.key_head_dim)
                    .and_then(|k| k.checked_mul(2))
                    .zip(
                        l.num_v_heads
                            .checked_mul(l.value_head_dim)
                            .and_then(|v| v.checked_mul(2)),
                    )
                    .and_then(|(k, v)| k.checked_add(v)),
            ),
        ];
        if let Some(m) = &self.mla {
            let nh = self.num_attention_heads;
            let q_head = m.qk_nope_head_dim.checked_add(m.qk_rope_head_dim);
            dims.extend([
                // Absent (a plain q_proj): nothing to bound.
                ("q_lora_rank", Some(m.q_lora_rank.unwrap_or(0))),
                ("kv_lora_rank", Some(m.kv_lora_rank)),
                ("qk_nope_head_dim", Some(m.qk_nope_head_dim)),
                ("qk_rope_head_dim", Some(m.qk_rope_head_dim)),
                ("v_head_dim", Some(m.v_head_dim)),
                (
                    "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
                    q_head.and_then(|q| q.checked_mul(nh)),
                ),
                (
                    "num_attention_heads * kv_lora_rank",
                    nh.checked_mul(m.kv_lora_rank),
                ),
                (
                    "kv_lora_rank + qk_rope_head_dim",
                    m.kv_lora_rank.checked_add(m.qk_rope_head_dim),
                ),
                (
                    "num_attention_heads * v_head_dim",
                    nh.checked_mul(m.v_head_dim),
                ),
            ]);
        }
        for (field, v) in dims {
            if v.is_none_or(|v| v > MAX_DIM) {
                let what = v.map_or("overflows".to_string(), |v| v.to_string());
                return Err(f.err(
                    field,
                    format!("{what} is larger than the {MAX_DIM} supported"),
                ));
            }
        }
        Ok(())
    }

    /// Half-split rotary over the first `head_dim * partial_rotary_factor`
    /// channels (Qwen, GLM): `rope_parameters` (Qwen3.5) or flat
    /// `rope_theta`/`partial_rotary_factor` with an optional `rope_scaling`.
    fn parse_rope(f: &Fields, head_dim: usize) -> Result<RopeConfig> {
        // Qwen3.5 nests rope settings in `rope_parameters`; Qwen3-Next keeps
        // `rope_theta`/`partial_rotary_factor` flat with optional `rope_scaling`.
        let params = match f.get("rope_parameters") {
            Some(Value::Object(m)) => Some(m),
            Some(v) => return Err(f.err("rope_parameters", format!("expected an object, got {v}"))),
            None => None,
        };
        let scaling = match f.get("rope_scaling") {
            Some(Value::Object(m)) => Some(m),
            Some(v) => return Err(f.err("rope_scaling", format!("expected an object, got {v}"))),
            None => None,
        };
        let pget = |k: &str| params.and_then(|m| m.get(k)).filter(|v| !v.is_null());
        let theta = match pget("rope_theta") {
            Some(v) => v.as_f64().ok_or_else(|| {
                f.err(
                    "rope_parameters.rope_theta",
                    format!("expected a number, got {v}"),
                )
            })?,
            None => f.f64_opt("rope_theta")?.unwrap_or(if params.is_some() {
                100_000.0
            } else {
                10_000.0
            }),
        };
        let factor = match pget("partial_rotary_factor") {
            Some(v) => v.as_f64().ok_or_else(|| {
                f.err(
                    "rope_parameters.partial_rotary_factor",
                    format!("expected a number, got {v}"),
                )
            })?,
            None => f
                .f64_opt("partial_rotary_factor")?
                .unwrap_or(if params.is_some() { 0.25 } else { 1.0 }),
        };
        let (kind_field, kind_src) = if params.is_some() {
            ("rope_parameters", params)
        } else {
            ("rope_scaling", scaling)
        };
        let rope_type = kind_src
            .and_then(|m| m.get("type").or_else(|| m.get("rope_type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let position_scale = match rope_type {
            "default" | "mrope" => 1.0,
            "linear" => {
                let fac = kind_src
                    .and_then(|m| m.get("factor"))
                    .and_then(Value::as_f64)
                    .ok_or_else(|| {
                        f.err(
                            &format!("{kind_field}.factor"),
                            "missing for linear rope scaling",
                        )
                    })?;
                if fac <= 0.0 {
                    return Err(f.err(&format!("{kind_field}.factor"), "must be positive"));
                }
                1.0 / fac
            }
            other => {
                return Err(f.err(
                    &format!("{kind_field}.type"),
                    format!("rope type `{other}` is not supported (supported: default, linear)"),
                ))
            }
        };
        let rotary_dim = (head_dim as f64 * factor) as usize;
        if rotary_dim == 0 || rotary_dim > head_dim || !rotary_dim.is_multiple_of(2) {
            return Err(f.err(
                "partial_rotary_factor",
                format!("gives rotary dim {rotary_dim} for head_dim {head_dim}; need an even number in 2..=head_dim"),
            ));
        }
        if theta <= 0.0 {
            return Err(f.err("rope_theta", "must be positive"));
        }
        Ok(RopeConfig {
            theta,
            rotary_dim,
            position_scale,
            interleaved: false,
            yarn: None,
        })
    }

    fn parse_quantization(f: &Fields, top: &Map<String, Value>) -> Result<Option<QuantConfig>> {
        let q = match top
            .get("quantization")
            .or_else(|| top.get("quantization_config"))
        {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Object(m)) => m,
            Some(v) => return Err(f.err("quantization", format!("expected an object, got {v}"))),
        };
        // A Hugging Face `quantization_config` describes the source weights, not
        // MLX affine groups: FP8 block weights (DeepSeek-V3 releases) are decoded
        // by `convert` from their `weight_scale_inv` tensors; others are refused.
        if let Some(method) = q.get("quant_method") {
            return match method.as_str() {
                // FP8 block weights (DeepSeek-V3) and MXFP4 experts (gpt-oss,
                // `*_blocks` / `*_scales`) are read from their own tensors.
                Some("fp8" | "mxfp4") if !q.contains_key("bits") => Ok(None),
                _ => Err(f.err(
                    "quantization_config.quant_method",
                    format!(
                        "{method} is not supported (supported: fp8 block weights, \
                         mxfp4 experts, MLX affine and mxfp4)"
                    ),
                )),
            };
        }
        let spec_of = |field: &str, m: &Map<String, Value>| -> Result<QuantSpec> {
            let mode = match m.get("mode") {
                None | Some(Value::Null) => QuantMode::Affine,
                Some(Value::String(s)) if s == "affine" => QuantMode::Affine,
                Some(Value::String(s)) if s == "mxfp4" => QuantMode::Mxfp4,
                Some(other) => {
                    return Err(f.err(
                        &format!("{field}.mode"),
                        format!("quantization mode {other} is not supported (affine, mxfp4)"),
                    ))
                }
            };
            let bits = m
                .get("bits")
                .and_then(Value::as_u64)
                .ok_or_else(|| f.err(&format!("{field}.bits"), "missing or not an integer"))?;
            let group_size = m.get("group_size").and_then(Value::as_u64).ok_or_else(|| {
                f.err(&format!("{field}.group_size"), "missing or not an integer")
            })?;
            let spec = QuantSpec {
                mode,
                ..QuantSpec::affine(bits as u32, group_size as usize)
            };
            spec.validate().map_err(|r| f.err(field, r))?;
            Ok(spec)
        };
        let default = if q.contains_key("bits") {
            Some(spec_of("quantization", q)?)
        } else {
            None
        };
        let mut overrides = BTreeMap::new();
        for (k, v) in q {
            match v {
                Value::Object(m) => {
                    overrides.insert(k.clone(), Some(spec_of(&format!("quantization.{k}"), m)?));
                }
                Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                Value::Bool(true) => {
                    overrides.insert(k.clone(), default);
                }
                _ => {}
            }
        }
        Ok(Some(QuantConfig { default, overrides }))
    }

    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.mlp_kinds[layer] == MlpKind::Moe
    }

    /// Layers with a position-indexed cache (full attention or MLA).
    pub fn num_full_attention_layers(&self) -> usize {
        self.layer_kinds
            .iter()
            .filter(|k| **k != LayerKind::LinearAttention)
            .count()
    }
}

/// End-of-sequence ids, the union over text_config and the top level: mlx-lm
/// writes the generation_config ids at the top, Qwen3.5's text_config has its own.
fn eos_ids(f: &Fields) -> Vec<u32> {
    let mut eos_token_ids: Vec<u32> = Vec::new();
    for m in &f.layers {
        let ids: Vec<u32> = match m.get("eos_token_id") {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().map(|x| x as u32))
                .collect(),
            Some(v) => v.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            None => Vec::new(),
        };
        for id in ids {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
    }
    eos_token_ids
}

/// Path of `config.json` inside a directory (for messages).
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, Path::new("config.json"))
    }

    fn qwen35() -> Value {
        json!({
            "model_type": "qwen3_5_moe",
            "tie_word_embeddings": false,
            "eos_token_id": [2, 0],
            "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}},
            "text_config": {
                "hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
                "linear_num_value_heads": 4, "linear_num_key_heads": 2,
                "linear_key_head_dim": 32, "linear_value_head_dim": 32,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64, "full_attention_interval": 4, "eos_token_id": 2,
                "rope_parameters": {"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
            }
        })
    }

    #[test]
    fn nested_text_config_and_rope_parameters() {
        let c = parse(qwen35()).unwrap();
        assert_eq!(c.arch, Architecture::Qwen3_5Moe);
        assert_eq!(c.hidden_size, 128);
        assert_eq!(c.rope.rotary_dim, 8);
        assert_eq!(c.rope.theta, 1e7);
        assert_eq!(c.layer_kinds[3], LayerKind::FullAttention);
        assert_eq!(c.layer_kinds[2], LayerKind::LinearAttention);
        assert!(c.moe.norm_topk_prob);
        assert_eq!(c.eos_token_ids, vec![2, 0]);
        let q = c.quantization.unwrap();
        assert_eq!(q.for_module("model.layers.0.mlp.gate").unwrap().bits, 8);
        assert_eq!(q.for_module("model.layers.1.mlp.gate").unwrap().bits, 4);
    }

    #[test]
    fn rope_type_spelling_and_layer_types() {
        let mut v = qwen35();
        v["text_config"]["rope_parameters"] =
            json!({"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5});
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("full_attention_interval");
        v["text_config"]["layer_types"] = json!([
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention",
            "linear_attention",
            "full_attention"
        ]);
        let c = parse(v).unwrap();
        assert_eq!(c.rope.rotary_dim, 16);
        assert_eq!(c.layer_kinds[1], LayerKind::FullAttention);
    }

    #[test]
    fn contradicting_layer_pattern_is_an_error() {
        let mut v = qwen35();
        v["text_config"]["layer_types"] = json!(vec!["full_attention"; 8]);
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("layer_types"), "{e}");
    }

    #[test]
    fn unsupported_model_type_is_named() {
        let mut v = qwen35();
        v["model_type"] = json!("llama");
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("llama") && e.contains("qwen3_5_moe"), "{e}");
    }

    #[test]
    fn missing_field_is_named() {
        let mut v = qwen35();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("hidden_size");
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("hidden_size") && e.contains("missing"), "{e}");
    }

    #[test]
    fn qwen3_next_flat_config_with_dense_layers() {
        let v = json!({
            "model_type": "qwen3_next", "hidden_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024,
            "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
            "linear_value_head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "intermediate_size": 128,
            "mlp_only_layers": [2], "decoder_sparse_step": 1, "full_attention_interval": 2,
            "rope_theta": 1e7, "partial_rotary_factor": 0.25, "norm_topk_prob": true,
            "tie_word_embeddings": true
        });
        let c = parse(v).unwrap();
        assert_eq!(
            c.mlp_kinds,
            vec![MlpKind::Moe, MlpKind::Moe, MlpKind::Dense, MlpKind::Moe]
        );
        assert!(c.tie_word_embeddings);
        assert_eq!(c.rope.rotary_dim, 8);
    }

    #[test]
    fn unsupported_rope_and_quant_mode_are_errors() {
        let mut v = qwen35();
        v["text_config"]["rope_parameters"]["type"] = json!("yarn");
        assert!(parse(v).unwrap_err().to_string().contains("yarn"));
        let mut v = qwen35();
        v["quantization"]["mode"] = json!("mxfp4");
        assert!(parse(v).unwrap_err().to_string().contains("mxfp4"));
    }
}
