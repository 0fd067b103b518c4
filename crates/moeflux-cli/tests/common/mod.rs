//! Helpers shared by the CLI tests: running the binary, fixtures, and the
//! checks every command's output must pass.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_moeflux"));
    c.args(args);
    c
}

pub fn moeflux(args: &[&str]) -> Output {
    command(args).output().expect("run moeflux")
}

/// Runs the binary with `input` on standard input.
pub fn moeflux_stdin(args: &[&str], input: &str) -> Output {
    moeflux_stdin_bytes(args, input.as_bytes())
}

/// Runs the binary with `input` (any bytes) on standard input.
pub fn moeflux_stdin_bytes(args: &[&str], input: &[u8]) -> Output {
    let mut child = command(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run moeflux");
    child.stdin.take().unwrap().write_all(input).unwrap();
    child.wait_with_output().unwrap()
}

/// Standard output of a successful run.
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "status {:?}, stderr: {}",
        out.status,
        text(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// Fails with exactly one `error: ...` line on stderr, exit status 1, no
/// panic; returns the line.
pub fn one_line_error(out: &Output) -> String {
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

/// `moeflux convert` of `tests/fixtures/<name>/src` into `<tmp>/<name>`.
pub fn convert(name: &str, tmp: &Path) -> PathBuf {
    let model = tmp.join(name);
    ok(&moeflux(&[
        "convert",
        s(&fixture(name).join("src")),
        s(&model),
    ]));
    model
}

/// A fixture's `golden.json`.
pub fn golden(name: &str) -> serde_json::Value {
    let t = std::fs::read_to_string(fixture(name).join("golden.json")).unwrap();
    serde_json::from_str(&t).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn id_list(ids: &[u32]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Runs the binary with its standard output a pipe whose reader is already
/// closed (`moeflux ... | head` once head has exited).
pub fn moeflux_closed_stdout(args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    command(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("run moeflux")
}
