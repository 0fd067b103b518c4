//! Next-token sampling and stop strings.
//!
//! [`Sampler`] turns a logits vector into a token id. The pipeline, in this
//! order:
//!
//! 1. **penalties** over the last [`SamplerConfig::repeat_last_n`] tokens of
//!    the history: repetition (HF / llama.cpp semantics: positive logits are
//!    divided by the penalty, negative ones multiplied), then frequency
//!    (`count * frequency_penalty` subtracted) and presence (subtracted once);
//! 2. **greedy** when `temperature == 0`: the argmax, ties to the lowest id;
//! 3. **top-k**: the `k` largest logits (ties to the lowest ids);
//! 4. **temperature**, then **softmax**;
//! 5. **top-p**: the smallest set of most likely tokens whose probability
//!    reaches `top_p`;
//! 6. **min-p**: tokens below `min_p` times the top probability are dropped;
//! 7. a **draw** from what remains, with a ChaCha20 generator seeded by
//!    [`SamplerConfig::seed`].
//!
//! Determinism: the same configuration, logits and history give the same
//! token on every run and platform. Candidate order is a strict total order
//! (logit descending, then id ascending) so no step depends on how a sort
//! or selection algorithm breaks ties; the softmax uses a portable `exp`
//! built from IEEE basic operations only (no libm), probabilities are summed
//! in `f64` in a fixed order, and each non-greedy token consumes exactly one
//! 64-bit word of the ChaCha20 stream. Greedy sampling consumes none.
//!
//! NaN logits are treated as `-inf` (never sampled). If no token has a
//! finite logit after penalties the sampler falls back to the argmax rule:
//! the lowest id holding the largest value, i.e. the first `+inf` if any, or
//! id 0 when every logit is `-inf`/NaN.
//!
//! [`StopStrings`] watches streamed text for stop strings, holding back any
//! tail that may still grow into one.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use rand_chacha::ChaCha20Rng;
use rand_core::{RngCore, SeedableRng};
use serde::{Deserialize, Serialize};

/// Sampling parameters. `Default` is greedy decoding with no penalties.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplerConfig {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; `0` = off.
    pub top_k: usize,
    /// Nucleus sampling mass in `(0, 1]`; `1` = off.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p` times the most likely
    /// token's, in `[0, 1]`; `0` = off.
    pub min_p: f32,
    /// Repetition penalty (> 0); `1` = off. For tokens seen in the window,
    /// positive logits are divided by it and negative ones multiplied.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token present in the window;
    /// `0` = off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per occurrence in the window;
    /// `0` = off.
    pub frequency_penalty: f32,
    /// How many of the most recent history tokens the penalties look at
    /// (`0` disables every penalty; `usize::MAX` = the whole history).
    pub repeat_last_n: usize,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplerConfig {
    /// Checks every parameter's range; the message names the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(format!(
                "temperature must be a finite number >= 0 (0 = greedy), got {t}"
            ));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(format!("top_p must be in (0, 1] (1 = off), got {p}"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(format!("min_p must be in [0, 1] (0 = off), got {m}"));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(format!(
                "repetition_penalty must be a finite number > 0 (1 = off), got {r}"
            ));
        }
        if !self.presence_penalty.is_finite() {
            return Err(format!(
                "presence_penalty must be finite, got {}",
                self.presence_penalty
            ));
        }
        if !self.frequency_penalty.is_finite() {
            return Err(format!(
                "frequency_penalty must be finite, got {}",
                self.frequency_penalty
            ));
        }
        Ok(())
    }

    /// True when sampling always takes the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Applies the repetition, frequency and presence penalties to `logits`
    /// in place, as [`Sampler::sample`] does first (NaN logits are left as
    /// they are here).
    pub fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        if self.has_penalties() {
            apply_penalties(logits, history, self, &mut Vec::new());
        }
    }

    fn has_penalties(&self) -> bool {
        self.repeat_last_n > 0
            && (self.repetition_penalty != 1.0
                || self.presence_penalty != 0.0
                || self.frequency_penalty != 0.0)
    }
}

