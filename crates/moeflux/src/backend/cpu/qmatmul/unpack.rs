//! Code unpackers: a block of packed codes to `NV` f32 vectors of exact small
//! integers, in an ISA-specific "stream order" (a permutation of the block's
//! elements chosen so that unpacking needs no lane shuffles). The activation
//! is permuted the same way once per call, so the dot products are unchanged.

use crate::backend::cpu::simd::Isa;

/// Unpacks one block of `NV * S::LANES` codes.
pub(crate) trait Unpack<S: Isa, const NV: usize> {
    /// Whether `unpack` exists (otherwise rows are unpacked in natural order
    /// into a buffer, by `unpack_row_natural` or `unpack_row_generic`).
    const FUSED: bool;
    /// Whether stream order is the natural order.
    const IDENTITY: bool;
    /// Packed bytes per block.
    const BYTES: usize;
    /// # Safety
    /// `p` points at `BYTES` readable bytes; the ISA's features are enabled.
    unsafe fn unpack(p: *const u8) -> [S::V; NV];
    /// Element (within the block) found at stream position `pos`.
    fn perm(pos: usize) -> usize;
    /// With `FUSED` false: unpacks a row of `cols` codes at `p` to f32 in
    /// natural order into `out` and returns true, or returns false to leave
    /// it to the matrix's own `unpack_generic`.
    ///
    /// # Safety
    /// `p` points at the row's packed codes; `out` holds `cols` floats; the
    /// ISA's features are enabled.
    #[inline(always)]
    unsafe fn unpack_row_natural(_p: *const u8, _cols: usize, _out: *mut f32) -> bool {
        false
    }
}

/// Bit widths without a SIMD unpacker (and every width on `Scalar`).
pub(crate) struct Generic;

impl<S: Isa, const NV: usize> Unpack<S, NV> for Generic {
    const FUSED: bool = false;
    const IDENTITY: bool = true;
    const BYTES: usize = 0;
    unsafe fn unpack(_p: *const u8) -> [S::V; NV] {
        unreachable!("generic codes are unpacked row-wise")
    }
    fn perm(pos: usize) -> usize {
        pos
    }
}

/// Rows unpacked whole by `U`, a natural-order unpacker of `UNV`-vector
/// (32-code) blocks, into a buffer that the tiles read in blocks of `NV`
/// vectors: groups narrower than `U`'s block (16, GGUF's K-quants) keep
/// the SIMD unpack.
pub(crate) struct Rowwise<U, const UNV: usize>(std::marker::PhantomData<U>);

impl<S: Isa, U: Unpack<S, UNV>, const UNV: usize, const NV: usize> Unpack<S, NV>
    for Rowwise<U, UNV>
{
    const FUSED: bool = false;
    const IDENTITY: bool = true;
    const BYTES: usize = 0;
    unsafe fn unpack(_p: *const u8) -> [S::V; NV] {
        unreachable!("unpacked row-wise")
    }
    fn perm(pos: usize) -> usize {
        pos
    }
    #[inline(always)]
    unsafe fn unpack_row_natural(p: *const u8, cols: usize, out: *mut f32) -> bool {
        const { assert!(U::FUSED && U::IDENTITY, "a natural-order SIMD unpacker") };
        let bw = UNV * S::LANES;
        for b in 0..cols / bw {
            let v = U::unpack(p.add(b * U::BYTES));
            for (j, &vj) in v.iter().enumerate() {
                S::store(out.add(b * bw + j * S::LANES), vj);
            }
        }
        true
    }
}

/// Unpacks one packed row of `cols` codes to f32 in natural order.
pub(crate) fn unpack_row_generic(packed: &[u32], bits: u32, out: &mut [f32]) {
    match bits {
        2 => unpack_row_bits::<2>(packed, out),
        3 => unpack_row_bits::<3>(packed, out),
        4 => unpack_row_bits::<4>(packed, out),
        5 => unpack_row_bits::<5>(packed, out),
        6 => unpack_row_bits::<6>(packed, out),
        8 => unpack_row_bits::<8>(packed, out),
        _ => panic!("unsupported bit width {bits}"),
    }
}

/// A 32-code block spans exactly `B` words; with `B` known, every shift
/// below is a constant once the loop is unrolled.
fn unpack_row_bits<const B: usize>(packed: &[u32], out: &mut [f32]) {
    let mask = (1u64 << B) - 1;
    for (words, o) in packed.chunks_exact(B).zip(out.chunks_exact_mut(32)) {
        for (j, v) in o.iter_mut().enumerate() {
            let bit = j * B;
            let (w, s) = (bit / 32, bit % 32);
            let lo = words[w] as u64;
            let hi = if w + 1 < B { words[w + 1] as u64 } else { 0 };
            *v = (((lo | (hi << 32)) >> s) & mask) as f32;
        }
    }
}

