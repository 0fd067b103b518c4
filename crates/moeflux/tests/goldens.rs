//! End-to-end agreement with mlx-lm for the GQA families (Qwen3.5, Qwen3-Next,
//! Qwen3-MoE, GLM-4.5/4.6, gpt-oss): every fixture is converted, then
//! evaluated as one batch and one token at a time, and every position's
//! logits are compared with mlx-lm's float32 forward on the dequantized
//! weights (see tools/goldens).

mod common;

use common::{
    check_against_golden, convert_fixture, eval_three_ways, fixtures, open, Golden, EVAL_MODES,
};
use moeflux::session::{Activations, Repack};
use moeflux::{LogitsMode, Session, SessionOptions};

fn run_fixture(name: &str, src: &str, golden_dir: &str, expert_bits: Option<u32>) {
    let golden = Golden::load(&fixtures().join(golden_dir));
    let (_tmp, dir) = convert_fixture(src, expert_bits);
    let rows = eval_three_ways(&golden, || open(&dir));
    for (mode, got) in EVAL_MODES.iter().zip(&rows) {
        check_against_golden(&format!("{name} {mode}"), &golden, got);
    }
    // Every token's arithmetic is independent of the batch it is in.
    assert_eq!(
        rows[0], rows[2],
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

#[test]
fn qwen3_moe_q4_qk_norm_no_gate_dense_layer() {
    run_fixture("qwen3moe-q4", "qwen3moe-q4/src", "qwen3moe-q4", None);
}

#[test]
fn qwen3_moe_from_hugging_face_bf16_tied_sparse_step() {
    run_fixture("qwen3moe-hf", "qwen3moe-hf/src", "qwen3moe-hf", None);
}

#[test]
fn glm4_moe_q4_qkv_bias_qk_norm_partial_rope_noaux_tc() {
    run_fixture("glm4moe-q4", "glm4moe-q4/src", "glm4moe-q4", None);
}

#[test]
fn gpt_oss_q4_sinks_sliding_window_biases_yarn_clamped_swiglu() {
    run_fixture("gptoss-q4", "gptoss-q4/src", "gptoss-q4", None);
}

/// gpt-oss's sliding layers keep only their window (plus slack): decoding
/// one token at a time far past it (the golden's tokens, then twelve
/// windows more) gives bit for bit the logits of one batch over the whole
/// sequence, whose attention holds every row until it is done, and the
/// golden's where it has them.
#[test]
fn gpt_oss_q4_decode_past_many_windows_equals_one_batch() {
    let golden = Golden::load(&fixtures().join("gptoss-q4"));
    let (_tmp, dir) = convert_fixture("gptoss-q4/src", None);
    let window = open(&dir).config().attention_window[0].expect("layer 0 slides");
    assert!(window < golden.prompt_len, "the prompt outgrows the window");
    let mut tokens = golden.tokens.clone();
    tokens.extend((0..12 * window).map(|i| ((i * 37 + 11) % golden.vocab) as u32));
    let mut s = open(&dir);
    let mut decoded = Vec::new();
    for &t in &tokens {
        decoded.extend(s.eval(&[t], LogitsMode::Last).unwrap());
    }
    let batch = open(&dir).eval(&tokens, LogitsMode::All).unwrap();
    let differ = decoded
        .iter()
        .zip(&batch)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    assert_eq!(
        differ.map(|i| i / golden.vocab),
        None,
        "first position whose decoded logits differ from the batch's"
    );
    check_against_golden(
        "gptoss-q4 decoded past many windows",
        &golden,
        &decoded[..golden.tokens.len() * golden.vocab],
    );
    // What the sliding layers hold is bounded: a snapshot here is smaller
    // than one holding every row (the largest at this position).
    let full = moeflux::Session::open(
        &dir,
        moeflux::SessionOptions {
            max_context: Some(tokens.len()),
            ..Default::default()
        },
    )
    .unwrap()
    .max_snapshot_len();
    let held = s.state_save().unwrap().len() as u64;
    assert!(
        held < full,
        "snapshot of {held} bytes, all rows take {full}"
    );
}

#[test]
fn gpt_oss_mxfp4_experts_from_mlx_lm() {
    run_fixture("gptoss-mxfp4", "gptoss-mxfp4/src", "gptoss-mxfp4", None);
}

/// Weights interleaved by eight rows for the CPU (`--cpu-repack`: MXFP4
/// and 4-bit affine experts held in RAM, 4-bit affine dense matrices with
/// 8-bit activations) give the bits of the weights as stored, with 8-bit
/// activations (the interleaved kernels) and with f32 (their fallback),
/// every way of feeding the tokens.
#[test]
fn weights_interleaved_for_the_cpu_give_the_stored_bits() {
    for (fixture, q8_note, f32_note) in [
        (
            "gptoss-mxfp4",
            "routed experts interleaved in RAM",
            Some("routed experts interleaved"),
        ),
        (
            "gptoss-q4",
            "dense 4-bit matrices interleaved",
            Some("routed experts interleaved"),
        ),
        // MLX affine 4-bit experts (and dense matrices), groups of 64.
        (
            "qwen35moe-q4",
            "routed experts interleaved in RAM",
            Some("routed experts interleaved"),
        ),
    ] {
        let golden = Golden::load(&fixtures().join(fixture));
        let (_tmp, dir) = convert_fixture(&format!("{fixture}/src"), None);
        for (activations, note) in [
            (Activations::Q8, Some(q8_note)),
            (Activations::F32, f32_note),
        ] {
            let open_with = |cpu_repack| {
                Session::open(
                    &dir,
                    SessionOptions {
                        threads: Some(2),
                        cpu_activations: activations,
                        cpu_repack,
                        ..Default::default()
                    },
                )
                .unwrap()
            };
            let backend = open_with(Repack::On).backend().to_string();
            assert_eq!(
                note.is_some_and(|n| backend.contains(n)),
                note.is_some(),
                "{fixture} {activations:?}: {backend}"
            );
            assert!(!open_with(Repack::Off).backend().contains("interleaved"));
            let stored = eval_three_ways(&golden, || open_with(Repack::Off));
            let held = eval_three_ways(&golden, || open_with(Repack::On));
            for ((mode, a), b) in EVAL_MODES.iter().zip(&stored).zip(&held) {
                assert!(
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{fixture} {activations:?} {mode}: interleaved weights change the logits"
                );
            }
        }
        // `auto` interleaves only for 8-bit activations.
        let auto = |cpu_activations| {
            Session::open(
                &dir,
                SessionOptions {
                    threads: Some(2),
                    cpu_activations,
                    ..Default::default()
                },
            )
            .unwrap()
            .backend()
            .contains("interleaved")
        };
        assert!(!auto(Activations::F32), "{fixture}");
        if moeflux::io::procfs::mem_available_bytes().is_some_and(|b| b > (3 << 30)) {
            assert!(auto(Activations::Q8), "{fixture}");
        }
    }
}

#[test]
fn gpt_oss_from_hugging_face_mxfp4_blocks_interleaved_gate_up() {
    run_fixture("gptoss-hf", "gptoss-hf/src", "gptoss-hf", None);
}

#[test]
fn glm4_moe_from_hugging_face_bf16_without_qk_norm_mtp_dropped() {
    run_fixture("glm4moe-hf", "glm4moe-hf/src", "glm4moe-hf", None);
}