/// A candidate token during sampling.
#[derive(Debug, Clone, Copy)]
struct Cand {
    id: u32,
    logit: f32,
    /// Unnormalised probability `exp((logit - max) / T)`.
    p: f64,
}

/// Strict total order: larger logit first, then smaller id.
fn best_first(a: &Cand, b: &Cand) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
}

/// Heap entry for top-k selection; the heap's maximum is the *worst* kept
/// candidate (lowest logit, then highest id).
#[derive(Clone, Copy)]
struct Worst(Cand);

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Worst {}
impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Worst {
    fn cmp(&self, other: &Self) -> Ordering {
        best_first(&self.0, &other.0)
    }
}

#[inline]
fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Index of the largest value (NaN as `-inf`), ties to the lowest index;
/// 0 when every value is NaN.
/// The index of the first of the largest values (NaN never wins; 0 when
/// nothing beats -inf): greedy sampling's pick.
pub(crate) fn argmax(logits: &[f32]) -> usize {
    // Two simple passes vectorise; NaN never wins a `>` comparison.
    let max = logits
        .iter()
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    logits.iter().position(|&x| x == max).unwrap_or(0)
}

/// `exp(x)` for `x <= 0` from IEEE basic operations only, so it gives the
/// same bits on every platform (libm's `exp` may differ in the last ulp),
/// and branch-free so loops over it vectorise. Relative error ~1e-15;
/// `x < -708` (including `-inf` and NaN) gives 0.
#[inline(always)]
pub(crate) fn portable_exp(x: f64) -> f64 {
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    // Adding then subtracting 1.5 * 2^52 rounds to the nearest integer.
    const SHIFTER: f64 = 6_755_399_441_055_744.0;
    const INV: [f64; 13] = [
        1.0 / 13.0,
        1.0 / 12.0,
        1.0 / 11.0,
        1.0 / 10.0,
        1.0 / 9.0,
        1.0 / 8.0,
        1.0 / 7.0,
        1.0 / 6.0,
        1.0 / 5.0,
        1.0 / 4.0,
        1.0 / 3.0,
        1.0 / 2.0,
        1.0,
    ];
    let in_range = x > -708.0; // false for NaN
    let xc = if in_range {
        if x < 0.0 {
            x
        } else {
            0.0
        }
    } else {
        -708.0
    };
    let shifted = xc * std::f64::consts::LOG2_E + SHIFTER;
    let k = shifted - SHIFTER;
    let ki = shifted.to_bits().wrapping_sub(SHIFTER.to_bits());
    let r = (xc - k * LN2_HI) - k * LN2_LO;
    // Taylor series to r^13 on |r| <= ln2/2 (truncation error < 1e-17),
    // Horner form: 1 + r(1 + r/2(1 + r/3(... (1 + r/13)))).
    let mut poly = 1.0;
    for inv in INV {
        poly = 1.0 + poly * r * inv;
    }
    let scale = f64::from_bits(ki.wrapping_add(1023) << 52);
    if in_range {
        poly * scale
    } else {
        0.0
    }
}

/// Sum in a fixed order (8 interleaved partial sums, then combined in a
/// fixed tree), so it vectorises and still gives the same bits everywhere.
fn fixed_order_sum(v: &[f64]) -> f64 {
    let mut acc = [0.0f64; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j];
        }
    }
    for (j, &x) in rest.iter().enumerate() {
        acc[j] += x;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Turns logits into token ids; see the module docs for the pipeline.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha20Rng,
    /// Penalised copy of the logits (only when penalties are on).
    scratch: Vec<f32>,
    /// Unnormalised probabilities of the whole vocabulary (no top-k).
    probs: Vec<f64>,
    cands: Vec<Cand>,
    window: Vec<u32>,
}

fn rng_for(seed: u64) -> ChaCha20Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    ChaCha20Rng::from_seed(key)
}

