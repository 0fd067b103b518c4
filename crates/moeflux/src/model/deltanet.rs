//! GatedDeltaNet linear attention: causal depthwise conv1d, L2-normalised
//! q/k, decay `g` and write strength `beta`, the delta-rule recurrence on a
//! `[v_dim, k_dim]` state per value head, and a gated RMSNorm.

use rayon::prelude::*;

use crate::backend::cpu::qmatmul::{matmul, matmul_group};
use crate::backend::cpu::{ops, vec};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::state::LinearState;
use crate::model::weights::{DenseStore, LinearRef};

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
    Fused {
        qkvz: LinearRef,
        ba: LinearRef,
    },
}

pub struct GatedDeltaNet {
    pub proj: DeltaProjections,
    /// `[conv_dim][kernel]`.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub norm: Vec<f32>,
    pub out_proj: LinearRef,
}

impl GatedDeltaNet {
    pub fn load(d: &DenseStore, c: &ModelConfig, prefix: &str) -> Result<Self> {
        let l = &c.linear;
        let h = c.hidden_size;
        let p = format!("{prefix}linear_attn.");
        let proj = if l.fused_projections {
            DeltaProjections::Fused {
                qkvz: d.linear(
                    &format!("{p}in_proj_qkvz"),
                    2 * l.key_dim() + 2 * l.value_dim(),
                    h,
                )?,
                ba: d.linear(&format!("{p}in_proj_ba"), 2 * l.num_v_heads, h)?,
            }
        } else {
            DeltaProjections::Split {
                qkv: d.linear(&format!("{p}in_proj_qkv"), l.conv_dim(), h)?,
                z: d.linear(&format!("{p}in_proj_z"), l.value_dim(), h)?,
                b: d.linear(&format!("{p}in_proj_b"), l.num_v_heads, h)?,
                a: d.linear(&format!("{p}in_proj_a"), l.num_v_heads, h)?,
            }
        };
        Ok(GatedDeltaNet {
            proj,
            conv: d.floats(
                &format!("{p}conv1d.weight"),
                &[l.conv_dim(), l.conv_kernel, 1],
            )?,
            a_log: d.floats(&format!("{p}A_log"), &[l.num_v_heads])?,
            dt_bias: d.floats(&format!("{p}dt_bias"), &[l.num_v_heads])?,
            norm: d.floats(&format!("{p}norm.weight"), &[l.value_head_dim])?,
            out_proj: d.linear(&format!("{p}out_proj"), h, l.value_dim())?,
        })
    }

    pub fn new_state(c: &ModelConfig) -> LinearState {
        let l = &c.linear;
        LinearState {
            conv: vec![0.0; (l.conv_kernel - 1) * l.conv_dim()],
            ssm: vec![0.0; l.num_v_heads * l.value_head_dim * l.key_head_dim],
        }
    }

    /// Runs `n` normed tokens through the layer in order, updating `state`.
    pub fn forward(
        &self,
        d: &DenseStore,
        c: &ModelConfig,
        xn: &[f32],
        n: usize,
        state: &mut LinearState,
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
        match &self.proj {
            DeltaProjections::Split {
                qkv,
                z: zp,
                b: bp,
                a: ap,
            } => {
                let (w0, w1, w2, w3) = (d.view(qkv), d.view(zp), d.view(bp), d.view(ap));
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
                let w = 2 * kd + 2 * vd;
                let mut f = vec![0.0f32; n * w];
                let mut g = vec![0.0f32; n * 2 * nv];
                let (w0, w1) = (d.view(qkvz), d.view(ba));
                matmul_group(&mut [(&w0, &mut f), (&w1, &mut g)], xn, n);
                let r = nv / nk;
                for t in 0..n {
                    let (src, m) = (&f[t * w..(t + 1) * w], &mut mixed[t * cd..(t + 1) * cd]);
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
                        let s = &g[t * 2 * nv + kh * 2 * r..];
                        b[t * nv + kh * r..t * nv + (kh + 1) * r].copy_from_slice(&s[..r]);
                        a[t * nv + kh * r..t * nv + (kh + 1) * r].copy_from_slice(&s[r..2 * r]);
                    }
                }
            }
        }

        self.conv_silu(c, &mut mixed, n, &mut state.conv);

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

        // Recurrence, one value head per task.
        let r = nv / nk;
        let mut y = vec![0.0f32; nv * n * dv];
        state
            .ssm
            .par_chunks_mut(dv * dk)
            .zip(y.par_chunks_mut(n * dv))
            .enumerate()
            .for_each(|(h, (s, yh))| {
                let kh = h / r;
                let decay_rate = self.a_log[h].exp();
                for t in 0..n {
                    let m = &mixed[t * cd..(t + 1) * cd];
                    let q = &m[kh * dk..(kh + 1) * dk];
                    let k = &m[kd + kh * dk..kd + (kh + 1) * dk];
                    let v = &m[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                    let g = (-decay_rate * ops::softplus(a[t * nv + h] + self.dt_bias[h])).exp();
                    let beta = ops::sigmoid(b[t * nv + h]);
                    vec::delta_rule_step(s, q, k, v, g, beta, &mut yh[t * dv..(t + 1) * dv]);
                }
            });

        // Gated RMSNorm per value head, then the output projection.
        let mut o = vec![0.0f32; n * vd];
        for t in 0..n {
            for h in 0..nv {
                let dst = &mut o[t * vd + h * dv..t * vd + (h + 1) * dv];
                ops::rms_norm(
                    &y[(h * n + t) * dv..(h * n + t + 1) * dv],
                    &self.norm,
                    c.rms_norm_eps,
                    dst,
                );
                for (x, &zz) in dst
                    .iter_mut()
                    .zip(&z[t * vd + h * dv..t * vd + (h + 1) * dv])
                {
                    *x *= ops::silu(zz);
                }
            }
        }
        matmul(&d.view(&self.out_proj), &o, n, out);
    }

    /// Causal depthwise conv over `[state; inputs]` then SiLU, in place;
    /// `state` keeps the last `kernel-1` raw inputs.
    fn conv_silu(&self, c: &ModelConfig, mixed: &mut [f32], n: usize, state: &mut [f32]) {
        let kk = c.linear.conv_kernel;
        let cd = c.linear.conv_dim();
        let hist = kk - 1;
        for t in 0..n {
            let x = &mut mixed[t * cd..(t + 1) * cd];
            for ch in 0..cd {
                let w = &self.conv[ch * kk..(ch + 1) * kk];
                let mut acc = 0.0f32;
                for j in 0..hist {
                    acc += w[j] * state[j * cd + ch];
                }
                acc += w[hist] * x[ch];
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
}
