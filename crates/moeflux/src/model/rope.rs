//! Rotary embedding tables. Qwen and GLM rotate half-split pairs `(i, i +
//! rotary_dim/2)` of the first `rotary_dim` channels of each head; the
//! DeepSeek-V3 family rotates interleaved pairs `(2i, 2i+1)`, optionally
//! YaRN-scaled, exactly as mlx-lm's `YarnRoPE` (`rope_utils.py`) and
//! `DeepseekV3Attention` compute it. Two factors come out of YaRN:
//!
//! - the rotation's magnitude `mscale = get_mscale(factor, mscale) /
//!   get_mscale(factor, mscale_all_dim)`, which mlx multiplies into the
//!   rotated channels of q and k (1.0 for DeepSeek-V3, where both are 1);
//! - the attention softmax scale `q_head_dim^-0.5 * m^2`, `m = 0.1 *
//!   mscale_all_dim * ln(factor) + 1` when `mscale_all_dim` is set and
//!   `factor > 1` (1.874x for DeepSeek-V3's factor 40; the original moeflux
//!   left this out).
//!
//! Angles are computed in f64 (long contexts lose precision in f32).

use crate::config::{MlaConfig, RopeConfig, YarnConfig};

/// `yarn_get_mscale` of mlx-lm.
fn get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// A model's rotary table.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Angle per position of pair `i`.
    pub inv_freq: Vec<f64>,
    /// Magnitude multiplier of the rotated channels (YaRN; 1 otherwise).
    pub mscale: f32,
    /// Position multiplier (`linear` scaling).
    pub position_scale: f64,
    /// Pairs `(2i, 2i+1)` rather than `(i, i + rotary_dim/2)`.
    pub interleaved: bool,
}

impl Rope {
    pub fn new(rope: &RopeConfig) -> Self {
        let interleaved = rope.interleaved;
        let dims = rope.rotary_dim;
        let half = dims / 2;
        let base = rope.theta;
        let plain: Vec<f64> = (0..half)
            .map(|i| base.powf(-(2.0 * i as f64) / dims as f64))
            .collect();
        let Some(y) = rope.yarn else {
            return Rope {
                inv_freq: plain,
                mscale: 1.0,
                position_scale: rope.position_scale,
                interleaved,
            };
        };
        let (low, high) = correction_range(&y, dims, base);
        let inv_freq = plain
            .iter()
            .enumerate()
            .map(|(i, &extra)| {
                // mlx: freq_mask = 1 - ramp; inverse frequency = mask / freq_extra +
                // (1 - mask) / freq_inter with freq_inter = factor * freq_extra.
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                (1.0 - ramp) * extra + ramp * extra / y.factor
            })
            .collect();
        Rope {
            inv_freq,
            mscale: (get_mscale(y.factor, y.mscale) / get_mscale(y.factor, y.mscale_all_dim))
                as f32,
            position_scale: rope.position_scale,
            interleaved,
        }
    }

    /// Rotates the first `2 * inv_freq.len()` channels of `x` in place for
    /// position `pos`, both channels of a pair scaled by `mscale`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let p = pos as f64 * self.position_scale;
        let half = self.inv_freq.len();
        for (i, &f) in self.inv_freq.iter().enumerate() {
            let (s, c) = (p * f).sin_cos();
            let (s, c) = (s as f32, c as f32);
            let (ia, ib) = if self.interleaved {
                (2 * i, 2 * i + 1)
            } else {
                (i, i + half)
            };
            let (a, b) = (x[ia] * self.mscale, x[ib] * self.mscale);
            x[ia] = a * c - b * s;
            x[ib] = a * s + b * c;
        }
    }
}

