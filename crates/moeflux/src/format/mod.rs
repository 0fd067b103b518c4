//! The moeflux model directory (format v1):
//!
//! ```text
//! DIR/config.json, tokenizer files     copied from the source checkpoint
//! DIR/moeflux.json                     manifest (this module)
//! DIR/dense.safetensors                every non-expert tensor
//! DIR/experts/layer_NNN.bin            one file per MoE layer: num_experts
//!                                      extents of `stride` bytes each
//! ```

pub mod manifest;

pub use manifest::{ExpertComponent, ExpertLayer, ExpertTensorRef, Manifest, TensorEntry};

pub const MANIFEST_FILE: &str = "moeflux.json";
pub const DENSE_FILE: &str = "dense.safetensors";
pub const EXPERTS_DIR: &str = "experts";
/// Alignment of expert extents (and of the expert stride): one expert is one
/// O_DIRECT-able read.
pub const EXPERT_ALIGN: usize = 4096;
/// Alignment of components inside an expert extent.
pub const COMPONENT_ALIGN: usize = 64;

/// Relative path of the expert file of `layer`.
pub fn expert_file_name(layer: usize) -> String {
    format!("{EXPERTS_DIR}/layer_{layer:03}.bin")
}
