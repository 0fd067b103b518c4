//! MXFP4 products, under the determinism contract of the parent module with
//! groups of 32 and no bias term:
//!
//! ```text
//! y = 0
//! for each group g:
//!     acc = 0
//!     for each V-wide vector i of the group, in stream order:
//!         acc = fma(2 * e2m1(codes_i), x_i, acc)
//!     y = fma(splat(scale_g / 2), acc, y)
//! out = hsum(y)
//! ```
//!
//! Codes enter as twice their e2m1 value (exact small integers, -0 as 0) and
//! the 1/2 is folded into the power-of-two scale: every intermediate is
//! exactly twice (or half) what the plain formula gives, so nothing rounds
//! differently. The product never forms a dequantized weight, so it stays
//! finite wherever the exact result fits f32, even for scales (254) whose
//! dequantized weights overflow. A scale of 255 (NaN) makes the row's outputs
//! NaN for every token.
//!
//! A group is one block at every level (4 x 8 lanes on AVX2 and scalar, 2 x
//! 16 on AVX-512). Codes become f32 by table, with no integer conversion:
//! on AVX-512 a 16-entry f32 table indexed by each lane's nibble
//! (`vpermps`); on AVX2 two 16-entry byte tables give the two non-zero bytes
//! of each f32 (`vpshufb`), interleaved with zero bytes into place.

#[cfg(target_arch = "x86_64")]
use super::{q_chunk_avx2, q_chunk_avx512, Avx2, Avx512};
use super::{q_chunk_scalar, q_run, Job, OutPtr, Packed, Scalar, SimdLevel, Unpack};
use crate::quant::interleave::ROWS;
use crate::quant::mxfp4::{half_scale_f32, Mxfp4Matrix, CODES_PER_WORD, E2M1_X2, GROUP};
use crate::quant::Mxfp4x8Matrix;

/// Prepares `out = W x` for an MXFP4 `W` (shapes checked by the caller).
pub(super) fn mxmatmul<'a>(
    level: SimdLevel,
    m: &'a Mxfp4Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    type M<'b> = Mxfp4Matrix<'b>;
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => {
            q_run::<Avx512, A512Fp4, 2, _>(m, x, n, out, q_chunk_avx512::<M, A512Fp4, 2>)
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => q_run::<Avx2, A2Fp4, 4, _>(m, x, n, out, q_chunk_avx2::<M, A2Fp4, 4>),
        _ => q_run::<Scalar, ScalarFp4, 4, _>(m, x, n, out, q_chunk_scalar::<M, ScalarFp4, 4>),
    }
}

/// Prepares `out = W x` for an interleaved MXFP4 `W` with f32 activations:
/// each group of eight rows put back in row order and multiplied by
/// [`mxmatmul`], so the bits are the row-major ones. A fallback (the
/// interleaved form is made for the 8-bit-activation product); the job's
/// "rows" are the groups.
pub(super) fn mx8matmul<'a>(
    level: SimdLevel,
    m: &'a Mxfp4x8Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    Job {
        rows: m.rows / ROWS,
        work_per_row: ROWS * m.cols * n,
        run: Box::new(move |g0, g1| {
            let out = out; // the whole pointer wrapper (Sync), not its field
            let mut codes = vec![0u32; ROWS * m.cols / CODES_PER_WORD];
            let mut scales = vec![0u8; ROWS * m.cols / GROUP];
            let mut y = vec![0.0f32; n * ROWS];
            for g in g0..g1 {
                m.deinterleave_group(g, &mut codes, &mut scales);
                let rows = Mxfp4Matrix {
                    rows: ROWS,
                    cols: m.cols,
                    codes: &codes,
                    scales: &scales,
                };
                (mxmatmul(level, &rows, x, n, OutPtr(y.as_mut_ptr())).run)(0, ROWS);
                // SAFETY: `job` checked that `out` holds n * rows floats.
                unsafe { super::scatter_group(&y, n, m.rows, g, out) };
            }
        }),
    }
}

/// [`half_scale_f32`] of every scale byte.
static HALF_SCALES: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut s = 0;
    while s < 256 {
        t[s] = half_scale_f32(s as u8);
        s += 1;
    }
    t
};

impl Packed for Mxfp4Matrix<'_> {
    const BIASED: bool = false;
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn group_size(&self) -> usize {
        GROUP
    }
    fn row_codes(&self, r: usize) -> *const u8 {
        self.codes[r * self.words_per_row()..].as_ptr() as *const u8
    }
    /// The scales halved (see the module docs).
    #[inline(always)]
    fn load_params(&self, r: usize, sc: &mut [f32], _bi: &mut [f32]) {
        let gpr = self.groups_per_row();
        for (d, &s) in sc.iter_mut().zip(&self.scales[r * gpr..(r + 1) * gpr]) {
            *d = HALF_SCALES[s as usize];
        }
    }
    fn unpack_generic(&self, _r: usize, _out: &mut [f32]) {
        unreachable!("every level has an MXFP4 unpacker")
    }
}

