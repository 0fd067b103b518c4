//! MLX affine quantization, bit-identical to `mx.quantize`.
//!
//! Per group of `group_size` consecutive inputs of a row: codes `q` of `bits`
//! bits, a scale and a bias with `w = q * scale + bias` (the scale may be
//! negative). Codes form an LSB-first bitstream in little-endian u32 words,
//! so element `j` of a row occupies bits `[j*bits, (j+1)*bits)`.

use crate::config::QuantSpec;

/// Codes plus per-group scale and bias, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub packed: Vec<u32>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

/// Number of u32 words holding one row of `cols` codes.
pub fn words_per_row(cols: usize, bits: u32) -> usize {
    cols * bits as usize / 32
}

/// Quantizes a row-major `rows x cols` f32 matrix with MLX's algorithm.
///
/// Callers holding bf16 weights pass them upcast; MLX computes codes from the
/// f32 scale and rounds scale/bias to bf16 afterwards (`round_to_bf16`).
pub fn quantize(w: &[f32], rows: usize, cols: usize, spec: QuantSpec) -> Quantized {
    assert_eq!(w.len(), rows * cols, "quantize: matrix size");
    assert_eq!(
        cols % spec.group_size,
        0,
        "quantize: cols not a multiple of group size"
    );
    let groups = cols / spec.group_size;
    let wpr = words_per_row(cols, spec.bits);
    let mut out = Quantized {
        packed: vec![0; rows * wpr],
        scales: vec![0.0; rows * groups],
        biases: vec![0.0; rows * groups],
    };
    let n_bins = ((1u32 << spec.bits) - 1) as f32;
    let mut codes = vec![0u8; cols];
    for r in 0..rows {
        let row = &w[r * cols..(r + 1) * cols];
        for g in 0..groups {
            let grp = &row[g * spec.group_size..(g + 1) * spec.group_size];
            let (scale, bias) = group_params(grp, n_bins);
            for (j, &x) in grp.iter().enumerate() {
                let q = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins);
                codes[g * spec.group_size + j] = q as u8;
            }
            out.scales[r * groups + g] = scale;
            out.biases[r * groups + g] = bias;
        }
        pack_codes(&codes, spec.bits, &mut out.packed[r * wpr..(r + 1) * wpr]);
    }
    out
}

/// Scale and bias of one group: the edge of larger magnitude becomes the bias
/// and is exactly representable, as in MLX. When the edge rounds to code 0
/// (a range below the 1e-7 scale floor), MLX sets the bias to 0 instead.
fn group_params(grp: &[f32], n_bins: f32) -> (f32, f32) {
    let mut mx = f32::NEG_INFINITY;
    let mut mn = f32::INFINITY;
    for &x in grp {
        mx = mx.max(x);
        mn = mn.min(x);
    }
    let use_min = mn.abs() > mx.abs();
    let mut scale = ((mx - mn) / n_bins).max(1e-7);
    if !use_min {
        scale = -scale;
    }
    let edge = if use_min { mn } else { mx };
    let q0 = (edge / scale).round_ties_even();
    if q0 == 0.0 {
        // mlx: `biases = where(q0 == 0, 0, edge)`
        return (scale, 0.0);
    }
    scale = edge / q0;
    (scale, edge)
}

/// Packs one row of codes (each < 2^bits) LSB-first into `out`.
pub fn pack_codes(codes: &[u8], bits: u32, out: &mut [u32]) {
    out.fill(0);
    let b = bits as usize;
    for (j, &q) in codes.iter().enumerate() {
        let bit = j * b;
        let (w, s) = (bit / 32, bit % 32);
        out[w] |= (q as u32) << s;
        if s + b > 32 {
            out[w + 1] |= (q as u32) >> (32 - s);
        }
    }
}

/// Code `j` of a packed row.
#[inline]
pub fn unpack_code(row: &[u32], j: usize, bits: u32) -> u32 {
    let b = bits as usize;
    let bit = j * b;
    let (w, s) = (bit / 32, bit % 32);
    let mask = (1u32 << b) - 1;
    let mut v = row[w] >> s;
    if s + b > 32 {
        v |= row[w + 1] << (32 - s);
    }
    v & mask
}