/// A uniform draw in [0, 1) from 53 random bits.
fn uniform(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Draws from `pool` (unnormalised, in the given order) with `u` in [0, 1).
fn draw(pool: &[Cand], u: f64) -> u32 {
    let sum = pool.iter().fold(0.0f64, |a, c| a + c.p);
    let r = u * sum;
    let mut acc = 0.0f64;
    for c in pool {
        acc += c.p;
        if r < acc {
            return c.id;
        }
    }
    // Unreachable unless rounding: the last candidate with mass.
    pool.iter().rev().find(|c| c.p > 0.0).unwrap_or(&pool[0]).id
}

impl Sampler {
    /// A sampler for `cfg`. Call [`SamplerConfig::validate`] first for a
    /// clear error: out-of-range values are not rejected here (a
    /// temperature < 0 behaves as greedy, top_p outside (0, 1) as off).
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = rng_for(cfg.seed);
        Sampler {
            cfg,
            rng,
            scratch: Vec::new(),
            probs: Vec::new(),
            cands: Vec::new(),
            window: Vec::new(),
        }
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Whether every pick is the argmax of the logits as given (temperature
    /// 0, no penalties): then [`crate::LogitsMode::Greedy`] picks the same
    /// token where the logits are.
    pub fn is_greedy(&self) -> bool {
        let t = self.cfg.temperature;
        (t.is_nan() || t <= 0.0) && !self.cfg.has_penalties()
    }

    /// Restarts the random stream from `seed` (as a new sampler would).
    pub fn reseed(&mut self, seed: u64) {
        self.cfg.seed = seed;
        self.rng = rng_for(seed);
    }

    /// Picks the next token from `logits` (one per vocabulary entry).
    /// `history` is the token sequence so far (prompt included); only its
    /// last `repeat_last_n` tokens matter, and only for penalties. Ids in
    /// the history beyond the vocabulary are ignored.
    ///
    /// Cost for a 248k vocabulary: a few hundred microseconds with top-k;
    /// without top-k every probability is computed (~1 ms), and top-p then
    /// sorts only the tokens above a probability threshold that is lowered
    /// until their mass suffices.
    ///
    /// # Panics
    /// If `logits` is empty or longer than `u32::MAX`.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        assert!(!logits.is_empty(), "Sampler::sample: empty logits");
        assert!(
            logits.len() <= u32::MAX as usize,
            "Sampler::sample: vocabulary too large"
        );
        let Sampler {
            cfg,
            rng,
            scratch,
            probs,
            cands,
            window,
        } = self;
        let logits: &[f32] = if cfg.has_penalties() && !history.is_empty() {
            scratch.clear();
            scratch.extend(logits.iter().map(|&x| clean(x)));
            apply_penalties(scratch, history, cfg, window);
            scratch
        } else {
            logits
        };

        // A NaN temperature (not validated) is greedy too.
        if cfg.temperature.is_nan() || cfg.temperature <= 0.0 {
            return argmax(logits) as u32;
        }
        let n = logits.len();
        let max = logits
            .iter()
            .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        if max.is_infinite() {
            // Nothing finite to draw from: the argmax rule (module docs).
            return argmax(logits) as u32;
        }
        let inv_t = 1.0 / cfg.temperature as f64;
        let max = max as f64;
        let p_of = |l: f32| portable_exp((l as f64 - max) * inv_t);
        let top_p = (cfg.top_p > 0.0 && cfg.top_p < 1.0).then_some(cfg.top_p as f64);
        let min_p = cfg.min_p as f64;

        cands.clear();
        if cfg.top_k > 0 && cfg.top_k < n {
            // Top-k: a bounded heap, then sort the k best.
            let k = cfg.top_k;
            let mut heap: BinaryHeap<Worst> = BinaryHeap::with_capacity(k + 1);
            for (i, &x) in logits.iter().enumerate() {
                // NaN and -inf are never candidates.
                if x.is_nan() || x == f32::NEG_INFINITY {
                    continue;
                }
                let c = Cand {
                    id: i as u32,
                    logit: x,
                    p: 0.0,
                };
                if heap.len() < k {
                    heap.push(Worst(c));
                } else if best_first(&c, &heap.peek().expect("k > 0").0) == Ordering::Less {
                    heap.pop();
                    heap.push(Worst(c));
                }
            }
            cands.extend(heap.into_iter().map(|w| w.0));
            cands.sort_unstable_by(best_first);
            for c in cands.iter_mut() {
                c.p = p_of(c.logit);
            }
            let mut keep = cands.len();
            if let Some(tp) = top_p {
                let total = cands.iter().fold(0.0f64, |a, c| a + c.p);
                keep = prefix_reaching(cands, tp * total);
            }
            // Sorted: min-p keeps a prefix; the top (p = 1) always stays.
            keep = cands[..keep].partition_point(|c| c.p >= min_p).max(1);
            return draw(&cands[..keep], uniform(rng));
        }

        // Whole vocabulary: every probability, in a vectorisable pass.
        probs.clear();
        probs.extend(logits.iter().map(|&l| p_of(l)));
        match top_p {
            None => {
                // Draw in id order among tokens at or above min-p.
                let (sum, u) = if min_p > 0.0 {
                    let s = probs
                        .iter()
                        .fold(0.0f64, |a, &p| if p >= min_p { a + p } else { a });
                    (s, uniform(rng))
                } else {
                    (fixed_order_sum(probs), uniform(rng))
                };
                let r = u * sum;
                let mut acc = 0.0f64;
                let mut last = None;
                for (i, &p) in probs.iter().enumerate() {
                    if p > 0.0 && p >= min_p {
                        acc += p;
                        last = Some(i);
                        if r < acc {
                            return i as u32;
                        }
                    }
                }
                last.unwrap_or_else(|| argmax(logits)) as u32
            }
            Some(tp) => {
                // The nucleus is a prefix of the best-first order, so it lies
                // within {p >= tau} once that set holds the target mass.
                let target = tp * fixed_order_sum(probs);
                let mut tau = 1.0 / 1024.0;
                loop {
                    cands.clear();
                    let mut mass = 0.0f64;
                    for (i, &p) in probs.iter().enumerate() {
                        if p >= tau && p > 0.0 {
                            mass += p;
                            cands.push(Cand {
                                id: i as u32,
                                logit: logits[i],
                                p,
                            });
                        }
                    }
                    if mass >= target || tau == 0.0 {
                        break;
                    }
                    tau = if tau < 1e-300 { 0.0 } else { tau / 1024.0 };
                }
                cands.sort_unstable_by(best_first);
                let keep = prefix_reaching(cands, target);
                let keep = cands[..keep].partition_point(|c| c.p >= min_p).max(1);
                draw(&cands[..keep], uniform(rng))
            }
        }
    }
}

/// Window counts and the three penalties, in place.
fn apply_penalties(l: &mut [f32], history: &[u32], cfg: &SamplerConfig, window: &mut Vec<u32>) {
    let start = history.len().saturating_sub(cfg.repeat_last_n);
    window.clear();
    window.extend_from_slice(&history[start..]);
    window.sort_unstable();
    let mut i = 0;
    while i < window.len() {
        let id = window[i];
        let mut j = i + 1;
        while j < window.len() && window[j] == id {
            j += 1;
        }
        let count = (j - i) as f32;
        i = j;
        let Some(x) = l.get_mut(id as usize) else {
            continue;
        };
        if cfg.repetition_penalty != 1.0 {
            if *x > 0.0 {
                *x /= cfg.repetition_penalty;
            } else {
                *x *= cfg.repetition_penalty;
            }
        }
        *x -= count * cfg.frequency_penalty + cfg.presence_penalty;
    }
}

/// Length of the shortest prefix of `c` whose probability sum reaches
/// `mass` (all of `c` if none does).
fn prefix_reaching(c: &[Cand], mass: f64) -> usize {
    let mut cum = 0.0;
    for (i, x) in c.iter().enumerate() {
        cum += x.p;
        if cum >= mass {
            return i + 1;
        }
    }
    c.len()
}

/// Detects stop strings in streamed text.
///
/// Feed generated text with [`push`](Self::push); it returns the text that
/// is safe to show now and whether a stop string was hit. Text that could
/// still become (part of) a stop string is held back. When a stop string is
/// found, the text before it is returned and the stop string and anything
/// after it are dropped; later pushes return nothing. Call
/// [`finish`](Self::finish) at the end of generation to flush what was held.
///
/// Matching is independent of how the text is split into chunks: the result
/// is what a search of the whole text would give, with the stop string that
/// *starts* earliest winning.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    hit: bool,
    /// Which stop string was hit (an index into `stops`).
    matched: Option<usize>,
}

