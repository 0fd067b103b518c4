//! `dense.safetensors`: a standard safetensors file written in a streaming
//! way. The header is computed from the plan first, so every tensor's
//! absolute offset is known; the data is then produced in bounded chunks (a
//! verbatim range of a mapped shard, or a block of rows converted or
//! quantized) and written with positional writes, in parallel.
//!
//! Tensors are ordered 4-byte dtypes first, then 2-byte ones (by name within
//! each), after a header padded to 8 bytes: every tensor starts at a multiple
//! of its element size and can be used in place from a memory map.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::format::TensorEntry;
use crate::quant::affine;

use super::dtype::{self, FloatTy};
use super::kvb::{self, KvbQuantSrc, KvbSplit};
use super::plan::{DenseJob, OutTensor, Plan};
use super::source::Source;
use super::Ctx;

/// Target amount of source data per work item.
const CHUNK_BYTES: usize = 32 << 20;

/// Where each output tensor lands.
pub struct DenseLayout {
    /// Absolute byte offset of each output (indexed like `Plan::outputs`).
    pub offsets: Vec<u64>,
    pub header: Vec<u8>,
    pub file_size: u64,
}

pub fn layout(outputs: &[OutTensor]) -> DenseLayout {
    let mut order: Vec<usize> = (0..outputs.len()).collect();
    order.sort_by(|&a, &b| {
        let (ta, tb) = (&outputs[a], &outputs[b]);
        dtype::size_of(tb.dtype)
            .cmp(&dtype::size_of(ta.dtype))
            .then_with(|| ta.name.cmp(&tb.name))
    });
    let mut rel = vec![0u64; outputs.len()];
    let mut header = String::from(r#"{"__metadata__":{"format":"moeflux"}"#);
    let mut off = 0u64;
    for &i in &order {
        let t = &outputs[i];
        let end = off + t.bytes();
        rel[i] = off;
        header.push_str(&format!(
            r#",{}:{{"dtype":"{}","shape":{},"data_offsets":[{},{}]}}"#,
            serde_json::Value::String(t.name.clone()),
            dtype::name(t.dtype),
            serde_json::to_string(&t.shape).expect("shape serializes"),
            off,
            end
        ));
        off = end;
    }
    header.push('}');
    let mut header = header.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let base = 8 + header.len() as u64;
    DenseLayout {
        offsets: rel.iter().map(|r| base + r).collect(),
        file_size: base + off,
        header,
    }
}

/// One unit of parallel work: a range of a job in the job's units (bytes for
/// verbatim copies, elements for conversions, rows for quantization).
struct Item {
    job: usize,
    start: usize,
    end: usize,
}

fn verbatim(job: &DenseJob) -> bool {
    match job {
        DenseJob::Tensor {
            src_ty,
            plus_one,
            cast,
            interleave,
            ..
        } => match src_ty {
            _ if interleave.is_some() => false,
            None => true,
            Some(t) => !*plus_one && *t != FloatTy::F16 && cast.is_none_or(|c| c == *t),
        },
        DenseJob::Quantize { .. } => false,
    }
}

fn job_raw(job: &DenseJob) -> &str {
    match job {
        DenseJob::Tensor { raw, .. } | DenseJob::Quantize { raw, .. } => raw,
    }
}

fn split(job: usize, total: usize, per: usize, items: &mut Vec<Item>) {
    let per = per.max(1);
    let mut s = 0;
    while s < total {
        let e = (s + per).min(total);
        items.push(Item {
            job,
            start: s,
            end: e,
        });
        s = e;
    }
}

pub fn write(
    src: &Source,
    plan: &Plan,
    lay: &DenseLayout,
    path: &Path,
    ctx: &Ctx,
) -> Result<BTreeMap<String, TensorEntry>> {
    let io = |e| Error::io(path, e);
    let mut file = File::create(path).map_err(io)?;
    file.write_all(&(lay.header.len() as u64).to_le_bytes())
        .map_err(io)?;
    file.write_all(&lay.header).map_err(io)?;
    file.set_len(lay.file_size).map_err(io)?;

    let mut items = Vec::new();
    for (j, job) in plan.jobs.iter().enumerate() {
        match job {
            DenseJob::Tensor {
                raw,
                src_ty,
                interleave,
                ..
            } => {
                let t = &src.tensors[raw];
                let es = dtype::size_of(t.dtype);
                if verbatim(job) {
                    split(j, t.len, CHUNK_BYTES, &mut items);
                } else if interleave.is_some() {
                    // Items count output elements, each two source ones.
                    split(j, t.len / es / 2, CHUNK_BYTES / es / 2, &mut items);
                } else {
                    split(j, t.len / es, CHUNK_BYTES / es, &mut items);
                    debug_assert!(src_ty.is_some());
                }
            }
            // A kv_b_proj half is produced from the whole source tensor: one item.
            DenseJob::Quantize {
                rows, kvb: Some(_), ..
            } => split(j, *rows, *rows, &mut items),
            DenseJob::Quantize { rows, cols, .. } => {
                split(j, *rows, CHUNK_BYTES / (cols * 4).max(1), &mut items);
            }
        }
    }

    // Chunks left per job: the last one releases the job's source pages.
    let left: Vec<AtomicUsize> = (0..plan.jobs.len()).map(|_| AtomicUsize::new(0)).collect();
    for it in &items {
        left[it.job].fetch_add(1, Ordering::Relaxed);
    }
    items.par_iter().try_for_each(|it| -> Result<()> {
        ctx.check_cancel()?;
        let n = run_item(src, plan, lay, &file, it).map_err(io)?;
        if left[it.job].fetch_sub(1, Ordering::AcqRel) == 1 {
            src.release(job_raw(&plan.jobs[it.job]));
        }
        ctx.advance(n);
        Ok(())
    })?;
    // The header counts as written once the data is.
    ctx.advance(8 + lay.header.len() as u64);
    file.sync_all().map_err(io)?;

    Ok(plan
        .outputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            (
                t.name.clone(),
                TensorEntry {
                    dtype: dtype::name(t.dtype),
                    shape: t.shape.clone(),
                    offset: lay.offsets[i],
                    bytes: t.bytes(),
                },
            )
        })
        .collect())
}

