//! What every synthetic tensor holds, and the random streams it is drawn
//! from.
//!
//! Quantized weights have uniformly random codes (random bytes are uniform
//! codes at any width) with one scale per tensor,
//! `s = gain / sqrt(cols * (4^bits - 1) / 12)`, and the centring bias
//! `-(2^bits - 1)/2 * s`: a matmul then maps unit-variance inputs to
//! outputs of variance `gain^2`. Norm weights are 1 (q/k norms included),
//! so every layer's inputs are unit-RMS. Attention biases (GLM's q/k/v
//! `.bias`) are small, U(-1/4, 1/4) (standard deviation 0.14 against the
//! projections' unit one). The `noaux_tc` router's correction bias is 0,
//! so its choice is the router logits' (where the skew below lives; any
//! constant would choose the same). The projections that write into the
//! residual stream have a gain of `sqrt(RESIDUAL_GAIN2 / depth)` so that
//! the stream grows from the embedding's unit variance to about
//! `1 + RESIDUAL_GROWTH` over the full depth: no layer explodes or
//! vanishes, logits are O(1).
//!
//! Hidden dimension 0 is reserved for the router skew: every embedding row
//! holds the same value `c0` there, and the residual writers' row 0 is
//! zero, so `x[0] = c0` for every token at every layer. Each layer's
//! `post_attention_layernorm` weight at dimension 0 cancels the expected
//! growth of the stream's RMS, making the router input's dimension 0 about
//! 1; the router's weight on it is then the expert's logit offset
//! (`skew.rs`), stored in the row's first quantization group (whose other
//! 63 weights are zero).
//!
//! Random streams: the bytes of a stream are produced in 4 KiB blocks, each
//! by its own wyrand generator seeded from (stream key, block index). Any
//! range can be produced on its own, so the output depends on the seed and
//! the tensor names only, not on the thread count or the work split, and a
//! layer's tensors do not depend on how many layers are written.

use half::bf16;

use crate::config::QuantSpec;
use crate::convert::plan::{DEFAULT_BITS, DEFAULT_GROUP_SIZE, GATE_BITS};

use super::skew;

/// Bytes per independently seeded block of a random stream.
const BLOCK: usize = 4096;

/// Gain^2 of the residual writers, times the depth. Calibrated so that the
/// stream's variance grows by about `RESIDUAL_GROWTH` over the full depth
/// (each branch's nonlinearities and gates shrink what it adds).
const RESIDUAL_GAIN2: f32 = 2.0;
/// Growth of the residual stream's variance over the full depth (relative
/// to the embedding's 1), assumed linear in the layer index: measured 0.8
/// on the qwen3.6-35b-a3b shapes (0.02 per layer).
const RESIDUAL_GROWTH: f32 = 0.8;

/// Half-width of the uniform attention biases (q/k/v `.bias`).
const ATTENTION_BIAS: f32 = 0.25;

/// splitmix64's finalizer: a bijective 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key of the random stream called `name` under `seed`.
pub fn stream_key(seed: u64, name: &str) -> u64 {
    // FNV-1a of the name, started from the mixed seed.
    let mut h = 0xcbf2_9ce4_8422_2325 ^ mix(seed);
    for b in name.bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    mix(h)
}

/// wyrand: one multiply per 8 bytes, good statistical quality.
struct WyRand(u64);

impl WyRand {
    fn new(key: u64, block: u64) -> Self {
        WyRand(mix(key ^ mix(block.wrapping_add(0x9e37_79b9_7f4a_7c15))))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.0) * u128::from(self.0 ^ 0xe703_7ed1_a0b4_28db);
        (t >> 64) as u64 ^ t as u64
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u32 << 24) as f32
    }

    fn fill(&mut self, out: &mut [u8]) {
        for c in out.chunks_exact_mut(8) {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
    }
}

/// Bytes `[offset, offset + out.len())` of the random stream `key`.
pub fn fill_random(key: u64, offset: u64, out: &mut [u8]) {
    let mut pos = 0;
    while pos < out.len() {
        let abs = offset + pos as u64;
        let skip = (abs % BLOCK as u64) as usize;
        let n = (BLOCK - skip).min(out.len() - pos);
        let mut rng = WyRand::new(key, abs / BLOCK as u64);
        let dst = &mut out[pos..pos + n];
        if n == BLOCK {
            rng.fill(dst);
        } else {
            let mut tmp = [0u8; BLOCK];
            rng.fill(&mut tmp);
            dst.copy_from_slice(&tmp[skip..skip + n]);
        }
        pos += n;
    }
}

