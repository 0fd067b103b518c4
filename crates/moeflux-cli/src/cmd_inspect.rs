//! `moeflux inspect DIR`: what a model directory holds.

use std::collections::BTreeMap;

use anyhow::{Context, Result};
use clap::Args;
use moeflux::config::{LayerKind, MlpKind, ModelConfig, RouterKind};
use moeflux::format::Manifest;
use serde_json::{json, Value};

use crate::model_ref::ModelRef;

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// Model directory written by `moeflux convert`, or `hf:ORG/NAME[@REV][:QUANT]`
    /// (see `moeflux pull`).
    #[arg(value_name = "DIR", value_parser = crate::model_ref::parse)]
    pub dir: ModelRef,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

fn kind_name(k: LayerKind) -> &'static str {
    match k {
        LayerKind::LinearAttention => "linear",
        LayerKind::FullAttention => "full",
        LayerKind::Mla => "mla",
    }
}

/// Runs of equal items: `[(item, count)]`.
fn runs<T: PartialEq + Copy>(v: &[T]) -> Vec<(T, usize)> {
    let mut out: Vec<(T, usize)> = Vec::new();
    for &x in v {
        match out.last_mut() {
            Some((y, n)) if *y == x => *n += 1,
            _ => out.push((x, 1)),
        }
    }
    out
}

/// "linear x3, full x1 repeated x15": the shortest period that tiles the
/// whole list, as runs.
pub fn layer_pattern(kinds: &[LayerKind]) -> String {
    let n = kinds.len();
    let period = (1..=n)
        .find(|&p| n.is_multiple_of(p) && (0..n).all(|i| kinds[i] == kinds[i % p]))
        .unwrap_or(n);
    let body = runs(&kinds[..period])
        .iter()
        .map(|(k, c)| format!("{} x{c}", kind_name(*k)))
        .collect::<Vec<_>>()
        .join(", ");
    if period < n {
        format!("{body} repeated x{}", n / period)
    } else {
        body
    }
}

/// The group a dense tensor belongs to, for the quantization summary.
fn group_of(name: &str) -> &'static str {
    let m = name
        .strip_suffix(".weight")
        .or_else(|| name.strip_suffix(".scales"))
        .or_else(|| name.strip_suffix(".biases"))
        .unwrap_or(name);
    if m == "model.embed_tokens" {
        "embedding"
    } else if m == "lm_head" {
        "lm_head"
    } else if m.ends_with("mlp.gate") || m.ends_with("mlp.router") {
        "router"
    } else if m.ends_with("shared_expert_gate") {
        "shared expert gate"
    } else if m.contains("mlp.shared_expert.") || m.contains("mlp.shared_experts.") {
        "shared expert"
    } else if m.contains(".self_attn.")
        && [
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "embed_q",
            "unembed_out",
        ]
        .iter()
        .any(|s| m.ends_with(s))
    {
        "MLA projections"
    } else if m.contains(".self_attn.") && m.ends_with("_proj") {
        "full attention"
    } else if m.contains(".linear_attn.") && (m.contains("in_proj") || m.ends_with("out_proj")) {
        "linear attention"
    } else if m.contains(".mlp.") && m.ends_with("_proj") {
        "dense MLP"
    } else {
        "norms, conv, vectors"
    }
}

fn size(bytes: u64) -> String {
    format!("{} ({bytes} bytes)", crate::progress::human_bytes(bytes))
}