/// A whole quantized `kv_b_proj`, dequantized as `mx.dequantize` does in
/// its scales' type.
fn dequantized_kvb(src: &Source, raw: &str, q: &KvbQuantSrc, k: &KvbSplit) -> Vec<f32> {
    let words = dtype::decode_u32(&src.bytes(&src.tensors[raw]));
    let s = dtype::decode(&src.bytes(&src.tensors[&q.scales]), q.scale_ty);
    let b = dtype::decode(&src.bytes(&src.tensors[&q.biases]), q.scale_ty);
    let (kvl, rows) = (k.kv_lora, k.source_rows());
    let wpr = affine::words_per_row(kvl, q.spec.bits);
    let g = kvl / q.spec.group_size;
    let mut out = vec![0f32; rows * kvl];
    for (r, row) in out.chunks_exact_mut(kvl).enumerate() {
        kvb::dequantize_row_as(
            &words[r * wpr..(r + 1) * wpr],
            &s[r * g..(r + 1) * g],
            &b[r * g..(r + 1) * g],
            q.spec,
            q.scale_ty,
            row,
        );
    }
    out
}

/// Produces and writes one item; returns the bytes written.
fn run_item(
    src: &Source,
    plan: &Plan,
    lay: &DenseLayout,
    file: &File,
    it: &Item,
) -> std::io::Result<u64> {
    let job = &plan.jobs[it.job];
    match job {
        DenseJob::Tensor {
            out,
            raw,
            src_ty,
            plus_one,
            cast,
            interleave,
        } => {
            let t = &src.tensors[raw];
            if verbatim(job) {
                let bytes = src.byte_range(t, it.start..it.end);
                file.write_all_at(&bytes, lay.offsets[*out] + it.start as u64)?;
                return Ok(bytes.len() as u64);
            }
            let ty = src_ty.expect("converted tensors are floats");
            let es = dtype::size_of(t.dtype);
            let mut v = match interleave {
                None => dtype::decode(&src.byte_range(t, it.start * es..it.end * es), ty),
                Some(phase) => {
                    dtype::decode(&src.byte_range(t, 2 * it.start * es..2 * it.end * es), ty)
                        .into_iter()
                        .skip(*phase)
                        .step_by(2)
                        .collect()
                }
            };
            for x in &mut v {
                if *plus_one {
                    // mlx adds in the source dtype: exact f32 sum, rounded once.
                    *x = ty.round(*x + 1.0);
                }
                if let Some(c) = cast.filter(|c| c.narrows(ty)) {
                    *x = c.round(*x);
                }
            }
            let od = plan.outputs[*out].dtype;
            let os = dtype::size_of(od);
            let mut buf = vec![0u8; v.len() * os];
            dtype::encode_into(&v, od, &mut buf);
            file.write_all_at(&buf, lay.offsets[*out] + (it.start * os) as u64)?;
            Ok(buf.len() as u64)
        }
        DenseJob::Quantize {
            outs,
            raw,
            src_ty,
            cols,
            spec,
            work,
            kvb,
            kvb_quant,
            ..
        } => {
            let (r0, r1) = (it.start, it.end);
            let rows = r1 - r0;
            // Float rows, FP8 blocks decoded (see `Source::float_rows`).
            let mut w = match (kvb, kvb_quant) {
                (Some(k), Some(q)) => k.rows(&dequantized_kvb(src, raw, q, k), r0, r1),
                (Some(k), None) => k.rows(&src.float_rows(raw, 0, k.source_rows()), r0, r1),
                _ => src.float_rows(raw, r0, r1),
            };
            if work.narrows(*src_ty) {
                for x in &mut w {
                    *x = work.round(*x);
                }
            }
            let q = affine::quantize(&w, rows, *cols, *spec);
            let wpr = affine::words_per_row(*cols, spec.bits);
            let mut wb = vec![0u8; q.packed.len() * 4];
            dtype::encode_u32(&q.packed, &mut wb);
            file.write_all_at(&wb, lay.offsets[outs[0]] + (r0 * wpr * 4) as u64)?;
            let groups = cols / spec.group_size;
            let sd = plan.outputs[outs[1]].dtype;
            let ss = dtype::size_of(sd);
            let mut n = wb.len();
            for (k, vals) in [(1, &q.scales), (2, &q.biases)] {
                // Scales and biases take the weight's type (BF16 encoding rounds itself).
                let r: Vec<f32> = match work {
                    FloatTy::F16 => vals.iter().map(|&x| work.round(x)).collect(),
                    _ => vals.clone(),
                };
                let mut b = vec![0u8; r.len() * ss];
                dtype::encode_into(&r, sd, &mut b);
                file.write_all_at(&b, lay.offsets[outs[k]] + (r0 * groups * ss) as u64)?;
                n += b.len();
            }
            Ok(n as u64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::Dtype;

    #[test]
    fn layout_is_aligned_and_readable() {
        let outs = vec![
            OutTensor {
                name: "b".into(),
                dtype: Dtype::BF16,
                shape: vec![3],
            },
            OutTensor {
                name: "a\"q".into(),
                dtype: Dtype::U32,
                shape: vec![2, 2],
            },
            OutTensor {
                name: "c".into(),
                dtype: Dtype::F32,
                shape: vec![1],
            },
        ];
        let lay = layout(&outs);
        let mut file = (lay.header.len() as u64).to_le_bytes().to_vec();
        file.extend(&lay.header);
        file.resize(lay.file_size as usize, 0);
        let st = safetensors::SafeTensors::deserialize(&file).unwrap();
        let base = file.as_ptr() as usize;
        for (i, t) in outs.iter().enumerate() {
            let v = st.tensor(&t.name).unwrap();
            assert_eq!(v.data().as_ptr() as usize - base, lay.offsets[i] as usize);
            assert_eq!(lay.offsets[i] as usize % dtype::size_of(t.dtype), 0);
        }
        // 4-byte tensors first.
        assert!(lay.offsets[0] > lay.offsets[1] && lay.offsets[0] > lay.offsets[2]);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&file).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "moeflux");
    }
}
