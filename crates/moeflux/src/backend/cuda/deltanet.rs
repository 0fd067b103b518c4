//! GatedDeltaNet on the GPU (`model::deltanet`): the input projections in
//! one launch (split, or fused and then split per key head); the causal conv
//! and the q/k norms in one kernel (a batch over tiles of 16 tokens in
//! parallel); the delta rule token by token, or in chunks of 64 for batches
//! (`deltanet_chunk.cu`); the gated norm; the output projection added to `x`.

use crate::config::{LinearAttnConfig, ModelConfig};
use crate::error::{Error, Result};
use crate::model::deltanet::{DeltaProjections, GatedDeltaNet};

use super::device::{args, DevBuf, Gpu};
use super::linear::{matmuls, mm, mm_add};
use super::model::{Ctx, MixerRun, SeqRows};
use super::state::{GpuLayerState, GpuLinearState};
use super::support::unsupported;
use super::token_split::row;

/// The shapes the kernels take (a warp's lanes over a head's channels, a
/// thread per conv tap).
pub(super) fn check_shape(c: &ModelConfig) -> Result<()> {
    let l = &c.linear;
    for (what, v) in [
        ("GatedDeltaNet value head dim", l.value_head_dim),
        ("GatedDeltaNet key head dim", l.key_head_dim),
    ] {
        if v % 32 != 0 || v > 256 {
            return Err(unsupported(format!(
                "{what} {v} (multiples of 32 up to 256)"
            )));
        }
    }
    if l.conv_kernel > 9 {
        return Err(unsupported(format!(
            "conv kernel {} (at most 9)",
            l.conv_kernel
        )));
    }
    Ok(())
}

/// A zero GatedDeltaNet state.
pub(super) fn new_state(gpu: &Gpu, c: &ModelConfig) -> Result<GpuLayerState> {
    let l = &c.linear;
    Ok(GpuLayerState::Linear(GpuLinearState {
        conv: DevBuf::zeros(gpu, 4 * (l.conv_kernel - 1) * l.conv_dim())?,
        ssm: DevBuf::zeros(gpu, 4 * l.num_v_heads * l.value_head_dim * l.key_head_dim)?,
    }))
}

fn state_error(i: usize) -> Error {
    Error::Invalid(format!("layer {i}: GPU state is not a GatedDeltaNet state"))
}

/// Tokens per block of `conv_qk_norm_batch` (kernels/deltanet.cu's `CONV_TILE`).
const CONV_TILE: usize = 16;

