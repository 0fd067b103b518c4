//! Multi-head latent attention on the CPU (`model::mla`), in the two forms
//! mlx-lm has: **absorbed** (always for one token: the query is folded
//! through `embed_q`, attention runs over the cached latents, the result
//! goes through `unembed_out`) and **decompressed** (batches: `k_nope` and
//! `v` of the context computed once per call), chosen by multiply-add count
//! ([`choose_path`]). They differ by summation order only.

use rayon::prelude::*;

use crate::backend::cpu::ops;
use crate::backend::cpu::qmatmul::{dequantize_row, matmul, matmul_group};
use crate::backend::cpu::vec;
use crate::config::{MlaConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::model::mla::{mla_of, MlaAttention, QueryProj, LORA_NORM_EPS};
use crate::model::rope::Rope;
use crate::model::state::MlaCache;
use crate::model::weights::Weights;
use crate::quant::{DenseData, DenseMatrix, Weight};

/// Largest decompressed `k_nope` + `v` buffer (bytes) the batch path may
/// allocate; beyond it the absorbed path runs (it needs no per-token copies).
const DECOMPRESS_MAX_BYTES: usize = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaPath {
    Absorbed,
    Decompressed,
}

/// The cheaper path for `n` new tokens ending at context length `ctx`:
/// one token always takes the absorbed path (as mlx-lm's `L == 1`); a batch
/// compares multiply-adds (decompression costs `ctx * heads * kv_lora *
/// (nope + v)` once, then `nope + rope + v` per (query, key) pair against
/// `2 * kv_lora + rope` absorbed) and falls back to absorbed when the
/// decompressed keys and values would exceed [`DECOMPRESS_MAX_BYTES`].
pub fn choose_path(m: &MlaConfig, heads: usize, n: usize, ctx: usize) -> MlaPath {
    if n <= 1 {
        return MlaPath::Absorbed;
    }
    let (kvl, nope, r, v) = (
        m.kv_lora_rank,
        m.qk_nope_head_dim,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let start = ctx - n;
    // Sum over the new tokens of the positions each attends to.
    let pairs = n * start + n * (n + 1) / 2;
    let decompressed = ctx * heads * kvl * (nope + v) + pairs * heads * (nope + r + v);
    let absorbed = n * heads * kvl * (nope + v) + pairs * heads * (2 * kvl + r);
    let bytes = ctx * heads * (nope + v) * 4;
    if decompressed <= absorbed && bytes <= DECOMPRESS_MAX_BYTES {
        MlaPath::Decompressed
    } else {
        MlaPath::Absorbed
    }
}

/// Attends `n` normed tokens at positions `start..start+n`, appending
/// their latents to `cache` (which must hold exactly `start` rows).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    a: &MlaAttention,
    w: &Weights,
    c: &ModelConfig,
    rope: &Rope,
    scale: f32,
    xn: &[f32],
    n: usize,
    start: usize,
    cache: &mut MlaCache,
    out: &mut [f32],
) -> Result<()> {
    let m = mla_of(c)?;
    let path = choose_path(&m, c.num_attention_heads, n, start + n);
    forward_with(a, w, c, rope, scale, xn, n, start, cache, out, path)
}

/// [`forward`] on a given path.
#[allow(clippy::too_many_arguments)]
pub fn forward_with(
    a: &MlaAttention,
    w: &Weights,
    c: &ModelConfig,
    rope: &Rope,
    scale: f32,
    xn: &[f32],
    n: usize,
    start: usize,
    cache: &mut MlaCache,
    out: &mut [f32],
    path: MlaPath,
) -> Result<()> {
    let m = mla_of(c)?;
    if cache.len() != start {
        return Err(Error::Invalid(format!(
            "MLA cache holds {} rows at position {start}",
            cache.len()
        )));
    }
    let q = project(a, w, c, &m, rope, xn, n, start, cache);
    let attn = match path {
        MlaPath::Absorbed => attend_absorbed(a, w, c, &m, scale, &q, n, start, cache),
        MlaPath::Decompressed => attend_decompressed(a, w, c, &m, scale, &q, n, start, cache),
    };
    matmul(&w.view(&a.o_proj), &attn, n, out);
    Ok(())
}

/// Queries `[n, heads, nope + rope]` with the rope part rotated; appends
/// the tokens' normed latents and rotated shared keys to `cache`.
#[allow(clippy::too_many_arguments)]
fn project(
    a: &MlaAttention,
    w: &Weights,
    c: &ModelConfig,
    m: &MlaConfig,
    rope: &Rope,
    xn: &[f32],
    n: usize,
    start: usize,
    cache: &mut MlaCache,
) -> Vec<f32> {
    let (nh, qhd, kvl, row) = (
        c.num_attention_heads,
        m.q_head_dim(),
        m.kv_lora_rank,
        m.cache_row(),
    );
    let mut q = vec![0.0f32; n * nh * qhd];
    let mut kv = vec![0.0f32; n * row];
    let wkv = w.view(&a.kv_a);
    match &a.q {
        QueryProj::Lora {
            a: qa_proj,
            norm,
            b,
        } => {
            let r = qa_proj.rows;
            let mut qa = vec![0.0f32; n * r];
            let wa = w.view(qa_proj);
            matmul_group(&mut [(&wa, &mut qa), (&wkv, &mut kv)], xn, n);
            let mut qn = vec![0.0f32; n * r];
            ops::rms_norm_rows(&qa, w.vector(*norm), LORA_NORM_EPS, &mut qn);
            matmul(&w.view(b), &qn, n, &mut q);
        }
        QueryProj::Plain(p) => {
            let wq = w.view(p);
            matmul_group(&mut [(&wq, &mut q), (&wkv, &mut kv)], xn, n);
        }
    }
    let kv_norm = w.vector(a.kv_norm);
    let mut latent = vec![0.0f32; kvl];
    for t in 0..n {
        let pos = start + t;
        let r = &mut kv[t * row..(t + 1) * row];
        ops::rms_norm(&r[..kvl], kv_norm, LORA_NORM_EPS, &mut latent);
        cache.latent.extend_from_slice(&latent);
        rope.apply(&mut r[kvl..], pos);
        cache.rope.extend_from_slice(&r[kvl..]);
        for h in 0..nh {
            let qh = &mut q[(t * nh + h) * qhd..(t * nh + h + 1) * qhd];
            rope.apply(&mut qh[m.qk_nope_head_dim..], pos);
        }
    }
    q
}

/// Latent-space attention; returns `[n, heads * v]`.
#[allow(clippy::too_many_arguments)]
fn attend_absorbed(
    a: &MlaAttention,
    w: &Weights,
    c: &ModelConfig,
    m: &MlaConfig,
    scale: f32,
    q: &[f32],
    n: usize,
    start: usize,
    cache: &MlaCache,
) -> Vec<f32> {
    let nh = c.num_attention_heads;
    let (nope, qhd, kvl, r, v) = (
        m.qk_nope_head_dim,
        m.q_head_dim(),
        m.kv_lora_rank,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let (we, wu) = (w.view(&a.embed_q), w.view(&a.unembed_out));
    let per_head: Vec<Vec<f32>> = (0..nh)
        .into_par_iter()
        .map(|h| {
            let mut qn = vec![0.0f32; n * nope];
            for t in 0..n {
                let src = &q[(t * nh + h) * qhd..(t * nh + h) * qhd + nope];
                qn[t * nope..(t + 1) * nope].copy_from_slice(src);
            }
            let mut qa = vec![0.0f32; n * kvl];
            matmul(&we.row_block(h * kvl, (h + 1) * kvl), &qn, n, &mut qa);
            let mut vc = vec![0.0f32; n * kvl];
            for t in 0..n {
                let qa_t = &qa[t * kvl..(t + 1) * kvl];
                let qpe = &q[(t * nh + h) * qhd + nope..(t * nh + h + 1) * qhd];
                let ctx = start + t + 1;
                let mut scores: Vec<f32> = (0..ctx)
                    .map(|p| {
                        (vec::dot(qa_t, &cache.latent[p * kvl..(p + 1) * kvl])
                            + vec::dot(qpe, &cache.rope[p * r..(p + 1) * r]))
                            * scale
                    })
                    .collect();
                ops::softmax_inplace(&mut scores);
                let o = &mut vc[t * kvl..(t + 1) * kvl];
                for (p, &w) in scores.iter().enumerate() {
                    vec::axpy(o, w, &cache.latent[p * kvl..(p + 1) * kvl]);
                }
            }
            let mut oh = vec![0.0f32; n * v];
            matmul(&wu.row_block(h * v, (h + 1) * v), &vc, n, &mut oh);
            oh
        })
        .collect();
    let mut attn = vec![0.0f32; n * nh * v];
    for (h, oh) in per_head.iter().enumerate() {
        for t in 0..n {
            attn[(t * nh + h) * v..(t * nh + h + 1) * v].copy_from_slice(&oh[t * v..(t + 1) * v]);
        }
    }
    attn
}

/// Attention over decompressed keys and values; returns `[n, heads * v]`.
#[allow(clippy::too_many_arguments)]
fn attend_decompressed(
    a: &MlaAttention,
    w: &Weights,
    c: &ModelConfig,
    m: &MlaConfig,
    scale: f32,
    q: &[f32],
    n: usize,
    start: usize,
    cache: &MlaCache,
) -> Vec<f32> {
    let nh = c.num_attention_heads;
    let (nope, qhd, kvl, r, v) = (
        m.qk_nope_head_dim,
        m.q_head_dim(),
        m.kv_lora_rank,
        m.qk_rope_head_dim,
        m.v_head_dim,
    );
    let ctx = start + n;
    // E_h^T for every head as one f32 matrix [heads * nope, kv_lora], so
    // k_nope of all cached tokens is one matmul.
    let we = w.view(&a.embed_q);
    let mut wt = vec![0.0f32; nh * nope * kvl];
    wt.par_chunks_mut(nope * kvl)
        .enumerate()
        .for_each(|(h, blk)| {
            let mut row = vec![0.0f32; nope];
            for cc in 0..kvl {
                dequantize_row(&we, h * kvl + cc, &mut row);
                for (i, &x) in row.iter().enumerate() {
                    blk[i * kvl + cc] = x;
                }
            }
        });
    let wt = Weight::Dense(DenseMatrix {
        rows: nh * nope,
        cols: kvl,
        data: DenseData::F32(&wt),
    });
    let latent = &cache.latent[..ctx * kvl];
    let mut k_nope = vec![0.0f32; ctx * nh * nope];
    let mut vals = vec![0.0f32; ctx * nh * v];
    let wu = w.view(&a.unembed_out);
    matmul_group(&mut [(&wt, &mut k_nope), (&wu, &mut vals)], latent, ctx);

    let mut attn = vec![0.0f32; n * nh * v];
    attn.par_chunks_mut(v).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        let qh = &q[i * qhd..(i + 1) * qhd];
        let (qn, qpe) = qh.split_at(nope);
        let cx = start + t + 1;
        let mut scores: Vec<f32> = (0..cx)
            .map(|p| {
                let kn = &k_nope[(p * nh + h) * nope..(p * nh + h + 1) * nope];
                (vec::dot(qn, kn) + vec::dot(qpe, &cache.rope[p * r..(p + 1) * r])) * scale
            })
            .collect();
        ops::softmax_inplace(&mut scores);
        o.fill(0.0);
        for (p, &w) in scores.iter().enumerate() {
            vec::axpy(o, w, &vals[(p * nh + h) * v..(p * nh + h + 1) * v]);
        }
    });
    attn
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ds_v3() -> MlaConfig {
        MlaConfig {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        }
    }

    #[test]
    fn decode_is_absorbed_and_prefill_decompressed() {
        let m = ds_v3();
        for ctx in [1, 100, 100_000] {
            assert_eq!(choose_path(&m, 128, 1, ctx), MlaPath::Absorbed);
        }
        assert_eq!(choose_path(&m, 128, 512, 512), MlaPath::Decompressed);
        // A short chunk after a long context keeps the latent form.
        assert_eq!(choose_path(&m, 128, 4, 8192), MlaPath::Absorbed);
        // Too large to decompress: 1 GiB / (128 * 256 * 4) = 8192 tokens.
        assert_eq!(choose_path(&m, 128, 9000, 9000), MlaPath::Absorbed);
    }
}
