//! The tensors an architecture needs, derived from its config: the single
//! source of truth for `convert` (what to read and check) and for loading a
//! model directory (what must be there, at which shape).
//!
//! Names are canonical: mlx-lm's names without the `language_model.` prefix
//! Qwen3.5 adds (`model.layers.3.self_attn.q_proj`, `lm_head`).

use crate::config::{LayerKind, MlpKind, ModelConfig, RouterKind};

/// What kind of tensor a schema entry is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WeightKind {
    /// A linear layer (or the embedding table) `[rows, cols]`: either
    /// quantized (`<name>.weight` U32 + `.scales` + `.biases`) or a float
    /// `<name>.weight` of that shape.
    Linear { rows: usize, cols: usize },
    /// A float vector `<name>` of `len` elements (norm weights, `A_log`, ...).
    Vector { len: usize },
    /// The depthwise conv1d weight `<name>`: float `[channels, kernel, 1]`.
    Conv { channels: usize, kernel: usize },
    /// A float table `<name>` `[rows, cols]`, never quantized (gpt-oss's
    /// per-expert biases: a row per expert).
    Table { rows: usize, cols: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightSpec {
    /// Module name for `Linear` (tensor names add `.weight` etc.), the full
    /// tensor name otherwise.
    pub name: String,
    pub kind: WeightKind,
}

/// The three stacked projections of a layer's routed experts
/// (`model.layers.N.mlp.switch_mlp.{gate,up,down}_proj`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertSpec {
    pub layer: usize,
    pub num_experts: usize,
    /// (component name, rows, cols) for `gate_proj`, `up_proj`, `down_proj`.
    pub projections: [(&'static str, usize, usize); 3],
}

impl ExpertSpec {
    /// Module name of one stacked projection in a checkpoint.
    pub fn module(&self, component: &str) -> String {
        format!("model.layers.{}.mlp.switch_mlp.{component}", self.layer)
    }
}

pub const EXPERT_COMPONENTS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

fn linear(name: String, rows: usize, cols: usize) -> WeightSpec {
    WeightSpec {
        name,
        kind: WeightKind::Linear { rows, cols },
    }
}

fn vector(name: String, len: usize) -> WeightSpec {
    WeightSpec {
        name,
        kind: WeightKind::Vector { len },
    }
}

/// The router's module name under `mlp.`: `router` for gpt-oss, `gate` for
/// every other family.
pub fn router_module(c: &ModelConfig) -> &'static str {
    if c.arch == crate::config::Architecture::GptOss {
        "router"
    } else {
        "gate"
    }
}

/// Prefix of layer `i`'s tensors.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}.")
}

/// Every dense (non-expert) weight of the model.
pub fn dense_weights(c: &ModelConfig) -> Vec<WeightSpec> {
    let h = c.hidden_size;
    let mut w = vec![linear("model.embed_tokens".into(), c.vocab_size, h)];
    for i in 0..c.num_layers {
        let p = layer_prefix(i);
        w.push(vector(format!("{p}input_layernorm.weight"), h));
        w.push(vector(format!("{p}post_attention_layernorm.weight"), h));
        match c.layer_kinds[i] {
            LayerKind::FullAttention => attention_weights(c, &p, &mut w),
            LayerKind::Mla => mla_weights(c, &p, &mut w),
            LayerKind::LinearAttention => deltanet_weights(c, &p, &mut w),
        }
        match c.mlp_kinds[i] {
            MlpKind::Moe => moe_weights(c, &p, &mut w),
            MlpKind::Dense => {
                let d = c.intermediate_size;
                w.push(linear(format!("{p}mlp.gate_proj"), d, h));
                w.push(linear(format!("{p}mlp.up_proj"), d, h));
                w.push(linear(format!("{p}mlp.down_proj"), h, d));
            }
        }
    }
    w.push(vector("model.norm.weight".into(), h));
    if !c.tie_word_embeddings {
        w.push(linear("lm_head".into(), c.vocab_size, h));
    }
    w
}

/// Grouped-query attention of one layer: `q_proj` holds per head `[q |
/// gate]` when the output is gated (Qwen3.5 / Qwen3-Next); q/k norms and
/// q/k/v biases where the config has them.
fn attention_weights(c: &ModelConfig, p: &str, w: &mut Vec<WeightSpec>) {
    let (h, nh, nkv, hd) = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_kv_heads,
        c.head_dim,
    );
    let a = &c.attention;
    let q_rows = if a.output_gate { 2 * nh * hd } else { nh * hd };
    for (name, rows) in [
        ("q_proj", q_rows),
        ("k_proj", nkv * hd),
        ("v_proj", nkv * hd),
    ] {
        w.push(linear(format!("{p}self_attn.{name}"), rows, h));
        if a.qkv_bias {
            w.push(vector(format!("{p}self_attn.{name}.bias"), rows));
        }
    }
    w.push(linear(format!("{p}self_attn.o_proj"), h, nh * hd));
    if a.o_bias {
        w.push(vector(format!("{p}self_attn.o_proj.bias"), h));
    }
    if a.sinks {
        w.push(vector(format!("{p}self_attn.sinks"), nh));
    }
    if a.qk_norm {
        w.push(vector(format!("{p}self_attn.q_norm.weight"), hd));
        w.push(vector(format!("{p}self_attn.k_norm.weight"), hd));
    }
}

