//! `moeflux synth --preset NAME DST`: a model directory with random weights
//! at a real model's shapes.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use moeflux::convert::ConvertProgress;
use moeflux::synth::{find_preset, synth, RouterSkew, SynthOptions};

use crate::progress::{human_bytes, ConvertBar};

#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Model shape: qwen3.6-35b-a3b, qwen3.5-397b-a17b, qwen3-235b-a22b,
    /// qwen3-30b-a3b, glm-4.6, glm-4.5-air, cogito-v2-671b (DeepSeek-V3
    /// architecture), gpt-oss-120b, gpt-oss-20b, or the test fixtures' sizes qwen3.5-tiny,
    /// qwen3-moe-tiny, glm-4.5-tiny.
    #[arg(long, value_name = "NAME")]
    pub preset: String,
    /// Write only the first N layers (identical to the full model's).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Routed experts as MLX affine of this width: 2, 4 or 8 bits (group
    /// size 64). Default: 4-bit affine, but MXFP4 (the release's format)
    /// for the gpt-oss presets.
    #[arg(long, value_name = "BITS")]
    pub expert_bits: Option<u32>,
    /// The same seed gives the same bytes.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Bias the routers so that expert popularity follows a Zipf law of
    /// exponent ALPHA (per layer, over a seeded ranking of the experts),
    /// like the routing locality of trained models. Default: uniform.
    #[arg(long, value_name = "zipf:ALPHA")]
    pub router_skew: Option<String>,
    /// Copy this tokenizer.json, or the tokenizer and chat-template files of
    /// this directory (e.g. the real model's), so that `moeflux run` works.
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// Replace DST if it already exists.
    #[arg(long)]
    pub force: bool,
    /// Model directory to create.
    pub dst: PathBuf,
}

pub fn run(args: SynthArgs) -> Result<()> {
    let preset = find_preset(&args.preset)?;
    let router_skew = args
        .router_skew
        .as_deref()
        .map(RouterSkew::parse)
        .transpose()?;
    let cancel = crate::cancel_on_ctrl_c()?;
    let bar = ConvertBar::new();
    let on_progress = |p: &ConvertProgress| bar.update(p);
    let defaults = SynthOptions::new(preset.name, preset.spec);
    let opts = SynthOptions {
        layers: args.layers,
        expert_bits: args.expert_bits.unwrap_or(defaults.expert_bits),
        expert_mxfp4: defaults.expert_mxfp4 && args.expert_bits.is_none(),
        seed: args.seed,
        router_skew,
        tokenizer: args.tokenizer.clone(),
        force: args.force,
        progress: Some(&on_progress),
        cancel: Some(&cancel),
        ..defaults
    };
    let result = synth(&args.dst, &opts);
    bar.finish();
    let r = result.with_context(|| format!("writing {}", args.dst.display()))?;

    let bytes = r.dense_bytes + r.expert_bytes;
    println!(
        "synthesized {} ({}, {} of {} layers, experts {}, seed {}, router {}): {} tensors, \
         dense {}, experts {} in {:.2} s ({:.0} MB/s) -> {}",
        args.preset,
        r.architecture,
        r.layers,
        r.preset_layers,
        if opts.expert_mxfp4 {
            "MXFP4".to_string()
        } else {
            format!("{}-bit", opts.expert_bits)
        },
        args.seed,
        router_skew.map_or("uniform".to_string(), |s| s.to_string()),
        r.tensors,
        human_bytes(r.dense_bytes),
        human_bytes(r.expert_bytes),
        r.elapsed.as_secs_f64(),
        bytes as f64 / 1e6 / r.elapsed.as_secs_f64(),
        r.dst.display()
    );
    Ok(())
}
