//! Per-sequence state: a KV cache per full-attention layer, a latent cache per
//! MLA layer and a conv + recurrent state per GatedDeltaNet layer.

/// Keys and values of one full-attention layer, row `p` = position `p`,
/// each row `[kv_heads * head_dim]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Floats per row.
    pub row: usize,
}

impl KvCache {
    pub fn new(row: usize) -> Self {
        KvCache {
            k: Vec::new(),
            v: Vec::new(),
            row,
        }
    }
    pub fn len(&self) -> usize {
        self.k.len() / self.row
    }
    pub fn is_empty(&self) -> bool {
        self.k.is_empty()
    }
    pub fn truncate(&mut self, n: usize) {
        self.k.truncate(n * self.row);
        self.v.truncate(n * self.row);
    }
}

/// The cache of one MLA layer (DeepSeek-V3), row `p` = position `p`: the
/// normalised KV latent `[kv_lora_rank]` and the rotated key part shared by all
/// heads `[qk_rope_head_dim]`. Keys and values of every head are recovered from
/// the latent (absorbed into the query / output, or decompressed for a batch).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MlaCache {
    pub latent: Vec<f32>,
    pub rope: Vec<f32>,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
}

impl MlaCache {
    pub fn new(kv_lora_rank: usize, rope_dim: usize) -> Self {
        MlaCache {
            latent: Vec::new(),
            rope: Vec::new(),
            kv_lora_rank,
            rope_dim,
        }
    }
    pub fn len(&self) -> usize {
        self.latent.len() / self.kv_lora_rank
    }
    pub fn is_empty(&self) -> bool {
        self.latent.is_empty()
    }
    pub fn truncate(&mut self, n: usize) {
        self.latent.truncate(n * self.kv_lora_rank);
        self.rope.truncate(n * self.rope_dim);
    }
}

/// State of one GatedDeltaNet layer: the last `kernel-1` conv inputs
/// `[kernel-1][conv_dim]` and the recurrent state `[v_heads][v_dim][k_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearState {
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    Full(KvCache),
    Linear(LinearState),
    Mla(MlaCache),
}

/// The whole model's state for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelState {
    pub layers: Vec<LayerState>,
}

impl ModelState {
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Full(kv) => kv.truncate(0),
                LayerState::Mla(m) => m.truncate(0),
                LayerState::Linear(s) => {
                    s.conv.fill(0.0);
                    s.ssm.fill(0.0);
                }
            }
        }
    }

    pub fn has_linear_layers(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l, LayerState::Linear(_)))
    }

    /// Copies of the GatedDeltaNet states, in layer order.
    pub fn linear_states(&self) -> Vec<LinearState> {
        self.layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Linear(s) => Some(s.clone()),
                LayerState::Full(_) | LayerState::Mla(_) => None,
            })
            .collect()
    }

    /// Truncates the KV caches to `n` rows and installs `linear` states.
    pub fn rewind(&mut self, n: usize, linear: &[LinearState]) {
        let mut it = linear.iter();
        for l in &mut self.layers {
            match l {
                LayerState::Full(kv) => kv.truncate(n),
                LayerState::Mla(m) => m.truncate(n),
                LayerState::Linear(s) => {
                    s.clone_from(it.next().expect("one state per linear layer"))
                }
            }
        }
    }
}
