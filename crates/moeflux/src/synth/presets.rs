//! The shapes `moeflux synth` can build: a [`SynthSpec`] per architecture
//! family and the named presets. Adding a model is an entry in [`presets`];
//! adding a family (DeepSeek-V3 for Cogito-V2) is a variant of `SynthSpec`
//! with its `config.json`, plus init rules for its new tensors in `init.rs`.
//!
//! Where the numbers come from: Qwen3.5/3.6 and Cogito-V2 from their
//! `config.json`; Qwen3-235B-A22B and Qwen3-30B-A3B from their model cards
//! (94/48 layers, 64/32 query and 4 KV heads, 128 experts top-8) and the
//! Megatron arguments of THUDM's slime (`scripts/models/qwen3-235B-A22B.sh`,
//! `qwen3-30B-A3B.sh`: hidden 4096/2048, head dim 128, FFN 12288/6144, MoE
//! FFN 1536/768, vocab 151936, rotary base 1e6, q/k norm, untied); GLM-4.6
//! and GLM-4.5-Air from slime's `glm4.5-355B-A32B.sh` (GLM-4.6 has GLM-4.5's
//! shape) and `glm4.5-106B-A12B.sh` (hidden 5120/4096, 92/46 layers = 3/1
//! dense + 89/45 MoE, 96 heads, 8 KV groups, head dim 128, q/k/v bias, q/k
//! norm for the 355B only, half rotary, FFN 12288/10944, 160/128 experts
//! top-8 of 1536/1408 with one shared expert of that width, sigmoid router
//! with expert bias, top-K scaling 2.5 (Air: 1.0), vocab 151552, rotary
//! base 1e6), GLM-4.5-Air's `config.json` (also in `config/glm.rs`'s tests:
//! eos ids, rms_norm_eps 1e-5, 131072 positions, one group) and GLM-4.6's
//! 202752-token context (its model card).

use serde_json::{json, Value};

use crate::config::Architecture;
use crate::error::{Error, Result};

/// The shape of a synthetic model. The CLI takes it from a preset; tests
/// build small ones directly.
#[derive(Debug, Clone, PartialEq)]
pub enum SynthSpec {
    Qwen3_5Moe(QwenShape),
    Qwen3Moe(Qwen3MoeShape),
    Glm4Moe(GlmShape),
    DeepseekV3(DeepseekShape),
    GptOss(GptOssShape),
}

/// A `gpt_oss` model (gpt-oss-20b/120b): GQA with sinks and biases,
/// sliding-window (`sliding_window`) and full layers alternating, YaRN
/// rotary (factor 32 over 4096 positions), every layer MoE with a biased
/// router and biased experts (clamped SwiGLU). Experts are MXFP4 like the
/// release's unless `--expert-bits` asks for MLX affine.
#[derive(Debug, Clone, PartialEq)]
pub struct GptOssShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    /// Expert width (`intermediate_size`).
    pub intermediate_size: usize,
    pub sliding_window: usize,
    pub eos_token_ids: &'static [u32],
}

/// A `qwen3_moe` model (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): GQA
/// with per-head q/k RMSNorm and full rotary in every layer, every layer MoE
/// (`decoder_sparse_step` 1, no `mlp_only_layers`) with a softmax top-K
/// router and no shared expert, untied embeddings.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3MoeShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate: usize,
    /// `intermediate_size`: the dense MLP width of the config (used by no
    /// layer when every layer is MoE, as in the released models).
    pub intermediate_size: usize,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub eos_token_ids: &'static [u32],
}

/// A `glm4_moe` model (GLM-4.5, GLM-4.5-Air, GLM-4.6): GQA with q/k/v
/// biases, q/k RMSNorm when `use_qk_norm`, half-split rotary over
/// `head_dim * partial_rotary_factor` channels; the first `first_k_dense`
/// layers with a dense SwiGLU MLP, then MoE layers with DeepSeek's
/// `noaux_tc` router (sigmoid, correction bias, groups) and ungated shared
/// experts.
#[derive(Debug, Clone, PartialEq)]
pub struct GlmShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate: usize,
    pub n_shared_experts: usize,
    /// Width of the dense MLP of the first layers.
    pub intermediate_size: usize,
    pub first_k_dense: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub use_qk_norm: bool,
    pub partial_rotary_factor: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub eos_token_ids: &'static [u32],
}

