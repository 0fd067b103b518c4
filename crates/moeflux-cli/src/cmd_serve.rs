//! `moeflux serve`: the OpenAI- and Anthropic-compatible HTTP server of `moeflux-server`
//! on one model.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
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
    /// Require `Authorization: Bearer KEY` or `x-api-key: KEY` (every endpoint but /health).
    /// Visible to other users in `ps`: prefer --api-key-file or the
    /// MOEFLUX_API_KEY environment variable.
    #[arg(long, conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from this file (surrounding whitespace removed).
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// Connections served at once; a few more answer /health only.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
    /// Seconds a client has to send a request's headers.
    #[arg(long, default_value_t = 10, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout: u64,
    /// Seconds a client has to send a request's body (408 after).
    #[arg(long, default_value_t = 30, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub body_timeout: u64,
    /// Seconds an idle keep-alive connection stays open.
    #[arg(long, default_value_t = 60, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout: u64,
    /// Requests that may wait for the model beyond the running ones; more
    /// get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Requests generating at once: their tokens share each forward pass,
    /// and each expert a step needs is read once for all of them. 1 runs
    /// one request at a time. Each takes its own KV cache / state.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub parallel: u64,
    /// Tokens per engine step: every running request's next token, then
    /// chunks of prompts being prefilled, up to this many (a long prompt
    /// never stalls the others for longer than one step).
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub step_tokens: u64,
    /// Write one JSON line per engine step to FILE: its sequences and
    /// tokens, and the milliseconds before, in and after its forward pass
    /// (where a served run's time goes).
    #[arg(long, value_name = "FILE")]
    pub step_log: Option<PathBuf>,
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
    /// Do not serve the chat page at `/` (it then answers 404).
    #[arg(long)]
    pub no_ui: bool,
}

/// The environment variable read for the API key when no flag gives one.
const API_KEY_ENV: &str = "MOEFLUX_API_KEY";

/// The API key from `--api-key`, else `--api-key-file`, else
/// `MOEFLUX_API_KEY`. An empty one is an error (an unset shell variable
/// must not turn authentication off), naming where it came from.
fn api_key(
    flag: Option<&str>,
    file: Option<&std::path::Path>,
    env: Option<String>,
) -> Result<Option<String>> {
    let (key, from) = match (flag, file, env) {
        (Some(k), _, _) => (k.to_string(), "--api-key".to_string()),
        (None, Some(path), _) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("--api-key-file: reading {}", path.display()))?;
            (
                text.trim().to_string(),
                format!("--api-key-file {}", path.display()),
            )
        }
        (None, None, Some(k)) => (k, API_KEY_ENV.to_string()),
        (None, None, None) => return Ok(None),
    };
    if let Err(e) = moeflux_server::check_api_key(&key) {
        bail!("{from}: {e}");
    }
    Ok(Some(key))
}

pub fn run(args: ServeArgs) -> Result<()> {
    if args.model.dist_init.is_some() {
        // Requests reach one process; the other ranks would never step.
        anyhow::bail!("serve does not take --dist-init (use --gpus for several GPUs of one host)");
    }
    let env_key = std::env::var_os(API_KEY_ENV)
        .map(|v| {
            v.into_string()
                .map_err(|_| anyhow::anyhow!("{API_KEY_ENV} is not valid UTF-8"))
        })
        .transpose()?;
    let key = api_key(
        args.api_key.as_deref(),
        args.api_key_file.as_deref(),
        env_key,
    )?;
    let opts = ServerOptions {
        api_key: key,
        model_name: args.model_name.clone(),
        max_body_bytes: usize::try_from(args.max_body).unwrap_or(usize::MAX),
        header_timeout: Duration::from_secs(args.header_timeout),
        body_timeout: Duration::from_secs(args.body_timeout),
        idle_timeout: Duration::from_secs(args.idle_timeout),
        max_connections: usize::try_from(args.max_connections).unwrap_or(usize::MAX),
        prepare_threads: 0,
        ui: !args.no_ui,
        engine: EngineOptions {
            max_queue: args.max_queue,
            parallel: args.parallel as usize,
            step_tokens: args.step_tokens as usize,
            step_log: args.step_log.clone(),
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
        if st.api_key.is_none() && !local.ip().is_loopback() {
            eprintln!(
                "warning: listening on {} without an API key: anyone who can reach it may use the model (set --api-key-file or {API_KEY_ENV})",
                local.ip()
            );
        }
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
        if st.ui {
            eprintln!("chat page: http://{local}/ (--no-ui turns it off)");
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_sources_and_empty_keys() {
        assert_eq!(api_key(None, None, None).unwrap(), None);
        assert_eq!(
            api_key(Some("k"), None, Some("e".into()))
                .unwrap()
                .as_deref(),
            Some("k")
        );
        assert_eq!(
            api_key(None, None, Some("e".into())).unwrap().as_deref(),
            Some("e")
        );
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("key");
        std::fs::write(&f, "sk-file\n").unwrap();
        assert_eq!(
            api_key(None, Some(&f), Some("e".into()))
                .unwrap()
                .as_deref(),
            Some("sk-file")
        );
        for (flag, file, env, named) in [
            (Some(""), None, None, "--api-key"),
            (Some("  "), None, None, "--api-key"),
            (None, None, Some(String::new()), API_KEY_ENV),
        ] {
            let e = api_key(flag, file, env).unwrap_err().to_string();
            assert!(e.starts_with(named) && e.contains("empty"), "{e}");
        }
        std::fs::write(&f, " \n").unwrap();
        let e = api_key(None, Some(&f), None).unwrap_err().to_string();
        assert!(e.contains("--api-key-file") && e.contains("empty"), "{e}");
    }
}
