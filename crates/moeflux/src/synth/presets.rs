//! The shapes `moeflux synth` can build: a [`SynthSpec`] per architecture
//! family and the named presets. Adding a model is a row in [`PRESETS`];
//! adding a family (DeepSeek-V3 for Cogito-V2) is a variant of `SynthSpec`
//! with its `config.json`, plus init rules for its new tensors in `init.rs`.

use serde_json::{json, Value};

use crate::error::{Error, Result};

/// The shape of a synthetic model. The CLI takes it from a preset; tests
/// build small ones directly.
#[derive(Debug, Clone, PartialEq)]
pub enum SynthSpec {
    Qwen3_5Moe(QwenShape),
    DeepseekV3(DeepseekShape),
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

/// Every preset, as listed by `moeflux synth --help`.
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
            SynthSpec::DeepseekV3(s) => s.num_layers,
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
