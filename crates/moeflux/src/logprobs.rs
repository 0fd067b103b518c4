//! Log-probabilities of a logits vector: the sampled token's and the most
//! likely tokens', as an OpenAI-style server reports them.
//!
//! The values are `log_softmax(logits)` in `f64`: `logit - max - ln(sum
//! exp(logit - max))`, the sum taken with the sampler's portable `exp` in a
//! fixed order, so they are the same on every platform but for `ln`. The
//! most likely tokens come in the sampler's strict order (logit descending,
//! then id ascending), found in one pass with a bounded sorted buffer: the
//! vocabulary is never sorted.
//!
//! Non-finite logits: NaN counts as `-inf` (as in the sampler). A `-inf`
//! logit (a masked token) has log-probability `-inf`. If some logits are
//! `+inf`, those share the whole mass (each `-ln(count)`) and every other
//! token is `-inf`; if every logit is `-inf` or NaN, every log-probability
//! is `-inf`.

use crate::sample::portable_exp;

/// Most alternatives [`token_logprobs`] reports per position (OpenAI's
/// `top_logprobs` limit).
pub const MAX_TOP: usize = 20;

/// One generated token's log-probability and the most likely tokens at its
/// position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token that was picked.
    pub id: u32,
    pub logprob: f64,
    /// The `top` most likely tokens `(id, logprob)`, most likely first
    /// (ties: lower id first); `min(top, vocabulary)` of them.
    pub top: Vec<(u32, f64)>,
}

#[inline]
fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// How the log-probabilities of one logits vector are computed from a
/// logit: `logit - shift`, with the special cases of the module docs.
#[derive(Debug, Clone, Copy)]
enum Norm {
    /// Finite maximum: `logprob = logit - shift` (`-inf` stays `-inf`).
    Finite { shift: f64 },
    /// Some logits are `+inf`: they get `-ln(count)`, the rest `-inf`.
    Infinite { each: f64 },
    /// Nothing but `-inf`/NaN.
    Empty,
}

impl Norm {
    fn of(logits: &[f32]) -> Norm {
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        if max == f32::INFINITY {
            let n = logits.iter().filter(|&&x| x == f32::INFINITY).count();
            return Norm::Infinite {
                each: -(n as f64).ln(),
            };
        }
        if max == f32::NEG_INFINITY {
            return Norm::Empty;
        }
        let max = max as f64;
        // Eight interleaved partial sums, combined in a fixed tree: the same
        // bits everywhere, and the loop vectorises.
        let mut acc = [0.0f64; 8];
        let chunks = logits.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for j in 0..8 {
                acc[j] += portable_exp(c[j] as f64 - max);
            }
        }
        for (j, &x) in rest.iter().enumerate() {
            acc[j] += portable_exp(x as f64 - max);
        }
        let sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        // sum >= 1 (the maximum contributes exp(0)), so ln is finite.
        Norm::Finite {
            shift: max + sum.ln(),
        }
    }

    fn logprob(self, logit: f32) -> f64 {
        let x = clean(logit);
        match self {
            Norm::Finite { shift } => x as f64 - shift,
            Norm::Infinite { each } if x == f32::INFINITY => each,
            _ => f64::NEG_INFINITY,
        }
    }
}

/// The `k` best ids of `logits` in the sampler's order (logit descending,
/// NaN as `-inf`, then id ascending), in one pass: a sorted buffer of at
/// most `k` entries that a logit enters only when it beats the worst kept.
fn top_ids(logits: &[f32], k: usize) -> Vec<u32> {
    let k = k.min(logits.len());
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return Vec::new();
    }
    for (i, &x) in logits.iter().enumerate() {
        let x = clean(x);
        // Ids come in ascending order, so an equal logit never beats a kept
        // one: strict comparisons keep ties to the lower id.
        if best.len() == k && x <= best[k - 1].0 {
            continue;
        }
        let at = best.partition_point(|&(y, _)| y >= x);
        best.insert(at, (x, i as u32));
        best.truncate(k);
    }
    best.into_iter().map(|(_, id)| id).collect()
}

