//! One layer type for every family: an input RMSNorm, a token mixer (full
//! attention, GatedDeltaNet or MLA), a post-attention RMSNorm and an MLP
//! (mixture of experts or dense), each half added to the residual stream.

use crate::model::attention::FullAttention;
use crate::model::deltanet::GatedDeltaNet;
use crate::model::mla::MlaAttention;
use crate::model::moe::{DenseMlp, MoeBlock};
use crate::model::weights::VectorRef;

pub enum Mixer {
    /// Grouped-query attention over a KV cache (Qwen, GLM).
    Full(FullAttention),
    /// GatedDeltaNet linear attention (Qwen3.5 / Qwen3-Next).
    Linear(GatedDeltaNet),
    /// Multi-head latent attention (the DeepSeek-V3 family).
    Mla(MlaAttention),
}

// One value per layer: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum Mlp {
    Moe(MoeBlock),
    Dense(DenseMlp),
}

pub struct Layer {
    pub input_norm: VectorRef,
    pub mixer: Mixer,
    pub post_norm: VectorRef,
    pub mlp: Mlp,
}

impl Mlp {
    pub fn moe(&self) -> Option<&MoeBlock> {
        match self {
            Mlp::Moe(m) => Some(m),
            Mlp::Dense(_) => None,
        }
    }
}
