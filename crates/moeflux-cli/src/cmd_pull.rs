//! `moeflux pull ORG/NAME[@REVISION][:QUANT]`: download a model from the
//! Hugging Face Hub into its cache and convert it once into moeflux's
//! models directory; prints that directory.

use std::path::Path;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result};
use clap::Args;
use moeflux::hub::{pull, HubConfig, PullOptions, PullProgress, Pulled, RepoSpec};

use crate::progress::{human_bytes, PullBar};

#[derive(Debug, Args)]
pub struct PullArgs {
    /// The model: ORG/NAME, optionally @REVISION (branch, tag or commit) and
    /// :QUANT (a GGUF repo's quantization, e.g. Q4_K_M).
    #[arg(value_name = "ORG/NAME[@REVISION][:QUANT]", value_parser = parse_spec)]
    pub spec: RepoSpec,
}

fn parse_spec(s: &str) -> std::result::Result<RepoSpec, String> {
    RepoSpec::parse(s).map_err(|e| e.to_string())
}

/// Pulls `spec` with a progress bar on stderr and one summary line;
/// `models_dir` replaces the configured models directory.
pub fn pull_model(
    spec: &RepoSpec,
    models_dir: Option<&Path>,
    cancel: Option<&AtomicBool>,
) -> Result<Pulled> {
    let mut cfg = HubConfig::from_env()?;
    if let Some(d) = models_dir {
        cfg.models_dir = d.to_path_buf();
    }
    let bar = PullBar::new();
    let on_progress = |p: &PullProgress| bar.update(p);
    let opts = PullOptions {
        progress: Some(&on_progress),
        cancel,
    };
    let result = pull(spec, &cfg, &opts);
    bar.finish();
    let p = result.with_context(|| format!("pulling {spec}"))?;
    let short = &p.commit[..12];
    match &p.converted {
        None => eprintln!("{spec} ({short}): {}", p.dir.display()),
        Some(r) => {
            eprintln!(
                "{spec} ({short}): downloaded {} files ({}), converted {} in {:.1} s -> {}",
                p.fetched.files,
                human_bytes(p.fetched.bytes),
                r.architecture,
                r.elapsed.as_secs_f64(),
                p.dir.display()
            );
            crate::cmd_convert::print_notes(r);
        }
    }
    Ok(p)
}

pub fn run(args: PullArgs, models_dir: Option<&Path>) -> Result<()> {
    let cancel = crate::cancel_on_ctrl_c()?;
    let p = pull_model(&args.spec, models_dir, Some(&cancel))?;
    println!("{}", p.dir.display());
    Ok(())
}
