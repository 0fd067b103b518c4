//! llama.cpp architectures -> moeflux's families: `config.json` from the
//! GGUF hyperparameters and mlx-lm tensor names from llama.cpp's
//! (`gguf-py/gguf/tensor_mapping.py`, `constants.py`).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value as Json};

use crate::error::{Error, Result};

use super::file::{TensorInfo, Value};

/// A llama.cpp architecture moeflux converts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufArch {
    Qwen3Moe,
    GptOss,
    Glm4Moe,
}

impl GgufArch {
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "qwen3moe" => Some(GgufArch::Qwen3Moe),
            "gpt-oss" => Some(GgufArch::GptOss),
            "glm4moe" => Some(GgufArch::Glm4Moe),
            _ => None,
        }
    }
}

/// llama.cpp architectures of moeflux's other families, not mapped yet.
pub const NOT_YET: [&str; 4] = ["qwen35moe", "qwen3next", "deepseek2", "kimi-k2"];

pub struct Meta<'a> {
    pub kv: &'a BTreeMap<String, Value>,
    pub arch: &'a str,
    pub path: &'a Path,
}

impl Meta<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.kv.get(&format!("{}.{k}", self.arch))
    }
    fn err(&self, k: &str, why: impl std::fmt::Display) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            field: format!("{}.{k}", self.arch),
            reason: why.to_string(),
        }
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?
            .ok_or_else(|| self.err(k, "missing from the GGUF metadata"))
    }
    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.err(
                        k,
                        format!("expected an unsigned integer (one for all layers), got {v:?}"),
                    )
                }),
        }
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(k, format!("expected a number, got {v:?}"))),
        }
    }
}

