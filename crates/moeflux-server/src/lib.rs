//! `moeflux-server`: an OpenAI-compatible HTTP server over one moeflux
//! model (with Anthropic's Messages API beside it), the engine behind
//! `moeflux serve`, embeddable in other programs.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use moeflux::{Session, SessionOptions};
//! use moeflux_server::{Server, ServerOptions};
//! let dir = std::path::PathBuf::from("model-dir");
//! let d = dir.clone();
//! let server = Server::start(&dir, ServerOptions::default(), Box::new(move || {
//!     Session::open(&d, SessionOptions::default()).map_err(|e| e.to_string())
//! }))?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! server.serve(listener, std::future::pending()).await?;
//! # Ok(()) }
//! ```
//!
//! Modules: [`api`] (request types, validation), [`routes`] (handlers,
//! auth), [`respond`] (responses and SSE streams), [`tools`] (tool-call
//! parsing), [`prompt`] (template, forced calls, message boundaries),
//! [`engine`] (the session's thread and its bounded FIFO queue),
//! [`prefix_cache`] (snapshots at message boundaries), [`metrics`],
//! [`error`] (OpenAI error objects), [`logprobs`] (OpenAI's logprobs
//! fields and shapes), [`anthropic`] (Anthropic's Messages
//! API onto the chat requests, its errors), [`anthropic_respond`] (its
//! answers and SSE stream), [`conn`] (the accept loop: connection cap and
//! timeouts), [`ui`] (the chat page at `/`), [`structured`]
//! (structured-output requests as grammars), [`constrain`] (grammars
//! applied to sampling).

pub mod anthropic;
pub mod anthropic_respond;
pub mod api;
pub mod conn;
pub mod constrain;
pub mod engine;
pub mod error;
pub mod logprobs;
pub mod metrics;
pub mod prefix_cache;
pub mod prompt;
pub mod respond;
pub mod routes;
mod scheduler;
mod step_log;
pub mod structured;
pub mod tools;
pub mod ui;

use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moeflux::text::chat::ChatTemplate;
use moeflux::text::tokenizer::Tokenizer;
use moeflux::Session;

pub use engine::EngineOptions;
pub use error::ApiError;
pub use prefix_cache::PrefixCacheOptions;

use api::Defaults;
use engine::{EngineHandle, ModelInfo};
use metrics::Metrics;
use prompt::LengthBound;
use tools::ToolFormat;

#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Required as `Authorization: Bearer KEY` (or `x-api-key: KEY`) on
    /// every endpoint but `/health`. An empty (or whitespace) key is refused by
    /// [`Server::start`], never read as "no key".
    pub api_key: Option<String>,
    /// The model id in responses and `/v1/models` (default: the model
    /// directory's name).
    pub model_name: Option<String>,
    /// Largest request body accepted, in bytes.
    pub max_body_bytes: usize,
    /// Time a client has to send a request's headers, from its first byte.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body, once its headers came.
    pub body_timeout: Duration,
    /// An idle keep-alive connection is closed after this.
    pub idle_timeout: Duration,
    /// Connections served at once; beyond them a few more are accepted
    /// that answer `/health` only (see [`conn`]).
    pub max_connections: usize,
    /// Prompts rendered and tokenized at once (0: one per CPU core).
    pub prepare_threads: usize,
    /// Serve the chat page at `/` (see [`ui`]); without it `/` is 404.
    pub ui: bool,
    pub engine: EngineOptions,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            api_key: None,
            model_name: None,
            max_body_bytes: 4 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_connections: 256,
            prepare_threads: 0,
            ui: true,
            engine: EngineOptions::default(),
        }
    }
}

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub tool_format: Option<ToolFormat>,
    pub defaults: Defaults,
    pub model_name: String,
    pub info: ModelInfo,
    pub metrics: Arc<Metrics>,
    pub api_key: Option<String>,
    /// The chat page is served (public, like `/health`).
    pub ui: bool,
    pub max_body_bytes: usize,
    pub body_timeout: Duration,
    /// Bounds the prompts rendered and tokenized at once (CPU and memory
    /// under a flood do not grow with the number of clients).
    pub prepare: Arc<tokio::sync::Semaphore>,
    pub length_bound: LengthBound,
    /// Unix time the server started (`created` of the model).
    pub started: u64,
    /// The vocabulary for grammars, built by the first structured request.
    pub grammars: std::sync::OnceLock<Result<constrain::GrammarEngine, String>>,
}

