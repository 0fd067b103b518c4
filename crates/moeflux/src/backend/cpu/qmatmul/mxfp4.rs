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

use std::borrow::Cow;
use std::marker::PhantomData;

use super::{
    qtile, Buf, Fused, Isa, Job, OutPtr, Scalar, SimdLevel, Unpack, BATCH_MIN_TOKENS, BUF_FLOATS,
    PREFETCH_BYTES,
};
#[cfg(target_arch = "x86_64")]
use super::{Avx2, Avx512};
use crate::quant::mxfp4::{half_scale_f32, Mxfp4Matrix, E2M1_X2, GROUP};

/// Per-call state of an MXFP4 matmul.
struct MCtx<'a> {
    m: &'a Mxfp4Matrix<'a>,
    n: usize,
    /// Activations in the kernel's stream order, `n * cols`.
    xs: Cow<'a, [f32]>,
}

type MChunkFn = unsafe fn(&MCtx<'_>, usize, usize, OutPtr);

/// Prepares `out = W x` for an MXFP4 `W` (shapes checked by the caller).
pub(super) fn mxmatmul<'a>(
    level: SimdLevel,
    m: &'a Mxfp4Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => m_run::<Avx512, A512Fp4, 2>(m, x, n, out, m_chunk_avx512),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => m_run::<Avx2, A2Fp4, 4>(m, x, n, out, m_chunk_avx2),
        _ => m_run::<Scalar, ScalarFp4, 4>(m, x, n, out, m_chunk_scalar),
    }
}

