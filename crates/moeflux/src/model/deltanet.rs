//! GatedDeltaNet linear attention (Qwen3.5 / Qwen3-Next): causal depthwise
//! conv1d, L2-normalised q/k, decay `g` and write strength `beta`, the
//! delta-rule recurrence on a `[v_dim, k_dim]` state per value head, and a
//! gated RMSNorm.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::state::LinearState;
use crate::model::weights::{LinearRef, VectorRef, WeightsLoader};

/// Input projections: Qwen3.5 splits them; Qwen3-Next fuses them per key head.
// One value per layer: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum DeltaProjections {
    Split {
        qkv: LinearRef,
        z: LinearRef,
        b: LinearRef,
        a: LinearRef,
    },
    /// `in_proj_qkvz` rows per key head `[q dk | k dk | v r*dv | z r*dv]`,
    /// `in_proj_ba` per key head `[b r | a r]` (`r` value heads per key head).
    Fused { qkvz: LinearRef, ba: LinearRef },
}

pub struct GatedDeltaNet {
    pub proj: DeltaProjections,
    /// `[conv_dim][kernel]`.
    pub conv: VectorRef,
    pub a_log: VectorRef,
    pub dt_bias: VectorRef,
    /// The gated RMSNorm's weight (`value_head_dim`).
    pub norm: VectorRef,
    pub out_proj: LinearRef,
}

impl GatedDeltaNet {
    pub fn load(w: &mut WeightsLoader, c: &ModelConfig, prefix: &str) -> Result<Self> {
        let l = &c.linear;
        let h = c.hidden_size;
        let p = format!("{prefix}linear_attn.");
        let proj = if l.fused_projections {
            DeltaProjections::Fused {
                qkvz: w.linear(
                    &format!("{p}in_proj_qkvz"),
                    2 * l.key_dim() + 2 * l.value_dim(),
                    h,
                )?,
                ba: w.linear(&format!("{p}in_proj_ba"), 2 * l.num_v_heads, h)?,
            }
        } else {
            DeltaProjections::Split {
                qkv: w.linear(&format!("{p}in_proj_qkv"), l.conv_dim(), h)?,
                z: w.linear(&format!("{p}in_proj_z"), l.value_dim(), h)?,
                b: w.linear(&format!("{p}in_proj_b"), l.num_v_heads, h)?,
                a: w.linear(&format!("{p}in_proj_a"), l.num_v_heads, h)?,
            }
        };
        Ok(GatedDeltaNet {
            proj,
            conv: w.vector(
                &format!("{p}conv1d.weight"),
                &[l.conv_dim(), l.conv_kernel, 1],
            )?,
            a_log: w.vector(&format!("{p}A_log"), &[l.num_v_heads])?,
            dt_bias: w.vector(&format!("{p}dt_bias"), &[l.num_v_heads])?,
            norm: w.vector(&format!("{p}norm.weight"), &[l.value_head_dim])?,
            out_proj: w.linear(&format!("{p}out_proj"), h, l.value_dim())?,
        })
    }

    /// A zero state: the conv's last `kernel-1` inputs and the recurrent
    /// state per value head.
    pub fn new_state(c: &ModelConfig) -> LinearState {
        let l = &c.linear;
        LinearState {
            conv: vec![0.0; (l.conv_kernel - 1) * l.conv_dim()],
            ssm: vec![0.0; l.num_v_heads * l.value_head_dim * l.key_head_dim],
        }
    }
}