/// The summary printed by `inspect` (also its `--json` output).
pub fn summary(m: &Manifest, c: &ModelConfig) -> Value {
    // Quantization per group: "4-bit g64" / "BF16" -> number of modules.
    let mut groups: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
    for (name, t) in &m.tensors {
        if name.ends_with(".scales") || name.ends_with(".biases") {
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let desc = match m.quantized.get(module) {
            Some(q) => format!("{}-bit g{}", q.bits, q.group_size),
            None => t.dtype.clone(),
        };
        *groups
            .entry(group_of(name))
            .or_default()
            .entry(desc)
            .or_default() += 1;
    }
    for l in &m.experts {
        for comp in &l.components {
            let desc = if comp.quant.is_mxfp4() {
                "MXFP4 (e2m1 g32, e8m0 scales)".to_string()
            } else {
                format!(
                    "{}-bit g{} ({} scales)",
                    comp.quant.bits, comp.quant.group_size, comp.scales.dtype
                )
            };
            *groups
                .entry("routed experts")
                .or_default()
                .entry(desc)
                .or_default() += 1;
        }
    }
    let dense_layers: Vec<usize> = (0..c.num_layers)
        .filter(|&i| c.mlp_kinds.get(i) == Some(&MlpKind::Dense))
        .collect();
    let first = m.experts.first();
    json!({
        "architecture": m.architecture,
        "layers": c.num_layers,
        "layer_pattern": layer_pattern(&c.layer_kinds),
        "dense_mlp_layers": dense_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "full_attention": {
            "heads": c.num_attention_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "rotary_dim": c.rope.rotary_dim,
            "rope_theta": c.rope.theta,
            "output_gate": c.attention.output_gate,
            "qk_norm": c.attention.qk_norm,
            "qkv_bias": c.attention.qkv_bias,
            "o_bias": c.attention.o_bias,
            "sinks": c.attention.sinks,
            "sliding_window": c.attention_window.iter().flatten().max(),
            "sliding_layers": c.attention_window.iter().filter(|w| w.is_some()).count(),
        },
        "linear_attention": c.layer_kinds.contains(&LayerKind::LinearAttention).then(|| json!({
            "k_heads": c.linear.num_k_heads,
            "v_heads": c.linear.num_v_heads,
            "k_head_dim": c.linear.key_head_dim,
            "v_head_dim": c.linear.value_head_dim,
            "conv_kernel": c.linear.conv_kernel,
        })),
        "moe": {
            "experts": c.moe.num_experts,
            "experts_per_token": c.moe.num_experts_per_tok,
            "moe_intermediate": c.moe.moe_intermediate,
            "shared_intermediate": c.moe.shared_intermediate,
            "norm_topk_prob": c.moe.norm_topk_prob,
            "moe_layers": m.experts.len(),
        },
        "mla": c.mla.map(|a| json!({
            "q_lora_rank": a.q_lora_rank,
            "kv_lora_rank": a.kv_lora_rank,
            "qk_nope_head_dim": a.qk_nope_head_dim,
            "qk_rope_head_dim": a.qk_rope_head_dim,
            "v_head_dim": a.v_head_dim,
            "cache_floats_per_token_layer": a.cache_row(),
            "yarn_factor": c.rope.yarn.map(|y| y.factor),
        })),
        "router": match c.moe.router {
            RouterKind::Softmax => json!({"kind": "softmax"}),
            RouterKind::TopKSoftmax => json!({"kind": "top_k_softmax", "bias": c.moe.router_bias}),
            RouterKind::NoauxTc { n_group, topk_group, routed_scaling_factor } => json!({
                "kind": "noaux_tc",
                "n_group": n_group,
                "topk_group": topk_group,
                "routed_scaling_factor": routed_scaling_factor,
            }),
        },
        "quantization": groups,
        "dense_tensors": m.tensors.len(),
        "dense_bytes": m.dense_bytes(),
        "expert_bytes": m.expert_bytes(),
        "bytes_per_expert": first.map(|l| l.expert_bytes),
        "expert_stride": first.map(|l| l.stride),
        "low_width_copies": m.low_width_experts.first().map(|l| json!({
            "bits": l.components.first().map(|c| c.quant.bits),
            "bytes": m.low_width_bytes(),
        })),
        "source": m.source,
    })
}

fn print_text(s: &Value) {
    let g = |p: &str| s.pointer(p).cloned().unwrap_or(Value::Null);
    let n = |p: &str| g(p).as_u64().unwrap_or(0);
    println!(
        "architecture   {}",
        g("/architecture").as_str().unwrap_or("?")
    );
    println!(
        "layers         {} ({})",
        n("/layers"),
        g("/layer_pattern").as_str().unwrap_or("?")
    );
    if let Some(d) = g("/dense_mlp_layers").as_array().filter(|d| !d.is_empty()) {
        let list: Vec<String> = d.iter().map(|x| x.to_string()).collect();
        println!("dense MLP at   layers {}", list.join(", "));
    }
    println!(
        "hidden         {}   vocab {}{}",
        n("/hidden_size"),
        n("/vocab_size"),
        if g("/tie_word_embeddings").as_bool() == Some(true) {
            " (tied embeddings)"
        } else {
            ""
        }
    );
    if g("/mla").is_object() {
        let q_lora = match g("/mla/q_lora_rank").as_u64() {
            Some(r) => format!("q_lora {r}"),
            None => "q_proj".into(),
        };
        println!(
            "MLA            {} heads, {q_lora}, kv_lora {}, nope {}, rope {}, v {}; cache {} floats/token/layer{}",
            n("/full_attention/heads"),
            n("/mla/kv_lora_rank"),
            n("/mla/qk_nope_head_dim"),
            n("/mla/qk_rope_head_dim"),
            n("/mla/v_head_dim"),
            n("/mla/cache_floats_per_token_layer"),
            match g("/mla/yarn_factor").as_f64() {
                Some(f) => format!(", YaRN x{f}"),
                None => String::new(),
            }
        );
    } else {
        let flavour: Vec<&str> = [
            ("/full_attention/output_gate", "output gate"),
            ("/full_attention/qk_norm", "q/k norm"),
            ("/full_attention/qkv_bias", "q/k/v bias"),
            ("/full_attention/o_bias", "o bias"),
            ("/full_attention/sinks", "sinks"),
        ]
        .iter()
        .filter(|(p, _)| g(p).as_bool() == Some(true))
        .map(|(_, name)| *name)
        .collect();
        println!(
            "full attention {} heads, {} kv heads, head dim {}, rotary dim {}{}{}",
            n("/full_attention/heads"),
            n("/full_attention/kv_heads"),
            n("/full_attention/head_dim"),
            n("/full_attention/rotary_dim"),
            if flavour.is_empty() {
                String::new()
            } else {
                format!("; {}", flavour.join(", "))
            },
            match g("/full_attention/sliding_window").as_u64() {
                Some(w) => format!(
                    "; {} of the layers see the last {w} positions only",
                    n("/full_attention/sliding_layers")
                ),
                None => String::new(),
            }
        );
    }
    if g("/linear_attention").is_object() {
        println!(
            "linear attn    {} k heads x {}, {} v heads x {}, conv kernel {}",
            n("/linear_attention/k_heads"),
            n("/linear_attention/k_head_dim"),
            n("/linear_attention/v_heads"),
            n("/linear_attention/v_head_dim"),
            n("/linear_attention/conv_kernel")
        );
    }
    if g("/router/kind").as_str() == Some("noaux_tc") {
        println!(
            "router         noaux_tc, {} groups keep {}, scaling {}",
            n("/router/n_group"),
            n("/router/topk_group"),
            g("/router/routed_scaling_factor").as_f64().unwrap_or(1.0)
        );
    }
    println!(
        "experts        {} per MoE layer, K = {}, intermediate {}, shared expert {}",
        n("/moe/experts"),
        n("/moe/experts_per_token"),
        n("/moe/moe_intermediate"),
        n("/moe/shared_intermediate")
    );
    println!("quantization");
    if let Some(groups) = g("/quantization").as_object() {
        for (group, descs) in groups {
            let parts: Vec<String> = descs
                .as_object()
                .map(|o| {
                    o.iter()
                        .map(|(d, c)| format!("{d} x{}", c.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default();
            println!("  {group:<22} {}", parts.join(", "));
        }
    }
    println!(
        "dense          {} in {} tensors",
        size(n("/dense_bytes")),
        n("/dense_tensors")
    );
    println!(
        "experts        {} in {} layer files; {} bytes per expert (stride {})",
        size(n("/expert_bytes")),
        n("/moe/moe_layers"),
        n("/bytes_per_expert"),
        n("/expert_stride")
    );
    if let Some(c) = s.get("low_width_copies").filter(|c| !c.is_null()) {
        println!(
            "low-width      {}-bit copies of the experts, {} (--low-width-experts)",
            c["bits"].as_u64().unwrap_or(0),
            size(c["bytes"].as_u64().unwrap_or(0))
        );
    }
    let src = g("/source");
    let mut line = format!(
        "source         {} ({})",
        src["path"].as_str().unwrap_or("?"),
        src["kind"].as_str().unwrap_or("?")
    );
    if let Some(b) = src["expert_bits"].as_u64() {
        line.push_str(&format!(", experts {b}-bit"));
    }
    println!("{line}");
    if let Some(r) = src["expert_requantization"].as_str() {
        println!("requantized    {r}");
    }
}

pub fn run(args: InspectArgs) -> Result<()> {
    // Describes only a directory that loads: every file, size, extent and
    // dtype it would describe is checked first, and a model that cannot
    // load is an error (non-zero exit) naming the file and field at fault.
    let dir = args.dir.dir()?;
    let (m, c) = moeflux::model::Model::check_dir(dir)
        .with_context(|| format!("{} cannot be loaded", dir.display()))?;
    let s = summary(&m, &c);
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&s).context("serializing the summary")?
        );
    } else {
        print_text(&s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use LayerKind::{FullAttention as F, LinearAttention as L};

    #[test]
    fn patterns() {
        assert_eq!(layer_pattern(&[L, L, L, F]), "linear x3, full x1");
        assert_eq!(
            layer_pattern(&[L, L, L, F, L, L, L, F]),
            "linear x3, full x1 repeated x2"
        );
        assert_eq!(
            layer_pattern(&[L, F, L, F]),
            "linear x1, full x1 repeated x2"
        );
        assert_eq!(layer_pattern(&[L, F, F]), "linear x1, full x2");
        assert_eq!(layer_pattern(&[]), "");
    }

    #[test]
    fn groups() {
        assert_eq!(group_of("model.layers.0.mlp.gate.weight"), "router");
        assert_eq!(
            group_of("model.layers.0.mlp.shared_expert_gate.scales"),
            "shared expert gate"
        );
        assert_eq!(
            group_of("model.layers.0.mlp.shared_expert.up_proj.weight"),
            "shared expert"
        );
        assert_eq!(
            group_of("model.layers.3.self_attn.q_proj.weight"),
            "full attention"
        );
        assert_eq!(
            group_of("model.layers.3.self_attn.q_norm.weight"),
            "norms, conv, vectors"
        );
        assert_eq!(
            group_of("model.layers.0.linear_attn.in_proj_qkvz.weight"),
            "linear attention"
        );
        assert_eq!(
            group_of("model.layers.0.linear_attn.conv1d.weight"),
            "norms, conv, vectors"
        );
        assert_eq!(group_of("model.layers.2.mlp.down_proj.weight"), "dense MLP");
        assert_eq!(group_of("model.embed_tokens.weight"), "embedding");
        assert_eq!(
            group_of("model.layers.1.self_attn.unembed_out.scales"),
            "MLA projections"
        );
        assert_eq!(
            group_of("model.layers.1.mlp.shared_experts.down_proj.weight"),
            "shared expert"
        );
    }
}