impl StopStrings {
    /// Empty strings in `stops` are ignored.
    pub fn new(stops: Vec<String>) -> StopStrings {
        StopStrings {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            hit: false,
            matched: None,
        }
    }

    /// True when there are no stop strings (everything passes through).
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Whether a stop string has been hit.
    pub fn is_hit(&self) -> bool {
        self.hit
    }

    /// The stop string that was hit (the earliest in the text; of two at
    /// the same place, the shorter, which completed first).
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// The text held back so far (a possible start of a stop string).
    pub fn held(&self) -> &str {
        &self.held
    }

    /// Adds `chunk`; returns (text safe to emit now, stop string hit).
    pub fn push(&mut self, chunk: &str) -> (String, bool) {
        if self.hit {
            return (String::new(), true);
        }
        if self.stops.is_empty() {
            return (chunk.to_string(), false);
        }
        self.held.push_str(chunk);
        let buf = std::mem::take(&mut self.held);
        let full = self.first_match(&buf);
        let partial = self.first_partial(&buf);
        match (full, partial) {
            (Some((p, i)), q) if q.is_none_or(|q| p <= q) => {
                self.hit = true;
                self.matched = Some(i);
                let mut buf = buf;
                buf.truncate(p);
                (buf, true)
            }
            (_, Some(q)) => {
                self.held = buf[q..].to_string();
                let mut buf = buf;
                buf.truncate(q);
                (buf, false)
            }
            (_, None) => (buf, false),
        }
    }

