//! `moeflux.json`: what the directory holds and where every byte lives.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::config::QuantSpec;
use crate::error::{Error, Result};

pub const FORMAT_NAME: &str = "moeflux-model";
pub const FORMAT_VERSION: u32 = 1;

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
/// weight codes then scales then biases at offsets inside the extent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertComponent {
    /// `gate_proj`, `up_proj` or `down_proj`.
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub quant: QuantSpec,
    pub weight: ExpertTensorRef,
    pub scales: ExpertTensorRef,
    pub biases: ExpertTensorRef,
}

/// A byte range inside an expert extent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertTensorRef {
    /// `U32` for codes; `BF16` or `F32` for scales and biases.
    pub dtype: String,
    pub offset: u64,
    pub bytes: u64,
}

impl Manifest {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
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

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("manifest serializes")
    }

    pub fn expert_layer(&self, layer: usize) -> Option<&ExpertLayer> {
        self.experts.iter().find(|l| l.layer == layer)
    }

    /// Total bytes of the dense tensors.
    pub fn dense_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.bytes).sum()
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
        self.experts
            .iter()
            .map(|l| l.stride * l.num_experts as u64)
            .sum()
    }
}

impl ExpertLayer {
    pub fn component(&self, name: &str) -> Option<&ExpertComponent> {
        self.components.iter().find(|c| c.name == name)
    }
}
