//! `moeflux serve`: the OpenAI-compatible HTTP server of `moeflux-server`
//! on one model.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use moeflux_server::{EngineOptions, PrefixCacheOptions, Server, ServerOptions};

use crate::gen_args::{parse_size, ModelArgs};

#[derive(Debug, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (127.0.0.1: this machine only).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (every endpoint but /health).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait for the model; more get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// The model id clients see (default: the model directory's name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Largest request body, e.g. `4M`.
    #[arg(long, default_value = "4M", value_parser = parse_size)]
    pub max_body: u64,
    /// RAM for snapshots of recent conversations (prefix reuse across
    /// interleaved conversations), e.g. `2G`; 0 turns the cache off.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    pub prefix_cache: u64,
    /// Directory where snapshots evicted from RAM go (default: none).
    #[arg(long)]
    pub prefix_cache_dir: Option<PathBuf>,
    /// Disk budget of --prefix-cache-dir.
    #[arg(long, default_value = "8G", value_parser = parse_size)]
    pub prefix_cache_disk: u64,
    /// Evaluate every prompt from scratch (no session or cache reuse; for
    /// measurements).
    #[arg(long)]
    pub no_prefix_reuse: bool,
}

pub fn run(args: ServeArgs) -> Result<()> {
    let opts = ServerOptions {
        api_key: args.api_key.clone(),
        model_name: args.model_name.clone(),
        max_body_bytes: usize::try_from(args.max_body).unwrap_or(usize::MAX),
        engine: EngineOptions {
            max_queue: args.max_queue,
            prefix_cache: PrefixCacheOptions {
                ram_bytes: args.prefix_cache,
                disk_dir: args.prefix_cache_dir.clone(),
                disk_bytes: args.prefix_cache_disk,
            },
            no_prefix_reuse: args.no_prefix_reuse,
            ..Default::default()
        },
    };
    let m = args.model.clone();
    let dir = args.model.dir()?;
    let server = Server::start(
        &dir,
        opts,
        Box::new(move || {
            let s = m.open_session().map_err(|e| format!("{e:#}"))?;
            m.report(&s);
            Ok(s)
        }),
    )
    .map_err(anyhow::Error::msg)
    .with_context(|| format!("starting the server on {}", dir.display()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("moeflux-http")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        let st = server.state();
        eprintln!(
            "moeflux serve: model `{}` ({}, context {} tokens) listening on http://{local}{}",
            st.model_name,
            st.info.backend,
            st.info.max_context,
            if st.api_key.is_some() {
                " (API key required)"
            } else {
                ""
            },
        );
        let shutdown = async {
            // Ctrl-C or SIGTERM (service managers): stop accepting, let
            // running answers finish.
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            let sigterm = async {
                match term.as_mut() {
                    Some(t) => {
                        t.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = sigterm => {}
            }
            eprintln!("\nshutting down (Ctrl-C again to exit at once)");
            tokio::spawn(async {
                let _ = tokio::signal::ctrl_c().await;
                std::process::exit(130);
            });
        };
        server.serve(listener, shutdown).await.context("serving")
    })?;
    // Open streams are not waited on for long.
    rt.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}
