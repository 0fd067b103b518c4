//! Products with the activations quantized to 8 bits, as llama.cpp's CPU
//! backend computes them: an opt-in ([`Activations::Q8`]) for 4-bit affine
//! weights (groups of 32 or a multiple of 64), 8-bit affine weights (groups
//! of a multiple of 32) and MXFP4. Every 32
//! consecutive inputs of a token become `dx * xq` (`dx = max|x| / 127`, `xq`
//! rounded to an integer in -127..=127), and the codes are multiplied by
//! `xq` in integers: one byte multiply-add (`vpmaddubsw`) per 32 weights
//! instead of a float conversion and FMA per 8, so the one-token product is
//! bound by memory rather than by the vector units on a 2-core AVX2 machine.
//! The cost is the rounding of the activations (measured on the demo model:
//! docs/PERFORMANCE.md); exact f32 activations stay the default.
//!
//! # Arithmetic (the determinism contract of this path)
//!
//! With `ds[b] = scale(group of b) * dx[b]` (one f32 product; the MXFP4
//! scale halved, codes taken as twice their e2m1 value) and `isum[b]` the
//! exact integer sum of `code * xq` over block `b`'s 32 inputs:
//!
//! ```text
//! acc = 0                                  (f32)
//! for each block b in order:
//!     acc = fma(f32(isum[b]), ds[b], acc)
//! out = acc + dot(bias, xsum)                          (affine only)
//! ```
//!
//! where `dot` is eight fma chains over the groups (group `g` in chain
//! `g % 8`) summed by a fixed tree and `xsum_g` is the f32 sum of the
//! group's unrounded activations. A block's integer sum is exact (at most
//! 32 * 255 * 127 < 2^24, so also exact as an f32) in any order, which
//! leaves the kernels free to form it as their instructions like: the
//! portable kernel, the row-major AVX2 one (four rows' sums gathered by
//! horizontal adds) and the interleaved ones (eight rows a vector, several
//! tokens a pass, AVX2 or AVX-512 VNNI) give the same bits, and as with
//! f32 activations a token's result is independent of the number of tokens
//! and of the thread count.

use std::cell::Cell;

use super::{group_sum, tree8, Job, OutPtr, Packed, SimdLevel};
use crate::quant::mxfp4::{Mxfp4Matrix, E2M1_X2};
use crate::quant::{QMatrix, Weight};

/// How the CPU's quantized products take their activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activations {
    /// Exact f32 (the default; what the goldens' bounds rest on).
    #[default]
    F32,
    /// Rounded to 8 bits per group of 32 inputs for 4/8-bit affine and
    /// MXFP4 weights; other weights keep f32 activations.
    Q8,
}

impl Activations {
    pub fn parse(s: &str) -> Option<Activations> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Some(Activations::F32),
            "q8" => Some(Activations::Q8),
            _ => None,
        }
    }
}

thread_local! {
    static MODE: Cell<Activations> = const { Cell::new(Activations::F32) };
}

/// Sets the activation mode of the products this thread starts (a session
/// sets it on each of its compute threads).
pub fn set_thread_activations(a: Activations) {
    MODE.with(|m| m.set(a));
}

/// The activation mode of this thread.
pub fn thread_activations() -> Activations {
    MODE.with(|m| m.get())
}

/// This thread's mode set for a scope, the previous one restored on drop
/// (also when a product panics).
pub(super) struct ModeScope(Activations);

impl ModeScope {
    pub(super) fn set(a: Activations) -> ModeScope {
        let old = thread_activations();
        set_thread_activations(a);
        ModeScope(old)
    }
}

impl Drop for ModeScope {
    fn drop(&mut self) {
        set_thread_activations(self.0);
    }
}

const BLOCK: usize = 32;

/// Which code layout a weight has on this path.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// 4-bit affine: nibbles, unsigned codes 0..=15.
    Nib4,
    /// MXFP4: nibbles, codes to twice their e2m1 value (-12..=12).
    Mx4,
    /// 8-bit affine: bytes 0..=255.
    U8,
}

