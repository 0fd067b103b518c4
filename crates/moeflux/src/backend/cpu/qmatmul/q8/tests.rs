use super::super::tests::{bitwise_eq, Rng};
use super::super::{matmul, matmul_at, matmul_q8_at};
use super::*;
use crate::backend::cpu::simd::{simd_level, supported_levels};
use crate::quant::mxfp4::{half_scale_f32, Mxfp4Matrix};
use crate::quant::{affine, mxfp4, QuantSpec, ScaleData};

/// A random weight with exact accessors for the f64 references.
enum Owned {
    Affine {
        rows: usize,
        cols: usize,
        spec: QuantSpec,
        codes: Vec<u8>,
        packed: Vec<u32>,
        scales: Vec<f32>,
        biases: Vec<f32>,
    },
    Mx {
        rows: usize,
        cols: usize,
        elems: Vec<u8>,
        codes: Vec<u32>,
        scales: Vec<u8>,
    },
}

impl Owned {
    fn affine(rng: &mut Rng, rows: usize, cols: usize, bits: u32, gs: usize) -> Owned {
        let spec = QuantSpec::affine(bits, gs);
        let codes: Vec<u8> = (0..rows * cols)
            .map(|_| (rng.next_u64() % (1 << bits)) as u8)
            .collect();
        let wpr = affine::words_per_row(cols, bits);
        let mut packed = vec![0u32; rows * wpr];
        for r in 0..rows {
            affine::pack_codes(
                &codes[r * cols..(r + 1) * cols],
                bits,
                &mut packed[r * wpr..(r + 1) * wpr],
            );
        }
        let groups = rows * cols / gs;
        let bins = ((1u32 << bits) - 1) as f32;
        let scales: Vec<f32> = (0..groups).map(|_| rng.f32() * 0.05 / bins).collect();
        let biases = scales
            .iter()
            .map(|&s| -s * bins * (0.5 + 0.5 * rng.f32()))
            .collect();
        Owned::Affine {
            rows,
            cols,
            spec,
            codes,
            packed,
            scales,
            biases,
        }
    }

    fn mx(rng: &mut Rng, rows: usize, cols: usize) -> Owned {
        let elems: Vec<u8> = (0..rows * cols)
            .map(|_| (rng.next_u64() % 16) as u8)
            .collect();
        let mut codes = vec![0u32; rows * cols / 8];
        mxfp4::pack_codes(&elems, &mut codes);
        let scales = (0..rows * cols / 32)
            .map(|_| 118 + (rng.next_u64() % 12) as u8)
            .collect();
        Owned::Mx {
            rows,
            cols,
            elems,
            codes,
            scales,
        }
    }

    fn weight(&self) -> Weight<'_> {
        match self {
            Owned::Affine {
                rows,
                cols,
                spec,
                packed,
                scales,
                biases,
                ..
            } => Weight::Quantized(QMatrix {
                rows: *rows,
                cols: *cols,
                spec: *spec,
                packed,
                scales: ScaleData::F32(scales),
                biases: ScaleData::F32(biases),
            }),
            Owned::Mx {
                rows,
                cols,
                codes,
                scales,
                ..
            } => Weight::Mxfp4(Mxfp4Matrix::new(*rows, *cols, codes, scales).unwrap()),
        }
    }

    fn shape(&self) -> (usize, usize, usize) {
        match self {
            Owned::Affine {
                rows, cols, spec, ..
            } => (*rows, *cols, spec.group_size),
            Owned::Mx { rows, cols, .. } => (*rows, *cols, 32),
        }
    }

    /// The weight at (r, j) as `code * scale` (the contract's integer code
    /// and scale), and the group's bias.
    fn parts(&self, r: usize, j: usize) -> (f64, f64, f64) {
        let (_, cols, gs) = self.shape();
        match self {
            Owned::Affine {
                codes,
                scales,
                biases,
                ..
            } => {
                let g = r * cols / gs + j / gs;
                (
                    codes[r * cols + j] as f64,
                    scales[g] as f64,
                    biases[g] as f64,
                )
            }
            Owned::Mx { elems, scales, .. } => (
                mxfp4::E2M1_X2[elems[r * cols + j] as usize] as f64,
                half_scale_f32(scales[r * cols / 32 + j / 32]) as f64,
                0.0,
            ),
        }
    }
}

/// Activations whose blocks span magnitudes (and one block of zeros).
fn activations(rng: &mut Rng, n: usize, cols: usize) -> Vec<f32> {
    let mut x = rng.vec(n * cols);
    for (b, blk) in x.chunks_exact_mut(32).enumerate() {
        let m = match b % 5 {
            0 => 0.01,
            1 => 1.0,
            2 => 30.0,
            3 if b == 3 => 0.0,
            _ => 3.0,
        };
        blk.iter_mut().for_each(|v| *v *= m);
    }
    x
}