/// Dequantizes one packed row into `out` (`w = q*scale + bias` in f32).
pub fn dequantize_row(
    row: &[u32],
    scales: &[f32],
    biases: &[f32],
    spec: QuantSpec,
    out: &mut [f32],
) {
    // Group by group: no division per element (the same f32 arithmetic).
    for (g, grp) in out.chunks_mut(spec.group_size).enumerate() {
        let (s, b) = (scales[g], biases[g]);
        let j0 = g * spec.group_size;
        for (i, o) in grp.iter_mut().enumerate() {
            *o = unpack_code(row, j0 + i, spec.bits) as f32 * s + b;
        }
    }
}

/// Rounds to the nearest bf16 (ties to even), as `astype(bfloat16)` does.
pub fn round_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// flash-moe's 2-bit expert re-quantization: per group, `scale = (max-min)/3`,
/// `bias = min`, codes rounded half away from zero with the f32 scale; scale
/// and bias stored as bf16 by truncation. Returns bf16 bit patterns.
pub fn requantize_2bit_seed(
    w: &[f32],
    rows: usize,
    cols: usize,
    group_size: usize,
) -> (Vec<u32>, Vec<u16>, Vec<u16>) {
    assert_eq!(w.len(), rows * cols);
    assert_eq!(cols % group_size, 0);
    let groups = cols / group_size;
    let wpr = words_per_row(cols, 2);
    let mut packed = vec![0u32; rows * wpr];
    let mut scales = vec![0u16; rows * groups];
    let mut biases = vec![0u16; rows * groups];
    let mut codes = vec![0u8; cols];
    for r in 0..rows {
        for g in 0..groups {
            let grp = &w[r * cols + g * group_size..r * cols + (g + 1) * group_size];
            let mn = grp.iter().copied().fold(f32::INFINITY, f32::min);
            let mx = grp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s = if mx == mn { 1.0 } else { (mx - mn) / 3.0 };
            for (j, &x) in grp.iter().enumerate() {
                codes[g * group_size + j] = ((x - mn) / s).round().clamp(0.0, 3.0) as u8;
            }
            scales[r * groups + g] = (s.to_bits() >> 16) as u16;
            biases[r * groups + g] = (mn.to_bits() >> 16) as u16;
        }
        pack_codes(&codes, 2, &mut packed[r * wpr..(r + 1) * wpr]);
    }
    (packed, scales, biases)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_row_matches_mlx_example() {
        // oracle.md: linspace(-1, 1, 64) at 4 bits -> word 0 = 0xcddddeee,
        // scale = -0.142857, bias = 1.0.
        let w: Vec<f32> = (0..64).map(|i| -1.0 + 2.0 * i as f32 / 63.0).collect();
        let q = quantize(&w, 1, 64, QuantSpec::affine(4, 64));
        assert_eq!(q.packed[0], 0xcddd_deee);
        assert_eq!(q.biases[0], 1.0);
        assert!((q.scales[0] + 0.142857).abs() < 1e-6);
    }

    #[test]
    fn pack_unpack_roundtrip_all_widths() {
        for bits in [2u32, 3, 4, 5, 6, 8] {
            let cols = 128;
            let codes: Vec<u8> = (0..cols)
                .map(|j| ((j * 7 + 3) % (1 << bits)) as u8)
                .collect();
            let mut packed = vec![0u32; words_per_row(cols, bits)];
            pack_codes(&codes, bits, &mut packed);
            for (j, &c) in codes.iter().enumerate() {
                assert_eq!(unpack_code(&packed, j, bits), c as u32, "bits {bits} j {j}");
            }
        }
    }

    #[test]
    fn dequantized_error_is_within_one_step() {
        // Half a step inside the range; MLX's edge-snapping may clip the far
        // end of a group by up to one step.
        let w: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        for bits in [2u32, 4, 8] {
            let spec = QuantSpec::affine(bits, 64);
            let q = quantize(&w, 2, 128, spec);
            let mut out = vec![0.0; 128];
            for r in 0..2 {
                dequantize_row(
                    &q.packed[r * words_per_row(128, bits)..],
                    &q.scales[r * 2..],
                    &q.biases[r * 2..],
                    spec,
                    &mut out,
                );
                for j in 0..128 {
                    let step = q.scales[r * 2 + j / 64].abs();
                    assert!((out[j] - w[r * 128 + j]).abs() <= step + 1e-6);
                }
            }
        }
    }
}
