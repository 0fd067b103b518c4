//! Elementwise and per-row f32 ops of the forward pass. Each op works on one
//! row at a time so a token's result does not depend on the batch it is in.

/// `out = x / sqrt(mean(x^2) + eps) * w` (mlx `fast.rms_norm`).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = inv_rms(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = xi * inv * wi;
    }
}

/// RMS normalisation without a weight, in place.
pub fn rms_norm_bare_inplace(x: &mut [f32], eps: f32, scale: f32) {
    let inv = inv_rms(x, eps);
    for v in x.iter_mut() {
        *v = *v * inv * scale;
    }
}

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// RMSNorm applied to each row of a `[n, width]` buffer.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let width = w.len();
    for (xr, or) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        rms_norm(xr, w, eps, or);
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)` computed without overflow (mlx `logaddexp(x, 0)`).
#[inline]
pub fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Numerically stable softmax in place.
pub fn softmax_inplace(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `out[i] = silu(gate[i]) * up[i]`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(g) * u;
    }
}

/// gpt-oss's clamped SwiGLU (mlx-lm `swiglu_oai`), in mlx's order of
/// operations: `g = min(gate, limit)`, `(clip(up, -limit, limit) + 1) * (g *
/// sigmoid(alpha * g))`.
pub fn swiglu_oai(gate: &[f32], up: &[f32], alpha: f32, limit: f32, out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        let g = g.min(limit);
        let u = u.clamp(-limit, limit);
        *o = (u + 1.0) * (g * sigmoid(alpha * g));
    }
}

pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Indices of the `k` largest values, largest first; ties go to the lower
/// index.
pub fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..x.len()).collect();
    idx.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Rotary tables for one position: `cos[i], sin[i]` of `pos * theta^(-2i/dim)`.
pub struct RopeTable {
    pub inv_freq: Vec<f64>,
}

impl RopeTable {
    pub fn new(rotary_dim: usize, theta: f64) -> Self {
        let half = rotary_dim / 2;
        let inv_freq = (0..half)
            .map(|i| theta.powf(-(2.0 * i as f64) / rotary_dim as f64))
            .collect();
        RopeTable { inv_freq }
    }

    /// Rotates the first `rotary_dim` channels of `x` (non-interleaved,
    /// "half-split" pairs `(i, i + rotary_dim/2)`) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: f64) {
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let (s, c) = (pos * f).sin_cos();
            let (s, c) = (s as f32, c as f32);
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = a * s + b * c;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_sums_to_one_and_is_stable() {
        let mut x = vec![1000.0, 1001.0, 999.0];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[0] && x[0] > x[2]);
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_index() {
        assert_eq!(top_k(&[0.1, 0.5, 0.5, 0.2], 3), vec![1, 2, 3]);
    }

    #[test]
    fn softplus_matches_definition() {
        for x in [-30.0f32, -1.0, 0.0, 1.5, 40.0] {
            let r = (1.0f64 + (x as f64).exp()).ln() as f32;
            assert!((softplus(x) - r).abs() <= 1e-6 * r.abs().max(1.0), "{x}");
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let t = RopeTable::new(8, 1e4);
        let mut x: Vec<f32> = (0..12).map(|i| i as f32 * 0.3 - 1.0).collect();
        let orig = x.clone();
        t.apply(&mut x, 0.0);
        assert_eq!(x, orig);
        t.apply(&mut x, 17.0);
        let n0: f32 = orig[..8].iter().map(|v| v * v).sum();
        let n1: f32 = x[..8].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        assert_eq!(x[8..], orig[8..]);
    }
}
