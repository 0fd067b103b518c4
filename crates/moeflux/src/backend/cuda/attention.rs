//! Grouped-query full attention on the GPU (`model::attention`): the q/k/v
//! projections in one launch; biases, q/k norms, rotary, the output gate's
//! copy and the K/V append in one kernel (`attn_prep`); attention over the
//! KV cache (`attention`, or on the tensor cores for batches of 16+ tokens:
//! `attn_kv_split` + `attention_mma`); the output projection added to `x`.

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::attention::FullAttention;

use super::abi::AttnParts;
use super::device::{args, Gpu};
use super::linear::{matmuls, mm, mm_add, MMA_MIN_TOKENS};
use super::model::{Ctx, MixerRun, SeqRows};
use super::state::{GpuLayerState, RowCache};
use super::support::unsupported;
use super::token_split::row;

/// The head widths the kernels take (a warp's lanes over a head's channels).
pub(super) fn check_shape(c: &ModelConfig) -> Result<()> {
    let hd = c.head_dim;
    if !hd.is_multiple_of(32) || hd > 256 {
        return Err(unsupported(format!(
            "head_dim {hd} (multiples of 32 up to 256)"
        )));
    }
    Ok(())
}

/// An empty KV cache for a full-attention layer with `window`.
pub(super) fn new_kv(gpu: &Gpu, c: &ModelConfig, window: Option<usize>) -> Result<GpuLayerState> {
    let row = c.num_kv_heads * c.head_dim;
    let mut cache = RowCache::new(gpu, row, row)?;
    cache.window = window;
    Ok(GpuLayerState::Full(cache))
}

fn state_error(i: usize) -> Error {
    Error::Invalid(format!("layer {i}: GPU state is not a KV cache"))
}

/// Query rows per block and keys per step of `attention_mma` (attn_mma.cu's
/// `ATT_ROWS`, `ATT_KT`).
const ATT_ROWS: usize = 64;
const ATT_KT: usize = 32;

/// The dynamic shared memory of `attention_mma` for a batch of `n` tokens
/// when the tensor-core attention serves it on this GPU: head dims of 32 to
/// 256, query heads per KV group dividing its 64 rows (or a multiple of
/// them), and the tiles within the device's shared memory (a 256-wide head
/// takes 200 KiB: Hopper, not Ampere).
fn attention_mma_smem(gpu: &Gpu, nh: usize, nkv: usize, hd: usize, n: usize) -> Option<usize> {
    let group = nh / nkv;
    let shape = matches!(hd, 32 | 64 | 128 | 256)
        && (ATT_ROWS.is_multiple_of(group) || group.is_multiple_of(ATT_ROWS));
    // q, two k buffers (rows of four quarters plus a padding uint4) and two
    // v buffers, in uint4s (ATT_SMEM_UINT4).
    let smem = 16 * ((ATT_ROWS + 2 * ATT_KT) * 4 * (hd / 16 + 1) + 2 * (ATT_KT / 16) * hd * 4);
    (gpu.mma && n >= MMA_MIN_TOKENS && shape && smem <= gpu.smem_optin).then_some(smem)
}

