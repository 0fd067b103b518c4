//! Source tensor names -> canonical names, mirroring mlx-lm's `sanitize()`
//! for the architecture (mlx-lm 0.32: `models/qwen3_5_moe.py`,
//! `models/qwen3_5.py`, `models/qwen3_next.py`):
//!
//! - qwen3_5_moe: drop `vision_tower*` / `model.visual*`; `model.language_model.`
//!   -> `language_model.model.`, anything else gets `language_model.` (the
//!   canonical name is the mlx name without that prefix); split the fused
//!   `mlp.experts.gate_up_proj` [E, 2I, H] into gate (first half of the rows)
//!   and up, take `mlp.experts.down_proj` as the stacked down projection; drop
//!   `mtp.*`; conv1d [C,1,K] -> [C,K,1]; add 1 to the zero-centred norms only
//!   when the checkpoint had an unsanitized conv1d.
//! - qwen3_next: stack per-expert `mlp.experts.{e}.{proj}.weight`; drop `mtp.*`;
//!   conv1d as above; add 1 to the norms only when per-expert tensors were present.
//!
//! - qwen3_moe (`models/qwen3_moe.py`): stack per-expert tensors; norms are
//!   plain weights.
//! - glm4_moe (`models/glm4_moe.py`): stack per-expert tensors; drop the
//!   multi-token-prediction layers (index >= `num_hidden_layers`); norms are
//!   plain weights.
//! - kimi_k25 (`models/kimi_k25.py`): drop the vision tower and projector,
//!   the text model under `language_model.` as deepseek_v3 below.
//! - deepseek_v3 / kimi_k2 (`models/deepseek_v3.py`): stack per-expert
//!   `mlp.experts.{e}.{proj}.weight`; split `self_attn.kv_b_proj` into
//!   `embed_q` / `unembed_out` (see [`super::kvb`]; mlx-lm checkpoints already
//!   hold them split as `[heads, rows, cols]`, read here as 2-D); FP8 weights
//!   are decoded with their `weight_scale_inv` (see [`super::fp8`]); drop the
//!   multi-token-prediction layers (index >= `num_hidden_layers`) and
//!   `rotary_emb.inv_freq`. Norms are stored as is (not zero-centred).
//!
//! Tied embeddings drop `lm_head`. Nothing is read here except shapes: the
//! transformations are recorded and applied while writing.

use std::collections::BTreeMap;

use crate::config::Architecture;
use crate::error::{Error, Result};
use crate::model::schema::EXPERT_COMPONENTS;

use super::kvb::{KvbHalf, KvbSplit};
use super::source::Source;

/// Suffixes of the zero-centred RMSNorm weights HF stores as `w - 1`.
const NORM_SUFFIXES: [&str; 5] = [
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
];

/// A dense tensor after sanitizing.
#[derive(Debug, Clone)]
pub struct DenseSrc {
    /// Name in the checkpoint.
    pub raw: String,
    /// Shape after sanitizing (conv1d moved to [C, K, 1]; same bytes).
    pub shape: Vec<usize>,
    /// Add 1.0 in the source dtype (HF zero-centred norm).
    pub plus_one: bool,
    /// This tensor is one half of MLA's `kv_b_proj` (`raw`), split on write.
    pub kvb: Option<KvbSplit>,
    /// `raw` is a quantized `kv_b_proj` with these scales and biases.
    pub kvb_quant: Option<(String, String)>,
    /// Only the even (`Some(0)`) or odd (`Some(1)`) entries of `raw`'s last
    /// axis (gpt-oss's interleaved `gate_up_proj_bias`).
    pub interleave: Option<usize>,
}