fn m_run<'a, S: Isa, U: Unpack<S, NV>, const NV: usize>(
    m: &'a Mxfp4Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
    chunk: MChunkFn,
) -> Job<'a> {
    const { assert!(NV * S::LANES == GROUP) };
    let xs = if U::IDENTITY {
        Cow::Borrowed(x)
    } else {
        let perm: Vec<usize> = (0..GROUP).map(U::perm).collect();
        let mut v = vec![0.0f32; x.len()];
        for (d, s) in v.chunks_exact_mut(GROUP).zip(x.chunks_exact(GROUP)) {
            for (o, &p) in d.iter_mut().zip(&perm) {
                *o = s[p];
            }
        }
        Cow::Owned(v)
    };
    let ctx = MCtx { m, n, xs };
    Job {
        rows: m.rows,
        work_per_row: m.cols * n,
        // SAFETY: `chunk` matches the CPU (the level was clamped) and writes
        // only rows r0..r1 of `out`, which `job` checked to hold them all.
        run: Box::new(move |r0, r1| unsafe { chunk(&ctx, r0, r1, out) }),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn m_chunk_avx512(ctx: &MCtx<'_>, r0: usize, r1: usize, out: OutPtr) {
    m_chunk::<Avx512, A512Fp4, 2, 4, 2, 4>(ctx, r0, r1, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn m_chunk_avx2(ctx: &MCtx<'_>, r0: usize, r1: usize, out: OutPtr) {
    m_chunk::<Avx2, A2Fp4, 4, 4, 2, 4>(ctx, r0, r1, out)
}

unsafe fn m_chunk_scalar(ctx: &MCtx<'_>, r0: usize, r1: usize, out: OutPtr) {
    m_chunk::<Scalar, ScalarFp4, 4, 4, 2, 2>(ctx, r0, r1, out)
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

/// Row `r`'s scales, halved (see the module docs), in f32.
#[inline(always)]
fn load_scales(m: &Mxfp4Matrix, r: usize, dst: &mut [f32]) {
    let gpr = m.groups_per_row();
    for (d, &s) in dst.iter_mut().zip(&m.scales[r * gpr..(r + 1) * gpr]) {
        *d = HALF_SCALES[s as usize];
    }
}

/// Unpacks row `r`'s codes (times 2) to f32 in stream order.
#[inline(always)]
unsafe fn unpack_row<S: Isa, U: Unpack<S, NV>, const NV: usize>(
    m: &Mxfp4Matrix,
    r: usize,
    out: &mut [f32],
) {
    let p = m.codes.as_ptr().add(r * m.words_per_row()) as *const u8;
    let o = out.as_mut_ptr();
    for b in 0..m.groups_per_row() {
        let v = U::unpack(p.add(b * U::BYTES));
        for (j, &vj) in v.iter().enumerate() {
            S::store(o.add(b * GROUP + j * S::LANES), vj);
        }
    }
}

/// Writes `hsum(y)` for a tile.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn m_finish<S: Isa, const R: usize, const T: usize>(
    ctx: &MCtx<'_>,
    y: [[S::V; T]; R],
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    let rows = ctx.m.rows;
    for r in 0..R {
        for t in 0..T {
            *out.0.add((t0 + t) * rows + r0 + r) = S::hsum(y[r][t]);
        }
    }
}

/// Few tokens: `RF` rows at a time, codes unpacked in registers per token
/// pass. More: blocks of rows unpacked once into a buffer, then `RB` x `TB`
/// tiles, token tiles outermost.
#[inline(always)]
unsafe fn m_chunk<
    S: Isa,
    U: Unpack<S, NV>,
    const NV: usize,
    const RF: usize,
    const RB: usize,
    const TB: usize,
>(
    ctx: &MCtx<'_>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    let m = ctx.m;
    let (cols, gpr) = (m.cols, m.groups_per_row());
    if ctx.n < BATCH_MIN_TOKENS {
        let mut sc = vec![0.0f32; RF * gpr];
        let mut r = r0;
        while r + RF <= r1 {
            m_rows_direct::<S, U, NV, RF>(ctx, r, &mut sc, out);
            r += RF;
        }
        while r < r1 {
            m_rows_direct::<S, U, NV, 1>(ctx, r, &mut sc, out);
            r += 1;
        }
    } else {
        let sub = (BUF_FLOATS / cols / RB * RB).max(RB).min(r1 - r0);
        let mut buf = vec![0.0f32; sub * cols];
        let mut sc = vec![0.0f32; sub * gpr];
        let mut a = r0;
        while a < r1 {
            let rows = sub.min(r1 - a);
            for i in 0..rows {
                unpack_row::<S, U, NV>(m, a + i, &mut buf[i * cols..(i + 1) * cols]);
                load_scales(m, a + i, &mut sc[i * gpr..(i + 1) * gpr]);
            }
            let blk = MBlock {
                a,
                rows,
                buf: &buf,
                sc: &sc,
            };
            let mut t = 0;
            while t + TB <= ctx.n {
                m_buf_rows::<S, NV, RB, TB>(ctx, &blk, t, out);
                t += TB;
            }
            while t < ctx.n {
                m_buf_rows::<S, NV, RB, 1>(ctx, &blk, t, out);
                t += 1;
            }
            a += rows;
        }
    }
}

/// `R` rows for every token (few tokens), codes unpacked in registers.
#[inline(always)]
unsafe fn m_rows_direct<S: Isa, U: Unpack<S, NV>, const NV: usize, const R: usize>(
    ctx: &MCtx<'_>,
    r: usize,
    sc: &mut [f32],
    out: OutPtr,
) {
    let m = ctx.m;
    let (cols, gpr, wpr) = (m.cols, m.groups_per_row(), m.words_per_row());
    for k in 0..R {
        load_scales(m, r + k, &mut sc[k * gpr..(k + 1) * gpr]);
    }
    let scales: [*const f32; R] = std::array::from_fn(|k| sc.as_ptr().add(k * gpr));
    let src = Fused::<U, R> {
        p: std::array::from_fn(|k| m.codes.as_ptr().add((r + k) * wpr) as *const u8),
        pf: PREFETCH_BYTES,
        _u: PhantomData,
    };
    for t in 0..ctx.n {
        let xs = [ctx.xs.as_ptr().add(t * cols)];
        let y = qtile::<S, _, NV, R, 1, 1>(&src, scales, xs, gpr, 1);
        m_finish::<S, R, 1>(ctx, y, r, t, out);
    }
}

/// A block of rows unpacked into a buffer.
struct MBlock<'a> {
    /// First row.
    a: usize,
    rows: usize,
    buf: &'a [f32],
    sc: &'a [f32],
}

/// Tokens `t0..t0+T` for every row of the block, `R` rows at a time.
#[inline(always)]
unsafe fn m_buf_rows<S: Isa, const NV: usize, const R: usize, const T: usize>(
    ctx: &MCtx<'_>,
    blk: &MBlock<'_>,
    t0: usize,
    out: OutPtr,
) {
    let mut i = 0;
    while i + R <= blk.rows {
        m_buf_tile::<S, NV, R, T>(ctx, blk, i, t0, out);
        i += R;
    }
    while i < blk.rows {
        m_buf_tile::<S, NV, 1, T>(ctx, blk, i, t0, out);
        i += 1;
    }
}

#[inline(always)]
unsafe fn m_buf_tile<S: Isa, const NV: usize, const R: usize, const T: usize>(
    ctx: &MCtx<'_>,
    blk: &MBlock<'_>,
    i: usize,
    t0: usize,
    out: OutPtr,
) {
    let (cols, gpr) = (ctx.m.cols, ctx.m.groups_per_row());
    let src = Buf::<R> {
        p: std::array::from_fn(|k| blk.buf.as_ptr().add((i + k) * cols)),
    };
    let scales: [*const f32; R] = std::array::from_fn(|k| blk.sc.as_ptr().add((i + k) * gpr));
    let xs: [*const f32; T] = std::array::from_fn(|t| ctx.xs.as_ptr().add((t0 + t) * cols));
    let y = qtile::<S, _, NV, R, T, 1>(&src, scales, xs, gpr, 1);
    m_finish::<S, R, T>(ctx, y, blk.a + i, t0, out);
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
