//! `moeflux logits`: float32 logits of every position as a numpy `.npy`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use moeflux::LogitsMode;
use npyz::WriterBuilder;

use crate::gen_args::ModelArgs;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EvalMode {
    /// All tokens in one eval call.
    Batch,
    /// One token per eval call.
    Incremental,
}

#[derive(Debug, Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Comma-separated token ids, e.g. 5,17,42.
    #[arg(long)]
    pub tokens: String,
    /// Output file: float32 array [n_tokens, vocab]; `-` writes it to
    /// standard output.
    #[arg(long)]
    pub output: PathBuf,
    #[arg(long, value_enum, default_value_t = EvalMode::Batch)]
    pub mode: EvalMode,
    /// Also write every block's output (embedding, per layer the norms and
    /// what the mixer and the MLP added to the residual stream, the logits)
    /// as .npy files with an index trace.json into DIR; with --mode
    /// incremental, one subdirectory per token (t0000, t0001, ...).
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
}

/// Comma-separated token ids; errors name `flag` (`--tokens`, `--prompt-ids`).
pub fn parse_tokens(flag: &str, s: &str) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for (i, part) in s.split(',').enumerate() {
        let p = part.trim();
        if p.is_empty() {
            continue;
        }
        out.push(
            p.parse::<u32>()
                .with_context(|| format!("{flag}: item {} (`{p}`) is not a token id", i + 1))?,
        );
    }
    if out.is_empty() {
        bail!("{flag}: no token ids given");
    }
    Ok(out)
}

pub fn run(args: LogitsArgs) -> Result<()> {
    let tokens = parse_tokens("--tokens", &args.tokens)?;
    let to_stdout = args.output.as_os_str() == "-";
    if !to_stdout {
        // Before the evaluation, not after it: a directory or device here.
        moeflux::fsutil::check_target(&args.output)?;
    }
    let mut session = args.model.open_session()?;
    args.model.report(&session);
    let vocab = session.vocab_size();
    // Validate every id before evaluating anything.
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        bail!(
            "--tokens: item {} is {t}, outside the vocabulary (size {vocab})",
            i + 1
        );
    }
    let mut eval = |tokens: &[u32], mode, step: Option<usize>| -> Result<Vec<f32>> {
        let Some(dir) = &args.trace else {
            return Ok(session.eval(tokens, mode)?);
        };
        let (logits, trace) = session.eval_traced(tokens, mode)?;
        let dir = match step {
            Some(i) => dir.join(format!("t{i:04}")),
            None => dir.clone(),
        };
        trace
            .write_dir(&dir)
            .with_context(|| format!("writing the trace to {}", dir.display()))?;
        Ok(logits)
    };
    let logits = match args.mode {
        EvalMode::Batch => eval(&tokens, LogitsMode::All, None)?,
        EvalMode::Incremental => {
            let mut all = Vec::with_capacity(tokens.len() * vocab);
            for (i, &t) in tokens.iter().enumerate() {
                all.extend(eval(&[t], LogitsMode::Last, Some(i))?);
            }
            all
        }
    };
    let shape = [tokens.len() as u64, vocab as u64];
    let write_npy = |w: &mut dyn std::io::Write| {
        let mut npy = npyz::WriteOptions::new()
            .default_dtype()
            .shape(&shape)
            .writer(w)
            .begin_nd()?;
        npy.extend(logits.iter().copied())?;
        npy.finish()
    };
    if to_stdout {
        let mut out = std::io::BufWriter::new(std::io::stdout().lock());
        write_npy(&mut out)
            .and_then(|()| std::io::Write::flush(&mut out))
            .context("writing the logits to standard output")?;
    } else {
        moeflux::fsutil::write_file_atomic(&args.output, |w| write_npy(w))?;
    }
    eprintln!(
        "wrote {} x {} logits to {}",
        tokens.len(),
        vocab,
        if to_stdout {
            "standard output".into()
        } else {
            args.output.display().to_string()
        }
    );
    if let Some(dir) = &args.trace {
        eprintln!("wrote every block's output to {}", dir.display());
    }
    Ok(())
}
