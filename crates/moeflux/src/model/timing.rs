//! Wall time per phase of the forward pass, accumulated across evals.

use std::time::{Duration, Instant};

/// (display name, key) of each phase, in pipeline order.
const PHASE_NAMES: [(&str, &str); 8] = [
    ("embed+norms", "embed_norms"),
    ("attention", "attention"),
    ("routing", "routing"),
    ("expert I/O wait", "expert_io_wait"),
    ("expert compute", "expert_compute"),
    ("shared expert/MLP", "shared_mlp"),
    ("LM head", "lm_head"),
    ("GPU step (CUDA graph)", "gpu_graph"),
];

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    /// Embedding lookup and RMSNorms.
    pub embed_norm: Duration,
    /// Full attention and GatedDeltaNet layers (projections included).
    pub attention: Duration,
    /// Router matmul, softmax and top-K.
    pub routing: Duration,
    /// Waiting for routed-expert reads.
    pub expert_io: Duration,
    /// Routed-expert SwiGLU and the weighted combination.
    pub expert_compute: Duration,
    /// Shared expert and dense MLP layers.
    pub shared_mlp: Duration,
    /// Final norm and LM head.
    pub lm_head: Duration,
    /// A whole decode step replayed as one CUDA graph (its phases cannot be
    /// told apart).
    pub gpu_graph: Duration,
}

impl PhaseTimes {
    pub fn total(&self) -> Duration {
        self.embed_norm
            + self.attention
            + self.routing
            + self.expert_io
            + self.expert_compute
            + self.shared_mlp
            + self.lm_head
            + self.gpu_graph
    }

    /// The time spent since an `earlier` reading of the same counters.
    pub fn minus(&self, earlier: &PhaseTimes) -> PhaseTimes {
        PhaseTimes {
            embed_norm: self.embed_norm.saturating_sub(earlier.embed_norm),
            attention: self.attention.saturating_sub(earlier.attention),
            routing: self.routing.saturating_sub(earlier.routing),
            expert_io: self.expert_io.saturating_sub(earlier.expert_io),
            expert_compute: self.expert_compute.saturating_sub(earlier.expert_compute),
            shared_mlp: self.shared_mlp.saturating_sub(earlier.shared_mlp),
            lm_head: self.lm_head.saturating_sub(earlier.lm_head),
            gpu_graph: self.gpu_graph.saturating_sub(earlier.gpu_graph),
        }
    }

    /// Counters summed with `other`'s.
    pub fn plus(&self, other: &PhaseTimes) -> PhaseTimes {
        PhaseTimes {
            embed_norm: self.embed_norm + other.embed_norm,
            attention: self.attention + other.attention,
            routing: self.routing + other.routing,
            expert_io: self.expert_io + other.expert_io,
            expert_compute: self.expert_compute + other.expert_compute,
            shared_mlp: self.shared_mlp + other.shared_mlp,
            lm_head: self.lm_head + other.lm_head,
            gpu_graph: self.gpu_graph + other.gpu_graph,
        }
    }

    /// `(name, duration)` pairs in pipeline order, for reports.
    pub fn phases(&self) -> [(&'static str, Duration); 8] {
        let d = self.durations();
        std::array::from_fn(|i| (PHASE_NAMES[i].0, d[i]))
    }

    /// `(key, duration)` pairs in pipeline order, keys in snake case for
    /// machine-readable output.
    pub fn keyed(&self) -> [(&'static str, Duration); 8] {
        let d = self.durations();
        std::array::from_fn(|i| (PHASE_NAMES[i].1, d[i]))
    }

    fn durations(&self) -> [Duration; 8] {
        [
            self.embed_norm,
            self.attention,
            self.routing,
            self.expert_io,
            self.expert_compute,
            self.shared_mlp,
            self.lm_head,
            self.gpu_graph,
        ]
    }
}

/// Adds the time since `*t` to `slot` and restarts `*t`.
#[inline]
pub fn lap(t: &mut Instant, slot: &mut Duration) {
    let now = Instant::now();
    *slot += now - *t;
    *t = now;
}
