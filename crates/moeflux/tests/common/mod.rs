//! Shared helpers for tests that run converted fixtures.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use moeflux::convert::{convert, ConvertOptions};
use moeflux::{LogitsMode, Session, SessionOptions};

pub mod oracle;

/// `tests/fixtures`; `$MOEFLUX_FIXTURES` overrides it where the test binary
/// runs away from its source tree (the GPU machine).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("MOEFLUX_FIXTURES") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

pub struct Golden {
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// `[tokens.len(), vocab]`, row-major.
    pub logits: Vec<f32>,
    pub vocab: usize,
}

impl Golden {
    pub fn load(dir: &Path) -> Golden {
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap())
                .unwrap();
        let ids = |k: &str| -> Vec<u32> {
            meta[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        };
        let tokens = ids("tokens");
        let prompt_len = ids("prompt").len();
        let bytes = std::fs::read(dir.join("golden_logits.npy")).unwrap();
        let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
        let shape = npy.shape().to_vec();
        let logits: Vec<f32> = npy.into_vec().unwrap();
        assert_eq!(shape[0] as usize, tokens.len());
        Golden {
            tokens,
            prompt_len,
            vocab: shape[1] as usize,
            logits,
        }
    }

    pub fn row(&self, t: usize) -> &[f32] {
        &self.logits[t * self.vocab..(t + 1) * self.vocab]
    }

    pub fn max_abs(&self) -> f32 {
        self.logits.iter().fold(0.0f32, |m, v| m.max(v.abs()))
    }
}

/// Converts fixture source `src` (relative to the fixtures dir) into a
/// fresh temp dir; returns (tempdir guard, model dir).
pub fn convert_fixture(src: &str, expert_bits: Option<u32>) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("model");
    let opts = ConvertOptions {
        expert_bits,
        ..Default::default()
    };
    convert(&fixtures().join(src), &dst, &opts).unwrap_or_else(|e| panic!("convert {src}: {e}"));
    (tmp, dst)
}

pub fn open(dir: &Path) -> Session {
    Session::open(
        dir,
        SessionOptions {
            threads: Some(2),
            ..Default::default()
        },
    )
    .unwrap()
}

/// The golden's tokens evaluated the three ways every backend must agree
/// on, each in a fresh session from `open`: one batch, one token at a time,
/// and the prompt as a batch then the continuation one token at a time.
pub const EVAL_MODES: [&str; 3] = ["batch", "incremental", "prefill+decode"];

/// Logits `[tokens, vocab]` for each of [`EVAL_MODES`].
pub fn eval_three_ways(golden: &Golden, open: impl Fn() -> Session) -> [Vec<f32>; 3] {
    let batch = open().eval(&golden.tokens, LogitsMode::All).unwrap();
    let mut s = open();
    let mut incremental = Vec::new();
    for &t in &golden.tokens {
        incremental.extend(s.eval(&[t], LogitsMode::Last).unwrap());
    }
    let mut s = open();
    let p = golden.prompt_len;
    let mut mixed = s.eval(&golden.tokens[..p], LogitsMode::All).unwrap();
    for &t in &golden.tokens[p..] {
        mixed.extend(s.eval(&[t], LogitsMode::Last).unwrap());
    }
    [batch, incremental, mixed]
}

fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best
}

fn top2_margin(x: &[f32]) -> f32 {
    let a = argmax(x);
    let second = x
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != a)
        .fold(f32::NEG_INFINITY, |m, (_, &v)| m.max(v));
    x[a] - second
}

/// The acceptance check: max |logit - golden| <= 1e-3 * max|golden| over
/// every position, and equal argmax wherever the golden's top-2 margin
/// exceeds that tolerance. Returns the worst absolute difference.
pub fn check_against_golden(name: &str, golden: &Golden, got: &[f32]) -> f32 {
    // The bound is loose for f32 CPU math; measured agreement is
    // ~1e-5 relative, so guard against regressions an order above that.
    check_within(name, golden, got, 1e-3, 1e-4)
}