/// Where one stacked expert projection comes from.
#[derive(Debug, Clone)]
pub enum ExpertSrc {
    /// mlx-lm quantized `switch_mlp.<proj>.{weight,scales,biases}` [E, rows, ...].
    Quantized {
        weight: String,
        scales: String,
        biases: String,
    },
    /// A float tensor [E, R, cols]; expert e is rows `row_start..row_start+rows`
    /// of slice e (`switch_mlp.<proj>.weight`, or half of a fused `gate_up_proj`).
    Stacked {
        raw: String,
        row_start: usize,
        rows: usize,
    },
    /// One float tensor [rows, cols] per expert (HF `experts.{e}.<proj>.weight`).
    PerExpert(Vec<String>),
    /// MXFP4 codes and e8m0 scales, copied as they are: mlx-lm's
    /// `switch_mlp.<proj>.{weight,scales}` (U32 `[E, rows, cols/8]`), or
    /// Hugging Face's `<proj>_blocks` (U8 `[E, R, cols/32, 16]`, the same
    /// bytes) and `<proj>_scales`, where a fused `gate_up_proj` interleaves
    /// gate (even rows) and up (odd rows).
    Mxfp4 {
        weight: String,
        scales: String,
        pick: RowPick,
    },
}

/// Which source rows of a stacked expert tensor make one projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPick {
    All,
    Even,
    Odd,
}

impl RowPick {
    /// Source row of output row `r`.
    pub fn source_row(self, r: usize) -> usize {
        match self {
            RowPick::All => r,
            RowPick::Even => 2 * r,
            RowPick::Odd => 2 * r + 1,
        }
    }

    /// Source rows per expert for `rows` output rows.
    pub fn source_rows(self, rows: usize) -> usize {
        match self {
            RowPick::All => rows,
            RowPick::Even | RowPick::Odd => 2 * rows,
        }
    }
}

impl ExpertSrc {
    /// Every checkpoint tensor this source reads.
    pub fn raw_names(&self) -> Vec<&str> {
        match self {
            ExpertSrc::Quantized {
                weight,
                scales,
                biases,
            } => vec![weight, scales, biases],
            ExpertSrc::Stacked { raw, .. } => vec![raw],
            ExpertSrc::PerExpert(v) => v.iter().map(String::as_str).collect(),
            ExpertSrc::Mxfp4 { weight, scales, .. } => vec![weight, scales],
        }
    }

    /// A checkpoint name to report problems against.
    pub fn first_raw(&self) -> &str {
        match self {
            ExpertSrc::Quantized { weight, .. } | ExpertSrc::Mxfp4 { weight, .. } => weight,
            ExpertSrc::Stacked { raw, .. } => raw,
            ExpertSrc::PerExpert(v) => &v[0],
        }
    }
}

#[derive(Debug, Default)]
pub struct Sanitized {
    /// Canonical dense tensor name -> source.
    pub dense: BTreeMap<String, DenseSrc>,
    /// (layer, component index in `EXPERT_COMPONENTS`) -> source.
    pub experts: BTreeMap<(usize, usize), ExpertSrc>,
    /// Checkpoint tensors intentionally left out (vision tower, MTP, tied lm_head).
    pub dropped: Vec<String>,
    /// Whether norms get +1 (the checkpoint is in Hugging Face layout).
    pub shift_norms: bool,
}

/// Prefixes of a multimodal checkpoint's vision parts (Qwen3.5's
/// `model.visual`, Kimi-K2.5's tower and projector), dropped like mlx-lm's
/// sanitize drops them.
const VISION_PREFIXES: [&str; 5] = [
    "vision_tower",
    "vision_model",
    "model.visual",
    "multi_modal_projector",
    "mm_projector",
];

/// The mlx-lm name of a checkpoint tensor (`None`: dropped vision tensor).
fn mlx_name(arch: Architecture, raw: &str) -> Option<String> {
    if VISION_PREFIXES.iter().any(|p| raw.starts_with(p)) {
        return None;
    }
    Some(if !arch.nests_language_model() {
        raw.to_string()
    } else if let Some(rest) = raw.strip_prefix("model.language_model") {
        format!("language_model.model{rest}")
    } else if raw.starts_with("language_model.") {
        raw.to_string()
    } else {
        format!("language_model.{raw}")
    })
}

