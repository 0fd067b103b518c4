//! The 8-bit-activation products of interleaved 4-bit matrices
//! ([`Mxfp4x8Matrix`], [`Affine4x8Matrix`]): the parent's contract lane
//! for lane, so they give the bits the row-major kernels give for the same
//! weights, eight rows per pass. One 32-byte load holds lane `k`'s four
//! code bytes of all eight rows, so the lane's activation bytes are one
//! broadcast, the eight rows' scales of a block one vector (and an affine
//! group's biases another), and the matrix one sequential stream. Where the
//! CPU has AVX-512 VNNI (at the AVX-512 level), one `vpdpbusd` per nibble
//! half replaces `vpmaddubsw` + `vpaddw` + `vpmaddwd` (the same exact
//! integer sums) and two tokens share each load and unpacking of the codes
//! (AVX-512's 32 vector registers hold both tokens' accumulators).

use super::{chunk_body, Acts, Kind, BLOCK};
use crate::backend::cpu::qmatmul::scatter_group;
use crate::backend::cpu::qmatmul::{Job, OutPtr, SimdLevel};
use crate::quant::interleave::ROWS;
use crate::quant::mxfp4::{Mxfp4Matrix, CODES_PER_WORD, GROUP};
use crate::quant::Mxfp4x8Matrix;
use crate::quant::{Affine4x8Matrix, QMatrix, QuantSpec, ScaleData};

/// The kernel a level runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Isa {
    Portable,
    Avx2,
    /// AVX-512 (F, VL, BW) with VNNI.
    Vnni,
}

impl Isa {
    fn at(level: SimdLevel) -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if level >= SimdLevel::Avx512
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512bw")
            {
                return Isa::Vnni;
            }
            if level >= SimdLevel::Avx2 {
                return Isa::Avx2;
            }
        }
        let _ = level;
        Isa::Portable
    }
}

/// Prepares `out = W x` for interleaved MXFP4 (shapes checked by the
/// caller); the job's "rows" are groups of eight rows.
pub(super) fn job_mxfp4<'a>(
    level: SimdLevel,
    m: &'a Mxfp4x8Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    let acts = Acts::new(Kind::Mx4, x, n, m.cols, GROUP);
    let isa = Isa::at(level);
    Job {
        rows: m.rows / ROWS,
        work_per_row: ROWS * m.cols * n,
        // SAFETY: `Isa::at` picks a kernel the CPU runs.
        run: Box::new(move |g0, g1| unsafe {
            #[cfg(target_arch = "x86_64")]
            match isa {
                Isa::Vnni => return vnni::groups_mxfp4(m, &acts, g0, g1, out),
                Isa::Avx2 => return avx2::groups_mxfp4(m, &acts, g0, g1, out),
                Isa::Portable => {}
            }
            portable_groups_mxfp4(m, &acts, g0, g1, out)
        }),
    }
}

/// [`job_mxfp4`] for interleaved affine 4-bit weights.
pub(super) fn job_affine<'a>(
    level: SimdLevel,
    m: &'a Affine4x8Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    let acts = Acts::new(Kind::Nib4, x, n, m.cols, m.group_size);
    let isa = Isa::at(level);
    Job {
        rows: m.rows / ROWS,
        work_per_row: ROWS * m.cols * n,
        // SAFETY: `Isa::at` picks a kernel the CPU runs.
        run: Box::new(move |g0, g1| unsafe {
            #[cfg(target_arch = "x86_64")]
            match isa {
                Isa::Vnni => return vnni::groups_affine(m, &acts, g0, g1, out),
                Isa::Avx2 => return avx2::groups_affine(m, &acts, g0, g1, out),
                Isa::Portable => {}
            }
            portable_groups_affine(m, &acts, g0, g1, out)
        }),
    }
}

