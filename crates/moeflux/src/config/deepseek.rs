//! `config.json` of the DeepSeek-V3 family (`deepseek_v3`, `kimi_k2`, and
//! `kimi_k25` whose fields sit in a nested `text_config`), read the
//! way mlx-lm's `deepseek_v3.ModelArgs` reads it (same defaults), with every
//! value checked and errors naming the field.

use serde_json::{Map, Value};

use super::{
    eos_ids, layer_count, positive, Architecture, AttentionConfig, Fields, LayerKind,
    LinearAttnConfig, MlaConfig, MlpKind, ModelConfig, MoeConfig, RopeConfig, RouterKind,
    YarnConfig,
};
use crate::error::Result;

pub(super) fn parse(
    f: &Fields,
    top: &Map<String, Value>,
    arch: Architecture,
) -> Result<ModelConfig> {
    let hidden_size = positive(f, "hidden_size", f.usize("hidden_size")?)?;
    let num_layers = layer_count(f)?;
    let num_attention_heads = positive(f, "num_attention_heads", f.usize("num_attention_heads")?)?;
    let vocab_size = positive(f, "vocab_size", f.usize("vocab_size")?)?;
    let rms_norm_eps = f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6) as f32;
    let max_position_embeddings = f.usize_opt("max_position_embeddings")?.unwrap_or(2048);
    let tie_word_embeddings = f.bool_opt("tie_word_embeddings")?.unwrap_or(false);
    if f.bool_opt("attention_bias")?.unwrap_or(false) {
        return Err(f.err("attention_bias", "attention biases are not supported"));
    }

    let mla = MlaConfig {
        // `null` (Kimi-K2 variants, DeepSeek-V2-Lite) means a plain q_proj.
        q_lora_rank: match f.usize_opt("q_lora_rank")? {
            Some(r) => Some(positive(f, "q_lora_rank", r)?),
            None => None,
        },
        kv_lora_rank: positive(f, "kv_lora_rank", f.usize("kv_lora_rank")?)?,
        qk_nope_head_dim: positive(f, "qk_nope_head_dim", f.usize("qk_nope_head_dim")?)?,
        qk_rope_head_dim: positive(f, "qk_rope_head_dim", f.usize("qk_rope_head_dim")?)?,
        v_head_dim: positive(f, "v_head_dim", f.usize("v_head_dim")?)?,
    };
    if !mla.qk_rope_head_dim.is_multiple_of(2) {
        return Err(f.err(
            "qk_rope_head_dim",
            format!(
                "{} is odd; rotary pairs need an even width",
                mla.qk_rope_head_dim
            ),
        ));
    }

    let intermediate_size = f.usize_opt("intermediate_size")?.unwrap_or(0);
    let moe = parse_moe(f)?;
    let first_dense = f.usize_opt("first_k_dense_replace")?.unwrap_or(0);
    let freq = f.usize_opt("moe_layer_freq")?.unwrap_or(1);
    if freq == 0 {
        return Err(f.err("moe_layer_freq", "must be greater than zero"));
    }
    // mlx-lm: MoE iff n_routed_experts is set, i >= first_k_dense_replace and
    // i % moe_layer_freq == 0.
    let mlp_kinds: Vec<MlpKind> = (0..num_layers)
        .map(|i| {
            if moe.num_experts > 0 && i >= first_dense && i % freq == 0 {
                MlpKind::Moe
            } else {
                MlpKind::Dense
            }
        })
        .collect();
    if mlp_kinds.contains(&MlpKind::Dense) {
        positive(f, "intermediate_size", intermediate_size)?;
    }
    if mlp_kinds.contains(&MlpKind::Moe) {
        check_moe(f, &moe)?;
    }

    let rope = parse_rope(f, mla.qk_rope_head_dim)?;
    let quantization = ModelConfig::parse_quantization(f, top)?;
    Ok(ModelConfig {
        arch,
        hidden_size,
        num_layers,
        num_attention_heads,
        // MLA has no grouped KV heads: every head reads the shared latent.
        num_kv_heads: num_attention_heads,
        head_dim: mla.q_head_dim(),
        vocab_size,
        rms_norm_eps,
        intermediate_size,
        max_position_embeddings,
        tie_word_embeddings,
        layer_kinds: vec![LayerKind::Mla; num_layers],
        attention_window: vec![None; num_layers],
        mlp_kinds,
        // MLA layers only: no GQA attention, no GatedDeltaNet.
        attention: AttentionConfig::default(),
        linear: LinearAttnConfig::default(),
        moe,
        rope,
        mla: Some(mla),
        quantization,
        eos_token_ids: eos_ids(f),
    })
}

