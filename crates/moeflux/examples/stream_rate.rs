//! How fast the one-token MXFP4 product (8-bit activations, `--cpu-activations q8`)
//! streams weights that come from DRAM, by where the bytes live: anonymous 4 KiB
//! pages, anonymous transparent huge pages, and a file mapping served by the page
//! cache (how experts are read when they fit in RAM), each beside the product of
//! the same bytes as eight-row interleaved matrices and a plain read of the same
//! bytes on the same threads. The working set is many gpt-oss expert
//! gate/up matrices (5760 x 2880), far larger than the caches.
//!
//!   cargo run --release --example stream_rate -- [MIB] [REPS]
//!
//! The file is written to the temporary directory and removed. Prints GB/s per
//! repetition; the machine should be idle.

use std::io::Write;
use std::time::Instant;

use moeflux::backend::cpu::qmatmul::{matmul_q8_at, simd_level};
use moeflux::quant::{Mxfp4Matrix, Mxfp4x8Matrix, Weight};
use rayon::prelude::*;

const ROWS: usize = 5760;
const COLS: usize = 2880;
const CODE_BYTES: usize = ROWS * COLS / 2;
const SCALE_BYTES: usize = ROWS * COLS / 32;
const MATRIX_BYTES: usize = CODE_BYTES + SCALE_BYTES;

/// Arbitrary bytes (codes and scales alike: the timing does not depend on them).
fn fill(b: &mut [u8]) {
    let mut s = 0x9e3779b97f4a7c15u64;
    for c in b.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c.copy_from_slice(&s.to_le_bytes()[..c.len()]);
    }
}

/// A `/proc/self/smaps_rollup` line, to show which pages the mapping got.
fn smaps(key: &str) -> String {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    s.lines().find(|l| l.starts_with(key)).map_or_else(
        || format!("{key} ?"),
        |l| l.split_whitespace().collect::<Vec<_>>().join(" "),
    )
}

fn time(label: &str, bytes: &[u8], reps: usize) {
    let n = bytes.len() / MATRIX_BYTES;
    let mats: Vec<Weight> = (0..n)
        .map(|i| {
            let b = &bytes[i * MATRIX_BYTES..(i + 1) * MATRIX_BYTES];
            // SAFETY: every mapping is page-aligned and MATRIX_BYTES a multiple
            // of 4, so each matrix's codes start 4-byte aligned.
            let codes =
                unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u32, CODE_BYTES / 4) };
            Weight::Mxfp4(Mxfp4Matrix::new(ROWS, COLS, codes, &b[CODE_BYTES..]).unwrap())
        })
        .collect();
    // The same bytes read as eight-row interleaved matrices (what the CPU
    // backend makes at load): the timing does not depend on the values.
    let interleaved: Vec<Weight> = (0..n)
        .map(|i| {
            let b = &bytes[i * MATRIX_BYTES..(i + 1) * MATRIX_BYTES];
            let m = Mxfp4x8Matrix {
                rows: ROWS,
                cols: COLS,
                codes: &b[..CODE_BYTES],
                scales: &b[CODE_BYTES..],
            };
            m.check().unwrap();
            Weight::Mxfp4x8(m)
        })
        .collect();
    let x: Vec<f32> = (0..COLS)
        .map(|i| ((i * 7919) % 113) as f32 / 113.0 - 0.5)
        .collect();
    let mut out = vec![0.0f32; ROWS];
    let level = simd_level();
    let total = (n * MATRIX_BYTES) as f64;
    let words: &[u64] =
        unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const u64, n * MATRIX_BYTES / 8) };
    let per_thread = words.len().div_ceil(rayon::current_num_threads());
    for rep in 0..reps {
        let t = Instant::now();
        for w in &mats {
            matmul_q8_at(level, w, &x, 1, &mut out);
        }
        let product = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for w in &interleaved {
            matmul_q8_at(level, w, &x, 1, &mut out);
        }
        let product8 = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let sum: u64 = words
            .par_chunks(per_thread)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .sum();
        let read = t.elapsed().as_secs_f64();
        println!(
            "| {label} | {rep} | {:.2} | {:.2} | {:.2} |",
            total / product / 1e9,
            total / product8 / 1e9,
            total / read / 1e9
        );
        std::hint::black_box((sum, &out));
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args
        .next()
        .map_or(512, |s| s.parse().expect("MIB: an integer"));
    let reps: usize = args
        .next()
        .map_or(3, |s| s.parse().expect("REPS: an integer"));
    let len = (mib << 20) / MATRIX_BYTES * MATRIX_BYTES;
    assert!(len > 0, "at least {} MiB", MATRIX_BYTES.div_ceil(1 << 20));
    println!(
        "{:?}, {} threads, {} MB of 5760 x 2880 MXFP4 matrices",
        simd_level(),
        rayon::current_num_threads(),
        len / 1_000_000
    );
    println!("| memory | rep | q8 product GB/s | interleaved q8 GB/s | plain read GB/s |");
    println!("|---|---:|---:|---:|---:|");
    for (label, advice) in [
        ("anonymous, 4 KiB pages", memmap2::Advice::NoHugePage),
        ("anonymous, huge pages", memmap2::Advice::HugePage),
    ] {
        let mut m = memmap2::MmapOptions::new().len(len).map_anon().unwrap();
        m.advise(advice).unwrap();
        fill(&mut m);
        time(label, &m, reps);
        eprintln!("{label}: {}", smaps("AnonHugePages"));
    }
    let path = std::env::temp_dir().join(format!("moeflux-stream-rate-{}", std::process::id()));
    {
        let mut v = vec![0u8; len];
        fill(&mut v);
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&v).unwrap();
    }
    let f = std::fs::File::open(&path).unwrap();
    // SAFETY: the file is ours and not modified while mapped.
    let m = unsafe { memmap2::Mmap::map(&f).unwrap() };
    time("file mapping (page cache)", &m, reps);
    eprintln!("file mapping: {}", smaps("FilePmdMapped"));
    drop(m);
    let _ = std::fs::remove_file(&path);
}
