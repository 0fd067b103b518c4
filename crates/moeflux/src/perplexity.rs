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
        ..Default::default()
    };
    for w in plan {
        session.clear();
        let mut at = w.begin;
        while at < w.end {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Err(Error::Cancelled);
            }
            let upto = (at + batch).min(w.end);
            let logits = session.eval(&tokens[at..upto], LogitsMode::All)?;
            for (row, pos) in logits.chunks_exact(vocab).zip(at..upto) {
                let target = pos + 1;
                if target >= w.first && target < w.end {
                    out.nll += log_sum_exp(row) - row[tokens[target] as usize] as f64;
                    out.scored += 1;
                }
            }
            at = upto;
            progress(out.scored, total);
        }
    }
    Ok(out)
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