pub(super) fn parse_moe(f: &Fields) -> Result<MoeConfig> {
    let num_experts = f.usize_opt("n_routed_experts")?.unwrap_or(0);
    let moe_intermediate = f.usize_opt("moe_intermediate_size")?.unwrap_or(0);
    let shared = f.usize_opt("n_shared_experts")?.unwrap_or(0);
    match f.get("scoring_func").map(|v| (v, v.as_str())) {
        None | Some((_, Some("sigmoid"))) => {}
        Some((v, _)) => {
            return Err(f.err(
                "scoring_func",
                format!("{v} is not supported (only \"sigmoid\", as mlx-lm)"),
            ))
        }
    }
    match f.get("topk_method").map(|v| (v, v.as_str())) {
        None | Some((_, Some("noaux_tc"))) => {}
        Some((v, _)) => {
            return Err(f.err(
                "topk_method",
                format!("{v} is not supported (only \"noaux_tc\", as mlx-lm)"),
            ))
        }
    }
    let scaling = f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0);
    if !(scaling.is_finite() && scaling > 0.0) {
        return Err(f.err(
            "routed_scaling_factor",
            format!("{scaling} must be positive"),
        ));
    }
    Ok(MoeConfig {
        num_experts,
        num_experts_per_tok: f.usize_opt("num_experts_per_tok")?.unwrap_or(1),
        moe_intermediate,
        shared_intermediate: moe_intermediate.checked_mul(shared).ok_or_else(|| {
            f.err(
                "n_shared_experts",
                format!("{shared} times moe_intermediate_size {moe_intermediate} overflows"),
            )
        })?,
        shared_gate: false,
        norm_topk_prob: f.bool_opt("norm_topk_prob")?.unwrap_or(true),
        router: RouterKind::NoauxTc {
            n_group: f.usize_opt("n_group")?.unwrap_or(1),
            topk_group: f.usize_opt("topk_group")?.unwrap_or(1),
            routed_scaling_factor: scaling as f32,
        },
        router_bias: false,
        expert_bias: false,
        activation: Default::default(),
    })
}

/// The group-limited choice must be able to find `num_experts_per_tok` experts.
pub(super) fn check_moe(f: &Fields, m: &MoeConfig) -> Result<()> {
    positive(f, "n_routed_experts", m.num_experts)?;
    positive(f, "num_experts_per_tok", m.num_experts_per_tok)?;
    positive(f, "moe_intermediate_size", m.moe_intermediate)?;
    let RouterKind::NoauxTc {
        n_group,
        topk_group,
        ..
    } = m.router
    else {
        unreachable!("parse_moe builds a noaux_tc router");
    };
    positive(f, "n_group", n_group)?;
    if !m.num_experts.is_multiple_of(n_group) {
        return Err(f.err(
            "n_group",
            format!(
                "{n_group} does not divide n_routed_experts {}",
                m.num_experts
            ),
        ));
    }
    if topk_group == 0 || topk_group > n_group {
        return Err(f.err(
            "topk_group",
            format!("{topk_group} must be in 1..=n_group ({n_group})"),
        ));
    }
    let per_group = m.num_experts / n_group;
    if n_group > 1 && per_group < 2 {
        return Err(f.err(
            "n_group",
            format!("{n_group} groups of {per_group} expert; a group score sums its top 2"),
        ));
    }
    let reachable = if n_group > 1 {
        topk_group * per_group
    } else {
        m.num_experts
    };
    if m.num_experts_per_tok > reachable {
        return Err(f.err(
            "num_experts_per_tok",
            format!(
                "{} exceeds the {reachable} experts of the topk_group={topk_group} groups kept",
                m.num_experts_per_tok
            ),
        ));
    }
    Ok(())
}

