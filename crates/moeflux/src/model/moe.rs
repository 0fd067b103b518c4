//! The sparse MoE block: softmax router with top-K, routed SwiGLU experts
//! streamed from the expert store, and a shared expert scaled by a sigmoid
//! gate. A batch is evaluated expert-major: each routed expert is read once
//! per layer per batch and applied to every token that chose it.

use std::collections::BTreeMap;

use crate::backend::cpu::ops;
use crate::backend::cpu::qmatmul::matmul;
use crate::config::{ModelConfig, QuantSpec};
use crate::error::{Error, Result};
use crate::format::ExpertLayer;
use crate::io::{ExpertBuf, ExpertStore};
use crate::model::timing::{lap, PhaseTimes};
use crate::model::weights::{DenseStore, LinearRef};
use crate::quant::{affine, QMatrix, ScaleData, Weight};

/// Experts read per I/O batch during a multi-token eval; bounds the memory
/// held in expert buffers while keeping several reads in flight.
const EXPERTS_PER_READ: usize = 16;

pub struct SharedExpert {
    pub gate: LinearRef,
    pub up: LinearRef,
    pub down: LinearRef,
    pub gate_scalar: LinearRef,
}

pub struct MoeBlock {
    pub layer: usize,
    pub router: LinearRef,
    pub shared: Option<SharedExpert>,
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
    fn view<'a>(&self, buf: &'a ExpertBuf) -> Weight<'a> {
        let words = self.rows * affine::words_per_row(self.cols, self.spec.bits);
        let groups = self.rows * self.cols / self.spec.group_size;
        let scales = |off: usize| {
            if self.scales_f32 {
                ScaleData::F32(buf.f32s(off, groups).expect("validated alignment"))
            } else {
                ScaleData::Bf16(buf.u16s(off, groups).expect("validated alignment"))
            }
        };
        Weight::Quantized(QMatrix {
            rows: self.rows,
            cols: self.cols,
            spec: self.spec,
            packed: buf.u32s(self.weight, words).expect("validated alignment"),
            scales: scales(self.scales),
            biases: scales(self.biases),
        })
    }
}

/// Routing of a batch: per token, `k` (expert, weight) pairs in slot order.
pub struct Routing {
    pub k: usize,
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
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
            experts,
        })
    }

    /// Softmax over all experts, top-`k`, renormalised iff `norm_topk_prob`.
    pub fn route(
        &self,
        d: &DenseStore,
        c: &ModelConfig,
        xn: &[f32],
        n: usize,
        k: usize,
    ) -> Routing {
        let e = c.moe.num_experts;
        let mut logits = vec![0.0f32; n * e];
        matmul(&d.view(&self.router), xn, n, &mut logits);
        let mut experts = Vec::with_capacity(n * k);
        let mut weights = Vec::with_capacity(n * k);
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

    /// Writes the block's output for `n` normed tokens to `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        d: &DenseStore,
        c: &ModelConfig,
        store: &ExpertStore,
        bufs: &mut Vec<ExpertBuf>,
        xn: &[f32],
        n: usize,
        k: usize,
        out: &mut [f32],
        times: &mut PhaseTimes,
    ) -> Result<()> {
        let h = c.hidden_size;
        let mut clock = std::time::Instant::now();
        let routing = self.route(d, c, xn, n, k);
        lap(&mut clock, &mut times.routing);

        // Expert-major: every chosen expert once, with the (token, slot)s it serves.
        let mut users: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (i, &e) in routing.experts.iter().enumerate() {
            users.entry(e).or_default().push(i);
        }
        let ids: Vec<usize> = users.keys().copied().collect();
        let mut slot_out = vec![0.0f32; n * k * h];
        let inter = self.experts.gate.rows;
        for chunk in ids.chunks(EXPERTS_PER_READ) {
            while bufs.len() < chunk.len() {
                bufs.push(ExpertBuf::new(self.experts.extent));
            }
            for b in bufs.iter_mut() {
                if b.len() < self.experts.extent {
                    *b = ExpertBuf::new(self.experts.extent);
                }
            }
            lap(&mut clock, &mut times.expert_compute);
            store.read_experts(self.layer, chunk, &mut bufs[..chunk.len()])?;
            lap(&mut clock, &mut times.expert_io);
            for (&e, buf) in chunk.iter().zip(bufs.iter()) {
                let slots = &users[&e];
                let m = slots.len();
                let mut x = vec![0.0f32; m * h];
                for (r, &s) in slots.iter().enumerate() {
                    let t = s / k;
                    x[r * h..(r + 1) * h].copy_from_slice(&xn[t * h..(t + 1) * h]);
                }
                let mut g = vec![0.0f32; m * inter];
                let mut u = vec![0.0f32; m * inter];
                matmul(&self.experts.gate.view(buf), &x, m, &mut g);
                matmul(&self.experts.up.view(buf), &x, m, &mut u);
                let mut act = vec![0.0f32; m * inter];
                ops::swiglu(&g, &u, &mut act);
                let mut y = vec![0.0f32; m * h];
                matmul(&self.experts.down.view(buf), &act, m, &mut y);
                for (r, &s) in slots.iter().enumerate() {
                    slot_out[s * h..(s + 1) * h].copy_from_slice(&y[r * h..(r + 1) * h]);
                }
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
        if let Some(sh) = &self.shared {
            let si = sh.gate.rows;
            let mut g = vec![0.0f32; n * si];
            let mut u = vec![0.0f32; n * si];
            matmul(&d.view(&sh.gate), xn, n, &mut g);
            matmul(&d.view(&sh.up), xn, n, &mut u);
            let mut act = vec![0.0f32; n * si];
            ops::swiglu(&g, &u, &mut act);
            let mut y = vec![0.0f32; n * h];
            matmul(&d.view(&sh.down), &act, n, &mut y);
            let mut gs = vec![0.0f32; n];
            matmul(&d.view(&sh.gate_scalar), xn, n, &mut gs);
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
        Ok(())
    }
}

/// A dense SwiGLU MLP (Qwen3-Next `mlp_only_layers`).
pub struct DenseMlp {
    pub gate: LinearRef,
    pub up: LinearRef,
    pub down: LinearRef,
}

impl DenseMlp {
    pub fn load(d: &DenseStore, c: &ModelConfig, prefix: &str) -> Result<Self> {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        Ok(DenseMlp {
            gate: d.linear(&format!("{prefix}mlp.gate_proj"), i, h)?,
            up: d.linear(&format!("{prefix}mlp.up_proj"), i, h)?,
            down: d.linear(&format!("{prefix}mlp.down_proj"), h, i)?,
        })
    }

    pub fn forward(&self, d: &DenseStore, xn: &[f32], n: usize, out: &mut [f32]) {
        let i = self.gate.rows;
        let mut g = vec![0.0f32; n * i];
        let mut u = vec![0.0f32; n * i];
        matmul(&d.view(&self.gate), xn, n, &mut g);
        matmul(&d.view(&self.up), xn, n, &mut u);
        let mut act = vec![0.0f32; n * i];
        ops::swiglu(&g, &u, &mut act);
        matmul(&d.view(&self.down), &act, n, out);
    }
}
