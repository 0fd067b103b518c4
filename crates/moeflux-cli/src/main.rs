//! The `moeflux` command. One module per subcommand: adding one is a variant
//! of [`Command`] plus a `cmd_<name>.rs` with its `Args` and `run`.

mod cmd_bench;
mod cmd_chat;
mod cmd_convert;
mod cmd_inspect;
mod cmd_logits;
mod cmd_perplexity;
mod cmd_pull;
mod cmd_run;
mod cmd_serve;
mod cmd_synth;
mod cmd_tokenize;
mod config_file;
mod demo;
mod gen_args;
mod model_ref;
mod output;
mod progress;

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "moeflux",
    version,
    about = "Run Mixture-of-Experts models larger than memory: dense weights resident, experts streamed from disk"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where models pulled from the Hugging Face Hub are converted to
    /// (default: $MOEFLUX_HOME/models, else ~/.cache/moeflux/models).
    #[arg(long, global = true, value_name = "DIR")]
    models_dir: Option<std::path::PathBuf>,
    /// A TOML file of settings: keys are long flags (`port = 8080`), at the top for every
    /// command that has the flag or in a `[serve]`-style table for one command; flags given
    /// here win over it.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<std::path::PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from a prompt, streamed to stdout.
    Run(cmd_run::RunArgs),
    /// Interactive multi-turn chat with the model's chat template.
    Chat(cmd_chat::ChatArgs),
    /// OpenAI- and Anthropic-compatible HTTP server (chat, completions, messages, tools, streaming).
    Serve(cmd_serve::ServeArgs),
    /// Measure prompt-processing and generation speed on a model.
    Bench(cmd_bench::BenchArgs),
    /// Download a model from the Hugging Face Hub and convert it once (prints its directory).
    Pull(cmd_pull::PullArgs),
    /// Convert an mlx-lm or Hugging Face checkpoint into a moeflux model directory.
    Convert(cmd_convert::ConvertArgs),
    /// Write a model directory with random weights at a real model's shapes (benchmarks, tests).
    Synth(cmd_synth::SynthArgs),
    /// Describe a model directory: architecture, shapes, quantization, sizes.
    Inspect(cmd_inspect::InspectArgs),
    /// Write the float32 logits of every position of a token list as .npy.
    Logits(cmd_logits::LogitsArgs),
    /// Perplexity of a text file (held-out quality), in windows like Hugging Face's recipe.
    Perplexity(cmd_perplexity::PerplexityArgs),
    /// Encode text to token ids, or decode ids to text, with a model's tokenizer.
    Tokenize(cmd_tokenize::TokenizeArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) to stdout.
    Completions {
        /// The shell: `moeflux completions bash > ~/.local/share/bash-completion/completions/moeflux`
        shell: clap_complete::Shell,
    },
}

impl Command {
    /// The command's model argument, when it takes one.
    fn model_mut(&mut self) -> Option<&mut model_ref::ModelRef> {
        match self {
            Command::Run(a) => a.model.model.as_mut(),
            Command::Chat(a) => a.model.model.as_mut(),
            Command::Serve(a) => a.model.model.as_mut(),
            Command::Bench(a) => a.model.model.as_mut(),
            Command::Logits(a) => a.model.model.as_mut(),
            Command::Perplexity(a) => a.model.model.as_mut(),
            Command::Tokenize(a) => Some(&mut a.model),
            Command::Inspect(a) => Some(&mut a.dir),
            Command::Pull(_)
            | Command::Convert(_)
            | Command::Synth(_)
            | Command::Completions { .. } => None,
        }
    }
}

/// Exit status after Ctrl-C (128 + SIGINT).
const EXIT_INTERRUPTED: u8 = 130;

/// The error chain on one line, `outer: inner: ...`, skipping a cause whose
/// text its parent already ends with (typed errors print their source).
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if out.ends_with(&s) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s);
    }
    out.replace('\n', " ")
}

fn cancelled(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<moeflux::Error>(),
            Some(moeflux::Error::Cancelled)
        )
    })
}

