//! The MoE block on the CPU (`model::moe`): the router (softmax top-K or
//! `noaux_tc`, see [`super::router`]), routed SwiGLU experts streamed from
//! the expert store, the shared expert (gated or not), and dense MLPs. A
//! batch is evaluated expert-major: each routed expert is read once per
//! layer per batch and applied to every token that chose it.

use std::collections::BTreeMap;
use std::time::Instant;

use rayon::prelude::*;

use crate::backend::cpu::experts::{ExpertRun, Prefetched};
use crate::backend::cpu::ops;
use crate::backend::cpu::qmatmul::{matmul, matmul_f32_activations, matmul_group};
use crate::backend::cpu::router::NoauxTc;
use crate::backend::prefetch::most_chosen;
use crate::config::{ExpertActivation, ModelConfig, RouterKind};
use crate::error::Result;
use crate::io::{ExpertBuf, ExpertStore, Landed};
use crate::model::moe::{DenseMlp, ExpertLayout, MoeBlock, SharedExpert};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::weights::Weights;

/// Expert bytes in flight per wave when experts are read into buffers
/// (mapped layers fetch everything at once): two waves are held, the one
/// being computed and the next one being read.
const WAVE_BYTES: usize = 64 << 20;

/// Routing of a batch: per token, `k` (expert, weight) pairs in slot order.
pub struct Routing {
    pub k: usize,
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

impl Routing {
    /// From router logits `[n, num_experts]`: softmax over all experts,
    /// top-`k`, renormalised iff `norm_topk_prob`.
    pub fn from_logits(c: &ModelConfig, mut logits: Vec<f32>, k: usize) -> Routing {
        let e = c.moe.num_experts;
        let mut experts = Vec::with_capacity(logits.len() / e * k);
        let mut weights = Vec::with_capacity(logits.len() / e * k);
        for probs in logits.chunks_exact_mut(e) {
            ops::softmax_inplace(probs);
            let top = ops::top_k(probs, k);
            let mut w: Vec<f32> = top.iter().map(|&i| probs[i]).collect();
            if c.moe.norm_topk_prob {
                let s: f32 = w.iter().sum();
                for x in &mut w {
                    *x /= s;
                }
            }
            experts.extend(top);
            weights.extend(w);
        }
        Routing {
            k,
            experts,
            weights,
        }
    }

    /// gpt-oss: per token the `k` largest logits (ties to the lower index),
    /// weighted by a softmax over those `k`.
    pub fn top_k_softmax(logits: &[f32], e: usize, k: usize) -> Routing {
        let mut experts = Vec::with_capacity(logits.len() / e * k);
        let mut weights = Vec::with_capacity(logits.len() / e * k);
        for row in logits.chunks_exact(e) {
            let top = ops::top_k(row, k);
            let mut w: Vec<f32> = top.iter().map(|&i| row[i]).collect();
            ops::softmax_inplace(&mut w);
            experts.extend(top);
            weights.extend(w);
        }
        Routing {
            k,
            experts,
            weights,
        }
    }

    /// From router logits `[n, num_experts]` by `noaux_tc` (see
    /// [`crate::model::router`]).
    pub fn noaux_tc(logits: &[f32], e: usize, r: NoauxTc) -> Routing {
        let mut experts = Vec::with_capacity(logits.len() / e * r.k);
        let mut weights = Vec::with_capacity(logits.len() / e * r.k);
        for row in logits.chunks_exact(e) {
            let (ex, w) = r.route(row);
            experts.extend(ex);
            weights.extend(w);
        }
        Routing {
            k: r.k,
            experts,
            weights,
        }
    }

    /// Every chosen expert once, ascending, with the (token, slot) indices
    /// (`token * k + j`) it serves.
    pub fn users(&self) -> BTreeMap<usize, Vec<usize>> {
        let mut users: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, &e) in self.experts.iter().enumerate() {
            users.entry(e).or_default().push(i);
        }
        users
    }
}

/// The router's choice of `k` experts per token: softmax top-`k`
/// (renormalised iff `norm_topk_prob`) or `noaux_tc`.
pub fn route(
    b: &MoeBlock,
    w: &Weights,
    c: &ModelConfig,
    xn: &[f32],
    n: usize,
    k: usize,
) -> Routing {
    let e = c.moe.num_experts;
    let mut logits = vec![0.0f32; n * e];
    // Exact activations even under `Activations::Q8`: the router is a small
    // product whose rounding would change which experts run (llama.cpp
    // keeps routers in f32 for the same reason).
    matmul_f32_activations(&w.view(&b.router), xn, n, &mut logits);
    if let Some(bias) = b.router_bias {
        let bias = w.vector(bias);
        for row in logits.chunks_exact_mut(e) {
            ops::add_inplace(row, bias);
        }
    }
    match (c.moe.router, b.score_bias.map(|v| w.vector(v))) {
        (RouterKind::TopKSoftmax, _) => Routing::top_k_softmax(&logits, e, k),
        (
            RouterKind::NoauxTc {
                n_group,
                topk_group,
                routed_scaling_factor,
            },
            Some(bias),
        ) => Routing::noaux_tc(
            &logits,
            c.moe.num_experts,
            NoauxTc {
                bias,
                n_group,
                topk_group,
                k,
                norm_topk_prob: c.moe.norm_topk_prob,
                routed_scaling_factor,
            },
        ),
        _ => Routing::from_logits(c, logits, k),
    }
}

