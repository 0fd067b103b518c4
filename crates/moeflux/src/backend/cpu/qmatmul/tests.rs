use super::*;
use crate::backend::cpu::simd::supported_levels;
use crate::quant::{affine, QuantSpec};

/// splitmix64 (the MXFP4 tests share it and the helpers below).
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub(super) fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub(super) fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

fn bf16(x: f32) -> u16 {
    affine::round_to_bf16(x)
}

/// Owned storage of a random quantized matrix.
struct OwnedQ {
    rows: usize,
    cols: usize,
    spec: QuantSpec,
    packed: Vec<u32>,
    scales_f32: Vec<f32>,
    biases_f32: Vec<f32>,
    scales_bf16: Vec<u16>,
    biases_bf16: Vec<u16>,
    bf16: bool,
}

impl OwnedQ {
    fn random(rng: &mut Rng, rows: usize, cols: usize, bits: u32, gs: usize, bf16s: bool) -> Self {
        let spec = QuantSpec::affine(bits, gs);
        let wpr = affine::words_per_row(cols, bits);
        let mut packed = vec![0u32; rows * wpr];
        for r in 0..rows {
            let codes: Vec<u8> = (0..cols)
                .map(|_| (rng.next_u64() % (1u64 << bits)) as u8)
                .collect();
            affine::pack_codes(&codes, bits, &mut packed[r * wpr..(r + 1) * wpr]);
        }
        let groups = rows * cols / gs;
        let n_bins = ((1u32 << bits) - 1) as f32;
        // Like MLX: the scale may be negative and the bias is a group edge.
        let scales: Vec<f32> = (0..groups).map(|_| rng.f32() * 0.05 / n_bins).collect();
        let biases: Vec<f32> = scales
            .iter()
            .map(|&s| -s * n_bins * (0.5 + 0.5 * rng.f32()))
            .collect();
        let scales_bf16: Vec<u16> = scales.iter().map(|&s| bf16(s)).collect();
        let biases_bf16: Vec<u16> = biases.iter().map(|&s| bf16(s)).collect();
        OwnedQ {
            rows,
            cols,
            spec,
            packed,
            scales_f32: scales,
            biases_f32: biases,
            scales_bf16,
            biases_bf16,
            bf16: bf16s,
        }
    }

    fn weight(&self) -> Weight<'_> {
        let (scales, biases) = if self.bf16 {
            (
                ScaleData::Bf16(&self.scales_bf16),
                ScaleData::Bf16(&self.biases_bf16),
            )
        } else {
            (
                ScaleData::F32(&self.scales_f32),
                ScaleData::F32(&self.biases_f32),
            )
        };
        Weight::Quantized(QMatrix {
            rows: self.rows,
            cols: self.cols,
            spec: self.spec,
            packed: &self.packed,
            scales,
            biases,
        })
    }
}

/// f64 reference from the dequantized terms: returns (value, magnitude) per
/// output, where magnitude sums |q*s*x| + |b*x| (or |w*x| for dense).
fn reference(w: &Weight, x: &[f32], n: usize) -> Vec<(f64, f64)> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![(0.0, 0.0); n * rows];
    for r in 0..rows {
        let terms: Vec<(f64, f64)> = match w {
            Weight::Quantized(q) => {
                let wpr = q.words_per_row();
                let gpr = q.groups_per_row();
                (0..cols)
                    .map(|j| {
                        let g = r * gpr + j / q.spec.group_size;
                        let code = affine::unpack_code(&q.packed[r * wpr..], j, q.spec.bits) as f64;
                        (code * q.scales.get(g) as f64, q.biases.get(g) as f64)
                    })
                    .collect()
            }
            Weight::Mxfp4(_) | Weight::Mxfp4x8(_) | Weight::Affine4x8(_) => {
                unreachable!("MXFP4 and interleaved weights have their own tests")
            }
            Weight::Dense(d) => (0..cols)
                .map(|j| {
                    let v = match d.data {
                        DenseData::Bf16(v) => affine::bf16_to_f32(v[r * cols + j]),
                        DenseData::F32(v) => v[r * cols + j],
                    };
                    (v as f64, 0.0)
                })
                .collect(),
        };
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            let mut s = 0.0;
            let mut m = 0.0;
            for (&(a, b), &xv) in terms.iter().zip(xt) {
                let xv = xv as f64;
                s += (a + b) * xv;
                m += (a * xv).abs() + (b * xv).abs();
            }
            out[t * rows + r] = (s, m);
        }
    }
    out
}

