//! The token mixers of the Qwen3.5-MoE / Qwen3-Next hybrid on the GPU:
//! gated full attention (KV cache) and GatedDeltaNet (conv + delta rule).

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::model::deltanet::DeltaProjections;
use crate::model::qwen3_hybrid::Mixer;

use super::device::{args, DevBuf, Gpu};
use super::linear::{dev_linear, matmuls, mm, mm_add, DevLinear, MMA_MIN_TOKENS};
use super::model::{unsupported, Ctx, GpuMixer};
use super::state::{GpuLayerState, GpuLinearState, RowCache};

pub(super) struct GpuFullAttn {
    q: DevLinear,
    k: DevLinear,
    v: DevLinear,
    o: DevLinear,
    q_norm: DevBuf,
    k_norm: DevBuf,
}

pub(super) struct GpuLinearAttn {
    proj: GpuDeltaProj,
    conv: DevBuf,
    a_log: DevBuf,
    dt_bias: DevBuf,
    norm: DevBuf,
    out: DevLinear,
}

enum GpuDeltaProj {
    Split {
        qkv: DevLinear,
        z: DevLinear,
        b: DevLinear,
        a: DevLinear,
    },
    Fused {
        qkvz: DevLinear,
        ba: DevLinear,
    },
}

/// The shapes the Qwen kernels take (a warp's lanes over a head's channels,
/// a thread per conv tap).
pub(super) fn check_shape(c: &ModelConfig) -> Result<()> {
    for (what, v) in [
        ("head_dim", c.head_dim),
        ("linear key head dim", c.linear.key_head_dim),
        ("linear value head dim", c.linear.value_head_dim),
    ] {
        if v % 32 != 0 || v > 256 {
            return Err(unsupported(format!(
                "{what} {v} (multiples of 32 up to 256)"
            )));
        }
    }
    if c.linear.conv_kernel > 9 {
        return Err(unsupported(format!("conv kernel {}", c.linear.conv_kernel)));
    }
    Ok(())
}

/// A Qwen mixer's weights on the device (`base`: the uploaded dense file).
pub(super) fn upload_mixer(gpu: &Gpu, base: u64, m: &Mixer) -> Result<GpuMixer> {
    let lin = |l| dev_linear(base, l);
    let vec = |v: &[f32]| DevBuf::from_slice(gpu, v);
    Ok(match m {
        Mixer::Full(a) => GpuMixer::Full(GpuFullAttn {
            q: lin(&a.q_proj),
            k: lin(&a.k_proj),
            v: lin(&a.v_proj),
            o: lin(&a.o_proj),
            q_norm: vec(&a.q_norm)?,
            k_norm: vec(&a.k_norm)?,
        }),
        Mixer::Linear(g) => GpuMixer::Linear(GpuLinearAttn {
            proj: match &g.proj {
                DeltaProjections::Split { qkv, z, b, a } => GpuDeltaProj::Split {
                    qkv: lin(qkv),
                    z: lin(z),
                    b: lin(b),
                    a: lin(a),
                },
                DeltaProjections::Fused { qkvz, ba } => GpuDeltaProj::Fused {
                    qkvz: lin(qkvz),
                    ba: lin(ba),
                },
            },
            conv: vec(&g.conv)?,
            a_log: vec(&g.a_log)?,
            dt_bias: vec(&g.dt_bias)?,
            norm: vec(&g.norm)?,
            out: lin(&g.out_proj),
        }),
    })
}

/// An empty KV cache for a full-attention layer.
pub(super) fn new_kv(gpu: &Gpu, c: &ModelConfig) -> Result<GpuLayerState> {
    let row = c.num_kv_heads * c.head_dim;
    Ok(GpuLayerState::Full(RowCache::new(gpu, row, row)?))
}

