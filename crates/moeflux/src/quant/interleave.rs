//! 4-bit matrices with eight rows interleaved: the same codes in the same
//! number of bytes, reordered so a CPU product reads one sequential stream
//! per eight rows instead of eight short ones, and one vector load brings
//! the same four code bytes of eight rows (the hardware prefetchers follow
//! one long stream; eight rows of 1.4 KiB each defeat them). Made at load
//! (`backend::cpu::repack`); only the CPU products read them.
//!
//! Codes, for rows `8g..8g+8` and column unit `u` (64 columns): 256 bytes,
//! for lane `k` in 0..8 and row `i` in 0..8 the four code bytes
//! `32u + 4k .. 32u + 4k + 4` of row `8g + i` (lanes 0-3 are columns
//! `64u .. 64u + 32`, lanes 4-7 the next 32), units in order, groups in
//! order. Group parameters follow the same row-group order:
//! * MXFP4 ([`Mxfp4x8Matrix`]): per unit 16 scale bytes, the eight rows'
//!   scales of block `2u`, then of `2u + 1` (in place of the row-major
//!   scales: same bytes). Scales 0, 1 and 255 (the subnormal and NaN
//!   halves, absent from released checkpoints) are refused, so the kernels
//!   expand a scale with one shift.
//! * MLX affine with bf16 scales and biases in groups of a multiple of 64
//!   ([`Affine4x8Matrix`]): per group, the eight rows' scales and then
//!   biases, as bf16.
//!
//! Only rows of a multiple of 8 and columns of 64 interleave.

use super::mxfp4::{Mxfp4Matrix, CODES_PER_WORD, GROUP};
use super::{QMatrix, ScaleData};
use crate::config::QuantSpec;

/// Rows interleaved together.
pub const ROWS: usize = 8;
/// Columns per unit (two blocks).
pub const UNIT_COLS: usize = 2 * GROUP;
/// Code bytes of one unit of one row group.
pub const UNIT_CODE_BYTES: usize = ROWS * UNIT_COLS / 2;

/// An interleaved MXFP4 matrix `[rows, cols]` (layout in the module docs):
/// `rows * cols / 2` code bytes and `rows * cols / 32` scale bytes.
#[derive(Debug, Clone, Copy)]
pub struct Mxfp4x8Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: &'a [u8],
    pub scales: &'a [u8],
}

/// Why an MXFP4 matrix does not interleave, `None` when it does.
pub fn interleavable(m: &Mxfp4Matrix) -> Option<String> {
    if let Err(why) = check_shape(m.rows, m.cols) {
        return Some(why);
    }
    m.scales
        .iter()
        .find(|&&s| !plain_scale(s))
        .map(|s| format!("scale byte {s} (subnormal or NaN)"))
}

/// Scales whose half is `(s - 1) << 23` as f32 bits.
#[inline]
pub fn plain_scale(s: u8) -> bool {
    (2..255).contains(&s)
}

/// Rows and columns that interleave; the error names the shape.
fn check_shape(rows: usize, cols: usize) -> Result<(), String> {
    if !rows.is_multiple_of(ROWS) || !cols.is_multiple_of(UNIT_COLS) {
        return Err(format!(
            "{rows} x {cols} is not a multiple of {ROWS} x {UNIT_COLS}"
        ));
    }
    Ok(())
}

/// Interleaves row-major 4-bit codes (`rows * cols / 2` bytes, LSB-first
/// nibbles) into `out` (as long).
fn interleave_codes(src: &[u8], rows: usize, cols: usize, out: &mut [u8]) {
    let (units, row_bytes) = (cols / UNIT_COLS, cols / 2);
    assert_eq!(src.len(), rows * row_bytes, "interleave: code bytes");
    assert_eq!(out.len(), src.len(), "interleave: code bytes");
    let mut c = 0;
    for g in 0..rows / ROWS {
        for u in 0..units {
            for k in 0..ROWS {
                for i in 0..ROWS {
                    let at = (ROWS * g + i) * row_bytes + UNIT_COLS / 2 * u + 4 * k;
                    out[c..c + 4].copy_from_slice(&src[at..at + 4]);
                    c += 4;
                }
            }
        }
    }
}

