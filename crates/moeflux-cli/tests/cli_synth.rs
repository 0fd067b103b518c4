//! `moeflux synth`: a directory that `inspect` and `run` accept, and one-line
//! errors for bad options.

mod common;

use common::*;

#[test]
fn synth_then_inspect_and_run() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("m");
    let out = ok(&moeflux(&["synth", "--preset", "qwen3.5-tiny", s(&dst)]));
    assert!(
        out.contains("synthesized qwen3.5-tiny") && out.contains("4 of 4 layers"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&ok(&moeflux(&["inspect", "--json", s(&dst)]))).unwrap();
    assert_eq!(v["architecture"], "qwen3_5_moe");
    assert_eq!(v["layers"], 4);
    assert_eq!(v["hidden_size"], 128);
    assert_eq!(v["moe"]["experts"], 16);
    assert_eq!(v["quantization"]["router"]["8-bit g64"], 4);
    assert_eq!(v["source"]["kind"], "synthetic");

    // Truncated, 2-bit experts, skewed router, with the fixtures' tokenizer.
    let out = ok(&moeflux(&[
        "synth",
        "--preset",
        "qwen3.5-tiny",
        "--layers",
        "2",
        "--expert-bits",
        "2",
        "--router-skew",
        "zipf:1",
        "--seed",
        "3",
        "--tokenizer",
        s(&fixture("qwen35moe-q4/src")),
        "--force",
        s(&dst),
    ]));
    assert!(
        out.contains("2 of 4 layers") && out.contains("zipf:1"),
        "{out}"
    );
    let o = ok(&moeflux(&["inspect", s(&dst)]));
    assert!(o.contains("2-bit g64 (BF16 scales)"), "{o}");
    let cfg = std::fs::read_to_string(dst.join("config.json")).unwrap();
    assert!(cfg.contains("\"router_skew\": \"zipf:1\""), "{cfg}");
    let run = moeflux(&[
        "run",
        "--model",
        s(&dst),
        "--prompt",
        "hello",
        "-n",
        "4",
        "--seed",
        "1",
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
}

#[test]
fn bad_options_are_one_error_line() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("m");
    let synth = |extra: &[&str]| {
        let mut a = vec!["synth", "--preset", "qwen3.5-tiny"];
        a.extend_from_slice(extra);
        a.push(s(&dst));
        moeflux(&a)
    };
    for (args, want) in [
        (&["--layers", "0"][..], "between 1 and 4"),
        (&["--layers", "5"], "between 1 and 4"),
        (&["--expert-bits", "3"], "2, 4 or 8"),
        (&["--router-skew", "zipf:x"], "zipf:ALPHA"),
        (&["--router-skew", "pareto:1"], "zipf:ALPHA"),
    ] {
        let line = one_line_error(&synth(args));
        assert!(line.contains(want), "{args:?}: {line}");
    }
    let line = one_line_error(&moeflux(&["synth", "--preset", "gpt5", s(&dst)]));
    assert!(line.contains("unknown preset `gpt5`"), "{line}");
    assert!(
        std::fs::read_dir(t.path()).unwrap().next().is_none(),
        "leftovers"
    );

    std::fs::create_dir(&dst).unwrap();
    let line = one_line_error(&synth(&[]));
    assert!(line.contains("--force"), "{line}");
}

/// The qwen3_moe and glm4_moe presets at the fixtures' sizes, truncated:
/// directories `inspect` reads with the family's shape (their forward pass
/// is not in this build, so nothing runs them). The real presets are listed
/// in the unknown-preset error.
#[test]
fn synth_new_families_then_inspect() {
    let t = tempfile::tempdir().unwrap();
    for (preset, arch, router, moe_layers) in [
        ("qwen3-moe-tiny", "qwen3_moe", "softmax", 3),
        ("glm-4.5-tiny", "glm4_moe", "noaux_tc", 2),
    ] {
        let dst = t.path().join(preset);
        let out = ok(&moeflux(&[
            "synth",
            "--preset",
            preset,
            "--layers",
            "3",
            "--seed",
            "7",
            s(&dst),
        ]));
        assert!(
            out.contains(&format!("synthesized {preset} ({arch}, 3 of 4 layers")),
            "{out}"
        );
        let v: serde_json::Value =
            serde_json::from_str(&ok(&moeflux(&["inspect", "--json", s(&dst)]))).unwrap();
        assert_eq!(v["architecture"], arch, "{v}");
        assert_eq!(v["layers"], 3);
        assert_eq!(v["hidden_size"], 128);
        assert_eq!(v["moe"]["experts"], 16);
        assert_eq!(v["router"]["kind"], router);
        assert_eq!(v["moe"]["moe_layers"], moe_layers);
        assert_eq!(v["quantization"]["router"]["8-bit g64"], moe_layers, "{v}");
        assert_eq!(v["source"]["kind"], "synthetic");
        let experts = std::fs::read_dir(dst.join("experts")).unwrap().count();
        assert_eq!(experts, moe_layers);
    }
    let line = one_line_error(&moeflux(&[
        "synth",
        "--preset",
        "glm-5",
        s(&t.path().join("x")),
    ]));
    for p in ["qwen3-235b-a22b", "qwen3-30b-a3b", "glm-4.6", "glm-4.5-air"] {
        assert!(line.contains(p), "{line}");
    }
}

/// SIGTERM during a long write stops it, removes the temporary directory
/// and exits 128 + 15; a temporary directory left by a dead process is
/// removed by the next run for the same destination.
#[test]
fn sigterm_removes_the_partial_output_and_stale_ones_go_next_time() {
    use std::time::{Duration, Instant};
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("big");
    // Over a gigabyte: still writing when the signal comes.
    let child = command(&[
        "synth",
        "--preset",
        "qwen3-235b-a22b",
        "--layers",
        "1",
        s(&dst),
    ])
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let tmp_dir = format!(".big.tmp-{}", child.id());
    let t0 = Instant::now();
    while !tmp.path().join(&tmp_dir).exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no temporary directory"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(err.contains("terminated by signal 15"), "{err}");
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // A dead process's leftovers.
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    let stale = tmp.path().join(format!(".small.tmp-{pid}"));
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("experts.bin"), b"partial").unwrap();
    let small = tmp.path().join("small");
    ok(&moeflux(&["synth", "--preset", "qwen3.5-tiny", s(&small)]));
    assert!(!stale.exists());
    assert!(small.is_dir());
}
