//! Gated full attention (Qwen3-Next / Qwen3.5): per-head q/k RMSNorm,
//! partial rotary, GQA over a KV cache, output gated by `sigmoid(gate)`.

use rayon::prelude::*;

use crate::backend::cpu::ops::{self, RopeTable};
use crate::backend::cpu::qmatmul::{matmul, matmul_group};
use crate::backend::cpu::vec;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::state::KvCache;
use crate::model::weights::{DenseStore, LinearRef};

pub struct FullAttention {
    pub q_proj: LinearRef,
    pub k_proj: LinearRef,
    pub v_proj: LinearRef,
    pub o_proj: LinearRef,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

impl FullAttention {
    pub fn load(d: &DenseStore, c: &ModelConfig, prefix: &str) -> Result<Self> {
        let (h, nh, nkv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_kv_heads,
            c.head_dim,
        );
        let p = format!("{prefix}self_attn.");
        Ok(FullAttention {
            q_proj: d.linear(&format!("{p}q_proj"), 2 * nh * hd, h)?,
            k_proj: d.linear(&format!("{p}k_proj"), nkv * hd, h)?,
            v_proj: d.linear(&format!("{p}v_proj"), nkv * hd, h)?,
            o_proj: d.linear(&format!("{p}o_proj"), h, nh * hd)?,
            q_norm: d.floats(&format!("{p}q_norm.weight"), &[hd])?,
            k_norm: d.floats(&format!("{p}k_norm.weight"), &[hd])?,
        })
    }

    /// Attends `n` normed tokens at positions `start..start+n`, appending
    /// their keys and values to `kv` (which must hold exactly `start` rows).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        d: &DenseStore,
        c: &ModelConfig,
        rope: &RopeTable,
        xn: &[f32],
        n: usize,
        start: usize,
        kv: &mut KvCache,
        out: &mut [f32],
    ) {
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
        assert_eq!(
            kv.len(),
            start,
            "KV cache rows must equal the start position"
        );
        let mut qg = vec![0.0f32; n * 2 * nh * hd];
        let mut k = vec![0.0f32; n * nkv * hd];
        let mut v = vec![0.0f32; n * nkv * hd];
        let (wq, wk, wv) = (
            d.view(&self.q_proj),
            d.view(&self.k_proj),
            d.view(&self.v_proj),
        );
        matmul_group(&mut [(&wq, &mut qg), (&wk, &mut k), (&wv, &mut v)], xn, n);

        // q_proj rows are per head `[q (hd) | gate (hd)]`.
        let mut q = vec![0.0f32; n * nh * hd];
        let mut gate = vec![0.0f32; n * nh * hd];
        let eps = c.rms_norm_eps;
        for t in 0..n {
            let pos = (start + t) as f64 * c.rope.position_scale;
            for h in 0..nh {
                let src = &qg[(t * nh + h) * 2 * hd..(t * nh + h + 1) * 2 * hd];
                let dst = &mut q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
                ops::rms_norm(&src[..hd], &self.q_norm, eps, dst);
                rope.apply(dst, pos);
                gate[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
            }
            for g in 0..nkv {
                let row = &mut k[(t * nkv + g) * hd..(t * nkv + g + 1) * hd];
                let normed: Vec<f32> = {
                    let mut o = vec![0.0; hd];
                    ops::rms_norm(row, &self.k_norm, eps, &mut o);
                    o
                };
                row.copy_from_slice(&normed);
                rope.apply(row, pos);
            }
        }
        kv.k.extend_from_slice(&k);
        kv.v.extend_from_slice(&v);

        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        let row = nkv * hd;
        let (keys, values) = (&kv.k, &kv.v);
        let mut attn = vec![0.0f32; n * nh * hd];
        attn.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
            let (t, h) = (i / nh, i % nh);
            let g = h / group;
            let qh = &q[i * hd..(i + 1) * hd];
            let ctx = start + t + 1;
            let mut scores: Vec<f32> = (0..ctx)
                .map(|p| vec::dot(qh, &keys[p * row + g * hd..p * row + (g + 1) * hd]) * scale)
                .collect();
            ops::softmax_inplace(&mut scores);
            o.fill(0.0);
            for (p, &w) in scores.iter().enumerate() {
                vec::axpy(o, w, &values[p * row + g * hd..p * row + (g + 1) * hd]);
            }
            let gr = &gate[i * hd..(i + 1) * hd];
            for (a, &gv) in o.iter_mut().zip(gr) {
                *a *= ops::sigmoid(gv);
            }
        });
        matmul(&d.view(&self.o_proj), &attn, n, out);
    }
}
