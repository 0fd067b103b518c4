//! Random test tokens whose expert choices are not near-ties. The GPU's batched
//! products round differently from the CPU's (bf16 hi/lo pairs on the tensor
//! cores: about 1e-4 relative), so where a token's k-th and (k+1)-th router
//! scores lie closer than that the two backends may pick different experts, and
//! their outputs then differ by far more than any bound: a property of the
//! tokens, not a fault of either backend. The margins are computed in f64 from
//! the CPU's router inputs and the router weights in `dense.safetensors`.

use std::path::Path;

use moeflux::model::trace::Trace;
use moeflux::{LogitsMode, Session};
use safetensors::{Dtype, SafeTensors};

/// Relative margin the draws keep: a few times the GPU's rounding of the
/// router input.
const MIN_MARGIN: f64 = 2e-4;

/// `n` random tokens (`MOEFLUX_TEST_SEED` replays a printed seed) redrawn
/// until every MoE layer's choice for every token clears [`MIN_MARGIN`].
pub fn random_tokens_clear_of_ties(cpu: &mut Session, dir: &Path, n: usize) -> Vec<u32> {
    draw_clear_of_ties(cpu, dir, n, |t| vec![t.to_vec()])
}

/// `n` random tokens redrawn until each token list `sequences` makes of
/// them (evaluated as separate sequences, in order) clears [`MIN_MARGIN`].
pub fn draw_clear_of_ties(
    cpu: &mut Session,
    dir: &Path,
    n: usize,
    sequences: impl Fn(&[u32]) -> Vec<Vec<u32>>,
) -> Vec<u32> {
    draw_clear_of_ties_in_all(&mut [cpu], dir, n, sequences)
}

/// [`draw_clear_of_ties`] in each of `cpus`: sessions of one model
/// directory that compute differently (its experts and their low-width
/// copies), so route differently.
pub fn draw_clear_of_ties_in_all(
    cpus: &mut [&mut Session],
    dir: &Path,
    n: usize,
    sequences: impl Fn(&[u32]) -> Vec<Vec<u32>>,
) -> Vec<u32> {
    let first = test_seed();
    let k = cpus[0].experts_per_token();
    let vocab = cpus[0].vocab_size();
    for attempt in 0..DRAWS {
        let seed = first.wrapping_add(attempt);
        let toks = moeflux::bench::random_tokens(n, vocab, seed);
        let mut m = f64::INFINITY;
        for cpu in cpus.iter_mut() {
            for seq in sequences(&toks) {
                let (_, trace) = cpu.eval_traced(&seq, LogitsMode::Last).unwrap();
                cpu.clear();
                m = m.min(routing_margin(dir, &trace, k));
            }
        }
        if m >= MIN_MARGIN {
            eprintln!("random tokens from seed {seed} (routing margin {m:.1e})");
            return toks;
        }
        eprintln!("seed {seed}: routing margin {m:.1e} < {MIN_MARGIN:e}, redrawn");
    }
    panic!("{DRAWS} draws of {n} tokens all held a near-tie in routing");
}

/// `MOEFLUX_TEST_SEED` (to replay a printed seed), else the clock.
pub fn test_seed() -> u64 {
    match std::env::var("MOEFLUX_TEST_SEED") {
        Ok(s) => s.parse().expect("MOEFLUX_TEST_SEED: an integer"),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    }
}

/// Draws before giving up. The evicting-cache batch test's ~160 tokens on
/// a zipf-routed synth model cleared the margin on the first draw in one
/// run and in none of 200 in another, so it gets many (a draw is one CPU
/// eval of those tokens).
const DRAWS: u64 = 2000;

/// The smallest gap between a token's k-th and (k+1)-th router scores,
/// relative to the largest magnitude among its top k + 1, over every MoE
/// layer of a CPU `trace`. Scores are the logits plus the router's bias, or
/// for `noaux_tc` routers sigmoid(logits) plus the correction bias (the
/// choice of groups is not modelled).
pub fn routing_margin(dir: &Path, trace: &Trace, k: usize) -> f64 {
    let path = dir.join("dense.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut worst = f64::INFINITY;
    for e in trace.entries.iter().filter(|e| e.block == "mlp_norm") {
        let l = e.layer.unwrap();
        let Some(router) = ["router", "gate"]
            .iter()
            .map(|m| format!("model.layers.{l}.mlp.{m}"))
            .find(|p| st.tensor(&format!("{p}.weight")).is_ok())
        else {
            // A dense MLP layer; a MoE layer must have its router here.
            assert!(
                trace.get(Some(l), "moe").is_none(),
                "{}: no router weights for MoE layer {l}",
                path.display()
            );
            continue;
        };
        let w = router_matrix(&st, &router, e.cols);
        let bias = floats(&st, &format!("{router}.bias"));
        let correction = floats(&st, &format!("{router}.e_score_correction_bias"));
        let experts = w.len() / e.cols;
        for x in e.data.chunks_exact(e.cols) {
            let mut s: Vec<f64> = (0..experts)
                .map(|r| {
                    let row = &w[r * e.cols..(r + 1) * e.cols];
                    let mut v: f64 = row.iter().zip(x).map(|(a, &b)| a * b as f64).sum();
                    if let Some(b) = &bias {
                        v += b[r];
                    }
                    match &correction {
                        Some(c) => 1.0 / (1.0 + (-v).exp()) + c[r],
                        None => v,
                    }
                })
                .collect();
            s.sort_by(|a, b| b.total_cmp(a));
            let top = s[..=k].iter().fold(0.0f64, |m, v| m.max(v.abs()));
            worst = worst.min((s[k - 1] - s[k]) / top.max(f64::MIN_POSITIVE));
        }
    }
    worst
}

/// `[experts, cols]` in f64: an MLX affine matrix (`weight` u32 codes with
/// `scales` and `biases`) or a float one.
fn router_matrix(st: &SafeTensors, p: &str, cols: usize) -> Vec<f64> {
    let w = st.tensor(&format!("{p}.weight")).unwrap();
    if w.dtype() != Dtype::U32 {
        return floats(st, &format!("{p}.weight")).unwrap();
    }
    let rows = w.shape()[0];
    let words: Vec<u32> = w
        .data()
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let bits = words.len() * 32 / (rows * cols);
    let scales = floats(st, &format!("{p}.scales")).unwrap();
    let biases = floats(st, &format!("{p}.biases")).unwrap();
    let gs = rows * cols / scales.len();
    let mask = (1u64 << bits) - 1;
    let per_row = cols * bits / 32;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let bit = c * bits;
            let lo = words[r * per_row + bit / 32] as u64;
            let hi = words.get(r * per_row + bit / 32 + 1).copied().unwrap_or(0) as u64;
            let code = ((lo | hi << 32) >> (bit % 32)) & mask;
            let g = (r * cols + c) / gs;
            out.push(code as f64 * scales[g] + biases[g]);
        }
    }
    out
}

/// A float tensor (f32, bf16 or f16) as f64, if present.
fn floats(st: &SafeTensors, name: &str) -> Option<Vec<f64>> {
    let t = st.tensor(name).ok()?;
    let d = t.data();
    Some(match t.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
            .collect(),
        Dtype::BF16 => d
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        Dtype::F16 => d
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f64())
            .collect(),
        other => panic!("{name}: router tensor of type {other:?}"),
    })
}
