//! Quantized and dense matmul kernels. (Stub: replaced by the SIMD kernels.)

use crate::quant::{affine, DenseData, Weight};

/// `out[t*rows + r] = dot(W[r, :], x[t*cols .. (t+1)*cols])` for `t < n_tokens`.
///
/// Every output element is computed by one thread in a fixed order, so a
/// token's result is bitwise independent of `n_tokens` and of the thread count.
pub fn matmul(w: &Weight, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), n_tokens * cols);
    assert_eq!(out.len(), n_tokens * rows);
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        dequantize_row(w, r, &mut row);
        for t in 0..n_tokens {
            let xt = &x[t * cols..(t + 1) * cols];
            out[t * rows + r] = row.iter().zip(xt).map(|(a, b)| a * b).sum();
        }
    }
}

/// Row `r` of the weight in f32.
pub fn dequantize_row(w: &Weight, r: usize, out: &mut [f32]) {
    match w {
        Weight::Quantized(q) => {
            let wpr = q.words_per_row();
            let gpr = q.groups_per_row();
            let packed = &q.packed[r * wpr..(r + 1) * wpr];
            for (j, o) in out.iter_mut().enumerate() {
                let g = r * gpr + j / q.spec.group_size;
                *o = affine::unpack_code(packed, j, q.spec.bits) as f32 * q.scales.get(g)
                    + q.biases.get(g);
            }
        }
        Weight::Dense(d) => match d.data {
            DenseData::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[r * d.cols..(r + 1) * d.cols]) {
                    *o = affine::bf16_to_f32(b);
                }
            }
            DenseData::F32(v) => out.copy_from_slice(&v[r * d.cols..(r + 1) * d.cols]),
        },
    }
}