/// Writes the block's output for `n` normed tokens to `out`.
///
/// Expert-major: every chosen expert is fetched once for the batch. All
/// fetches of a wave are issued at once; the shared expert is computed
/// while they are in flight, and each routed expert as soon as it lands
/// (experts fetched ahead by the previous layer first). Outputs are kept
/// per (token, slot) and combined in slot order, so the result does not
/// depend on the order experts land in. With prefetch on, `next` (the
/// next MoE layer) gets its likely experts fetched ahead.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    b: &MoeBlock,
    w: &Weights,
    c: &ModelConfig,
    run: &mut ExpertRun<'_>,
    next: Option<&MoeBlock>,
    xn: &[f32],
    n: usize,
    out: &mut [f32],
    times: &mut PhaseTimes,
) -> Result<()> {
    let (h, k) = (c.hidden_size, run.k);
    let mut clock = Instant::now();
    let routing = route(b, w, c, xn, n, k);
    lap(&mut clock, &mut times.routing);

    let users = routing.users();
    // Experts held interleaved in RAM need no fetch (and no prefetch).
    let resident = run.repacked.filter(|r| r.has(b.layer));
    let ids: Vec<usize> = match resident {
        Some(_) => Vec::new(),
        None => users.keys().copied().collect(),
    };
    let ahead = run.take_prefetch(b.layer);
    let misses: Vec<usize> = match &ahead {
        Some(p) => {
            run.count(&ids, &p.ids);
            ids.iter().copied().filter(|e| !p.ids.contains(e)).collect()
        }
        None => ids,
    };
    let cap = fetch_cap(b, run.store, k);
    let mut waves = misses.chunks(cap);
    let mut current = match waves.next() {
        Some(ids) => Some((ids, run.start_fetch(b.layer, ids, b.experts.extent)?)),
        None => None,
    };
    lap(&mut clock, &mut times.expert_io);

    let held = |l: usize| run.repacked.is_some_and(|r| r.has(l));
    if let Some(nx) = next.filter(|nx| run.prefetch && !held(nx.layer)) {
        let guess = route(nx, w, c, xn, n, k);
        let ids = most_chosen(&guess.experts, fetch_cap(nx, run.store, k));
        let fetch = run.start_fetch(nx.layer, &ids, nx.experts.extent)?;
        run.stats.predicted += ids.len() as u64;
        run.pending = Some(Prefetched {
            layer: nx.layer,
            ids,
            fetch,
        });
        lap(&mut clock, &mut times.routing);
    }

    let shared = b.shared.as_ref().map(|sh| shared_forward(sh, w, xn, n, h));
    lap(&mut clock, &mut times.shared_mlp);

    let act = ExpertAct::of(b, w, c);
    let mut slot_out = vec![0.0f32; n * k * h];
    if let Some(mut p) = ahead {
        // Every prefetched read is waited for, so its buffer returns
        // to the pool; the unused ones were issued a layer ago.
        while let Some(landed) = p.fetch.next_landed() {
            lap(&mut clock, &mut times.expert_io);
            let e = p.ids[landed.index];
            let buf = match users.get(&e) {
                Some(slots) => {
                    let buf =
                        apply_landed(b, &act, run, landed, e, slots, xn, k, h, &mut slot_out)?;
                    lap(&mut clock, &mut times.expert_compute);
                    buf
                }
                None => landed.buf,
            };
            run.bufs.extend(buf);
        }
    }
    while let Some((wave_ids, mut fetch)) = current.take() {
        // Read the next wave while this one is computed.
        current = match waves.next() {
            Some(ids) => Some((ids, run.start_fetch(b.layer, ids, b.experts.extent)?)),
            None => None,
        };
        lap(&mut clock, &mut times.expert_io);
        if run.store.mapped(b.layer, wave_ids[0]).is_some() {
            // Served from the mapping: the wave's experts side by side once
            // it has landed, as for the experts held in RAM below.
            let mut work = Vec::with_capacity(wave_ids.len());
            while let Some(landed) = fetch.next_landed() {
                landed.result?;
                let e = wave_ids[landed.index];
                let bytes = run
                    .store
                    .mapped(b.layer, e)
                    .expect("mapped layer serves its experts");
                work.push((e, bytes, &users[&e][..]));
            }
            lap(&mut clock, &mut times.expert_io);
            apply_experts(&b.experts, &act, false, &work, xn, k, h, &mut slot_out);
            lap(&mut clock, &mut times.expert_compute);
            continue;
        }
        while let Some(landed) = fetch.next_landed() {
            lap(&mut clock, &mut times.expert_io);
            let e = wave_ids[landed.index];
            let buf = apply_landed(b, &act, run, landed, e, &users[&e], xn, k, h, &mut slot_out)?;
            run.bufs.extend(buf);
            lap(&mut clock, &mut times.expert_compute);
        }
    }

    if let Some(mem) = resident {
        let held: Vec<usize> = users.keys().copied().collect();
        run.store.count_held(b.layer, &held);
        let work: Vec<_> = users
            .iter()
            .map(|(&e, slots)| {
                let bytes = mem
                    .expert(b.layer, e)
                    .expect("the router picks experts in range");
                (e, bytes, &slots[..])
            })
            .collect();
        apply_experts(&b.experts, &act, true, &work, xn, k, h, &mut slot_out);
        lap(&mut clock, &mut times.expert_compute);
    }

    // Combine per token in slot order so the sum does not depend on the batch.
    for t in 0..n {
        let o = &mut out[t * h..(t + 1) * h];
        o.fill(0.0);
        for j in 0..k {
            let w = routing.weights[t * k + j];
            let s = &slot_out[(t * k + j) * h..(t * k + j + 1) * h];
            for (a, &b) in o.iter_mut().zip(s) {
                *a += w * b;
            }
        }
    }
    lap(&mut clock, &mut times.expert_compute);
    match shared {
        Some((y, Some(gs))) => {
            for t in 0..n {
                let sg = ops::sigmoid(gs[t]);
                for (a, &v) in out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(&y[t * h..(t + 1) * h])
                {
                    *a += sg * v;
                }
            }
        }
        Some((y, None)) => ops::add_inplace(out, &y),
        None => {}
    }
    lap(&mut clock, &mut times.shared_mlp);
    Ok(())
}