/// Row group `g0`'s codes (`src`, interleaved) back in row-major order
/// (`out`: eight rows).
fn deinterleave_codes(src: &[u8], cols: usize, out: &mut [u8]) {
    let (units, row_bytes) = (cols / UNIT_COLS, cols / 2);
    assert_eq!(out.len(), ROWS * row_bytes, "deinterleave: code bytes");
    let mut c = 0;
    for u in 0..units {
        for k in 0..ROWS {
            for i in 0..ROWS {
                let at = i * row_bytes + UNIT_COLS / 2 * u + 4 * k;
                out[at..at + 4].copy_from_slice(&src[c..c + 4]);
                c += 4;
            }
        }
    }
}

/// Writes `m` interleaved into `codes` (`rows * cols / 2` bytes) and
/// `scales` (`rows * cols / 32`); the caller checked [`interleavable`].
pub fn interleave(m: &Mxfp4Matrix, codes: &mut [u8], scales: &mut [u8]) {
    let units = m.cols / UNIT_COLS;
    let gpr = m.groups_per_row();
    assert_eq!(scales.len(), m.rows * gpr, "interleave: scale bytes");
    interleave_codes(bytemuck::cast_slice(m.codes), m.rows, m.cols, codes);
    let mut s = 0;
    for g in 0..m.rows / ROWS {
        for u in 0..units {
            for half in 0..2 {
                for i in 0..ROWS {
                    scales[s] = m.scales[(ROWS * g + i) * gpr + 2 * u + half];
                    s += 1;
                }
            }
        }
    }
}

impl<'a> Mxfp4x8Matrix<'a> {
    /// Checks that the slices have the sizes the shape implies.
    pub fn check(&self) -> Result<(), String> {
        check_shape(self.rows, self.cols).map_err(|e| format!("interleaved mxfp4: {e}"))?;
        let codes = self.rows.checked_mul(self.cols / 2);
        let scales = self.rows.checked_mul(self.cols / GROUP);
        if codes != Some(self.codes.len()) || scales != Some(self.scales.len()) {
            return Err(format!(
                "interleaved mxfp4: {} code and {} scale bytes for {} x {}",
                self.codes.len(),
                self.scales.len(),
                self.rows,
                self.cols
            ));
        }
        Ok(())
    }

    pub fn units(&self) -> usize {
        self.cols / UNIT_COLS
    }

    /// Row group `g`'s code bytes (`units * 256`) and scales (`units * 16`).
    pub fn group(&self, g: usize) -> (&'a [u8], &'a [u8]) {
        let (cb, sb) = (self.units() * UNIT_CODE_BYTES, self.units() * 2 * ROWS);
        (
            &self.codes[g * cb..(g + 1) * cb],
            &self.scales[g * sb..(g + 1) * sb],
        )
    }

    /// Row groups `g0..g1` as a matrix of their own.
    pub fn groups(&self, g0: usize, g1: usize) -> Mxfp4x8Matrix<'a> {
        let (cb, sb) = (self.units() * UNIT_CODE_BYTES, self.units() * 2 * ROWS);
        Mxfp4x8Matrix {
            rows: (g1 - g0) * ROWS,
            cols: self.cols,
            codes: &self.codes[g0 * cb..g1 * cb],
            scales: &self.scales[g0 * sb..g1 * sb],
        }
    }

    /// The eight rows of group `g` in the row-major layout: `codes`
    /// (`8 * cols / 8` words) and `scales` (`8 * cols / 32` bytes).
    pub fn deinterleave_group(&self, g: usize, codes: &mut [u32], scales: &mut [u8]) {
        let (units, gpr) = (self.units(), self.cols / GROUP);
        assert_eq!(codes.len(), ROWS * self.cols / CODES_PER_WORD);
        assert_eq!(scales.len(), ROWS * gpr);
        let (src, ssrc) = self.group(g);
        deinterleave_codes(src, self.cols, bytemuck::cast_slice_mut(codes));
        let mut s = 0;
        for u in 0..units {
            for half in 0..2 {
                for i in 0..ROWS {
                    scales[i * gpr + 2 * u + half] = ssrc[s];
                    s += 1;
                }
            }
        }
    }

    /// Row `r` in f32, as [`Mxfp4Matrix::dequantize_row`] gives it.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), String> {
        self.check()?;
        if r >= self.rows {
            return Err(format!("interleaved mxfp4: row {r} of {}", self.rows));
        }
        let mut codes = vec![0u32; ROWS * self.cols / CODES_PER_WORD];
        let mut scales = vec![0u8; ROWS * self.cols / GROUP];
        self.deinterleave_group(r / ROWS, &mut codes, &mut scales);
        Mxfp4Matrix::new(ROWS, self.cols, &codes, &scales)?.dequantize_row(r % ROWS, out)
    }
}

