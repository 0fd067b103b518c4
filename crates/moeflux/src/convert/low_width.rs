//! Low-width copies of a model's routed experts: every affine expert
//! projection dequantized in f32 and quantized again (MLX affine, the same
//! group size, bf16 scales and biases) at fewer bits, written beside the
//! experts (`experts/low<bits>/layer_NNN.bin`) and listed in the manifest's
//! `low_width_experts`. A session may use them in place of the experts
//! (`SessionOptions::low_width_experts`): fewer bytes per expert read or
//! uploaded, at the quality cost `moeflux perplexity --kl` measures.

use std::io::Write;
use std::path::Path;

use rayon::prelude::*;
use safetensors::Dtype;

use crate::config::{QuantMode, QuantSpec};
use crate::error::{Error, Result};
use crate::format::{ExpertLayer, Manifest, MANIFEST_FILE};
use crate::model::moe::{ComponentLayout, ExpertLayout};
use crate::model::Model;
use crate::quant::{affine, Weight};

use super::dtype;
use super::plan::{layout_layer, ComponentShape};

/// Widths the copies may have.
pub const LOW_WIDTH_BITS: [u32; 2] = [2, 3];

/// Writes `bits`-wide copies of the routed experts of the model in `dir`
/// and records them in its manifest (replacing copies made before), each
/// file written whole to a temporary name and renamed, the manifest last.
/// `progress(done, total)` counts layers.
pub fn write_low_width_copies(
    dir: &Path,
    bits: u32,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Manifest> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let (mut manifest, config) = Model::read_dir(dir)?;
    manifest.check(&manifest_path, &config)?;
    if !LOW_WIDTH_BITS.contains(&bits) {
        return Err(Error::Invalid(format!(
            "low-width copies of {bits} bits: choose one of {LOW_WIDTH_BITS:?}"
        )));
    }
    if manifest.experts.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: the model has no routed experts to copy",
            dir.display()
        )));
    }
    // Every layer's copy is planned before any is written, so a layer
    // that cannot have one leaves nothing behind.
    let mut plan = Vec::with_capacity(manifest.experts.len());
    for el in &manifest.experts {
        let layout = ExpertLayout::from_manifest(el, &config, &manifest_path)?;
        let low = low_layer(el, &layout, bits)
            .map_err(|why| Error::format(&manifest_path, format!("layer {}: {why}", el.layer)))?;
        plan.push((el, layout, low));
    }
    let total = plan.len();
    for (done, (el, layout, low)) in plan.iter().enumerate() {
        write_layer(dir, el, layout, low)?;
        progress(done + 1, total);
    }
    let copies = plan.into_iter().map(|(_, _, low)| low).collect();
    manifest.low_width_experts = copies;
    manifest.check(&manifest_path, &config)?;
    let text = manifest.file_text();
    crate::fsutil::write_file_atomic(&manifest_path, |w| w.write_all(text.as_bytes()))?;
    Ok(manifest)
}

/// Where the copies of layer `layer` at `bits` go, relative to the model.
fn copy_file_name(bits: u32, layer: usize) -> String {
    format!("experts/low{bits}/layer_{layer:03}.bin")
}

/// The layout of `el`'s copies at `bits`, or why there are none: MXFP4
/// experts, or experts already this narrow.
fn low_layer(
    el: &ExpertLayer,
    layout: &ExpertLayout,
    bits: u32,
) -> std::result::Result<ExpertLayer, String> {
    let mut shapes: Vec<ComponentShape> = Vec::new();
    for (c, name) in [&layout.gate, &layout.up, &layout.down].into_iter().zip([
        "gate_proj",
        "up_proj",
        "down_proj",
    ]) {
        if !c.spec.mode.is_affine() {
            return Err("MXFP4 experts have no low-width copies".into());
        }
        if c.spec.bits <= bits {
            return Err(format!(
                "{name} is {}-bit already; copies must be narrower",
                c.spec.bits
            ));
        }
        let spec = QuantSpec {
            bits,
            group_size: c.spec.group_size,
            mode: QuantMode::Affine,
        };
        shapes.push((name, c.rows, c.cols, spec, Dtype::BF16));
    }
    let mut low = layout_layer(el.layer, el.num_experts, &shapes);
    low.file = copy_file_name(bits, el.layer);
    Ok(low)
}

/// Every expert of layer `el` re-quantized into `low`'s file.
fn write_layer(
    dir: &Path,
    el: &ExpertLayer,
    layout: &ExpertLayout,
    low: &ExpertLayer,
) -> Result<()> {
    let src_path = dir.join(&el.file);
    let file = std::fs::File::open(&src_path).map_err(|e| Error::io(&src_path, e))?;
    // SAFETY: read-only; the file is not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(&src_path, e))?;
    let need = el.num_experts as u64 * el.stride;
    if (map.len() as u64) < need {
        return Err(Error::format(
            &src_path,
            format!("{} bytes, the manifest implies {need}", map.len()),
        ));
    }
    let stride = low.stride as usize;
    let mut out = vec![0u8; el.num_experts * stride];
    let parts = [&layout.gate, &layout.up, &layout.down];
    out.par_chunks_mut(stride).enumerate().for_each(|(e, dst)| {
        let at = e * el.stride as usize;
        let src = &map[at..at + layout.extent];
        for (c, lc) in parts.iter().zip(&low.components) {
            requantize(c, src, dst, lc);
        }
    });
    let dst_path = dir.join(&low.file);
    if let Some(parent) = dst_path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
    }
    crate::fsutil::write_file_atomic(&dst_path, |w| w.write_all(&out))
}

/// Component `c` of the expert in `src`, dequantized in f32 and quantized
/// as its copy `lc` says, into the copy's place in `dst`.
fn requantize(
    c: &ComponentLayout,
    src: &[u8],
    dst: &mut [u8],
    lc: &crate::format::ExpertComponent,
) {
    let Weight::Quantized(q) = c.view(src) else {
        unreachable!("low_layer refused MXFP4 experts")
    };
    let (rows, cols) = (q.rows, q.cols);
    let mut w = vec![0.0f32; rows * cols];
    for (r, out) in w.chunks_mut(cols).enumerate() {
        q.dequantize_row(r, out);
    }
    let low = affine::quantize(&w, rows, cols, lc.quant);
    let piece =
        |r: &crate::format::ExpertTensorRef| r.offset as usize..(r.offset + r.bytes) as usize;
    dtype::encode_u32(&low.packed, &mut dst[piece(&lc.weight)]);
    dtype::encode_into(&low.scales, Dtype::BF16, &mut dst[piece(&lc.scales)]);
    let biases = lc.biases.as_ref().expect("affine copies have biases");
    dtype::encode_into(&low.biases, Dtype::BF16, &mut dst[piece(biases)]);
}
