//! Grouped-query attention on the CPU (`model::attention::FullAttention`):
//! q/k/v projections in one grouped matmul, biases, per-head q/k RMSNorm,
//! rotary, the KV append, causal softmax attention per (token, head) (over
//! a sliding window, with a sink logit, where the layer has them), the
//! optional `sigmoid(gate)` output gate, and the output projection (and its
//! bias).

use rayon::prelude::*;

use crate::backend::cpu::qmatmul::{matmul, matmul_group};
use crate::backend::cpu::vec;
use crate::backend::cpu::{ops, SeqRows};
use crate::config::ModelConfig;
use crate::model::attention::FullAttention;
use crate::model::rope::Rope;
use crate::model::state::KvCache;
use crate::model::weights::Weights;

/// Attends the `n` normed tokens of a batch: the projections over all of
/// them, then per sequence its rows at its positions, appending their keys
/// and values to its KV cache (which must hold exactly `start` rows); the
/// output projection goes to `out`. A token's result does not depend on
/// the other sequences in the batch.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    a: &FullAttention,
    w: &Weights,
    c: &ModelConfig,
    rope: &Rope,
    xn: &[f32],
    n: usize,
    seqs: &mut [SeqRows<'_, KvCache>],
    out: &mut [f32],
) {
    let (nh, nkv, hd) = (c.num_attention_heads, c.num_kv_heads, c.head_dim);
    for s in seqs.iter() {
        assert_eq!(
            s.state.len(),
            s.start,
            "KV cache rows must equal the start position"
        );
    }
    // q_proj rows are per head `[q | gate]` when the output is gated.
    let q_stride = if a.output_gate { 2 * hd } else { hd };
    let mut qg = vec![0.0f32; n * nh * q_stride];
    let mut k = vec![0.0f32; n * nkv * hd];
    let mut v = vec![0.0f32; n * nkv * hd];
    let (wq, wk, wv) = (w.view(&a.q_proj), w.view(&a.k_proj), w.view(&a.v_proj));
    matmul_group(&mut [(&wq, &mut qg), (&wk, &mut k), (&wv, &mut v)], xn, n);
    if let Some([bq, bk, bv]) = a.qkv_bias {
        for (y, b) in [(&mut qg, bq), (&mut k, bk), (&mut v, bv)] {
            let b = w.vector(b);
            for row in y.chunks_exact_mut(b.len()) {
                ops::add_inplace(row, b);
            }
        }
    }
    let norms = a.qk_norm.map(|(q, k)| (w.vector(q), w.vector(k)));

    // Per token: its sequence and position.
    let mut at = vec![(0usize, 0usize); n];
    for (si, s) in seqs.iter().enumerate() {
        for t in s.rows.clone() {
            at[t] = (si, s.start + t - s.rows.start);
        }
    }
    let mut q = vec![0.0f32; n * nh * hd];
    let mut gate = vec![0.0f32; if a.output_gate { n * nh * hd } else { 0 }];
    let eps = c.rms_norm_eps;
    let mut normed = vec![0.0f32; hd];
    for (t, &(_, pos)) in at.iter().enumerate() {
        for h in 0..nh {
            let src = &qg[(t * nh + h) * q_stride..(t * nh + h + 1) * q_stride];
            let dst = &mut q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            match norms {
                Some((qn, _)) => ops::rms_norm(&src[..hd], qn, eps, dst),
                None => dst.copy_from_slice(&src[..hd]),
            }
            rope.apply(dst, pos);
            if a.output_gate {
                gate[(t * nh + h) * hd..(t * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
            }
        }
        for g in 0..nkv {
            let row = &mut k[(t * nkv + g) * hd..(t * nkv + g + 1) * hd];
            if let Some((_, kn)) = norms {
                ops::rms_norm(row, kn, eps, &mut normed);
                row.copy_from_slice(&normed);
            }
            rope.apply(row, pos);
        }
    }
    let row = nkv * hd;
    for s in seqs.iter_mut() {
        let r = s.rows.start * row..s.rows.end * row;
        s.state.k.extend_from_slice(&k[r.clone()]);
        s.state.v.extend_from_slice(&v[r]);
    }

    let scale = 1.0 / (hd as f32).sqrt();
    let group = nh / nkv;
    let caches: Vec<(&[f32], &[f32])> = seqs
        .iter()
        .map(|s| (&s.state.k[..], &s.state.v[..]))
        .collect();
    let sinks = a.sinks.map(|s| w.vector(s));
    let mut attn = vec![0.0f32; n * nh * hd];
    attn.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        let g = h / group;
        let (si, pos) = at[t];
        let (keys, values) = caches[si];
        let qh = &q[i * hd..(i + 1) * hd];
        let first = a.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let mut scores: Vec<f32> = (first..=pos)
            .map(|p| vec::dot(qh, &keys[p * row + g * hd..p * row + (g + 1) * hd]) * scale)
            .collect();
        match sinks {
            // The sink's logit joins the softmax and takes its share of
            // the weight, which no value receives.
            Some(s) => {
                scores.push(s[h]);
                ops::softmax_inplace(&mut scores);
                scores.pop();
            }
            None => ops::softmax_inplace(&mut scores),
        }
        o.fill(0.0);
        for (j, &wt) in scores.iter().enumerate() {
            let p = first + j;
            vec::axpy(o, wt, &values[p * row + g * hd..p * row + (g + 1) * hd]);
        }
        if !gate.is_empty() {
            let gr = &gate[i * hd..(i + 1) * hd];
            for (x, &gv) in o.iter_mut().zip(gr) {
                *x *= ops::sigmoid(gv);
            }
        }
    });
    matmul(&w.view(&a.o_proj), &attn, n, out);
    if let Some(b) = a.o_bias {
        let b = w.vector(b);
        for row in out.chunks_exact_mut(b.len()) {
            ops::add_inplace(row, b);
        }
    }
}