/// An interleaved MLX affine 4-bit matrix `[rows, cols]` (layout in the
/// module docs): `rows * cols / 2` code bytes, `rows * cols / group_size`
/// scales and as many biases, in bf16.
#[derive(Debug, Clone, Copy)]
pub struct Affine4x8Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub codes: &'a [u8],
    /// Per row group and group: the eight rows' scales, then their biases
    /// (bf16 bits).
    pub params: &'a [u16],
}

/// An interleaved affine matrix's bytes, owned (made by
/// [`interleave_affine`]).
pub struct OwnedAffine4x8 {
    pub rows: usize,
    pub cols: usize,
    pub group_size: usize,
    pub codes: Vec<u8>,
    pub params: Vec<u16>,
}

impl OwnedAffine4x8 {
    pub fn view(&self) -> Affine4x8Matrix<'_> {
        Affine4x8Matrix {
            rows: self.rows,
            cols: self.cols,
            group_size: self.group_size,
            codes: &self.codes,
            params: &self.params,
        }
    }
}

/// `q` interleaved, or why it does not interleave (not 4-bit, groups not
/// a multiple of 64, f32 scales, or the shape).
pub fn interleave_affine(q: &QMatrix) -> Result<OwnedAffine4x8, String> {
    q.check()?;
    let (ScaleData::Bf16(scales), ScaleData::Bf16(biases)) = (q.scales, q.biases) else {
        return Err("f32 scales (interleaving keeps bf16 ones)".into());
    };
    if q.spec.bits != 4 || !q.spec.group_size.is_multiple_of(UNIT_COLS) {
        return Err(format!(
            "{}-bit codes in groups of {} (interleaving takes 4-bit codes in groups of a multiple of {UNIT_COLS})",
            q.spec.bits, q.spec.group_size
        ));
    }
    check_shape(q.rows, q.cols)?;
    let mut codes = vec![0u8; q.rows * q.cols / 2];
    interleave_codes(bytemuck::cast_slice(q.packed), q.rows, q.cols, &mut codes);
    let gpr = q.groups_per_row();
    let mut params = Vec::with_capacity(2 * q.rows * gpr);
    for g in 0..q.rows / ROWS {
        for j in 0..gpr {
            for data in [scales, biases] {
                params.extend((0..ROWS).map(|i| data[(ROWS * g + i) * gpr + j]));
            }
        }
    }
    Ok(OwnedAffine4x8 {
        rows: q.rows,
        cols: q.cols,
        group_size: q.spec.group_size,
        codes,
        params,
    })
}