/// Experts fetched at once: all of them from a mapping, else enough to
/// fill [`WAVE_BYTES`] (at least `k`).
fn fetch_cap(b: &MoeBlock, store: &ExpertStore, k: usize) -> usize {
    if store.is_mapped(b.layer) == Some(true) {
        b.experts.num_experts
    } else {
        (WAVE_BYTES / b.experts.extent).max(k).max(1)
    }
}

/// Applies expert `e` once its fetch has landed; hands back its buffer.
#[allow(clippy::too_many_arguments)]
fn apply_landed(
    b: &MoeBlock,
    act: &ExpertAct<'_>,
    run: &ExpertRun<'_>,
    landed: Landed,
    e: usize,
    slots: &[usize],
    xn: &[f32],
    k: usize,
    h: usize,
    slot_out: &mut [f32],
) -> Result<Option<ExpertBuf>> {
    landed.result?;
    let bytes = match &landed.buf {
        Some(b) => b.as_bytes(),
        None => run
            .store
            .mapped(b.layer, e)
            .expect("mapped layer serves its experts"),
    };
    apply_experts(
        &b.experts,
        act,
        false,
        &[(e, bytes, slots)],
        xn,
        k,
        h,
        slot_out,
    );
    Ok(landed.buf)
}

/// Routed experts `(expert, its bytes, its slots)`, each a SwiGLU over the
/// tokens that chose it, written to their (token, slot) rows of
/// `slot_out`; `interleaved`: the bytes were made by
/// [`ExpertLayout::interleave_extent`]. Several run side by side on the
/// pool's threads, each one's products nested, so the threads meet once
/// per call rather than twice per expert (each expert's rows come out the
/// same either way).
#[allow(clippy::too_many_arguments)]
fn apply_experts(
    layout: &ExpertLayout,
    act: &ExpertAct<'_>,
    interleaved: bool,
    work: &[(usize, &[u8], &[usize])],
    xn: &[f32],
    k: usize,
    h: usize,
    slot_out: &mut [f32],
) {
    let ys: Vec<Vec<f32>> = work
        .par_iter()
        .map(|&(e, bytes, slots)| {
            let m = slots.len();
            let mut x = vec![0.0f32; m * h];
            for (r, &s) in slots.iter().enumerate() {
                let t = s / k;
                x[r * h..(r + 1) * h].copy_from_slice(&xn[t * h..(t + 1) * h]);
            }
            let mut y = vec![0.0f32; m * h];
            expert_forward_with(layout, act, e, bytes, interleaved, &x, m, &mut y);
            y
        })
        .collect();
    for ((_, _, slots), y) in work.iter().zip(&ys) {
        for (r, &s) in slots.iter().enumerate() {
            slot_out[s * h..(s + 1) * h].copy_from_slice(&y[r * h..(r + 1) * h]);
        }
    }
}