/// Canonical name: the mlx name without the `language_model.` prefix of
/// the families that nest their text model.
pub fn canonical_of_mlx(arch: Architecture, mlx: &str) -> String {
    if arch.nests_language_model() {
        mlx.strip_prefix("language_model.").unwrap_or(mlx).into()
    } else if arch == Architecture::GptOss {
        // gpt-oss's SwitchGLU is `mlp.experts`; canonically every family's
        // stacked experts are `mlp.switch_mlp`.
        mlx.replacen(".mlp.experts.", ".mlp.switch_mlp.", 1)
    } else {
        mlx.to_string()
    }
}

/// The module path mlx-lm uses in `config.json` `quantization` for a
/// canonical module name.
pub fn mlx_module_path(arch: Architecture, canonical: &str) -> String {
    if arch.nests_language_model() {
        format!("language_model.{canonical}")
    } else if arch == Architecture::GptOss {
        canonical.replacen(".mlp.switch_mlp.", ".mlp.experts.", 1)
    } else {
        canonical.to_string()
    }
}

/// Splits `model.layers.<L>.<rest>` into (L, rest).
fn layer_and_rest(name: &str) -> Option<(usize, &str)> {
    let s = name.strip_prefix("model.layers.")?;
    let dot = s.find('.')?;
    let layer = s[..dot].parse().ok()?;
    Some((layer, &s[dot + 1..]))
}

/// Whether `raw` is the block-scale tensor of an FP8 weight.
fn is_fp8_scale(src: &Source, raw: &str) -> bool {
    src.fp8_scales.values().any(|s| s == raw)
}

fn component_index(c: &str) -> Option<usize> {
    EXPERT_COMPONENTS.iter().position(|x| *x == c)
}

