//! moeflux: run Mixture-of-Experts language models larger than memory by
//! keeping the dense part resident and streaming routed experts from disk.

pub mod backend;
pub mod bench;
pub mod config;
pub mod convert;
pub mod error;
pub mod format;
pub mod fsutil;
pub mod generate;
pub mod hash;
#[cfg(feature = "hub")]
pub mod hub;
pub mod io;
pub mod logprobs;
pub mod model;
pub mod perplexity;
pub mod quant;
pub mod sample;
pub mod text;

pub use config::{Architecture, ModelConfig};
pub use error::{Error, Result};
pub mod session;
pub mod synth;

pub use session::{Backend, Batch, LogitsMode, Output, SeqId, Session, SessionOptions, Work};