    /// End of the text: flushes what was held back (cut at a stop string
    /// if one is complete in it).
    pub fn finish(&mut self) -> String {
        if self.hit {
            self.held.clear();
            return String::new();
        }
        let mut buf = std::mem::take(&mut self.held);
        if let Some((p, i)) = self.first_match(&buf) {
            self.hit = true;
            self.matched = Some(i);
            buf.truncate(p);
        }
        buf
    }

    /// Start of the earliest complete stop string in `buf`, and its index
    /// (the shorter of two that start there).
    fn first_match(&self, buf: &str) -> Option<(usize, usize)> {
        self.stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| buf.find(s.as_str()).map(|p| (p, s.len(), i)))
            .min()
            .map(|(p, _, i)| (p, i))
    }

    /// Earliest position whose tail is a proper prefix of a stop string.
    fn first_partial(&self, buf: &str) -> Option<usize> {
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let from = buf.len().saturating_sub(longest.saturating_sub(1));
        (from..buf.len()).find(|&q| {
            buf.is_char_boundary(q) && {
                let tail = &buf.as_bytes()[q..];
                self.stops
                    .iter()
                    .any(|s| s.len() > tail.len() && s.as_bytes().starts_with(tail))
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn portable_exp_matches_std() {
        let mut x = -750.0f64;
        while x <= 0.0 {
            let a = portable_exp(x);
            if x > -708.0 {
                let b = x.exp();
                assert!(((a - b) / b).abs() < 4e-15, "x={x} {a} vs {b}");
            } else {
                assert_eq!(a, 0.0, "x={x}");
            }
            x += 0.01337;
        }
        assert_eq!(portable_exp(0.0), 1.0);
        assert_eq!(portable_exp(f64::NEG_INFINITY), 0.0);
        assert_eq!(portable_exp(f64::NAN), 0.0);
        assert_eq!(portable_exp(-1.0), 0.36787944117144233);
    }
}