impl Kind {
    fn of(w: &Weight) -> Option<Kind> {
        match w {
            // A unit of two blocks shares one scale, or (groups of 32)
            // has one per block.
            Weight::Quantized(q) if q.spec.bits == 4 => {
                let gs = q.spec.group_size;
                (gs == BLOCK || gs % (2 * BLOCK) == 0).then_some(Kind::Nib4)
            }
            Weight::Quantized(q) if q.spec.bits == 8 && q.spec.group_size % BLOCK == 0 => {
                Some(Kind::U8)
            }
            Weight::Mxfp4(_) | Weight::Mxfp4x8(_) => Some(Kind::Mx4),
            Weight::Affine4x8(_) => Some(Kind::Nib4),
            _ => None,
        }
    }
    /// Blocks per unit.
    fn unit_blocks(self) -> usize {
        if self == Kind::U8 {
            1
        } else {
            2
        }
    }
    /// Activation bytes per unit: two 32-byte vectors (low and high
    /// nibbles) for 4-bit codes, one for bytes.
    fn unit_bytes(self) -> usize {
        32 * self.unit_blocks()
    }
    /// The offset the AVX2 kernel adds to codes to make them unsigned
    /// (`vpmaddubsw` multiplies unsigned by signed bytes): 12 for MXFP4's
    /// -12..=12; 8-bit codes go the other way (`code - 128` as a signed
    /// byte, multiplied by sign and magnitude), so their sums gain
    /// `128 * sum(xq)`.
    fn correction(self) -> i32 {
        match self {
            Kind::Nib4 => 0,
            Kind::Mx4 => -12,
            Kind::U8 => 128,
        }
    }
}

/// The activations of one call, quantized.
struct Acts {
    kind: Kind,
    n: usize,
    blocks: usize,
    units: usize,
    /// `n * units * unit_bytes`: per unit, the activations in the kernel's
    /// order (for nibbles: the inputs of the low nibbles of the unit's 32
    /// code bytes, then of the high nibbles), zero past the last block.
    xq: Vec<i8>,
    /// Blocks per group of scales.
    bpg: usize,
    /// `n * units * 8`: each lane's block's `dx` (0 for the empty lanes of a
    /// last odd block).
    dxv: Vec<f32>,
    /// `n * units * 8`: the kernel's correction of each lane's block
    /// (`Kind::correction` times the block's sum of `xq`, so 0 for affine
    /// 4-bit codes), laid out as `dxv`.
    corr: Vec<i32>,
    /// `n * groups`: sums of the unrounded activations (affine only).
    xsum: Vec<f32>,
}

impl Acts {
    fn new(kind: Kind, x: &[f32], n: usize, cols: usize, group: usize) -> Acts {
        let blocks = cols / BLOCK;
        let units = blocks.div_ceil(kind.unit_blocks());
        let ub = kind.unit_bytes();
        let mut xq = vec![0i8; n * units * ub];
        let mut dxv = vec![0.0f32; n * units * 8];
        let lanes_per_block = 8 / kind.unit_blocks();
        let mut corr = vec![0i32; n * units * 8];
        let mut q = [0i8; BLOCK];
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            for b in 0..blocks {
                let dx = quantize_block_fast(&xt[b * BLOCK..(b + 1) * BLOCK], &mut q);
                let u = b / kind.unit_blocks();
                let first = (t * units + u) * 8 + (b % kind.unit_blocks()) * lanes_per_block;
                let lanes = first..first + lanes_per_block;
                dxv[lanes.clone()].fill(dx);
                if kind.correction() != 0 {
                    corr[lanes].fill(kind.correction() * q.iter().map(|&v| v as i32).sum::<i32>());
                }
                let unit = &mut xq[(t * units + u) * ub..(t * units + u + 1) * ub];
                if kind == Kind::U8 {
                    unit.copy_from_slice(&q);
                } else {
                    // Code byte j of the unit holds inputs 2j (low nibble)
                    // and 2j + 1 (high) of block 2u + j / 16.
                    let half = 16 * (b % 2);
                    for j in 0..16 {
                        unit[half + j] = q[2 * j];
                        unit[32 + half + j] = q[2 * j + 1];
                    }
                }
            }
        }
        let xsum = if kind == Kind::Mx4 {
            Vec::new()
        } else {
            x.chunks_exact(group).map(group_sum).collect()
        };
        Acts {
            kind,
            n,
            blocks,
            units,
            bpg: group / BLOCK,
            xq,
            dxv,
            corr,
            xsum,
        }
    }

    fn unit(&self, t: usize, u: usize) -> *const i8 {
        let ub = self.kind.unit_bytes();
        self.xq[(t * self.units + u) * ub..].as_ptr()
    }
}

