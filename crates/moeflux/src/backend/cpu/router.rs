//! The DeepSeek-V3 `noaux_tc` router, as mlx-lm's `group_expert_select`:
//!
//! 1. `s = sigmoid(logits)` (the unbiased scores);
//! 2. `b = s + e_score_correction_bias` — used for the choice only;
//! 3. with `n_group > 1`: each group's score is the sum of its top 2 `b`; the
//!    `n_group - topk_group` lowest groups get `b = 0.0` (mlx-lm and HF fill
//!    with 0, not -inf: the same unless surviving biased scores are negative);
//! 4. top-`k` experts by `b`;
//! 5. weights are `s` at those experts, divided by their sum when
//!    `norm_topk_prob` (and `k > 1`), times `routed_scaling_factor`.
//!
//! Ties go to the lower index (group and expert), like [`ops::top_k`].

use crate::backend::cpu::ops;

#[derive(Debug, Clone, Copy)]
pub struct NoauxTc<'a> {
    pub bias: &'a [f32],
    pub n_group: usize,
    pub topk_group: usize,
    pub k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl NoauxTc<'_> {
    /// One token's experts (in choice order) and weights from its router logits.
    pub fn route(&self, logits: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let e = logits.len();
        let scores: Vec<f32> = logits.iter().map(|&x| ops::sigmoid(x)).collect();
        let mut biased: Vec<f32> = scores.iter().zip(self.bias).map(|(s, b)| s + b).collect();
        if self.n_group > 1 {
            let per = e / self.n_group;
            let group_scores: Vec<f32> = biased
                .chunks_exact(per)
                .map(|g| {
                    let top = ops::top_k(g, 2);
                    g[top[0]] + g[top[1]]
                })
                .collect();
            let keep = ops::top_k(&group_scores, self.topk_group);
            for (gi, g) in biased.chunks_exact_mut(per).enumerate() {
                if !keep.contains(&gi) {
                    g.fill(0.0);
                }
            }
        }
        let experts = ops::top_k(&biased, self.k);
        let mut weights: Vec<f32> = experts.iter().map(|&i| scores[i]).collect();
        if self.k > 1 && self.norm_topk_prob {
            let sum: f32 = weights.iter().sum();
            for w in &mut weights {
                *w /= sum;
            }
        }
        for w in &mut weights {
            *w *= self.routed_scaling_factor;
        }
        (experts, weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    #[test]
    fn bias_chooses_but_does_not_weigh() {
        // 8 experts in 4 groups of 2, keep 2 groups, top-2.
        let probs = [0.9, 0.1, 0.5, 0.45, 0.2, 0.3, 0.6, 0.55];
        let logits: Vec<f32> = probs.iter().map(|&p| logit(p)).collect();
        let bias = [0.0f32; 8];
        // Unbiased group scores: 1.0, 0.95, 0.5, 1.15 -> groups 3 and 0.
        let r = NoauxTc {
            bias: &bias,
            n_group: 4,
            topk_group: 2,
            k: 2,
            norm_topk_prob: false,
            routed_scaling_factor: 2.5,
        };
        let (e, w) = r.route(&logits);
        assert_eq!(e, vec![0, 6]);
        assert!((w[0] - 0.9 * 2.5).abs() < 1e-5 && (w[1] - 0.6 * 2.5).abs() < 1e-5);
        // A bias on expert 5 lifts group 2 (1.2) over group 0 (1.0) and makes
        // expert 5 the top pick, yet its weight stays its unbiased score.
        let mut lifted = bias;
        lifted[5] = 0.7;
        let r = NoauxTc { bias: &lifted, ..r };
        let (e, w) = r.route(&logits);
        assert_eq!(e, vec![5, 6]);
        assert!((w[0] - 0.3 * 2.5).abs() < 1e-5 && (w[1] - 0.6 * 2.5).abs() < 1e-5);
        // Renormalised: weights sum to the scaling factor.
        let r = NoauxTc {
            norm_topk_prob: true,
            ..r
        };
        let (_, w) = r.route(&logits);
        assert!((w[0] - 2.5 * 0.3 / 0.9).abs() < 1e-5);
        assert!((w.iter().sum::<f32>() - 2.5).abs() < 1e-5);
    }

    #[test]
    fn dropped_groups_are_zero_filled_like_mlx() {
        // Group 1 (experts 2, 3) is dropped; its scores become 0.0, which beats
        // the negative biased score of expert 1 in a kept group.
        let logits = [logit(0.9), logit(0.1), logit(0.2), logit(0.2)];
        let bias = [0.0, -0.5, 0.0, 0.0];
        let r = NoauxTc {
            bias: &bias,
            n_group: 2,
            topk_group: 1,
            k: 2,
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
        };
        let (e, _) = r.route(&logits);
        assert_eq!(e, vec![0, 2]);
    }
}