/// A `deepseek_v3` model (Cogito-V2 671B, DeepSeek-V3/R1): MLA in every layer,
/// the first `first_k_dense` layers with a dense SwiGLU MLP, then MoE layers
/// with a `noaux_tc` router and ungated shared experts; YaRN rotary.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepseekShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub vocab_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate: usize,
    pub n_shared_experts: usize,
    /// Width of the dense MLP of the first layers.
    pub intermediate_size: usize,
    pub first_k_dense: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
    pub eos_token_ids: &'static [u32],
}

/// A `qwen3_5_moe` hybrid (Qwen3.5 / Qwen3.6): GatedDeltaNet layers with a
/// full-attention layer every `full_attention_interval`, every layer MoE
/// with a shared expert, untied embeddings.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenShape {
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_attention_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_intermediate: usize,
    pub shared_intermediate: usize,
    pub linear_v_heads: usize,
    pub linear_k_heads: usize,
    /// Key and value head dim of the linear-attention layers.
    pub linear_head_dim: usize,
    pub full_attention_interval: usize,
    /// `eos_token_id` of the real model (its tokenizer's ids), so that a
    /// copied tokenizer works with `moeflux run`.
    pub eos_token_ids: &'static [u32],
}

/// A named, real model shape.
#[derive(Debug, Clone)]
pub struct Preset {
    pub name: &'static str,
    pub description: &'static str,
    pub spec: SynthSpec,
}

const QWEN_EOS: &[u32] = &[248046, 248044];
/// Qwen3's `<|im_end|>` and `<|endoftext|>` (its generation_config.json).
const QWEN3_EOS: &[u32] = &[151645, 151643];
/// gpt-oss's `<|return|>`, `<|endoftext|>`, `<|call|>` (generation_config.json).
const GPT_OSS_EOS: &[u32] = &[200002, 199999, 200012];
/// GLM-4.5/4.6's `<|endoftext|>`, `<|user|>`, `<|observation|>`.
const GLM_EOS: &[u32] = &[151329, 151336, 151338];

/// Every preset, as listed by `moeflux synth --help`.
/// gpt-oss-120b's shape; gpt-oss-20b differs only in depth and expert count.
const GPT_OSS_120B: GptOssShape = GptOssShape {
    hidden_size: 2880,
    num_layers: 36,
    num_attention_heads: 64,
    num_kv_heads: 8,
    head_dim: 64,
    vocab_size: 201_088,
    num_experts: 128,
    experts_per_token: 4,
    intermediate_size: 2880,
    sliding_window: 128,
    eos_token_ids: GPT_OSS_EOS,
};

