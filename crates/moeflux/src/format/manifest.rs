//! `moeflux.json`: what the directory holds and where every byte lives.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::{ModelConfig, QuantSpec};
use crate::error::{Error, Result};

pub const FORMAT_NAME: &str = "moeflux-model";
pub const FORMAT_VERSION: u32 = 1;
/// Largest `moeflux.json` read (the largest real ones are a few MB): an
/// untrusted file must not exhaust memory before it is parsed.
pub const MAX_MANIFEST_BYTES: u64 = 256 << 20;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always `moeflux-model`.
    pub format: String,
    pub format_version: u32,
    /// `model_type` of the checkpoint (`qwen3_5_moe`, `qwen3_next`).
    pub architecture: String,
    pub source: SourceInfo,
    /// File holding the dense tensors, relative to the model directory.
    pub dense_file: String,
    /// Every tensor of `dense_file`, by canonical name (no `language_model.`
    /// prefix): dtype, shape and absolute byte range in the file.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Quantized dense modules (`<module>.weight/.scales/.biases`) and their
    /// parameters, by module name (the tensor name without `.weight`).
    pub quantized: BTreeMap<String, QuantSpec>,
    /// Routed experts of every MoE layer, in layer order.
    pub experts: Vec<ExpertLayer>,
    /// Copies of the same experts at fewer bits (`moeflux convert
    /// --low-width-copies`), used in their place when a session asks
    /// (`SessionOptions::low_width_experts`). Empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub low_width_experts: Vec<ExpertLayer>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SourceInfo {
    /// Source directory as given to `convert`.
    pub path: String,
    /// `mlx` (already quantized by mlx-lm) or `unquantized` (quantized by moeflux).
    pub kind: String,
    /// Bits of the routed experts in the source, if they were quantized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_bits: Option<u32>,
    /// Set when `convert --expert-bits` re-quantized the experts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_requantization: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// safetensors dtype name: `U32`, `BF16`, `F16` or `F32`.
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Absolute offset of the first byte in the file.
    pub offset: u64,
    pub bytes: u64,
}

/// The experts of one MoE layer: `num_experts` extents of `stride` bytes in
/// `file`; expert `e` starts at `e * stride`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertLayer {
    pub layer: usize,
    /// Relative to the model directory (`experts/layer_NNN.bin`).
    pub file: String,
    pub num_experts: usize,
    /// Bytes used inside each extent.
    pub expert_bytes: u64,
    /// Distance between experts; a multiple of 4096.
    pub stride: u64,
    /// `gate_proj`, `up_proj`, `down_proj`, in that order.
    pub components: Vec<ExpertComponent>,
}

/// One projection of an expert: `[rows, cols]` quantized with `quant`,
/// weight codes then scales then (affine only) biases at offsets inside the
/// extent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertComponent {
    /// `gate_proj`, `up_proj` or `down_proj`.
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub quant: QuantSpec,
    pub weight: ExpertTensorRef,
    pub scales: ExpertTensorRef,
    /// Affine components only; MXFP4 has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub biases: Option<ExpertTensorRef>,
}

/// A byte range inside an expert extent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertTensorRef {
    /// `U32` for codes; `BF16` or `F32` for affine scales and biases, `U8`
    /// for MXFP4 scales.
    pub dtype: String,
    pub offset: u64,
    pub bytes: u64,
}

impl Manifest {
    pub fn read(path: &Path) -> Result<Self> {
        let text = crate::format::read_small_text(path, MAX_MANIFEST_BYTES)?;
        let m: Manifest = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })?;
        if m.format != FORMAT_NAME {
            return Err(Error::format(
                path,
                format!("`format` is `{}`, expected `{FORMAT_NAME}`", m.format),
            ));
        }
        if m.format_version != FORMAT_VERSION {
            return Err(Error::format(
                path,
                format!(
                    "format_version {} is not supported by this build (supports {FORMAT_VERSION})",
                    m.format_version
                ),
            ));
        }
        Ok(m)
    }

    /// Checks every count, index and extent of the manifest against `config`
    /// before anything is allocated or opened by them (the manifest is
    /// untrusted input): paths stay inside the model directory, every expert
    /// layer is a MoE layer of the config listed once with its own file, the
    /// config's number of experts, and a stride that is a positive multiple
    /// of 4096 holding `expert_bytes` with no overflow. Errors name the field
    /// (`experts[3].layer`). Component extents inside an expert are checked
    /// by [`crate::model::moe::ExpertLayout::from_manifest`]; file sizes
    /// where the files are opened.
    pub fn check(&self, path: &Path, config: &ModelConfig) -> Result<()> {
        let bad = |field: String, reason: String| Error::format(path, format!("{field}: {reason}"));
        super::check_relative(&self.dense_file).map_err(|r| bad("dense_file".into(), r))?;
        for (name, t) in &self.tensors {
            if t.offset.checked_add(t.bytes).is_none() {
                return Err(bad(
                    format!("tensors.{name}"),
                    format!("offset {} + bytes {} overflows", t.offset, t.bytes),
                ));
            }
        }
        let mut files = std::collections::BTreeSet::new();
        check_experts(&self.experts, "experts", &mut files, path, config)?;
        check_experts(
            &self.low_width_experts,
            "low_width_experts",
            &mut files,
            path,
            config,
        )
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest serializes")
    }

    /// What `moeflux.json` holds: the JSON and a newline.
    pub fn file_text(&self) -> String {
        let mut text = self.to_json();
        text.push('\n');
        text
    }

    pub fn expert_layer(&self, layer: usize) -> Option<&ExpertLayer> {
        self.experts.iter().find(|l| l.layer == layer)
    }

    /// This manifest with its low-width copies in the experts' place (and
    /// no copies of their own): what a store of the copies opens.
    pub fn copies_as_experts(&self) -> Manifest {
        Manifest {
            experts: self.low_width_experts.clone(),
            low_width_experts: Vec::new(),
            ..self.clone()
        }
    }

    /// The low-width copies of layer `layer`'s experts, if the model has them.
    pub fn low_width_layer(&self, layer: usize) -> Option<&ExpertLayer> {
        self.low_width_experts.iter().find(|l| l.layer == layer)
    }

    /// Total bytes of the dense tensors.
    pub fn dense_bytes(&self) -> u64 {
        // Saturating: `inspect` may describe a manifest that fails its checks.
        self.tensors
            .values()
            .fold(0u64, |a, t| a.saturating_add(t.bytes))
    }

    /// Weight bytes one decoded token reads: the dense tensors, of which the
    /// embedding table only one row (all of it again when it doubles as the
    /// LM head), plus `k` routed experts of every MoE layer. The numerator
    /// of the decode roofline.
    pub fn decode_bytes_per_token(&self, k: usize, vocab: usize, tied_embeddings: bool) -> u64 {
        let embed: u64 = self
            .tensors
            .iter()
            .filter(|(name, _)| name.starts_with("model.embed_tokens."))
            .map(|(_, t)| t.bytes)
            .sum();
        let embed_read = if tied_embeddings {
            embed
        } else {
            embed / vocab.max(1) as u64
        };
        let experts: u64 = self.experts.iter().map(|l| k as u64 * l.expert_bytes).sum();
        self.dense_bytes() - embed + embed_read + experts
    }

    /// Total bytes of all expert files.
    pub fn expert_bytes(&self) -> u64 {
        layers_bytes(&self.experts)
    }

    /// Total bytes of the low-width copies' files (0: none).
    pub fn low_width_bytes(&self) -> u64 {
        layers_bytes(&self.low_width_experts)
    }
}

