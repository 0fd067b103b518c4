use super::super::tests::{bitwise_eq, per_token, run, Rng};
use super::super::{dequantize_row, matmul_group, simd_level, unpack_row};
use super::*;
use crate::backend::cpu::simd::supported_levels;
use crate::quant::mxfp4::{self, E2M1};
use crate::quant::Weight;

/// Owned storage of an MXFP4 matrix.
struct OwnedM {
    rows: usize,
    cols: usize,
    codes: Vec<u32>,
    scales: Vec<u8>,
}

impl OwnedM {
    /// Uniform codes (negative zero included), scales in `lo..=hi`.
    fn random(rng: &mut Rng, rows: usize, cols: usize, lo: u8, hi: u8) -> Self {
        let elems: Vec<u8> = (0..rows * cols)
            .map(|_| (rng.next_u64() % 16) as u8)
            .collect();
        let mut codes = vec![0u32; rows * cols / 8];
        mxfp4::pack_codes(&elems, &mut codes);
        let span = (hi - lo) as u64 + 1;
        let scales = (0..rows * cols / 32)
            .map(|_| lo + (rng.next_u64() % span) as u8)
            .collect();
        OwnedM {
            rows,
            cols,
            codes,
            scales,
        }
    }

    fn weight(&self) -> Weight<'_> {
        Weight::Mxfp4(Mxfp4Matrix::new(self.rows, self.cols, &self.codes, &self.scales).unwrap())
    }
}

/// Rounding steps on the longest path to an output, over every level: per
/// lane up to 4 products of a group, the scale step per group, the
/// horizontal sum; doubled for the scalar level's unfused multiply-adds.
fn depth(cols: usize) -> f64 {
    (2 * (4 + cols / 32) + 4 + 1) as f64
}

/// f64 reference: (value, magnitude = sum of |w * x|) per output, with `w`
/// the exact weight `e2m1 * 2^(s - 127)` (no overflow in f64).
fn reference(m: &OwnedM, x: &[f32], n: usize) -> Vec<(f64, f64)> {
    let (rows, cols) = (m.rows, m.cols);
    let mut out = vec![(0.0, 0.0); n * rows];
    for r in 0..rows {
        let w: Vec<f64> = (0..cols)
            .map(|j| {
                let s = m.scales[r * cols / 32 + j / 32];
                let c = mxfp4::code(&m.codes[r * cols / 8..], j);
                let scale = if s == 255 {
                    f64::NAN
                } else {
                    2f64.powi(s as i32 - 127)
                };
                E2M1[c] as f64 * scale
            })
            .collect();
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            let (mut s, mut mag) = (0.0, 0.0);
            for (&a, &b) in w.iter().zip(xt) {
                s += a * b as f64;
                mag += (a * b as f64).abs();
            }
            out[t * rows + r] = (s, mag);
        }
    }
    out
}

/// `|got - want| <= k * depth * u * magnitude + k * depth * 2^-149` (the
/// second term for results in f32's subnormal range).
fn check_close(got: &[f32], want: &[(f64, f64)], cols: usize, k: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    let u = f32::EPSILON as f64 / 2.0;
    let tiny = f64::from(f32::from_bits(1));
    let d = depth(cols) * k * 1.01;
    for (i, (&g, &(v, m))) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - v).abs();
        assert!(
            err <= d * u * m + d * tiny,
            "{what}: element {i}: got {g}, want {v} (magnitude {m}, err {err})"
        );
    }
}

#[test]
fn mxfp4_matches_f64_reference() {
    let mut rng = Rng(11);
    for (rows, cols) in [(1, 32), (3, 96), (17, 256), (6, 2880)] {
        // Typical scales, and the smallest ones (subnormal results).
        for (lo, hi) in [(118, 130), (0, 3)] {
            let m = OwnedM::random(&mut rng, rows, cols, lo, hi);
            let w = m.weight();
            for n in [1, 2, 5] {
                let x = rng.vec(n * cols);
                let want = reference(&m, &x, n);
                for level in supported_levels() {
                    let got = run(level, &w, &x, n);
                    let what = format!("{level} {rows}x{cols} scales {lo}..{hi} n {n}");
                    check_close(&got, &want, cols, 1.0, &what);
                }
            }
        }
    }
}

#[test]
fn mxfp4_levels_agree_within_bounds() {
    let mut rng = Rng(12);
    let m = OwnedM::random(&mut rng, 29, 512, 120, 130);
    let w = m.weight();
    for n in [1, 4] {
        let x = rng.vec(n * 512);
        let levels = supported_levels();
        let base = run(levels[0], &w, &x, n);
        let base: Vec<(f64, f64)> = base
            .iter()
            .zip(reference(&m, &x, n))
            .map(|(&b, (_, mag))| (b as f64, mag))
            .collect();
        for &level in &levels[1..] {
            let got = run(level, &w, &x, n);
            // Both within the bound of the exact value: within twice it of
            // each other.
            check_close(&got, &base, 512, 2.0, &format!("{level} vs scalar n {n}"));
        }
    }
}