/// Per output: the contract evaluated in f64 from the same rounded
/// activations, its magnitude, and the exact product with f32 activations
/// with the bound the rounding of the activations allows.
struct Expect {
    q8: f64,
    mag: f64,
    exact: f64,
    bound: f64,
}

// Weights, codes and activations are indexed together.
#[allow(clippy::needless_range_loop)]
fn expected(w: &Owned, x: &[f32], n: usize) -> Vec<Expect> {
    let (rows, cols, gs) = w.shape();
    let mut out = Vec::new();
    for t in 0..n {
        let xt = &x[t * cols..(t + 1) * cols];
        let mut xq = vec![0i8; cols];
        let mut dx = vec![0.0f32; cols / 32];
        for b in 0..cols / 32 {
            let mut q = [0i8; 32];
            dx[b] = quantize_block(&xt[b * 32..(b + 1) * 32], &mut q);
            xq[b * 32..(b + 1) * 32].copy_from_slice(&q);
        }
        for r in 0..rows {
            let mut e = Expect {
                q8: 0.0,
                mag: 0.0,
                exact: 0.0,
                bound: 0.0,
            };
            for b in 0..cols / 32 {
                let (mut isum, mut iabs, mut wabs) = (0.0, 0.0, 0.0);
                let mut scale = 0.0;
                for j in b * 32..(b + 1) * 32 {
                    let (c, s, _) = w.parts(r, j);
                    scale = s;
                    isum += c * xq[j] as f64;
                    iabs += (c * xq[j] as f64).abs();
                    wabs += (c * s).abs();
                }
                // ds is rounded to f32 in the kernel.
                let ds = (scale as f32 * dx[b]) as f64;
                e.q8 += ds * isum;
                e.mag += (ds * iabs).abs();
                // |x - xq dx| <= dx / 2, with room for dx's own rounding.
                e.bound += wabs * dx[b] as f64 * 0.5 * (1.0 + 1e-5);
            }
            for g in 0..cols / gs {
                let (_, _, bias) = w.parts(r, g * gs);
                let xg = &xt[g * gs..(g + 1) * gs];
                e.q8 += bias * xg.iter().map(|&v| v as f64).sum::<f64>();
                e.mag += bias.abs() * xg.iter().map(|&v| v.abs() as f64).sum::<f64>();
            }
            for (j, &xj) in xt.iter().enumerate() {
                let (c, s, bias) = w.parts(r, j);
                e.exact += (c * s + bias) * xj as f64;
            }
            out.push(e);
        }
    }
    out
}

fn run_q8(level: SimdLevel, w: &Weight, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * w.rows()];
    matmul_q8_at(level, w, x, n, &mut out);
    out
}

/// The shapes: every kind, odd and even block counts, groups of 32-128.
fn weights(rng: &mut Rng, rows: usize) -> Vec<(String, Owned)> {
    let mut v = Vec::new();
    for (cols, gs) in [(32, 32), (96, 32), (192, 64), (384, 128), (2880, 64)] {
        v.push((
            format!("4-bit {cols}/{gs}"),
            Owned::affine(rng, rows, cols, 4, gs),
        ));
    }
    for (cols, gs) in [(32, 32), (96, 32), (2880, 64)] {
        v.push((
            format!("8-bit {cols}/{gs}"),
            Owned::affine(rng, rows, cols, 8, gs),
        ));
    }
    for cols in [32, 96, 2880] {
        v.push((format!("mxfp4 {cols}"), Owned::mx(rng, rows, cols)));
    }
    v
}

#[test]
fn q8_products_follow_the_contract_and_the_rounding_bound() {
    let mut rng = Rng(0x5eed_0008);
    for (name, w) in weights(&mut rng, 7) {
        let (rows, cols, gs) = w.shape();
        let n = 3;
        let x = activations(&mut rng, n, cols);
        let expect = expected(&w, &x, n);
        let groups = cols / gs;
        let steps = (cols / 32 + groups + gs / 8 + 12) as f64;
        for level in supported_levels() {
            let got = run_q8(level, &w.weight(), &x, n);
            for (i, (g, e)) in got.iter().zip(&expect).enumerate() {
                let g = *g as f64;
                let tol = steps * f32::EPSILON as f64 * e.mag + 1e-30;
                assert!(
                    (g - e.q8).abs() <= tol,
                    "{name} {level:?} output {i} (row {}, token {}): {g} vs the contract's {} (tol {tol})",
                    i % rows,
                    i / rows,
                    e.q8
                );
                assert!(
                    (g - e.exact).abs() <= e.bound + tol,
                    "{name} {level:?} output {i}: {g} vs exact {} beyond the rounding bound {}",
                    e.exact,
                    e.bound
                );
            }
        }
    }
}