/// Bytes of the files of `layers` (saturating: `inspect` may describe a
/// manifest that fails its checks).
fn layers_bytes(layers: &[ExpertLayer]) -> u64 {
    layers.iter().fold(0u64, |a, l| {
        a.saturating_add(l.stride.saturating_mul(l.num_experts as u64))
    })
}

impl ExpertLayer {
    pub fn component(&self, name: &str) -> Option<&ExpertComponent> {
        self.components.iter().find(|c| c.name == name)
    }
}

/// Checks one list of expert layers (`field`: its name in errors) against
/// `config`: see [`Manifest::check`]. `files` collects the files of every
/// list, so no two layers of any list share one.
fn check_experts(
    list: &[ExpertLayer],
    field: &str,
    files: &mut std::collections::BTreeSet<std::path::PathBuf>,
    path: &Path,
    config: &ModelConfig,
) -> Result<()> {
    let bad = |field: String, reason: String| Error::format(path, format!("{field}: {reason}"));
    let mut seen = vec![false; config.num_layers];
    for (i, el) in list.iter().enumerate() {
        let f = |name: &str| format!("{field}[{i}].{name}");
        if el.layer >= config.num_layers {
            return Err(bad(
                f("layer"),
                format!(
                    "{} is not a layer of this model (config.json: num_hidden_layers {})",
                    el.layer, config.num_layers
                ),
            ));
        }
        if !config.is_moe_layer(el.layer) {
            return Err(bad(
                f("layer"),
                if config.moe.num_experts == 0 {
                    format!(
                        "layer {} is not a MoE layer: config.json: num_experts is 0 \
                         (a model without routed experts)",
                        el.layer
                    )
                } else {
                    format!("layer {} is not a MoE layer in config.json", el.layer)
                },
            ));
        }
        if std::mem::replace(&mut seen[el.layer], true) {
            return Err(bad(f("layer"), format!("layer {} listed twice", el.layer)));
        }
        super::check_relative(&el.file).map_err(|r| bad(f("file"), r))?;
        // Lexically normalised, so `experts/./a.bin` and `experts/a.bin` match.
        let norm: std::path::PathBuf = Path::new(&el.file).components().collect();
        if !files.insert(norm) {
            return Err(bad(
                f("file"),
                format!("`{}` is also the file of another layer", el.file),
            ));
        }
        if el.num_experts != config.moe.num_experts {
            return Err(bad(
                f("num_experts"),
                format!(
                    "{}, but config.json says {}",
                    el.num_experts, config.moe.num_experts
                ),
            ));
        }
        if el.stride == 0 || !el.stride.is_multiple_of(super::EXPERT_ALIGN as u64) {
            return Err(bad(
                f("stride"),
                format!(
                    "{} is not a positive multiple of {}",
                    el.stride,
                    super::EXPERT_ALIGN
                ),
            ));
        }
        if el.expert_bytes == 0 || el.expert_bytes > el.stride {
            return Err(bad(
                f("expert_bytes"),
                format!(
                    "{} is not in 1..={} (the stride)",
                    el.expert_bytes, el.stride
                ),
            ));
        }
        let total = (el.num_experts as u64).checked_mul(el.stride);
        if total.is_none_or(|t| usize::try_from(t).is_err()) {
            return Err(bad(
                f("stride"),
                format!(
                    "{} experts x stride {} does not fit in memory",
                    el.num_experts, el.stride
                ),
            ));
        }
    }
    Ok(())
}
