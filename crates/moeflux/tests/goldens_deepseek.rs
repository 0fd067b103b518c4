//! End-to-end agreement with mlx-lm for the DeepSeek-V3 family (DeepSeek-V3,
//! Kimi-K2, Kimi-K2.5; MLA,
//! `noaux_tc` routing, dense first layer, YaRN): each fixture is converted,
//! then evaluated as one batch (decompressed MLA), one token at a time
//! (absorbed MLA, the decode path) and as prefill + decode, and every
//! position's logits are compared with mlx-lm's float32 forward on the
//! dequantized weights (tools/goldens/make_deepseek_fixtures.py).
//!
//! Unlike the Qwen models, batch and incremental logits are not bitwise
//! equal here: the two MLA paths sum in different orders (as in mlx-lm,
//! whose two paths differ by ~1e-5 in float32). Each must match the golden.

mod common;

use common::{
    check_against_golden, convert_fixture, eval_three_ways, fixtures, open, Golden, EVAL_MODES,
};

fn run_fixture(name: &str, src: &str, golden_dir: &str) {
    let golden = Golden::load(&fixtures().join(golden_dir));
    let (_tmp, dir) = convert_fixture(src, None);
    let rows = eval_three_ways(&golden, || open(&dir));
    for (mode, got) in EVAL_MODES.iter().zip(&rows) {
        check_against_golden(&format!("{name} {mode}"), &golden, got);
    }
}

#[test]
fn deepseek_v3_q4_mla_noaux_tc_yarn() {
    run_fixture("deepseekv3-q4", "deepseekv3-q4/src", "deepseekv3-q4");
}

#[test]
fn kimi_k2_q4_plain_q_proj_one_group_rope_mscale() {
    run_fixture("kimik2-q4", "kimik2-q4/src", "kimik2-q4");
}

#[test]
fn deepseek_v3_from_hugging_face_fp8() {
    run_fixture("deepseekv3-fp8", "deepseekv3-fp8/src", "deepseekv3-fp8");
}

#[test]
fn deepseek_v3_older_mlx_with_quantized_unsplit_kv_b_proj() {
    run_fixture(
        "deepseekv3-legacy-q4",
        "deepseekv3-legacy-q4/src",
        "deepseekv3-legacy-q4",
    );
}

#[test]
fn kimi_k25_q4_nested_text_config() {
    run_fixture("kimik25-q4", "kimik25-q4/src", "kimik25-q4");
}

#[test]
fn kimi_k25_from_hugging_face_bf16_vision_dropped() {
    run_fixture("kimik25-hf", "kimik25-hf/src", "kimik25-hf");
}