pub fn presets() -> Vec<Preset> {
    vec![
        Preset {
            name: "qwen3.6-35b-a3b",
            description: "Qwen3.6-35B-A3B: hidden 2048, 40 layers, 256 experts top-8",
            spec: SynthSpec::Qwen3_5Moe(QwenShape {
                hidden_size: 2048,
                num_layers: 40,
                num_attention_heads: 16,
                num_kv_heads: 2,
                head_dim: 256,
                vocab_size: 248_320,
                num_experts: 256,
                experts_per_token: 8,
                moe_intermediate: 512,
                shared_intermediate: 512,
                linear_v_heads: 32,
                linear_k_heads: 16,
                linear_head_dim: 128,
                full_attention_interval: 4,
                eos_token_ids: QWEN_EOS,
            }),
        },
        Preset {
            name: "qwen3.5-397b-a17b",
            description: "Qwen3.5-397B-A17B: hidden 4096, 60 layers, 512 experts top-10",
            spec: SynthSpec::Qwen3_5Moe(QwenShape {
                hidden_size: 4096,
                num_layers: 60,
                num_attention_heads: 32,
                num_kv_heads: 2,
                head_dim: 256,
                vocab_size: 248_320,
                num_experts: 512,
                experts_per_token: 10,
                moe_intermediate: 1024,
                shared_intermediate: 1024,
                linear_v_heads: 64,
                linear_k_heads: 16,
                linear_head_dim: 128,
                full_attention_interval: 4,
                eos_token_ids: QWEN_EOS,
            }),
        },
        Preset {
            name: "cogito-v2-671b",
            description: "Cogito-V2 671B (DeepSeek-V3 architecture): hidden 7168, 61 layers \
                          (first 3 dense, 18432), MLA 128 heads, 256 experts top-8 of 2048",
            spec: SynthSpec::DeepseekV3(DeepseekShape {
                hidden_size: 7168,
                num_layers: 61,
                num_attention_heads: 128,
                vocab_size: 129_280,
                num_experts: 256,
                experts_per_token: 8,
                moe_intermediate: 2048,
                n_shared_experts: 1,
                intermediate_size: 18_432,
                first_k_dense: 3,
                q_lora_rank: 1536,
                kv_lora_rank: 512,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
                n_group: 8,
                topk_group: 4,
                routed_scaling_factor: 2.5,
                eos_token_ids: &[1],
            }),
        },
        Preset {
            name: "qwen3-235b-a22b",
            description: "Qwen3-235B-A22B: hidden 4096, 94 layers, GQA 64/4 heads, \
                          128 experts top-8 of 1536",
            spec: SynthSpec::Qwen3Moe(Qwen3MoeShape {
                hidden_size: 4096,
                num_layers: 94,
                num_attention_heads: 64,
                num_kv_heads: 4,
                head_dim: 128,
                vocab_size: 151_936,
                num_experts: 128,
                experts_per_token: 8,
                moe_intermediate: 1536,
                intermediate_size: 12_288,
                // The first release; the 2507 updates have 5e6 and 262144.
                rope_theta: 1_000_000.0,
                max_position_embeddings: 40_960,
                eos_token_ids: QWEN3_EOS,
            }),
        },
        Preset {
            name: "qwen3-30b-a3b",
            description: "Qwen3-30B-A3B: hidden 2048, 48 layers, GQA 32/4 heads, \
                          128 experts top-8 of 768",
            spec: SynthSpec::Qwen3Moe(Qwen3MoeShape {
                hidden_size: 2048,
                num_layers: 48,
                num_attention_heads: 32,
                num_kv_heads: 4,
                head_dim: 128,
                vocab_size: 151_936,
                num_experts: 128,
                experts_per_token: 8,
                moe_intermediate: 768,
                intermediate_size: 6144,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 40_960,
                eos_token_ids: QWEN3_EOS,
            }),
        },
        Preset {
            name: "gpt-oss-120b",
            description: "gpt-oss-120b (117B-A5.1B): hidden 2880, 36 layers (sliding 128 / full), \
                          GQA 64/8 heads of 64 with sinks, 128 experts top-4 of 2880",
            spec: SynthSpec::GptOss(GPT_OSS_120B),
        },
        Preset {
            name: "gpt-oss-20b",
            description: "gpt-oss-20b (21B-A3.6B): hidden 2880, 24 layers (sliding 128 / full), \
                          GQA 64/8 heads of 64 with sinks, 32 experts top-4 of 2880",
            spec: SynthSpec::GptOss(GptOssShape {
                num_layers: 24,
                num_experts: 32,
                ..GPT_OSS_120B
            }),
        },
        Preset {
            name: "glm-4.6",
            description: "GLM-4.6 (355B-A32B): hidden 5120, 92 layers (first 3 dense, 12288), \
                          GQA 96/8 heads with q/k norm, 160 experts top-8 of 1536 + 1 shared",
            spec: SynthSpec::Glm4Moe(GlmShape {
                hidden_size: 5120,
                num_layers: 92,
                num_attention_heads: 96,
                num_kv_heads: 8,
                head_dim: 128,
                vocab_size: 151_552,
                num_experts: 160,
                experts_per_token: 8,
                moe_intermediate: 1536,
                n_shared_experts: 1,
                intermediate_size: 12_288,
                first_k_dense: 3,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 2.5,
                use_qk_norm: true,
                partial_rotary_factor: 0.5,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 202_752,
                eos_token_ids: GLM_EOS,
            }),
        },
        Preset {
            name: "glm-4.5-air",
            description: "GLM-4.5-Air (106B-A12B): hidden 4096, 46 layers (first dense, 10944), \
                          GQA 96/8 heads, 128 experts top-8 of 1408 + 1 shared",
            spec: SynthSpec::Glm4Moe(GlmShape {
                hidden_size: 4096,
                num_layers: 46,
                num_attention_heads: 96,
                num_kv_heads: 8,
                head_dim: 128,
                vocab_size: 151_552,
                num_experts: 128,
                experts_per_token: 8,
                moe_intermediate: 1408,
                n_shared_experts: 1,
                intermediate_size: 10_944,
                first_k_dense: 1,
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0,
                use_qk_norm: false,
                partial_rotary_factor: 0.5,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 131_072,
                eos_token_ids: GLM_EOS,
            }),
        },
        Preset {
            name: "qwen3.5-tiny",
            description: "the test fixtures' qwen3_5_moe shape (hidden 128, 4 layers, \
                          16 experts top-4, vocab 1024): a model in milliseconds",
            spec: SynthSpec::Qwen3_5Moe(QwenShape {
                hidden_size: 128,
                num_layers: 4,
                num_attention_heads: 4,
                num_kv_heads: 2,
                head_dim: 32,
                vocab_size: 1024,
                num_experts: 16,
                experts_per_token: 4,
                moe_intermediate: 64,
                shared_intermediate: 64,
                linear_v_heads: 4,
                linear_k_heads: 2,
                linear_head_dim: 32,
                full_attention_interval: 4,
                eos_token_ids: &[2],
            }),
        },
        Preset {
            name: "qwen3-moe-tiny",
            description: "the qwen3moe-q4 fixture's shape (hidden 128, 4 layers, \
                          16 experts top-4, vocab 1024)",
            spec: SynthSpec::Qwen3Moe(Qwen3MoeShape {
                hidden_size: 128,
                num_layers: 4,
                num_attention_heads: 4,
                num_kv_heads: 2,
                head_dim: 32,
                vocab_size: 1024,
                num_experts: 16,
                experts_per_token: 4,
                moe_intermediate: 64,
                intermediate_size: 192,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 4096,
                eos_token_ids: &[2],
            }),
        },
        Preset {
            name: "glm-4.5-tiny",
            description: "the glm4moe-q4 fixture's shape (hidden 128, 4 layers, first dense, \
                          16 experts top-4 in 4 groups, q/k norm, vocab 1024)",
            spec: SynthSpec::Glm4Moe(GlmShape {
                hidden_size: 128,
                num_layers: 4,
                num_attention_heads: 4,
                num_kv_heads: 2,
                head_dim: 32,
                vocab_size: 1024,
                num_experts: 16,
                experts_per_token: 4,
                moe_intermediate: 64,
                n_shared_experts: 1,
                intermediate_size: 192,
                first_k_dense: 1,
                n_group: 4,
                topk_group: 2,
                routed_scaling_factor: 2.5,
                use_qk_norm: true,
                partial_rotary_factor: 0.5,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 4096,
                eos_token_ids: &[2],
            }),
        },
    ]
}