/// For code `j` of a 32-code block of `bits`-bit codes: the word holding its
/// first bit and the shift of that bit (for the SIMD generic unpackers).
const fn word_shift(bits: usize) -> ([i32; 32], [i32; 32]) {
    let mut w = [0i32; 32];
    let mut s = [0i32; 32];
    let mut j = 0;
    while j < 32 {
        w[j] = (j * bits / 32) as i32;
        s[j] = (j * bits % 32) as i32;
        j += 1;
    }
    (w, s)
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Unpack;
    use crate::backend::cpu::simd::{Avx2, Avx512};
    use std::arch::x86_64::*;

    /// 16 codes of `B` bits: lane `i` takes word `w[i]` (and the next) of
    /// `data`, shifted right by `s[i]`.
    #[inline(always)]
    unsafe fn gen16<const B: usize>(data: __m512i, w: *const i32, s: *const i32) -> __m512 {
        let wi = _mm512_loadu_si512(w as *const __m512i);
        let sh = _mm512_loadu_si512(s as *const __m512i);
        let lo = _mm512_permutexvar_epi32(wi, data);
        let hi = _mm512_permutexvar_epi32(_mm512_add_epi32(wi, _mm512_set1_epi32(1)), data);
        let v = _mm512_or_si512(
            _mm512_srlv_epi32(lo, sh),
            _mm512_sllv_epi32(hi, _mm512_sub_epi32(_mm512_set1_epi32(32), sh)),
        );
        _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32((1 << B) - 1)))
    }

    /// 8 codes of `B` bits (see `gen16`).
    #[inline(always)]
    unsafe fn gen8<const B: usize>(data: __m256i, w: *const i32, s: *const i32) -> __m256 {
        let wi = _mm256_loadu_si256(w as *const __m256i);
        let sh = _mm256_loadu_si256(s as *const __m256i);
        let lo = _mm256_permutevar8x32_epi32(data, wi);
        let hi = _mm256_permutevar8x32_epi32(data, _mm256_add_epi32(wi, _mm256_set1_epi32(1)));
        let v = _mm256_or_si256(
            _mm256_srlv_epi32(lo, sh),
            _mm256_sllv_epi32(hi, _mm256_sub_epi32(_mm256_set1_epi32(32), sh)),
        );
        _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32((1 << B) - 1)))
    }

    /// Any width (used for 3, 5 and 6 bits), 32 codes in natural order: each
    /// lane gathers the word(s) holding its code with a lane permute, then
    /// shifts by a per-lane amount.
    pub(crate) struct A512Gen<const B: usize>;
    impl<const B: usize> A512Gen<B> {
        const TABLES: ([i32; 32], [i32; 32]) = super::word_shift(B);
    }
    impl<const B: usize> Unpack<Avx512, 2> for A512Gen<B> {
        const FUSED: bool = true;
        const IDENTITY: bool = true;
        const BYTES: usize = 4 * B;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m512; 2] {
            // Only the block's B words are read (masked load).
            let data = _mm512_maskz_loadu_epi32(((1u32 << B) - 1) as u16, p as *const i32);
            let (w, s) = &Self::TABLES;
            [
                gen16::<B>(data, w.as_ptr(), s.as_ptr()),
                gen16::<B>(data, w.as_ptr().add(16), s.as_ptr().add(16)),
            ]
        }
        fn perm(pos: usize) -> usize {
            pos
        }
    }

    /// 8-bit, 32 codes (2 x 16 lanes), natural order.
    pub(crate) struct A512U8;
    impl Unpack<Avx512, 2> for A512U8 {
        const FUSED: bool = true;
        const IDENTITY: bool = true;
        const BYTES: usize = 32;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m512; 2] {
            let a = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16) as *const __m128i));
            [_mm512_cvtepi32_ps(a), _mm512_cvtepi32_ps(b)]
        }
        fn perm(pos: usize) -> usize {
            pos
        }
    }

    /// 4-bit, 32 codes from 16 bytes: low nibbles (even elements), then high
    /// nibbles (odd elements).
    pub(crate) struct A512U4;
    impl Unpack<Avx512, 2> for A512U4 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 16;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m512; 2] {
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            let lo = _mm512_and_si512(v, _mm512_set1_epi32(15));
            let hi = _mm512_srli_epi32::<4>(v);
            [_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi)]
        }
        fn perm(pos: usize) -> usize {
            if pos < 16 {
                2 * pos
            } else {
                2 * (pos - 16) + 1
            }
        }
    }

    /// 2-bit, 32 codes from 8 bytes (group size 32): the 8 bytes are
    /// duplicated into both halves and shifted per lane; position `8s + k`
    /// holds element `4k + s`.
    pub(crate) struct A512U2x32;
    impl Unpack<Avx512, 2> for A512U2x32 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 8;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m512; 2] {
            let b = _mm_loadl_epi64(p as *const __m128i);
            let v = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(b, b));
            let m = _mm512_set1_epi32(3);
            let s01 = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
            let s23 = _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4);
            let c0 = _mm512_and_si512(_mm512_srlv_epi32(v, s01), m);
            let c1 = _mm512_and_si512(_mm512_srlv_epi32(v, s23), m);
            [_mm512_cvtepi32_ps(c0), _mm512_cvtepi32_ps(c1)]
        }
        fn perm(pos: usize) -> usize {
            4 * (pos % 8) + pos / 8
        }
    }

    /// 2-bit, 64 codes from 16 bytes (group size >= 64): position `16s + k`
    /// holds element `4k + s`.
    pub(crate) struct A512U2x64;
    impl Unpack<Avx512, 4> for A512U2x64 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 16;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m512; 4] {
            let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
            let m = _mm512_set1_epi32(3);
            let c0 = _mm512_and_si512(v, m);
            let c1 = _mm512_and_si512(_mm512_srli_epi32::<2>(v), m);
            let c2 = _mm512_and_si512(_mm512_srli_epi32::<4>(v), m);
            let c3 = _mm512_srli_epi32::<6>(v);
            [
                _mm512_cvtepi32_ps(c0),
                _mm512_cvtepi32_ps(c1),
                _mm512_cvtepi32_ps(c2),
                _mm512_cvtepi32_ps(c3),
            ]
        }
        fn perm(pos: usize) -> usize {
            4 * (pos % 16) + pos / 16
        }
    }

    #[inline(always)]
    unsafe fn u8x8(p: *const u8) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }

    /// Any width (used for 3, 5 and 6 bits), 32 codes in natural order (see
    /// `A512Gen`).
    pub(crate) struct A2Gen<const B: usize>;
    impl<const B: usize> A2Gen<B> {
        const TABLES: ([i32; 32], [i32; 32]) = super::word_shift(B);
        const LOAD_MASK: [i32; 8] = {
            let mut m = [0i32; 8];
            let mut i = 0;
            while i < B {
                m[i] = -1;
                i += 1;
            }
            m
        };
    }
    impl<const B: usize> Unpack<Avx2, 4> for A2Gen<B> {
        const FUSED: bool = true;
        const IDENTITY: bool = true;
        const BYTES: usize = 4 * B;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m256; 4] {
            // Only the block's B words are read (masked load).
            let lm = _mm256_loadu_si256(Self::LOAD_MASK.as_ptr() as *const __m256i);
            let data = _mm256_maskload_epi32(p as *const i32, lm);
            let (w, s) = &Self::TABLES;
            let (w, s) = (w.as_ptr(), s.as_ptr());
            [
                gen8::<B>(data, w, s),
                gen8::<B>(data, w.add(8), s.add(8)),
                gen8::<B>(data, w.add(16), s.add(16)),
                gen8::<B>(data, w.add(24), s.add(24)),
            ]
        }
        fn perm(pos: usize) -> usize {
            pos
        }
    }

    /// 8-bit, 32 codes (4 x 8 lanes), natural order.
    pub(crate) struct A2U8;
    impl Unpack<Avx2, 4> for A2U8 {
        const FUSED: bool = true;
        const IDENTITY: bool = true;
        const BYTES: usize = 32;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m256; 4] {
            [u8x8(p), u8x8(p.add(8)), u8x8(p.add(16)), u8x8(p.add(24))]
        }
        fn perm(pos: usize) -> usize {
            pos
        }
    }

    /// 4-bit, 32 codes from 16 bytes: per 8-byte half, even then odd elements.
    pub(crate) struct A2U4;
    impl Unpack<Avx2, 4> for A2U4 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 16;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m256; 4] {
            let m = _mm256_set1_epi32(15);
            let a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
            [
                _mm256_cvtepi32_ps(_mm256_and_si256(a, m)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(a)),
                _mm256_cvtepi32_ps(_mm256_and_si256(b, m)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b)),
            ]
        }
        fn perm(pos: usize) -> usize {
            let (h, q) = (pos / 16, pos % 16);
            16 * h + if q < 8 { 2 * q } else { 2 * (q - 8) + 1 }
        }
    }

    /// 2-bit, 32 codes from 8 bytes: position `8s + k` holds element `4k + s`.
    pub(crate) struct A2U2;
    impl Unpack<Avx2, 4> for A2U2 {
        const FUSED: bool = true;
        const IDENTITY: bool = false;
        const BYTES: usize = 8;
        #[inline(always)]
        unsafe fn unpack(p: *const u8) -> [__m256; 4] {
            let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
            let m = _mm256_set1_epi32(3);
            [
                _mm256_cvtepi32_ps(_mm256_and_si256(v, m)),
                _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32::<2>(v), m)),
                _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32::<4>(v), m)),
                _mm256_cvtepi32_ps(_mm256_srli_epi32::<6>(v)),
            ]
        }
        fn perm(pos: usize) -> usize {
            4 * (pos % 8) + pos / 8
        }
    }
}
