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
use crate::model::state::{first_needed, KvCache};
use crate::model::weights::Weights;

/// Attends the `n` normed tokens of a batch: the projections over all of
/// them, then per sequence its rows at its positions, appending their keys
/// and values to its KV cache (which must end at position `start`); the
/// output projection goes to `out`. A token's result does not depend on
/// the other sequences in the batch. A sliding-window layer's cache is
/// trimmed after the attention (the chunk's first query may need rows its
/// last one does not).
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
        // A cache without a window keeps every row (tests compare against one).
        debug_assert!(s.state.window.is_none() || s.state.window == a.window);
        assert!(
            s.state.start <= s.state.first_needed(s.start),
            "KV cache dropped rows position {} attends to",
            s.start
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
    // Per sequence: its keys and values, and the position of their first row.
    let caches: Vec<(&[f32], &[f32], usize)> = seqs
        .iter()
        .map(|s| (&s.state.k[..], &s.state.v[..], s.state.start))
        .collect();
    let sinks = a.sinks.map(|s| w.vector(s));
    let mut attn = vec![0.0f32; n * nh * hd];
    attn.par_chunks_mut(hd).enumerate().for_each(|(i, o)| {
        let (t, h) = (i / nh, i % nh);
        let g = h / group;
        let (si, pos) = at[t];
        let (keys, values, held_from) = caches[si];
        let qh = &q[i * hd..(i + 1) * hd];
        let first = first_needed(a.window, pos);
        // Rows are indexed from the first position held.
        let (lo, hi) = (first - held_from, pos - held_from);
        let mut scores: Vec<f32> = (lo..=hi)
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
            let p = lo + j;
            vec::axpy(o, wt, &values[p * row + g * hd..p * row + (g + 1) * hd]);
        }
        if !gate.is_empty() {
            let gr = &gate[i * hd..(i + 1) * hd];
            for (x, &gv) in o.iter_mut().zip(gr) {
                *x *= ops::sigmoid(gv);
            }
        }
    });
    for s in seqs.iter_mut() {
        s.state.trim();
    }
    matmul(&w.view(&a.o_proj), &attn, n, out);
    if let Some(b) = a.o_bias {
        let b = w.vector(b);
        for row in out.chunks_exact_mut(b.len()) {
            ops::add_inplace(row, b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layer::Mixer;
    use crate::model::Model;
    use crate::synth::presets::GptOssShape;
    use crate::synth::{synth, SynthOptions, SynthSpec};

    /// A tiny gpt-oss model (layer 0 slides over `WINDOW` positions).
    const WINDOW: usize = 8;

    fn tiny_gpt_oss() -> (tempfile::TempDir, Model) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        let spec = SynthSpec::GptOss(GptOssShape {
            hidden_size: 128,
            num_layers: 2,
            num_attention_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            vocab_size: 256,
            num_experts: 4,
            experts_per_token: 2,
            intermediate_size: 64,
            sliding_window: WINDOW,
            eos_token_ids: &[2],
        });
        synth(&dir, &SynthOptions::new("tiny-gpt-oss", spec)).unwrap();
        let (manifest, config) = Model::read_dir(&dir).unwrap();
        let model = Model::load(&dir, &manifest, config).unwrap();
        (tmp, model)
    }

    /// Deterministic inputs `[n, hidden]` in [-1, 1).
    fn inputs(n: usize, h: usize, seed: u64) -> Vec<f32> {
        let mut x = seed | 1;
        (0..n * h)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Attends `chunks` (token counts) in turn with a windowed cache and
    /// with one that keeps every row: every output must be bit-identical,
    /// and the windowed cache must stay within its bound after each chunk.
    fn windowed_equals_unbounded(chunks: &[usize]) {
        let (_tmp, m) = tiny_gpt_oss();
        let c = &m.config;
        let Mixer::Full(a) = &m.layers[0].mixer else {
            panic!("layer 0 is attention")
        };
        assert_eq!(a.window, Some(WINDOW));
        let row = c.num_kv_heads * c.head_dim;
        let mut bounded = KvCache::new(row, a.window);
        let mut unbounded = KvCache::new(row, None);
        let h = c.hidden_size;
        let mut pos = 0;
        for (i, &n) in chunks.iter().enumerate() {
            let xn = inputs(n, h, i as u64 + 7);
            let mut outs = Vec::new();
            for kv in [&mut bounded, &mut unbounded] {
                let mut out = vec![0.0f32; n * h];
                let mut seqs = [SeqRows {
                    rows: 0..n,
                    start: pos,
                    state: kv,
                }];
                forward(a, &m.weights, c, &m.rope, &xn, n, &mut seqs, &mut out);
                outs.push(out);
            }
            let differ = outs[0]
                .iter()
                .zip(&outs[1])
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(differ, 0, "chunk {i} ({n} tokens at {pos})");
            pos += n;
            assert_eq!((bounded.len(), unbounded.len()), (pos, pos));
            assert_eq!(unbounded.held(), pos);
            // Trimmed after every chunk, however long.
            assert!(
                bounded.held() <= bounded.max_held().unwrap(),
                "{} rows held at {pos}",
                bounded.held()
            );
        }
        // Far past the window, the bounded cache holds O(window) rows.
        assert!(bounded.held() < 2 * WINDOW, "{}", bounded.held());
    }

    #[test]
    fn window_decode_is_bit_identical_to_an_unbounded_cache() {
        windowed_equals_unbounded(&[1; 5 * WINDOW]);
    }

    #[test]
    fn prefill_chunks_longer_than_the_window_are_bit_identical() {
        // A first chunk, one longer than the window after rows were
        // dropped, single tokens, then another long chunk.
        let mut chunks = vec![3, 3 * WINDOW + 1];
        chunks.extend([1; 2 * WINDOW]);
        chunks.extend([2 * WINDOW + 3, 1, 5, 1]);
        windowed_equals_unbounded(&chunks);
    }
}
