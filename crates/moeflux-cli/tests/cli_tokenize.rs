//! `moeflux tokenize` end to end on a fixture's tokenizer: text → ids →
//! text round trips, JSON output, and one clean `error:` line for bad input.

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Output, Stdio};

use common::*;

fn fixture_src() -> PathBuf {
    fixture("qwen35moe-q4/src")
}

/// One `error:` line on stderr, nothing on stdout, exit status 1.
fn fails(out: &Output) -> String {
    assert!(out.stdout.is_empty());
    one_line_error(out)
}

const TEXT: &str = "<|im_start|>user\nHello, 世界! 🦙 e\u{301}te\u{301}<|im_end|>\n";

#[test]
fn text_to_ids_to_text_round_trips() {
    let model = fixture_src();
    let m = model.to_str().unwrap();
    let line = ok(&moeflux(&["tokenize", "--model", m, TEXT]));
    let ids = line.trim_end_matches('\n');
    assert!(!ids.contains('\n') && !ids.contains(' '), "{line:?}");
    let parsed: Vec<u32> = ids.split(',').map(|x| x.parse().unwrap()).collect();
    assert_eq!(parsed[0], 1, "<|im_start|> is one token");
    assert_eq!(parsed.iter().filter(|&&i| i == 2).count(), 1);

    // --json prints the same ids as an array.
    let json: Vec<u32> =
        serde_json::from_str(&ok(&moeflux(&["tokenize", "--model", m, "--json", TEXT]))).unwrap();
    assert_eq!(json, parsed);

    // Back to text. The fixture tokenizer normalizes to NFC (e + U+0301 is é).
    let nfc = TEXT.replace("e\u{301}", "\u{e9}");
    let decoded: String = serde_json::from_str(&ok(&moeflux(&[
        "tokenize", "--model", m, "--decode", ids, "--json",
    ])))
    .unwrap();
    assert_eq!(decoded, nfc);
    let plain = ok(&moeflux(&["tokenize", "--model", m, "--decode", ids]));
    assert_eq!(plain, format!("{nfc}\n"));
    // The JSON array spelling is accepted too, and specials can be skipped.
    let skipped = ok(&moeflux(&[
        "tokenize",
        "--model",
        m,
        "--decode",
        &serde_json::to_string(&json).unwrap(),
        "--skip-special",
    ]));
    assert_eq!(skipped, "user\nHello, 世界! 🦙 \u{e9}t\u{e9}\n\n");
}

#[test]
fn needs_only_the_tokenizer_and_reads_stdin() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture_src().join("tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    let m = tmp.path().to_str().unwrap();
    let mut child = command(&["tokenize", "--model", m, "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all("def f(x):\n    return x\n".as_bytes())
        .unwrap();
    let ids = ok(&child.wait_with_output().unwrap());
    let back = ok(&moeflux(&[
        "tokenize",
        "--model",
        m,
        "--decode",
        ids.trim(),
    ]));
    assert_eq!(back, "def f(x):\n    return x\n\n");
}

#[test]
fn bad_input_is_one_clean_error_line() {
    let model = fixture_src();
    let m = model.to_str().unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let e = fails(&moeflux(&[
        "tokenize",
        "--model",
        tmp.path().to_str().unwrap(),
        "hi",
    ]));
    assert!(e.contains("tokenizer.json"), "{e}");

    std::fs::write(tmp.path().join("tokenizer.json"), "not json").unwrap();
    let e = fails(&moeflux(&[
        "tokenize",
        "--model",
        tmp.path().to_str().unwrap(),
        "hi",
    ]));
    assert!(e.contains("tokenizer.json: cannot load tokenizer"), "{e}");

    let e = fails(&moeflux(&["tokenize", "--model", m, "--decode", "1,1024"]));
    assert!(e.contains("1024") && e.contains("out of range"), "{e}");
    let e = fails(&moeflux(&["tokenize", "--model", m, "--decode", "1,x"]));
    assert!(e.contains("`x`"), "{e}");
    let e = fails(&moeflux(&["tokenize", "--model", m, "--decode", "-1"]));
    assert!(e.contains("`-1`"), "{e}");
    let e = fails(&moeflux(&[
        "tokenize",
        "--model",
        m,
        "--decode",
        "99999999999",
    ]));
    assert!(e.contains("not a token id"), "{e}");
}

/// `--config FILE` reaches a real command as its flags would, a typo in it is
/// a usage error naming the file and the key, and `completions` prints scripts.
#[test]
fn config_file_and_completions() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("moeflux.toml");
    let model = fixture_src();
    std::fs::write(
        &cfg,
        format!("model = {:?}\n[tokenize]\njson = true\n", s(&model)),
    )
    .unwrap();
    let direct = ok(&moeflux(&[
        "tokenize",
        "--model",
        s(&model),
        "--json",
        TEXT,
    ]));
    assert!(direct.starts_with('['), "{direct}");
    assert_eq!(
        ok(&moeflux(&["--config", s(&cfg), "tokenize", TEXT])),
        direct
    );

    std::fs::write(&cfg, "[tokenize]\njsn = true\n").unwrap();
    let out = moeflux(&["tokenize", "--config", s(&cfg), "x"]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.starts_with("error: ") && err.contains("'jsn'") && err.contains(s(&cfg)),
        "{err}"
    );

    for shell in ["bash", "zsh", "fish"] {
        let script = ok(&moeflux(&["completions", shell]));
        // fish names long flags without their dashes (`-l config`).
        assert!(
            script.contains("tokenize") && script.contains("config"),
            "{shell}"
        );
    }
}