/// A zero GatedDeltaNet state.
pub(super) fn new_linear_state(gpu: &Gpu, c: &ModelConfig) -> Result<GpuLayerState> {
    let l = &c.linear;
    Ok(GpuLayerState::Linear(GpuLinearState {
        conv: DevBuf::zeros(gpu, 4 * (l.conv_kernel - 1) * l.conv_dim())?,
        ssm: DevBuf::zeros(gpu, 4 * l.num_v_heads * l.value_head_dim * l.key_head_dim)?,
    }))
}

fn state_error(i: usize) -> Error {
    Error::Invalid(format!("layer {i}: GPU state does not match its mixer"))
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

impl GpuFullAttn {
    /// Gated full attention of layer `i`, its output added to `x`.
    pub fn forward(&self, cx: &mut Ctx, i: usize, xn: u64, n: usize, x: u64) -> Result<()> {
        let c = cx.config;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        let (wq, wk, wv, wo) = (self.q, self.k, self.v, self.o);
        let (qn, kn) = (self.q_norm.ptr(), self.k_norm.ptr());
        let g = cx.gpu;
        let s = &mut *cx.scratch;
        let qg = s.get(g, "qg", 4 * n * 2 * nh * hd)?;
        let k = s.get(g, "k", 4 * n * nkv * hd)?;
        let v = s.get(g, "v", 4 * n * nkv * hd)?;
        let q = s.get(g, "q", 4 * n * nh * hd)?;
        let gate = s.get(g, "gate", 4 * n * nh * hd)?;
        let attn = s.get(g, "attn", 4 * n * nh * hd)?;
        matmuls(g, &[mm(wq, qg), mm(wk, k), mm(wv, v)], xn, n)?;
        let half = (c.rope.rotary_dim / 2) as i32;
        let (nh_i, nkv_i, hd_i) = (nh as i32, nkv as i32, hd as i32);
        let (eps, ps) = (c.rms_norm_eps, c.rope.position_scale);
        let (inv_freq, pos) = (cx.inv_freq, cx.pos);
        let Some(GpuLayerState::Full(kv)) = cx.state.layers.get(i) else {
            return Err(state_error(i));
        };
        let (kc, vc) = (kv.a.ptr(), kv.b.ptr());
        let scale = 1.0 / (hd as f32).sqrt();
        // SAFETY: `attn_prep` in kernels.cu; the scratch buffers are sized
        // for n tokens and the cache for its rows (grown before the eval).
        unsafe {
            g.launch(
                "attn_prep",
                ((nh + nkv) as u32, n as u32, 1),
                hd as u32,
                (4 * hd) as u32,
                &mut args!(
                    qg, k, v, qn, kn, inv_freq, half, nh_i, nkv_i, hd_i, eps, pos, ps, q, gate, kc,
                    vc
                ),
            )?
        };
        if let Some(smem) = attention_mma_smem(g, nh, nkv, hd, n) {
            let ctx = cx.start + n;
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
                    "attention_mma",
                    grid,
                    128,
                    smem as u32,
                    &mut args!(q, kp, vp, gate, nh_i, nkv_i, hd_i, pos, pad_i, nn, scale, attn),
                )?;
            }
        } else {
            // SAFETY: `attention` in kernels.cu; buffers as above.
            unsafe {
                g.launch(
                    "attention",
                    (nh as u32, n as u32, 1),
                    256,
                    0,
                    &mut args!(q, kc, vc, gate, nh_i, nkv_i, hd_i, pos, scale, attn),
                )?
            };
        }
        matmuls(g, &[mm_add(wo, x)], attn, n)
    }
}

/// Tokens per block of `conv_qk_norm_batch` (kernels.cu's `CONV_TILE`).
const CONV_TILE: usize = 16;

