//! Multi-head latent attention (DeepSeek-V3), following mlx-lm's
//! `DeepseekV3Attention`:
//!
//! ```text
//! q      = q_b(RMSNorm(q_a x)) | q_proj x          per head [q_nope | q_pe]
//! kv     = kv_a_proj_with_mqa x                    [latent | k_pe]
//! c      = RMSNorm(latent), k_pe, q_pe rotated     (interleaved YaRN rope)
//! cache <- (c, k_pe)                               kv_lora_rank + rope dims per token
//! score  = scale * (q_nope . k_nope_t + q_pe . k_pe_t),  k_nope_t = E_h^T c_t
//! out_h  = sum_t p_t v_t,                          v_t = U_h c_t
//! ```
//!
//! `E_h` (`embed_q`, `[kv_lora, nope]` per head) and `U_h` (`unembed_out`,
//! `[v, kv_lora]` per head) are the two halves of the checkpoint's `kv_b_proj`.
//! Two ways to evaluate the same product, as in mlx-lm:
//!
//! - **absorbed** (always for one token): `q'_h = E_h q_nope` so scores are
//!   `q'_h . c_t`; the softmax-weighted latent `sum_t p_t c_t` goes through `U_h`
//!   once. Per cached token this reads only the latent — the decode path.
//! - **decompressed** (batches): `k_nope` and `v` of every cached token are
//!   computed once per call (`c E_h`, `U_h c`) and attention runs per head
//!   in `nope + rope` / `v` dims — cheaper when many queries share the context.
//!
//! The CPU chooses the path by multiply-add count (`backend::cpu::mla`); the
//! GPU always absorbs. Both match mlx's float32 forward; they differ from each
//! other by summation order only.

use crate::config::{MlaConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::model::weights::{LinearRef, VectorRef, WeightsLoader};

/// mlx-lm builds `q_a_layernorm` and `kv_a_layernorm` with `eps=1e-6`,
/// whatever `rms_norm_eps` says.
pub const LORA_NORM_EPS: f32 = 1e-6;

pub enum QueryProj {
    /// `q_b_proj(RMSNorm(q_a_proj x))` (DeepSeek-V3: rank 1536).
    Lora {
        a: LinearRef,
        norm: VectorRef,
        b: LinearRef,
    },
    /// `q_proj x` (`q_lora_rank: null`).
    Plain(LinearRef),
}

pub struct MlaAttention {
    pub q: QueryProj,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`.
    pub kv_a: LinearRef,
    pub kv_norm: VectorRef,
    /// `[heads * kv_lora_rank, qk_nope_head_dim]`: per head `E_h`.
    pub embed_q: LinearRef,
    /// `[heads * v_head_dim, kv_lora_rank]`: per head `U_h`.
    pub unembed_out: LinearRef,
    pub o_proj: LinearRef,
}

/// The MLA shape of a config that must have one.
pub fn mla_of(c: &ModelConfig) -> Result<MlaConfig> {
    c.mla.ok_or_else(|| {
        Error::Invalid(format!(
            "{} has no MLA shape in its config",
            c.arch.model_type()
        ))
    })
}

impl MlaAttention {
    pub fn load(w: &mut WeightsLoader, c: &ModelConfig, prefix: &str) -> Result<Self> {
        let m = mla_of(c)?;
        let (h, nh) = (c.hidden_size, c.num_attention_heads);
        let p = format!("{prefix}self_attn.");
        let q_rows = nh * m.q_head_dim();
        let q = match m.q_lora_rank {
            Some(r) => QueryProj::Lora {
                a: w.linear(&format!("{p}q_a_proj"), r, h)?,
                norm: w.vector(&format!("{p}q_a_layernorm.weight"), &[r])?,
                b: w.linear(&format!("{p}q_b_proj"), q_rows, r)?,
            },
            None => QueryProj::Plain(w.linear(&format!("{p}q_proj"), q_rows, h)?),
        };
        Ok(MlaAttention {
            q,
            kv_a: w.linear(&format!("{p}kv_a_proj_with_mqa"), m.cache_row(), h)?,
            kv_norm: w.vector(&format!("{p}kv_a_layernorm.weight"), &[m.kv_lora_rank])?,
            embed_q: w.linear(
                &format!("{p}embed_q"),
                nh * m.kv_lora_rank,
                m.qk_nope_head_dim,
            )?,
            unembed_out: w.linear(
                &format!("{p}unembed_out"),
                nh * m.v_head_dim,
                m.kv_lora_rank,
            )?,
            o_proj: w.linear(&format!("{p}o_proj"), h, nh * m.v_head_dim)?,
        })
    }
}