/// `rope_scaling` from `ARCH.rope.scaling.*` (none, linear or YaRN).
fn rope_scaling(m: &Meta) -> Result<Json> {
    let kind = match m.get("rope.scaling.type") {
        None => "none",
        Some(v) => v
            .as_str()
            .ok_or_else(|| m.err("rope.scaling.type", "expected a string"))?,
    };
    let factor = m.f64_opt("rope.scaling.factor")?;
    Ok(match kind {
        "none" => Json::Null,
        "linear" => json!({"rope_type": "linear", "factor": factor.unwrap_or(1.0)}),
        "yarn" => {
            let mut o = json!({
                "rope_type": "yarn",
                "factor": factor.ok_or_else(|| m.err("rope.scaling.factor", "missing for YaRN"))?,
                "original_max_position_embeddings": m.usize("rope.scaling.original_context_length")?,
                "beta_fast": m.f64_opt("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                "beta_slow": m.f64_opt("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
            });
            if let Some(l) = m.f64_opt("rope.scaling.yarn_log_multiplier")? {
                o["mscale_all_dim"] = json!(l);
            }
            o
        }
        k => {
            return Err(m.err(
                "rope.scaling.type",
                format!("`{k}` is not supported (none, linear, yarn)"),
            ))
        }
    })
}

/// The checkpoint's `config.json` (without `quantization`, added by the caller).
pub fn config(a: GgufArch, m: &Meta, tensors: &BTreeMap<String, TensorInfo>) -> Result<Json> {
    // GLM's multi-token-prediction layers are counted in block_count.
    let blocks = m.usize("block_count")?;
    let nextn = m.usize_opt("nextn_predict_layers")?.unwrap_or(0);
    let layers = blocks.checked_sub(nextn).ok_or_else(|| {
        m.err(
            "nextn_predict_layers",
            format!("{nextn} exceeds block_count {blocks}"),
        )
    })?;
    let hidden = m.usize("embedding_length")?;
    let heads = m.usize("attention.head_count")?;
    let kv_heads = m.usize_opt("attention.head_count_kv")?.unwrap_or(heads);
    let head_dim = match m.usize_opt("attention.key_length")? {
        Some(d) => d,
        None => hidden.checked_div(heads).unwrap_or(0),
    };
    if let Some(v) = m.usize_opt("attention.value_length")? {
        if v != head_dim {
            return Err(m.err(
                "attention.value_length",
                format!("{v} differs from key_length {head_dim}"),
            ));
        }
    }
    let vocab = tensors
        .get("token_embd.weight")
        .map(|t| t.dims.get(1).copied().unwrap_or(0))
        .ok_or_else(|| Error::tensor(m.path, "token_embd.weight", "missing from the GGUF"))?;
    let tied = !tensors.contains_key("output.weight");
    let eps = m
        .f64_opt("attention.layer_norm_rms_epsilon")?
        .ok_or_else(|| m.err("attention.layer_norm_rms_epsilon", "missing"))?;
    let experts = m.usize("expert_count")?;
    let topk = m.usize("expert_used_count")?;
    let ctx = m.usize_opt("context_length")?.unwrap_or(4096);
    let theta = m.f64_opt("rope.freq_base")?.unwrap_or(10_000.0);
    let rope_dims = m.usize_opt("rope.dimension_count")?;
    if let Some(n) = rope_dims.filter(|_| a != GgufArch::Glm4Moe) {
        if n != head_dim {
            return Err(m.err(
                "rope.dimension_count",
                format!("{n}: only full rotary ({head_dim}) is supported for this architecture"),
            ));
        }
    }
    let mut c = Map::new();
    let kv = m.kv;
    for (key, field) in [
        ("tokenizer.ggml.bos_token_id", "bos_token_id"),
        ("tokenizer.ggml.eos_token_id", "eos_token_id"),
        ("tokenizer.ggml.padding_token_id", "pad_token_id"),
    ] {
        if let Some(id) = kv.get(key).and_then(Value::as_u64) {
            c.insert(field.into(), json!(id));
        }
    }
    let common = json!({
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": eps,
        "vocab_size": vocab, "max_position_embeddings": ctx, "rope_theta": theta,
        "num_experts_per_tok": topk, "tie_word_embeddings": tied,
        "rope_scaling": rope_scaling(m)?,
    });
    c.extend(common.as_object().expect("object").clone());
    match a {
        GgufArch::Qwen3Moe => {
            // llama.cpp's qwen3moe has no dense layers; the tensors say
            // which blocks are (`blk.N.ffn_gate` without `ffn_gate_inp`).
            let dense: Vec<usize> = (0..layers)
                .filter(|l| !tensors.contains_key(&format!("blk.{l}.ffn_gate_inp.weight")))
                .collect();
            let inter = match m.usize_opt("feed_forward_length")? {
                Some(n) => n,
                None if dense.is_empty() => 0,
                None => {
                    return Err(m.err(
                        "feed_forward_length",
                        "missing (the model has dense layers)",
                    ))
                }
            };
            c.extend(
                json!({
                    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
                    "intermediate_size": inter,
                    "moe_intermediate_size": m.usize("expert_feed_forward_length")?,
                    "num_experts": experts, "decoder_sparse_step": 1, "mlp_only_layers": dense,
                    "norm_topk_prob": m.get("expert_weights_norm").and_then(Value::as_bool).unwrap_or(true),
                })
                .as_object()
                .expect("object")
                .clone(),
            );
        }
        GgufArch::Glm4Moe => {
            if let Some(f) = m.get("expert_gating_func") {
                // llama.cpp: 1 softmax, 2 sigmoid (GLM-4.5's noaux_tc router).
                if f.as_u64() != Some(2) {
                    return Err(m.err(
                        "expert_gating_func",
                        format!("{f:?}; GLM's router is sigmoid (2)"),
                    ));
                }
            }
            let rot = rope_dims.unwrap_or(head_dim / 2);
            c.extend(
                json!({
                    "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
                    "intermediate_size": m.usize_opt("feed_forward_length")?.unwrap_or(0),
                    "moe_intermediate_size": m.usize("expert_feed_forward_length")?,
                    "n_routed_experts": experts,
                    "n_shared_experts": m.usize_opt("expert_shared_count")?.unwrap_or(0),
                    "first_k_dense_replace": m.usize_opt("leading_dense_block_count")?.unwrap_or(0),
                    "routed_scaling_factor": m.f64_opt("expert_weights_scale")?.unwrap_or(1.0),
                    "norm_topk_prob": m.get("expert_weights_norm").and_then(Value::as_bool).unwrap_or(true),
                    "n_group": m.usize_opt("expert_group_count")?.unwrap_or(1),
                    "topk_group": m.usize_opt("expert_group_used_count")?.unwrap_or(1),
                    "partial_rotary_factor": rot as f64 / head_dim.max(1) as f64,
                    "attention_bias": true,
                    "use_qk_norm": tensors.contains_key("blk.0.attn_q_norm.weight"),
                    "num_nextn_predict_layers": nextn,
                })
                .as_object()
                .expect("object")
                .clone(),
            );
        }
        GgufArch::GptOss => {
            let window = m.usize_opt("attention.sliding_window")?.unwrap_or(128);
            // llama.cpp: an explicit per-layer pattern, else every even layer slides.
            let swa: Vec<bool> = match m.get("attention.sliding_window_pattern") {
                Some(Value::Arr(v)) if v.len() == layers => v
                    .iter()
                    .map(|b| {
                        b.as_bool().ok_or_else(|| {
                            m.err("attention.sliding_window_pattern", "expected booleans")
                        })
                    })
                    .collect::<Result<_>>()?,
                Some(v) => {
                    return Err(m.err(
                        "attention.sliding_window_pattern",
                        format!("expected {layers} booleans, got {v:?}"),
                    ))
                }
                None => (0..layers).map(|l| l % 2 == 0).collect(),
            };
            let types: Vec<&str> = swa
                .iter()
                .map(|&s| {
                    if s {
                        "sliding_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect();
            c.extend(
                json!({
                    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
                    "intermediate_size": m.usize("expert_feed_forward_length")?,
                    "num_local_experts": experts, "sliding_window": window, "layer_types": types,
                    // llama.cpp hard-codes gpt-oss's SwiGLU (alpha 1.702, limit 7).
                    "swiglu_limit": 7.0,
                })
                .as_object()
                .expect("object")
                .clone(),
            );
        }
    }
    Ok(Json::Object(c))
}

/// The mlx-lm module name (without `.weight`/`.bias`) and suffix of a
/// llama.cpp tensor name; `None` for a name this architecture does not have.
pub fn mlx_name(a: GgufArch, gguf: &str) -> Option<String> {
    let (base, suffix) = gguf.rsplit_once('.')?;
    if !matches!(suffix, "weight" | "bias") {
        return None;
    }
    let top = match base {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(t) = top {
        return (suffix == "weight").then(|| format!("{t}.weight"));
    }
    let rest = base.strip_prefix("blk.")?;
    let (l, part) = rest.split_once('.')?;
    let l: usize = l.parse().ok()?;
    let experts = match a {
        GgufArch::Qwen3Moe | GgufArch::Glm4Moe => "mlp.switch_mlp",
        GgufArch::GptOss => "mlp.experts",
    };
    // GLM's multi-token-prediction block: kept under its layer number, which
    // sanitize drops as mlx-lm does (layers from num_hidden_layers on).
    if let Some(rest) = part
        .strip_prefix("nextn.")
        .filter(|_| a == GgufArch::Glm4Moe)
    {
        return Some(format!("model.layers.{l}.nextn.{rest}.{suffix}"));
    }
    let m = match (a, part) {
        (_, "attn_norm") => "input_layernorm".to_string(),
        (GgufArch::Qwen3Moe, "ffn_norm")
        | (GgufArch::GptOss | GgufArch::Glm4Moe, "post_attention_norm") => {
            "post_attention_layernorm".into()
        }
        (_, "attn_q") => "self_attn.q_proj".into(),
        (_, "attn_k") => "self_attn.k_proj".into(),
        (_, "attn_v") => "self_attn.v_proj".into(),
        (_, "attn_output") => "self_attn.o_proj".into(),
        (GgufArch::Qwen3Moe | GgufArch::Glm4Moe, "attn_q_norm") => "self_attn.q_norm".into(),
        (GgufArch::Qwen3Moe | GgufArch::Glm4Moe, "attn_k_norm") => "self_attn.k_norm".into(),
        (GgufArch::GptOss, "attn_sinks") if suffix == "weight" => {
            return Some(format!("model.layers.{l}.self_attn.sinks"))
        }
        (GgufArch::Qwen3Moe | GgufArch::Glm4Moe, "ffn_gate_inp") => "mlp.gate".into(),
        (GgufArch::Glm4Moe, "exp_probs_b") if suffix == "bias" => {
            return Some(format!("model.layers.{l}.mlp.gate.e_score_correction_bias"))
        }
        (GgufArch::Glm4Moe, "ffn_gate_shexp") => "mlp.shared_experts.gate_proj".into(),
        (GgufArch::Glm4Moe, "ffn_up_shexp") => "mlp.shared_experts.up_proj".into(),
        (GgufArch::Glm4Moe, "ffn_down_shexp") => "mlp.shared_experts.down_proj".into(),
        (GgufArch::GptOss, "ffn_gate_inp") => "mlp.router".into(),
        (_, "ffn_gate_exps") => format!("{experts}.gate_proj"),
        (_, "ffn_up_exps") => format!("{experts}.up_proj"),
        (_, "ffn_down_exps") => format!("{experts}.down_proj"),
        (GgufArch::Qwen3Moe | GgufArch::Glm4Moe, "ffn_gate") => "mlp.gate_proj".into(),
        (GgufArch::Qwen3Moe | GgufArch::Glm4Moe, "ffn_up") => "mlp.up_proj".into(),
        (GgufArch::Qwen3Moe | GgufArch::Glm4Moe, "ffn_down") => "mlp.down_proj".into(),
        _ => return None,
    };
    Some(format!("model.layers.{l}.{m}.{suffix}"))
}

/// Tensors llama.cpp writes that moeflux does not use (computed tables).
pub fn ignorable(gguf: &str) -> bool {
    matches!(gguf, "rope_freqs.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_per_family() {
        let q = GgufArch::Qwen3Moe;
        assert_eq!(
            mlx_name(q, "blk.3.ffn_down_exps.weight").unwrap(),
            "model.layers.3.mlp.switch_mlp.down_proj.weight"
        );
        assert_eq!(
            mlx_name(q, "blk.0.ffn_norm.weight").unwrap(),
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(mlx_name(q, "blk.0.attn_sinks.weight"), None);
        assert_eq!(mlx_name(q, "output.bias"), None);
        let g = GgufArch::GptOss;
        assert_eq!(
            mlx_name(g, "blk.1.ffn_up_exps.bias").unwrap(),
            "model.layers.1.mlp.experts.up_proj.bias"
        );
        assert_eq!(
            mlx_name(g, "blk.1.attn_sinks.weight").unwrap(),
            "model.layers.1.self_attn.sinks"
        );
        let z = GgufArch::Glm4Moe;
        assert_eq!(
            mlx_name(z, "blk.2.exp_probs_b.bias").unwrap(),
            "model.layers.2.mlp.gate.e_score_correction_bias"
        );
        assert_eq!(
            mlx_name(z, "blk.46.nextn.eh_proj.weight").unwrap(),
            "model.layers.46.nextn.eh_proj.weight"
        );
        assert_eq!(mlx_name(z, "blk.x.attn_q.weight"), None);
    }

    #[test]
    fn glm_nextn_layers_are_not_model_layers() {
        let mut kv = BTreeMap::new();
        for (k, v) in [
            ("block_count", 4u64),
            ("nextn_predict_layers", 1),
            ("embedding_length", 64),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
            ("attention.key_length", 32),
            ("rope.dimension_count", 16),
            ("expert_count", 8),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 64),
            ("expert_gating_func", 2),
        ] {
            kv.insert(format!("glm4moe.{k}"), Value::U(v));
        }
        kv.insert(
            "glm4moe.attention.layer_norm_rms_epsilon".into(),
            Value::F(1e-5),
        );
        let t = |name: &str, dims: Vec<usize>| {
            let ty = super::super::ggml::GgmlType::from_id(0).unwrap();
            (
                name.to_string(),
                TensorInfo {
                    name: name.into(),
                    dims,
                    ty,
                    start: 0,
                    len: 0,
                },
            )
        };
        let tensors: BTreeMap<_, _> = [t("token_embd.weight", vec![64, 1024])]
            .into_iter()
            .collect();
        let m = Meta {
            kv: &kv,
            arch: "glm4moe",
            path: Path::new("g.gguf"),
        };
        let c = config(GgufArch::Glm4Moe, &m, &tensors).unwrap();
        assert_eq!(c["num_hidden_layers"], 3);
        assert_eq!(c["partial_rotary_factor"], 0.5);
        assert_eq!(c["tie_word_embeddings"], true);
        kv.insert("glm4moe.expert_gating_func".into(), Value::U(1));
        let m = Meta {
            kv: &kv,
            arch: "glm4moe",
            path: Path::new("g.gguf"),
        };
        let e = config(GgufArch::Glm4Moe, &m, &tensors)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("glm4moe.expert_gating_func") && e.contains("g.gguf"),
            "{e}"
        );
    }
}