/// [`check_against_golden`] with the acceptance bound `tol_rel` and a
/// tighter regression guard `guard_rel` (both relative to max|golden|).
pub fn check_within(name: &str, golden: &Golden, got: &[f32], tol_rel: f32, guard_rel: f32) -> f32 {
    assert_eq!(got.len(), golden.logits.len(), "{name}: logits size");
    let tol = tol_rel * golden.max_abs();
    let mut worst = 0.0f32;
    for t in 0..golden.tokens.len() {
        let g = golden.row(t);
        let m = &got[t * golden.vocab..(t + 1) * golden.vocab];
        let d = g
            .iter()
            .zip(m)
            .fold(0.0f32, |acc, (a, b)| acc.max((a - b).abs()));
        assert!(d.is_finite(), "{name}: non-finite logits at position {t}");
        worst = worst.max(d);
        if top2_margin(g) > tol {
            assert_eq!(
                argmax(m),
                argmax(g),
                "{name}: argmax differs at position {t}"
            );
        }
    }
    assert!(
        worst <= tol,
        "{name}: max |logit - golden| = {worst:e} exceeds {tol:e} ({tol_rel:e} * max|golden|)"
    );
    assert!(
        worst <= guard_rel * golden.max_abs(),
        "{name}: max |logit - golden| = {worst:e} is within the {tol_rel:e} bound but above \
         the {guard_rel:e} relative this engine achieves"
    );
    eprintln!("{name}: max |diff| = {worst:.3e} (tolerance {tol:.3e})");
    worst
}

/// A small synthetic model shape with a real model's expert count and
/// top-k, so that routing statistics and expert caches mean something.
pub fn small_moe_spec() -> moeflux::synth::SynthSpec {
    moeflux::synth::SynthSpec::Qwen3_5Moe(moeflux::synth::QwenShape {
        hidden_size: 256,
        num_layers: 4,
        num_attention_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        vocab_size: 512,
        num_experts: 128,
        experts_per_token: 8,
        moe_intermediate: 64,
        shared_intermediate: 64,
        linear_v_heads: 2,
        linear_k_heads: 1,
        linear_head_dim: 64,
        full_attention_interval: 2,
        eos_token_ids: &[2],
    })
}

/// A small gpt-oss-shaped synthetic model (MXFP4 experts) whose widths,
/// 1088 = 17 x 64 and 5440 = 85 x 64 like gpt-oss's 2880 = 45 x 64, give
/// rows that 512 bytes do not divide (544 and 2720 bytes of 4-bit codes):
/// the one-token kernels' uneven slices; the experts are wide enough that
/// decode takes the streaming per-slot kernels. The window (8) is shorter
/// than the tests' prompts.
pub fn small_gpt_oss_spec() -> moeflux::synth::SynthSpec {
    moeflux::synth::SynthSpec::GptOss(moeflux::synth::GptOssShape {
        hidden_size: 1088,
        num_layers: 2,
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        vocab_size: 512,
        num_experts: 16,
        experts_per_token: 4,
        intermediate_size: 5440,
        sliding_window: 8,
        eos_token_ids: &[2],
    })
}

/// A small DeepSeek-V3-shaped synthetic model (MLA with a query LoRA and
/// value heads narrower than the key heads, one dense layer, grouped
/// `noaux_tc` routing over a real expert count); every quantized width a
/// multiple of the group size 64.
pub fn small_deepseek_spec() -> moeflux::synth::SynthSpec {
    moeflux::synth::SynthSpec::DeepseekV3(moeflux::synth::DeepseekShape {
        hidden_size: 256,
        num_layers: 4,
        num_attention_heads: 4,
        vocab_size: 512,
        num_experts: 64,
        experts_per_token: 6,
        moe_intermediate: 64,
        n_shared_experts: 1,
        intermediate_size: 128,
        first_k_dense: 1,
        q_lora_rank: 64,
        kv_lora_rank: 128,
        qk_nope_head_dim: 64,
        qk_rope_head_dim: 32,
        v_head_dim: 32,
        n_group: 8,
        topk_group: 3,
        routed_scaling_factor: 2.5,
        eos_token_ids: &[2],
    })
}
