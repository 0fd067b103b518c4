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
