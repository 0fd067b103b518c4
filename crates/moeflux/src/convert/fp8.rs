//! FP8 block-scaled weights of DeepSeek-V3 / Kimi-K2 releases: `W` stored as
//! e4m3 (`F8_E4M3`) with a `W_scale_inv` of one f32 per 128x128 block
//! (`[ceil(rows/128), ceil(cols/128)]`). Decoded as mlx-lm's
//! `deepseek_v3.sanitize` does: `bf16(e4m3(code) * scale_inv)` — the e4m3
//! value is exact in bf16, the product is an f32 rounded once to bf16.

use crate::convert::dtype::FloatTy;

/// Rows and columns covered by one scale.
pub const BLOCK: usize = 128;

/// The value of an e4m3 code (OCP "fn" variant: bias 7, no infinities,
/// `S.1111.111` is NaN, subnormals `m/8 * 2^-6`). Exact in f32.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((code >> 3) & 0x0f) as i32;
    let man = (code & 0x07) as f32;
    if exp == 15 && code & 0x07 == 7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// The scale grid of a `[rows, cols]` weight.
pub fn scale_shape(rows: usize, cols: usize) -> [usize; 2] {
    [rows.div_ceil(BLOCK), cols.div_ceil(BLOCK)]
}

/// Rows `r0..r1` of a `[rows, cols]` e4m3 weight (`codes` is the whole
/// tensor) with its f32 block scales, decoded to bf16-rounded f32.
pub fn decode_rows(codes: &[u8], scales: &[f32], cols: usize, r0: usize, r1: usize) -> Vec<f32> {
    let scale_cols = cols.div_ceil(BLOCK);
    let mut out = Vec::with_capacity((r1 - r0) * cols);
    for r in r0..r1 {
        let srow = &scales[(r / BLOCK) * scale_cols..(r / BLOCK + 1) * scale_cols];
        out.extend(
            codes[r * cols..(r + 1) * cols]
                .iter()
                .enumerate()
                .map(|(c, &q)| FloatTy::Bf16.round(e4m3_to_f32(q) * srow[c / BLOCK])),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_reference_points() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // largest finite
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn block_scales_follow_rows_and_columns() {
        // [130, 130]: scales [2, 2]; code 0x38 (1.0) everywhere.
        let codes = vec![0x38u8; 130 * 130];
        let scales = [1.0f32, 2.0, 3.0, 4.0];
        let rows = decode_rows(&codes, &scales, 130, 127, 129);
        assert_eq!(rows[0], 1.0); // row 127, col 0
        assert_eq!(rows[129], 2.0); // row 127, col 129
        assert_eq!(rows[130], 3.0); // row 128, col 0
        assert_eq!(rows[259], 4.0); // row 128, col 129
                                    // The product is rounded to bf16: 1.0 * (1 + 2^-10) -> 1.0.
        let r = decode_rows(&[0x38], &[1.0 + 2f32.powi(-10)], 1, 0, 1);
        assert_eq!(r[0], 1.0);
        assert_eq!(scale_shape(130, 64), [2, 1]);
    }
}
