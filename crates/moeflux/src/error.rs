//! Typed errors. Every variant names the file, tensor or field at fault so
//! a user can act on the message without reading the source.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: config field `{field}`: {reason}")]
    Config {
        path: PathBuf,
        field: String,
        reason: String,
    },
    #[error("unsupported model_type `{model_type}` in {path} (supported: {supported})")]
    UnsupportedModel {
        path: PathBuf,
        model_type: String,
        supported: String,
    },
    #[error("{file}: tensor `{tensor}`: {reason}")]
    Tensor {
        file: PathBuf,
        tensor: String,
        reason: String,
    },
    #[error("{path}: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("token id {token} at index {index} is out of range (vocab size {vocab})")]
    TokenOutOfRange {
        token: u32,
        index: usize,
        vocab: usize,
    },
    #[error("{path}: cannot load tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("token id {token} at index {index} is not in the tokenizer's vocabulary")]
    UnknownToken { token: u32, index: usize },
    #[error("tokenizer: {0}")]
    Tokenize(String),
    #[error("empty token list")]
    EmptyTokens,
    #[error("position {requested} is beyond the current position {current}")]
    PositionBeyondEnd { requested: usize, current: usize },
    #[error(
        "cannot truncate to {requested}: linear-attention layers, and sliding-window layers \
         that dropped the rows it attends to, need a checkpoint at or before that position \
         (checkpoints: {available:?})"
    )]
    NoCheckpoint {
        requested: usize,
        available: Vec<usize>,
    },
    #[error("context full: {requested} positions requested, limit is {limit}")]
    ContextFull { requested: usize, limit: usize },
    #[error("snapshot rejected: {0}")]
    Snapshot(String),
    #[error("{path}: destination exists (use --force to overwrite)")]
    DestinationExists { path: PathBuf },
    #[error("cancelled")]
    Cancelled,
    /// Getting a model from the Hugging Face Hub: names the repo, and the
    /// file, status or setting at fault.
    #[error("{repo}: {reason}")]
    Hub { repo: String, reason: String },
    /// The GPU backend: no GPU or driver, or a failed CUDA call.
    #[error("{0}")]
    Gpu(String),
    /// A model (a shape or a feature of it) a backend cannot run; another
    /// backend may (`--backend auto` falls back to the CPU).
    #[error("the {backend} backend cannot run this model: {what}")]
    Unsupported { what: String, backend: &'static str },
    #[error("{0}")]
    Invalid(String),
    /// A forward pass produced a NaN or an infinity (damaged or hostile
    /// weights); names the first block whose output is not finite.
    #[error("the model computed non-finite values: {0}")]
    NonFinite(String),
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
    pub fn tensor(
        file: impl Into<PathBuf>,
        tensor: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Error::Tensor {
            file: file.into(),
            tensor: tensor.into(),
            reason: reason.into(),
        }
    }
    pub fn format(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Format {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
