//! `config.json` of the Qwen MoE families, read as mlx-lm reads them:
//! the Qwen3.5 / Qwen3-Next hybrids (GatedDeltaNet + gated attention,
//! nested `text_config`, `layer_types` or `full_attention_interval`) and
//! Qwen3-MoE (plain GQA with q/k norm, `decoder_sparse_step` /
//! `mlp_only_layers`, no shared expert).

use serde_json::{Map, Value};

use super::{
    check_mlp_widths, eos_ids, positive, Architecture, AttentionConfig, Fields, GqaShape,
    LayerKind, LinearAttnConfig, MlpKind, ModelConfig, MoeConfig, RouterKind,
};
use crate::error::Result;

pub(super) fn parse(
    f: &Fields,
    top: &Map<String, Value>,
    arch: Architecture,
) -> Result<ModelConfig> {
    let g = GqaShape::parse(f, 262_144)?;
    // mlx-lm builds these projections without biases: refuse a checkpoint
    // that has them rather than run it without.
    if f.bool_opt("attention_bias")?.unwrap_or(false) {
        return Err(f.err("attention_bias", "attention biases are not supported"));
    }
    let hybrid = arch != Architecture::Qwen3Moe;
    let layer_kinds = if hybrid {
        parse_layer_kinds(f, g.num_layers)?
    } else {
        vec![LayerKind::FullAttention; g.num_layers]
    };
    let linear = if layer_kinds.contains(&LayerKind::LinearAttention) {
        parse_linear(f, arch == Architecture::Qwen3Next)?
    } else {
        LinearAttnConfig::default()
    };

    let moe = MoeConfig {
        num_experts: f.usize_opt("num_experts")?.unwrap_or(0),
        num_experts_per_tok: f.usize_opt("num_experts_per_tok")?.unwrap_or(0),
        moe_intermediate: f.usize_opt("moe_intermediate_size")?.unwrap_or(0),
        shared_intermediate: if hybrid {
            f.usize_opt("shared_expert_intermediate_size")?.unwrap_or(0)
        } else {
            0
        },
        shared_gate: hybrid,
        norm_topk_prob: f
            .bool_opt("norm_topk_prob")?
            .unwrap_or(arch == Architecture::Qwen3_5Moe),
        router: RouterKind::Softmax,
        router_bias: false,
        expert_bias: false,
        activation: Default::default(),
    };
    let mlp_kinds = parse_mlp_kinds(f, arch, g.num_layers, &moe)?;
    check_mlp_widths(f, &mlp_kinds, &moe, g.intermediate_size, "num_experts")?;

    let rope = ModelConfig::parse_rope(f, g.head_dim)?;
    Ok(ModelConfig {
        arch,
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
        layer_kinds,
        attention_window: vec![None; mlp_kinds.len()],
        mlp_kinds,
        attention: AttentionConfig {
            output_gate: hybrid,
            qk_norm: true,
            qkv_bias: false,
            ..Default::default()
        },
        linear,
        moe,
        rope,
        mla: None,
        quantization: ModelConfig::parse_quantization(f, top)?,
        eos_token_ids: eos_ids(f),
    })
}

/// GatedDeltaNet's widths (`fused_projections`: Qwen3-Next's layout), every one positive, value heads a multiple of
/// key heads.
fn parse_linear(f: &Fields, fused_projections: bool) -> Result<LinearAttnConfig> {
    let linear = LinearAttnConfig {
        fused_projections,
        num_v_heads: f.usize("linear_num_value_heads")?,
        num_k_heads: f.usize("linear_num_key_heads")?,
        key_head_dim: f.usize("linear_key_head_dim")?,
        value_head_dim: f.usize("linear_value_head_dim")?,
        conv_kernel: f.usize_opt("linear_conv_kernel_dim")?.unwrap_or(4),
    };
    for (name, v) in [
        ("linear_num_value_heads", linear.num_v_heads),
        ("linear_num_key_heads", linear.num_k_heads),
        ("linear_key_head_dim", linear.key_head_dim),
        ("linear_value_head_dim", linear.value_head_dim),
        ("linear_conv_kernel_dim", linear.conv_kernel),
    ] {
        positive(f, name, v)?;
    }
    if !linear.num_v_heads.is_multiple_of(linear.num_k_heads) {
        return Err(f.err(
            "linear_num_value_heads",
            format!(
                "{} is not a multiple of linear_num_key_heads {}",
                linear.num_v_heads, linear.num_k_heads
            ),
        ));
    }
    Ok(linear)
}

