//! Rate of the CPU quantized products (multiply-adds per second) by shape and
//! token count, on the current rayon pool, with random MLX affine weights
//! (group 64) or, given `mxfp4`, random MXFP4 weights (group 32).
//! The ceiling to compare with is the machine's FMA peak (2 FMA units x
//! lanes x clock per core).
//!
//!   cargo run --release --example qmatmul_rate -- [BITS|mxfp4][:q8] [REPS] [avx2|avx512|scalar]
//!
//! `:q8` times the products with 8-bit activations (`--cpu-activations q8`).

use std::time::Instant;

use moeflux::backend::cpu::qmatmul::{matmul_at, matmul_q8_at, SimdLevel};
use moeflux::config::QuantSpec;
use moeflux::quant::{Mxfp4Matrix, QMatrix, ScaleData, Weight};

/// A small xorshift generator: the weights only need to be arbitrary.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let arg = args.next().unwrap_or_else(|| "4".to_string());
    let (format, q8) = match arg.strip_suffix(":q8") {
        Some(f) => (f.to_string(), true),
        None => (arg, false),
    };
    let product = if q8 { matmul_q8_at } else { matmul_at };
    let mxfp4 = format == "mxfp4";
    let bits: u32 = if mxfp4 { 4 } else { format.parse()? };
    let reps: usize = args.next().map_or(Ok(5), |s| s.parse())?;
    let level = match args.next().as_deref() {
        None => moeflux::backend::cpu::qmatmul::simd_level(),
        Some("avx512") => SimdLevel::Avx512,
        Some("avx2") => SimdLevel::Avx2,
        Some("scalar") => SimdLevel::Scalar,
        Some(s) => return Err(format!("unknown level '{s}'").into()),
    };
    let spec = QuantSpec::affine(bits, std::env::var("GS").map_or(64, |v| v.parse().unwrap()));
    let mut rng = Rng(0x9e3779b97f4a7c15);
    let what = if mxfp4 {
        "MXFP4, group 32".to_string()
    } else {
        format!("{bits}-bit affine, group 64")
    } + if q8 { ", 8-bit activations" } else { "" };
    println!(
        "{level:?}, {what}, {} threads",
        rayon::current_num_threads()
    );
    println!("| rows x cols | tokens | ms | GFMA/s |");
    println!("|---|---:|---:|---:|");
    // An LM head slice, a GatedDeltaNet input projection, an expert's up and
    // down projections (A3B widths), gpt-oss-20b's expert gate_up projection.
    for (rows, cols) in [
        (32768, 2048),
        (12288, 2048),
        (512, 2048),
        (2048, 512),
        (5760, 2880),
    ] {
        let words = rows * cols * bits as usize / 32;
        let packed: Vec<u32> = (0..words).map(|_| rng.next() as u32).collect();
        let groups = rows * cols / spec.group_size;
        let scales: Vec<f32> = (0..groups).map(|_| rng.f32() * 0.02).collect();
        let biases: Vec<f32> = (0..groups).map(|_| rng.f32() * 0.1).collect();
        let e8m0: Vec<u8> = (0..rows * cols / 32)
            .map(|_| 120 + (rng.next() % 8) as u8)
            .collect();
        let w = if mxfp4 {
            Weight::Mxfp4(Mxfp4Matrix::new(rows, cols, &packed, &e8m0)?)
        } else {
            Weight::Quantized(QMatrix {
                rows,
                cols,
                spec,
                packed: &packed,
                scales: ScaleData::F32(&scales),
                biases: ScaleData::F32(&biases),
            })
        };
        for n in [1usize, 2, 4, 8, 16, 64] {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
            let mut out = vec![0.0f32; n * rows];
            // Small matrices repeat so each timing covers a few ms.
            let inner = (1usize << 26).div_ceil(rows * cols * n).max(1);
            product(level, &w, &x, n, &mut out);
            let mut best = f64::INFINITY;
            for _ in 0..reps {
                let t = Instant::now();
                for _ in 0..inner {
                    product(level, &w, &x, n, &mut out);
                }
                best = best.min(t.elapsed().as_secs_f64() / inner as f64);
            }
            let gfma = (rows * cols * n) as f64 / best / 1e9;
            println!("| {rows} x {cols} | {n} | {:.3} | {gfma:.1} |", best * 1e3);
        }
    }
    Ok(())
}
