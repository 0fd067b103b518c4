//! `config.json` of gpt-oss (`gpt_oss`), read as mlx-lm's `gpt_oss.ModelArgs`
//! reads it: GQA with learned sinks and biases on q/k/v/o, `layer_types`
//! alternating `sliding_attention` (a window of `sliding_window` positions)
//! and `full_attention`, half-split rotary with optional YaRN scaling (mlx-lm's
//! `YarnRoPE`: the correction range is rounded, whatever HF's `truncate`
//! says), every layer MoE: `num_local_experts` experts of width
//! `intermediate_size`, top-`num_experts_per_tok` over the router's logits.

use serde_json::{Map, Value};

use super::deepseek::parse_rope;
use super::{
    check_mlp_widths, eos_ids, Architecture, AttentionConfig, ExpertActivation, Fields, GqaShape,
    LayerKind, LinearAttnConfig, MlpKind, ModelConfig, MoeConfig, RouterKind,
};
use crate::error::Result;

/// mlx-lm's `SwigluOAI` defaults (the released models use them).
const SWIGLU_ALPHA: f32 = 1.702;
const SWIGLU_LIMIT: f32 = 7.0;

pub(super) fn parse(f: &Fields, top: &Map<String, Value>) -> Result<ModelConfig> {
    let g = GqaShape::parse(f, 131_072)?;
    let n = g.num_layers;
    let window = f.usize_opt("sliding_window")?.unwrap_or(128);
    let attention_window = parse_windows(f, n, window)?;
    // The experts' width (checked here so the error names gpt-oss's field).
    super::positive(f, "intermediate_size", g.intermediate_size)?;
    let moe = MoeConfig {
        num_experts: f.usize_opt("num_local_experts")?.unwrap_or(128),
        num_experts_per_tok: f.usize_opt("num_experts_per_tok")?.unwrap_or(4),
        moe_intermediate: g.intermediate_size,
        shared_intermediate: 0,
        shared_gate: false,
        norm_topk_prob: false,
        router: RouterKind::TopKSoftmax,
        router_bias: true,
        expert_bias: true,
        activation: ExpertActivation::SwigluOai {
            alpha: SWIGLU_ALPHA,
            limit: SWIGLU_LIMIT,
        },
    };
    let mlp_kinds = vec![MlpKind::Moe; n];
    check_mlp_widths(f, &mlp_kinds, &moe, 0, "num_local_experts")?;
    let mut rope = parse_rope(f, g.head_dim)?;
    rope.interleaved = false;
    if f.get("rope_theta").is_none() {
        rope.theta = 150_000.0;
    }
    Ok(ModelConfig {
        arch: Architecture::GptOss,
        hidden_size: g.hidden_size,
        num_layers: n,
        num_attention_heads: g.num_attention_heads,
        num_kv_heads: g.num_kv_heads,
        head_dim: g.head_dim,
        vocab_size: g.vocab_size,
        rms_norm_eps: g.rms_norm_eps,
        intermediate_size: 0,
        max_position_embeddings: g.max_position_embeddings,
        tie_word_embeddings: g.tie_word_embeddings,
        layer_kinds: vec![LayerKind::FullAttention; n],
        attention_window,
        mlp_kinds,
        attention: AttentionConfig {
            output_gate: false,
            qk_norm: false,
            qkv_bias: true,
            o_bias: true,
            sinks: true,
        },
        linear: LinearAttnConfig::default(),
        moe,
        rope,
        mla: None,
        quantization: ModelConfig::parse_quantization(f, top)?,
        eos_token_ids: eos_ids(f),
    })
}