impl GpuLinearAttn {
    /// GatedDeltaNet of layer `i`, its output added to `x`.
    pub fn forward(&self, cx: &mut Ctx, i: usize, xn: u64, n: usize, x: u64) -> Result<()> {
        let la = self;
        let l = &cx.config.linear;
        let (nk, nv, dk, dv) = (
            l.num_k_heads,
            l.num_v_heads,
            l.key_head_dim,
            l.value_head_dim,
        );
        let (kd, vd, cd) = (l.key_dim(), l.value_dim(), l.conv_dim());
        let conv_kernel = l.conv_kernel;
        let eps = cx.config.rms_norm_eps;
        let g = cx.gpu;
        let s = &mut *cx.scratch;
        let mixed = s.get(g, "mixed", 4 * n * cd)?;
        // A batch's conv reads the projections' raw output from its own
        // buffer (conv_qk_norm_batch is not in place); one token's is.
        let raw = if n > 1 {
            s.get(g, "mixed_raw", 4 * n * cd)?
        } else {
            mixed
        };
        let z = s.get(g, "z", 4 * n * vd)?;
        let b = s.get(g, "b", 4 * n * nv)?;
        let a = s.get(g, "a", 4 * n * nv)?;
        let y = s.get(g, "y", 4 * n * vd)?;
        let o = s.get(g, "o", 4 * n * vd)?;
        match la.proj {
            GpuDeltaProj::Split {
                qkv,
                z: zw,
                b: bw,
                a: aw,
            } => {
                matmuls(g, &[mm(qkv, raw), mm(zw, z), mm(bw, b), mm(aw, a)], xn, n)?;
            }
            GpuDeltaProj::Fused { qkvz, ba } => {
                let fused = s.get(g, "fused", 4 * n * (2 * kd + 2 * vd))?;
                let fba = s.get(g, "fba", 4 * n * 2 * nv)?;
                matmuls(g, &[mm(qkvz, fused), mm(ba, fba)], xn, n)?;
                let r = (nv / nk) as i32;
                let (nk_i, dk_i, dv_i) = (nk as i32, dk as i32, dv as i32);
                // SAFETY: `deltanet_split` in kernels.cu, buffers sized above.
                unsafe {
                    g.launch(
                        "deltanet_split",
                        (nk as u32, n as u32, 1),
                        128,
                        0,
                        &mut args!(fused, fba, nk_i, dk_i, dv_i, r, raw, z, b, a),
                    )?
                };
            }
        }
        let Some(GpuLayerState::Linear(st)) = cx.state.layers.get(i) else {
            return Err(state_error(i));
        };
        let (conv_state, ssm) = (st.conv.ptr(), st.ssm.ptr());
        let (conv_w, a_log, dt_bias, norm) = (
            la.conv.ptr(),
            la.a_log.ptr(),
            la.dt_bias.ptr(),
            la.norm.ptr(),
        );
        let (kk, nn) = (conv_kernel as i32, n as i32);
        let (nk_i, nv_i, dk_i, dv_i) = (nk as i32, nv as i32, dk as i32, dv as i32);
        // SAFETY (every launch below): arguments match the kernels in
        // kernels.cu; buffers sized above, states at model load.
        unsafe {
            if n > 1 {
                let cd_i = cd as i32;
                g.launch(
                    "conv_qk_norm_batch",
                    ((2 * nk + nv) as u32, n.div_ceil(CONV_TILE) as u32, 1),
                    dk.max(dv) as u32,
                    0,
                    &mut args!(raw, mixed, conv_w, conv_state, nk_i, dk_i, nv_i, dv_i, kk, nn),
                )?;
                g.launch(
                    "conv_state_update",
                    (cd.div_ceil(256) as u32, 1, 1),
                    256,
                    0,
                    &mut args!(raw, conv_state, cd_i, kk, nn),
                )?;
            } else {
                g.launch(
                    "conv_qk_norm",
                    ((2 * nk + nv) as u32, 1, 1),
                    dk.max(dv) as u32,
                    0,
                    &mut args!(mixed, conv_w, conv_state, nk_i, dk_i, nv_i, dv_i, kk, nn),
                )?;
            }
            launch_delta_rule(g, l, n, [mixed, a, b, a_log, dt_bias, ssm, y])?;
            g.launch(
                "gated_norm",
                (nv as u32, n as u32, 1),
                dv as u32,
                0,
                &mut args!(y, z, norm, eps, dv_i, o),
            )?;
        }
        matmuls(g, &[mm_add(la.out, x)], o, n)
    }
}

