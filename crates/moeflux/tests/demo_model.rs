//! The bundled demo model (`models/demo`, trained by `tools/train-demo`)
//! against transformers' own `qwen3_5_moe` forward on the same dequantized
//! weights: the second oracle, independent of mlx-lm.

mod common;

use common::oracle::{demo_model, Oracle};

/// The core engine issue's acceptance bound, and the regression guard an
/// order above the agreement measured (docs/DEMO.md).
const TOL: f32 = 1e-3;
const GUARD: f32 = 1e-4;

fn oracle() -> Oracle {
    Oracle::load(
        &common::fixtures().join("demo-oracle/oracle.json"),
        &demo_model(),
    )
}

#[test]
fn demo_model_matches_transformers_in_a_batch() {
    let mut s = common::open(&demo_model());
    oracle().check("cpu batch", &mut s, false, TOL, GUARD);
}

#[test]
fn demo_model_matches_transformers_token_by_token() {
    let mut s = common::open(&demo_model());
    oracle().check("cpu incremental", &mut s, true, TOL, GUARD);
}

/// The held-out text the demo model never saw, scored in overlapping windows.
#[test]
fn demo_model_perplexity_matches_transformers() {
    let mut s = common::open(&demo_model());
    // Logits agree to ~1e-5 relative; the mean log-probability follows them.
    oracle().check_perplexity("cpu", &mut s, 1e-4);
}
