//! `moeflux perplexity`: how well the model predicts a text file.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use moeflux::perplexity::{perplexity, perplexity_against, PerplexityOptions};
use moeflux::session::{Activations, Backend};
use moeflux::text::tokenizer::Tokenizer;

use crate::gen_args::{interrupt_flag, ModelArgs};

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 text file, tokenized whole with no special tokens added.
    pub file: PathBuf,
    /// Tokens per window: the most context a prediction sees.
    #[arg(long, default_value_t = 512)]
    pub window: usize,
    /// Tokens between window starts (default: the window, so windows do not
    /// overlap); smaller gives predictions more context at more compute.
    #[arg(long)]
    pub stride: Option<usize>,
    /// Tokens per evaluation batch inside a window.
    #[arg(long, default_value_t = 256)]
    pub batch: usize,
    /// Score only the first N tokens of the text.
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    /// Also score the text on the CPU with exact f32 activations and the
    /// model's own experts (a second session) and report how far this
    /// run's next-token distributions are from those: mean and largest KL
    /// divergence, and how often the most likely token agrees (for
    /// `--cpu-activations q8`, `--low-width-experts` or the GPU).
    #[arg(long)]
    pub kl: bool,
}

pub fn run(mut args: PerplexityArgs) -> Result<()> {
    let text =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let text = String::from_utf8(text)
        .with_context(|| format!("{} is not UTF-8 text", args.file.display()))?;
    let dir = args.model.dir()?;
    let tokenizer = Tokenizer::from_model_dir(&dir)?;
    let mut tokens = tokenizer.encode(&text, false)?;
    if let Some(n) = args.max_tokens {
        tokens.truncate(n);
    }
    if tokens.len() < 2 {
        bail!(
            "{}: {} token(s) after tokenizing; perplexity needs at least 2",
            args.file.display(),
            tokens.len()
        );
    }
    // The session needs no more context than one window.
    args.model.ctx.get_or_insert(args.window);
    let opts = PerplexityOptions {
        window: args.window,
        stride: args.stride.unwrap_or(args.window),
        batch: args.batch,
    };
    let mut session = args.model.open_session()?;
    args.model.report(&session);
    let trained = session.config().max_position_embeddings;
    if opts.window > trained {
        eprintln!(
            "warning: a window of {} tokens is longer than the {trained} positions the model \
             was made for",
            opts.window
        );
    }
    let mut reference = if args.kl {
        let mut r = args.model.clone();
        r.backend = Backend::Cpu;
        r.cpu_activations = Activations::F32;
        (r.low_width_experts, r.low_width_misses) = (false, false);
        r.low_width_below = None;
        (r.gpus, r.dist_init, r.rank, r.world) = (None, None, None, None);
        (r.gpu_memory, r.host_cache, r.cpu_experts) = (None, None, 0);
        eprintln!("reference: the CPU with f32 activations");
        Some(r.open_session().context("opening the reference session")?)
    } else {
        None
    };
    let cancel = interrupt_flag()?;
    let bar = crate::progress::token_bar("perplexity");
    let t0 = Instant::now();
    let progress = |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let result = match reference.as_mut() {
        Some(r) => perplexity_against(&mut session, r, &tokens, opts, Some(&cancel), progress),
        None => perplexity(&mut session, &tokens, opts, Some(&cancel), progress),
    };
    bar.finish_and_clear();
    let p = match result {
        Err(moeflux::Error::Cancelled) => bail!("interrupted"),
        r => r?,
    };
    let secs = t0.elapsed().as_secs_f64();
    let divergence = p.reference.map(|d| {
        serde_json::json!({
            "perplexity": (d.nll / p.scored as f64).exp(),
            "kl_mean": d.kl_sum / p.scored as f64,
            "kl_max": d.kl_max,
            "same_top": d.same_top as f64 / p.scored as f64,
        })
    });
    // `--low-width-misses`: how many of the expert uses ran on a copy.
    let cache = session.gpu_cache_stats();
    let low_share = (cache.low_hits + cache.low_misses > 0)
        .then(|| cache.low_width_share())
        .flatten();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "reference": divergence,
                "file": args.file,
                "model": dir,
                "backend": session.backend(),
                "tokens": p.tokens,
                "scored": p.scored,
                "nll_per_token": p.nll_per_token(),
                "perplexity": p.perplexity(),
                "window": opts.window,
                "stride": opts.stride,
                "seconds": secs,
                "gpu_cache_hit_rate": cache.hit_rate(),
                "gpu_low_width_share": low_share,
            })
        );
    } else {
        println!(
            "perplexity {:.4} | {:.5} nats/token over {} of {} tokens (window {}, stride {}) | {:.1} s, {:.0} tok/s",
            p.perplexity(),
            p.nll_per_token(),
            p.scored,
            p.tokens,
            opts.window,
            opts.stride,
            secs,
            p.scored as f64 / secs
        );
        if let Some(share) = low_share {
            println!(
                "{:.1}% of expert uses on low-width copies (GPU cache hits {:.1}%)",
                100.0 * share,
                100.0 * cache.hit_rate().unwrap_or(0.0)
            );
        }
        if let Some(d) = p.reference {
            let n = p.scored as f64;
            println!(
                "against the CPU with f32 activations (perplexity {:.4}): KL mean {:.3e}, max {:.3e} nats | same top token {:.2}%",
                (d.nll / n).exp(),
                d.kl_sum / n,
                d.kl_max,
                100.0 * d.same_top as f64 / n
            );
        }
    }
    Ok(())
}
