//! Runtime SIMD level selection and the small vector abstraction the CPU
//! kernels are written against.
//!
//! The level is detected once (`is_x86_feature_detected!`) and may be lowered
//! with `MOEFLUX_SIMD=scalar|avx2|avx512` (clamped to what the CPU supports).
//! Results are bitwise reproducible for a given level; different levels round
//! differently (lane counts and FMA use differ).

use std::fmt;
use std::sync::OnceLock;

/// Instruction set used by the CPU kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Portable code (8 f32 lanes as arrays; the compiler may vectorize it).
    Scalar,
    /// AVX2 + FMA, 8 f32 lanes.
    Avx2,
    /// AVX-512F (+ AVX2/FMA), 16 f32 lanes.
    Avx512,
}

impl fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        })
    }
}

impl SimdLevel {
    /// Parses `scalar`, `avx2` or `avx512` (case-insensitive).
    pub fn parse(s: &str) -> Option<SimdLevel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "none" => Some(SimdLevel::Scalar),
            "avx2" => Some(SimdLevel::Avx2),
            "avx512" | "avx-512" | "avx512f" => Some(SimdLevel::Avx512),
            _ => None,
        }
    }

    /// This level, lowered to the best one the CPU supports.
    pub fn clamped(self) -> SimdLevel {
        self.min(detected_level())
    }
}

/// The best level this CPU supports (detected once).
pub fn detected_level() -> SimdLevel {
    static DETECTED: OnceLock<SimdLevel> = OnceLock::new();
    *DETECTED.get_or_init(detect)
}

fn detect() -> SimdLevel {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        if avx2 && is_x86_feature_detected!("avx512f") {
            return SimdLevel::Avx512;
        }
        if avx2 {
            return SimdLevel::Avx2;
        }
    }
    SimdLevel::Scalar
}

/// The level the kernels use: the detected one, lowered by `MOEFLUX_SIMD`
/// when set (read once).
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let detected = detected_level();
        match std::env::var("MOEFLUX_SIMD") {
            Ok(v) if !v.trim().is_empty() => match SimdLevel::parse(&v) {
                Some(l) => l.min(detected),
                None => {
                    eprintln!("moeflux: ignoring MOEFLUX_SIMD={v:?} (expected scalar|avx2|avx512)");
                    detected
                }
            },
            _ => detected,
        }
    })
}

/// Every level this CPU can run, lowest first.
pub fn supported_levels() -> Vec<SimdLevel> {
    [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512]
        .into_iter()
        .filter(|&l| l <= detected_level())
        .collect()
}

/// A vector ISA. Every method is `#[inline(always)]` and must only be called
/// from code compiled with the ISA's target features (the kernels' entry
/// points carry `#[target_feature]`).
///
/// `fma(a, b, c)` is `a*b + c`, fused or not depending on the ISA, but always
/// the same for a given ISA, which is what bitwise reproducibility needs.
pub(crate) trait Isa: Copy {
    type V: Copy;
    const LANES: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(x: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn load_bf16(p: *const u16) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    /// Horizontal sum in a fixed order.
    unsafe fn hsum(v: Self::V) -> f32;
    /// Hint that `p` will be read soon (may be a no-op; never faults).
    #[inline(always)]
    unsafe fn prefetch(_p: *const u8) {}

    /// `sum a[i]*b[i]` for `i < n`: lane accumulators over whole vectors,
    /// `hsum`, then the tail in order.
    #[inline(always)]
    unsafe fn dot(a: *const f32, b: *const f32, n: usize) -> f32 {
        let full = n / Self::LANES * Self::LANES;
        let mut acc = Self::zero();
        let mut i = 0;
        while i < full {
            acc = Self::fma(Self::load(a.add(i)), Self::load(b.add(i)), acc);
            i += Self::LANES;
        }
        let mut s = Self::hsum(acc);
        while i < n {
            s += *a.add(i) * *b.add(i);
            i += 1;
        }
        s
    }
}

/// Portable fallback: 8 lanes as an array, unfused multiply-add.
#[derive(Clone, Copy)]
pub(crate) struct Scalar;

impl Isa for Scalar {
    type V = [f32; 8];
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> [f32; 8] {
        [0.0; 8]
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> [f32; 8] {
        [x; 8]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; 8] {
        (p as *const [f32; 8]).read_unaligned()
    }
    #[inline(always)]
    unsafe fn load_bf16(p: *const u16) -> [f32; 8] {
        let b = (p as *const [u16; 8]).read_unaligned();
        b.map(|h| f32::from_bits((h as u32) << 16))
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; 8]) {
        (p as *mut [f32; 8]).write_unaligned(v)
    }
    #[inline(always)]
    unsafe fn fma(a: [f32; 8], b: [f32; 8], c: [f32; 8]) -> [f32; 8] {
        let mut r = [0.0; 8];
        for i in 0..8 {
            r[i] = a[i] * b[i] + c[i];
        }
        r
    }
    #[inline(always)]
    unsafe fn hsum(v: [f32; 8]) -> f32 {
        let a = [v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]];
        let b = [a[0] + a[2], a[1] + a[3]];
        b[0] + b[1]
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Isa;
    use std::arch::x86_64::*;

    /// AVX2 + FMA, 8 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx2;

    /// Fixed-order horizontal sum of 8 lanes: (lo128 + hi128), then pairs.
    #[inline(always)]
    unsafe fn hsum256(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<0b01>(s, s));
        _mm_cvtss_f32(s)
    }

    impl Isa for Avx2 {
        type V = __m256;
        const LANES: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m256 {
            _mm256_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m256 {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn hsum(v: __m256) -> f32 {
            hsum256(v)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }

    /// AVX-512F, 16 lanes.
    #[derive(Clone, Copy)]
    pub(crate) struct Avx512;

    impl Isa for Avx512 {
        type V = __m512;
        const LANES: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> __m512 {
            _mm512_set1_ps(x)
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn load_bf16(p: *const u16) -> __m512 {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn hsum(v: __m512) -> f32 {
            let lo = _mm512_castps512_ps256(v);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            hsum256(_mm256_add_ps(lo, hi))
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const u8) {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_clamp() {
        assert_eq!(SimdLevel::parse("AVX2"), Some(SimdLevel::Avx2));
        assert_eq!(SimdLevel::parse("avx512"), Some(SimdLevel::Avx512));
        assert_eq!(SimdLevel::parse("scalar"), Some(SimdLevel::Scalar));
        assert_eq!(SimdLevel::parse("sse"), None);
        assert!(SimdLevel::Avx512.clamped() <= detected_level());
        assert_eq!(SimdLevel::Scalar.clamped(), SimdLevel::Scalar);
        assert!(simd_level() <= detected_level());
        assert_eq!(supported_levels().last().copied(), Some(detected_level()));
        assert_eq!(SimdLevel::Avx512.to_string(), "avx512");
    }
}