/// `rope_theta` plus `rope_scaling` (`yarn`/`deepseek_yarn`, `linear` or none), applied
/// to the `qk_rope_head_dim` channels with interleaved pairs (mlx `traditional=True`).
pub(super) fn parse_rope(f: &Fields, rotary_dim: usize) -> Result<RopeConfig> {
    let theta = f.f64_opt("rope_theta")?.unwrap_or(10_000.0);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(f.err("rope_theta", "must be positive"));
    }
    let mut rope = RopeConfig {
        theta,
        rotary_dim,
        position_scale: 1.0,
        interleaved: true,
        yarn: None,
    };
    let scaling = match f.get("rope_scaling") {
        None => return Ok(rope),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(f.err("rope_scaling", format!("expected an object, got {v}"))),
    };
    let num = |key: &str, default: Option<f64>| -> Result<f64> {
        let field = format!("rope_scaling.{key}");
        match scaling.get(key).filter(|v| !v.is_null()) {
            Some(v) => {
                let x = v
                    .as_f64()
                    .ok_or_else(|| f.err(&field, format!("expected a number, got {v}")))?;
                if !x.is_finite() {
                    return Err(f.err(&field, format!("{x} is not finite")));
                }
                Ok(x)
            }
            None => default.ok_or_else(|| f.err(&field, "missing")),
        }
    };
    let kind = scaling
        .get("type")
        .or_else(|| scaling.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => {}
        "linear" => {
            let factor = num("factor", None)?;
            if factor <= 0.0 {
                return Err(f.err("rope_scaling.factor", "must be positive"));
            }
            rope.position_scale = 1.0 / factor;
        }
        "yarn" | "deepseek_yarn" => {
            let y = YarnConfig {
                factor: num("factor", None)?,
                original_max_position_embeddings: num(
                    "original_max_position_embeddings",
                    Some(4096.0),
                )?,
                beta_fast: num("beta_fast", Some(32.0))?,
                beta_slow: num("beta_slow", Some(1.0))?,
                mscale: num("mscale", Some(1.0))?,
                mscale_all_dim: num("mscale_all_dim", Some(0.0))?,
            };
            if y.factor <= 0.0 {
                return Err(f.err("rope_scaling.factor", "must be positive"));
            }
            if y.original_max_position_embeddings <= 0.0 {
                return Err(f.err(
                    "rope_scaling.original_max_position_embeddings",
                    "must be positive",
                ));
            }
            if y.beta_fast <= 0.0 || y.beta_slow <= 0.0 {
                return Err(f.err(
                    "rope_scaling.beta_fast",
                    "beta_fast and beta_slow must be positive",
                ));
            }
            rope.yarn = Some(y);
        }
        other => {
            return Err(f.err(
                "rope_scaling.type",
                format!("rope type `{other}` is not supported (supported: default, linear, yarn)"),
            ))
        }
    }
    Ok(rope)
}