#[test]
fn mxfp4_extreme_scales_stay_exact_in_products() {
    // Scale 254 with code ±6 dequantizes to ±inf, but the product of a small
    // activation fits f32 and comes out finite and accurate; scale 0 gives
    // subnormal weights.
    let (rows, cols) = (2, 64);
    let mut elems = vec![7u8; rows * cols]; // +6
    for e in elems.iter_mut().skip(1).step_by(3) {
        *e = 15; // -6
    }
    elems[5] = 8; // -0
    let mut codes = vec![0u32; rows * cols / 8];
    mxfp4::pack_codes(&elems, &mut codes);
    let scales = vec![254u8, 0, 0, 254];
    let m = OwnedM {
        rows,
        cols,
        codes,
        scales,
    };
    let w = m.weight();
    let mut row = vec![0.0f32; cols];
    dequantize_row(&w, 0, &mut row);
    assert!(row[0] == f32::INFINITY && row[1] == f32::NEG_INFINITY);
    assert!(row[5] == 0.0 && row[5].is_sign_negative());
    assert_eq!(row[32], 6.0 * 2f32.powi(-127));
    let mut rng = Rng(13);
    let x: Vec<f32> = rng.vec(2 * cols).iter().map(|v| v * 1e-3).collect();
    let want = reference(&m, &x, 2);
    for level in supported_levels() {
        let got = run(level, &w, &x, 2);
        assert!(got.iter().all(|v| v.is_finite()), "{level}: {got:?}");
        check_close(&got, &want, cols, 1.0, &format!("{level} extreme scales"));
    }
}

#[test]
fn mxfp4_nan_scale_poisons_its_row() {
    let mut rng = Rng(14);
    let mut m = OwnedM::random(&mut rng, 9, 128, 120, 130);
    let clean = m.scales.clone();
    m.scales[2 * 4 + 1] = 255; // row 2, group 1
    let w = m.weight();
    let mut row = vec![0.0f32; 128];
    dequantize_row(&w, 2, &mut row);
    assert!(row[32..64].iter().all(|v| v.is_nan()), "group 1 is NaN");
    assert!(row[..32].iter().chain(&row[64..]).all(|v| v.is_finite()));
    let clean_w = Weight::Mxfp4(Mxfp4Matrix::new(9, 128, &m.codes, &clean).unwrap());
    for n in [1, 5] {
        let x = rng.vec(n * 128);
        for level in supported_levels() {
            let got = run(level, &w, &x, n);
            let want = run(level, &clean_w, &x, n);
            for t in 0..n {
                for r in 0..9 {
                    let (g, c) = (got[t * 9 + r], want[t * 9 + r]);
                    if r == 2 {
                        assert!(g.is_nan(), "{level} token {t}: row 2 gave {g}");
                    } else {
                        assert_eq!(g.to_bits(), c.to_bits(), "{level} token {t} row {r}");
                    }
                }
            }
        }
    }
}

/// Token `t`'s outputs for each token, computed one token at a time.
#[test]
fn mxfp4_batch_equals_per_token_bitwise() {
    let mut rng = Rng(15);
    // 4096 and 2880 columns make the batched path split the rows into blocks.
    for (rows, cols) in [(37, 256), (21, 4096), (19, 2880)] {
        let m = OwnedM::random(&mut rng, rows, cols, 110, 140);
        let w = m.weight();
        let x = rng.vec(33 * cols);
        for level in supported_levels() {
            let one = per_token(level, &w, &x, 33);
            for n in [2, 3, 7, 33] {
                let got = run(level, &w, &x[..n * cols], n);
                assert!(
                    bitwise_eq(&got, &one[..n * rows]),
                    "{level} {rows}x{cols}: n_tokens {n} differs from one token at a time"
                );
            }
        }
    }
}

#[test]
fn mxfp4_independent_of_thread_count() {
    let mut rng = Rng(16);
    let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect();
    let m = OwnedM::random(&mut rng, 301, 512, 115, 135);
    let w = m.weight();
    for n in [1, 2, 9] {
        let x = rng.vec(n * 512);
        for level in supported_levels() {
            let results: Vec<Vec<f32>> = pools
                .iter()
                .map(|p| p.install(|| run(level, &w, &x, n)))
                .collect();
            for r in &results[1..] {
                assert!(
                    bitwise_eq(&results[0], r),
                    "{level} n {n}: thread count matters"
                );
            }
        }
    }
}