/// The log-probability of `chosen` and of the `top` most likely tokens
/// under `log_softmax(logits)` (`top` is capped at [`MAX_TOP`]). One pass
/// for the normaliser, one for the top tokens; nothing vocabulary-sized is
/// allocated.
///
/// # Panics
/// If `chosen` is not an index of `logits`.
pub fn token_logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprobs {
    let norm = Norm::of(logits);
    let top = top_ids(logits, top.min(MAX_TOP))
        .into_iter()
        .map(|id| (id, norm.logprob(logits[id as usize])))
        .collect();
    TokenLogprobs {
        id: chosen,
        logprob: norm.logprob(logits[chosen as usize]),
        top,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: log-softmax in f64 with std's `exp`/`ln`, and the
    /// top ids by a full sort.
    fn direct(logits: &[f32]) -> (Vec<f64>, Vec<u32>) {
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let lse = max
            + logits
                .iter()
                .map(|&x| (x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let lp = logits.iter().map(|&x| x as f64 - lse).collect();
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|&a, &b| {
            clean(logits[b as usize])
                .total_cmp(&clean(logits[a as usize]))
                .then(a.cmp(&b))
        });
        (lp, ids)
    }

    /// A deterministic pseudo-random vector (xorshift), values in
    /// [-scale, scale), rounded to `1/4` when `coarse` so that ties occur.
    fn logits(n: usize, seed: u64, scale: f32, coarse: bool) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f32 / (1u64 << 53) as f32;
                let x = (u * 2.0 - 1.0) * scale;
                if coarse {
                    (x * 4.0).round() / 4.0
                } else {
                    x
                }
            })
            .collect()
    }

    #[test]
    fn matches_a_direct_f64_computation() {
        for (n, seed, scale, coarse) in [
            (1, 1, 3.0, false),
            (7, 2, 3.0, false),
            (1000, 3, 20.0, false),
            (4099, 4, 60.0, false),
            (500, 5, 2.0, true),
        ] {
            let l = logits(n, seed, scale, coarse);
            let (lp, ids) = direct(&l);
            for top in [0, 1, 5, 20] {
                let chosen = (seed as u32 * 31) % n as u32;
                let got = token_logprobs(&l, chosen, top);
                assert_eq!(got.id, chosen);
                assert!((got.logprob - lp[chosen as usize]).abs() < 1e-12);
                let want: Vec<u32> = ids.iter().copied().take(top.min(n)).collect();
                let got_ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
                assert_eq!(got_ids, want, "n={n} top={top}");
                for &(id, v) in &got.top {
                    assert!((v - lp[id as usize]).abs() < 1e-12, "n={n} id={id}");
                }
            }
            // The probabilities sum to 1.
            let total: f64 = (0..n as u32)
                .map(|i| token_logprobs(&l, i, 0).logprob.exp())
                .sum();
            assert!((total - 1.0).abs() < 1e-12, "n={n}: {total}");
        }
    }

    #[test]
    fn ties_go_to_the_lower_id() {
        let l = [1.0, 3.0, 2.0, 3.0, 3.0, 2.0];
        let got = token_logprobs(&l, 0, 5);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 4, 2, 5]);
        assert_eq!(got.top[0].1, got.top[2].1);
        let got = token_logprobs(&[0.5; 30], 7, 20);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, (0..20).collect::<Vec<u32>>());
        assert!((got.logprob + 30f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn top_is_capped_by_the_limit_and_the_vocabulary() {
        let l = logits(100, 9, 5.0, false);
        assert_eq!(token_logprobs(&l, 0, 50).top.len(), MAX_TOP);
        assert_eq!(token_logprobs(&l[..3], 0, 20).top.len(), 3);
    }

    #[test]
    fn masked_and_nan_logits() {
        let ninf = f32::NEG_INFINITY;
        // A mask: -inf tokens get -inf and come last; the rest normalise
        // among themselves.
        let l = [ninf, 1.0, f32::NAN, 1.0, ninf];
        let got = token_logprobs(&l, 0, 5);
        assert_eq!(got.logprob, f64::NEG_INFINITY);
        let ids: Vec<u32> = got.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0, 2, 4]);
        assert!((got.top[0].1 + 2f64.ln()).abs() < 1e-15);
        assert!(got.top[2..].iter().all(|t| t.1 == f64::NEG_INFINITY));
        // Everything masked.
        let got = token_logprobs(&[ninf, f32::NAN], 1, 2);
        assert_eq!(got.logprob, f64::NEG_INFINITY);
        assert_eq!(got.top, [(0, f64::NEG_INFINITY), (1, f64::NEG_INFINITY)]);
        // +inf takes all the mass.
        let inf = f32::INFINITY;
        let got = token_logprobs(&[inf, 5.0, inf, f32::NAN], 2, 3);
        assert!((got.logprob + 2f64.ln()).abs() < 1e-15);
        assert_eq!(
            got.top,
            [(0, -(2f64.ln())), (2, -(2f64.ln())), (1, f64::NEG_INFINITY)]
        );
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let got = token_logprobs(&[1000.0, 1000.0, -1000.0], 0, 1);
        assert!((got.logprob + 2f64.ln()).abs() < 1e-12);
        assert_eq!(got.top[0].0, 0);
    }
}
