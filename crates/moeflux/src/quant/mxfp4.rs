//! MXFP4 (OCP Microscaling FP4), the format gpt-oss ships its experts in.
//!
//! Per group of [`GROUP`] = 32 consecutive inputs of a row: 4-bit FP4 e2m1
//! codes (sign bit 3, magnitude index bits 0-2 into [`E2M1`]) and one e8m0
//! scale byte `s` worth `2^(s - 127)`. Weights are kept exactly as released,
//! never re-quantized.
//!
//! Storage (as mlx's `mx.quantize(.., mode="mxfp4")` lays it out): codes form
//! an LSB-first bitstream in little-endian u32 words, `cols / 8` per row, so
//! element `j` of a row occupies bits `[4j, 4j + 4)`; scales are bytes,
//! `cols / 32` per row. Hugging Face checkpoints (`*_blocks` uint8
//! `[.., cols/32, 16]`, low nibble = even element, `*_scales` uint8
//! `[.., cols/32]`) hold the same bytes in another shape: see
//! [`codes_from_hf_blocks`].
//!
//! Scale 255 is NaN in the OCP specification, and decodes to NaN here (every
//! weight of the group is NaN). mlx instead computes `2^128 = inf` for it
//! (so ±inf weights, NaN for zero codes); released checkpoints contain no 255.
//! Scale 0 is `2^-127`, a subnormal f32, exactly.

/// Inputs per scale.
pub const GROUP: usize = 32;
/// Codes per packed u32 word.
pub const CODES_PER_WORD: usize = 8;

/// FP4 e2m1 values by code: bit 3 is the sign (code 8 is -0.0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Twice the e2m1 values, as exact small integers: the kernels multiply
/// these and fold the 1/2 into the power-of-two scale ([`half_scale_f32`]),
/// which changes no rounding. -0 becomes 0, which no sum can tell apart
/// (accumulators start at +0).
pub const E2M1_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The e8m0 scale `2^(s - 127)` in f32 (exact for every `s < 255`; 0 is the
/// subnormal `2^-127`), NaN for 255.
#[inline]
pub const fn scale_f32(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(1 << 22),
        255 => f32::NAN,
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// `scale_f32(s) / 2`, exactly (`2^-128` is an f32 subnormal), NaN for 255:
/// the scale that goes with [`E2M1_X2`].
#[inline]
pub const fn half_scale_f32(s: u8) -> f32 {
    match s {
        0 => f32::from_bits(1 << 21),
        1 => f32::from_bits(1 << 22),
        255 => f32::NAN,
        _ => f32::from_bits(((s as u32) - 1) << 23),
    }
}

/// A row-major MXFP4 matrix `[rows, cols]`: `codes` holds `rows * cols / 8`
/// words, `scales` `rows * cols / 32` bytes.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u32],
    pub scales: &'a [u8],
}

impl<'a> Mxfp4Matrix<'a> {
    /// A checked matrix; the error names what does not fit the shape.
    pub fn new(
        rows: usize,
        cols: usize,
        codes: &'a [u32],
        scales: &'a [u8],
    ) -> Result<Self, String> {
        let m = Mxfp4Matrix {
            rows,
            cols,
            codes,
            scales,
        };
        m.check()?;
        Ok(m)
    }

    pub fn words_per_row(&self) -> usize {
        self.cols / CODES_PER_WORD
    }

    pub fn groups_per_row(&self) -> usize {
        self.cols / GROUP
    }

    /// Checks that the slices have the sizes the shape implies.
    pub fn check(&self) -> Result<(), String> {
        if !self.cols.is_multiple_of(GROUP) {
            return Err(format!(
                "mxfp4: {} columns is not a multiple of the group size {GROUP}",
                self.cols
            ));
        }
        let words = self.rows.checked_mul(self.words_per_row());
        if words != Some(self.codes.len()) {
            return Err(format!(
                "mxfp4: codes have {} words, expected {} ({} x {} / {CODES_PER_WORD})",
                self.codes.len(),
                words.map_or("too many".to_string(), |w| w.to_string()),
                self.rows,
                self.cols
            ));
        }
        let groups = self.rows * self.groups_per_row();
        if self.scales.len() != groups {
            return Err(format!(
                "mxfp4: scales have {} entries, expected {groups} ({} x {} / {GROUP})",
                self.scales.len(),
                self.rows,
                self.cols
            ));
        }
        Ok(())
    }

    /// Rows `r0..r1` as a matrix of their own.
    pub fn row_block(&self, r0: usize, r1: usize) -> Mxfp4Matrix<'a> {
        let (wpr, gpr) = (self.words_per_row(), self.groups_per_row());
        Mxfp4Matrix {
            rows: r1 - r0,
            cols: self.cols,
            codes: &self.codes[r0 * wpr..r1 * wpr],
            scales: &self.scales[r0 * gpr..r1 * gpr],
        }
    }

    /// Row `r` in f32: `E2M1[code] * scale_f32(s)`, bitwise what
    /// `mx.dequantize(.., mode="mxfp4", dtype=float32)` gives for scales
    /// below 255 (products past f32's range are ±inf there too).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), String> {
        self.check()?;
        if r >= self.rows {
            return Err(format!("mxfp4: row {r} of {}", self.rows));
        }
        if out.len() != self.cols {
            return Err(format!(
                "mxfp4: output has {} entries for {} columns",
                out.len(),
                self.cols
            ));
        }
        let (wpr, gpr) = (self.words_per_row(), self.groups_per_row());
        dequantize_row(
            &self.codes[r * wpr..(r + 1) * wpr],
            &self.scales[r * gpr..(r + 1) * gpr],
            out,
        );
        Ok(())
    }
}

