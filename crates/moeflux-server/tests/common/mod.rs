//! What the server's test binaries share: the converted fixture model
//! (`qwen35moe-q4`, random weights, the Qwen3.5 chat template) and a server
//! over it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use moeflux::{Session, SessionOptions};
use moeflux_server::{Server, ServerOptions};

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The fixture model converted once per test binary, with the Qwen3.5
/// template (which renders tools).
pub fn model_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<(tempfile::TempDir, PathBuf)> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("tiny-qwen");
        moeflux::convert::convert(
            &fixtures().join("qwen35moe-q4/src"),
            &dst,
            &Default::default(),
        )
        .unwrap();
        std::fs::copy(
            fixtures().join("templates/qwen3.5/chat_template.jinja"),
            dst.join("chat_template.jinja"),
        )
        .unwrap();
        (tmp, dst)
    })
    .1
    .clone()
}

/// A server over [`model_dir`] (2 threads, a 2048-token context).
pub fn open(opts: ServerOptions) -> Result<Server, String> {
    open_dir(&model_dir(), opts)
}

/// A server on the model directory `dir` (2 threads, 2048-token context).
pub fn open_dir(dir: &std::path::Path, opts: ServerOptions) -> Result<Server, String> {
    let d = dir.to_path_buf();
    Server::start(
        dir,
        opts,
        Box::new(move || {
            Session::open(
                &d,
                SessionOptions {
                    threads: Some(2),
                    max_context: Some(2048),
                    ..Default::default()
                },
            )
            .map_err(|e| e.to_string())
        }),
    )
}
