//! Router skew: per-expert logit offsets that make expert popularity follow
//! a Zipf law, to emulate the routing locality of trained models.
//!
//! Model of the router: expert `e`'s logit for a token is `b_e + sigma*z`
//! with `z` ~ N(0, 1) independent across experts and tokens (a random
//! router row applied to a random unit-RMS hidden state), and top-k keeps
//! the `k` largest. In the mean-field view the k-th largest logit sits at a
//! fixed threshold `T`, so `e` is chosen with probability
//! `f_e = Phi((b_e - T) / sigma)`. Choosing the target frequencies `f_e`
//! (summing to `k`) and setting `b_e = sigma * Phi^-1(f_e)` (T = 0, the sum
//! makes it consistent) gives those frequencies, up to the fluctuation of
//! the threshold from token to token, which flattens the curve a little.

/// Highest target frequency: an expert picked by nearly every token.
const MAX_FREQ: f64 = 0.99;

/// How often each popularity rank (index 0 = most popular) should be chosen
/// per token under Zipf(`alpha`) with top-`k` of `n` experts:
/// `f_r = min(MAX_FREQ, c / (r+1)^alpha)` with `c` such that the `f_r` sum
/// to `k` (a token chooses `k` distinct experts, so no rank can exceed 1:
/// the head of the law is clipped and the rest keeps its shape).
pub fn zipf_frequencies(n: usize, k: usize, alpha: f64) -> Vec<f64> {
    let f = |c: f64| -> Vec<f64> {
        (1..=n)
            .map(|r| (c * (r as f64).powf(-alpha)).min(MAX_FREQ))
            .collect()
    };
    if k as f64 >= n as f64 * MAX_FREQ {
        return vec![k as f64 / n as f64; n]; // every expert always chosen
    }
    // The sum grows with c: bisect (in log space, c spans many decades).
    let (mut lo, mut hi) = (1e-12f64, 1e12f64);
    for _ in 0..200 {
        let mid = (lo * hi).sqrt();
        if f(mid).iter().sum::<f64>() < k as f64 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    f(hi)
}

/// Router logit offsets by expert: expert `e` has popularity rank
/// `rank[e]` (0-based) and target frequency `zipf_frequencies(..)[rank]`;
/// `sigma` is the standard deviation of the token-dependent part of a
/// router logit.
pub fn router_offsets(rank: &[usize], k: usize, alpha: f64, sigma: f64) -> Vec<f32> {
    let f = zipf_frequencies(rank.len(), k, alpha);
    rank.iter()
        .map(|&r| (sigma * probit(f[r])) as f32)
        .collect()
}

/// The standard normal quantile `Phi^-1(p)` for `0 < p < 1` (Abramowitz and
/// Stegun 26.2.23, absolute error below 4.5e-4: plenty for a calibration).
fn probit(p: f64) -> f64 {
    let tail = |q: f64| {
        let t = (-2.0 * q.ln()).sqrt();
        t - (2.515517 + 0.802853 * t + 0.010328 * t * t)
            / (1.0 + 1.432788 * t + 0.189269 * t * t + 0.001308 * t * t * t)
    };
    if p < 0.5 {
        -tail(p)
    } else {
        tail(1.0 - p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        assert!((probit(0.975) - 1.96).abs() < 1e-3);
        assert!((probit(0.5)).abs() < 1e-3);
        assert!((probit(0.01) + 2.326).abs() < 1e-3);
    }

    #[test]
    fn zipf_sums_to_k_and_keeps_its_shape() {
        let f = zipf_frequencies(256, 8, 1.0);
        assert!((f.iter().sum::<f64>() - 8.0).abs() < 1e-6);
        assert_eq!(f[0], MAX_FREQ);
        // Below the clipped head, frequency ~ 1/rank.
        assert!((f[9] / f[19] - 2.0).abs() < 1e-9);
        let u = zipf_frequencies(64, 4, 0.0);
        assert!(u.iter().all(|&x| (x - 4.0 / 64.0).abs() < 1e-9));
        assert_eq!(zipf_frequencies(4, 4, 1.0), vec![1.0; 4]);
    }

    #[test]
    fn offsets_follow_rank() {
        let rank = [2, 0, 1, 3];
        let b = router_offsets(&rank, 1, 1.0, 1.0);
        assert!(b[1] > b[2] && b[2] > b[0] && b[0] > b[3]);
    }
}