/// Code `j` of a packed row.
#[inline]
pub fn code(row: &[u32], j: usize) -> usize {
    ((row[j / CODES_PER_WORD] >> (4 * (j % CODES_PER_WORD))) & 15) as usize
}

/// Dequantizes one row (`codes.len() * 8` values, `scales` one per 32).
pub fn dequantize_row(codes: &[u32], scales: &[u8], out: &mut [f32]) {
    for (g, o) in out.chunks_exact_mut(GROUP).enumerate() {
        let s = scale_f32(scales[g]);
        let words = &codes[g * GROUP / CODES_PER_WORD..(g + 1) * GROUP / CODES_PER_WORD];
        for (j, v) in o.iter_mut().enumerate() {
            *v = E2M1[code(words, j)] * s;
        }
    }
}

/// Packs codes (each < 16) LSB-first, 8 to a word.
pub fn pack_codes(codes: &[u8], out: &mut [u32]) {
    out.fill(0);
    for (j, &c) in codes.iter().enumerate() {
        out[j / CODES_PER_WORD] |= ((c & 15) as u32) << (4 * (j % CODES_PER_WORD));
    }
}

/// Codes in the stored layout from a Hugging Face `*_blocks` tensor of
/// `rows` x `cols` weights (`[.., cols/32, 16]` bytes, rows outermost; the
/// leading dimensions, e.g. experts, flatten into `rows`).
///
/// Byte `b` of a block holds element `2b` in its low nibble and `2b + 1` in
/// its high one (transformers' `convert_moe_packed_tensors`: `lut[lo]` at
/// `0::2`, `lut[hi]` at `1::2`), which is exactly the LSB-first nibble order
/// of the u32 words: the bytes are the same, read as little-endian words.
/// The `*_scales` bytes (`[.., cols/32]`) are used unchanged.
///
/// gpt-oss's expert tensors are `[experts, out, in/32, 16]`: rows are output
/// features, as here (transformers transposes only after decoding, because
/// its experts compute `x @ W`).
pub fn codes_from_hf_blocks(blocks: &[u8], rows: usize, cols: usize) -> Result<Vec<u32>, String> {
    if !cols.is_multiple_of(GROUP) {
        return Err(format!(
            "mxfp4 blocks: {cols} columns is not a multiple of the group size {GROUP}"
        ));
    }
    let want = rows.checked_mul(cols / 2);
    if want != Some(blocks.len()) {
        return Err(format!(
            "mxfp4 blocks: {} bytes, expected {rows} x {cols} / 2",
            blocks.len()
        ));
    }
    Ok(blocks
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Checks a Hugging Face `*_scales` tensor against the shape; the bytes are
/// the stored scales as they are.
pub fn check_hf_scales(scales: &[u8], rows: usize, cols: usize) -> Result<(), String> {
    let want = rows.checked_mul(cols / GROUP);
    if !cols.is_multiple_of(GROUP) || want != Some(scales.len()) {
        return Err(format!(
            "mxfp4 scales: {} bytes, expected {rows} x {cols} / {GROUP}",
            scales.len()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_are_powers_of_two() {
        for s in 0..255u8 {
            let want = 2f64.powi(s as i32 - 127);
            assert_eq!(scale_f32(s) as f64, want, "s {s}");
            assert_eq!(half_scale_f32(s) as f64, want / 2.0, "s {s}");
        }
        assert!(scale_f32(255).is_nan() && half_scale_f32(255).is_nan());
        for (c, &v) in E2M1.iter().enumerate() {
            assert_eq!(E2M1_X2[c] as f32, 2.0 * v, "code {c}");
        }
        assert!(E2M1[8] == 0.0 && E2M1[8].is_sign_negative());
    }

    #[test]
    fn shape_errors_name_the_problem() {
        let codes = [0u32; 8];
        let scales = [127u8; 2];
        assert!(Mxfp4Matrix::new(1, 64, &codes, &scales).is_ok());
        assert!(Mxfp4Matrix::new(2, 32, &codes, &scales).is_ok());
        let e = Mxfp4Matrix::new(1, 48, &codes, &scales).unwrap_err();
        assert!(e.contains("multiple of the group size"), "{e}");
        let e = Mxfp4Matrix::new(2, 64, &codes, &scales).unwrap_err();
        assert!(e.contains("codes have 8 words, expected 16"), "{e}");
        let e = Mxfp4Matrix::new(1, 64, &codes, &scales[..1]).unwrap_err();
        assert!(e.contains("scales have 1 entries, expected 2"), "{e}");
        let e = Mxfp4Matrix::new(usize::MAX, 64, &codes, &scales).unwrap_err();
        assert!(e.contains("too many"), "{e}");
        let m = Mxfp4Matrix::new(1, 64, &codes, &scales).unwrap();
        assert!(m.dequantize_row(1, &mut [0.0; 64]).is_err());
        assert!(m.dequantize_row(0, &mut [0.0; 63]).is_err());
        assert!(codes_from_hf_blocks(&[0; 16], 1, 48).is_err());
        assert!(codes_from_hf_blocks(&[0; 15], 1, 32).is_err());
        assert!(check_hf_scales(&[0; 2], 1, 32).is_err());
        assert!(check_hf_scales(&[0; 2], 2, 32).is_ok());
    }

    /// transformers' `convert_moe_packed_tensors` for one block row:
    /// `lut[lo]` at even, `lut[hi]` at odd positions, then `ldexp(.., s-127)`.
    fn hf_decode(blocks: &[u8], scales: &[u8], out: &mut [f32]) {
        for (g, blk) in blocks.chunks_exact(16).enumerate() {
            let e = scales[g] as i32 - 127;
            for (b, &byte) in blk.iter().enumerate() {
                let lo = E2M1[(byte & 15) as usize] as f64 * 2f64.powi(e);
                let hi = E2M1[(byte >> 4) as usize] as f64 * 2f64.powi(e);
                out[g * 32 + 2 * b] = lo as f32;
                out[g * 32 + 2 * b + 1] = hi as f32;
            }
        }
    }

    #[test]
    fn hf_blocks_are_the_stored_bytes() {
        // Random block bytes and scales, two "experts" of 3 x 96.
        let (rows, cols) = (6, 96);
        let mut z = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            z
        };
        let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| next() as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32)
            .map(|_| 100 + (next() % 50) as u8)
            .collect();
        let codes = codes_from_hf_blocks(&blocks, rows, cols).unwrap();
        check_hf_scales(&scales, rows, cols).unwrap();
        let m = Mxfp4Matrix::new(rows, cols, &codes, &scales).unwrap();
        let (mut got, mut want) = (vec![0.0; cols], vec![0.0; cols]);
        for r in 0..rows {
            m.dequantize_row(r, &mut got).unwrap();
            hf_decode(
                &blocks[r * cols / 2..(r + 1) * cols / 2],
                &scales[r * cols / 32..(r + 1) * cols / 32],
                &mut want,
            );
            let (g, w): (Vec<u32>, Vec<u32>) = (
                got.iter().map(|v| v.to_bits()).collect(),
                want.iter().map(|v| v.to_bits()).collect(),
            );
            assert_eq!(g, w, "row {r}");
        }
        // And packing element codes gives the same words.
        let mut elems = vec![0u8; rows * cols];
        for (i, &b) in blocks.iter().enumerate() {
            elems[2 * i] = b & 15;
            elems[2 * i + 1] = b >> 4;
        }
        let mut packed = vec![0u32; codes.len()];
        pack_codes(&elems, &mut packed);
        assert_eq!(packed, codes);
    }
}
