//! The `moeflux` binary: `convert` and `inspect` on a fixture, and one-line
//! errors (non-zero exit, no panic) on bad input.

mod common;

use common::*;

#[test]
fn convert_then_inspect() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("next");
    let out = moeflux(&["convert", s(&fixture("qwen3next-q4/src")), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let summary = text(&out.stdout);
    assert!(
        summary.contains("qwen3_next")
            && summary.contains("tensors")
            && summary.contains("dense ")
            && summary.contains(" KB"),
        "{summary}"
    );
    assert!(dst.join("moeflux.json").is_file());

    let out = moeflux(&["inspect", s(&dst)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let o = text(&out.stdout);
    assert!(o.contains("qwen3_next"), "{o}");
    assert!(o.contains("linear x1, full x1 repeated x2"), "{o}");
    assert!(o.contains("8-bit g64"), "{o}");
    assert!(o.contains("dense MLP at   layers 2"), "{o}");

    let out = moeflux(&["inspect", "--json", s(&dst)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["architecture"], "qwen3_next");
    assert_eq!(v["moe"]["experts"], 8);
    assert_eq!(v["source"]["kind"], "mlx");
    assert!(v["expert_bytes"].as_u64().unwrap() > 0);

    // Again without --force: refused; with --force: replaced.
    let out = moeflux(&["convert", s(&fixture("qwen3next-q4/src")), s(&dst)]);
    let line = one_line_error(&out);
    assert!(line.contains("--force"), "{line}");
    let out = moeflux(&[
        "convert",
        "--force",
        "--expert-bits",
        "2",
        s(&fixture("qwen3next-q4/src")),
        s(&dst),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("4->2-bit"));
    let out = moeflux(&["inspect", s(&dst)]);
    assert!(text(&out.stdout).contains("2-bit g64 (BF16 scales)"));
}

/// `--low-width-copies`: at conversion, or added to a model later; then
/// runs with `--low-width-experts` and `inspect` checks the copies.
#[test]
fn low_width_copies_at_conversion_and_later() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("m");
    let src = fixture("qwen35moe-q4/src");
    let out = moeflux(&["convert", "--low-width-copies", "2", s(&src), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("copied at 2 bits"),
        "{}",
        text(&out.stdout)
    );
    assert!(dst.join("experts/low2").is_dir());
    let out = moeflux(&["inspect", s(&dst)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("2-bit copies of the experts"),
        "{}",
        text(&out.stdout)
    );
    let out = moeflux(&["inspect", "--json", s(&dst)]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["low_width_copies"]["bits"], 2);
    assert!(v["low_width_copies"]["bytes"].as_u64().unwrap() > 0);
    let later = t.path().join("later");
    let out = moeflux(&["convert", s(&src), s(&later)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let run = |dir: &std::path::Path| {
        moeflux(&[
            "run",
            "--model",
            s(dir),
            "-p",
            "Hello",
            "-n",
            "2",
            "--low-width-experts",
        ])
    };
    let line = one_line_error(&run(&later));
    assert!(line.contains("--low-width-copies"), "{line}");
    // `--low-width-misses` is the GPU cache's, and excludes every expert
    // at low width.
    let misses = |dir: &std::path::Path, more: &[&str]| {
        let mut a = vec!["run", "--model", s(dir), "-p", "Hello", "-n", "2"];
        a.extend(["--backend", "cpu", "--low-width-misses"]);
        a.extend(more);
        moeflux(&a)
    };
    let line = one_line_error(&misses(&later, &[]));
    assert!(line.contains("--low-width-copies"), "{line}");
    let line = one_line_error(&misses(&dst, &[]));
    assert!(
        line.contains("--low-width-misses") && line.contains("CPU"),
        "{line}"
    );
    let out = misses(&dst, &["--low-width-experts"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = moeflux(&["run", "--model", s(&dst), "--low-width-below", "0.1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let out = moeflux(&["convert", "--model", s(&later), "--low-width-copies", "2"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Both ways give the same copies.
    assert_eq!(
        std::fs::read(dst.join("experts/low2/layer_000.bin")).unwrap(),
        std::fs::read(later.join("experts/low2/layer_000.bin")).unwrap()
    );
    let out = run(&later);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A truncated copy is named by inspect.
    let copy = later.join("experts/low2/layer_001.bin");
    let f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    f.set_len(4096).unwrap();
    let line = one_line_error(&moeflux(&["inspect", s(&later)]));
    assert!(line.contains("layer_001.bin"), "{line}");
    // Widths the copies cannot have.
    let out = moeflux(&["convert", "--model", s(&later), "--low-width-copies", "4"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("not one of"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn convert_hf_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("m");
    let out = moeflux(&["convert", s(&fixture("qwen35moe-hf/src")), s(&dst)]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("unquantized source"));
    let out = moeflux(&["inspect", s(&dst)]);
    assert!(text(&out.stdout).contains("qwen3_5_moe"));
}

#[test]
fn bad_input_is_one_error_line() {
    let t = tempfile::tempdir().unwrap();
    // Missing source.
    let out = moeflux(&["convert", "/nonexistent/src", s(&t.path().join("a"))]);
    let line = one_line_error(&out);
    assert!(line.contains("/nonexistent/src"), "{line}");
    assert_eq!(out.status.code(), Some(1));

    // Source without config.json.
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    std::fs::copy(
        fixture("qwen35moe-q4/src/model.safetensors"),
        src.join("model.safetensors"),
    )
    .unwrap();
    let out = moeflux(&["convert", s(&src), s(&t.path().join("b"))]);
    let line = one_line_error(&out);
    assert!(line.contains("config.json"), "{line}");

    // Truncated shard.
    std::fs::copy(
        fixture("qwen35moe-q4/src/config.json"),
        src.join("config.json"),
    )
    .unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(src.join("model.safetensors"))
        .unwrap();
    f.set_len(1000).unwrap();
    let out = moeflux(&["convert", s(&src), s(&t.path().join("c"))]);
    let line = one_line_error(&out);
    assert!(line.contains("model.safetensors"), "{line}");

    // Not a model directory.
    let out = moeflux(&["inspect", s(t.path())]);
    let line = one_line_error(&out);
    assert!(line.contains("moeflux.json"), "{line}");

    // Nothing was created by the failed conversions.
    let mut left: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["src"]);

    // Usage errors come from clap (exit 2), still without a panic.
    let out = moeflux(&["convert", "--expert-bits", "3", "a", "b"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(!text(&out.stderr).contains("panicked"));
}

/// What convert left out of the checkpoint is said on stderr, grouped: the
/// GLM multi-token-prediction layer (its 11 tensors at layer 3), the
/// Kimi-K2.5 vision tower and projector; nothing for a checkpoint without
/// extras.
#[test]
fn convert_reports_skipped_tensors() {
    let t = tempfile::tempdir().unwrap();
    let out = moeflux(&[
        "convert",
        s(&fixture("glm4moe-hf/src")),
        s(&t.path().join("glm")),
    ]);
    assert!(text(&out.stdout).contains("converted glm4_moe"));
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.trim_end(),
        "skipped 11 tensors: multi-token-prediction layer 3 (11)"
    );

    let out = moeflux(&[
        "convert",
        s(&fixture("kimik25-hf/src")),
        s(&t.path().join("kimi")),
    ]);
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert_eq!(
        err.trim_end(),
        "skipped 23 tensors: vision tower (17), vision projector (6)"
    );

    let out = moeflux(&[
        "convert",
        s(&fixture("qwen3moe-hf/src")),
        s(&t.path().join("qwen")),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), "");
}
