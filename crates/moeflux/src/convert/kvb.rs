//! MLA's `kv_b_proj` `[heads * (nope + v), kv_lora]` (per head: `nope` rows
//! giving k_nope, then `v` rows giving v) split into the two per-head
//! matrices mlx-lm's `deepseek_v3.sanitize` makes of it and moeflux stores:
//! `embed_q` = the k_nope rows transposed, `[heads, kv_lora, nope]`, and
//! `unembed_out` = the v rows, `[heads, v, kv_lora]` (both kept 2-D as
//! `[heads * rows, cols]`).

use crate::config::QuantSpec;
use crate::convert::dtype::FloatTy;
use crate::quant::affine;

/// An mlx-lm checkpoint from before the split (older mlx-lm): `kv_b_proj`
/// quantized as a plain linear layer. mlx-lm's sanitize dequantizes it in the
/// scales' type, splits it and quantizes both halves again with the same bits
/// and group size; so does convert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvbQuantSrc {
    pub scales: String,
    pub biases: String,
    pub spec: QuantSpec,
    pub scale_ty: FloatTy,
}

/// `mx.dequantize` of one quantized row in the scales' type: for bf16 that is
/// `bf16(bf16(scale * q) + bias)` (two roundings, measured against mlx); f32
/// scales give the f32 result.
pub fn dequantize_row_as(
    row: &[u32],
    scales: &[f32],
    biases: &[f32],
    spec: QuantSpec,
    ty: FloatTy,
    out: &mut [f32],
) {
    for (j, o) in out.iter_mut().enumerate() {
        let g = j / spec.group_size;
        let q = affine::unpack_code(row, j, spec.bits) as f32;
        *o = ty.round(ty.round(q * scales[g]) + biases[g]);
    }
}

/// Which half of `kv_b_proj`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvbHalf {
    EmbedQ,
    UnembedOut,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvbSplit {
    pub half: KvbHalf,
    pub heads: usize,
    pub nope: usize,
    pub v: usize,
    pub kv_lora: usize,
}

impl KvbSplit {
    /// Rows of the whole source `kv_b_proj`.
    pub fn source_rows(&self) -> usize {
        self.heads * (self.nope + self.v)
    }

    /// `[rows, cols]` of this half.
    pub fn shape(&self) -> [usize; 2] {
        match self.half {
            KvbHalf::EmbedQ => [self.heads * self.kv_lora, self.nope],
            KvbHalf::UnembedOut => [self.heads * self.v, self.kv_lora],
        }
    }

    /// Rows `r0..r1` of this half from the whole `kv_b_proj` in f32.
    pub fn rows(&self, full: &[f32], r0: usize, r1: usize) -> Vec<f32> {
        let (kvl, per) = (self.kv_lora, self.nope + self.v);
        let cols = self.shape()[1];
        let mut out = Vec::with_capacity((r1 - r0) * cols);
        for r in r0..r1 {
            match self.half {
                KvbHalf::EmbedQ => {
                    let (h, c) = (r / kvl, r % kvl);
                    out.extend((0..self.nope).map(|i| full[(h * per + i) * kvl + c]));
                }
                KvbHalf::UnembedOut => {
                    let (h, j) = (r / self.v, r % self.v);
                    let src = (h * per + self.nope + j) * kvl;
                    out.extend_from_slice(&full[src..src + kvl]);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_matches_the_per_head_layout() {
        // 2 heads, nope 2, v 1, kv_lora 3: kv_b row (h, i) col c = 100h + 10i + c.
        let (heads, nope, v, kvl) = (2, 2, 1, 3);
        let full: Vec<f32> = (0..heads * (nope + v))
            .flat_map(|r| (0..kvl).map(move |c| (100 * (r / 3) + 10 * (r % 3) + c) as f32))
            .collect();
        let e = KvbSplit {
            half: KvbHalf::EmbedQ,
            heads,
            nope,
            v,
            kv_lora: kvl,
        };
        // embed_q[h][c][i] = kv_b[h, i][c]
        assert_eq!(e.shape(), [6, 2]);
        assert_eq!(
            e.rows(&full, 0, 6),
            vec![0., 10., 1., 11., 2., 12., 100., 110., 101., 111., 102., 112.]
        );
        let u = KvbSplit {
            half: KvbHalf::UnembedOut,
            ..e
        };
        // unembed_out[h][j][c] = kv_b[h, nope + j][c]
        assert_eq!(u.shape(), [2, 3]);
        assert_eq!(u.rows(&full, 0, 2), vec![20., 21., 22., 120., 121., 122.]);
    }
}
