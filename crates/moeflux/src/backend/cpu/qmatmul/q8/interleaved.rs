//! The 8-bit-activation products of interleaved 4-bit matrices
//! ([`Mxfp4x8Matrix`], [`Affine4x8Matrix`]): the parent's contract, so
//! they give the bits the row-major kernels give for the same weights,
//! eight rows per pass. One 32-byte load holds lane `k`'s four code bytes
//! of all eight rows (a block is four lanes), so the lane's activation
//! bytes are one broadcast, the eight rows' scales of a block one vector
//! (and an affine group's biases another), and the matrix one sequential
//! stream. Several tokens share each load and unpacking of the codes, and
//! a block's integer sums are widened and scaled once per token: by
//! `vpmaddubsw` summed in 16 bits on AVX2, by `vpdpbusd` where the CPU has
//! AVX-512 VNNI (at the AVX-512 level).

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

    /// How a block's exact integer sums of `code * xq` (one per row) are
    /// formed from its lanes' low- and high-nibble codes and activations
    /// (the same integers either way).
    trait Dot {
        /// Tokens per pass over a row group's codes: each code vector is
        /// loaded and unpacked once for all of them.
        const TOKENS: usize;
        /// Lanes a partial sum takes before [`Dot::widen`] (headroom).
        const LANES: usize;
        /// `part` plus one lane's products.
        unsafe fn add(part: __m256i, lo: __m256i, hi: __m256i, xl: __m256i, xh: __m256i)
            -> __m256i;
        /// A partial sum as eight exact i32 row sums.
        unsafe fn widen(part: __m256i) -> __m256i;
    }

    /// AVX2: `vpmaddubsw` pairs summed in 16 bits, widened by `vpmaddwd`
    /// once per block. Affine codes (<= 15) leave room for a block's four
    /// lanes (at most 8 * 2 * 15 * 127 = 30480); MXFP4's offset codes
    /// (<= 24) for two. Four tokens a pass: their partial sums and
    /// accumulators take eight of the sixteen registers.
    struct Maddubs<const MX: bool>;

    impl<const MX: bool> Dot for Maddubs<MX> {
        const TOKENS: usize = if MX { 2 } else { 4 };
        const LANES: usize = if MX { 2 } else { 4 };
        #[inline(always)]
        unsafe fn add(
            part: __m256i,
            lo: __m256i,
            hi: __m256i,
            xl: __m256i,
            xh: __m256i,
        ) -> __m256i {
            let s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            _mm256_add_epi16(part, s16)
        }
        #[inline(always)]
        unsafe fn widen(part: __m256i) -> __m256i {
            _mm256_madd_epi16(part, _mm256_set1_epi16(1))
        }
    }

    /// AVX-512 VNNI on 256-bit vectors: `vpdpbusd` adds straight into 32
    /// bits. Four tokens a pass (AVX-512 has 32 registers).
    struct Vnni;

    impl Dot for Vnni {
        const TOKENS: usize = 4;
        const LANES: usize = 4;
        #[inline(always)]
        unsafe fn add(
            part: __m256i,
            lo: __m256i,
            hi: __m256i,
            xl: __m256i,
            xh: __m256i,
        ) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(part, lo, xl), hi, xh)
        }
        #[inline(always)]
        unsafe fn widen(part: __m256i) -> __m256i {
            part
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
        mxfp4_groups::<Maddubs<true>>(m, a, g0, g1, out)
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
        affine_groups::<Maddubs<false>>(m, a, g0, g1, out)
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

    /// Calls `$pass!(T, t)` for tokens `t..t + T` in passes of
    /// `D::TOKENS`, then of two and one for the rest.
    macro_rules! passes {
        ($d:ty, $n:expr, $pass:ident) => {{
            let mut t = 0;
            while t + <$d>::TOKENS <= $n {
                match <$d>::TOKENS {
                    4 => $pass!(4, t),
                    _ => $pass!(2, t),
                }
                t += <$d>::TOKENS;
            }
            if t + 2 <= $n {
                $pass!(2, t);
                t += 2;
            }
            if t < $n {
                $pass!(1, t);
            }
        }};
    }

    #[inline(always)]
    unsafe fn mxfp4_groups<D: Dot>(m: &Mxfp4x8Matrix, a: &Acts, g0: usize, g1: usize, out: OutPtr) {
        for g in g0..g1 {
            let (codes, scales) = m.group(g);
            let (c, s) = (codes.as_ptr(), scales.as_ptr());
            let y = out.0.add(ROWS * g);
            macro_rules! pass {
                ($tn:literal, $t:expr) => {{
                    let v = group::<true, $tn, D>(c, s, 1, a, $t);
                    for (j, vj) in v.into_iter().enumerate() {
                        _mm256_storeu_ps(y.add(($t + j) * m.rows), vj);
                    }
                }};
            }
            passes!(D, a.n, pass);
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
            macro_rules! pass {
                ($tn:literal, $t:expr) => {{
                    let v = group::<false, $tn, D>(c, p as *const u8, upg, a, $t);
                    for (j, vj) in v.into_iter().enumerate() {
                        let b = bias_term(p, a, gpr, $t + j);
                        _mm256_storeu_ps(y.add(($t + j) * m.rows), _mm256_add_ps(vj, b));
                    }
                }};
            }
            passes!(D, a.n, pass);
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
    /// `i`'s `acc` of token `t0 + j`, each code vector loaded and unpacked
    /// once for all `T` tokens. `MX`: MXFP4 codes (by table, offset by 12
    /// and corrected) with `params` the group's scale bytes; else unsigned
    /// affine codes with `params` the group's bf16 scales and biases, `upg`
    /// units per quantization group. (No closures in hot code: a closure
    /// is compiled without the caller's target features.)
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
        let mut acc = [_mm256_setzero_ps(); T];
        // The affine group of unit u, counted (a division per unit cost
        // more than its unit's conversions).
        let (mut grp, mut left) = (0, upg);
        for u in 0..a.units {
            let c = codes.add(u * UNIT_CODE_BYTES);
            let (s0, s1) = if MX {
                let s = params.add(u * 2 * ROWS);
                (half_scales(s), half_scales(s.add(ROWS)))
            } else {
                let s = bf16x8((params as *const u16).add(2 * ROWS * grp));
                left -= 1;
                if left == 0 {
                    grp += 1;
                    left = upg;
                }
                (s, s)
            };
            // Per token, the unit's activation bytes: lane k's low-nibble
            // inputs at dword k, its high-nibble inputs at dword 8 + k.
            let x: [*const i32; T] = std::array::from_fn(|j| a.unit(t0 + j, u) as *const i32);
            // Block 2u + h takes lanes 4h..4h + 4.
            for h in 0..2 {
                let mut isum = [_mm256_setzero_si256(); T];
                let mut part = [_mm256_setzero_si256(); T];
                for k in 4 * h..4 * h + 4 {
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
                        part[j] = D::add(part[j], lo, hi, xl, xh);
                    }
                    if (k + 1) % D::LANES == 0 {
                        for j in 0..T {
                            isum[j] = _mm256_add_epi32(isum[j], D::widen(part[j]));
                            part[j] = _mm256_setzero_si256();
                        }
                    }
                }
                let sh = if h == 0 { s0 } else { s1 };
                for j in 0..T {
                    let lane = ((t0 + j) * a.units + u) * 8 + 4 * h;
                    if MX {
                        let cv = _mm256_set1_epi32(*a.corr.as_ptr().add(lane));
                        isum[j] = _mm256_add_epi32(isum[j], cv);
                    }
                    let ds = _mm256_mul_ps(sh, _mm256_broadcast_ss(&*a.dxv.as_ptr().add(lane)));
                    acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), ds, acc[j]);
                }
            }
        }
        acc
    }
}