/// GatedDeltaNet of one layer: split input projections (Qwen3.5) or fused
/// per key head (Qwen3-Next).
fn deltanet_weights(c: &ModelConfig, p: &str, w: &mut Vec<WeightSpec>) {
    let (l, h) = (&c.linear, c.hidden_size);
    let a = format!("{p}linear_attn.");
    if l.fused_projections {
        w.push(linear(
            format!("{a}in_proj_qkvz"),
            2 * l.key_dim() + 2 * l.value_dim(),
            h,
        ));
        w.push(linear(format!("{a}in_proj_ba"), 2 * l.num_v_heads, h));
    } else {
        w.push(linear(format!("{a}in_proj_qkv"), l.conv_dim(), h));
        w.push(linear(format!("{a}in_proj_z"), l.value_dim(), h));
        w.push(linear(format!("{a}in_proj_b"), l.num_v_heads, h));
        w.push(linear(format!("{a}in_proj_a"), l.num_v_heads, h));
    }
    w.push(WeightSpec {
        name: format!("{a}conv1d.weight"),
        kind: WeightKind::Conv {
            channels: l.conv_dim(),
            kernel: l.conv_kernel,
        },
    });
    w.push(vector(format!("{a}A_log"), l.num_v_heads));
    w.push(vector(format!("{a}dt_bias"), l.num_v_heads));
    w.push(vector(format!("{a}norm.weight"), l.value_head_dim));
    w.push(linear(format!("{a}out_proj"), h, l.value_dim()));
}

/// A MoE block's dense part: the router (with `noaux_tc`'s correction bias;
/// mlx-lm never quantizes that router, it stays in the checkpoint's float
/// type) and the shared expert (Qwen's sigmoid-gated `shared_expert`, or
/// DeepSeek's and GLM's ungated `shared_experts`).
fn moe_weights(c: &ModelConfig, p: &str, w: &mut Vec<WeightSpec>) {
    let (m, h) = (&c.moe, c.hidden_size);
    let router = router_module(c);
    w.push(linear(format!("{p}mlp.{router}"), m.num_experts, h));
    if m.router_bias {
        w.push(vector(format!("{p}mlp.{router}.bias"), m.num_experts));
    }
    // Expert biases are small ([experts, rows] per projection): they live
    // with the dense weights, not in the streamed expert extents.
    if m.expert_bias {
        let i = m.moe_intermediate;
        for (proj, rows) in [("gate_proj", i), ("up_proj", i), ("down_proj", h)] {
            w.push(WeightSpec {
                name: format!("{p}mlp.switch_mlp.{proj}.bias"),
                kind: WeightKind::Table {
                    rows: m.num_experts,
                    cols: rows,
                },
            });
        }
    }
    if let RouterKind::NoauxTc { .. } = m.router {
        w.push(vector(
            format!("{p}mlp.gate.e_score_correction_bias"),
            m.num_experts,
        ));
    }
    if m.shared_intermediate > 0 {
        let s = m.shared_intermediate;
        let module = if m.shared_gate {
            "shared_expert"
        } else {
            "shared_experts"
        };
        w.push(linear(format!("{p}mlp.{module}.gate_proj"), s, h));
        w.push(linear(format!("{p}mlp.{module}.up_proj"), s, h));
        w.push(linear(format!("{p}mlp.{module}.down_proj"), h, s));
        if m.shared_gate {
            w.push(linear(format!("{p}mlp.shared_expert_gate"), 1, h));
        }
    }
}

/// MLA projections of one layer (mlx-lm names: `kv_b_proj` is stored split
/// into per-head `embed_q` `[heads, kv_lora, nope]` and `unembed_out`
/// `[heads, v, kv_lora]`, kept here as 2-D `[heads * rows, cols]`).
fn mla_weights(c: &ModelConfig, p: &str, w: &mut Vec<WeightSpec>) {
    let Some(m) = c.mla else { return };
    let (h, nh) = (c.hidden_size, c.num_attention_heads);
    let a = format!("{p}self_attn.");
    match m.q_lora_rank {
        Some(r) => {
            w.push(linear(format!("{a}q_a_proj"), r, h));
            w.push(vector(format!("{a}q_a_layernorm.weight"), r));
            w.push(linear(format!("{a}q_b_proj"), nh * m.q_head_dim(), r));
        }
        None => w.push(linear(format!("{a}q_proj"), nh * m.q_head_dim(), h)),
    }
    w.push(linear(format!("{a}kv_a_proj_with_mqa"), m.cache_row(), h));
    w.push(vector(format!("{a}kv_a_layernorm.weight"), m.kv_lora_rank));
    w.push(linear(
        format!("{a}embed_q"),
        nh * m.kv_lora_rank,
        m.qk_nope_head_dim,
    ));
    w.push(linear(
        format!("{a}unembed_out"),
        nh * m.v_head_dim,
        m.kv_lora_rank,
    ));
    w.push(linear(format!("{a}o_proj"), h, nh * m.v_head_dim));
}

/// The routed experts of every MoE layer.
pub fn expert_weights(c: &ModelConfig) -> Vec<ExpertSpec> {
    let (h, i) = (c.hidden_size, c.moe.moe_intermediate);
    (0..c.num_layers)
        .filter(|&l| c.mlp_kinds[l] == MlpKind::Moe)
        .map(|layer| ExpertSpec {
            layer,
            num_experts: c.moe.num_experts,
            projections: [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)],
        })
        .collect()
}
