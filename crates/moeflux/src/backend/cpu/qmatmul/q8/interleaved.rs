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
                Isa::Vnni => return avx2::groups_mxfp4_vnni(m, &acts, g0, g1, out),
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
                Isa::Vnni => return avx2::groups_affine_vnni(m, &acts, g0, g1, out),
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
    const PREFETCH_BYTES: usize = 4096;

    /// How a lane's exact integer sum of `code * xq` is formed from its
    /// low- and high-nibble codes and activations (the same integers
    /// either way).
    trait Dot {
        /// Tokens per pass over a row group's codes: each code vector is
        /// loaded and unpacked once for all of them.
        const TOKENS: usize;
        unsafe fn isum(lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i) -> __m256i;
    }

    /// AVX2: `vpmaddubsw` pairs (no saturation: codes <= 24, |xq| <= 127),
    /// added, then `vpmaddwd` by ones. One token per pass: a second
    /// token's eight accumulators do not fit AVX2's sixteen registers (two
    /// per pass measured 7-20% slower, `MOEFLUX_SIMD=avx2` on the Xeon).
    struct Maddubs;

    impl Dot for Maddubs {
        const TOKENS: usize = 1;
        #[inline(always)]
        unsafe fn isum(lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i) -> __m256i {
            let s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            _mm256_madd_epi16(s16, _mm256_set1_epi16(1))
        }
    }

    /// AVX-512 VNNI on 256-bit vectors: one `vpdpbusd` per nibble half.
    /// Two tokens per pass (AVX-512's 32 registers hold their sixteen
    /// accumulators).
    struct Vnni;

    impl Dot for Vnni {
        const TOKENS: usize = 2;
        #[inline(always)]
        unsafe fn isum(lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i) -> __m256i {
            let s = _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl);
            _mm256_dpbusd_epi32(s, hi, xh)
        }
    }

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
        mxfp4_groups::<Maddubs>(m, a, g0, g1, out)
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
        affine_groups::<Maddubs>(m, a, g0, g1, out)
    }

    /// [`groups_mxfp4`] by AVX-512 VNNI.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, VL, BW and VNNI; as [`groups_mxfp4`].
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(super) unsafe fn groups_mxfp4_vnni(
        m: &Mxfp4x8Matrix,
        a: &Acts,
        g0: usize,
        g1: usize,
        out: OutPtr,
    ) {
        mxfp4_groups::<Vnni>(m, a, g0, g1, out)
    }

    /// [`groups_affine`] by AVX-512 VNNI.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, VL, BW and VNNI; as [`groups_affine`].
    #[target_feature(enable = "avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")]
    pub(super) unsafe fn groups_affine_vnni(
        m: &Affine4x8Matrix,
        a: &Acts,
        g0: usize,
        g1: usize,
        out: OutPtr,
    ) {
        affine_groups::<Vnni>(m, a, g0, g1, out)
    }

    #[inline(always)]
    unsafe fn mxfp4_groups<D: Dot>(m: &Mxfp4x8Matrix, a: &Acts, g0: usize, g1: usize, out: OutPtr) {
        for g in g0..g1 {
            let (codes, scales) = m.group(g);
            let (c, s) = (codes.as_ptr(), scales.as_ptr());
            let y = out.0.add(ROWS * g);
            let mut t = 0;
            while D::TOKENS == 2 && t + 2 <= a.n {
                let [y0, y1] = group::<true, 2, D>(c, s, 1, a, t);
                _mm256_storeu_ps(y.add(t * m.rows), y0);
                _mm256_storeu_ps(y.add((t + 1) * m.rows), y1);
                t += 2;
            }
            for t in t..a.n {
                let [y0] = group::<true, 1, D>(c, s, 1, a, t);
                _mm256_storeu_ps(y.add(t * m.rows), y0);
            }
        }
    }

    #[inline(always)]
    unsafe fn affine_groups<D: Dot>(
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
            while D::TOKENS == 2 && t + 2 <= a.n {
                let [y0, y1] = group::<false, 2, D>(c, p as *const u8, upg, a, t);
                let (b0, b1) = (bias_term(p, a, gpr, t), bias_term(p, a, gpr, t + 1));
                _mm256_storeu_ps(y.add(t * m.rows), _mm256_add_ps(y0, b0));
                _mm256_storeu_ps(y.add((t + 1) * m.rows), _mm256_add_ps(y1, b1));
                t += 2;
            }
            for t in t..a.n {
                let [y0] = group::<false, 1, D>(c, p as *const u8, upg, a, t);
                let b0 = bias_term(p, a, gpr, t);
                _mm256_storeu_ps(y.add(t * m.rows), _mm256_add_ps(y0, b0));
            }
        }
    }

    /// `bias_dot`'s eight chains (group j in chain j % 8) and tree, for the
    /// eight rows of a group (`p` its bf16 scales and biases) at once.
    #[inline(always)]
    unsafe fn bias_term(p: *const u16, a: &Acts, gpr: usize, t: usize) -> __m256 {
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
    unsafe fn half_scales(p: *const u8) -> __m256 {
        let s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_sub_epi32(s, _mm256_set1_epi32(1)),
            23,
        ))
    }

    /// Eight bf16 values as f32 (exact: the bits shifted into place).
    #[inline(always)]
    unsafe fn bf16x8(p: *const u16) -> __m256 {
        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
    }

    /// `((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7))`, the contract's
    /// tree, lane by lane.
    #[inline(always)]
    unsafe fn tree8(v: [__m256; 8]) -> __m256 {
        _mm256_add_ps(
            _mm256_add_ps(_mm256_add_ps(v[0], v[4]), _mm256_add_ps(v[2], v[6])),
            _mm256_add_ps(_mm256_add_ps(v[1], v[5]), _mm256_add_ps(v[3], v[7])),
        )
    }

    /// One row group, tokens `t0..t0 + T`: lane `i` of output `j` is row
    /// `i`'s `tree8` of token `t0 + j`'s lane accumulators, each code
    /// vector loaded and unpacked once for all `T` tokens. `MX`: MXFP4
    /// codes (by table, offset by 12 and corrected) with `params` the
    /// group's scale bytes; else unsigned affine codes with `params` the
    /// group's bf16 scales and biases, `upg` units per quantization group.
    /// (No closures in hot code: a closure is compiled without the
    /// caller's target features.)
    #[inline(always)]
    unsafe fn group<const MX: bool, const T: usize, D: Dot>(
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
            // Per token: the unit's activation bytes (lane k's low-nibble
            // inputs at dword k, its high-nibble inputs at dword 8 + k),
            // its lanes' corrections and the two blocks' scale products.
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
                    let mut si = D::isum(lo, hi, xl, xh);
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
