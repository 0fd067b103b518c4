//! What the fuzz targets share: the committed tiny fixtures, one converted
//! model per process, and the seeds each target starts from.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// The `qwen35moe-q4` fixture converted once per process into a private
/// directory (targets rewrite its files between runs).
pub fn model_dir() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().expect("temp dir");
        let dst = tmp.path().join("model");
        moeflux::convert::convert(
            &fixtures().join("qwen35moe-q4/src"),
            &dst,
            &Default::default(),
        )
        .expect("the fixture converts");
        (tmp, dst)
    })
    .1
}

pub fn session_options() -> moeflux::SessionOptions {
    moeflux::SessionOptions {
        threads: Some(1),
        max_context: Some(256),
        backend: moeflux::Backend::Cpu,
        ..Default::default()
    }
}

/// The committed chat templates the server and `chat` meet most.
pub const TEMPLATES: [&str; 8] = [
    "qwen3.5",
    "qwen3",
    "qwen3-coder",
    "qwen3-2507-thinking",
    "glm4.5",
    "kimi-k2",
    "kimi-k2-thinking",
    "llama3.1",
];

pub fn template(i: u8) -> &'static moeflux::text::chat::ChatTemplate {
    static T: OnceLock<Vec<moeflux::text::chat::ChatTemplate>> = OnceLock::new();
    let all = T.get_or_init(|| {
        TEMPLATES
            .iter()
            .map(|name| {
                moeflux::text::chat::ChatTemplate::from_model_dir(
                    fixtures().join("templates").join(name),
                )
                .expect("committed template compiles")
            })
            .collect()
    });
    &all[i as usize % all.len()]
}

pub fn tokenizer() -> &'static moeflux::text::tokenizer::Tokenizer {
    static T: OnceLock<moeflux::text::tokenizer::Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        moeflux::text::tokenizer::Tokenizer::from_model_dir(fixtures().join("qwen35moe-q4/src"))
            .expect("fixture tokenizer")
    })
}

/// Replaces `name` in the model directory with `bytes` for one run and puts
/// the original back afterwards (also when the run panics, so a reported
/// crash reproduces from its input alone).
pub struct Swapped {
    path: PathBuf,
    original: Option<Vec<u8>>,
}

impl Swapped {
    pub fn new(name: &str, bytes: &[u8]) -> Swapped {
        let path = model_dir().join(name);
        // A file the directory lacks is removed again afterwards.
        let original = std::fs::read(&path).ok();
        // A new inode each time: a map of the old file stays valid.
        let tmp = path.with_extension("fuzz-tmp");
        std::fs::write(&tmp, bytes).expect("write");
        std::fs::rename(&tmp, &path).expect("rename");
        Swapped { path, original }
    }

    pub fn original(&self) -> &[u8] {
        self.original.as_deref().unwrap_or_default()
    }
}

impl Drop for Swapped {
    fn drop(&mut self) {
        let Some(original) = &self.original else {
            let _ = std::fs::remove_file(&self.path);
            return;
        };
        let tmp = self.path.with_extension("fuzz-tmp");
        let _ = std::fs::write(&tmp, original);
        let _ = std::fs::rename(&tmp, &self.path);
    }
}
