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
    #[arg(required_unless_present = "model")]
    pub src: Option<PathBuf>,
    /// Model directory to create.
    #[arg(required_unless_present = "model")]
    pub dst: Option<PathBuf>,
    /// Also write low-width copies of the routed experts at 2 (or 3) bits
    /// (each affine expert dequantized and quantized again), which
    /// `--low-width-experts` runs in their place.
    #[arg(long, value_name = "BITS", value_parser = parse_low_width_bits)]
    pub low_width_copies: Option<u32>,
    /// With --low-width-copies and no SRC DST: add the copies to this
    /// existing model directory (replacing copies made before).
    #[arg(long, conflicts_with_all = ["src", "dst", "expert_bits", "force"],
          requires = "low_width_copies")]
    pub model: Option<PathBuf>,
    /// Width of the routed experts: re-quantize them to 2, 4 or 8 bits
    /// (2 uses flash-moe's 2-bit scheme). Default: keep the source's.
    #[arg(long, value_name = "BITS", value_parser = parse_expert_bits)]
    pub expert_bits: Option<u32>,
    /// Replace DST if it already exists.
    #[arg(long)]
    pub force: bool,
}

fn parse_low_width_bits(s: &str) -> std::result::Result<u32, String> {
    match s.parse::<u32>() {
        Ok(b) if moeflux::convert::low_width::LOW_WIDTH_BITS.contains(&b) => Ok(b),
        _ => Err(format!(
            "`{s}` is not one of {:?}",
            moeflux::convert::low_width::LOW_WIDTH_BITS
        )),
    }
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
    if let Some(dir) = &args.model {
        let bits = args
            .low_width_copies
            .expect("clap requires it with --model");
        return low_width_copies(dir, bits);
    }
    let (src, dst) = match (&args.src, &args.dst) {
        (Some(s), Some(d)) => (s.clone(), d.clone()),
        _ => anyhow::bail!("convert needs SRC and DST (or --model DIR --low-width-copies BITS)"),
    };
    let cancel = crate::cancel_on_ctrl_c()?;
    let bar = ConvertBar::new();
    let on_progress = |p: &ConvertProgress| bar.update(p);
    let opts = ConvertOptions {
        expert_bits: args.expert_bits,
        force: args.force,
        progress: Some(&on_progress),
        cancel: Some(&cancel),
    };
    let result = convert(&src, &dst, &opts);
    bar.finish();
    let r = result.with_context(|| format!("converting {} to {}", src.display(), dst.display()))?;

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
    match args.low_width_copies {
        Some(bits) => low_width_copies(&dst, bits),
        None => Ok(()),
    }
}

/// Writes `bits`-wide copies of the experts of the model in `dir`.
fn low_width_copies(dir: &std::path::Path, bits: u32) -> Result<()> {
    let t0 = std::time::Instant::now();
    let bar = crate::progress::count_bar("low-width copies", "layers");
    let progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let result = moeflux::convert::low_width::write_low_width_copies(dir, bits, &progress);
    bar.finish_and_clear();
    let m = result.with_context(|| format!("writing low-width copies in {}", dir.display()))?;
    println!(
        "{} layers of experts copied at {bits} bits in {:.1} s: {} -> {} (use them with \
         --low-width-experts)",
        m.low_width_experts.len(),
        t0.elapsed().as_secs_f64(),
        human_bytes(m.expert_bytes()),
        human_bytes(m.low_width_bytes()),
    );
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
