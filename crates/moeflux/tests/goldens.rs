//! End-to-end agreement with mlx-lm: every fixture is converted, then
//! evaluated as one batch and one token at a time, and every position's
//! logits are compared with mlx-lm's float32 forward on the dequantized
//! weights (see tools/goldens).

mod common;

use common::{check_against_golden, convert_fixture, fixtures, open, Golden};
use moeflux::LogitsMode;

fn run_fixture(name: &str, src: &str, golden_dir: &str, expert_bits: Option<u32>) {
    let golden = Golden::load(&fixtures().join(golden_dir));
    let (_tmp, dir) = convert_fixture(src, expert_bits);

    let mut batch = open(&dir);
    let all = batch.eval(&golden.tokens, LogitsMode::All).unwrap();
    check_against_golden(&format!("{name} batch"), &golden, &all);

    let mut inc = open(&dir);
    let mut rows = Vec::new();
    for &t in &golden.tokens {
        rows.extend(inc.eval(&[t], LogitsMode::Last).unwrap());
    }
    check_against_golden(&format!("{name} incremental"), &golden, &rows);

    // Prompt as a batch, then the continuation one token at a time.
    let mut mixed = open(&dir);
    let p = golden.prompt_len;
    let mut rows = mixed.eval(&golden.tokens[..p], LogitsMode::All).unwrap();
    for &t in &golden.tokens[p..] {
        rows.extend(mixed.eval(&[t], LogitsMode::Last).unwrap());
    }
    check_against_golden(&format!("{name} prefill+decode"), &golden, &rows);

    // Every token's arithmetic is independent of the batch it is in.
    assert_eq!(
        all, rows,
        "{name}: batch and incremental logits differ bitwise"
    );
}

#[test]
fn qwen35moe_q4_real_layer_pattern() {
    run_fixture("qwen35moe-q4", "qwen35moe-q4/src", "qwen35moe-q4", None);
}

#[test]
fn qwen3next_q4_fused_projections_dense_layer_tied() {
    run_fixture("qwen3next-q4", "qwen3next-q4/src", "qwen3next-q4", None);
}

#[test]
fn qwen35moe_q8_unnormalized_topk_tied() {
    run_fixture("qwen35moe-q8", "qwen35moe-q8/src", "qwen35moe-q8", None);
}

#[test]
fn qwen35moe_q2() {
    run_fixture("qwen35moe-q2", "qwen35moe-q2/src", "qwen35moe-q2", None);
}

#[test]
fn qwen35moe_q4_experts_requantized_to_2bit() {
    run_fixture(
        "qwen35moe-q4 --expert-bits 2",
        "qwen35moe-q4/src",
        "qwen35moe-q4-e2",
        Some(2),
    );
}

#[test]
fn qwen35moe_from_hugging_face_bf16() {
    run_fixture("qwen35moe-hf", "qwen35moe-hf/src", "qwen35moe-hf", None);
}

#[test]
fn qwen3next_from_hugging_face_bf16() {
    run_fixture("qwen3next-hf", "qwen3next-hf/src", "qwen3next-hf", None);
}