impl AppState {
    /// The grammar engine (built on first use: a large vocabulary's token
    /// trie takes a moment, and most servers never need it).
    pub fn grammars(&self) -> Result<&constrain::GrammarEngine, ApiError> {
        self.grammars
            .get_or_init(|| constrain::GrammarEngine::new(self.tokenizer.clone()))
            .as_ref()
            .map_err(|e| ApiError::internal(format!("structured output: {e}")))
    }
}

/// A loaded model behind the HTTP API.
pub struct Server {
    state: Arc<AppState>,
    conn: conn::ConnOptions,
}

/// Refuses an API key that would not protect anything: empty or only
/// whitespace (an unset shell variable), or with whitespace around it
/// (which no `Authorization` header can carry).
pub fn check_api_key(key: &str) -> Result<(), String> {
    if key.trim().is_empty() {
        return Err(
            "the API key is empty; give a non-empty key, or none to serve without one".into(),
        );
    }
    if key.trim() != key || key.chars().any(char::is_control) {
        return Err("the API key has whitespace or control characters around or in it".into());
    }
    Ok(())
}

impl Server {
    /// Loads the tokenizer and chat template from `model_dir`, then opens
    /// the session with `open` on the engine thread (so the session never
    /// crosses threads) and waits until it is ready.
    pub fn start(
        model_dir: &Path,
        opts: ServerOptions,
        open: Box<dyn FnOnce() -> Result<Session, String> + Send>,
    ) -> Result<Server, String> {
        if let Some(k) = &opts.api_key {
            check_api_key(k)?;
        }
        if opts.max_connections == 0 {
            return Err("max_connections must be at least 1".into());
        }
        let tokenizer = Arc::new(Tokenizer::from_model_dir(model_dir).map_err(|e| e.to_string())?);
        let template = ChatTemplate::from_model_dir(model_dir).map_err(|e| e.to_string())?;
        let tool_format = ToolFormat::detect(template.source());
        let length_bound = LengthBound::from_tokenizer(&tokenizer);
        let prepare_threads = match opts.prepare_threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        let metrics = Arc::new(Metrics::default());
        // The template was compiled (a syntax error reported) before the
        // session opens; it renders within the budget of the context.
        let (engine, info) = EngineHandle::start(
            open,
            tokenizer.clone(),
            opts.engine.clone(),
            metrics.clone(),
        )?;
        let model_name = opts.model_name.clone().unwrap_or_else(|| {
            model_dir
                .canonicalize()
                .ok()
                .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "moeflux".into())
        });
        Ok(Server {
            state: Arc::new(AppState {
                engine,
                tokenizer,
                template: Arc::new(template.with_context_window(info.max_context)),
                tool_format,
                defaults: Defaults::from_model_dir(model_dir),
                model_name,
                info,
                metrics,
                api_key: opts.api_key,
                ui: opts.ui,
                max_body_bytes: opts.max_body_bytes,
                body_timeout: opts.body_timeout,
                prepare: Arc::new(tokio::sync::Semaphore::new(prepare_threads)),
                length_bound,
                started: unix_now(),
                grammars: std::sync::OnceLock::new(),
            }),
            conn: conn::ConnOptions {
                max_connections: opts.max_connections,
                header_timeout: opts.header_timeout,
                idle_timeout: opts.idle_timeout,
            },
        })
    }

    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// The HTTP routes (for embedding in a larger axum app, or tests).
    pub fn router(&self) -> axum::Router {
        routes::router(self.state.clone())
    }

    /// Serves on `listener` until `shutdown` resolves, then waits for the
    /// open connections to finish their requests.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        conn::serve(
            listener,
            self.router(),
            routes::over_limit_router(self.state.clone()),
            self.conn,
            self.state.metrics.clone(),
            shutdown,
        )
        .await
    }
}

pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A random 64-bit value (the standard library's per-process random hash
/// keys, mixed with a counter): ids and default seeds, nothing secret.
pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.finish()
}

/// `prefix` + 24 hex digits.
pub(crate) fn random_id(prefix: &str) -> String {
    format!("{prefix}{:016x}{:08x}", random_u64(), random_u64() as u32)
}
