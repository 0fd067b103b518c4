//! `moeflux convert SRC DST`: an mlx-lm or Hugging Face checkpoint, or a
//! GGUF file -> a moeflux model directory.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use moeflux::convert::{convert, ConvertOptions, ConvertProgress, ConvertReport};

use crate::progress::{human_bytes, ConvertBar};

#[derive(Debug, Args)]
pub struct ConvertArgs {
    /// Source checkpoint directory: mlx-lm quantized (`mlx_lm.convert -q`), or
    /// unquantized bf16/f16/f32 (Hugging Face or mlx layout; quantized here
    /// exactly as `mlx_lm.convert -q --q-bits 4 --q-group-size 64` would);
    /// or a GGUF file (any part of a split `NAME-00001-of-0000N.gguf`).
    pub src: PathBuf,
    /// Model directory to create.
    pub dst: PathBuf,
    /// Width of the routed experts: re-quantize them to 2, 4 or 8 bits
    /// (2 uses flash-moe's 2-bit scheme). Default: keep the source's.
    #[arg(long, value_name = "BITS", value_parser = parse_expert_bits)]
    pub expert_bits: Option<u32>,
    /// Replace DST if it already exists.
    #[arg(long)]
    pub force: bool,
}

fn parse_expert_bits(s: &str) -> std::result::Result<u32, String> {
    match s {
        "2" => Ok(2),
        "4" => Ok(4),
        "8" => Ok(8),
        _ => Err(format!("`{s}` is not one of 2, 4, 8")),
    }
}

pub fn run(args: ConvertArgs) -> Result<()> {
    let cancel = crate::cancel_on_ctrl_c()?;
    let bar = ConvertBar::new();
    let on_progress = |p: &ConvertProgress| bar.update(p);
    let opts = ConvertOptions {
        expert_bits: args.expert_bits,
        force: args.force,
        progress: Some(&on_progress),
        cancel: Some(&cancel),
    };
    let result = convert(&args.src, &args.dst, &opts);
    bar.finish();
    let r = result.with_context(|| {
        format!(
            "converting {} to {}",
            args.src.display(),
            args.dst.display()
        )
    })?;

    let bits = match (r.source_expert_bits, r.expert_bits) {
        (Some(a), Some(b)) if a != b => format!(", experts {a}->{b}-bit"),
        (_, Some(b)) => format!(", experts {b}-bit"),
        _ => String::new(),
    };
    println!(
        "converted {} ({} source, {} layers, {} MoE): {} tensors, dense {}, experts {}{bits} in {:.2} s -> {}",
        r.architecture,
        r.source_kind.as_str(),
        r.layers,
        r.moe_layers,
        r.tensors,
        human_bytes(r.dense_bytes),
        human_bytes(r.expert_bytes),
        r.elapsed.as_secs_f64(),
        r.dst.display()
    );
    print_notes(&r);
    Ok(())
}

/// What a conversion left out or re-quantized, on stderr, so nothing
/// disappears silently: dropped tensors (MTP layers, vision parts, a tied
/// lm_head), a GGUF's tensor types and its re-quantized tensors.
pub fn print_notes(r: &ConvertReport) {
    if let Some(line) = r.dropped_summary() {
        eprintln!("{line}");
    }
    if !r.gguf_types.is_empty() {
        let t: Vec<String> = r
            .gguf_types
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect();
        eprintln!("GGUF tensor types: {}", t.join(", "));
    }
    for w in &r.warnings {
        eprintln!("warning: {w}");
    }
}

#[cfg(test)]
mod tests {
    use crate::progress::human_bytes;

    #[test]
    fn sizes() {
        assert_eq!(human_bytes(1_500), "1.5 KB");
        assert_eq!(human_bytes(2_340_000), "2.3 MB");
        assert_eq!(human_bytes(210_000_000_000), "210.00 GB");
    }

    #[test]
    fn expert_bits_values() {
        assert_eq!(super::parse_expert_bits("2"), Ok(2));
        assert!(super::parse_expert_bits("3").is_err());
    }
}
