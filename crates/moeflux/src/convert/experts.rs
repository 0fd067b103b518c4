//! Expert packing: `experts/layer_NNN.bin`, `num_experts` extents of
//! `stride` bytes. Expert `e` is built in a per-thread buffer (slice `e` of
//! the stacked source tensors, copied or re-quantized) and written with one
//! positional write, so memory stays at a few extents per thread.

use std::borrow::Cow;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rayon::prelude::*;
use safetensors::Dtype;

use crate::error::{Error, Result};
use crate::format::{ExpertComponent, ExpertTensorRef};
use crate::quant::affine;

use super::dtype::{self, FloatTy};
use super::plan::{ComponentPlan, ExpertOp, LayerPlan};
use super::sanitize::ExpertSrc;
use super::source::Source;
use super::Ctx;

pub fn write_layer(src: &Source, lp: &LayerPlan, path: &Path, ctx: &Ctx) -> Result<()> {
    let io = |e| Error::io(path, e);
    let stride = lp.manifest.stride as usize;
    let file = File::create(path).map_err(io)?;
    file.set_len(lp.manifest.stride * lp.num_experts as u64)
        .map_err(io)?;
    (0..lp.num_experts).into_par_iter().try_for_each_init(
        || vec![0u8; stride],
        |buf, e| -> Result<()> {
            ctx.check_cancel()?;
            buf.fill(0);
            build_expert(src, lp, e, buf);
            file.write_all_at(buf, (e * stride) as u64).map_err(io)?;
            ctx.advance(stride as u64);
            Ok(())
        },
    )?;
    file.sync_all().map_err(io)?;
    // The file is durable: drop its pages from the page cache rather than
    // evicting more useful data while hundreds of GB stream through.
    // SAFETY: plain fadvise on an open descriptor.
    unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        );
    }
    for c in &lp.components {
        for raw in c.src.raw_names() {
            src.release(raw);
        }
    }
    Ok(())
}

/// MXFP4 codes and scales of expert `e`, row by row (Hugging Face's fused
/// `gate_up_proj` interleaves the rows of gate and up).
fn copy_mxfp4(src: &Source, c: &ComponentPlan, mc: &ExpertComponent, e: usize, buf: &mut [u8]) {
    let ExpertSrc::Mxfp4 {
        weight,
        scales,
        pick,
    } = &c.src
    else {
        unreachable!("MXFP4 components come from MXFP4 sources")
    };
    for (name, r) in [(weight, &mc.weight), (scales, &mc.scales)] {
        let from = expert_slice(src, name, e);
        let out = piece(buf, r);
        let per_row = out.len() / c.rows;
        for (row, o) in out.chunks_exact_mut(per_row).enumerate() {
            let s = pick.source_row(row) * per_row;
            o.copy_from_slice(&from[s..s + per_row]);
        }
    }
}

fn piece<'b>(buf: &'b mut [u8], r: &ExpertTensorRef) -> &'b mut [u8] {
    &mut buf[r.offset as usize..(r.offset + r.bytes) as usize]
}

/// Slice `e` of a tensor stacked along its leading dimension.
fn expert_slice<'s>(src: &'s Source, raw: &str, e: usize) -> Cow<'s, [u8]> {
    let t = &src.tensors[raw];
    let per = t.bytes_per_leading();
    src.byte_range(t, e * per..(e + 1) * per)
}

/// Fills `buf` (zeroed, one extent) with expert `e` of layer `lp`.
pub fn build_expert(src: &Source, lp: &LayerPlan, e: usize, buf: &mut [u8]) {
    for (c, mc) in lp.components.iter().zip(&lp.manifest.components) {
        let Some(biases) = &mc.biases else {
            copy_mxfp4(src, c, mc, e, buf);
            continue;
        };
        let refs = [&mc.weight, &mc.scales, biases];
        match c.op {
            ExpertOp::Copy => {
                let ExpertSrc::Quantized {
                    weight,
                    scales,
                    biases,
                } = &c.src
                else {
                    unreachable!("copy from quantized experts only")
                };
                let (_, sty) = c.src_quant.expect("quantized source");
                for (k, name) in [weight, scales, biases].into_iter().enumerate() {
                    let bytes = expert_slice(src, name, e);
                    let out = piece(buf, refs[k]);
                    if k > 0 && sty == FloatTy::F16 {
                        dtype::encode_into(&dtype::decode(&bytes, sty), Dtype::F32, out);
                    } else {
                        out.copy_from_slice(&bytes);
                    }
                }
            }
            ExpertOp::Seed2 => {
                let w = dequantize_expert(src, c, e);
                let (packed, s, b) =
                    affine::requantize_2bit_seed(&w, c.rows, c.cols, c.out_spec.group_size);
                dtype::encode_u32(&packed, piece(buf, refs[0]));
                dtype::encode_bf16_bits(&s, piece(buf, refs[1]));
                dtype::encode_bf16_bits(&b, piece(buf, refs[2]));
            }
            ExpertOp::Requant => {
                let w = dequantize_expert(src, c, e);
                quantize_into(&w, c, FloatTy::F32, buf, &refs);
            }
            ExpertOp::Quantize { work } => {
                let mut w = float_expert(src, c, e);
                if work.narrows(float_ty(src, c, e)) {
                    for x in &mut w {
                        *x = work.round(*x);
                    }
                }
                quantize_into(&w, c, work, buf, &refs);
            }
        }
    }
}