#[cfg(test)]
mod tests {
    use super::super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_json(&v, std::path::Path::new("config.json"))
    }

    /// DeepSeek-V3's own config.json (the fields mlx-lm reads).
    fn v3() -> Value {
        json!({
            "model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
            "num_attention_heads": 128, "num_key_value_heads": 128, "vocab_size": 129280,
            "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
            "moe_layer_freq": 1, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": true,
            "rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]},
            "eos_token_id": 1
        })
    }

    #[test]
    fn deepseek_v3_shape() {
        let c = parse(v3()).unwrap();
        assert_eq!(c.arch, Architecture::DeepseekV3);
        let m = c.mla.unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.cache_row()),
            (Some(1536), 512, 576)
        );
        assert_eq!(c.head_dim, 192);
        assert!(c.layer_kinds.iter().all(|k| *k == LayerKind::Mla));
        assert_eq!(
            c.mlp_kinds[..4],
            [MlpKind::Dense, MlpKind::Dense, MlpKind::Dense, MlpKind::Moe]
        );
        assert_eq!(c.moe.shared_intermediate, 2048);
        assert_eq!(
            c.moe.router,
            RouterKind::NoauxTc {
                n_group: 8,
                topk_group: 4,
                routed_scaling_factor: 2.5
            }
        );
        let y = c.rope.yarn.unwrap();
        assert_eq!((y.factor, y.mscale_all_dim), (40.0, 1.0));
        assert!(c.rope.interleaved && c.rope.rotary_dim == 64);
        // The FP8 quantization_config describes the source, not MLX groups.
        assert!(c.quantization.is_none());
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn kimi_k2_null_q_lora_and_yarn_defaults() {
        let mut v = v3();
        v["model_type"] = json!("kimi_k2");
        v["q_lora_rank"] = Value::Null;
        v["n_group"] = json!(1);
        v["topk_group"] = json!(1);
        v["moe_layer_freq"] = json!(2);
        v["rope_scaling"] = json!({"type": "deepseek_yarn", "factor": 32});
        let c = parse(v).unwrap();
        assert_eq!(c.arch, Architecture::KimiK2);
        assert_eq!(c.mla.unwrap().q_lora_rank, None);
        // MoE from layer 3 on, every second layer (i % moe_layer_freq == 0).
        assert_eq!(
            c.mlp_kinds[3..7],
            [MlpKind::Dense, MlpKind::Moe, MlpKind::Dense, MlpKind::Moe]
        );
        let y = c.rope.yarn.unwrap();
        assert_eq!(
            (
                y.original_max_position_embeddings,
                y.beta_fast,
                y.beta_slow,
                y.mscale,
                y.mscale_all_dim
            ),
            (4096.0, 32.0, 1.0, 1.0, 0.0)
        );
    }

    #[test]
    fn kimi_k25_nested_text_config() {
        let text = v3();
        let v = json!({
            "architectures": ["KimiK25ForConditionalGeneration"],
            "model_type": "kimi_k25",
            "text_config": text,
            "vision_config": {"hidden_size": 1152},
        });
        let c = parse(v).unwrap();
        assert_eq!(c.arch, Architecture::KimiK25);
        assert_eq!(c.hidden_size, 7168);
        assert_eq!(c.mla.unwrap().kv_lora_rank, 512);
        assert!(c.arch.is_deepseek() && c.arch.nests_language_model());
    }

    #[test]
    fn bad_values_name_their_field() {
        let cases: Vec<(&str, Value, &str)> = vec![
            ("kv_lora_rank", Value::Null, "kv_lora_rank"),
            ("qk_rope_head_dim", json!(63), "qk_rope_head_dim"),
            ("scoring_func", json!("softmax"), "scoring_func"),
            ("topk_method", json!("greedy"), "topk_method"),
            ("n_group", json!(7), "n_group"),
            ("topk_group", json!(9), "topk_group"),
            ("num_experts_per_tok", json!(200), "num_experts_per_tok"),
            (
                "routed_scaling_factor",
                json!(-1.0),
                "routed_scaling_factor",
            ),
            ("moe_layer_freq", json!(0), "moe_layer_freq"),
            ("intermediate_size", json!(0), "intermediate_size"),
            (
                "rope_scaling",
                json!({"type": "yarn"}),
                "rope_scaling.factor",
            ),
            (
                "rope_scaling",
                json!({"type": "longrope", "factor": 2}),
                "rope_scaling.type",
            ),
            ("v_head_dim", json!("128"), "v_head_dim"),
            // Sizes a hostile config could make overflow the shape arithmetic.
            ("num_hidden_layers", json!(1u64 << 62), "num_hidden_layers"),
            (
                "kv_lora_rank",
                json!(1u64 << 20),
                "num_attention_heads * kv_lora_rank",
            ),
            ("n_shared_experts", json!(1u64 << 62), "n_shared_experts"),
            ("vocab_size", json!(1u64 << 40), "vocab_size"),
        ];
        for (field, value, named) in cases {
            let mut v = v3();
            v[field] = value.clone();
            let e = parse(v).expect_err(field).to_string();
            assert!(e.contains(named), "{field} = {value}: {e}");
        }
        let mut v = v3();
        v["quantization_config"]["quant_method"] = json!("gptq");
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains("quant_method") && e.contains("gptq"), "{e}");
    }
}