fn check_close(got: &[f32], want: &[(f64, f64)], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &(v, m))) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - v).abs();
        assert!(
            err <= 1e-5 * m + 1e-30,
            "{what}: element {i}: got {g}, want {v} (magnitude {m}, err {err})"
        );
    }
}

pub(super) fn bitwise_eq(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

pub(super) fn run(level: SimdLevel, w: &Weight, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * w.rows()];
    matmul_at(level, w, x, n, &mut out);
    out
}

const BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
// 16: GGUF's K-quants (every level's buffered path, blocks of one group).
const GROUPS: [usize; 4] = [16, 32, 64, 128];

#[test]
fn quantized_matches_f64_reference() {
    let mut rng = Rng(1);
    for bits in BITS {
        for gs in GROUPS {
            for bf in [false, true] {
                for (rows, cols) in [(1, 128), (3, 384), (17, 256)] {
                    let q = OwnedQ::random(&mut rng, rows, cols, bits, gs, bf);
                    let w = q.weight();
                    for n in [1, 2, 5] {
                        let x = rng.vec(n * cols);
                        let want = reference(&w, &x, n);
                        for level in supported_levels() {
                            let got = run(level, &w, &x, n);
                            let what = format!(
                                "{level} bits {bits} gs {gs} bf16 {bf} {rows}x{cols} n {n}"
                            );
                            check_close(&got, &want, &what);
                        }
                    }
                }
            }
        }
    }
}

fn dense_owned(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u16>, Vec<f32>) {
    let f: Vec<f32> = rng.vec(rows * cols);
    let b: Vec<u16> = f.iter().map(|&v| bf16(v)).collect();
    (b, f)
}

#[test]
fn dense_matches_f64_reference() {
    let mut rng = Rng(2);
    for (rows, cols) in [(1, 7), (3, 100), (17, 257), (5, 512), (2, 31)] {
        let (b, f) = dense_owned(&mut rng, rows, cols);
        for data in [DenseData::Bf16(&b), DenseData::F32(&f)] {
            let w = Weight::Dense(DenseMatrix { rows, cols, data });
            for n in [1, 2, 6] {
                let x = rng.vec(n * cols);
                let want = reference(&w, &x, n);
                for level in supported_levels() {
                    let got = run(level, &w, &x, n);
                    check_close(&got, &want, &format!("dense {level} {rows}x{cols} n {n}"));
                }
            }
        }
    }
}

/// Token `t`'s outputs for each token, computed one token at a time.
pub(super) fn per_token(level: SimdLevel, w: &Weight, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (w.rows(), w.cols());
    let mut out = vec![0.0; n * rows];
    for t in 0..n {
        let y = run(level, w, &x[t * cols..(t + 1) * cols], 1);
        out[t * rows..(t + 1) * rows].copy_from_slice(&y);
    }
    out
}

fn check_batch_invariance(level: SimdLevel, w: &Weight, x: &[f32], what: &str) {
    let rows = w.rows();
    let cols = w.cols();
    let one = per_token(level, w, x, 33);
    for n in [2, 3, 7, 33] {
        let got = run(level, w, &x[..n * cols], n);
        assert!(
            bitwise_eq(&got, &one[..n * rows]),
            "{what}: n_tokens {n} differs from one token at a time"
        );
    }
}

#[test]
fn batch_equals_per_token_bitwise() {
    let mut rng = Rng(3);
    // cols 4096 makes the batched path split the rows into several blocks.
    for (rows, cols) in [(37, 256), (21, 4096)] {
        for bits in BITS {
            for gs in GROUPS {
                let q = OwnedQ::random(&mut rng, rows, cols, bits, gs, gs == 64);
                let w = q.weight();
                let x = rng.vec(33 * cols);
                for level in supported_levels() {
                    let what = format!("{level} bits {bits} gs {gs} {rows}x{cols}");
                    check_batch_invariance(level, &w, &x, &what);
                }
            }
        }
    }
    for (rows, cols) in [(37, 250), (9, 4096)] {
        let (b, f) = dense_owned(&mut rng, rows, cols);
        for data in [DenseData::Bf16(&b), DenseData::F32(&f)] {
            let w = Weight::Dense(DenseMatrix { rows, cols, data });
            let x = rng.vec(33 * cols);
            for level in supported_levels() {
                check_batch_invariance(level, &w, &x, &format!("dense {level} {rows}x{cols}"));
            }
        }
    }
}

