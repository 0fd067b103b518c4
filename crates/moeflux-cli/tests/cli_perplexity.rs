//! `moeflux perplexity`, and the demo model every command falls back to
//! without `--model`.

mod common;

use common::*;

fn held_out() -> String {
    fixtures()
        .join("../../tools/train-demo/heldout.txt")
        .to_string_lossy()
        .into_owned()
}

#[test]
fn perplexity_of_held_out_text_on_the_demo_model() {
    let file = held_out();
    let out = moeflux(&[
        "perplexity",
        &file,
        "--max-tokens",
        "600",
        "--window",
        "128",
        "--stride",
        "64",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert!(
        text(&out.stderr).contains("no --model given: using the demo model"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(v["tokens"], 600);
    assert_eq!(v["scored"], 599);
    assert_eq!(v["window"], 128);
    assert_eq!(v["stride"], 64);
    let ppl = v["perplexity"].as_f64().unwrap();
    let nll = v["nll_per_token"].as_f64().unwrap();
    assert!((ppl.ln() - nll).abs() < 1e-9);
    // A model that learned the text's kind: far below the 8192-token
    // vocabulary's uniform perplexity (tools/train-demo measures ~60 on all
    // of it with window 512).
    assert!(ppl > 1.0 && ppl < 200.0, "{ppl}");

    let out = moeflux(&["perplexity", &file, "--max-tokens", "300"]);
    let line = ok(&out);
    assert!(line.starts_with("perplexity "), "{line}");
    assert!(
        line.contains("over 299 of 300 tokens (window 512, stride 512)"),
        "{line}"
    );
}

#[test]
fn q8_activations_measured_against_f32_with_kl() {
    let file = held_out();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "perplexity",
            &file,
            "--max-tokens",
            "400",
            "--window",
            "200",
        ];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--kl", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&ok(&moeflux(&args))).unwrap();
        v
    };
    // The same products as the reference: no divergence at all.
    let same = run(&[]);
    assert_eq!(same["reference"]["kl_max"], 0.0);
    assert_eq!(same["reference"]["same_top"], 1.0);
    assert_eq!(same["reference"]["perplexity"], same["perplexity"]);
    // Rounded activations: close to the reference, not equal to it.
    let q8 = run(&["--cpu-activations", "q8"]);
    let r = &q8["reference"];
    assert_eq!(r["perplexity"], same["perplexity"]);
    let kl = r["kl_mean"].as_f64().unwrap();
    assert!(kl > 0.0 && kl < 0.05, "{q8}");
    assert!(r["same_top"].as_f64().unwrap() > 0.8, "{q8}");
    let (p8, p) = (
        q8["perplexity"].as_f64().unwrap(),
        same["perplexity"].as_f64().unwrap(),
    );
    assert!(p8 != p && (p8 / p - 1.0).abs() < 0.02, "{p8} vs {p}");

    let out = moeflux(&["perplexity", &file, "--cpu-activations", "int8"]);
    let err = text(&out.stderr);
    assert!(
        !out.status.success() && err.contains("expected f32 or q8"),
        "{err}"
    );
}

#[test]
fn perplexity_bad_input_is_one_error_line() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let binary = tmp.path().join("bad.txt");
    std::fs::write(&binary, [0xff, 0xfe, 0x00]).unwrap();
    let missing = tmp.path().join("missing.txt");
    let file = held_out();
    for (args, needle) in [
        (vec!["perplexity", s(&missing)], "missing.txt"),
        (vec!["perplexity", s(&empty)], "perplexity needs at least 2"),
        (vec!["perplexity", s(&binary)], "is not UTF-8"),
        (vec!["perplexity", &file, "--stride", "0"], "stride"),
        (
            vec!["perplexity", &file, "--window", "1"],
            "at least 2 tokens",
        ),
        (
            vec!["perplexity", &file, "--window", "64", "--stride", "65"],
            "stride",
        ),
    ] {
        let out = moeflux(&args);
        let err = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn run_and_chat_default_to_the_demo_model() {
    let out = moeflux(&["run", "-p", "In the beginning", "-n", "8", "--temp", "0"]);
    assert!(!ok(&out).trim().is_empty());
    assert!(text(&out.stderr).contains("no --model given: using the demo model"));

    let out = moeflux_stdin(&["chat", "-n", "8", "--temp", "0"], "Tell me a fortune.\n");
    assert!(!ok(&out).trim().is_empty());
    assert!(text(&out.stderr).contains("no --model given: using the demo model"));
}