/// Batches of at least this many tokens (one chunk) run the delta rule in
/// chunks (`gdn_chunk_prep`, `gdn_chunk_scan`: deltanet_chunk.cu) rather
/// than token by token (`delta_rule`). On the H100 at Qwen3.6-35B-A3B's
/// shapes a 4096-token prefill takes 1.3 ms per layer that way against 2.9
/// ms: about 20 us a chunk against 0.7 us a token. A partial chunk costs a
/// whole one, so the two meet near 30 tokens; one chunk keeps a margin.
const GDN_CHUNK_MIN_TOKENS: usize = 64;
/// deltanet_chunk.cu's `GDN_C` (tokens per chunk), `GDN_R` (state rows per
/// scan block) and `GDN_REC` (floats of the prep's record per value head
/// and chunk).
const GDN_C: usize = 64;
const GDN_R: usize = 32;
const GDN_REC: usize = 2 * GDN_C * GDN_C + 3 * GDN_C;

/// The dynamic shared memory of `gdn_chunk_scan` for key heads of `dk`:
/// q^T and k^T (rows of `GDN_C + 4`), T^T and P^T, the rows' state, three
/// `GDN_C x GDN_R` tiles and the decays.
fn gdn_scan_smem(dk: usize) -> usize {
    4 * (2 * dk * (GDN_C + 4) + 2 * GDN_C * GDN_C + dk * GDN_R + 3 * GDN_C * GDN_R + 3 * GDN_C)
}

/// The delta rule of `n` tokens: `bufs` are `mixed`, `a`, `b`, `a_log`,
/// `dt_bias`, the state (updated) and `y`, as `delta_rule` takes them. In
/// chunks for batches of [`GDN_CHUNK_MIN_TOKENS`] and more when the scan's
/// shared memory fits the GPU (141 KB at dk = 128; 225 KB at 256: Hopper,
/// not Ampere), with the prep's records in the workspace (33 KB per value
/// head and chunk); else token by token.
///
/// # Safety
/// The buffers must hold what `delta_rule` reads and writes for `n` tokens
/// of `l`'s shapes.
unsafe fn launch_delta_rule(
    g: &Gpu,
    l: &crate::config::LinearAttnConfig,
    n: usize,
    bufs: [u64; 7],
) -> Result<()> {
    let [mixed, a, b, a_log, dt_bias, ssm, y] = bufs;
    let (nk, nv, dk, dv) = (
        l.num_k_heads,
        l.num_v_heads,
        l.key_head_dim,
        l.value_head_dim,
    );
    let (nn, nk_i, nv_i, dk_i, dv_i) = (n as i32, nk as i32, nv as i32, dk as i32, dv as i32);
    let smem = gdn_scan_smem(dk);
    if n < GDN_CHUNK_MIN_TOKENS || smem > g.smem_optin {
        return g.launch(
            "delta_rule",
            (nv as u32, dv.div_ceil(32) as u32, 1),
            256,
            0,
            &mut args!(mixed, a, b, a_log, dt_bias, ssm, nn, nk_i, nv_i, dk_i, dv_i, y),
        );
    }
    let chunks = n.div_ceil(GDN_C);
    let ws = g.workspace(4 * nv * chunks * GDN_REC)?;
    g.launch(
        "gdn_chunk_prep",
        (nv as u32, chunks as u32, 1),
        256,
        0,
        &mut args!(mixed, a, b, a_log, dt_bias, nn, nk_i, nv_i, dk_i, dv_i, ws),
    )?;
    g.launch(
        "gdn_chunk_scan",
        (nv as u32, (dv / GDN_R) as u32, 1),
        256,
        smem as u32,
        &mut args!(mixed, ws, ssm, nn, nk_i, nv_i, dk_i, dv_i, y),
    )
}