/// Grouped-query attention of layer `i` for the `n` normed tokens `xn`
/// of `seqs` (their rows, in order), its output projection added to `x`:
/// the projections once over all rows, rotary, the KV append and the
/// attention per sequence on its own cache (one launch each for a decode
/// batch).
pub(super) fn forward(
    cx: &mut Ctx,
    i: usize,
    a: &FullAttention,
    xn: u64,
    n: usize,
    x: u64,
    seqs: &[SeqRows],
) -> Result<()> {
    let w = cx.weights;
    let c = cx.config;
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    let (wq, wk, wv, wo) = (
        w.lin(&a.q_proj),
        w.lin(&a.k_proj),
        w.lin(&a.v_proj),
        w.lin(&a.o_proj),
    );
    let bias = a.qkv_bias.map(|b| b.map(|v| w.vec(v)));
    // gpt-oss: a sink logit per head and (sliding layers) a window; the
    // one-token kernel's `attention_sinks` serves both its decode and its
    // batches (the tensor-core kernel has neither).
    let sinks = a.sinks.map(|v| w.vec(v));
    let window = a.window.unwrap_or(0) as i32;
    // Only `attention_sinks` reads a window layer's ring (`ring.rs`).
    if a.window.is_some() && sinks.is_none() {
        return Err(unsupported(format!(
            "layer {i}: a sliding window without attention sinks"
        )));
    }
    let norm = a.qk_norm.map(|(q, k)| (w.vec(q), w.vec(k)));
    let parts = AttnParts {
        q_bias: bias.map_or(0, |b| b[0]),
        k_bias: bias.map_or(0, |b| b[1]),
        v_bias: bias.map_or(0, |b| b[2]),
        q_norm: norm.map_or(0, |n| n.0),
        k_norm: norm.map_or(0, |n| n.1),
        gated: a.output_gate as i32,
        // gpt-oss's YaRN scales the rotated channels (1.35 at factor 32).
        mscale: cx.rope_mscale,
    };
    let q_rows = wq.rows();
    let kv_rows = nkv * hd;
    // Split by tokens, this GPU projects its own rows (`m` of them from
    // `lo`) and the others' are broadcast to it before rotary.
    let own = cx.own_rows(n);
    let (lo, m) = (own.start, own.len());
    let g = cx.gpu;
    let s = &mut *cx.scratch;
    let qg = s.get(g, "qg", 4 * n * q_rows)?;
    let k = s.get(g, "k", 4 * n * kv_rows)?;
    let v = s.get(g, "v", 4 * n * kv_rows)?;
    let q = s.get(g, "q", 4 * n * nh * hd)?;
    let gate = if a.output_gate {
        s.get(g, "gate", 4 * n * nh * hd)?
    } else {
        0
    };
    let attn = s.get(g, "attn", 4 * n * nh * hd)?;
    let ops = [
        mm(wq, row(qg, lo, q_rows)),
        mm(wk, row(k, lo, kv_rows)),
        mm(wv, row(v, lo, kv_rows)),
    ];
    matmuls(g, &ops, row(xn, lo, c.hidden_size), m)?;
    cx.share_rows(&[(qg, q_rows), (k, kv_rows), (v, kv_rows)])?;
    let half = (c.rope.rotary_dim / 2) as i32;
    let (nh_i, nkv_i, hd_i) = (nh as i32, nkv as i32, hd as i32);
    let (eps, ps) = (c.rms_norm_eps, c.rope.position_scale);
    let inv_freq = cx.inv_freq;
    let scale = 1.0 / (hd as f32).sqrt();
    let (qs, ks) = (4 * q_rows as u64, 4 * kv_rows as u64);
    let hs = 4 * (nh * hd) as u64;
    for run in MixerRun::split(seqs) {
        let sq = match run {
            MixerRun::Decode(run) => {
                let tab = cx
                    .decode_table(i, run, |l| matches!(l, GpuLayerState::Full(_)))
                    .ok_or_else(|| state_error(i))?;
                let first = &run[0];
                let r0 = first.seg.rows.start as u64;
                let rows = run.len() as u32;
                let (qg, k, v) = (qg + r0 * qs, k + r0 * ks, v + r0 * ks);
                let (q, attn) = (q + r0 * hs, attn + r0 * hs);
                let gate = if a.output_gate { gate + r0 * hs } else { 0 };
                let (pos, none) = (first.pos, 0u64);
                let (mask, masks) = (-1i64, cx.decode_masks(i, run));
                // SAFETY: `attn_prep` and `attention` in kernels/attention.cu, a row
                // per sequence: the table holds each one's K and V cache
                // (grown for its token before the eval) and its row mask,
                // `pos` its position; the scratch buffers hold n rows.
                unsafe {
                    g.launch(
                        "attn_prep",
                        ((nh + nkv) as u32, rows, 1),
                        hd as u32,
                        (4 * hd) as u32,
                        &mut args!(
                            qg, k, v, parts, inv_freq, half, nh_i, nkv_i, hd_i, eps, pos, ps, q,
                            gate, none, none, tab, mask, masks
                        ),
                    )?;
                    match sinks {
                        Some(sk) => g.launch(
                            "attention_sinks",
                            (nh as u32, rows, 1),
                            256,
                            0,
                            &mut args!(
                                q, none, none, sk, nh_i, nkv_i, hd_i, pos, scale, attn, tab,
                                window, mask, masks
                            ),
                        )?,
                        None => g.launch(
                            if a.output_gate {
                                "attention"
                            } else {
                                "attention_plain"
                            },
                            (nh as u32, rows, 1),
                            256,
                            0,
                            &mut args!(
                                q, none, none, gate, nh_i, nkv_i, hd_i, pos, scale, attn, tab
                            ),
                        )?,
                    }
                }
                continue;
            }
            MixerRun::One(sq) => sq,
        };
        let Some(GpuLayerState::Full(kv)) = sq.state.layers.get(i) else {
            return Err(state_error(i));
        };
        let (kc, vc, mask) = (kv.a.ptr(), kv.b.ptr(), kv.mask());
        let (pos, none) = (sq.pos, 0u64);
        let n = sq.seg.rows.len();
        let r0 = sq.seg.rows.start as u64;
        let (qg, k, v) = (
            qg + 4 * r0 * q_rows as u64,
            k + 4 * r0 * (nkv * hd) as u64,
            v + 4 * r0 * (nkv * hd) as u64,
        );
        let at = 4 * r0 * (nh * hd) as u64;
        let (q, attn) = (q + at, attn + at);
        let gate = if a.output_gate { gate + at } else { 0 };
        // SAFETY: `attn_prep` in kernels/attention.cu; the scratch buffers are sized
        // for n tokens and the cache for its rows (grown before the eval); the
        // parts' vectors hold a projection row's floats, gate is allocated
        // exactly when gated.
        unsafe {
            g.launch(
                "attn_prep",
                ((nh + nkv) as u32, n as u32, 1),
                hd as u32,
                (4 * hd) as u32,
                &mut args!(
                    qg, k, v, parts, inv_freq, half, nh_i, nkv_i, hd_i, eps, pos, ps, q, gate, kc,
                    vc, none, mask, none
                ),
            )?
        };
        let mma_smem = attention_mma_smem(g, nh, nkv, hd, n).filter(|_| sinks.is_none());
        if let Some(sk) = sinks {
            // SAFETY: `attention_sinks` in kernels/attention.cu; buffers as below,
            // sinks hold a float per head.
            unsafe {
                g.launch(
                    "attention_sinks",
                    (nh as u32, n as u32, 1),
                    256,
                    0,
                    &mut args!(
                        q, kc, vc, sk, nh_i, nkv_i, hd_i, pos, scale, attn, none, window, mask,
                        none
                    ),
                )?
            };
        } else if let Some(smem) = mma_smem {
            let ctx = sq.seg.start + n;
            let ctx_pad = ctx.next_multiple_of(ATT_KT);
            let per = ctx_pad * hd / 4; // uint4s per KV group, of K and of V
            let ws = g.workspace(2 * 16 * per * nkv)?;
            let (kp, vp) = (ws, ws + (16 * per * nkv) as u64);
            let (ctx_i, pad_i, nn) = (ctx as i64, ctx_pad as i64, n as i32);
            let group = nh / nkv;
            let heads = group.min(ATT_ROWS);
            let grid = (
                n.div_ceil(ATT_ROWS / heads) as u32,
                (nkv * group / heads) as u32,
                1,
            );
            // SAFETY: `attn_kv_split` and `attention_mma` in attn_mma.cu;
            // the workspace holds both split caches of ctx_pad rows, the
            // caches hold ctx rows, q / gate / attn n tokens, and
            // attention_mma_smem checked the shape and the shared memory.
            unsafe {
                g.launch(
                    "attn_kv_split",
                    ((per * nkv).div_ceil(256) as u32, 2, 1),
                    256,
                    0,
                    &mut args!(kc, vc, nkv_i, hd_i, ctx_i, pad_i, kp, vp),
                )?;
                g.launch(
                    if a.output_gate {
                        "attention_mma"
                    } else {
                        "attention_mma_plain"
                    },
                    grid,
                    128,
                    smem as u32,
                    &mut args!(q, kp, vp, gate, nh_i, nkv_i, hd_i, pos, pad_i, nn, scale, attn),
                )?;
            }
        } else {
            // SAFETY: `attention` in kernels/attention.cu; buffers as above.
            unsafe {
                g.launch(
                    if a.output_gate {
                        "attention"
                    } else {
                        "attention_plain"
                    },
                    (nh as u32, n as u32, 1),
                    256,
                    0,
                    &mut args!(q, kc, vc, gate, nh_i, nkv_i, hd_i, pos, scale, attn, none),
                )?
            };
        }
    }
    let o_bias = a.o_bias.map(|b| w.vec(b));
    let out = mm_add(wo, row(x, lo, c.hidden_size)).with_bias(o_bias);
    matmuls(g, &[out], row(attn, lo, nh * hd), m)
}
