//! `moeflux pull` and `--model hf:...` through the binary, against the local
//! Hub stand-in of the library's tests.

mod common;
#[path = "../../moeflux/tests/support/hub_server.rs"]
mod hub_server;

use std::path::Path;
use std::process::{Command, Output};

use common::*;
use hub_server::HubServer;

const COMMIT: &str = "89abcdef0123456789abcdef0123456789abcdef";

/// The binary with the Hub settings pointed at `server` and `home`, none
/// inherited from the machine running the tests.
fn hub_cmd(server: &HubServer, home: &Path, args: &[&str]) -> Output {
    let mut c: Command = command(args);
    for v in [
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "HF_HUB_CACHE",
        "XDG_CACHE_HOME",
    ] {
        c.env_remove(v);
    }
    c.env("HF_ENDPOINT", server.endpoint())
        .env("HF_HOME", home.join("hf"))
        .env("MOEFLUX_HOME", home.join("moeflux"));
    c.output().expect("run moeflux")
}

#[test]
fn pull_prints_the_model_directory_and_hf_models_work_in_other_commands() {
    let server = HubServer::start();
    server.add_dir("org/m", COMMIT, &fixture("qwen35moe-q4").join("src"), &[]);
    let home = tempfile::tempdir().unwrap();
    let out = ok(&hub_cmd(&server, home.path(), &["pull", "org/m"]));
    let dir = home
        .path()
        .join("moeflux/models")
        .join(format!("org--m--{COMMIT}"));
    assert_eq!(out.trim_end(), dir.to_str().unwrap());
    assert!(dir.join("moeflux.json").is_file());
    assert!(home
        .path()
        .join("hf/hub/models--org--m/snapshots")
        .join(COMMIT)
        .join("model.safetensors")
        .is_file());

    // The same model by name in another command: reused, not downloaded.
    server.clear_requests();
    let described = ok(&hub_cmd(&server, home.path(), &["inspect", "hf:org/m"]));
    assert!(described.contains("qwen3_5_moe"), "{described}");
    assert!(server.file_requests().is_empty());
    let ids = ok(&hub_cmd(
        &server,
        home.path(),
        &["tokenize", "--model", "hf:org/m", "--json", "hello"],
    ));
    assert!(ids.trim_start().starts_with('['), "{ids}");

    // --models-dir chooses where the conversion goes.
    let other = home.path().join("elsewhere");
    let out = ok(&hub_cmd(
        &server,
        home.path(),
        &["pull", "org/m", "--models-dir", s(&other)],
    ));
    assert_eq!(
        out.trim_end(),
        other.join(format!("org--m--{COMMIT}")).to_str().unwrap()
    );
}

#[test]
fn pull_errors_exit_non_zero_with_one_line() {
    let server = HubServer::start();
    let home = tempfile::tempdir().unwrap();
    let line = one_line_error(&hub_cmd(&server, home.path(), &["pull", "org/missing"]));
    assert!(
        line.contains("pulling org/missing: org/missing: repo org/missing not found"),
        "{line}"
    );
    let out = hub_cmd(
        &server,
        home.path(),
        &["run", "--model", "hf:bad", "-n", "1"],
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "a malformed name is a usage error"
    );
    assert!(
        text(&out.stderr).contains("ORG/NAME"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn gguf_quant_by_name_pulls_converts_and_runs() {
    let server = HubServer::start();
    let read = |n: &str| std::fs::read(fixture("gguf").join(n)).unwrap();
    server.add_repo(
        "org/g-GGUF",
        COMMIT,
        vec![
            ("G-Q4_1.gguf".into(), read("qwen3moe.gguf")),
            (
                "G-Q8_0-00001-of-00002.gguf".into(),
                read("qwen3moe-mixed-00001-of-00002.gguf"),
            ),
            (
                "G-Q8_0-00002-of-00002.gguf".into(),
                read("qwen3moe-mixed-00002-of-00002.gguf"),
            ),
        ],
        None,
    );
    let home = tempfile::tempdir().unwrap();
    let models = home.path().join("moeflux/models");
    let out = hub_cmd(
        &server,
        home.path(),
        &[
            "run",
            "--model",
            "hf:org/g-GGUF:Q4_1",
            "-p",
            "Hello",
            "-n",
            "2",
        ],
    );
    assert!(!ok(&out).is_empty());
    let err = text(&out.stderr);
    assert!(err.contains("GGUF tensor types: "), "{err}");
    assert!(models
        .join(format!("org--g-GGUF--{COMMIT}--G-Q4_1"))
        .join("moeflux.json")
        .is_file());

    let out = ok(&hub_cmd(&server, home.path(), &["pull", "org/g-GGUF:Q8_0"]));
    assert_eq!(
        out.trim_end(),
        s(&models.join(format!("org--g-GGUF--{COMMIT}--G-Q8_0")))
    );
    let line = one_line_error(&hub_cmd(&server, home.path(), &["pull", "org/g-GGUF"]));
    assert!(line.contains("choose one with org/g-GGUF:QUANT"), "{line}");
}