pub fn sanitize(src: &Source) -> Result<Sanitized> {
    let cfg = &src.config;
    let arch = cfg.arch;
    let mut out = Sanitized::default();

    // canonical -> raw
    let mut names: BTreeMap<String, String> = BTreeMap::new();
    for raw in src.tensors.keys() {
        let Some(mlx) = mlx_name(arch, raw) else {
            out.dropped.push(raw.clone());
            continue;
        };
        let canon = canonical_of_mlx(arch, &mlx);
        if let Some(prev) = names.insert(canon.clone(), raw.clone()) {
            return Err(Error::tensor(
                src.file_of(raw),
                raw,
                format!("maps to `{canon}` like `{prev}`; the checkpoint mixes naming schemes"),
            ));
        }
    }

    let shape_of = |canon: &str| &src.tensors[&names[canon]].shape;
    out.shift_norms = match arch {
        Architecture::Qwen3_5Moe => names
            .keys()
            .any(|k| k.contains("conv1d.weight") && shape_of(k).last() != Some(&1)),
        Architecture::Qwen3Next => names.keys().any(|k| {
            k.starts_with("model.layers.") && k.ends_with(".mlp.experts.0.up_proj.weight")
        }),
        // Plain norm weights in both layouts.
        Architecture::Qwen3Moe
        | Architecture::Glm4Moe
        | Architecture::DeepseekV3
        | Architecture::KimiK2
        | Architecture::KimiK25
        | Architecture::GptOss => false,
    };
    if arch.is_deepseek() {
        // FP8 block scales are read with their weights, not copied.
        names.retain(|_, raw| !raw.ends_with("_scale_inv") || !is_fp8_scale(src, raw));
    }

    // Known extras: DeepSeek's and GLM's multi-token-prediction layers
    // (indices from num_hidden_layers on), rotary tables, tied heads.
    let numbered_mtp = arch.is_deepseek() || arch == Architecture::Glm4Moe;
    names.retain(|canon, raw| {
        let mtp_layer = numbered_mtp
            && (layer_and_rest(canon).is_some_and(|(l, _)| l >= cfg.num_layers)
                || canon.contains("rotary_emb.inv_freq"));
        let drop = mtp_layer
            || canon.contains("mtp.")
            || (cfg.tie_word_embeddings
                && canon
                    .strip_prefix("lm_head.")
                    .is_some_and(|s| matches!(s, "weight" | "scales" | "biases")));
        if drop {
            out.dropped.push(raw.clone());
        }
        !drop
    });

    let take = |names: &mut BTreeMap<String, String>, canon: &str| names.remove(canon);
    let missing = |canon: &str, why: &str| {
        Error::tensor(
            src.weights_location(),
            canon,
            format!("missing from the checkpoint ({why})"),
        )
    };

    // Hugging Face expert layouts.
    match arch {
        Architecture::Qwen3_5Moe => {
            for l in 0..cfg.num_layers {
                let p = format!("model.layers.{l}.mlp.experts");
                if let Some(raw) = take(&mut names, &format!("{p}.gate_up_proj")) {
                    let t = &src.tensors[&raw];
                    if t.shape.len() != 3 {
                        return Err(Error::tensor(
                            src.file_of(&raw),
                            &raw,
                            format!(
                                "shape {:?}, expected [experts, 2*intermediate, hidden]",
                                t.shape
                            ),
                        ));
                    }
                    let mid = t.shape[1] / 2;
                    out.experts.insert(
                        (l, 0),
                        ExpertSrc::Stacked {
                            raw: raw.clone(),
                            row_start: 0,
                            rows: mid,
                        },
                    );
                    out.experts.insert(
                        (l, 1),
                        ExpertSrc::Stacked {
                            raw,
                            row_start: mid,
                            rows: t.shape[1] - mid,
                        },
                    );
                    let down = format!("{p}.down_proj");
                    let raw = take(&mut names, &down)
                        .ok_or_else(|| missing(&down, "experts.gate_up_proj is present"))?;
                    let rows = src.tensors[&raw].shape.get(1).copied().unwrap_or(0);
                    out.experts.insert(
                        (l, 2),
                        ExpertSrc::Stacked {
                            raw,
                            row_start: 0,
                            rows,
                        },
                    );
                }
            }
        }
        Architecture::Qwen3Next
        | Architecture::Qwen3Moe
        | Architecture::Glm4Moe
        | Architecture::DeepseekV3
        | Architecture::KimiK2
        | Architecture::KimiK25 => {
            let moe_layers: Vec<usize> = names
                .keys()
                .filter(|k| k.ends_with(".mlp.experts.0.up_proj.weight"))
                .filter_map(|k| layer_and_rest(k).map(|(l, _)| l))
                .collect();
            for l in moe_layers {
                for (ci, c) in EXPERT_COMPONENTS.iter().enumerate() {
                    let mut raws = Vec::with_capacity(cfg.moe.num_experts);
                    for e in 0..cfg.moe.num_experts {
                        let n = format!("model.layers.{l}.mlp.experts.{e}.{c}.weight");
                        raws.push(
                            take(&mut names, &n).ok_or_else(|| {
                                missing(&n, "other per-expert tensors are present")
                            })?,
                        );
                    }
                    out.experts.insert((l, ci), ExpertSrc::PerExpert(raws));
                }
            }
        }
        Architecture::GptOss => {
            for l in 0..cfg.num_layers {
                let p = format!("model.layers.{l}.mlp.switch_mlp");
                let gate_up = format!("{p}.gate_up_proj_blocks");
                let Some(blocks) = take(&mut names, &gate_up) else {
                    if let Some(raw) = names.get(&format!("{p}.gate_up_proj")) {
                        return Err(Error::tensor(
                            src.file_of(raw),
                            raw,
                            "unquantized Hugging Face gpt-oss experts are not supported: \
                             convert the MXFP4 release (`*_blocks` / `*_scales`)",
                        ));
                    }
                    continue;
                };
                let why = "mlp.experts.gate_up_proj_blocks is present";
                let mut need = |suffix: &str| {
                    let n = format!("{p}.{suffix}");
                    take(&mut names, &n).ok_or_else(|| missing(&n, why))
                };
                let (gu_scales, gu_bias) =
                    (need("gate_up_proj_scales")?, need("gate_up_proj_bias")?);
                let (down, down_scales) = (need("down_proj_blocks")?, need("down_proj_scales")?);
                let down_bias = need("down_proj_bias")?;
                for (ci, weight, scales, pick) in [
                    (0, &blocks, &gu_scales, RowPick::Even),
                    (1, &blocks, &gu_scales, RowPick::Odd),
                    (2, &down, &down_scales, RowPick::All),
                ] {
                    out.experts.insert(
                        (l, ci),
                        ExpertSrc::Mxfp4 {
                            weight: weight.clone(),
                            scales: scales.clone(),
                            pick,
                        },
                    );
                }
                for (c, raw, interleave) in [
                    ("gate_proj", &gu_bias, Some(0)),
                    ("up_proj", &gu_bias, Some(1)),
                    ("down_proj", &down_bias, None),
                ] {
                    let mut shape = src.tensors[raw].shape.clone();
                    if let (Some(_), Some(last)) = (interleave, shape.last_mut()) {
                        *last /= 2;
                    }
                    out.dense.insert(
                        format!("{p}.{c}.bias"),
                        DenseSrc {
                            raw: raw.clone(),
                            shape,
                            plus_one: false,
                            kvb: None,
                            kvb_quant: None,
                            interleave,
                        },
                    );
                }
            }
        }
    }

    type KvbHalfSrc = (String, String, KvbSplit, Option<(String, String)>);
    let mut kvb_halves: Vec<KvbHalfSrc> = Vec::new();
    if let Some(m) = cfg.mla.filter(|_| arch.is_deepseek()) {
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}.self_attn.kv_b_proj");
            let Some(raw) = take(&mut names, &format!("{p}.weight")) else {
                continue;
            };
            // Older mlx-lm checkpoints quantize kv_b_proj unsplit.
            let quant = match (
                take(&mut names, &format!("{p}.scales")),
                take(&mut names, &format!("{p}.biases")),
            ) {
                (Some(s), Some(b)) => Some((s, b)),
                (None, None) => None,
                _ => {
                    return Err(missing(
                        &format!("{p}.biases"),
                        "kv_b_proj.scales and .biases come together",
                    ))
                }
            };
            let split = |half| KvbSplit {
                half,
                heads: cfg.num_attention_heads,
                nope: m.qk_nope_head_dim,
                v: m.v_head_dim,
                kv_lora: m.kv_lora_rank,
            };
            let e = split(KvbHalf::EmbedQ);
            let shape = &src.tensors[&raw].shape;
            // Quantized: the column count is checked with the scales in the plan.
            if shape.first() != Some(&e.source_rows())
                || (quant.is_none() && shape.as_slice() != [e.source_rows(), e.kv_lora])
            {
                return Err(Error::tensor(
                    src.file_of(&raw),
                    &raw,
                    format!(
                        "shape {shape:?}, expected [{}, {}] (heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)",
                        e.source_rows(),
                        e.kv_lora
                    ),
                ));
            }
            let a = format!("model.layers.{l}.self_attn.");
            kvb_halves.push((format!("{a}embed_q.weight"), raw.clone(), e, quant.clone()));
            kvb_halves.push((
                format!("{a}unembed_out.weight"),
                raw,
                split(KvbHalf::UnembedOut),
                quant,
            ));
        }
    }

    // mlx-lm stacked experts (quantized or not).
    let switch: Vec<(String, usize, usize, String)> = names
        .keys()
        .filter_map(|k| {
            let (l, rest) = layer_and_rest(k)?;
            let rest = rest.strip_prefix("mlp.switch_mlp.")?;
            let (c, part) = rest.split_once('.')?;
            let ci = component_index(c)?;
            matches!(part, "weight" | "scales" | "biases").then(|| (k.clone(), l, ci, part.into()))
        })
        .collect();
    let mut parts: BTreeMap<(usize, usize), BTreeMap<String, String>> = BTreeMap::new();
    for (canon, l, ci, part) in switch {
        let raw = names.remove(&canon).expect("listed above");
        if out.experts.contains_key(&(l, ci)) {
            return Err(Error::tensor(
                src.file_of(&raw),
                &raw,
                "experts of this layer are also given in Hugging Face layout",
            ));
        }
        parts.entry((l, ci)).or_default().insert(part, raw);
    }
    for ((l, ci), mut p) in parts {
        let module = format!("model.layers.{l}.mlp.switch_mlp.{}", EXPERT_COMPONENTS[ci]);
        let weight = p
            .remove("weight")
            .ok_or_else(|| missing(&format!("{module}.weight"), "its scales/biases are present"))?;
        let es = if p.is_empty() {
            let rows = src.tensors[&weight].shape.get(1).copied().unwrap_or(0);
            ExpertSrc::Stacked {
                raw: weight,
                row_start: 0,
                rows,
            }
        } else {
            let scales = p
                .remove("scales")
                .ok_or_else(|| missing(&format!("{module}.scales"), "quantized experts"))?;
            match p.remove("biases") {
                Some(biases) => ExpertSrc::Quantized {
                    weight,
                    scales,
                    biases,
                },
                // The plan checks config.json declares them MXFP4.
                None => ExpertSrc::Mxfp4 {
                    weight,
                    scales,
                    pick: RowPick::All,
                },
            }
        };
        out.experts.insert((l, ci), es);
    }

    // Everything else is dense.
    for (canon, raw) in names {
        let t = &src.tensors[&raw];
        let mut shape = t.shape.clone();
        if canon.contains("conv1d.weight") && shape.len() == 3 && shape[2] != 1 {
            shape.swap(1, 2); // moveaxis(2, 1): [C, 1, K] -> [C, K, 1], same bytes
        }
        // mlx-lm's MultiLinear halves of kv_b_proj are [heads, rows, cols]:
        // the same bytes as [heads * rows, cols].
        if arch.is_deepseek()
            && shape.len() == 3
            && [".embed_q.", ".unembed_out."]
                .iter()
                .any(|m| canon.contains(m))
        {
            shape = vec![shape[0] * shape[1], shape[2]];
        }
        let plus_one =
            out.shift_norms && shape.len() == 1 && NORM_SUFFIXES.iter().any(|s| canon.ends_with(s));
        out.dense.insert(
            canon,
            DenseSrc {
                raw,
                shape,
                plus_one,
                kvb: None,
                kvb_quant: None,
                interleave: None,
            },
        );
    }
    for (canon, raw, split, kvb_quant) in kvb_halves {
        if let Some(prev) = out.dense.get(&canon) {
            return Err(Error::tensor(
                src.file_of(&raw),
                &raw,
                format!("the checkpoint also has `{}`", prev.raw),
            ));
        }
        out.dense.insert(
            canon,
            DenseSrc {
                raw,
                shape: split.shape().to_vec(),
                plus_one: false,
                kvb: Some(split),
                kvb_quant,
                interleave: None,
            },
        );
    }
    out.dropped.sort();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let a = Architecture::Qwen3_5Moe;
        assert_eq!(
            mlx_name(a, "model.language_model.layers.0.mlp.gate.weight").unwrap(),
            "language_model.model.layers.0.mlp.gate.weight"
        );
        assert_eq!(
            mlx_name(a, "lm_head.weight").unwrap(),
            "language_model.lm_head.weight"
        );
        assert_eq!(
            mlx_name(a, "language_model.model.norm.weight").unwrap(),
            "language_model.model.norm.weight"
        );
        assert!(mlx_name(a, "model.visual.blocks.0.x").is_none());
        assert_eq!(
            canonical_of_mlx(a, "language_model.model.norm.weight"),
            "model.norm.weight"
        );
        assert_eq!(
            mlx_module_path(a, "model.layers.0.mlp.gate"),
            "language_model.model.layers.0.mlp.gate"
        );
        assert_eq!(
            layer_and_rest("model.layers.12.mlp.gate.weight"),
            Some((12, "mlp.gate.weight"))
        );
        assert_eq!(layer_and_rest("model.norm.weight"), None);
    }
}