/// `xq = round(x / dx)` with `dx = max|x| / 127`; returns `dx` (0 for a
/// zero block, NaN when the block holds a NaN or an infinity, so the output
/// is NaN as with f32 activations).
fn quantize_block(x: &[f32], q: &mut [i8; BLOCK]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if !x.iter().all(|v| v.is_finite()) {
        q.fill(0);
        return f32::NAN;
    }
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = 127.0 / amax;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    amax / 127.0
}

/// [`quantize_block`]'s result, by AVX2 where the CPU has it (`round`
/// is a libm call per input, a tenth of a batched product's time).
fn quantize_block_fast(x: &[f32], q: &mut [i8; BLOCK]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        return unsafe { quantize_block_avx2(x, q) };
    }
    quantize_block(x, q)
}

/// [`quantize_block`] with eight inputs per vector: the same maximum (exact
/// in any order), the same product by `127 / amax`, and round half away
/// from zero as `trunc(y + copysign(0.49999997, y))` (exact for every f32:
/// the constant is the float below one half), so the same bytes.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_block_avx2(x: &[f32], q: &mut [i8; BLOCK]) -> f32 {
    use std::arch::x86_64::*;
    assert_eq!(x.len(), BLOCK);
    let sign = _mm256_set1_ps(-0.0);
    let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add(8 * i)));
    let a: [__m256; 4] = std::array::from_fn(|i| _mm256_andnot_ps(sign, v[i]));
    // Finite: |v| < inf (false for NaN too).
    let inf = _mm256_set1_ps(f32::INFINITY);
    let finite = a.iter().fold(0xff, |m, &ai| {
        m & _mm256_movemask_ps(_mm256_cmp_ps(ai, inf, _CMP_LT_OQ))
    });
    if finite != 0xff {
        q.fill(0);
        return f32::NAN;
    }
    let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = _mm256_set1_ps(127.0 / amax);
    let half = _mm256_set1_ps(0.49999997);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let r: [__m256i; 4] = std::array::from_fn(|i| {
        let y = _mm256_mul_ps(v[i], inv);
        let y = _mm256_add_ps(y, _mm256_or_ps(half, _mm256_and_ps(sign, y)));
        let y = _mm256_round_ps(y, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(y, lo), hi))
    });
    // i32 -> i8 in order: the packs work per 128-bit lane, the permute
    // puts the dwords back in order.
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(r[0], r[1]),
        _mm256_packs_epi32(r[2], r[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
    amax / 127.0
}

/// Prepares `out = W x` with quantized activations; `None` when `w` has no
/// such product (the caller then uses f32 activations). Shapes are checked
/// by the caller.
pub(super) fn job<'a>(
    level: SimdLevel,
    w: &'a Weight<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Option<Job<'a>> {
    let kind = Kind::of(w)?;
    #[cfg(target_arch = "x86_64")]
    let simd = level >= SimdLevel::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    let simd = {
        let _ = level;
        false
    };
    Some(match w {
        Weight::Quantized(q) => make_job::<QMatrix>(kind, simd, q, x, n, out),
        Weight::Mxfp4(m) => make_job::<Mxfp4Matrix>(kind, simd, m, x, n, out),
        Weight::Mxfp4x8(m) => interleaved::job_mxfp4(level, m, x, n, out),
        Weight::Affine4x8(m) => interleaved::job_affine(level, m, x, n, out),
        Weight::Dense(_) => unreachable!("Kind::of excludes dense weights"),
    })
}

fn make_job<'a, P: Packed>(
    kind: Kind,
    simd: bool,
    p: &'a P,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    let acts = Acts::new(kind, x, n, p.cols(), p.group_size());
    Job {
        rows: p.rows(),
        work_per_row: p.cols() * n,
        // SAFETY: `simd` is set only where the CPU has AVX2 and FMA.
        run: Box::new(move |r0, r1| unsafe {
            #[cfg(target_arch = "x86_64")]
            if simd {
                return chunk_avx2(p, &acts, r0, r1, out);
            }
            let _ = simd;
            chunk_body::<P, false>(p, &acts, r0, r1, out)
        }),
    }
}

/// [`chunk_body`] compiled for AVX2 and FMA (its `mul_add`s become fused
/// instructions rather than calls).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn chunk_avx2<P: Packed>(p: &P, a: &Acts, r0: usize, r1: usize, out: OutPtr) {
    chunk_body::<P, true>(p, a, r0, r1, out)
}