/// The SIGTERM or SIGHUP that cancelled a writer (0: none): the exit status
/// is then 128 + it, as if the signal had killed the process.
static TERMINATED_BY: AtomicI32 = AtomicI32::new(0);

/// For long writers (convert, synth): the first Ctrl-C, SIGTERM or SIGHUP
/// sets the returned flag (the writer stops and removes its partial
/// output), a second exits at once (the next run removes what is left).
fn cancel_on_ctrl_c() -> anyhow::Result<Arc<AtomicBool>> {
    let cancel = Arc::new(AtomicBool::new(false));
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        let flag = cancel.clone();
        // SAFETY: the action only touches atomics and calls `_exit`, all
        // async-signal-safe.
        unsafe {
            signal_hook_registry::register(sig, move || {
                if flag.swap(true, Ordering::SeqCst) {
                    libc::_exit(128 + sig);
                }
                TERMINATED_BY.store(sig, Ordering::SeqCst);
            })
        }
        .with_context(|| format!("installing the handler of signal {sig}"))?;
    }
    let presses = AtomicUsize::new(0);
    let flag = cancel.clone();
    ctrlc::set_handler(move || {
        if presses.fetch_add(1, Ordering::SeqCst) == 0 {
            flag.store(true, Ordering::SeqCst);
            eprintln!("\ninterrupted: stopping and removing the partial output...");
        } else {
            std::process::exit(130);
        }
    })
    .context("installing the Ctrl-C handler")?;
    Ok(cancel)
}

fn main() -> ExitCode {
    let args = match config_file::expand(std::env::args_os().collect(), &Cli::command()) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            return ExitCode::from(2);
        }
    };
    let mut cli = Cli::parse_from(args);
    if !matches!(cli.command, Command::Serve(_)) {
        // `moeflux inspect | head`: end quietly when the reader goes away,
        // like other Unix tools, instead of failing (or panicking in
        // `println!`) on EPIPE. Not for `serve`, whose sockets must report
        // a gone client as an error.
        // SAFETY: setting a signal disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let models_dir = cli.models_dir.clone();
    // `--model hf:...`: pulled here, once, so every command gets a directory.
    let resolved = match cli.command.model_mut() {
        Some(m) => m.resolve(models_dir.as_deref()),
        None => Ok(()),
    };
    let result = resolved.and_then(|()| match cli.command {
        Command::Pull(a) => cmd_pull::run(a, models_dir.as_deref()),
        Command::Run(a) => cmd_run::run(a),
        Command::Chat(a) => cmd_chat::run(a),
        Command::Serve(a) => cmd_serve::run(a),
        Command::Bench(a) => cmd_bench::run(a),
        Command::Convert(a) => cmd_convert::run(a),
        Command::Synth(a) => cmd_synth::run(a),
        Command::Inspect(a) => cmd_inspect::run(a),
        Command::Logits(a) => cmd_logits::run(a),
        Command::Perplexity(a) => cmd_perplexity::run(a),
        Command::Tokenize(a) => cmd_tokenize::run(a),
        Command::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "moeflux",
                &mut std::io::stdout(),
            );
            Ok(())
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if cancelled(&e) => match TERMINATED_BY.load(Ordering::SeqCst) {
            0 => {
                eprintln!("interrupted");
                ExitCode::from(EXIT_INTERRUPTED)
            }
            sig => {
                eprintln!("terminated by signal {sig}; the partial output was removed");
                ExitCode::from(128 + sig as u8)
            }
        },
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_on_one_line_without_repeats() {
        let io = moeflux::Error::io(
            "/x/config.json",
            std::io::Error::new(std::io::ErrorKind::NotFound, "not found"),
        );
        let e = anyhow::Error::new(io).context("converting a to b");
        assert_eq!(one_line(&e), "converting a to b: /x/config.json: not found");
        let c = anyhow::Error::new(moeflux::Error::Cancelled).context("converting");
        assert!(cancelled(&c));
        assert!(!cancelled(&e));
    }
}