/// mlx-lm derives the layer pattern from `full_attention_interval`; HF
/// configs also carry `layer_types`. Accept either, refuse a contradiction.
fn parse_layer_kinds(f: &Fields, num_layers: usize) -> Result<Vec<LayerKind>> {
    let from_types = match f.get("layer_types") {
        None => None,
        Some(Value::Array(a)) => {
            let mut kinds = Vec::with_capacity(a.len());
            for (i, v) in a.iter().enumerate() {
                kinds.push(match v.as_str() {
                    Some("linear_attention") => LayerKind::LinearAttention,
                    Some("full_attention") => LayerKind::FullAttention,
                    _ => {
                        return Err(f.err(
                            "layer_types",
                            format!(
                            "entry {i} is {v}; expected \"linear_attention\" or \"full_attention\""
                        ),
                        ))
                    }
                });
            }
            if kinds.len() != num_layers {
                return Err(f.err(
                    "layer_types",
                    format!(
                        "has {} entries but num_hidden_layers is {num_layers}",
                        kinds.len()
                    ),
                ));
            }
            Some(kinds)
        }
        Some(v) => return Err(f.err("layer_types", format!("expected a list, got {v}"))),
    };
    let from_interval = match f.usize_opt("full_attention_interval")? {
        None => None,
        Some(0) => return Err(f.err("full_attention_interval", "must be greater than zero")),
        Some(n) => Some(
            (0..num_layers)
                .map(|i| {
                    if (i + 1) % n == 0 {
                        LayerKind::FullAttention
                    } else {
                        LayerKind::LinearAttention
                    }
                })
                .collect::<Vec<_>>(),
        ),
    };
    match (from_types, from_interval) {
        (Some(t), Some(i)) if t != i => Err(f.err(
            "layer_types",
            "contradicts full_attention_interval; fix one of them",
        )),
        (Some(t), _) => Ok(t),
        (None, Some(i)) => Ok(i),
        (None, None) => Ok((0..num_layers)
            .map(|i| {
                if (i + 1) % 4 == 0 {
                    LayerKind::FullAttention
                } else {
                    LayerKind::LinearAttention
                }
            })
            .collect()),
    }
}

fn parse_mlp_kinds(
    f: &Fields,
    arch: Architecture,
    num_layers: usize,
    moe: &MoeConfig,
) -> Result<Vec<MlpKind>> {
    if moe.num_experts == 0 {
        return Ok(vec![MlpKind::Dense; num_layers]);
    }
    // mlx-lm's qwen3_5 makes every layer MoE when num_experts > 0;
    // qwen3_next and qwen3_moe read decoder_sparse_step and mlp_only_layers.
    match arch {
        Architecture::Qwen3_5Moe => Ok(vec![MlpKind::Moe; num_layers]),
        _ => {
            let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
            if step == 0 {
                return Err(f.err("decoder_sparse_step", "must be greater than zero"));
            }
            let only: Vec<usize> = match f.get("mlp_only_layers") {
                None => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_u64().map(|x| x as usize).ok_or_else(|| {
                            f.err("mlp_only_layers", format!("entry {v} is not an integer"))
                        })
                    })
                    .collect::<Result<_>>()?,
                Some(v) => {
                    return Err(f.err("mlp_only_layers", format!("expected a list, got {v}")))
                }
            };
            Ok((0..num_layers)
                .map(|i| {
                    if !only.contains(&i) && (i + 1) % step == 0 {
                        MlpKind::Moe
                    } else {
                        MlpKind::Dense
                    }
                })
                .collect())
        }
    }
}