#[test]
fn results_independent_of_thread_count() {
    let mut rng = Rng(4);
    let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect();
    let (rows, cols) = (301, 512);
    let mut weights = Vec::new();
    for (bits, gs) in [(4, 64), (2, 32), (8, 128), (3, 64)] {
        weights.push(OwnedQ::random(&mut rng, rows, cols, bits, gs, true));
    }
    let (b, f) = dense_owned(&mut rng, rows, cols);
    for n in [1, 2, 9] {
        let x = rng.vec(n * cols);
        let mut ws: Vec<Weight> = weights.iter().map(|q| q.weight()).collect();
        ws.push(Weight::Dense(DenseMatrix {
            rows,
            cols,
            data: DenseData::Bf16(&b),
        }));
        ws.push(Weight::Dense(DenseMatrix {
            rows,
            cols,
            data: DenseData::F32(&f),
        }));
        for w in &ws {
            for level in supported_levels() {
                let results: Vec<Vec<f32>> = pools
                    .iter()
                    .map(|p| p.install(|| run(level, w, &x, n)))
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
}

#[test]
fn grouped_matmuls_equal_separate_ones() {
    let mut rng = Rng(9);
    let cols = 256;
    let owned: Vec<OwnedQ> = [(4, 64, 300), (8, 64, 17), (2, 32, 96), (4, 64, 1)]
        .iter()
        .map(|&(bits, gs, rows)| OwnedQ::random(&mut rng, rows, cols, bits, gs, true))
        .collect();
    let (b, _) = dense_owned(&mut rng, 40, cols);
    let mut ws: Vec<Weight> = owned.iter().map(|q| q.weight()).collect();
    ws.push(Weight::Dense(DenseMatrix {
        rows: 40,
        cols,
        data: DenseData::Bf16(&b),
    }));
    for threads in [1, 2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for n in [1, 4, 33] {
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
                assert!(
                    bitwise_eq(got, want),
                    "weight {i}, n {n}, {threads} threads"
                );
            }
        }
    }
}

#[test]
fn dequantize_row_matches_affine() {
    let mut rng = Rng(5);
    for bits in BITS {
        for gs in GROUPS {
            for bf in [false, true] {
                let q = OwnedQ::random(&mut rng, 5, 256, bits, gs, bf);
                let w = q.weight();
                let gpr = 256 / gs;
                let wpr = affine::words_per_row(256, bits);
                let (s, b): (Vec<f32>, Vec<f32>) = if bf {
                    (
                        q.scales_bf16
                            .iter()
                            .map(|&h| affine::bf16_to_f32(h))
                            .collect(),
                        q.biases_bf16
                            .iter()
                            .map(|&h| affine::bf16_to_f32(h))
                            .collect(),
                    )
                } else {
                    (q.scales_f32.clone(), q.biases_f32.clone())
                };
                let mut got = vec![0.0; 256];
                let mut want = vec![0.0; 256];
                for r in 0..5 {
                    dequantize_row(&w, r, &mut got);
                    affine::dequantize_row(
                        &q.packed[r * wpr..(r + 1) * wpr],
                        &s[r * gpr..(r + 1) * gpr],
                        &b[r * gpr..(r + 1) * gpr],
                        q.spec,
                        &mut want,
                    );
                    assert!(bitwise_eq(&got, &want), "bits {bits} gs {gs} row {r}");
                }
            }
        }
    }
    let (b, f) = dense_owned(&mut rng, 3, 10);
    let mut got = vec![0.0; 10];
    for (data, want) in [
        (
            DenseData::Bf16(&b),
            b[10..20].iter().map(|&h| affine::bf16_to_f32(h)).collect(),
        ),
        (DenseData::F32(&f), f[10..20].to_vec()),
    ] {
        dequantize_row(
            &Weight::Dense(DenseMatrix {
                rows: 3,
                cols: 10,
                data,
            }),
            1,
            &mut got,
        );
        assert!(bitwise_eq(&got, &want));
    }
}

#[test]
fn unpackers_match_their_permutation() {
    // Every fast unpacker, through unpack_row, against the natural-order codes.
    let mut rng = Rng(6);
    for level in supported_levels() {
        for bits in BITS {
            for gs in GROUPS {
                let q = OwnedQ::random(&mut rng, 2, 256, bits, gs, false);
                let Weight::Quantized(qm) = q.weight() else {
                    unreachable!()
                };
                let mut natural = vec![0.0f32; 256];
                unpack_row_generic(&q.packed[..qm.words_per_row()], bits, &mut natural);
                let (stream, bw, perm) = stream_row(level, &qm);
                for (i, &v) in stream.iter().enumerate() {
                    let j = i / bw * bw + perm(i % bw);
                    assert_eq!(v, natural[j], "{level} bits {bits} gs {gs} pos {i}");
                }
            }
        }
    }
}

/// Row 0 of `q` in the stream order of `level`'s kernel, with its block width
/// and permutation.
fn stream_row(level: SimdLevel, q: &QMatrix) -> (Vec<f32>, usize, fn(usize) -> usize) {
    fn go<S: Isa, U: Unpack<S, NV>, const NV: usize>(
        q: &QMatrix,
        f: unsafe fn(&QMatrix, &mut [f32]),
    ) -> (Vec<f32>, usize, fn(usize) -> usize) {
        let mut out = vec![0.0; q.cols];
        unsafe { f(q, &mut out) };
        (out, NV * S::LANES, U::perm)
    }
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn r512<U: Unpack<Avx512, NV>, const NV: usize>(q: &QMatrix, o: &mut [f32]) {
            unpack_row::<Avx512, _, U, NV>(q, 0, o)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn r256<U: Unpack<Avx2, NV>, const NV: usize>(q: &QMatrix, o: &mut [f32]) {
            unpack_row::<Avx2, _, U, NV>(q, 0, o)
        }
        let gs = q.spec.group_size;
        match (level, q.spec.bits) {
            (SimdLevel::Avx512, 8) => return go::<Avx512, A512U8, 2>(q, r512::<A512U8, 2>),
            (SimdLevel::Avx512, 4) => return go::<Avx512, A512U4, 2>(q, r512::<A512U4, 2>),
            (SimdLevel::Avx512, 2) if gs == 32 => {
                return go::<Avx512, A512U2x32, 2>(q, r512::<A512U2x32, 2>)
            }
            (SimdLevel::Avx512, 2) => return go::<Avx512, A512U2x64, 4>(q, r512::<A512U2x64, 4>),
            (SimdLevel::Avx512, 3) => return go::<Avx512, A512Gen<3>, 2>(q, r512::<A512Gen<3>, 2>),
            (SimdLevel::Avx512, 5) => return go::<Avx512, A512Gen<5>, 2>(q, r512::<A512Gen<5>, 2>),
            (SimdLevel::Avx512, 6) => return go::<Avx512, A512Gen<6>, 2>(q, r512::<A512Gen<6>, 2>),
            (SimdLevel::Avx2, 3) => return go::<Avx2, A2Gen<3>, 4>(q, r256::<A2Gen<3>, 4>),
            (SimdLevel::Avx2, 5) => return go::<Avx2, A2Gen<5>, 4>(q, r256::<A2Gen<5>, 4>),
            (SimdLevel::Avx2, 6) => return go::<Avx2, A2Gen<6>, 4>(q, r256::<A2Gen<6>, 4>),
            (SimdLevel::Avx2, 8) => return go::<Avx2, A2U8, 4>(q, r256::<A2U8, 4>),
            (SimdLevel::Avx2, 4) => return go::<Avx2, A2U4, 4>(q, r256::<A2U4, 4>),
            (SimdLevel::Avx2, 2) => return go::<Avx2, A2U2, 4>(q, r256::<A2U2, 4>),
            _ => {}
        }
    }
    unsafe fn rs(q: &QMatrix, o: &mut [f32]) {
        unpack_row::<Scalar, _, Generic, 4>(q, 0, o)
    }
    go::<Scalar, Generic, 4>(q, rs)
}

// ---------------------------------------------------------------------------
// Benchmark (not a test): prints throughput per SIMD level and shape.
//   cargo test --release -p moeflux --lib qmatmul::tests::bench -- --ignored --nocapture

/// Seconds per call: the best of 5 rounds of about `secs / 5` each (the
/// machine is shared, so the minimum is the stable statistic).
fn time_it(mut f: impl FnMut(), secs: f64) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = std::time::Instant::now();
        let mut iters = 0u32;
        while start.elapsed().as_secs_f64() < secs / 5.0 || iters < 2 {
            f();
            iters += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / iters as f64);
    }
    best
}

