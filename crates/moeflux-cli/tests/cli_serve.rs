//! `moeflux serve`: starts on a free port, answers over real HTTP, stops
//! cleanly on SIGTERM; bad flags give one error line. (The API itself is
//! tested in crates/moeflux-server and, through the `openai` client, in
//! tests/server.)

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Stdio;

use common::*;

fn http(port: u16, request: &str) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The key comes from MOEFLUX_API_KEY (not in `ps`), and `bearer` in any
/// case is accepted.
#[test]
fn serves_chat_and_stops_on_sigterm() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let mut child = command(&[
        "serve",
        "--model",
        s(&model),
        "--port",
        "0",
        "--backend",
        "cpu",
        "--threads",
        "2",
        "--ctx-size",
        "512",
    ])
    .env("MOEFLUX_API_KEY", "k")
    .stderr(Stdio::piped())
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("context 512 tokens"), "{line}");
    assert!(line.contains("(API key required)"), "{line}");
    let port: u16 = line
        .rsplit(':')
        .next()
        .and_then(|p| p.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    let body = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"temperature":0}"#;
    let req = |auth: &str| {
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    };
    let denied = http(port, &req(""));
    assert!(denied.starts_with("HTTP/1.1 401"), "{denied}");
    let ok = http(port, &req("Authorization: bearer k\r\n"));
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    let json = &ok[ok.find("\r\n\r\n").unwrap() + 4..];
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 1);
    // SIGTERM: a clean exit.
    let kill = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn bad_model_dir_is_one_error_line() {
    let out = moeflux(&["serve", "--model", "/nonexistent/model", "--port", "0"]);
    let line = one_line_error(&out);
    assert!(line.contains("/nonexistent/model"), "{line}");
}

/// An empty key (an unset variable) is refused before the model loads,
/// naming where it came from, and so is one in an empty key file.
#[test]
fn empty_api_key_is_refused() {
    let out = moeflux(&["serve", "--model", "/nonexistent/model", "--api-key", ""]);
    let line = one_line_error(&out);
    assert!(
        line.contains("--api-key") && line.contains("empty"),
        "{line}"
    );
    let out = command(&["serve", "--model", "/nonexistent/model"])
        .env("MOEFLUX_API_KEY", " ")
        .output()
        .unwrap();
    let line = one_line_error(&out);
    assert!(
        line.contains("MOEFLUX_API_KEY") && line.contains("empty"),
        "{line}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("key");
    std::fs::write(&file, "\n").unwrap();
    let out = moeflux(&[
        "serve",
        "--model",
        "/nonexistent/model",
        "--api-key-file",
        s(&file),
    ]);
    let line = one_line_error(&out);
    assert!(
        line.contains("--api-key-file") && line.contains("empty"),
        "{line}"
    );
}

/// `--api-key-file`: the key is read from the file (newline trimmed).
#[test]
fn api_key_from_a_file() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let file = tmp.path().join("key");
    std::fs::write(&file, "sk-from-file\n").unwrap();
    let mut child = command(&[
        "serve",
        "--model",
        s(&model),
        "--port",
        "0",
        "--backend",
        "cpu",
        "--threads",
        "1",
        "--ctx-size",
        "256",
        "--api-key-file",
        s(&file),
    ])
    .env_remove("MOEFLUX_API_KEY")
    .stderr(Stdio::piped())
    .stdout(Stdio::null())
    .spawn()
    .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    err.read_line(&mut line).unwrap();
    assert!(line.contains("(API key required)"), "{line}");
    let port: u16 = line
        .rsplit(':')
        .next()
        .and_then(|p| p.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    let get = |auth: &str| {
        http(
            port,
            &format!("GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{auth}\r\n"),
        )
    };
    assert!(get("").starts_with("HTTP/1.1 401"));
    let ok = get("Authorization: Bearer sk-from-file\r\n");
    assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
    let _ = child.kill();
    let _ = child.wait();
}
