//! GatedDeltaNet on the CPU (`model::deltanet`): input projections (split
//! or fused per key head), causal conv + SiLU, q/k L2 normalisation, the
//! delta-rule recurrence per value head, the gated RMSNorm and the output
//! projection.

use rayon::prelude::*;

use crate::backend::cpu::qmatmul::{matmul, matmul_group};
use crate::backend::cpu::{ops, vec, SeqRows};
use crate::config::ModelConfig;
use crate::model::deltanet::{DeltaProjections, GatedDeltaNet};
use crate::model::state::LinearState;
use crate::model::weights::Weights;

/// Runs the `n` normed tokens of a batch through the layer: the
/// projections over all of them, the conv and the recurrence per sequence,
/// its rows in order, updating its state; the output projection goes to
/// `out`. A token's result does not depend on the other sequences.
pub fn forward(
    gdn: &GatedDeltaNet,
    w: &Weights,
    c: &ModelConfig,
    xn: &[f32],
    n: usize,
    seqs: &mut [SeqRows<'_, LinearState>],
    out: &mut [f32],
) {
    let l = &c.linear;
    let (nk, nv, dk, dv) = (
        l.num_k_heads,
        l.num_v_heads,
        l.key_head_dim,
        l.value_head_dim,
    );
    let (kd, vd, cd) = (l.key_dim(), l.value_dim(), l.conv_dim());
    let mut mixed = vec![0.0f32; n * cd];
    let mut z = vec![0.0f32; n * vd];
    let mut b = vec![0.0f32; n * nv];
    let mut a = vec![0.0f32; n * nv];
    match &gdn.proj {
        DeltaProjections::Split {
            qkv,
            z: zp,
            b: bp,
            a: ap,
        } => {
            let (w0, w1, w2, w3) = (w.view(qkv), w.view(zp), w.view(bp), w.view(ap));
            matmul_group(
                &mut [
                    (&w0, &mut mixed),
                    (&w1, &mut z),
                    (&w2, &mut b),
                    (&w3, &mut a),
                ],
                xn,
                n,
            );
        }
        DeltaProjections::Fused { qkvz, ba } => {
            let width = 2 * kd + 2 * vd;
            let mut f = vec![0.0f32; n * width];
            let mut ba_out = vec![0.0f32; n * 2 * nv];
            let (w0, w1) = (w.view(qkvz), w.view(ba));
            matmul_group(&mut [(&w0, &mut f), (&w1, &mut ba_out)], xn, n);
            let r = nv / nk;
            for t in 0..n {
                let (src, m) = (
                    &f[t * width..(t + 1) * width],
                    &mut mixed[t * cd..(t + 1) * cd],
                );
                let zt = &mut z[t * vd..(t + 1) * vd];
                for kh in 0..nk {
                    // Per key head: [q dk | k dk | v r*dv | z r*dv].
                    let s = &src[kh * (2 * dk + 2 * r * dv)..];
                    m[kh * dk..(kh + 1) * dk].copy_from_slice(&s[..dk]);
                    m[kd + kh * dk..kd + (kh + 1) * dk].copy_from_slice(&s[dk..2 * dk]);
                    m[2 * kd + kh * r * dv..2 * kd + (kh + 1) * r * dv]
                        .copy_from_slice(&s[2 * dk..2 * dk + r * dv]);
                    zt[kh * r * dv..(kh + 1) * r * dv]
                        .copy_from_slice(&s[2 * dk + r * dv..2 * dk + 2 * r * dv]);
                    // Per key head: [b r | a r].
                    let s = &ba_out[t * 2 * nv + kh * 2 * r..];
                    b[t * nv + kh * r..t * nv + (kh + 1) * r].copy_from_slice(&s[..r]);
                    a[t * nv + kh * r..t * nv + (kh + 1) * r].copy_from_slice(&s[r..2 * r]);
                }
            }
        }
    }

    for s in seqs.iter_mut() {
        let rows = &mut mixed[s.rows.start * cd..s.rows.end * cd];
        conv_silu(w.vector(gdn.conv), c, rows, s.rows.len(), &mut s.state.conv);
    }

    // q, k: L2 normalisation (as RMSNorm with eps scaled by 1/dk) with the
    // 1/sqrt(dk) readout scale folded into q.
    let inv = 1.0 / (dk as f32).sqrt();
    let eps = 1e-6 * inv * inv;
    for t in 0..n {
        let m = &mut mixed[t * cd..(t + 1) * cd];
        for h in 0..nk {
            ops::rms_norm_bare_inplace(&mut m[h * dk..(h + 1) * dk], eps, inv * inv);
            ops::rms_norm_bare_inplace(&mut m[kd + h * dk..kd + (h + 1) * dk], eps, inv);
        }
    }

    // Recurrence, one (sequence, value head) per task; `y` holds per
    // sequence `[nv][its tokens][dv]` from its first row's offset.
    let (a_log, dt_bias) = (w.vector(gdn.a_log), w.vector(gdn.dt_bias));
    let r = nv / nk;
    let mut y = vec![0.0f32; n * nv * dv];
    let mut tasks = Vec::with_capacity(seqs.len() * nv);
    let mut rest = &mut y[..];
    for s in seqs.iter_mut() {
        let m = s.rows.len();
        let (mine, tail) = rest.split_at_mut(m * nv * dv);
        rest = tail;
        for (h, (st, yh)) in s
            .state
            .ssm
            .chunks_mut(dv * dk)
            .zip(mine.chunks_mut(m * dv))
            .enumerate()
        {
            tasks.push((h, s.rows.clone(), st, yh));
        }
    }
    tasks.into_par_iter().for_each(|(h, rows, s, yh)| {
        let kh = h / r;
        let decay_rate = a_log[h].exp();
        for (i, t) in rows.enumerate() {
            let m = &mixed[t * cd..(t + 1) * cd];
            let q = &m[kh * dk..(kh + 1) * dk];
            let k = &m[kd + kh * dk..kd + (kh + 1) * dk];
            let v = &m[2 * kd + h * dv..2 * kd + (h + 1) * dv];
            let g = (-decay_rate * ops::softplus(a[t * nv + h] + dt_bias[h])).exp();
            let beta = ops::sigmoid(b[t * nv + h]);
            vec::delta_rule_step(s, q, k, v, g, beta, &mut yh[i * dv..(i + 1) * dv]);
        }
    });

    // Gated RMSNorm per value head, then the output projection.
    let norm = w.vector(gdn.norm);
    let mut o = vec![0.0f32; n * vd];
    for s in seqs.iter() {
        let (m, base) = (s.rows.len(), s.rows.start * nv * dv);
        for (i, t) in s.rows.clone().enumerate() {
            for h in 0..nv {
                let dst = &mut o[t * vd + h * dv..t * vd + (h + 1) * dv];
                let src = base + (h * m + i) * dv;
                ops::rms_norm(&y[src..src + dv], norm, c.rms_norm_eps, dst);
                for (x, &zz) in dst
                    .iter_mut()
                    .zip(&z[t * vd + h * dv..t * vd + (h + 1) * dv])
                {
                    *x *= ops::silu(zz);
                }
            }
        }
    }
    matmul(&w.view(&gdn.out_proj), &o, n, out);
}

/// Causal depthwise conv (`conv`: `[conv_dim][kernel]`) over `[state;
/// inputs]` then SiLU, in place; `state` keeps the last `kernel-1` raw inputs.
fn conv_silu(conv: &[f32], c: &ModelConfig, mixed: &mut [f32], n: usize, state: &mut [f32]) {
    let kk = c.linear.conv_kernel;
    let cd = c.linear.conv_dim();
    let hist = kk - 1;
    for t in 0..n {
        let x = &mut mixed[t * cd..(t + 1) * cd];
        for ch in 0..cd {
            let taps = &conv[ch * kk..(ch + 1) * kk];
            let mut acc = 0.0f32;
            for j in 0..hist {
                acc += taps[j] * state[j * cd + ch];
            }
            acc += taps[hist] * x[ch];
            if hist > 0 {
                for j in 0..hist - 1 {
                    state[j * cd + ch] = state[(j + 1) * cd + ch];
                }
                state[(hist - 1) * cd + ch] = x[ch];
            }
            x[ch] = ops::silu(acc);
        }
    }
}