/// `n` uniform values in [0, 1) from the stream `key`.
fn uniforms(key: u64, n: usize) -> impl Iterator<Item = f32> {
    let mut rng = WyRand::new(key, 0);
    (0..n).map(move |_| rng.unit())
}

/// Sets code `j` of a packed row (LSB-first bitstream; 2, 4 and 8-bit codes
/// never straddle a byte).
fn set_code(row: &mut [u8], j: usize, bits: u32, code: u8) {
    let bit = j * bits as usize;
    let mask = ((1u16 << bits) - 1) as u8;
    let shift = bit % 8;
    row[bit / 8] = (row[bit / 8] & !(mask << shift)) | ((code & mask) << shift);
}

fn bf16_bytes(x: f32) -> [u8; 2] {
    bf16::from_f32(x).to_le_bytes()
}

/// Variance of a uniformly random `bits`-bit code.
fn code_variance(bits: u32) -> f32 {
    ((1u64 << (2 * bits)) - 1) as f32 / 12.0
}

/// The per-tensor scale for a matmul of gain `gain` over `cols` inputs and
/// its centring bias, both rounded to bf16 as stored.
fn scale_bias(gain: f32, cols: usize, bits: u32) -> (f32, f32) {
    let s = bf16::from_f32(gain / (cols as f32 * code_variance(bits)).sqrt()).to_f32();
    let half_range = ((1u32 << bits) - 1) as f32 / 2.0;
    (s, bf16::from_f32(-half_range * s).to_f32())
}

/// Mean square of the e2m1 values over uniformly random codes.
const E2M1_MEAN_SQUARE: f32 = 8.5625;

/// The power-of-two MXFP4 scale nearest (in log) to gain `gain` over
/// `cols` inputs with uniformly random codes.
fn mxfp4_scale(gain: f32, cols: usize) -> f32 {
    let s = gain / (cols as f32 * E2M1_MEAN_SQUARE).sqrt();
    s.log2().round().exp2()
}

/// Layer index of a `model.layers.N.` tensor name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Model-wide parameters of the fill rules.
pub struct Init {
    pub seed: u64,
    /// Layers of the full model (per-layer values do not depend on truncation).
    pub depth: usize,
    pub hidden: usize,
    pub experts_per_token: usize,
    pub num_experts: usize,
    /// Zipf exponent of the router skew.
    pub skew: Option<f64>,
}

/// How one quantized matrix is filled.
pub struct LinearInit {
    pub spec: QuantSpec,
    key: u64,
    scale: f32,
    bias: f32,
    /// Row 0 all zero (residual writers: keeps hidden dimension 0 constant).
    zero_row0: bool,
    /// Column 0 at the top code (the embedding's constant component).
    top_col0: bool,
    /// Per-row weight of column 0, alone in its group (the router skew).
    col0: Option<Vec<f32>>,
}

impl Init {
    fn residual_gain(&self) -> f32 {
        (RESIDUAL_GAIN2 / self.depth as f32).sqrt()
    }

    /// The embedding's scale and bias (4-bit, unit element variance) and
    /// `c0`, the value of its column 0 in every row.
    fn embedding(&self) -> (f32, f32, f32) {
        let (s, b) = scale_bias(1.0, 1, DEFAULT_BITS);
        let top = ((1 << DEFAULT_BITS) - 1) as f32;
        (s, b, top * s + b)
    }

    /// Dense linear layer `module` with `cols` inputs.
    pub fn linear(&self, module: &str, cols: usize) -> LinearInit {
        let router = module.ends_with("mlp.gate") || module.ends_with("mlp.router");
        let gate = router || module.ends_with("shared_expert_gate");
        // mlx-lm's quant_predicate: router and shared-expert gate at 8 bits.
        let bits = if gate { GATE_BITS } else { DEFAULT_BITS };
        let key = stream_key(self.seed, module);
        let residual = ["o_proj", "out_proj", "down_proj"]
            .iter()
            .any(|s| module.ends_with(s));
        let (scale, bias) = match module {
            "model.embed_tokens" => {
                let (s, b, _) = self.embedding();
                (s, b)
            }
            _ if residual => scale_bias(self.residual_gain(), cols, bits),
            _ => scale_bias(1.0, cols, bits),
        };
        let col0 = match (router, self.skew, layer_of(module)) {
            (true, Some(alpha), Some(layer)) => Some(self.router_col0(layer, alpha, scale, bits)),
            _ => None,
        };
        LinearInit {
            spec: QuantSpec::affine(bits, DEFAULT_GROUP_SIZE),
            key,
            scale,
            bias,
            zero_row0: residual,
            top_col0: module == "model.embed_tokens",
            col0,
        }
    }