/// GatedDeltaNet of layer `i` for the `n` normed tokens `xn` of `seqs`
/// (their rows, in order), its output projection added to `x`: the
/// projections and the gated norm once over all rows, the conv and the
/// delta rule per sequence on its own state (one launch each for a decode
/// batch).
pub(super) fn forward(
    cx: &mut Ctx,
    i: usize,
    gdn: &GatedDeltaNet,
    xn: u64,
    n: usize,
    x: u64,
    seqs: &[SeqRows],
) -> Result<()> {
    let w = cx.weights;
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
    let h = cx.config.hidden_size;
    // Split by tokens, this GPU projects its own rows (`m` of them from `lo`)
    // and the others' are broadcast to it before the conv.
    let own = cx.own_rows(n);
    let (lo, m) = (own.start, own.len());
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
    match &gdn.proj {
        DeltaProjections::Split {
            qkv,
            z: zw,
            b: bw,
            a: aw,
        } => {
            let (qkv, zw, bw, aw) = (w.lin(qkv), w.lin(zw), w.lin(bw), w.lin(aw));
            let ops = [
                mm(qkv, row(raw, lo, cd)),
                mm(zw, row(z, lo, vd)),
                mm(bw, row(b, lo, nv)),
                mm(aw, row(a, lo, nv)),
            ];
            matmuls(g, &ops, row(xn, lo, h), m)?;
        }
        DeltaProjections::Fused { qkvz, ba } => {
            let (qkvz, ba) = (w.lin(qkvz), w.lin(ba));
            let fused = s.get(g, "fused", 4 * m * (2 * kd + 2 * vd))?;
            let fba = s.get(g, "fba", 4 * m * 2 * nv)?;
            matmuls(g, &[mm(qkvz, fused), mm(ba, fba)], row(xn, lo, h), m)?;
            let r = (nv / nk) as i32;
            let (nk_i, dk_i, dv_i) = (nk as i32, dk as i32, dv as i32);
            let (raw, z, b, a) = (
                row(raw, lo, cd),
                row(z, lo, vd),
                row(b, lo, nv),
                row(a, lo, nv),
            );
            // SAFETY: `deltanet_split` in kernels/deltanet.cu, buffers sized
            // above (m rows from lo).
            unsafe {
                g.launch(
                    "deltanet_split",
                    (nk as u32, m as u32, 1),
                    128,
                    0,
                    &mut args!(fused, fba, nk_i, dk_i, dv_i, r, raw, z, b, a),
                )?
            };
        }
    }
    // The gated norm and the output projection need only this GPU's z.
    cx.share_rows(&[(raw, cd), (b, nv), (a, nv)])?;
    let (conv_w, a_log, dt_bias, norm) = (
        w.vec(gdn.conv),
        w.vec(gdn.a_log),
        w.vec(gdn.dt_bias),
        w.vec(gdn.norm),
    );
    let kk = conv_kernel as i32;
    let (nk_i, nv_i, dk_i, dv_i) = (nk as i32, nv as i32, dk as i32, dv as i32);
    for run in MixerRun::split(seqs) {
        let sq = match run {
            MixerRun::Decode(run) => {
                let tab = cx
                    .decode_table(i, run, |l| matches!(l, GpuLayerState::Linear(_)))
                    .ok_or_else(|| state_error(i))?;
                let r0 = run[0].seg.rows.start as u64;
                let rows = run.len();
                // The projections' raw rows, convolved in place (nobody
                // else reads them).
                let mixed = raw + 4 * r0 * cd as u64;
                let (a, b, y) = (
                    a + 4 * r0 * nv as u64,
                    b + 4 * r0 * nv as u64,
                    y + 4 * r0 * vd as u64,
                );
                let (one, none) = (1i32, 0u64);
                // SAFETY: `conv_qk_norm` and `delta_rule` in kernels/deltanet.cu, a
                // row per sequence: the table holds each one's conv and
                // recurrent state, the scratch buffers n rows.
                unsafe {
                    g.launch(
                        "conv_qk_norm",
                        ((2 * nk + nv) as u32, rows as u32, 1),
                        dk.max(dv) as u32,
                        0,
                        &mut args!(mixed, conv_w, none, nk_i, dk_i, nv_i, dv_i, kk, one, tab),
                    )?;
                    g.launch(
                        "delta_rule",
                        (nv as u32, dv.div_ceil(32) as u32, rows as u32),
                        256,
                        0,
                        &mut args!(
                            mixed, a, b, a_log, dt_bias, none, one, nk_i, nv_i, dk_i, dv_i, y, tab
                        ),
                    )?;
                }
                continue;
            }
            MixerRun::One(sq) => sq,
        };
        let Some(GpuLayerState::Linear(st)) = sq.state.layers.get(i) else {
            return Err(state_error(i));
        };
        let (conv_state, ssm) = (st.conv.ptr(), st.ssm.ptr());
        let r0 = sq.seg.rows.start as u64;
        let m = sq.seg.rows.len();
        let none = 0u64;
        let nn = m as i32;
        let (raw, mixed) = (raw + 4 * r0 * cd as u64, mixed + 4 * r0 * cd as u64);
        let (a, b, y) = (
            a + 4 * r0 * nv as u64,
            b + 4 * r0 * nv as u64,
            y + 4 * r0 * vd as u64,
        );
        // SAFETY (every launch below): arguments match the kernels in
        // kernels/deltanet.cu; buffers sized above for n rows, this sequence's m
        // of them from r0; states at model load.
        unsafe {
            // A batch's projections went to `raw` (the batch conv is not in
            // place; its one-token case equals conv_qk_norm bit for bit).
            if n > 1 {
                let cd_i = cd as i32;
                g.launch(
                    "conv_qk_norm_batch",
                    ((2 * nk + nv) as u32, m.div_ceil(CONV_TILE) as u32, 1),
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
                    &mut args!(mixed, conv_w, conv_state, nk_i, dk_i, nv_i, dv_i, kk, nn, none),
                )?;
            }
            launch_delta_rule(g, l, m, [mixed, a, b, a_log, dt_bias, ssm, y])?;
        }
    }
    let (y, z, o) = (row(y, lo, vd), row(z, lo, vd), row(o, lo, vd));
    // SAFETY: `gated_norm` in kernels/deltanet.cu, over this GPU's m rows
    // from lo (every row of the batch unless it is split).
    unsafe {
        g.launch(
            "gated_norm",
            (nv as u32, m as u32, 1),
            dv as u32,
            0,
            &mut args!(y, z, norm, eps, dv_i, o),
        )?;
    }
    matmuls(g, &[mm_add(w.lin(&gdn.out_proj), row(x, lo, h))], o, m)
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
unsafe fn launch_delta_rule(g: &Gpu, l: &LinearAttnConfig, n: usize, bufs: [u64; 7]) -> Result<()> {
    let [mixed, a, b, a_log, dt_bias, ssm, y] = bufs;
    let (nk, nv, dk, dv) = (
        l.num_k_heads,
        l.num_v_heads,
        l.key_head_dim,
        l.value_head_dim,
    );
    let (nn, nk_i, nv_i, dk_i, dv_i) = (n as i32, nk as i32, nv as i32, dk as i32, dv as i32);
    let smem = gdn_scan_smem(dk);
    let none = 0u64;
    if n < GDN_CHUNK_MIN_TOKENS || smem > g.smem_optin {
        return g.launch(
            "delta_rule",
            (nv as u32, dv.div_ceil(32) as u32, 1),
            256,
            0,
            &mut args!(mixed, a, b, a_log, dt_bias, ssm, nn, nk_i, nv_i, dk_i, dv_i, y, none),
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