// ---------------------------------------------------------------------------
// Unpackers: 32 codes (16 bytes, one group) to twice their e2m1 values.

/// Portable: natural order, by table.
pub(super) struct ScalarFp4;
impl Unpack<Scalar, 4> for ScalarFp4 {
    const FUSED: bool = true;
    const IDENTITY: bool = true;
    const BYTES: usize = 16;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> [[f32; 8]; 4] {
        let mut v = [[0.0f32; 8]; 4];
        for b in 0..16 {
            let byte = *p.add(b);
            let e = 2 * b;
            v[e / 8][e % 8] = E2M1_X2[(byte & 15) as usize] as f32;
            v[e / 8][e % 8 + 1] = E2M1_X2[(byte >> 4) as usize] as f32;
        }
        v
    }
    fn perm(pos: usize) -> usize {
        pos
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::E2M1_X2;
    use crate::backend::cpu::qmatmul::unpack::Unpack;
    use crate::backend::cpu::simd::{Avx2, Avx512};
    use std::arch::x86_64::*;

    /// `2 * e2m1` by code, in f32.
    static VALUES: [f32; 16] = {
        let mut t = [0.0f32; 16];
        let mut c = 0;
        while c < 16 {
            t[c] = E2M1_X2[c] as f32;
            c += 1;
        }
        t
    };

    /// Byte `k` of each code's `2 * e2m1` in f32. Bytes 0 and 1 are zero
    /// for every code (the values have at most two significant bits).
    const fn f32_byte(k: u32) -> [u8; 16] {
        let mut t = [0u8; 16];
        let mut c = 0;
        while c < 16 {
            let bits = (E2M1_X2[c] as f32).to_bits();
            assert!(bits & 0xffff == 0);
            t[c] = (bits >> (8 * k)) as u8;
            c += 1;
        }
        t
    }
    static BYTE2: [u8; 16] = f32_byte(2);
    static BYTE3: [u8; 16] = f32_byte(3);

    /// AVX-512: the 16 bytes widened to 32-bit lanes, each lane's low nibble
    /// (even elements) then high nibble (odd elements) looked up in the f32
    /// table (`vpermps` reads only the index's low 4 bits).
    pub(crate) struct A512Fp4;
    impl Unpack<Avx512, 2> for A512Fp4 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 16;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m512; 2] {
            let t = _mm512_loadu_ps(VALUES.as_ptr());
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            [
                _mm512_permutexvar_ps(b, t),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(b), t),
            ]
        }
        fn perm(pos: usize) -> usize {
            if pos < 16 {
                2 * pos
            } else {
                2 * (pos - 16) + 1
            }
        }
    }

    /// AVX2: the 16 bytes in both halves, low nibbles (even elements) in the
    /// low half and high nibbles (odd elements) in the high half; bytes 2
    /// and 3 of the f32 values looked up, then interleaved with zeros into
    /// 32-bit lanes. Vector `k` holds elements `8k, 8k+2, 8k+4, 8k+6` in
    /// lanes 0-3 and `8k+1, .., 8k+7` in lanes 4-7.
    pub(crate) struct A2Fp4;
    impl Unpack<Avx2, 4> for A2Fp4 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 16;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m256; 4] {
            let t2 = _mm256_broadcastsi128_si256(_mm_loadu_si128(BYTE2.as_ptr() as *const __m128i));
            let t3 = _mm256_broadcastsi128_si256(_mm_loadu_si128(BYTE3.as_ptr() as *const __m128i));
            let b = _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i));
            let nibbles = _mm256_and_si256(
                _mm256_blend_epi32::<0xF0>(b, _mm256_srli_epi16::<4>(b)),
                _mm256_set1_epi8(15),
            );
            let (b2, b3) = (
                _mm256_shuffle_epi8(t2, nibbles),
                _mm256_shuffle_epi8(t3, nibbles),
            );
            let (lo, hi) = (_mm256_unpacklo_epi8(b2, b3), _mm256_unpackhi_epi8(b2, b3));
            let z = _mm256_setzero_si256();
            [
                _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, lo)),
                _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, lo)),
                _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, hi)),
                _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, hi)),
            ]
        }
        fn perm(pos: usize) -> usize {
            let l = pos % 8;
            8 * (pos / 8) + if l < 4 { 2 * l } else { 2 * (l - 4) + 1 }
        }
    }
}

#[cfg(test)]
mod tests;