/// Row groups `g0..g1` by the row-major portable kernel on each group put
/// back in row order (machines without AVX2; the reference).
///
/// # Safety
/// `out` holds `a.n * m.rows` floats.
unsafe fn portable_groups_affine(m: &Affine4x8Matrix, a: &Acts, g0: usize, g1: usize, out: OutPtr) {
    let gpr = m.groups_per_row();
    let mut packed = vec![0u32; ROWS * m.cols / CODES_PER_WORD];
    let (mut scales, mut biases) = (vec![0u16; ROWS * gpr], vec![0u16; ROWS * gpr]);
    let mut y = vec![0.0f32; a.n * ROWS];
    for g in g0..g1 {
        m.deinterleave_group(g, &mut packed, &mut scales, &mut biases);
        let rows = QMatrix {
            rows: ROWS,
            cols: m.cols,
            spec: QuantSpec::affine(4, m.group_size),
            packed: &packed,
            scales: ScaleData::Bf16(&scales),
            biases: ScaleData::Bf16(&biases),
        };
        chunk_body::<QMatrix, false>(&rows, a, 0, ROWS, OutPtr(y.as_mut_ptr()));
        scatter_group(&y, a.n, m.rows, g, out);
    }
}

/// [`portable_groups_affine`] for MXFP4.
///
/// # Safety
/// `out` holds `a.n * m.rows` floats.
unsafe fn portable_groups_mxfp4(m: &Mxfp4x8Matrix, a: &Acts, g0: usize, g1: usize, out: OutPtr) {
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
        scatter_group(&y, a.n, m.rows, g, out);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::avx2::MX_OFFSET;
    use super::{Acts, OutPtr, ROWS};
    use crate::quant::interleave::UNIT_CODE_BYTES;
    use crate::quant::{Affine4x8Matrix, Mxfp4x8Matrix};
    use std::arch::x86_64::*;

    /// Software prefetch distance: one stream, a few units ahead.
    pub(super) const PREFETCH_BYTES: usize = 4096;

    /// Row groups `g0..g1` of interleaved MXFP4 for every token.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` holds `a.n * m.rows` floats; `m`
    /// was checked and its scales are plain (`interleavable`).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn groups_mxfp4(
        m: &Mxfp4x8Matrix,
        a: &Acts,
        g0: usize,
        g1: usize,
        out: OutPtr,
    ) {
        for g in g0..g1 {
            let (codes, scales) = m.group(g);
            for t in 0..a.n {
                let y = group::<true>(codes.as_ptr(), scales.as_ptr(), 1, a, t);
                _mm256_storeu_ps(out.0.add(t * m.rows + ROWS * g), y);
            }
        }
    }

    /// Row groups `g0..g1` of interleaved affine 4-bit for every token.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `out` holds `a.n * m.rows` floats; `m`
    /// was checked.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn groups_affine(
        m: &Affine4x8Matrix,
        a: &Acts,
        g0: usize,
        g1: usize,
        out: OutPtr,
    ) {
        let gpr = m.groups_per_row();
        let upg = m.group_size / 64;
        for g in g0..g1 {
            let (codes, params) = m.group(g);
            let p = params.as_ptr();
            for t in 0..a.n {
                let y = group::<false>(codes.as_ptr(), p as *const u8, upg, a, t);
                let y = _mm256_add_ps(y, bias_term(p, a, gpr, t));
                _mm256_storeu_ps(out.0.add(t * m.rows + ROWS * g), y);
            }
        }
    }

    /// `bias_dot`'s eight chains (group j in chain j % 8) and tree, for the
    /// eight rows of a group (`p` its bf16 scales and biases) at once.
    #[inline(always)]
    pub(super) unsafe fn bias_term(p: *const u16, a: &Acts, gpr: usize, t: usize) -> __m256 {
        let xsum = a.xsum.as_ptr().add(t * gpr);
        let mut b = [_mm256_setzero_ps(); 8];
        for j in 0..gpr {
            let bias = bf16x8(p.add(2 * ROWS * j + ROWS));
            b[j % 8] = _mm256_fmadd_ps(bias, _mm256_broadcast_ss(&*xsum.add(j)), b[j % 8]);
        }
        tree8(b)
    }

    /// The eight rows' halved MXFP4 scales of one block: `(s - 1) << 23` as
    /// f32 (what `half_scale_f32` gives for the plain scales 2..=254).
    #[inline(always)]
    pub(super) unsafe fn half_scales(p: *const u8) -> __m256 {
        let s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_sub_epi32(s, _mm256_set1_epi32(1)),
            23,
        ))
    }

    /// Eight bf16 values as f32 (exact: the bits shifted into place).
    #[inline(always)]
    pub(super) unsafe fn bf16x8(p: *const u16) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    }

    /// `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`, the contract's
    /// tree, lane by lane.
    #[inline(always)]
    pub(super) unsafe fn tree8(v: [__m256; 8]) -> __m256 {
        _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
            _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])),
        )
    }

    /// One row group, token `t`: lane `i` is row `i`'s `tree8` of the lane
    /// accumulators. `MX`: MXFP4 codes (by table, offset by 12 and
    /// corrected) with `params` the group's scale bytes; else unsigned
    /// affine codes with `params` the group's bf16 scales and biases,
    /// `upg` units per quantization group. (No closures in hot code: a
    /// closure is compiled without the caller's target features.)
    #[inline(always)]
    unsafe fn group<const MX: bool>(
        codes: *const u8,
        params: *const u8,
        upg: usize,
        a: &Acts,
        t: usize,
    ) -> __m256 {
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
            let (s0, s1) = if MX {
                let s = params.add(u * 2 * ROWS);
                (half_scales(s), half_scales(s.add(ROWS)))
            } else {
                let s = bf16x8((params as *const u16).add(2 * ROWS * (u / upg)));
                (s, s)
            };
            let ds0 = _mm256_mul_ps(s0, _mm256_broadcast_ss(&*dx));
            let ds1 = _mm256_mul_ps(s1, _mm256_broadcast_ss(&*dx.add(4)));
            for (k, acc) in acc.iter_mut().enumerate() {
                let p = c.add(32 * k);
                if k % 2 == 0 {
                    _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                }
                let v = _mm256_loadu_si256(p as *const __m256i);
                let mut lo = _mm256_and_si256(v, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if MX {
                    lo = _mm256_shuffle_epi8(table, lo);
                    hi = _mm256_shuffle_epi8(table, hi);
                }
                let xl = _mm256_set1_epi32(x.add(k).read_unaligned());
                let xh = _mm256_set1_epi32(x.add(8 + k).read_unaligned());
                let s16 =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                let mut si = _mm256_madd_epi16(s16, ones);
                if MX {
                    si = _mm256_add_epi32(si, _mm256_set1_epi32(*corr.add(k)));
                }
                let ds = if k < 4 { ds0 } else { ds1 };
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), ds, *acc);
            }
        }
        tree8(acc)
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::super::avx2::MX_OFFSET;
    use super::avx2::{bf16x8, bias_term, half_scales, tree8, PREFETCH_BYTES};
    use super::{Acts, OutPtr, ROWS};
    use crate::quant::interleave::UNIT_CODE_BYTES;
    use crate::quant::{Affine4x8Matrix, Mxfp4x8Matrix};
    use std::arch::x86_64::*;

    /// Row groups `g0..g1` of interleaved MXFP4 for every token, two at a
    /// time.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, VL, BW and VNNI; as `avx2::groups_mxfp4`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(super) unsafe fn groups_mxfp4(
        m: &Mxfp4x8Matrix,
        a: &Acts,
        g0: usize,
        g1: usize,
        out: OutPtr,
    ) {
        for g in g0..g1 {
            let (codes, scales) = m.group(g);
            let (c, s) = (codes.as_ptr(), scales.as_ptr());
            let y = out.0.add(ROWS * g);
            let mut t = 0;
            while t + 2 <= a.n {
                let [y0, y1] = group::<true, 2>(c, s, 1, a, t);
                _mm256_storeu_ps(y.add(t * m.rows), y0);
                _mm256_storeu_ps(y.add((t + 1) * m.rows), y1);
                t += 2;
            }
            if t < a.n {
                let [y0] = group::<true, 1>(c, s, 1, a, t);
                _mm256_storeu_ps(y.add(t * m.rows), y0);
            }
        }
    }

    /// Row groups `g0..g1` of interleaved affine 4-bit for every token, two
    /// at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, VL, BW and VNNI; as `avx2::groups_affine`.
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(super) unsafe fn groups_affine(
        m: &Affine4x8Matrix,
        a: &Acts,
        g0: usize,
        g1: usize,
        out: OutPtr,
    ) {
        let gpr = m.groups_per_row();
        let upg = m.group_size / 64;
        for g in g0..g1 {
            let (codes, params) = m.group(g);
            let (c, p) = (codes.as_ptr(), params.as_ptr());
            let y = out.0.add(ROWS * g);
            let mut t = 0;
            while t + 2 <= a.n {
                let [y0, y1] = group::<false, 2>(c, p as *const u8, upg, a, t);
                let (b0, b1) = (bias_term(p, a, gpr, t), bias_term(p, a, gpr, t + 1));
                _mm256_storeu_ps(y.add(t * m.rows), _mm256_add_ps(y0, b0));
                _mm256_storeu_ps(y.add((t + 1) * m.rows), _mm256_add_ps(y1, b1));
                t += 2;
            }
            if t < a.n {
                let [y0] = group::<false, 1>(c, p as *const u8, upg, a, t);
                let b0 = bias_term(p, a, gpr, t);
                _mm256_storeu_ps(y.add(t * m.rows), _mm256_add_ps(y0, b0));
            }
        }
    }

    /// `avx2::group` for tokens `t0..t0 + T`, each code vector loaded and
    /// unpacked once for all of them; a lane's integer sum is one
    /// `vpdpbusd` per nibble half (the same exact sum), so every token's
    /// result has `avx2::group`'s bits.
    #[inline(always)]
    unsafe fn group<const MX: bool, const T: usize>(
        codes: *const u8,
        params: *const u8,
        upg: usize,
        a: &Acts,
        t0: usize,
    ) -> [__m256; T] {
        let low = _mm256_set1_epi8(15);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(MX_OFFSET.as_ptr() as *const _));
        let mut acc = [[_mm256_setzero_ps(); 8]; T];
        for u in 0..a.units {
            let c = codes.add(u * UNIT_CODE_BYTES);
            let (s0, s1) = if MX {
                let s = params.add(u * 2 * ROWS);
                (half_scales(s), half_scales(s.add(ROWS)))
            } else {
                let s = bf16x8((params as *const u16).add(2 * ROWS * (u / upg)));
                (s, s)
            };
            let mut x = [std::ptr::null::<i32>(); T];
            let mut corr = [std::ptr::null::<i32>(); T];
            let mut ds = [[_mm256_setzero_ps(); 2]; T];
            for j in 0..T {
                let t = t0 + j;
                x[j] = a.unit(t, u) as *const i32;
                let lanes = (t * a.units + u) * 8;
                let dx = a.dxv.as_ptr().add(lanes);
                corr[j] = a.corr.as_ptr().add(lanes);
                ds[j] = [
                    _mm256_mul_ps(s0, _mm256_broadcast_ss(&*dx)),
                    _mm256_mul_ps(s1, _mm256_broadcast_ss(&*dx.add(4))),
                ];
            }
            for k in 0..8 {
                let p = c.add(32 * k);
                if k % 2 == 0 {
                    _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                }
                let v = _mm256_loadu_si256(p as *const __m256i);
                let mut lo = _mm256_and_si256(v, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                if MX {
                    lo = _mm256_shuffle_epi8(table, lo);
                    hi = _mm256_shuffle_epi8(table, hi);
                }
                for j in 0..T {
                    let xl = _mm256_set1_epi32(x[j].add(k).read_unaligned());
                    let xh = _mm256_set1_epi32(x[j].add(8 + k).read_unaligned());
                    let mut si = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl);
                    si = _mm256_dpbusd_epi32(si, hi, xh);
                    if MX {
                        si = _mm256_add_epi32(si, _mm256_set1_epi32(*corr[j].add(k)));
                    }
                    let d = ds[j][k / 4];
                    acc[j][k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), d, acc[j][k]);
                }
            }
        }
        std::array::from_fn(|j| tree8(acc[j]))
    }
}