/// A shared expert's `(down(swiglu(gate x, up x)), gate logit)` for `n`
/// tokens; the caller adds `sigmoid(logit) * y`, or `y` when it has no gate.
fn shared_forward(
    sh: &SharedExpert,
    w: &Weights,
    xn: &[f32],
    n: usize,
    h: usize,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let mut y = vec![0.0f32; n * h];
    let gs = sh.gate.map(|gate| {
        let mut gs = vec![0.0f32; n];
        matmul(&w.view(&gate), xn, n, &mut gs);
        gs
    });
    dense_forward(&sh.mlp, w, xn, n, &mut y);
    (y, gs)
}

/// A dense SwiGLU MLP on `n` rows of `xn`: `out = down(silu(gate x) * up x)`.
pub fn dense_forward(m: &DenseMlp, w: &Weights, xn: &[f32], n: usize, out: &mut [f32]) {
    let i = m.gate.rows;
    let mut g = vec![0.0f32; n * i];
    let mut u = vec![0.0f32; n * i];
    let (gw, uw) = (w.view(&m.gate), w.view(&m.up));
    matmul_group(&mut [(&gw, &mut g), (&uw, &mut u)], xn, n);
    let mut act = vec![0.0f32; n * i];
    ops::swiglu(&g, &u, &mut act);
    matmul(&w.view(&m.down), &act, n, out);
}

/// What a routed expert adds beyond its three products: per-expert biases
/// (`[experts, rows]` tables) and the gated activation.
pub struct ExpertAct<'a> {
    /// gate, up and down bias tables.
    pub bias: Option<[&'a [f32]; 3]>,
    pub activation: ExpertActivation,
}

impl<'a> ExpertAct<'a> {
    pub fn of(b: &MoeBlock, w: &'a Weights, c: &ModelConfig) -> Self {
        ExpertAct {
            bias: b.expert_bias.map(|t| t.map(|v| w.vector(v))),
            activation: c.moe.activation,
        }
    }

    /// Plain SwiGLU without biases.
    pub const PLAIN: ExpertAct<'static> = ExpertAct {
        bias: None,
        activation: ExpertActivation::Silu,
    };
}

/// Adds row `e` of a `[experts, width]` bias table to every `width`-wide
/// row of `y`.
fn add_bias_rows(table: &[f32], e: usize, width: usize, y: &mut [f32]) {
    let b = &table[e * width..(e + 1) * width];
    for row in y.chunks_exact_mut(width) {
        ops::add_inplace(row, b);
    }
}

/// One routed expert (its bytes: an extent of `layout`) on `m` rows of `x`
/// (m x hidden): `y = down(silu(gate x) * up x)`.
pub fn expert_forward(layout: &ExpertLayout, bytes: &[u8], x: &[f32], m: usize, y: &mut [f32]) {
    expert_forward_with(layout, &ExpertAct::PLAIN, 0, bytes, false, x, m, y)
}

/// [`expert_forward`] of expert `e` with its biases and activation;
/// `interleaved`: `bytes` were made by [`ExpertLayout::interleave_extent`].
#[allow(clippy::too_many_arguments)]
pub fn expert_forward_with(
    layout: &ExpertLayout,
    act: &ExpertAct<'_>,
    e: usize,
    bytes: &[u8],
    interleaved: bool,
    x: &[f32],
    m: usize,
    y: &mut [f32],
) {
    let inter = layout.gate.rows;
    let mut g = vec![0.0f32; m * inter];
    let mut u = vec![0.0f32; m * inter];
    let view = |c: &crate::model::moe::ComponentLayout| match interleaved {
        true => c.view_interleaved(bytes),
        false => c.view(bytes),
    };
    let (gw, uw) = (view(&layout.gate), view(&layout.up));
    matmul_group(&mut [(&gw, &mut g), (&uw, &mut u)], x, m);
    if let Some([bg, bu, _]) = act.bias {
        add_bias_rows(bg, e, inter, &mut g);
        add_bias_rows(bu, e, inter, &mut u);
    }
    let mut a = vec![0.0f32; m * inter];
    match act.activation {
        ExpertActivation::Silu => ops::swiglu(&g, &u, &mut a),
        ExpertActivation::SwigluOai { alpha, limit } => {
            ops::swiglu_oai(&g, &u, alpha, limit, &mut a)
        }
    }
    matmul(&view(&layout.down), &a, m, y);
    if let Some([_, _, bd]) = act.bias {
        add_bias_rows(bd, e, layout.down.rows, y);
    }
}
