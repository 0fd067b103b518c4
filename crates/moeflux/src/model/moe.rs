//! The sparse MoE block: a router (Qwen: softmax top-K; DeepSeek-V3:
//! `noaux_tc`, see [`crate::model::router`]), routed SwiGLU experts streamed
//! from the expert store, and a shared expert (Qwen: scaled by a sigmoid gate;
//! DeepSeek: added as is). A batch is evaluated expert-major: each routed
//! expert is read once per layer per batch and applied to every token that
//! chose it.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::backend::cpu::ops;
use crate::backend::cpu::qmatmul::{matmul, matmul_group};
use crate::config::{ModelConfig, QuantSpec, RouterKind};
use crate::error::{Error, Result};
use crate::format::ExpertLayer;
use crate::io::{ExpertBuf, ExpertStore, Landed};
use crate::model::experts::{most_chosen, ExpertRun, Prefetched};
use crate::model::router::NoauxTc;
use crate::model::timing::{lap, PhaseTimes};
use crate::model::weights::{DenseStore, LinearRef};
use crate::quant::{affine, QMatrix, ScaleData, Weight};

/// Expert bytes in flight per wave when experts are read into buffers
/// (mapped layers fetch everything at once): two waves are held, the one
/// being computed and the next one being read.
const WAVE_BYTES: usize = 64 << 20;

pub struct SharedExpert {
    pub gate: LinearRef,
    pub up: LinearRef,
    pub down: LinearRef,
    pub gate_scalar: LinearRef,
}

pub struct MoeBlock {
    pub layer: usize,
    pub router: LinearRef,
    /// Qwen's shared expert with its sigmoid gate.
    pub shared: Option<SharedExpert>,
    /// DeepSeek's shared experts (one SwiGLU MLP of `n_shared_experts` widths),
    /// added without a gate.
    pub ungated_shared: Option<DenseMlp>,
    /// DeepSeek's `e_score_correction_bias` (`noaux_tc` routing).
    pub score_bias: Option<Vec<f32>>,
    pub experts: ExpertLayout,
}

/// Where one projection of an expert lives inside its extent.
#[derive(Debug, Clone, Copy)]
pub struct ComponentLayout {
    pub rows: usize,
    pub cols: usize,
    pub spec: QuantSpec,
    pub weight: usize,
    pub scales: usize,
    pub biases: usize,
    pub scales_f32: bool,
}

/// gate, up and down projections of every expert of a layer.
#[derive(Debug, Clone)]
pub struct ExpertLayout {
    pub num_experts: usize,
    pub extent: usize,
    pub gate: ComponentLayout,
    pub up: ComponentLayout,
    pub down: ComponentLayout,
}

impl ExpertLayout {
    /// One expert (its bytes: an extent of this layout) on `m` rows of `x`
    /// (m x hidden): `y = down(silu(gate x) * up x)`.
    pub fn forward(&self, bytes: &[u8], x: &[f32], m: usize, y: &mut [f32]) {
        let inter = self.gate.rows;
        let mut g = vec![0.0f32; m * inter];
        let mut u = vec![0.0f32; m * inter];
        let (gw, uw) = (self.gate.view(bytes), self.up.view(bytes));
        matmul_group(&mut [(&gw, &mut g), (&uw, &mut u)], x, m);
        let mut act = vec![0.0f32; m * inter];
        ops::swiglu(&g, &u, &mut act);
        matmul(&self.down.view(bytes), &act, m, y);
    }