/// The preset called `name`.
pub fn find_preset(name: &str) -> Result<Preset> {
    let all = presets();
    let names: Vec<&str> = all.iter().map(|p| p.name).collect();
    let names = names.join(", ");
    all.into_iter()
        .find(|p| p.name == name)
        .ok_or_else(|| Error::Invalid(format!("unknown preset `{name}` (presets: {names})")))
}

impl SynthSpec {
    pub fn num_layers(&self) -> usize {
        match self {
            SynthSpec::Qwen3_5Moe(s) => s.num_layers,
            SynthSpec::Qwen3Moe(s) => s.num_layers,
            SynthSpec::Glm4Moe(s) => s.num_layers,
            SynthSpec::DeepseekV3(s) => s.num_layers,
            SynthSpec::GptOss(s) => s.num_layers,
        }
    }

    /// The architecture the spec's `config.json` declares.
    pub fn arch(&self) -> Architecture {
        match self {
            SynthSpec::Qwen3_5Moe(_) => Architecture::Qwen3_5Moe,
            SynthSpec::Qwen3Moe(_) => Architecture::Qwen3Moe,
            SynthSpec::Glm4Moe(_) => Architecture::Glm4Moe,
            SynthSpec::DeepseekV3(_) => Architecture::DeepseekV3,
            SynthSpec::GptOss(_) => Architecture::GptOss,
        }
    }