    /// Projection `component` of expert `expert` of `layer`, `bits` wide.
    pub fn expert(
        &self,
        layer: usize,
        expert: usize,
        component: &str,
        cols: usize,
        spec: QuantSpec,
    ) -> LinearInit {
        let down = component == "down_proj";
        let gain = if down { self.residual_gain() } else { 1.0 };
        let (scale, bias) = if spec.is_mxfp4() {
            (mxfp4_scale(gain, cols), 0.0)
        } else {
            scale_bias(gain, cols, spec.bits)
        };
        LinearInit {
            spec,
            key: stream_key(
                self.seed,
                &format!("model.layers.{layer}.mlp.switch_mlp.{component}.{expert}"),
            ),
            scale,
            bias,
            zero_row0: down,
            top_col0: false,
            col0: None,
        }
    }

    /// Router weights on hidden dimension 0 (which is about 1 at the router):
    /// the logit offsets of a Zipf(`alpha`) popularity over a seeded random
    /// ranking of the layer's experts.
    fn router_col0(&self, layer: usize, alpha: f64, scale: f32, bits: u32) -> Vec<f32> {
        let n = self.num_experts;
        // Fisher-Yates: rank[e] = popularity rank of expert e.
        let mut rank: Vec<usize> = (0..n).collect();
        let mut rng = WyRand::new(
            stream_key(self.seed, &format!("model.layers.{layer}.mlp.gate.rank")),
            0,
        );
        for i in (1..n).rev() {
            rank.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        // The token-dependent part of a logit: the other groups' weights
        // against unit-RMS inputs.
        let sigma = ((self.hidden - DEFAULT_GROUP_SIZE) as f64 * code_variance(bits) as f64).sqrt()
            * scale as f64;
        skew::router_offsets(&rank, self.experts_per_token, alpha, sigma)
    }

    /// A float vector: `A_log` (stored F32), `dt_bias`, attention biases,
    /// the router's correction bias (stored F32), norm weights.
    pub fn vector(&self, name: &str, len: usize) -> Vec<f32> {
        let key = stream_key(self.seed, name);
        if name.ends_with("A_log") {
            // A ~ U(1, 16) as in the reference initialisation (U(0, 16)).
            return uniforms(key, len).map(|u| (1.0 + 15.0 * u).ln()).collect();
        }
        if name.ends_with("dt_bias") {
            return uniforms(key, len).map(|u| 2.0 * u - 1.0).collect();
        }
        if name.ends_with("_proj.bias") {
            return uniforms(key, len)
                .map(|u| ATTENTION_BIAS * (2.0 * u - 1.0))
                .collect();
        }
        // The correction bias (noaux_tc) and gpt-oss's router bias are 0,
        // so the choice is the router logits' (where the skew lives); the
        // attention sinks start at mlx-lm's 0.
        if name.ends_with("e_score_correction_bias")
            || name.ends_with("mlp.router.bias")
            || name.ends_with("self_attn.sinks")
        {
            return vec![0.0; len];
        }
        let mut v = vec![1.0; len];
        if let (true, Some(layer)) = (
            name.ends_with("post_attention_layernorm.weight"),
            layer_of(name),
        ) {
            // RMS of the residual stream at this point, relative to the embedding's.
            let t = (layer as f32 + 0.5) / self.depth as f32;
            v[0] = (1.0 + RESIDUAL_GROWTH * t).sqrt() / self.embedding().2;
        }
        v
    }

    /// The depthwise conv1d weight `[channels, kernel, 1]`: U(-a, a) with
    /// variance 1/kernel, so the conv keeps unit variance.
    pub fn conv(&self, name: &str, channels: usize, kernel: usize) -> Vec<f32> {
        let a = (3.0 / kernel as f32).sqrt();
        uniforms(stream_key(self.seed, name), channels * kernel)
            .map(|u| a * (2.0 * u - 1.0))
            .collect()
    }
}

impl LinearInit {
    /// Packed code bytes of one row.
    pub fn row_bytes(&self, cols: usize) -> usize {
        cols * self.spec.bits as usize / 8
    }