#[test]
fn q8_levels_agree_bit_for_bit_and_tokens_are_independent() {
    let mut rng = Rng(0x5eed_0009);
    for (name, w) in weights(&mut rng, 9) {
        let (rows, cols, _) = w.shape();
        let n = 5;
        let x = activations(&mut rng, n, cols);
        let portable = run_q8(SimdLevel::Scalar, &w.weight(), &x, n);
        for level in supported_levels() {
            let got = run_q8(level, &w.weight(), &x, n);
            assert!(bitwise_eq(&got, &portable), "{name}: {level:?} != portable");
            for t in 0..n {
                let one = run_q8(level, &w.weight(), &x[t * cols..(t + 1) * cols], 1);
                assert!(
                    bitwise_eq(&one, &got[t * rows..(t + 1) * rows]),
                    "{name} {level:?}: token {t} alone differs from the batch of {n}"
                );
            }
        }
    }
}

#[test]
fn q8_results_do_not_depend_on_the_thread_count() {
    let mut rng = Rng(0x5eed_000a);
    let w = Owned::mx(&mut rng, 61, 2880);
    let x = activations(&mut rng, 2, 2880);
    let alone = run_q8(simd_level(), &w.weight(), &x, 2);
    for threads in [2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let got = pool.install(|| run_q8(simd_level(), &w.weight(), &x, 2));
        assert!(bitwise_eq(&got, &alone), "{threads} threads");
    }
}

#[test]
fn the_thread_mode_picks_the_product() {
    let mut rng = Rng(0x5eed_000b);
    let q4 = Owned::affine(&mut rng, 8, 256, 4, 64);
    let q3 = Owned::affine(&mut rng, 8, 256, 3, 64);
    let x = activations(&mut rng, 1, 256);
    let level = simd_level();
    let f32_of = |w: &Owned| {
        let mut out = vec![0.0; 8];
        matmul_at(level, &w.weight(), &x, 1, &mut out);
        out
    };
    let mode_of = |w: &Owned| {
        let mut out = vec![0.0; 8];
        matmul(&w.weight(), &x, 1, &mut out);
        out
    };
    assert!(bitwise_eq(&mode_of(&q4), &f32_of(&q4)), "default is f32");
    // A pool whose threads are set, as a session sets its compute threads.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .start_handler(|_| set_thread_activations(Activations::Q8))
        .build()
        .unwrap();
    let q8 = run_q8(level, &q4.weight(), &x, 1);
    assert!(!bitwise_eq(&q8, &f32_of(&q4)), "q8 rounds the activations");
    assert!(bitwise_eq(&pool.install(|| mode_of(&q4)), &q8));
    // 3-bit codes have no q8 product: f32 activations.
    assert!(bitwise_eq(&pool.install(|| mode_of(&q3)), &f32_of(&q3)));
    assert_eq!(thread_activations(), Activations::F32);
}

#[test]
fn the_vector_quantizer_gives_the_scalar_bytes() {
    let mut rng = Rng(0x5eed_0042);
    let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
    for case in 0..4000 {
        let mut x: Vec<f32> = (0..32).map(|_| (rng.f32() - 0.5) * 8.0).collect();
        match case % 8 {
            // Inputs that land on halves: amax 127 makes y = x.
            0 => {
                x = (0..32).map(|i| (i as f32 - 16.0) * 0.5).collect();
                x[0] = 127.0;
            }
            1 => x = (0..32).map(|i| (i as f32 - 15.5) * 8.0).collect(),
            2 => x[case % 32] = f32::NAN,
            3 => x[(case / 8) % 32] = f32::NEG_INFINITY,
            4 => x.fill(0.0),
            5 => x.iter_mut().for_each(|v| *v *= 1e-30),
            _ => {}
        }
        let (da, db) = (quantize_block(&x, &mut a), quantize_block_fast(&x, &mut b));
        assert_eq!(da.to_bits(), db.to_bits(), "case {case}: {x:?}");
        assert_eq!(a, b, "case {case}: {x:?}");
    }
}

