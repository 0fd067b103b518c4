//! Grouped-query full attention: Qwen3.5 / Qwen3-Next's gated form (`q_proj`
//! rows per head `[q | gate]`, output scaled by `sigmoid(gate)`), Qwen3-MoE's
//! and GLM's plain form; per-head q/k RMSNorm and q/k/v biases where the
//! config has them; gpt-oss's o bias, sinks and sliding window; partial
//! half-split rotary; a KV cache per layer.

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::weights::{LinearRef, VectorRef, WeightsLoader};

pub struct FullAttention {
    pub q_proj: LinearRef,
    pub k_proj: LinearRef,
    pub v_proj: LinearRef,
    pub o_proj: LinearRef,
    /// `q_proj` rows are per head `[q (head_dim) | gate (head_dim)]`.
    pub output_gate: bool,
    /// Per-head RMSNorm weights of q and k (`head_dim` each).
    pub qk_norm: Option<(VectorRef, VectorRef)>,
    /// Biases of q, k and v, added to the projections before the norms.
    pub qkv_bias: Option<[VectorRef; 3]>,
    /// Bias of the output projection (gpt-oss).
    pub o_bias: Option<VectorRef>,
    /// One logit per head that joins the softmax without a value (gpt-oss).
    pub sinks: Option<VectorRef>,
    /// Keys visible to a query: the last `window` positions, itself
    /// included (gpt-oss's sliding layers); `None`: all earlier ones.
    pub window: Option<usize>,
}

impl FullAttention {
    pub fn load(
        w: &mut WeightsLoader,
        c: &ModelConfig,
        prefix: &str,
        window: Option<usize>,
    ) -> Result<Self> {
        let (h, nh, nkv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_kv_heads,
            c.head_dim,
        );
        let a = &c.attention;
        let p = format!("{prefix}self_attn.");
        let q_rows = if a.output_gate { 2 * nh * hd } else { nh * hd };
        let qk_norm = if a.qk_norm {
            Some((
                w.vector(&format!("{p}q_norm.weight"), &[hd])?,
                w.vector(&format!("{p}k_norm.weight"), &[hd])?,
            ))
        } else {
            None
        };
        let qkv_bias = if a.qkv_bias {
            Some([
                w.vector(&format!("{p}q_proj.bias"), &[q_rows])?,
                w.vector(&format!("{p}k_proj.bias"), &[nkv * hd])?,
                w.vector(&format!("{p}v_proj.bias"), &[nkv * hd])?,
            ])
        } else {
            None
        };
        let o_bias = if a.o_bias {
            Some(w.vector(&format!("{p}o_proj.bias"), &[h])?)
        } else {
            None
        };
        let sinks = if a.sinks {
            Some(w.vector(&format!("{p}sinks"), &[nh])?)
        } else {
            None
        };
        Ok(FullAttention {
            q_proj: w.linear(&format!("{p}q_proj"), q_rows, h)?,
            k_proj: w.linear(&format!("{p}k_proj"), nkv * hd, h)?,
            v_proj: w.linear(&format!("{p}v_proj"), nkv * hd, h)?,
            o_proj: w.linear(&format!("{p}o_proj"), h, nh * hd)?,
            output_gate: a.output_gate,
            qk_norm,
            qkv_bias,
            o_bias,
            sinks,
            window,
        })
    }
}