    /// A whole MXFP4 matrix: uniformly random e2m1 codes, one e8m0 scale
    /// for every group (row 0 all zero codes where `zero_row0`).
    pub fn fill_mxfp4(&self, cols: usize, codes: &mut [u8], scales: &mut [u8]) {
        fill_random(self.key, 0, codes);
        if self.zero_row0 {
            codes[..cols / 2].fill(0);
        }
        // 2^(e - 127) = scale; the scale is a power of two by construction.
        let e = (self.scale.log2().round() as i32 + 127).clamp(1, 254) as u8;
        scales.fill(e);
    }

    /// Rows `r0..` (as many as `codes` holds): packed codes, and bf16
    /// scales and biases (one per group of 64).
    pub fn fill(
        &self,
        cols: usize,
        r0: usize,
        codes: &mut [u8],
        scales: &mut [u8],
        biases: &mut [u8],
    ) {
        let rb = self.row_bytes(cols);
        let bits = self.spec.bits;
        let top = ((1u32 << bits) - 1) as u8;
        let mid = 1u8 << (bits - 1);
        fill_random(self.key, (r0 * rb) as u64, codes);
        let groups = cols / self.spec.group_size;
        let sb = [bf16_bytes(self.scale), bf16_bytes(self.bias)];
        for (i, row) in codes.chunks_exact_mut(rb).enumerate() {
            let r = r0 + i;
            let s_row = &mut scales[i * groups * 2..(i + 1) * groups * 2];
            let b_row = &mut biases[i * groups * 2..(i + 1) * groups * 2];
            let [s, b] = if self.zero_row0 && r == 0 {
                [[0; 2]; 2]
            } else {
                sb
            };
            for (sc, bc) in s_row.chunks_exact_mut(2).zip(b_row.chunks_exact_mut(2)) {
                sc.copy_from_slice(&s);
                bc.copy_from_slice(&b);
            }
            if self.top_col0 {
                set_code(row, 0, bits, top);
            }
            if let Some(col0) = &self.col0 {
                // Group 0: weight w at column 0, zeros elsewhere: codes
                // mid + round(w / s0) and mid, bias -mid * s0 (exact in bf16).
                let w = col0[r];
                let s0 = bf16::from_f32((w.abs() / (mid - 1) as f32).max(1e-6)).to_f32();
                let q = (w / s0).round().clamp(-f32::from(mid), f32::from(mid - 1));
                for j in 1..self.spec.group_size {
                    set_code(row, j, bits, mid);
                }
                set_code(row, 0, bits, (f32::from(mid) + q) as u8);
                s_row[..2].copy_from_slice(&bf16_bytes(s0));
                b_row[..2].copy_from_slice(&bf16_bytes(-f32::from(mid) * s0));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_split_independent() {
        let key = stream_key(7, "t");
        let mut whole = vec![0u8; 3 * BLOCK + 100];
        fill_random(key, 0, &mut whole);
        let mut parts = vec![0u8; whole.len()];
        for (a, b) in [(0, 5), (5, 4096), (4096, 9000), (9000, whole.len())] {
            fill_random(key, a as u64, &mut parts[a..b]);
        }
        assert_eq!(whole, parts);
        let mut other = vec![0u8; whole.len()];
        fill_random(stream_key(8, "t"), 0, &mut other);
        assert_ne!(whole, other);
        // Roughly uniform bytes.
        let mean = whole.iter().map(|&b| b as f64).sum::<f64>() / whole.len() as f64;
        assert!((mean - 127.5).abs() < 3.0, "{mean}");
    }

    #[test]
    fn codes_land_where_mlx_reads_them() {
        for (j, bits, code, want) in [
            (1, 4, 0xf, [0xf0, 0, 0, 0]),
            (5, 2, 0x3, [0, 0x0c, 0, 0]),
            (3, 8, 0xab, [0, 0, 0, 0xab]),
        ] {
            let mut row = [0u8; 4];
            set_code(&mut row, j, bits, code);
            assert_eq!(row, want, "{bits}-bit code {j}");
        }
    }

    #[test]
    fn unit_gain() {
        for bits in [2, 4, 8] {
            let (s, b) = scale_bias(1.0, 1024, bits);
            let var = 1024.0 * code_variance(bits) * s * s;
            assert!((var - 1.0).abs() < 0.01, "{bits}: {var}");
            let top = ((1u32 << bits) - 1) as f32;
            // Code 0 and the top code are symmetric about 0 (up to bf16 rounding).
            assert!((top * s + b + b).abs() < 0.01 * top * s, "centred");
        }
    }
}
