//! Our MLX affine quantizer against real `mx.quantize` output, bit for bit,
//! and the CPU matmul on MLX-packed weights against `mx.dequantize(..) @ x`.
//!
//! MXFP4: our dequantization against `mx.dequantize(.., mode="mxfp4")` bit for
//! bit, the Hugging Face block layout against mlx's codes, and the products
//! against `mx.quantized_matmul`.
//!
//! Fixture: tests/fixtures/quant/quant_vectors.safetensors, written by
//! tools/goldens/quant_vectors.py (see its docstring for the keys).

use std::path::PathBuf;

use moeflux::backend::cpu::qmatmul::{matmul, matmul_at};
use moeflux::backend::cpu::simd::supported_levels;
use moeflux::config::QuantSpec;
use moeflux::quant::affine::{self, bf16_to_f32, round_to_bf16};
use moeflux::quant::{mxfp4, Mxfp4Matrix, QMatrix, ScaleData, Weight};
use safetensors::{Dtype, SafeTensors};

fn fixture() -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quant/quant_vectors.safetensors");
    std::fs::read(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
}

/// A tensor's shape, dtype and raw little-endian bytes.
fn get<'a>(st: &'a SafeTensors, name: &str) -> (Vec<usize>, Dtype, &'a [u8]) {
    let t = st
        .tensor(name)
        .unwrap_or_else(|e| panic!("tensor {name}: {e}"));
    (t.shape().to_vec(), t.dtype(), t.data())
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
fn u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}
fn u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2)
        .map(|c| u16::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Scales or biases as stored (bf16 bit patterns or f32).
enum Params {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

impl Params {
    fn load(st: &SafeTensors, name: &str) -> Params {
        match get(st, name) {
            (_, Dtype::BF16, b) => Params::Bf16(u16s(b)),
            (_, Dtype::F32, b) => Params::F32(f32s(b)),
            (_, d, _) => panic!("{name}: unexpected dtype {d:?}"),
        }
    }
    fn view(&self) -> ScaleData<'_> {
        match self {
            Params::Bf16(v) => ScaleData::Bf16(v),
            Params::F32(v) => ScaleData::F32(v),
        }
    }
}

struct Case {
    key: String,
    bits: u32,
    gs: usize,
    bf16: bool,
}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for gs in [32usize, 64, 128] {
            v.push(Case {
                key: format!("b{bits}_g{gs}_f32"),
                bits,
                gs,
                bf16: false,
            });
        }
    }
    for bits in [2u32, 4, 8] {
        v.push(Case {
            key: format!("b{bits}_g64_bf16"),
            bits,
            gs: 64,
            bf16: true,
        });
    }
    v
}

/// Bit patterns for an exact comparison that also distinguishes -0.0.
fn bits_f32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn quantize_matches_mlx_bit_for_bit() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut n_cases = 0;
    for c in cases() {
        let (shape, dt, raw) = get(&st, &format!("{}.input", c.key));
        let (rows, cols) = (shape[0], shape[1]);
        // bf16 weights are quantized upcast to f32, then scale/bias rounded.
        let input: Vec<f32> = match (dt, c.bf16) {
            (Dtype::F32, false) => f32s(raw),
            (Dtype::BF16, true) => u16s(raw).into_iter().map(bf16_to_f32).collect(),
            _ => panic!("{}: unexpected input dtype {dt:?}", c.key),
        };
        let spec = QuantSpec::affine(c.bits, c.gs);
        let q = affine::quantize(&input, rows, cols, spec);

        let (wshape, wdt, wraw) = get(&st, &format!("{}.weight", c.key));
        assert_eq!(wdt, Dtype::U32);
        assert_eq!(wshape, vec![rows, affine::words_per_row(cols, c.bits)]);
        let want_w = u32s(wraw);
        let bad: Vec<usize> = (0..want_w.len())
            .filter(|&i| q.packed[i] != want_w[i])
            .collect();
        assert!(
            bad.is_empty(),
            "{}: {} of {} packed words differ, first at word {} (ours {:#010x}, mlx {:#010x})",
            c.key,
            bad.len(),
            want_w.len(),
            bad[0],
            q.packed[bad[0]],
            want_w[bad[0]]
        );

        for (what, ours) in [("scales", &q.scales), ("biases", &q.biases)] {
            let name = format!("{}.{what}", c.key);
            match Params::load(&st, &name) {
                Params::F32(want) => {
                    assert!(!c.bf16, "{name}: f32 for a bf16 case");
                    assert_eq!(bits_f32(ours), bits_f32(&want), "{name} differ");
                }
                Params::Bf16(want) => {
                    assert!(c.bf16, "{name}: bf16 for an f32 case");
                    let ours: Vec<u16> = ours.iter().map(|&v| round_to_bf16(v)).collect();
                    assert_eq!(ours, want, "{name} differ");
                }
            }
        }
        n_cases += 1;
    }
    assert_eq!(n_cases, 21);
}

