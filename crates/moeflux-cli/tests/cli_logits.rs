//! `moeflux logits` end to end: convert a fixture, write logits in both
//! modes, compare with mlx-lm's golden; bad input exits non-zero with one
//! `error:` line and writes nothing.

mod common;

use std::path::Path;

use common::*;

fn read_npy(p: &Path) -> (Vec<u64>, Vec<f32>) {
    let bytes = std::fs::read(p).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    let shape = npy.shape().to_vec();
    (shape, npy.into_vec().unwrap())
}

#[test]
fn logits_batch_and_incremental_match_the_golden() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let meta = golden("qwen35moe-q4");
    let tokens: Vec<String> = meta["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.to_string())
        .collect();
    let (gshape, golden) = read_npy(&fixtures().join("qwen35moe-q4/golden_logits.npy"));
    let tol = 1e-3 * golden.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for mode in ["batch", "incremental"] {
        let out_path = tmp.path().join(format!("{mode}.npy"));
        let out = moeflux(&[
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            &tokens.join(","),
            "--output",
            out_path.to_str().unwrap(),
            "--mode",
            mode,
        ]);
        assert!(
            out.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (shape, got) = read_npy(&out_path);
        assert_eq!(shape, gshape, "{mode}");
        let worst = got
            .iter()
            .zip(&golden)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= tol, "{mode}: max diff {worst} > {tol}");
    }
}

#[test]
fn inspect_describes_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let out = moeflux(&["inspect", model.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("qwen3_5_moe"), "{text}");
}

fn assert_clean_failure(out: &std::process::Output, needle: &str) {
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("error:") && err.contains(needle),
        "expected `{needle}` in: {err}"
    );
}

#[test]
fn bad_logits_input_fails_cleanly_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let m = model.to_str().unwrap();
    let out_path = tmp.path().join("never.npy");
    let o = out_path.to_str().unwrap();
    assert_clean_failure(
        &moeflux(&[
            "logits", "--model", m, "--tokens", "1,2,1024", "--output", o,
        ]),
        "1024",
    );
    assert_clean_failure(
        &moeflux(&["logits", "--model", m, "--tokens", "1,x,3", "--output", o]),
        "`x`",
    );
    assert_clean_failure(
        &moeflux(&["logits", "--model", m, "--tokens", ",", "--output", o]),
        "no token ids",
    );
    let missing = tmp.path().join("nope");
    assert_clean_failure(
        &moeflux(&[
            "logits",
            "--model",
            missing.to_str().unwrap(),
            "--tokens",
            "1",
            "--output",
            o,
        ]),
        "moeflux.json",
    );
    assert!(!out_path.exists());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "only the model directory should exist"
    );
}
