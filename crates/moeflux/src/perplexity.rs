//! Perplexity of a token sequence, in windows as Hugging Face's
//! fixed-length-model recipe cuts them (and `tools/train-demo/ppl.py`, so the
//! two agree token for token).
//!
//! Windows of `window` tokens start every `stride` tokens; each scores the
//! tokens no earlier window scored, except its own first, which has no
//! context. With `stride == window` the windows do not overlap and each
//! scores `window - 1` tokens; a smaller stride gives later windows more
//! context at more compute.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};
use crate::session::{LogitsMode, Session};

#[derive(Debug, Clone, Copy)]
pub struct PerplexityOptions {
    /// Tokens per window (the context each prediction can see at most).
    pub window: usize,
    /// Tokens between window starts, `1..=window`.
    pub stride: usize,
    /// Tokens per `eval` call inside a window (bounds the logits held at
    /// once: `batch * vocab` floats).
    pub batch: usize,
}

/// One window: evaluate `[begin, end)`, score the tokens `[first, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub begin: usize,
    pub end: usize,
    pub first: usize,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Perplexity {
    /// Tokens in the text.
    pub tokens: usize,
    /// Tokens predicted and scored.
    pub scored: usize,
    /// Sum of -ln p(token | context) over the scored tokens.
    pub nll: f64,
    /// With a reference session: how far this session's predictions are
    /// from the reference's.
    pub reference: Option<Divergence>,
}

/// This session's next-token distributions `q` against a reference
/// session's `p` at the same scored positions.
#[derive(Debug, Clone, Copy, Default)]
pub struct Divergence {
    /// The reference's sum of -ln p(token | context).
    pub nll: f64,
    /// Sum and largest of KL(p || q) in nats.
    pub kl_sum: f64,
    pub kl_max: f64,
    /// Positions where both put the same token first.
    pub same_top: usize,
}

impl Perplexity {
    pub fn nll_per_token(&self) -> f64 {
        self.nll / self.scored as f64
    }

    pub fn perplexity(&self) -> f64 {
        self.nll_per_token().exp()
    }
}

/// The windows over `n` tokens.
pub fn windows(n: usize, window: usize, stride: usize) -> Vec<Window> {
    let mut out = Vec::new();
    let mut scored_to = 1;
    let mut begin = 0;
    while begin < n {
        let end = (begin + window).min(n);
        let first = (begin + 1).max(scored_to);
        if first < end {
            out.push(Window { begin, end, first });
        }
        scored_to = end;
        if end == n {
            break;
        }
        begin += stride;
    }
    out
}

/// Scores `tokens` with `session` (cleared before each window and left
/// holding the last). `progress(scored, total)` is called after each batch.
pub fn perplexity(
    session: &mut Session,
    tokens: &[u32],
    opts: PerplexityOptions,
    cancel: Option<&AtomicBool>,
    progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    score(session, None, tokens, opts, cancel, progress)
}

/// [`perplexity`], with `reference` (a session over the same model, e.g.
/// on the CPU with exact activations) evaluating the same windows, and
/// [`Perplexity::reference`] comparing the two distributions.
pub fn perplexity_against(
    session: &mut Session,
    reference: &mut Session,
    tokens: &[u32],
    opts: PerplexityOptions,
    cancel: Option<&AtomicBool>,
    progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    if reference.vocab_size() != session.vocab_size() {
        return Err(Error::Invalid(format!(
            "the reference session has a vocabulary of {} tokens, this one {}",
            reference.vocab_size(),
            session.vocab_size()
        )));
    }
    score(session, Some(reference), tokens, opts, cancel, progress)
}