#[test]
#[ignore]
fn bench() {
    let mut rng = Rng(7);
    let threads_list = [1usize, 2];
    let pools: Vec<rayon::ThreadPool> = threads_list
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect();

    // Memory bandwidth baseline: xor-reduce a 256 MiB buffer (vectorized).
    let big: Vec<u64> = (0..32u64 << 20).collect();
    for (pool, t) in pools.iter().zip(threads_list) {
        let secs = time_it(
            || {
                let s: u64 = pool.install(|| {
                    big.par_chunks(1 << 15)
                        .map(|c| c.iter().fold(0u64, |a, &v| a ^ v))
                        .reduce(|| 0, |a, b| a ^ b)
                });
                std::hint::black_box(s);
            },
            1.0,
        );
        println!(
            "baseline read 256 MiB, {t} thr: {:.1} GB/s",
            (big.len() * 8) as f64 / secs / 1e9
        );
    }
    drop(big);

    let filter = std::env::var("QBENCH").unwrap_or_default();
    let shapes: [(&str, usize, usize, u32, usize); 9] = [
        ("attn 2048x4096 q4", 2048, 4096, 4, 64),
        ("expert gate 512x2048 q4", 512, 2048, 4, 64),
        ("lm_head 248320x2048 q4", 248320, 2048, 4, 64),
        ("2048x4096 q8", 2048, 4096, 8, 64),
        ("2048x4096 q2", 2048, 4096, 2, 64),
        ("2048x4096 q3", 2048, 4096, 3, 64),
        ("2048x4096 q2 g32", 2048, 4096, 2, 32),
        // GGUF's Q6_K and Q3_K as stored: groups of 16.
        ("2048x4096 q6 g16", 2048, 4096, 6, 16),
        ("2048x4096 q3 g16", 2048, 4096, 3, 16),
    ];
    for (name, rows, cols, bits, gs) in shapes {
        if !filter.is_empty() && !name.contains(&filter) {
            continue;
        }
        let q = OwnedQ::random(&mut rng, rows, cols, bits, gs, true);
        let w = q.weight();
        let bytes = (q.packed.len() * 4 + q.scales_bf16.len() * 4) as f64;
        let token_counts: &[usize] = if rows > 100_000 {
            &[1]
        } else {
            &[1, 8, 64, 512]
        };
        for &n in token_counts {
            let x = rng.vec(n * cols);
            let mut out = vec![0.0; n * rows];
            for level in supported_levels() {
                if level == SimdLevel::Scalar && (n > 8 || rows > 100_000) {
                    continue;
                }
                for (pool, t) in pools.iter().zip(threads_list) {
                    let secs = pool.install(|| {
                        time_it(
                            || matmul_at(level, &w, &x, n, &mut out),
                            if rows > 100_000 { 2.0 } else { 0.5 },
                        )
                    });
                    println!(
                        "{name:26} n={n:3} {level:6} {t}thr: {:8.3} ms  {:6.1} GB/s  {:6.1} GMAC/s",
                        secs * 1e3,
                        bytes / secs / 1e9,
                        (rows * cols * n) as f64 / secs / 1e9
                    );
                }
            }
        }
    }
    for (name, rows, cols, bf) in [
        ("dense bf16 2048x2048", 2048, 2048, true),
        ("dense f32 2048x2048", 2048, 2048, false),
    ] {
        if !filter.is_empty() && !name.contains(&filter) {
            continue;
        }
        let (b, f) = dense_owned(&mut rng, rows, cols);
        let data = if bf {
            DenseData::Bf16(&b)
        } else {
            DenseData::F32(&f)
        };
        let w = Weight::Dense(DenseMatrix { rows, cols, data });
        let bytes = (rows * cols * if bf { 2 } else { 4 }) as f64;
        for n in [1, 64] {
            let x = rng.vec(n * cols);
            let mut out = vec![0.0; n * rows];
            for level in supported_levels() {
                for (pool, t) in pools.iter().zip(threads_list) {
                    let secs =
                        pool.install(|| time_it(|| matmul_at(level, &w, &x, n, &mut out), 0.5));
                    println!(
                        "{name:26} n={n:3} {level:6} {t}thr: {:8.3} ms  {:6.1} GB/s  {:6.1} GMAC/s",
                        secs * 1e3,
                        bytes / secs / 1e9,
                        (rows * cols * n) as f64 / secs / 1e9
                    );
                }
            }
        }
    }
}