/// `layer_types` (default: sliding and full alternating, as mlx-lm).
fn parse_windows(f: &Fields, n: usize, window: usize) -> Result<Vec<Option<usize>>> {
    if window == 0 {
        return Err(f.err("sliding_window", "must be greater than zero"));
    }
    let Some(v) = f.get("layer_types") else {
        return Ok((0..n).map(|i| (i % 2 == 0).then_some(window)).collect());
    };
    let list = v
        .as_array()
        .ok_or_else(|| f.err("layer_types", format!("expected a list, got {v}")))?;
    if list.len() != n {
        return Err(f.err(
            "layer_types",
            format!("{} entries for {n} layers", list.len()),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            Some("sliding_attention") => Ok(Some(window)),
            Some("full_attention") => Ok(None),
            _ => Err(f.err(
                &format!("layer_types[{i}]"),
                format!("{t} is not sliding_attention or full_attention"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, std::path::Path::new("config.json"))
    }

    /// gpt-oss-120b's `config.json` as released (quantization_config aside).
    fn gpt_oss_120b() -> Value {
        json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880,
            "layer_types": (0..36).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect::<Vec<_>>(),
            "max_position_embeddings": 131072, "model_type": "gpt_oss",
            "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
            "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": false,
            "pad_token_id": 199999, "rms_norm_eps": 1e-05,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "rope_type": "yarn",
                             "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
            "swiglu_limit": 7.0, "tie_word_embeddings": false, "transformers_version": "4.55.0.dev0",
            "use_cache": true, "vocab_size": 201088
        })
    }

    #[test]
    fn gpt_oss_120b_config() {
        let c = parse(gpt_oss_120b()).unwrap();
        assert_eq!(c.arch, Architecture::GptOss);
        assert_eq!((c.hidden_size, c.num_layers, c.head_dim), (2880, 36, 64));
        assert_eq!((c.num_attention_heads, c.num_kv_heads), (64, 8));
        assert_eq!((c.moe.num_experts, c.moe.num_experts_per_tok), (128, 4));
        assert_eq!(c.moe.moe_intermediate, 2880);
        assert_eq!(c.moe.router, RouterKind::TopKSoftmax);
        assert!(c.moe.router_bias && c.moe.expert_bias);
        assert!(matches!(
            c.moe.activation,
            ExpertActivation::SwigluOai { limit, .. } if limit == 7.0
        ));
        assert_eq!(c.attention_window[0], Some(128));
        assert_eq!(c.attention_window[1], None);
        assert_eq!(c.attention_window[35], None);
        let a = c.attention;
        assert!(a.sinks && a.o_bias && a.qkv_bias && !a.qk_norm && !a.output_gate);
        assert!(!c.rope.interleaved);
        assert_eq!(c.rope.rotary_dim, 64);
        assert_eq!(c.rope.theta, 150000.0);
        let y = c.rope.yarn.unwrap();
        assert_eq!(
            (y.factor, y.original_max_position_embeddings),
            (32.0, 4096.0)
        );
        assert_eq!(c.mlp_kinds, vec![MlpKind::Moe; 36]);
        assert_eq!(c.eos_token_ids, vec![200002]);
    }

    #[test]
    fn gpt_oss_default_layer_types_alternate() {
        let mut v = gpt_oss_120b();
        v.as_object_mut().unwrap().remove("layer_types");
        let c = parse(v).unwrap();
        assert_eq!(&c.attention_window[..3], &[Some(128), None, Some(128)]);
    }

    #[test]
    fn gpt_oss_bad_values_name_the_field() {
        for (field, value, named) in [
            ("layer_types", json!(["sliding_attention"]), "layer_types"),
            (
                "layer_types",
                json!((0..36)
                    .map(|i| if i % 2 == 0 {
                        "sliding_attention"
                    } else {
                        "chunked"
                    })
                    .collect::<Vec<_>>()),
                "layer_types[1]",
            ),
            ("sliding_window", json!(0), "sliding_window"),
            ("num_experts_per_tok", json!(129), "num_experts_per_tok"),
            ("num_local_experts", json!(0), "num_local_experts"),
            ("intermediate_size", json!(0), "intermediate_size"),
        ] {
            let mut v = gpt_oss_120b();
            v[field] = value;
            let e = parse(v).unwrap_err().to_string();
            assert!(e.contains(named), "{field}: {e}");
        }
    }
}