    /// Checks the manifest's description of a layer against the config.
    pub fn from_manifest(
        l: &ExpertLayer,
        c: &ModelConfig,
        manifest_path: &std::path::Path,
    ) -> Result<Self> {
        let err = |reason: String| {
            Error::format(
                manifest_path,
                format!("experts of layer {}: {reason}", l.layer),
            )
        };
        if l.num_experts != c.moe.num_experts {
            return Err(err(format!(
                "{} experts, config says {}",
                l.num_experts, c.moe.num_experts
            )));
        }
        if !l.stride.is_multiple_of(crate::format::EXPERT_ALIGN as u64) || l.expert_bytes > l.stride
        {
            return Err(err(format!(
                "stride {} is not a multiple of 4096 holding {} bytes",
                l.stride, l.expert_bytes
            )));
        }
        let (h, i) = (c.hidden_size, c.moe.moe_intermediate);
        let comp = |name: &str, rows: usize, cols: usize| -> Result<ComponentLayout> {
            let cp = l
                .component(name)
                .ok_or_else(|| err(format!("component {name} missing")))?;
            if cp.rows != rows || cp.cols != cols {
                return Err(err(format!(
                    "{name} is [{}, {}], expected [{rows}, {cols}]",
                    cp.rows, cp.cols
                )));
            }
            cp.quant
                .validate()
                .map_err(|r| err(format!("{name}: {r}")))?;
            if !cols.is_multiple_of(cp.quant.group_size) {
                return Err(err(format!(
                    "{name}: {cols} columns not divisible by group size"
                )));
            }
            let wbytes = rows * affine::words_per_row(cols, cp.quant.bits) * 4;
            let groups = rows * cols / cp.quant.group_size;
            let scales_f32 = match cp.scales.dtype.as_str() {
                "F32" => true,
                "BF16" => false,
                other => return Err(err(format!("{name}: scale dtype {other} not supported"))),
            };
            if cp.biases.dtype != cp.scales.dtype {
                return Err(err(format!("{name}: scales and biases differ in dtype")));
            }
            let sbytes = groups * if scales_f32 { 4 } else { 2 };
            let parts = [
                (&cp.weight, wbytes, 4usize, "weight"),
                (&cp.scales, sbytes, if scales_f32 { 4 } else { 2 }, "scales"),
                (&cp.biases, sbytes, if scales_f32 { 4 } else { 2 }, "biases"),
            ];
            for (r, bytes, align, what) in parts {
                if r.bytes as usize != bytes
                    || r.offset + r.bytes > l.expert_bytes
                    || !(r.offset as usize).is_multiple_of(align)
                {
                    return Err(err(format!(
                        "{name}.{what}: bad byte range {}+{}",
                        r.offset, r.bytes
                    )));
                }
            }
            if cp.weight.dtype != "U32" {
                return Err(err(format!(
                    "{name}.weight dtype {}, expected U32",
                    cp.weight.dtype
                )));
            }
            Ok(ComponentLayout {
                rows,
                cols,
                spec: cp.quant,
                weight: cp.weight.offset as usize,
                scales: cp.scales.offset as usize,
                biases: cp.biases.offset as usize,
                scales_f32,
            })
        };
        Ok(ExpertLayout {
            num_experts: l.num_experts,
            extent: l.stride as usize,
            gate: comp("gate_proj", i, h)?,
            up: comp("up_proj", i, h)?,
            down: comp("down_proj", h, i)?,
        })
    }
}

impl ComponentLayout {
    /// The projection inside one expert's bytes (a buffer or the mapping,
    /// both 4096-aligned; offsets were validated against the extent).
    fn view<'a>(&self, bytes: &'a [u8]) -> Weight<'a> {
        let words = self.rows * affine::words_per_row(self.cols, self.spec.bits);
        let groups = self.rows * self.cols / self.spec.group_size;
        let scales = |off: usize| {
            if self.scales_f32 {
                ScaleData::F32(cast(&bytes[off..off + 4 * groups]))
            } else {
                ScaleData::Bf16(cast(&bytes[off..off + 2 * groups]))
            }
        };
        Weight::Quantized(QMatrix {
            rows: self.rows,
            cols: self.cols,
            spec: self.spec,
            packed: cast(&bytes[self.weight..self.weight + 4 * words]),
            scales: scales(self.scales),
            biases: scales(self.biases),
        })
    }
}

fn cast<T: bytemuck::Pod>(b: &[u8]) -> &[T] {
    bytemuck::try_cast_slice(b).expect("expert layout validated for alignment")
}

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

impl MoeBlock {
    pub fn load(
        d: &DenseStore,
        c: &ModelConfig,
        prefix: &str,
        layer: usize,
        experts: ExpertLayout,
    ) -> Result<Self> {
        let h = c.hidden_size;
        let p = format!("{prefix}mlp.");
        if let RouterKind::NoauxTc { .. } = c.moe.router {
            let s = c.moe.shared_intermediate;
            let ungated_shared = if s > 0 {
                Some(DenseMlp::load_at(d, &format!("{p}shared_experts."), s, h)?)
            } else {
                None
            };
            let e = c.moe.num_experts;
            return Ok(MoeBlock {
                layer,
                router: d.linear(&format!("{p}gate"), e, h)?,
                shared: None,
                ungated_shared,
                score_bias: Some(d.floats(&format!("{p}gate.e_score_correction_bias"), &[e])?),
                experts,
            });
        }
        let shared = if c.moe.shared_intermediate > 0 {
            let s = c.moe.shared_intermediate;
            Some(SharedExpert {
                gate: d.linear(&format!("{p}shared_expert.gate_proj"), s, h)?,
                up: d.linear(&format!("{p}shared_expert.up_proj"), s, h)?,
                down: d.linear(&format!("{p}shared_expert.down_proj"), h, s)?,
                gate_scalar: d.linear(&format!("{p}shared_expert_gate"), 1, h)?,
            })
        } else {
            None
        };
        Ok(MoeBlock {
            layer,
            router: d.linear(&format!("{p}gate"), c.moe.num_experts, h)?,
            shared,
            ungated_shared: None,
            score_bias: None,
            experts,
        })
    }