/// MLX affine quantization of `w` [rows, cols] into the extent; scales and
/// biases rounded to `work`, then stored as the component's scale dtype.
fn quantize_into(
    w: &[f32],
    c: &ComponentPlan,
    work: FloatTy,
    buf: &mut [u8],
    refs: &[&ExpertTensorRef; 3],
) {
    let q = affine::quantize(w, c.rows, c.cols, c.out_spec);
    dtype::encode_u32(&q.packed, piece(buf, refs[0]));
    for (k, vals) in [(1, &q.scales), (2, &q.biases)] {
        // BF16 encoding rounds itself; F16 values are stored widened to F32.
        if work == FloatTy::F16 {
            let r: Vec<f32> = vals.iter().map(|&x| work.round(x)).collect();
            dtype::encode_into(&r, c.out_scale_dtype, piece(buf, refs[k]));
        } else {
            dtype::encode_into(vals, c.out_scale_dtype, piece(buf, refs[k]));
        }
    }
}

/// Expert `e` of a quantized component, dequantized in f32
/// (`q * scale + bias`, two rounded operations, as `mx.dequantize`).
fn dequantize_expert(src: &Source, c: &ComponentPlan, e: usize) -> Vec<f32> {
    let ExpertSrc::Quantized {
        weight,
        scales,
        biases,
    } = &c.src
    else {
        unreachable!("dequantize quantized experts only")
    };
    let (spec, sty) = c.src_quant.expect("quantized source");
    let words = dtype::decode_u32(&expert_slice(src, weight, e));
    let s = dtype::decode(&expert_slice(src, scales, e), sty);
    let b = dtype::decode(&expert_slice(src, biases, e), sty);
    let wpr = affine::words_per_row(c.cols, spec.bits);
    let g = c.cols / spec.group_size;
    let mut out = vec![0f32; c.rows * c.cols];
    for (r, row) in out.chunks_exact_mut(c.cols).enumerate() {
        affine::dequantize_row(
            &words[r * wpr..(r + 1) * wpr],
            &s[r * g..(r + 1) * g],
            &b[r * g..(r + 1) * g],
            spec,
            row,
        );
    }
    out
}

/// Float type of expert `e`'s source tensor.
fn float_ty(src: &Source, c: &ComponentPlan, e: usize) -> FloatTy {
    let raw = match &c.src {
        ExpertSrc::PerExpert(raws) => &raws[e],
        ExpertSrc::Stacked { raw, .. } => raw,
        ExpertSrc::Quantized { .. } | ExpertSrc::Mxfp4 { .. } => {
            unreachable!("float experts only")
        }
    };
    src.float_ty(raw).expect("checked by the plan")
}

/// Expert `e` of a float component as f32 [rows, cols] (exact).
fn float_expert(src: &Source, c: &ComponentPlan, e: usize) -> Vec<f32> {
    let ty = c.src_float.expect("float source");
    match &c.src {
        ExpertSrc::Stacked {
            raw,
            row_start,
            rows,
        } => {
            let t = &src.tensors[raw];
            let row_bytes = c.cols * dtype::size_of(t.dtype);
            let slice = expert_slice(src, raw, e);
            dtype::decode(
                &slice[row_start * row_bytes..(row_start + rows) * row_bytes],
                ty,
            )
        }
        ExpertSrc::PerExpert(raws) => src.float_rows(&raws[e], 0, c.rows),
        ExpertSrc::Quantized { .. } | ExpertSrc::Mxfp4 { .. } => {
            unreachable!("float experts only")
        }
    }
}
