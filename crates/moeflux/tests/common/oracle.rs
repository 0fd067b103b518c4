//! The demo model against transformers (`tools/train-demo/oracle.py`): per
//! position the 64 logits the golden keeps, the full-vocabulary log-sum-exp
//! and the argmax.

use std::path::{Path, PathBuf};

use moeflux::perplexity::{perplexity, PerplexityOptions};
use moeflux::text::tokenizer::Tokenizer;
use moeflux::{LogitsMode, Session};

/// The checkout's root, found from the fixtures folder (which
/// `$MOEFLUX_FIXTURES` moves on the GPU machine).
fn checkout() -> PathBuf {
    super::fixtures().join("../..")
}

/// `models/demo`.
pub fn demo_model() -> PathBuf {
    checkout().join("models/demo")
}

/// The demo model's held-out text.
pub fn held_out_text() -> Vec<u8> {
    std::fs::read(checkout().join("tools/train-demo/heldout.txt")).unwrap()
}

pub struct Position {
    pub ids: Vec<usize>,
    pub logits: Vec<f32>,
    pub logsumexp: f64,
    pub argmax: usize,
}

pub struct Prompt {
    pub name: String,
    pub tokens: Vec<u32>,
    pub positions: Vec<Position>,
}

/// transformers' perplexity of the first `max_tokens` of the held-out text.
pub struct PerplexityRef {
    pub window: usize,
    pub stride: usize,
    pub max_tokens: usize,
    pub scored: usize,
    pub nll_per_token: f64,
}

pub struct Oracle {
    pub prompts: Vec<Prompt>,
    pub vocab: usize,
    pub held_out_sha256: String,
    /// The short perplexity run (the whole-text one is for docs/DEMO.md).
    pub perplexity: PerplexityRef,
}

