//! The 8-bit-activation product of interleaved MXFP4
//! ([`Mxfp4x8Matrix`]): the parent's contract lane for lane, so it gives
//! the bits the row-major kernels give for the same weights, eight rows per
//! pass. One 32-byte load holds lane `k`'s four code bytes of all eight
//! rows, so the lane's activation bytes are one broadcast, the eight rows'
//! scales of a block one vector, and the matrix one sequential stream.

use super::{chunk_body, Acts, Kind, BLOCK};
use crate::backend::cpu::qmatmul::{Job, OutPtr};
use crate::quant::mxfp4::interleaved::ROWS;
use crate::quant::mxfp4::{Mxfp4Matrix, Mxfp4x8Matrix, CODES_PER_WORD, GROUP};

/// Prepares `out = W x` (shapes checked by the caller); the job's "rows"
/// are groups of eight rows.
pub(super) fn job<'a>(
    simd: bool,
    m: &'a Mxfp4x8Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    let acts = Acts::new(Kind::Mx4, x, n, m.cols, GROUP);
    Job {
        rows: m.rows / ROWS,
        work_per_row: ROWS * m.cols * n,
        // SAFETY: `simd` is set only where the CPU has AVX2 and FMA.
        run: Box::new(move |g0, g1| unsafe {
            #[cfg(target_arch = "x86_64")]
            if simd {
                return avx2::groups(m, &acts, g0, g1, out);
            }
            let _ = simd;
            portable_groups(m, &acts, g0, g1, out)
        }),
    }
}

/// Row groups `g0..g1` by the row-major portable kernel on each group
/// put back in row order (machines without AVX2; the reference).
///
/// # Safety
/// `out` holds `a.n * m.rows` floats.
unsafe fn portable_groups(m: &Mxfp4x8Matrix, a: &Acts, g0: usize, g1: usize, out: OutPtr) {
    let mut codes = vec![0u32; ROWS * m.cols / CODES_PER_WORD];
    let mut scales = vec![0u8; ROWS * m.cols / BLOCK];
    let mut y = vec![0.0f32; a.n * ROWS];
    for g in g0..g1 {
        m.deinterleave_group(g, &mut codes, &mut scales);
        let rows = Mxfp4Matrix {
            rows: ROWS,
            cols: m.cols,
            codes: &codes,
            scales: &scales,
        };
        chunk_body::<Mxfp4Matrix, false>(&rows, a, 0, ROWS, OutPtr(y.as_mut_ptr()));
        for t in 0..a.n {
            for i in 0..ROWS {
                *out.0.add(t * m.rows + ROWS * g + i) = y[t * ROWS + i];
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2::MX_OFFSET;
    use super::{Acts, OutPtr, ROWS};
    use crate::quant::mxfp4::interleaved::UNIT_CODE_BYTES;
    use crate::quant::mxfp4::Mxfp4x8Matrix;
    use std::arch::x86_64::*;

    /// Software prefetch distance: one stream, a few units ahead.
    const PREFETCH_BYTES: usize = 4096;

    /// Row groups `g0..g1` for every token.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` holds `a.n * m.rows` floats; `m`
    /// was checked and its scales are plain (`interleavable`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn groups(m: &Mxfp4x8Matrix, a: &Acts, g0: usize, g1: usize, out: OutPtr) {
        for g in g0..g1 {
            let (codes, scales) = m.group(g);
            for t in 0..a.n {
                let y = group(codes.as_ptr(), scales.as_ptr(), a, t);
                _mm256_storeu_ps(out.0.add(t * m.rows + ROWS * g), y);
            }
        }
    }

    /// The eight rows' halved scales of one block: `(s - 1) << 23` as f32
    /// (what `half_scale_f32` gives for the plain scales 2..=254).
    #[inline(always)]
    unsafe fn half_scales(p: *const u8) -> __m256 {
        let s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_sub_epi32(s, _mm256_set1_epi32(1)),
            23,
        ))
    }

    /// One row group, token `t`: lane `i` is row `i`'s output.
    #[inline(always)]
    unsafe fn group(codes: *const u8, scales: *const u8, a: &Acts, t: usize) -> __m256 {
        let low = _mm256_set1_epi8(15);
        let ones = _mm256_set1_epi16(1);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(MX_OFFSET.as_ptr() as *const _));
        let mut acc = [_mm256_setzero_ps(); 8];
        for u in 0..a.units {
            let c = codes.add(u * UNIT_CODE_BYTES);
            // The unit's activation bytes: lane k's low-nibble inputs at
            // dword k, its high-nibble inputs at dword 8 + k.
            let x = a.unit(t, u) as *const i32;
            let lanes = (t * a.units + u) * 8;
            let dx = a.dxv.as_ptr().add(lanes);
            let corr = a.corr.as_ptr().add(lanes);
            let s = scales.add(u * 2 * ROWS);
            let ds0 = _mm256_mul_ps(half_scales(s), _mm256_broadcast_ss(&*dx));
            let ds1 = _mm256_mul_ps(half_scales(s.add(ROWS)), _mm256_broadcast_ss(&*dx.add(4)));
            for (k, acc) in acc.iter_mut().enumerate() {
                let p = c.add(32 * k);
                if k % 2 == 0 {
                    _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                }
                let v = _mm256_loadu_si256(p as *const __m256i);
                let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, low));
                let hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low));
                let xl = _mm256_set1_epi32(x.add(k).read_unaligned());
                let xh = _mm256_set1_epi32(x.add(8 + k).read_unaligned());
                let s16 =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                let si = _mm256_add_epi32(
                    _mm256_madd_epi16(s16, ones),
                    _mm256_set1_epi32(*corr.add(k)),
                );
                let ds = if k < 4 { ds0 } else { ds1 };
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), ds, *acc);
            }
        }
        // The contract's tree8, for eight rows at once.
        _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
            _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])),
        )
    }
}