    /// The router's choice of `k` experts per token: softmax top-`k`
    /// (renormalised iff `norm_topk_prob`) or `noaux_tc`.
    pub fn route(
        &self,
        d: &DenseStore,
        c: &ModelConfig,
        xn: &[f32],
        n: usize,
        k: usize,
    ) -> Routing {
        let mut logits = vec![0.0f32; n * c.moe.num_experts];
        matmul(&d.view(&self.router), xn, n, &mut logits);
        match (c.moe.router, &self.score_bias) {
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
        &self,
        d: &DenseStore,
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
        let routing = self.route(d, c, xn, n, k);
        lap(&mut clock, &mut times.routing);

        let users = routing.users();
        let ids: Vec<usize> = users.keys().copied().collect();
        let ahead = run.take_prefetch(self.layer);
        let misses: Vec<usize> = match &ahead {
            Some(p) => {
                run.count(&ids, &p.ids);
                ids.iter().copied().filter(|e| !p.ids.contains(e)).collect()
            }
            None => ids,
        };
        let cap = self.fetch_cap(run.store, k);
        let mut waves = misses.chunks(cap);
        let mut current = match waves.next() {
            Some(w) => Some((w, run.start_fetch(self.layer, w, self.experts.extent)?)),
            None => None,
        };
        lap(&mut clock, &mut times.expert_io);

        if let Some(nx) = next.filter(|_| run.prefetch) {
            let guess = nx.route(d, c, xn, n, k);
            let ids = most_chosen(&guess.experts, nx.fetch_cap(run.store, k));
            let fetch = run.start_fetch(nx.layer, &ids, nx.experts.extent)?;
            run.stats.predicted += ids.len() as u64;
            run.pending = Some(Prefetched {
                layer: nx.layer,
                ids,
                fetch,
            });
            lap(&mut clock, &mut times.routing);
        }

        let shared = self.shared.as_ref().map(|sh| sh.forward(d, xn, n, h));
        let ungated = self.ungated_shared.as_ref().map(|m| {
            let mut y = vec![0.0f32; n * h];
            m.forward(d, xn, n, &mut y);
            y
        });
        lap(&mut clock, &mut times.shared_mlp);

        let mut slot_out = vec![0.0f32; n * k * h];
        if let Some(mut p) = ahead {
            // Every prefetched read is waited for, so its buffer returns
            // to the pool; the unused ones were issued a layer ago.
            while let Some(landed) = p.fetch.next_landed() {
                lap(&mut clock, &mut times.expert_io);
                let e = p.ids[landed.index];
                let buf = match users.get(&e) {
                    Some(slots) => {
                        let b =
                            self.apply_landed(run, landed, e, slots, xn, k, h, &mut slot_out)?;
                        lap(&mut clock, &mut times.expert_compute);
                        b
                    }
                    None => landed.buf,
                };
                run.bufs.extend(buf);
            }
        }
        while let Some((wave_ids, mut fetch)) = current.take() {
            // Read the next wave while this one is computed.
            current = match waves.next() {
                Some(w) => Some((w, run.start_fetch(self.layer, w, self.experts.extent)?)),
                None => None,
            };
            lap(&mut clock, &mut times.expert_io);
            while let Some(landed) = fetch.next_landed() {
                lap(&mut clock, &mut times.expert_io);
                let e = wave_ids[landed.index];
                let buf = self.apply_landed(run, landed, e, &users[&e], xn, k, h, &mut slot_out)?;
                run.bufs.extend(buf);
                lap(&mut clock, &mut times.expert_compute);
            }
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
        if let Some((y, gs)) = shared {
            for t in 0..n {
                let sg = ops::sigmoid(gs[t]);
                for (a, &b) in out[t * h..(t + 1) * h]
                    .iter_mut()
                    .zip(&y[t * h..(t + 1) * h])
                {
                    *a += sg * b;
                }
            }
        }
        if let Some(y) = ungated {
            ops::add_inplace(out, &y);
        }
        lap(&mut clock, &mut times.shared_mlp);
        Ok(())
    }

    /// Experts fetched at once: all of them from a mapping, else enough to
    /// fill [`WAVE_BYTES`] (at least `k`).
    fn fetch_cap(&self, store: &ExpertStore, k: usize) -> usize {
        if store.is_mapped(self.layer) == Some(true) {
            self.experts.num_experts
        } else {
            (WAVE_BYTES / self.experts.extent).max(k).max(1)
        }
    }

    /// Applies expert `e` once its fetch has landed; hands back its buffer.
    #[allow(clippy::too_many_arguments)]
    fn apply_landed(
        &self,
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
                .mapped(self.layer, e)
                .expect("mapped layer serves its experts"),
        };
        self.apply_expert(bytes, slots, xn, k, h, slot_out);
        Ok(landed.buf)
    }

    /// One routed expert's SwiGLU over the tokens that chose it, written to
    /// their (token, slot) rows of `slot_out`.
    fn apply_expert(
        &self,
        bytes: &[u8],
        slots: &[usize],
        xn: &[f32],
        k: usize,
        h: usize,
        slot_out: &mut [f32],
    ) {
        let m = slots.len();
        let mut x = vec![0.0f32; m * h];
        for (r, &s) in slots.iter().enumerate() {
            let t = s / k;
            x[r * h..(r + 1) * h].copy_from_slice(&xn[t * h..(t + 1) * h]);
        }
        let mut y = vec![0.0f32; m * h];
        self.experts.forward(bytes, &x, m, &mut y);
        for (r, &s) in slots.iter().enumerate() {
            slot_out[s * h..(s + 1) * h].copy_from_slice(&y[r * h..(r + 1) * h]);
        }
    }
}

impl SharedExpert {
    /// `(down(swiglu(gate x, up x)), gate logit)` for `n` tokens; the caller
    /// adds `sigmoid(logit) * y`.
    fn forward(&self, d: &DenseStore, xn: &[f32], n: usize, h: usize) -> (Vec<f32>, Vec<f32>) {
        let si = self.gate.rows;
        let mut g = vec![0.0f32; n * si];
        let mut u = vec![0.0f32; n * si];
        let mut gs = vec![0.0f32; n];
        let (gw, uw, sw) = (
            d.view(&self.gate),
            d.view(&self.up),
            d.view(&self.gate_scalar),
        );
        matmul_group(&mut [(&gw, &mut g), (&uw, &mut u), (&sw, &mut gs)], xn, n);
        let mut act = vec![0.0f32; n * si];
        ops::swiglu(&g, &u, &mut act);
        let mut y = vec![0.0f32; n * h];
        matmul(&d.view(&self.down), &act, n, &mut y);
        (y, gs)
    }
}

/// A dense SwiGLU MLP (Qwen3-Next `mlp_only_layers`, DeepSeek's first layers
/// and its shared experts).
pub struct DenseMlp {
    pub gate: LinearRef,
    pub up: LinearRef,
    pub down: LinearRef,
}

impl DenseMlp {
    pub fn load(d: &DenseStore, c: &ModelConfig, prefix: &str) -> Result<Self> {
        Self::load_at(
            d,
            &format!("{prefix}mlp."),
            c.intermediate_size,
            c.hidden_size,
        )
    }

    /// `{module}gate_proj`, `up_proj`, `down_proj` of width `i`.
    pub fn load_at(d: &DenseStore, module: &str, i: usize, h: usize) -> Result<Self> {
        Ok(DenseMlp {
            gate: d.linear(&format!("{module}gate_proj"), i, h)?,
            up: d.linear(&format!("{module}up_proj"), i, h)?,
            down: d.linear(&format!("{module}down_proj"), h, i)?,
        })
    }

    pub fn forward(&self, d: &DenseStore, xn: &[f32], n: usize, out: &mut [f32]) {
        let i = self.gate.rows;
        let mut g = vec![0.0f32; n * i];
        let mut u = vec![0.0f32; n * i];
        let (gw, uw) = (d.view(&self.gate), d.view(&self.up));
        matmul_group(&mut [(&gw, &mut g), (&uw, &mut u)], xn, n);
        let mut act = vec![0.0f32; n * i];
        ops::swiglu(&g, &u, &mut act);
        matmul(&d.view(&self.down), &act, n, out);
    }
}