impl Oracle {
    /// Loads the golden and checks it was made from this model directory.
    pub fn load(golden: &Path, model: &Path) -> Oracle {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(golden).unwrap()).unwrap();
        let manifest = std::fs::read(model.join("moeflux.json")).unwrap();
        assert_eq!(
            v["moeflux_json_sha256"].as_str().unwrap(),
            sha256_hex(&manifest),
            "{} was made from another model directory than {}",
            golden.display(),
            model.display()
        );
        let nums = |x: &serde_json::Value| -> Vec<f64> {
            x.as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_f64().unwrap())
                .collect()
        };
        let prompts = v["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| Prompt {
                name: p["name"].as_str().unwrap().to_string(),
                tokens: nums(&p["tokens"]).iter().map(|&t| t as u32).collect(),
                positions: p["positions"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|r| Position {
                        ids: nums(&r["ids"]).iter().map(|&i| i as usize).collect(),
                        logits: nums(&r["logits"]).iter().map(|&x| x as f32).collect(),
                        logsumexp: r["logsumexp"].as_f64().unwrap(),
                        argmax: r["argmax"].as_u64().unwrap() as usize,
                    })
                    .collect(),
            })
            .collect();
        let p = &v["perplexity"][0];
        let int = |k: &str| p[k].as_u64().unwrap() as usize;
        Oracle {
            prompts,
            vocab: v["vocab_size"].as_u64().unwrap() as usize,
            held_out_sha256: v["held_out_sha256"].as_str().unwrap().to_string(),
            perplexity: PerplexityRef {
                window: int("ctx"),
                stride: int("stride"),
                max_tokens: int("max_tokens"),
                scored: int("scored"),
                nll_per_token: p["nll_per_token"].as_f64().unwrap(),
            },
        }
    }

    /// Largest |logit| the golden holds (the tolerances' scale).
    pub fn max_abs(&self) -> f32 {
        self.prompts
            .iter()
            .flat_map(|p| &p.positions)
            .flat_map(|r| &r.logits)
            .fold(0.0f32, |m, x| m.max(x.abs()))
    }

    /// Runs every prompt through `session` (cleared first), as one batch or
    /// one token at a time, and checks it against the golden: max |logit -
    /// golden| and |log-sum-exp - golden| within `tol_rel * max|golden|`
    /// (and within the regression guard `guard_rel`), equal argmax wherever
    /// the golden's top-2 margin exceeds the tolerance. Returns the worst
    /// logit difference.
    pub fn check(
        &self,
        what: &str,
        session: &mut Session,
        incremental: bool,
        tol_rel: f32,
        guard_rel: f32,
    ) -> f32 {
        let tol = tol_rel * self.max_abs();
        let mut worst = 0.0f32;
        let mut worst_lse = 0.0f64;
        for p in &self.prompts {
            session.clear();
            let logits = if incremental {
                let mut rows = Vec::new();
                for &t in &p.tokens {
                    rows.extend(session.eval(&[t], LogitsMode::Last).unwrap());
                }
                rows
            } else {
                session.eval(&p.tokens, LogitsMode::All).unwrap()
            };
            assert_eq!(logits.len(), p.tokens.len() * self.vocab);
            for (t, (row, g)) in logits.chunks(self.vocab).zip(&p.positions).enumerate() {
                let d = g
                    .ids
                    .iter()
                    .zip(&g.logits)
                    .fold(0.0f32, |m, (&i, &x)| m.max((row[i] - x).abs()));
                assert!(d.is_finite(), "{what} {}: non-finite at {t}", p.name);
                worst = worst.max(d);
                worst_lse = worst_lse.max((logsumexp(row) - g.logsumexp).abs());
                let mut sorted = g.logits.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                if sorted[0] - sorted[1] > tol {
                    assert_eq!(argmax(row), g.argmax, "{what} {}: argmax at {t}", p.name);
                }
            }
        }
        eprintln!(
            "{what}: max |logit diff| = {worst:.3e}, max |logsumexp diff| = {worst_lse:.3e} \
             (tolerance {tol:.3e})"
        );
        for (name, d) in [("logit", worst as f64), ("log-sum-exp", worst_lse)] {
            assert!(d <= tol as f64, "{what}: {name} differs by {d:e} > {tol:e}");
            assert!(
                d <= (guard_rel * self.max_abs()) as f64,
                "{what}: {name} differs by {d:e}, within the {tol_rel:e} bound but above the \
                 {guard_rel:e} relative this engine achieves"
            );
        }
        worst
    }
}

impl Oracle {
    /// The held-out text, tokenized by moeflux and scored in the golden's
    /// windows, against transformers' perplexity of the same tokens on the
    /// same weights: |nll/token difference| must stay below `max_diff`.
    pub fn check_perplexity(&self, what: &str, session: &mut Session, max_diff: f64) -> f64 {
        let text = held_out_text();
        assert_eq!(
            sha256_hex(&text),
            self.held_out_sha256,
            "another held-out text"
        );
        let tok = Tokenizer::from_model_dir(demo_model()).unwrap();
        let mut tokens = tok
            .encode(std::str::from_utf8(&text).unwrap(), false)
            .unwrap();
        let r = &self.perplexity;
        tokens.truncate(r.max_tokens);
        let opts = PerplexityOptions {
            window: r.window,
            stride: r.stride,
            batch: 64,
        };
        let p = perplexity(session, &tokens, opts, None, |_, _| {}).unwrap();
        assert_eq!(p.scored, r.scored, "{what}: tokens scored");
        let d = (p.nll_per_token() - r.nll_per_token).abs();
        eprintln!(
            "{what}: perplexity {:.4} vs transformers {:.4}, |nll/token diff| = {d:.2e}",
            p.perplexity(),
            r.nll_per_token.exp()
        );
        assert!(d < max_diff, "{what}: nll/token differs by {d:e}");
        d
    }
}

fn logsumexp(row: &[f32]) -> f64 {
    let m = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    m + row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