#[test]
fn matmul_on_mlx_weights_matches_mlx_dequantize() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (xshape, _, xraw) = get(&st, "x");
    let (n, cols) = (xshape[0], xshape[1]);
    let x = f32s(xraw);
    for c in cases() {
        let packed = u32s(get(&st, &format!("{}.weight", c.key)).2);
        let scales = Params::load(&st, &format!("{}.scales", c.key));
        let biases = Params::load(&st, &format!("{}.biases", c.key));
        let (yshape, _, yraw) = get(&st, &format!("{}.y", c.key));
        let rows = yshape[1];
        assert_eq!(yshape[0], n);
        let want = f32s(yraw);
        let qm = QMatrix {
            rows,
            cols,
            spec: QuantSpec::affine(c.bits, c.gs),
            packed: &packed,
            scales: scales.view(),
            biases: biases.view(),
        };
        let w = Weight::Quantized(qm);
        // Magnitude per output: sum over j of |w_rj * x_tj| with w dequantized.
        let mut row = vec![0.0f32; cols];
        let mut mag = vec![0.0f64; n * rows];
        for r in 0..rows {
            moeflux::backend::cpu::qmatmul::dequantize_row(&w, r, &mut row);
            for t in 0..n {
                mag[t * rows + r] = row
                    .iter()
                    .zip(&x[t * cols..(t + 1) * cols])
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
            }
        }
        let mut outs = vec![("default".to_string(), {
            let mut o = vec![0.0f32; n * rows];
            matmul(&w, &x, n, &mut o);
            o
        })];
        for level in supported_levels() {
            let mut o = vec![0.0f32; n * rows];
            matmul_at(level, &w, &x, n, &mut o);
            outs.push((level.to_string(), o));
        }
        for (name, got) in outs {
            for i in 0..n * rows {
                let err = (got[i] as f64 - want[i] as f64).abs();
                assert!(
                    err <= 1e-5 * mag[i] + 1e-30,
                    "{} ({name}): output {i}: ours {}, mlx {}, magnitude {}",
                    c.key,
                    got[i],
                    want[i],
                    mag[i]
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------
// MXFP4: keys `mxfp4_{quantized,random}.*` (see tools/goldens/quant_vectors.py).

fn u8s<'a>(st: &'a SafeTensors, name: &str, want: Dtype) -> (Vec<usize>, &'a [u8]) {
    let (shape, dt, raw) = get(st, name);
    assert_eq!(dt, want, "{name}: dtype");
    (shape, raw)
}

/// Rounding steps on the longest path to one of our outputs (see the CPU
/// kernels' tests): per lane up to 4 products and a scale step per group,
/// the horizontal sum; doubled for the scalar level.
fn mxfp4_depth(cols: usize) -> f64 {
    (2 * (4 + cols / 32) + 5) as f64
}

#[test]
fn mxfp4_dequantize_and_hf_blocks_match_mlx_bit_for_bit() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for name in ["quantized", "random"] {
        let key = format!("mxfp4_{name}");
        let (cshape, craw) = u8s(&st, &format!("{key}.codes"), Dtype::U32);
        let (sshape, scales) = u8s(&st, &format!("{key}.scales"), Dtype::U8);
        let (bshape, blocks) = u8s(&st, &format!("{key}.blocks"), Dtype::U8);
        let (dshape, draw) = u8s(&st, &format!("{key}.dequant"), Dtype::F32);
        let (rows, cols) = (dshape[0], dshape[1]);
        assert_eq!(cshape, vec![rows, cols / 8]);
        assert_eq!(sshape, vec![rows, cols / 32]);
        assert_eq!(bshape, vec![rows, cols / 32, 16]);
        let codes = u32s(craw);
        // The Hugging Face layout holds the same bytes.
        let from_hf = mxfp4::codes_from_hf_blocks(blocks, rows, cols).unwrap();
        assert_eq!(from_hf, codes, "{key}: HF blocks");
        mxfp4::check_hf_scales(scales, rows, cols).unwrap();

        let m = Mxfp4Matrix::new(rows, cols, &codes, scales).unwrap();
        let want = u32s(draw);
        let w = Weight::Mxfp4(m);
        let mut row = vec![0.0f32; cols];
        let (mut neg_zero, mut extremes) = (0, 0);
        for r in 0..rows {
            moeflux::backend::cpu::qmatmul::dequantize_row(&w, r, &mut row);
            for (j, v) in row.iter().enumerate() {
                assert_eq!(
                    v.to_bits(),
                    want[r * cols + j],
                    "{key}: row {r} col {j}: ours {v}, mlx {}",
                    f32::from_bits(want[r * cols + j])
                );
                neg_zero += (v.to_bits() == 0x8000_0000) as usize;
            }
            extremes += scales[r * cols / 32..(r + 1) * cols / 32]
                .iter()
                .filter(|&&s| s == 0 || s == 254)
                .count();
        }
        if name == "random" {
            assert!(neg_zero > 0 && extremes >= 3, "{key}: coverage");
        }
    }
}

#[test]
fn mxfp4_matmul_matches_mlx_quantized_matmul() {
    let bytes = fixture();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for name in ["quantized", "random"] {
        let key = format!("mxfp4_{name}");
        let codes = u32s(u8s(&st, &format!("{key}.codes"), Dtype::U32).1);
        let scales = u8s(&st, &format!("{key}.scales"), Dtype::U8).1;
        let (xshape, xraw) = u8s(&st, &format!("{key}.x"), Dtype::F32);
        let (yshape, yraw) = u8s(&st, &format!("{key}.y"), Dtype::F32);
        let (n, cols) = (xshape[0], xshape[1]);
        let rows = yshape[1];
        assert_eq!(yshape[0], n);
        let (x, want) = (f32s(xraw), f32s(yraw));
        let w = Weight::Mxfp4(Mxfp4Matrix::new(rows, cols, &codes, scales).unwrap());
        // Exact value and magnitude per output, in f64 (where no weight
        // overflows).
        let mut exact = vec![(0.0f64, 0.0f64); n * rows];
        for r in 0..rows {
            for t in 0..n {
                let (mut s, mut m) = (0.0, 0.0);
                for j in 0..cols {
                    let c = (codes[r * cols / 8 + j / 8] >> (4 * (j % 8))) & 15;
                    let e = scales[r * cols / 32 + j / 32] as i32 - 127;
                    let v = mxfp4::E2M1[c as usize] as f64 * 2f64.powi(e) * x[t * cols + j] as f64;
                    s += v;
                    m += v.abs();
                }
                exact[t * rows + r] = (s, m);
            }
        }
        let u = f32::EPSILON as f64 / 2.0;
        let tiny = f64::from(f32::from_bits(1));
        let ours_bound = mxfp4_depth(cols) * 1.01;
        // mlx's summation order is its own: allow a serial sum's depth.
        let mlx_bound = cols as f64;
        let mut compared = 0;
        for level in supported_levels() {
            let mut got = vec![0.0f32; n * rows];
            matmul_at(level, &w, &x, n, &mut got);
            for i in 0..n * rows {
                let (v, m) = exact[i];
                if m >= f32::MAX as f64 / 2.0 {
                    // Past f32's range (row 1 of `random`, scale 254): mlx
                    // gives inf; nothing finite to compare.
                    continue;
                }
                let (g, y) = (got[i] as f64, want[i] as f64);
                assert!(
                    (g - v).abs() <= ours_bound * (u * m + tiny),
                    "{key} {level}: output {i}: ours {g}, exact {v}, magnitude {m}"
                );
                assert!(
                    (g - y).abs() <= (ours_bound + mlx_bound) * (u * m + tiny),
                    "{key} {level}: output {i}: ours {g}, mlx {y}, magnitude {m}"
                );
                compared += 1;
            }
        }
        assert!(
            compared >= supported_levels().len() * (rows - 1) * n,
            "{key}"
        );
    }
}