/// `yarn_find_correction_range`: the first and last pair index of the ramp
/// between extrapolated and interpolated frequencies (`high` nudged when equal).
fn correction_range(y: &YarnConfig, dims: usize, base: f64) -> (f64, f64) {
    let corr_dim = |rotations: f64| {
        dims as f64
            * (y.original_max_position_embeddings / (rotations * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let low = corr_dim(y.beta_fast).floor().max(0.0);
    let high = corr_dim(y.beta_slow).ceil().min(dims as f64 - 1.0);
    if low == high {
        (low, high + 0.001)
    } else {
        (low, high)
    }
}

/// The attention softmax scale of `DeepseekV3Attention`.
pub fn softmax_scale(mla: &MlaConfig, rope: &RopeConfig) -> f32 {
    let mut scale = (mla.q_head_dim() as f64).powf(-0.5);
    if let Some(y) = rope.yarn {
        if y.mscale_all_dim != 0.0 && y.factor > 1.0 {
            let m = 0.1 * y.mscale_all_dim * y.factor.ln() + 1.0;
            scale *= m * m;
        }
    }
    scale as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rope(yarn: Option<YarnConfig>) -> RopeConfig {
        RopeConfig {
            theta: 10_000.0,
            rotary_dim: 64,
            position_scale: 1.0,
            interleaved: true,
            yarn,
        }
    }

    fn deepseek_yarn() -> YarnConfig {
        YarnConfig {
            factor: 40.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: 1.0,
            mscale_all_dim: 1.0,
        }
    }

    #[test]
    fn deepseek_v3_values() {
        // DeepSeek-V3: dims 64, base 1e4, factor 40 -> ramp from pair 10 to 23
        // (floor 10.2 / ceil 22.4 of the correction dims), mscale 1, softmax
        // scale 192^-0.5 * (0.1 ln 40 + 1)^2.
        let y = deepseek_yarn();
        assert_eq!(correction_range(&y, 64, 1e4), (10.0, 23.0));
        let r = Rope::new(&rope(Some(y)));
        assert_eq!(r.mscale, 1.0);
        assert_eq!(r.inv_freq[0], 1.0);
        let plain = Rope::new(&rope(None));
        for i in 0..=10 {
            assert_eq!(r.inv_freq[i], plain.inv_freq[i], "pair {i} is extrapolated");
        }
        for i in 23..32 {
            let want = plain.inv_freq[i] / 40.0;
            assert!(
                (r.inv_freq[i] - want).abs() <= 1e-15 * want,
                "pair {i} is interpolated"
            );
        }
        let mla = MlaConfig {
            q_lora_rank: Some(1536),
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
        };
        let m = 0.1 * 40f64.ln() + 1.0;
        let want = (m * m / 192f64.sqrt()) as f32;
        assert_eq!(softmax_scale(&mla, &rope(Some(y))), want);
        assert!((want * 192f32.sqrt() - 1.8738).abs() < 1e-3);
        assert_eq!(
            softmax_scale(&mla, &rope(None)),
            (1.0 / 192f64.sqrt()) as f32
        );
    }

    #[test]
    fn interleaved_pairs_and_mscale() {
        let mut y = deepseek_yarn();
        y.mscale_all_dim = 0.5;
        let r = Rope::new(&rope(Some(y)));
        let ms = ((0.1 * 40f64.ln() + 1.0) / (0.05 * 40f64.ln() + 1.0)) as f32;
        assert_eq!(r.mscale, ms);
        let mut x = vec![0.0f32; 64];
        x[0] = 1.0;
        r.apply(&mut x, 0);
        assert_eq!(x[0], ms);
        assert!(x[1..].iter().all(|&v| v == 0.0));
        // Pair 0 turns by one radian per position: channel 1 is its partner.
        let mut x = vec![0.0f32; 64];
        x[0] = 1.0;
        r.apply(&mut x, 1);
        assert!((x[0] - ms * 1f32.cos()).abs() < 1e-6 && (x[1] - ms * 1f32.sin()).abs() < 1e-6);
        assert!(x[2..].iter().all(|&v| v == 0.0));
    }
}