#[test]
fn mxfp4_grouped_and_row_blocks_equal_separate() {
    let mut rng = Rng(17);
    let cols = 256;
    let ms: Vec<OwnedM> = [300, 17, 1]
        .iter()
        .map(|&rows| OwnedM::random(&mut rng, rows, cols, 120, 130))
        .collect();
    let ws: Vec<Weight> = ms.iter().map(|m| m.weight()).collect();
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for n in [1, 4] {
            let x = rng.vec(n * cols);
            let want: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| pool.install(|| run(simd_level(), w, &x, n)))
                .collect();
            let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows()]).collect();
            let mut parts: Vec<(&Weight, &mut [f32])> = ws
                .iter()
                .zip(outs.iter_mut())
                .map(|(w, o)| (w, o.as_mut_slice()))
                .collect();
            pool.install(|| matmul_group(&mut parts, &x, n));
            for (i, (got, want)) in outs.iter().zip(&want).enumerate() {
                assert!(bitwise_eq(got, want), "weight {i} n {n} {threads} threads");
            }
            // Rows 40..57 of the first matrix as a matrix of their own.
            let blk = ws[0].row_block(40, 57);
            let got = run(simd_level(), &blk, &x, n);
            for t in 0..n {
                assert!(bitwise_eq(
                    &got[t * 17..(t + 1) * 17],
                    &want[0][t * 300 + 40..t * 300 + 57]
                ));
            }
        }
    }
}

#[test]
fn mxfp4_dequantize_row_matches_table() {
    let mut rng = Rng(18);
    let m = OwnedM::random(&mut rng, 4, 96, 0, 254);
    let w = m.weight();
    let mut got = vec![0.0f32; 96];
    for r in 0..4 {
        dequantize_row(&w, r, &mut got);
        for (j, &g) in got.iter().enumerate() {
            let c = mxfp4::code(&m.codes[r * 12..], j);
            let s = m.scales[r * 3 + j / 32];
            let want = (E2M1[c] as f64 * 2f64.powi(s as i32 - 127)) as f32;
            assert_eq!(g.to_bits(), want.to_bits(), "row {r} col {j}");
        }
    }
}

#[test]
#[should_panic(expected = "mxfp4: scales have 1 entries, expected 2")]
fn mxfp4_matmul_rejects_a_bad_matrix() {
    // Fields are public, so a matrix can bypass `new`; matmul checks again.
    let codes = [0u32; 8];
    let w = Weight::Mxfp4(Mxfp4Matrix {
        rows: 1,
        cols: 64,
        codes: &codes,
        scales: &[127],
    });
    run(SimdLevel::Scalar, &w, &[0.0; 64], 1);
}

#[test]
fn mxfp4_unpackers_match_their_permutation() {
    let mut rng = Rng(19);
    let m = OwnedM::random(&mut rng, 1, 256, 127, 127);
    let mm = Mxfp4Matrix::new(1, 256, &m.codes, &m.scales).unwrap();
    let natural: Vec<f32> = (0..256)
        // `+ 0.0` turns -0 into +0, as the unpackers do.
        .map(|j| 2.0 * E2M1[mxfp4::code(&m.codes, j)] + 0.0)
        .collect();
    for level in supported_levels() {
        let (stream, perm) = stream_row(level, &mm);
        for (i, &v) in stream.iter().enumerate() {
            let j = i / 32 * 32 + perm(i % 32);
            assert_eq!(v, natural[j], "{level} pos {i}");
            assert!(!v.is_sign_negative() || v != 0.0, "{level}: -0 unpacked");
        }
    }
}

/// Row 0 of `m` in the stream order of `level`'s kernel, with its
/// permutation.
fn stream_row(level: SimdLevel, m: &Mxfp4Matrix) -> (Vec<f32>, fn(usize) -> usize) {
    let mut out = vec![0.0; m.cols];
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn r512(m: &Mxfp4Matrix, o: &mut [f32]) {
            unpack_row::<Avx512, _, A512Fp4, 2>(m, 0, o)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn r256(m: &Mxfp4Matrix, o: &mut [f32]) {
            unpack_row::<Avx2, _, A2Fp4, 4>(m, 0, o)
        }
        match level {
            SimdLevel::Avx512 => {
                unsafe { r512(m, &mut out) };
                return (out, <A512Fp4 as Unpack<Avx512, 2>>::perm);
            }
            SimdLevel::Avx2 => {
                unsafe { r256(m, &mut out) };
                return (out, <A2Fp4 as Unpack<Avx2, 4>>::perm);
            }
            _ => {}
        }
    }
    unsafe { unpack_row::<Scalar, _, ScalarFp4, 4>(m, 0, &mut out) };
    (out, <ScalarFp4 as Unpack<Scalar, 4>>::perm)
}