/// Rows `r0..r1` for every token, four rows at a time (their activation
/// loads shared), by the AVX2 kernel or the portable one.
///
/// # Safety
/// With `SIMD`, the CPU has AVX2 and FMA.
#[inline(always)]
unsafe fn chunk_body<P: Packed, const SIMD: bool>(
    p: &P,
    a: &Acts,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    const R: usize = 4;
    let (rows, gpr) = (p.rows(), p.groups_per_row());
    let mut sc = vec![0.0f32; R * gpr];
    let mut bi = vec![0.0f32; R * gpr];
    // The AVX2 kernel's scales: group-major, the four rows of a group
    // together, and two spare groups of zeros (read by a last odd block
    // with groups of 32).
    let mut sct = vec![0.0f32; if SIMD { R * (gpr + 2) } else { 0 }];
    let mut r = r0;
    while r < r1 {
        let m = R.min(r1 - r);
        for k in 0..m {
            p.load_params(r + k, &mut sc[k * gpr..], &mut bi[k * gpr..]);
        }
        // Rows past `m` repeat the last one (computed, not stored).
        let codes: [*const u8; R] = std::array::from_fn(|k| p.row_codes(r + k.min(m - 1)));
        if SIMD {
            for (g, four) in sct.chunks_exact_mut(R).take(gpr).enumerate() {
                for (k, v) in four.iter_mut().enumerate() {
                    *v = sc[k.min(m - 1) * gpr + g];
                }
            }
        }
        for t in 0..a.n {
            // The codes of rows r..r + m hold `blocks` blocks each, the
            // activation buffers `units` units per token (checked shapes).
            #[cfg(target_arch = "x86_64")]
            let acc = if SIMD {
                avx2::rows(a, t, codes, sct.as_ptr())
            } else {
                portable_rows(a, t, codes, &sc, gpr, m)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let acc = portable_rows(a, t, codes, &sc, gpr, m);
            for k in 0..m {
                let mut v = acc[k];
                if a.kind != Kind::Mx4 {
                    v += bias_dot(&bi[k * gpr..(k + 1) * gpr], &a.xsum[t * gpr..(t + 1) * gpr]);
                }
                // `job` checked that `out` holds n * rows floats.
                *out.0.add(t * rows + r + k) = v;
            }
        }
        r += m;
    }
}

/// `dot(biases, xsum)`: eight interleaved fma chains (independent, so they
/// pipeline and vectorise), then a fixed tree.
#[inline(always)]
fn bias_dot(b: &[f32], xsum: &[f32]) -> f32 {
    let mut p = [0.0f32; 8];
    let (bc, xc) = (b.chunks_exact(8), xsum.chunks_exact(8));
    let (br, xr) = (bc.remainder(), xc.remainder());
    for (bv, xv) in bc.zip(xc) {
        for i in 0..8 {
            p[i] = bv[i].mul_add(xv[i], p[i]);
        }
    }
    for (i, (&bv, &xv)) in br.iter().zip(xr).enumerate() {
        p[i] = bv.mul_add(xv, p[i]);
    }
    tree8(&p)
}

/// The code of each byte of a unit as the contract's integer: `lo`/`hi`
/// nibble or the byte.
#[inline(always)]
fn code_value(kind: Kind, byte: u8, high: bool) -> i32 {
    let nib = if high { byte >> 4 } else { byte & 15 };
    match kind {
        Kind::Nib4 => nib as i32,
        Kind::Mx4 => E2M1_X2[nib as usize] as i32,
        Kind::U8 => byte as i32,
    }
}

/// The contract in plain code (machines without AVX2, and the reference the
/// AVX2 kernels are tested against bit for bit): each row's `acc` for token
/// `t`, rows `codes[..m]` with their group scales `sc` (`gpr` a row).
///
/// # Safety
/// Each `codes[k]` points at a row of `a.blocks` blocks of codes.
unsafe fn portable_rows<const R: usize>(
    a: &Acts,
    t: usize,
    codes: [*const u8; R],
    sc: &[f32],
    gpr: usize,
    m: usize,
) -> [f32; R] {
    let kind = a.kind;
    let ubl = kind.unit_blocks();
    let mut acc = [0.0f32; R];
    for b in 0..a.blocks {
        let (u, half) = (b / ubl, b % ubl);
        let xq = std::slice::from_raw_parts(a.unit(t, u), kind.unit_bytes());
        let lane = (t * a.units + u) * 8 + 4 * half;
        let dx = a.dxv[lane];
        for (k, acc) in acc.iter_mut().enumerate().take(m) {
            let mut s = 0i32;
            if kind == Kind::U8 {
                let c = std::slice::from_raw_parts(codes[k].add(u * 32), 32);
                for (&code, &x) in c.iter().zip(xq) {
                    s += code_value(kind, code, false) * x as i32;
                }
            } else {
                // The block's 16 code bytes: byte i of the unit holds the
                // inputs at activation bytes i (low nibble) and 32 + i (high).
                let c = std::slice::from_raw_parts(codes[k].add(u * 32 + 16 * half), 16);
                for (j, &code) in c.iter().enumerate() {
                    let i = 16 * half + j;
                    s += code_value(kind, code, false) * xq[i] as i32;
                    s += code_value(kind, code, true) * xq[32 + i] as i32;
                }
            }
            let d = sc[k * gpr + b / a.bpg] * dx;
            *acc = (s as f32).mul_add(d, *acc);
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Acts, Kind};

    /// Software prefetch distance for the codes: this kernel consumes them
    /// about twice as fast as the f32 one, so it looks twice as far ahead
    /// (8 KiB: 1.1-1.3x over 4 KiB on DRAM-bound matrices on the 2-core
    /// EPYC, `qmatmul_rate mxfp4:q8`).
    const PREFETCH_BYTES: usize = 8192;
    use crate::quant::mxfp4::E2M1_X2;
    use std::arch::x86_64::*;

    /// `E2M1_X2 + 12` by code: MXFP4 codes as unsigned bytes.
    pub(super) static MX_OFFSET: [u8; 16] = {
        let mut t = [0u8; 16];
        let mut c = 0;
        while c < 16 {
            t[c] = (E2M1_X2[c] + 12) as u8;
            c += 1;
        }
        t
    };

    /// The contract's `acc` of token `t` for the four rows `codes`, whose
    /// scales `sct` holds group-major (four rows a group, two spare groups
    /// of zeros).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; each `codes[k]` points at a row of
    /// `a.blocks` blocks of codes.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows(
        a: &Acts,
        t: usize,
        codes: [*const u8; 4],
        sct: *const f32,
    ) -> [f32; 4] {
        let y = match (a.kind, a.bpg == 1) {
            (Kind::U8, _) => bytes(a, t, codes, sct),
            (Kind::Mx4, true) => nibbles::<true, true>(a, t, codes, sct),
            (Kind::Mx4, false) => nibbles::<true, false>(a, t, codes, sct),
            (Kind::Nib4, true) => nibbles::<false, true>(a, t, codes, sct),
            (Kind::Nib4, false) => nibbles::<false, false>(a, t, codes, sct),
        };
        let mut acc = [0.0f32; 4];
        _mm_storeu_ps(acc.as_mut_ptr(), y);
        acc
    }

    /// Four rows' exact sums of eight lanes each, lane by lane in halves:
    /// `[s0[0..4], s1[0..4], s2[0..4], s3[0..4] | s0[4..8], .., s3[4..8]]`.
    #[inline(always)]
    unsafe fn row_sums(s: [__m256i; 4]) -> __m256i {
        _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]))
    }

    /// 4-bit codes, two blocks per 32 code bytes; `PAIR`: a scale per block
    /// (groups of 32), else one per unit (groups of 64 or more).
    #[inline(always)]
    unsafe fn nibbles<const MX: bool, const PAIR: bool>(
        a: &Acts,
        t: usize,
        codes: [*const u8; 4],
        sct: *const f32,
    ) -> __m128 {
        let mut y = _mm_setzero_ps();
        let whole = a.blocks / 2;
        // Units per group and the group of unit u, counted down (no division).
        let upg = (a.bpg / 2).max(1);
        let (mut g, mut left) = (0, upg);
        for u in 0..whole {
            // (Loops, not closures, in hot code: a closure is compiled
            // without the caller's target features.)
            let mut c = [_mm256_setzero_si256(); 4];
            for (k, ck) in c.iter_mut().enumerate() {
                let p = codes[k].add(u * 32);
                _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                *ck = _mm256_loadu_si256(p as *const __m256i);
            }
            y = nibble_unit::<MX, PAIR, false>(a, t, u, g, c, sct, y);
            left -= 1;
            if left == 0 {
                g += 1;
                left = upg;
            }
        }
        if a.blocks % 2 == 1 {
            let mut c = [_mm256_setzero_si256(); 4];
            for (k, ck) in c.iter_mut().enumerate() {
                let p = codes[k].add(whole * 32) as *const __m128i;
                *ck = _mm256_zextsi128_si256(_mm_loadu_si128(p));
            }
            y = nibble_unit::<MX, PAIR, true>(a, t, whole, g, c, sct, y);
        }
        y
    }

    /// One unit (two blocks; only the first when `HALF`) of the four rows
    /// whose code bytes are `c`; `g` is the unit's group when not `PAIR`.
    #[inline(always)]
    unsafe fn nibble_unit<const MX: bool, const PAIR: bool, const HALF: bool>(
        a: &Acts,
        t: usize,
        u: usize,
        g: usize,
        c: [__m256i; 4],
        sct: *const f32,
        y: __m128,
    ) -> __m128 {
        let low = _mm256_set1_epi8(15);
        let ones = _mm256_set1_epi16(1);
        let lanes = (t * a.units + u) * 8;
        let xl = _mm256_loadu_si256(a.unit(t, u) as *const __m256i);
        let xh = _mm256_loadu_si256(a.unit(t, u).add(32) as *const __m256i);
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(MX_OFFSET.as_ptr() as *const _));
        let mut s = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let mut lo = _mm256_and_si256(c[k], low);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(c[k], 4), low);
            if MX {
                lo = _mm256_shuffle_epi8(table, lo);
                hi = _mm256_shuffle_epi8(table, hi);
            }
            let s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            s[k] = _mm256_madd_epi16(s16, ones);
        }
        // [rows' block 2u | rows' block 2u + 1]
        let mut h = row_sums(s);
        if MX {
            let cv = _mm256_loadu_si256(a.corr.as_ptr().add(lanes) as *const __m256i);
            h = _mm256_add_epi32(h, cv);
        }
        let sv = if PAIR {
            _mm256_loadu_ps(sct.add(8 * u))
        } else {
            _mm256_broadcast_ps(&*(sct.add(4 * g) as *const __m128))
        };
        let d = _mm256_mul_ps(sv, _mm256_loadu_ps(a.dxv.as_ptr().add(lanes)));
        let v = _mm256_cvtepi32_ps(h);
        let y = _mm_fmadd_ps(_mm256_castps256_ps128(v), _mm256_castps256_ps128(d), y);
        if HALF {
            y
        } else {
            _mm_fmadd_ps(_mm256_extractf128_ps(v, 1), _mm256_extractf128_ps(d, 1), y)
        }
    }

    /// 8-bit codes, one block per 32 code bytes.
    #[inline(always)]
    unsafe fn bytes(a: &Acts, t: usize, codes: [*const u8; 4], sct: *const f32) -> __m128 {
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let mut y = _mm_setzero_ps();
        let (mut g, mut left) = (0, a.bpg);
        for u in 0..a.units {
            let lanes = (t * a.units + u) * 8;
            let x = _mm256_loadu_si256(a.unit(t, u) as *const __m256i);
            let mut s = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                let p = codes[k].add(u * 32);
                _mm_prefetch(p.wrapping_add(PREFETCH_BYTES) as *const i8, _MM_HINT_T0);
                // code - 128 as a signed byte: |w| <= 128 keeps the pair
                // sums of vpmaddubsw (at most 2 * 128 * 127) from saturating.
                let w = _mm256_xor_si256(_mm256_loadu_si256(p as *const __m256i), flip);
                let s16 = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
                s[k] = _mm256_madd_epi16(s16, ones);
            }
            let h = row_sums(s);
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let h = _mm_add_epi32(h, _mm_set1_epi32(*a.corr.as_ptr().add(lanes)));
            let d = _mm_mul_ps(
                _mm_loadu_ps(sct.add(4 * g)),
                _mm_set1_ps(*a.dxv.as_ptr().add(lanes)),
            );
            y = _mm_fmadd_ps(_mm_cvtepi32_ps(h), d, y);
            left -= 1;
            if left == 0 {
                g += 1;
                left = a.bpg;
            }
        }
        y
    }
}

mod interleaved;

#[cfg(test)]
mod tests;