fn score(
    session: &mut Session,
    mut reference: Option<&mut Session>,
    tokens: &[u32],
    opts: PerplexityOptions,
    cancel: Option<&AtomicBool>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Perplexity> {
    let PerplexityOptions {
        window,
        stride,
        batch,
    } = opts;
    if window < 2 {
        return Err(Error::Invalid(format!(
            "the window must hold at least 2 tokens (got {window})"
        )));
    }
    if stride == 0 || stride > window {
        return Err(Error::Invalid(format!(
            "the stride must be between 1 and the window ({window}), got {stride}"
        )));
    }
    if batch == 0 {
        return Err(Error::Invalid("the batch must be at least 1 token".into()));
    }
    if window > session.max_context() {
        return Err(Error::Invalid(format!(
            "a window of {window} tokens exceeds the session's context of {}",
            session.max_context()
        )));
    }
    if tokens.len() < 2 {
        return Err(Error::Invalid(format!(
            "perplexity needs at least 2 tokens, the text has {}",
            tokens.len()
        )));
    }
    let vocab = session.vocab_size();
    let plan = windows(tokens.len(), window, stride);
    let total: usize = plan.iter().map(|w| w.end - w.first).sum();
    let mut out = Perplexity {
        tokens: tokens.len(),
        reference: reference.as_ref().map(|_| Divergence::default()),
        ..Default::default()
    };
    for w in plan {
        session.clear();
        if let Some(r) = reference.as_deref_mut() {
            r.clear();
        }
        let mut at = w.begin;
        while at < w.end {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(Error::Cancelled);
            }
            let upto = (at + batch).min(w.end);
            let logits = session.eval(&tokens[at..upto], LogitsMode::All)?;
            let ref_logits = match reference.as_deref_mut() {
                Some(r) => Some(r.eval(&tokens[at..upto], LogitsMode::All)?),
                None => None,
            };
            for (i, (row, pos)) in logits.chunks_exact(vocab).zip(at..upto).enumerate() {
                let target = pos + 1;
                if target >= w.first && target < w.end {
                    let token = tokens[target] as usize;
                    out.nll += log_sum_exp(row) - row[token] as f64;
                    out.scored += 1;
                    if let (Some(d), Some(p)) = (out.reference.as_mut(), &ref_logits) {
                        let p = &p[i * vocab..(i + 1) * vocab];
                        d.nll += log_sum_exp(p) - p[token] as f64;
                        let kl = kl_divergence(p, row);
                        d.kl_sum += kl;
                        d.kl_max = d.kl_max.max(kl);
                        d.same_top += usize::from(argmax(p) == argmax(row));
                    }
                }
            }
            at = upto;
            progress(out.scored, total);
        }
    }
    Ok(out)
}

/// KL(softmax(p) || softmax(q)) in nats, in f64.
fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_sum_exp(p), log_sum_exp(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let la = a as f64 - lp;
            la.exp() * (la - (b as f64 - lq))
        })
        .sum::<f64>()
        .max(0.0)
}

fn argmax(row: &[f32]) -> usize {
    row.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv {
                (i, v)
            } else {
                (bi, bv)
            }
        })
        .0
}

fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    max + row
        .iter()
        .map(|&x| (x as f64 - max).exp())
        .sum::<f64>()
        .ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(begin: usize, end: usize, first: usize) -> Window {
        Window { begin, end, first }
    }

    #[test]
    fn kl_is_zero_for_equal_rows_and_matches_a_hand_computed_value() {
        let p = [1.0f32, 2.0, 0.5];
        assert!(kl_divergence(&p, &p).abs() < 1e-12);
        // Shifting every logit changes no probability.
        let shifted: Vec<f32> = p.iter().map(|v| v + 3.0).collect();
        assert!(kl_divergence(&p, &shifted) < 1e-12);
        let q = [0.0f32, 0.0, 0.0];
        let z: f64 = p.iter().map(|&v| (v as f64).exp()).sum();
        let want: f64 = p
            .iter()
            .map(|&v| {
                let pi = (v as f64).exp() / z;
                pi * (pi * 3.0).ln()
            })
            .sum();
        assert!((kl_divergence(&p, &q) - want).abs() < 1e-12);
        assert_eq!(argmax(&p), 1);
    }

    #[test]
    fn disjoint_windows_skip_each_first_token() {
        assert_eq!(windows(10, 4, 4), vec![w(0, 4, 1), w(4, 8, 5), w(8, 10, 9)]);
    }

    #[test]
    fn overlapping_windows_score_every_token_once() {
        let plan = windows(10, 4, 2);
        assert_eq!(plan, vec![w(0, 4, 1), w(2, 6, 4), w(4, 8, 6), w(6, 10, 8)]);
        let scored: usize = plan.iter().map(|w| w.end - w.first).sum();
        assert_eq!(scored, 9);
    }

    #[test]
    fn a_window_longer_than_the_text_is_one_window() {
        assert_eq!(windows(5, 512, 512), vec![w(0, 5, 1)]);
        assert_eq!(windows(1, 4, 4), vec![]);
    }

    #[test]
    fn each_token_is_scored_at_most_once_and_only_window_starts_are_skipped() {
        for n in [2, 7, 33, 100] {
            for window in [2, 3, 8, 16] {
                for stride in 1..=window {
                    let plan = windows(n, window, stride);
                    let mut hits = vec![0; n];
                    for x in &plan {
                        assert!(x.begin < x.first && x.first < x.end && x.end <= n);
                        assert!(x.end - x.begin <= window);
                        for h in &mut hits[x.first..x.end] {
                            *h += 1;
                        }
                    }
                    // Overlapping windows leave no gap; disjoint ones skip
                    // each window's first token, which has no context.
                    for (t, &h) in hits.iter().enumerate() {
                        let window_start = stride == window && t % window == 0;
                        let want = usize::from(t > 0 && !window_start);
                        assert_eq!(h, want, "n {n} window {window} stride {stride} token {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn log_sum_exp_is_stable() {
        let v = log_sum_exp(&[1000.0, 1000.0]);
        assert!((v - (1000.0 + 2f64.ln())).abs() < 1e-9);
    }
}
