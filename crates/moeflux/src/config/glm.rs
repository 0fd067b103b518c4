//! `config.json` of GLM-4.5 / 4.6 (`glm4_moe`), read as mlx-lm's
//! `glm4_moe.ModelArgs` reads it: GQA with q/k/v biases (`attention_bias`),
//! q/k RMSNorm when `use_qk_norm`, half-split rotary over
//! `head_dim * partial_rotary_factor` channels; DeepSeek's `noaux_tc`
//! router, `n_shared_experts` ungated shared experts, dense layers before
//! `first_k_dense_replace`. The multi-token-prediction layers
//! (`num_nextn_predict_layers`) are not part of the model run here.

use serde_json::{Map, Value};

use super::deepseek::{check_moe, parse_moe};
use super::{
    eos_ids, positive, Architecture, AttentionConfig, Fields, GqaShape, LayerKind,
    LinearAttnConfig, MlpKind, ModelConfig,
};
use crate::error::Result;

pub(super) fn parse(f: &Fields, top: &Map<String, Value>) -> Result<ModelConfig> {
    let g = GqaShape::parse(f, 131_072)?;
    let moe = parse_moe(f)?;
    let first_dense = f.usize_opt("first_k_dense_replace")?.unwrap_or(0);
    let mlp_kinds: Vec<MlpKind> = (0..g.num_layers)
        .map(|i| {
            if moe.num_experts > 0 && i >= first_dense {
                MlpKind::Moe
            } else {
                MlpKind::Dense
            }
        })
        .collect();
    if mlp_kinds.contains(&MlpKind::Dense) {
        positive(f, "intermediate_size", g.intermediate_size)?;
    }
    if mlp_kinds.contains(&MlpKind::Moe) {
        check_moe(f, &moe)?;
    }
    let rope = ModelConfig::parse_rope(f, g.head_dim)?;
    Ok(ModelConfig {
        arch: Architecture::Glm4Moe,
        hidden_size: g.hidden_size,
        num_layers: g.num_layers,
        num_attention_heads: g.num_attention_heads,
        num_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        vocab_size: g.vocab_size,
        rms_norm_eps: g.rms_norm_eps,
        intermediate_size: g.intermediate_size,
        max_position_embeddings: g.max_position_embeddings,
        tie_word_embeddings: g.tie_word_embeddings,
        layer_kinds: vec![LayerKind::FullAttention; g.num_layers],
        attention_window: vec![None; mlp_kinds.len()],
        mlp_kinds,
        attention: AttentionConfig {
            output_gate: false,
            qk_norm: f.bool_opt("use_qk_norm")?.unwrap_or(false),
            qkv_bias: f.bool_opt("attention_bias")?.unwrap_or(false),
            ..Default::default()
        },
        linear: LinearAttnConfig::default(),
        moe,
        rope,
        mla: None,
        quantization: ModelConfig::parse_quantization(f, top)?,
        eos_token_ids: eos_ids(f),
    })
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, std::path::Path::new("config.json"))
    }

    /// GLM-4.5-Air's config.json.
    fn air() -> Value {
        json!({
            "architectures": ["Glm4MoeForCausalLM"], "attention_bias": true,
            "eos_token_id": [151329, 151336, 151338], "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 4096, "partial_rotary_factor": 0.5, "intermediate_size": 10944,
            "max_position_embeddings": 131072, "model_type": "glm4_moe",
            "moe_intermediate_size": 1408, "norm_topk_prob": true, "num_attention_heads": 96,
            "n_group": 1, "topk_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
            "routed_scaling_factor": 1.0, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
            "num_hidden_layers": 46, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_scaling": null, "rope_theta": 1000000, "num_nextn_predict_layers": 1,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_qk_norm": false,
            "vocab_size": 151552
        })
    }

    #[test]
    fn glm_4_5_air_shape() {
        let c = parse(air()).unwrap();
        assert_eq!(c.arch, Architecture::Glm4Moe);
        assert_eq!(
            (c.num_attention_heads, c.num_kv_heads, c.head_dim),
            (96, 8, 128)
        );
        assert_eq!(c.rope.rotary_dim, 64);
        assert!(!c.rope.interleaved);
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(
            c.attention,
            AttentionConfig {
                output_gate: false,
                qk_norm: false,
                qkv_bias: true,
                ..Default::default()
            }
        );
        assert!(c.layer_kinds.iter().all(|k| *k == LayerKind::FullAttention));
        assert_eq!(c.mlp_kinds[..2], [MlpKind::Dense, MlpKind::Moe]);
        assert_eq!(c.mlp_kinds.len(), 46);
        assert_eq!((c.moe.num_experts, c.moe.shared_intermediate), (128, 1408));
        assert!(!c.moe.shared_gate);
        assert_eq!(
            c.moe.router,
            RouterKind::NoauxTc {
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: 1.0
            }
        );
        assert_eq!(c.eos_token_ids, vec![151329, 151336, 151338]);
    }

    #[test]
    fn glm_4_6_qk_norm_and_bad_fields() {
        let mut v = air();
        v["use_qk_norm"] = json!(true);
        v["first_k_dense_replace"] = json!(3);
        v["routed_scaling_factor"] = json!(2.5);
        let c = parse(v).unwrap();
        assert!(c.attention.qk_norm);
        assert_eq!(c.mlp_kinds[2..4], [MlpKind::Dense, MlpKind::Moe]);
        for (field, value, named) in [
            ("partial_rotary_factor", json!(0.0), "partial_rotary_factor"),
            ("n_group", json!(3), "n_group"),
            ("num_key_value_heads", json!(7), "num_key_value_heads"),
            ("use_qk_norm", json!("yes"), "use_qk_norm"),
            ("intermediate_size", json!(0), "intermediate_size"),
        ] {
            let mut v = air();
            v[field] = value.clone();
            let e = parse(v).expect_err(field).to_string();
            assert!(e.contains(named), "{field} = {value}: {e}");
        }
    }
}