impl<'a> Affine4x8Matrix<'a> {
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.group_size
    }

    /// Checks that the slices have the sizes the shape implies.
    pub fn check(&self) -> Result<(), String> {
        check_shape(self.rows, self.cols).map_err(|e| format!("interleaved affine: {e}"))?;
        if self.group_size == 0
            || !self.group_size.is_multiple_of(UNIT_COLS)
            || !self.cols.is_multiple_of(self.group_size)
        {
            return Err(format!(
                "interleaved affine: groups of {} for {} columns",
                self.group_size, self.cols
            ));
        }
        let params = self.rows * self.groups_per_row() * 2;
        if self.codes.len() != self.rows * self.cols / 2 || self.params.len() != params {
            return Err(format!(
                "interleaved affine: {} code bytes and {} parameters for {} x {} in groups of {}",
                self.codes.len(),
                self.params.len(),
                self.rows,
                self.cols,
                self.group_size
            ));
        }
        Ok(())
    }

    /// Row group `g`'s code bytes and parameters.
    pub fn group(&self, g: usize) -> (&'a [u8], &'a [u16]) {
        let (cb, pb) = (ROWS * self.cols / 2, 2 * ROWS * self.groups_per_row());
        (
            &self.codes[g * cb..(g + 1) * cb],
            &self.params[g * pb..(g + 1) * pb],
        )
    }

    /// Row groups `g0..g1` as a matrix of their own.
    pub fn groups(&self, g0: usize, g1: usize) -> Affine4x8Matrix<'a> {
        let (cb, pb) = (ROWS * self.cols / 2, 2 * ROWS * self.groups_per_row());
        Affine4x8Matrix {
            rows: (g1 - g0) * ROWS,
            codes: &self.codes[g0 * cb..g1 * cb],
            params: &self.params[g0 * pb..g1 * pb],
            ..*self
        }
    }

    /// The eight rows of group `g` in the row-major layout: `packed`
    /// (`8 * cols / 8` words), `scales` and `biases` (`8 * cols / group_size`).
    pub fn deinterleave_group(
        &self,
        g: usize,
        packed: &mut [u32],
        scales: &mut [u16],
        biases: &mut [u16],
    ) {
        let gpr = self.groups_per_row();
        let (src, params) = self.group(g);
        deinterleave_codes(src, self.cols, bytemuck::cast_slice_mut(packed));
        for j in 0..gpr {
            for i in 0..ROWS {
                scales[i * gpr + j] = params[2 * ROWS * j + i];
                biases[i * gpr + j] = params[2 * ROWS * j + ROWS + i];
            }
        }
    }

    /// Row `r` in f32, as the row-major matrix's `dequantize_row` gives it.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), String> {
        self.check()?;
        if r >= self.rows || out.len() != self.cols {
            return Err(format!(
                "interleaved affine: row {r} of {} into {} values",
                self.rows,
                out.len()
            ));
        }
        let gpr = self.groups_per_row();
        let mut packed = vec![0u32; ROWS * self.cols / 8];
        let (mut scales, mut biases) = (vec![0u16; ROWS * gpr], vec![0u16; ROWS * gpr]);
        self.deinterleave_group(r / ROWS, &mut packed, &mut scales, &mut biases);
        let f32s = |v: &[u16]| {
            v.iter()
                .map(|&b| super::affine::bf16_to_f32(b))
                .collect::<Vec<_>>()
        };
        let (scales, biases) = (f32s(&scales), f32s(&biases));
        let i = r % ROWS;
        let wpr = self.cols / 8;
        super::affine::dequantize_row(
            &packed[i * wpr..(i + 1) * wpr],
            &scales[i * gpr..(i + 1) * gpr],
            &biases[i * gpr..(i + 1) * gpr],
            QuantSpec::affine(4, self.group_size),
            out,
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::mxfp4::pack_codes;

    fn random(rows: usize, cols: usize, seed: u64) -> (Vec<u32>, Vec<u8>) {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let elems: Vec<u8> = (0..rows * cols).map(|_| (next() % 16) as u8).collect();
        let mut codes = vec![0u32; rows * cols / 8];
        pack_codes(&elems, &mut codes);
        let scales = (0..rows * cols / 32)
            .map(|_| 2 + (next() % 253) as u8)
            .collect();
        (codes, scales)
    }

    #[test]
    fn interleaving_keeps_every_row() {
        let (rows, cols) = (24, 192);
        let (codes, scales) = random(rows, cols, 0x5eed);
        let m = Mxfp4Matrix::new(rows, cols, &codes, &scales).unwrap();
        assert_eq!(interleavable(&m), None);
        let (mut ic, mut is) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32]);
        interleave(&m, &mut ic, &mut is);
        let x = Mxfp4x8Matrix {
            rows,
            cols,
            codes: &ic,
            scales: &is,
        };
        x.check().unwrap();
        let (mut want, mut got) = (vec![0.0f32; cols], vec![0.0f32; cols]);
        for r in 0..rows {
            m.dequantize_row(r, &mut want).unwrap();
            x.dequantize_row(r, &mut got).unwrap();
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {r}"
            );
        }
        // Lane 5 of unit 1 of group 2, row 3: code bytes 32 + 20.. of row 19.
        let src: &[u8] = bytemuck::cast_slice(&codes);
        let at = 2 * 3 * UNIT_CODE_BYTES + UNIT_CODE_BYTES + 5 * 32 + 3 * 4;
        assert_eq!(
            &ic[at..at + 4],
            &src[19 * cols / 2 + 52..19 * cols / 2 + 56]
        );
    }

    #[test]
    fn odd_shapes_and_edge_scales_do_not_interleave() {
        let (codes, mut scales) = random(8, 96, 7);
        let m = Mxfp4Matrix::new(8, 96, &codes, &scales).unwrap();
        assert!(interleavable(&m).unwrap().contains("8 x 96"));
        let (codes, _) = random(8, 64, 7);
        for edge in [0u8, 1, 255] {
            scales = vec![127u8; 16];
            scales[11] = edge;
            let m = Mxfp4Matrix::new(8, 64, &codes, &scales).unwrap();
            assert!(interleavable(&m).unwrap().contains(&format!("byte {edge}")));
        }
    }
}
