//! Our MLX affine quantizer against real `mx.quantize` output, bit for bit,
//! and the CPU matmul on MLX-packed weights against `mx.dequantize(..) @ x`.
//!
//! Fixture: tests/fixtures/quant/quant_vectors.safetensors, written by
//! tools/goldens/quant_vectors.py (see its docstring for the keys).

use std::path::PathBuf;

use moeflux::backend::cpu::qmatmul::{matmul, matmul_at};
use moeflux::backend::cpu::simd::supported_levels;
use moeflux::config::QuantSpec;
use moeflux::quant::affine::{self, bf16_to_f32, round_to_bf16};
use moeflux::quant::{QMatrix, ScaleData, Weight};
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
        let spec = QuantSpec {
            bits: c.bits,
            group_size: c.gs,
        };
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
            spec: QuantSpec {
                bits: c.bits,
                group_size: c.gs,
            },
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
