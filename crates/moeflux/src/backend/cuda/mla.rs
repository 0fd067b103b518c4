//! Multi-head latent attention (DeepSeek-V3 family) on the GPU, the same
//! computation as `model/mla.rs`: the cache holds the normed latent and the
//! rotated shared key per token (`kv_lora_rank + qk_rope_head_dim` floats),
//! and attention always runs in the **absorbed** form — each head's
//! `q_nope` goes through `embed_q` into latent space, scores are taken
//! against the cached latents, and the softmax-weighted latent goes through
//! `unembed_out` — for one token (as on the CPU) and for batches (the CPU
//! decompresses there; both forms match mlx-lm's float32 forward). Batches
//! are attended in chunks of tokens so the per-head latent buffers stay
//! bounded. The YaRN tables are the model's (`model/rope.rs`), computed on
//! the host and uploaded.

use crate::config::{MlaConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::model::mla::{mla_of, MlaAttention, QueryProj, LORA_NORM_EPS};
use crate::model::rope::{softmax_scale, Rope};

use super::abi::Qw;
use super::device::{args, Gpu};
use super::linear::{
    head_matmul, matmuls, mm, mm_add, rms_norm, DevLinear, PerHead, ROWS_PER_WARP,
};
use super::model::Ctx;
use super::state::{GpuLayerState, RowCache};
use super::support::unsupported;
use super::token_split::row;

/// Bytes of the per-head latent buffers (absorbed queries, attended
/// latents) one chunk of a batch may take.
const CHUNK_BYTES: usize = 64 << 20;

/// Latent channels a lane of `mla_attention` holds (`MLA_LAT` in mla.cu:
/// 16 per lane of a warp) and rotary channels (`MLA_ROPE`: 4 per lane).
const MAX_KV_LORA: usize = 16 * 32;
const MAX_ROPE: usize = 4 * 32;

/// What every MLA layer shares: the shape, the rotary magnitude and
/// position scale, and the softmax scale (YaRN's `mscale_all_dim` in it).
#[derive(Clone, Copy, Debug)]
pub(super) struct MlaParams {
    pub dims: MlaConfig,
    pub heads: usize,
    pub mscale: f32,
    pub position_scale: f64,
    pub scale: f32,
}

impl MlaParams {
    /// The shape the kernels take, or why not.
    pub fn new(c: &ModelConfig, rope: &Rope) -> Result<MlaParams> {
        let dims = mla_of(c)?;
        let (kvl, r) = (dims.kv_lora_rank, dims.qk_rope_head_dim);
        if kvl > MAX_KV_LORA || r > MAX_ROPE || r % 2 != 0 || 2 * rope.inv_freq.len() != r {
            return Err(unsupported(format!(
                "MLA with kv_lora_rank {kvl} and qk_rope_head_dim {r} (at most {MAX_KV_LORA} \
                 and an even {MAX_ROPE})"
            )));
        }
        // A warp's rows of the per-head products must share a head.
        if !kvl.is_multiple_of(ROWS_PER_WARP) || !dims.v_head_dim.is_multiple_of(ROWS_PER_WARP) {
            return Err(unsupported(format!(
                "MLA with kv_lora_rank {kvl} and v_head_dim {} (multiples of {ROWS_PER_WARP})",
                dims.v_head_dim
            )));
        }
        Ok(MlaParams {
            dims,
            heads: c.num_attention_heads,
            mscale: rope.mscale,
            position_scale: rope.position_scale,
            scale: softmax_scale(&dims, &c.rope),
        })
    }
}

/// The per-head absorptions must be quantized (the per-head product kernel
/// decodes codes); every converter writes them so.
fn quantized(l: DevLinear, what: &str) -> Result<Qw> {
    match l {
        DevLinear::Quant(q) => Ok(q),
        DevLinear::Dense { .. } => Err(unsupported(format!("an unquantized MLA {what}"))),
    }
}

/// What the GPU needs of an MLA layer that the kernels cannot take
/// otherwise (checked before anything is uploaded).
pub(super) fn check_layer(a: &MlaAttention) -> Result<()> {
    for (what, l) in [("embed_q", &a.embed_q), ("unembed_out", &a.unembed_out)] {
        if l.quant.is_none() {
            return Err(unsupported(format!("an unquantized MLA {what}")));
        }
    }
    Ok(())
}

/// An empty latent cache.
pub(super) fn new_cache(gpu: &Gpu, p: &MlaParams) -> Result<GpuLayerState> {
    let d = &p.dims;
    Ok(GpuLayerState::Mla(RowCache::new(
        gpu,
        d.kv_lora_rank,
        d.qk_rope_head_dim,
    )?))
}

/// Tokens of a batch attended per chunk: the absorbed queries and the
/// attended latents of a chunk (`heads * kv_lora_rank` floats per token
/// each) within [`CHUNK_BYTES`].
fn chunk_tokens(p: &MlaParams) -> usize {
    (CHUNK_BYTES / (4 * p.heads * p.dims.kv_lora_rank)).max(1)
}

/// Attention of layer `i` for `n` normed tokens at the eval's positions,
/// their latents appended to the layer's cache (already grown to take
/// them); the output projection is added to `x`. One sequence's rows:
/// `cx.split`, if any, is this sequence's share of the split.
pub(super) fn forward(
    cx: &mut Ctx,
    i: usize,
    a: &MlaAttention,
    xn: u64,
    n: usize,
    x: u64,
) -> Result<()> {
    let w = cx.weights;
    let p = &cx
        .mla
        .ok_or_else(|| Error::Invalid("MLA layer without MLA parameters".into()))?;
    let d = &p.dims;
    let (nh, qhd, kvl, r, nope, v) = (
        p.heads,
        d.q_head_dim(),
        d.kv_lora_rank,
        d.qk_rope_head_dim,
        d.qk_nope_head_dim,
        d.v_head_dim,
    );
    let h = cx.config.hidden_size;
    // Split by tokens, this GPU projects and attends its own rows (`mine`
    // of them from `lo`); the others' latents are broadcast to it, so every
    // GPU appends every row to its cache.
    let own = cx.own_rows(n);
    let (lo, mine) = (own.start, own.len());
    let g = cx.gpu;
    let s = &mut *cx.scratch;
    let q = s.get(g, "mla_q", 4 * n * nh * qhd)?;
    let kv = s.get(g, "mla_kv", 4 * n * (kvl + r))?;
    let kv_a = w.lin(&a.kv_a);
    let (xn, q_own, kv_own) = (row(xn, lo, h), row(q, lo, nh * qhd), row(kv, lo, kvl + r));
    // (A sequence of a split batch may lie wholly in the other GPUs' rows.)
    match &a.q {
        _ if mine == 0 => {}
        QueryProj::Lora {
            a: qa_proj,
            norm,
            b,
        } => {
            let (wa, wb, norm) = (w.lin(qa_proj), w.lin(b), w.vec(*norm));
            let rank = wa.rows();
            let qa = s.get(g, "mla_qa", 4 * mine * rank)?;
            let qn = s.get(g, "mla_qn", 4 * mine * rank)?;
            matmuls(g, &[mm(wa, qa), mm(kv_a, kv_own)], xn, mine)?;
            rms_norm(g, qa, norm, mine, rank, LORA_NORM_EPS, qn)?;
            matmuls(g, &[mm(wb, q_own)], qn, mine)?;
        }
        QueryProj::Plain(wq) => matmuls(g, &[mm(w.lin(wq), q_own), mm(kv_a, kv_own)], xn, mine)?,
    }
    cx.share_rows(&[(kv, kvl + r)])?;
    let s = &mut *cx.scratch;
    let Some(GpuLayerState::Mla(cache)) = cx.state.layers.get(i) else {
        return Err(Error::Invalid(format!(
            "layer {i}: GPU state is not an MLA cache"
        )));
    };
    let (lat, rope) = (cache.a.ptr(), cache.b.ptr());
    let (nh_i, kvl_i, r_i, qhd_i, nope_i) =
        (nh as i32, kvl as i32, r as i32, qhd as i32, nope as i32);
    let (kv_norm, inv_freq, pos) = (w.vec(a.kv_norm), cx.inv_freq, cx.pos);
    let (eps, mscale, ps, scale) = (LORA_NORM_EPS, p.mscale, p.position_scale, p.scale);
    // SAFETY: `mla_prep` in mla.cu; q and kv hold n tokens, the cache
    // rows *pos .. *pos + n exist. (Split by tokens, it also rotates the
    // other GPUs' query rows here, which nothing reads.)
    unsafe {
        g.launch(
            "mla_prep",
            (1 + nh as u32, n as u32, 1),
            256,
            0,
            &mut args!(
                kv, q, kv_norm, inv_freq, nh_i, kvl_i, r_i, qhd_i, nope_i, eps, mscale, pos, ps,
                lat, rope
            ),
        )?
    };
    let embed_q = quantized(w.lin(&a.embed_q), "embed_q")?;
    let unembed_out = quantized(w.lin(&a.unembed_out), "unembed_out")?;
    let chunk = chunk_tokens(p).min(mine.max(1));
    let qa = s.get(g, "mla_qlat", 4 * chunk * nh * kvl)?;
    let ctx_lat = s.get(g, "mla_ctx", 4 * chunk * nh * kvl)?;
    let attn = s.get(g, "mla_attn", 4 * n * nh * v)?;
    let into_latent = PerHead {
        rows_per_head: kvl,
        x_token: nh * qhd,
        x_head: qhd,
    };
    let out_of_latent = PerHead {
        rows_per_head: v,
        x_token: nh * kvl,
        x_head: kvl,
    };
    for t0 in (lo..lo + mine).step_by(chunk) {
        let m = chunk.min(lo + mine - t0);
        let q_t0 = q + (4 * t0 * nh * qhd) as u64;
        head_matmul(g, embed_q, into_latent, q_t0, m, qa)?;
        let t0_i = t0 as i32;
        // SAFETY: `mla_attention` in mla.cu: qa and ctx_lat hold m tokens
        // of every head, q the chunk's rotated queries, the cache every
        // row up to the chunk's last position; shared memory holds the
        // 8 warps' partial latents.
        unsafe {
            g.launch(
                "mla_attention",
                (nh as u32, m as u32, 1),
                256,
                (4 * 8 * kvl) as u32,
                &mut args!(
                    qa, q_t0, lat, rope, nh_i, kvl_i, r_i, qhd_i, nope_i, pos, t0_i, scale, ctx_lat
                ),
            )?
        };
        let attn_t0 = attn + (4 * t0 * nh * v) as u64;
        head_matmul(g, unembed_out, out_of_latent, ctx_lat, m, attn_t0)?;
    }
    if mine == 0 {
        return Ok(());
    }
    let out = mm_add(w.lin(&a.o_proj), row(x, lo, h));
    matmuls(g, &[out], row(attn, lo, nh * v), mine)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(heads: usize, kvl: usize) -> MlaParams {
        MlaParams {
            dims: MlaConfig {
                q_lora_rank: Some(1536),
                kv_lora_rank: kvl,
                qk_nope_head_dim: 128,
                qk_rope_head_dim: 64,
                v_head_dim: 128,
            },
            heads,
            mscale: 1.0,
            position_scale: 1.0,
            scale: 0.1,
        }
    }

    #[test]
    fn chunks_bound_the_latent_buffers() {
        // DeepSeek-V3: 128 heads x 512 floats = 256 KiB per token.
        assert_eq!(chunk_tokens(&params(128, 512)), 256);
        // Never zero, however wide.
        assert_eq!(chunk_tokens(&params(1 << 20, 512)), 1);
    }
}