#[test]
fn activation_blocks_round_to_127_steps() {
    let mut q = [0i8; 32];
    let mut x = [0.25f32; 32];
    x[7] = -2.0;
    let dx = quantize_block(&x, &mut q);
    assert_eq!(dx, 2.0 / 127.0);
    assert_eq!(q[7], -127);
    assert_eq!(q[0], (0.25f32 * 127.0 / 2.0).round() as i8);
    assert_eq!(quantize_block(&[0.0; 32], &mut q), 0.0);
    assert!(q.iter().all(|&v| v == 0));
    x[3] = f32::NAN;
    assert!(quantize_block(&x, &mut q).is_nan());
    assert_eq!(Activations::parse(" Q8 "), Some(Activations::Q8));
    assert_eq!(Activations::parse("f32"), Some(Activations::F32));
    assert_eq!(Activations::parse("int8"), None);
}

/// q8 and f32 products of `w` and of its interleaved form `x8`, every
/// level, one, three, four and nine tokens (the AVX-512 kernel's pairs and
/// a last odd token), and on three threads: the same bits.
fn assert_interleaved_agrees(rng: &mut Rng, w: &Weight, x8: &Weight, what: &str) {
    let (rows, cols) = (w.rows(), w.cols());
    for n in [1, 3, 4, 9] {
        let x = activations(rng, n, cols);
        for level in supported_levels() {
            let want = run_q8(level, w, &x, n);
            let got = run_q8(level, x8, &x, n);
            assert!(bitwise_eq(&got, &want), "{what}, {n} tokens, {level:?}: q8");
            let (mut a, mut b) = (vec![f32::NAN; n * rows], vec![f32::NAN; n * rows]);
            matmul_at(level, w, &x, n, &mut a);
            matmul_at(level, x8, &x, n, &mut b);
            assert!(bitwise_eq(&a, &b), "{what}, {n} tokens, {level:?}: f32");
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let three = pool.install(|| run_q8(simd_level(), x8, &x, n));
        assert!(
            bitwise_eq(&three, &run_q8(simd_level(), w, &x, n)),
            "{what}: 3 threads"
        );
    }
}

#[test]
fn interleaved_affine_gives_the_row_major_bits() {
    use crate::quant::interleave::interleave_affine;
    let mut rng = Rng(0x5eed_000d);
    let bf16 = |v: &[f32]| {
        v.iter()
            .map(|&x| affine::round_to_bf16(x))
            .collect::<Vec<u16>>()
    };
    for (rows, cols, gs) in [(8, 64, 64), (24, 384, 128), (40, 2880, 64)] {
        let Owned::Affine {
            spec,
            packed,
            scales,
            biases,
            ..
        } = Owned::affine(&mut rng, rows, cols, 4, gs)
        else {
            unreachable!("Owned::affine")
        };
        let (scales, biases) = (bf16(&scales), bf16(&biases));
        let q = QMatrix {
            rows,
            cols,
            spec,
            packed: &packed,
            scales: ScaleData::Bf16(&scales),
            biases: ScaleData::Bf16(&biases),
        };
        let owned = interleave_affine(&q).unwrap();
        let x8 = Weight::Affine4x8(owned.view());
        let what = format!("{rows} x {cols}/{gs}");
        assert_interleaved_agrees(&mut rng, &Weight::Quantized(q), &x8, &what);
    }
    // Groups of 32, 8-bit codes and f32 scales stay as they are.
    for (bits, gs) in [(4, 32), (8, 64), (4, 64)] {
        let w = Owned::affine(&mut rng, 8, 128, bits, gs);
        let Weight::Quantized(q) = w.weight() else {
            unreachable!("Owned::affine")
        };
        assert!(interleave_affine(&q).is_err(), "{bits}-bit, groups of {gs}");
    }
}

#[test]
fn interleaved_mxfp4_gives_the_row_major_bits() {
    use crate::quant::interleave::{interleavable, interleave};
    use crate::quant::Mxfp4x8Matrix;
    let mut rng = Rng(0x5eed_000c);
    for (rows, cols) in [(8, 64), (24, 192), (40, 2880)] {
        let w = Owned::mx(&mut rng, rows, cols);
        let Owned::Mx { codes, scales, .. } = &w else {
            unreachable!("Owned::mx")
        };
        let m = Mxfp4Matrix::new(rows, cols, codes, scales).unwrap();
        assert_eq!(interleavable(&m), None);
        let (mut ic, mut is) = (vec![0u8; rows * cols / 2], vec![0u8; rows * cols / 32]);
        interleave(&m, &mut ic, &mut is);
        let x8 = Weight::Mxfp4x8(Mxfp4x8Matrix {
            rows,
            cols,
            codes: &ic,
            scales: &is,
        });
        assert_interleaved_agrees(&mut rng, &w.weight(), &x8, &format!("{rows} x {cols}"));
    }
}
