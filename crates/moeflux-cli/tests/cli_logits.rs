//! `moeflux logits` end to end: convert a fixture, write logits in both
//! modes, compare with mlx-lm's golden; bad input exits non-zero with one
//! `error:` line and writes nothing.

use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn moeflux(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moeflux"))
        .args(args)
        .output()
        .unwrap()
}

fn read_npy(p: &Path) -> (Vec<u64>, Vec<f32>) {
    let bytes = std::fs::read(p).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    let shape = npy.shape().to_vec();
    (shape, npy.into_vec().unwrap())
}

fn convert(tmp: &Path) -> PathBuf {
    let model = tmp.join("model");
    let src = fixtures().join("qwen35moe-q4/src");
    let out = moeflux(&["convert", src.to_str().unwrap(), model.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    model
}

#[test]
fn logits_batch_and_incremental_match_the_golden() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert(tmp.path());
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("qwen35moe-q4/golden.json")).unwrap(),
    )
    .unwrap();
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
    let model = convert(tmp.path());
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
    let model = convert(tmp.path());
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