    /// `config.json` in mlx-lm's layout for the first `layers` layers,
    /// without the `quantization` block (added by the writer).
    pub(crate) fn config_json(&self, layers: usize) -> Value {
        match self {
            SynthSpec::Qwen3_5Moe(s) => json!({
                "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "model_type": "qwen3_5_moe",
                "text_config": {
                    "model_type": "qwen3_5_moe_text",
                    "hidden_size": s.hidden_size,
                    "num_hidden_layers": layers,
                    "full_attention_interval": s.full_attention_interval,
                    "num_attention_heads": s.num_attention_heads,
                    "num_key_value_heads": s.num_kv_heads,
                    "head_dim": s.head_dim,
                    "linear_num_value_heads": s.linear_v_heads,
                    "linear_num_key_heads": s.linear_k_heads,
                    "linear_key_head_dim": s.linear_head_dim,
                    "linear_value_head_dim": s.linear_head_dim,
                    "linear_conv_kernel_dim": 4,
                    "num_experts": s.num_experts,
                    "num_experts_per_tok": s.experts_per_token,
                    "moe_intermediate_size": s.moe_intermediate,
                    "shared_expert_intermediate_size": s.shared_intermediate,
                    "norm_topk_prob": true,
                    "rms_norm_eps": 1e-6,
                    "vocab_size": s.vocab_size,
                    "max_position_embeddings": 262_144,
                    "tie_word_embeddings": false,
                    "hidden_act": "silu",
                    "attention_bias": false,
                    "attn_output_gate": true,
                    "dtype": "bfloat16",
                    "eos_token_id": s.eos_token_ids.last(),
                    "rope_parameters": {
                        "rope_theta": 10_000_000,
                        "partial_rotary_factor": 0.25,
                        "type": "default"
                    }
                },
                "tie_word_embeddings": false,
                "eos_token_id": s.eos_token_ids,
            }),
            SynthSpec::Qwen3Moe(s) => json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                "attention_bias": false,
                "attention_dropout": 0.0,
                "bos_token_id": s.eos_token_ids.last(),
                "decoder_sparse_step": 1,
                "eos_token_id": s.eos_token_ids,
                "head_dim": s.head_dim,
                "hidden_act": "silu",
                "hidden_size": s.hidden_size,
                "initializer_range": 0.02,
                "intermediate_size": s.intermediate_size,
                "max_position_embeddings": s.max_position_embeddings,
                "max_window_layers": layers,
                "mlp_only_layers": [],
                "moe_intermediate_size": s.moe_intermediate,
                "norm_topk_prob": true,
                "num_attention_heads": s.num_attention_heads,
                "num_experts": s.num_experts,
                "num_experts_per_tok": s.experts_per_token,
                "num_hidden_layers": layers,
                "num_key_value_heads": s.num_kv_heads,
                "output_router_logits": false,
                "rms_norm_eps": 1e-6,
                "rope_scaling": null,
                "rope_theta": s.rope_theta,
                "router_aux_loss_coef": 0.001,
                "sliding_window": null,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "use_cache": true,
                "use_sliding_window": false,
                "vocab_size": s.vocab_size,
            }),
            SynthSpec::Glm4Moe(s) => json!({
                "architectures": ["Glm4MoeForCausalLM"],
                "model_type": "glm4_moe",
                "attention_bias": true,
                "attention_dropout": 0.0,
                "pad_token_id": s.eos_token_ids.first(),
                "eos_token_id": s.eos_token_ids,
                "head_dim": s.head_dim,
                "hidden_act": "silu",
                "hidden_size": s.hidden_size,
                "partial_rotary_factor": s.partial_rotary_factor,
                "initializer_range": 0.02,
                "intermediate_size": s.intermediate_size,
                "max_position_embeddings": s.max_position_embeddings,
                "moe_intermediate_size": s.moe_intermediate,
                "norm_topk_prob": true,
                "num_attention_heads": s.num_attention_heads,
                "n_group": s.n_group,
                "topk_group": s.topk_group,
                "n_routed_experts": s.num_experts,
                "n_shared_experts": s.n_shared_experts,
                "routed_scaling_factor": s.routed_scaling_factor,
                "num_experts_per_tok": s.experts_per_token,
                "first_k_dense_replace": s.first_k_dense,
                "num_hidden_layers": layers,
                "num_key_value_heads": s.num_kv_heads,
                "rms_norm_eps": 1e-5,
                // mlx-lm requires the key (unused).
                "rope_scaling": null,
                "rope_theta": s.rope_theta,
                // The MTP layer is not written (as mlx_lm.convert drops it).
                "num_nextn_predict_layers": 1,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "use_cache": true,
                "use_qk_norm": s.use_qk_norm,
                "vocab_size": s.vocab_size,
            }),
            SynthSpec::GptOss(s) => json!({
                "architectures": ["GptOssForCausalLM"],
                "model_type": "gpt_oss",
                "attention_bias": true,
                "eos_token_id": s.eos_token_ids.first(),
                "head_dim": s.head_dim,
                "hidden_act": "silu",
                "hidden_size": s.hidden_size,
                "initial_context_length": 4096,
                "intermediate_size": s.intermediate_size,
                "layer_types": (0..layers)
                    .map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" })
                    .collect::<Vec<_>>(),
                "max_position_embeddings": 131_072,
                "num_attention_heads": s.num_attention_heads,
                "num_experts_per_tok": s.experts_per_token,
                "experts_per_token": s.experts_per_token,
                "num_hidden_layers": layers,
                "num_key_value_heads": s.num_kv_heads,
                "num_local_experts": s.num_experts,
                "pad_token_id": s.eos_token_ids.get(1),
                "rms_norm_eps": 1e-5,
                "rope_scaling": {
                    "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                    "original_max_position_embeddings": 4096, "rope_type": "yarn",
                    "truncate": false
                },
                "rope_theta": 150_000,
                "sliding_window": s.sliding_window,
                "swiglu_limit": 7.0,
                "tie_word_embeddings": false,
                "torch_dtype": "bfloat16",
                "vocab_size": s.vocab_size,
            }),
            SynthSpec::DeepseekV3(s) => json!({
                "architectures": ["DeepseekV3ForCausalLM"],
                "model_type": "deepseek_v3",
                "hidden_size": s.hidden_size,
                "num_hidden_layers": layers,
                "num_attention_heads": s.num_attention_heads,
                "num_key_value_heads": s.num_attention_heads,
                "vocab_size": s.vocab_size,
                "intermediate_size": s.intermediate_size,
                "moe_intermediate_size": s.moe_intermediate,
                "n_routed_experts": s.num_experts,
                "n_shared_experts": s.n_shared_experts,
                "num_experts_per_tok": s.experts_per_token,
                "first_k_dense_replace": s.first_k_dense,
                "moe_layer_freq": 1,
                "q_lora_rank": s.q_lora_rank,
                "kv_lora_rank": s.kv_lora_rank,
                "qk_nope_head_dim": s.qk_nope_head_dim,
                "qk_rope_head_dim": s.qk_rope_head_dim,
                "v_head_dim": s.v_head_dim,
                "n_group": s.n_group,
                "topk_group": s.topk_group,
                "routed_scaling_factor": s.routed_scaling_factor,
                "scoring_func": "sigmoid",
                "topk_method": "noaux_tc",
                "norm_topk_prob": true,
                "rms_norm_eps": 1e-6,
                "rope_theta": 10000,
                "rope_scaling": {
                    "type": "yarn",
                    "factor": 40,
                    "original_max_position_embeddings": 4096,
                    "beta_fast": 32,
                    "beta_slow": 1,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0
                },
                "max_position_embeddings": 163_840,
                "tie_word_embeddings": false,
                "attention_bias": false,
                "hidden_act": "silu",
                "torch_dtype": "bfloat16",
                "bos_token_id": 0,
                "eos_token_id": s.eos_token_ids.last(),
            }),
        }
    }
}
