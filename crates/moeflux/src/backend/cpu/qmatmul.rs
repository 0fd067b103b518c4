//! Quantized (MLX affine, MXFP4) and dense matmul kernels for the CPU
//! backend (MXFP4 in the `mxfp4` submodule, same contract without biases).
//!
//! `out[t*rows + r] = dot(W[r, :], x[t*cols .. (t+1)*cols])`.
//!
//! # Arithmetic (the determinism contract)
//!
//! For a quantized row and one token, with `V` the SIMD lane count of the
//! level in use and code vectors taken in a fixed per-level "stream order"
//! (a permutation of each block of codes; `x` is permuted the same way once
//! per call):
//!
//! ```text
//! y = 0                                   (V lanes)
//! for each group g:
//!     acc = 0                             (V lanes)
//!     for each V-wide vector i of the group, in stream order:
//!         acc = fma(codes_i, x_i, acc)
//!     y = fma(splat(scale_g), acc, y)
//! out = hsum(y) + dot(biases, xsum)       (xsum_g = sum of x over group g)
//! ```
//!
//! Dense rows use the same loop with one group of scale 1 and no bias, plus
//! the columns past the last whole vector added in order after `hsum`.
//!
//! Every output element is computed by exactly this sequence on one thread,
//! whatever the tile shape, the code source (unpacked in registers or from a
//! buffer of unpacked codes, which are exact small integers in f32), the
//! number of tokens or the thread count. So a token's result is bitwise
//! independent of `n_tokens` and of the rayon pool. Different SIMD levels give
//! (slightly) different results.
//!
//! # Structure
//!
//! Rows are split into chunks run on the current rayon pool (inline when the
//! work is small). Within a chunk:
//! * few tokens (`n < BATCH_MIN_TOKENS`): 4 rows at a time, codes unpacked in
//!   registers (every width on AVX2/AVX-512 for groups of 32 or more; groups
//!   of 16 and the scalar level unpack rows into a buffer first) and shared
//!   by the rows' x loads;
//! * more tokens: rows are unpacked once to f32 in stream order (a block of at
//!   most `BUF_FLOATS`), then register tiles of `RB` rows x `TB` tokens run
//!   over it, token tile outermost so the codes stream from L2 while the
//!   activations stay in L1.

mod mxfp4;
mod q8;
mod unpack;

pub use q8::{set_thread_activations, thread_activations, Activations};

use std::borrow::Cow;
use std::marker::PhantomData;

use rayon::prelude::*;

pub use super::simd::{simd_level, SimdLevel};
#[cfg(target_arch = "x86_64")]
use super::simd::{Avx2, Avx512};
use super::simd::{Isa, Scalar};
use crate::quant::{Affine4x8Matrix, DenseData, DenseMatrix, QMatrix, ScaleData, Weight};
use unpack::*;

/// Below this many multiply-adds a call runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;
/// Smallest number of multiply-adds worth a rayon task.
const CHUNK_MIN_WORK: usize = 1 << 15;
/// Row chunks per pool thread (load balance).
const TASKS_PER_THREAD: usize = 4;
/// From this many tokens on, rows are unpacked once into a buffer and reused.
const BATCH_MIN_TOKENS: usize = 3;
/// Software prefetch distance for packed codes read in registers (n = 1
/// path): about one 4-row tile ahead at 2048 columns x 4 bits. Worth ~1.5x on
/// DRAM-bound matrices on the dev machine (Zen 5 VM).
const PREFETCH_BYTES: usize = 4096;
/// Size of the per-task buffer of unpacked rows, in f32 (256 KiB: L2-resident).
const BUF_FLOATS: usize = 1 << 16;

/// `out[t*rows + r] = dot(W[r, :], x[t*cols .. (t+1)*cols])` for `t < n_tokens`.
///
/// Every output element is computed by one thread in a fixed order, so a
/// token's result is bitwise independent of `n_tokens` and of the thread count.
/// Runs on the current rayon pool, with the SIMD level of [`simd_level`].
pub fn matmul(w: &Weight, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    matmul_at(simd_level(), w, x, n_tokens, out)
}

/// [`matmul`] with an explicit SIMD level (lowered to what the CPU supports);
/// for tests and benchmarks.
pub fn matmul_at(level: SimdLevel, w: &Weight, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    if let Some(job) = job(level, w, x, n_tokens, out) {
        run_jobs(&[job]);
    }
}

/// [`matmul`] with exact f32 activations whatever this thread's mode.
pub fn matmul_f32_activations(w: &Weight, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let _mode = q8::ModeScope::set(Activations::F32);
    matmul(w, x, n_tokens, out);
}

/// [`matmul_at`] with the activations quantized to 8 bits where `w` has
/// such a product ([`Activations::Q8`], whatever this thread's mode); for
/// tests and benchmarks.
pub fn matmul_q8_at(level: SimdLevel, w: &Weight, x: &[f32], n_tokens: usize, out: &mut [f32]) {
    let _mode = q8::ModeScope::set(Activations::Q8);
    matmul_at(level, w, x, n_tokens, out);
}

/// Several matmuls of the same input at once: `outs[i] = W_i x` for
/// `(W_i, outs[i])` in `parts`, with the row chunks of all of them spread
/// over the rayon pool in one go (one fork-join instead of one per weight,
/// which matters for the many small matrices of a decode step). Each result
/// is bitwise what [`matmul`] gives.
pub fn matmul_group(parts: &mut [(&Weight, &mut [f32])], x: &[f32], n_tokens: usize) {
    let level = simd_level();
    let jobs: Vec<Job> = parts
        .iter_mut()
        .filter_map(|(w, out)| job(level, w, x, n_tokens, out))
        .collect();
    run_jobs(&jobs);
}

/// Checks the shapes and prepares one matmul; `None` when there is nothing
/// to compute.
fn job<'a>(
    level: SimdLevel,
    w: &'a Weight,
    x: &'a [f32],
    n_tokens: usize,
    out: &mut [f32],
) -> Option<Job<'a>> {
    let (rows, cols) = (w.rows(), w.cols());
    assert_eq!(x.len(), n_tokens * cols, "matmul: x has the wrong length");
    assert_eq!(
        out.len(),
        n_tokens * rows,
        "matmul: out has the wrong length"
    );
    let checked = match w {
        Weight::Quantized(q) => q.check(),
        Weight::Mxfp4(m) => m.check(),
        Weight::Mxfp4x8(m) => m.check(),
        Weight::Affine4x8(m) => m.check(),
        Weight::Dense(_) => Ok(()),
    };
    if let Err(e) = checked {
        panic!("matmul: {e}");
    }
    if let Weight::Dense(d) = w {
        let len = match d.data {
            DenseData::Bf16(v) => v.len(),
            DenseData::F32(v) => v.len(),
        };
        assert_eq!(
            len,
            rows * cols,
            "matmul: dense weight has the wrong length"
        );
    }
    if rows == 0 || n_tokens == 0 {
        return None;
    }
    if cols == 0 {
        out.fill(0.0);
        return None;
    }
    let level = level.clamped();
    let out = OutPtr(out.as_mut_ptr());
    if thread_activations() == Activations::Q8 {
        if let Some(j) = q8::job(level, w, x, n_tokens, out) {
            return Some(j);
        }
    }
    Some(match w {
        Weight::Quantized(q) => qmatmul(level, q, x, n_tokens, out),
        Weight::Mxfp4(m) => mxfp4::mxmatmul(level, m, x, n_tokens, out),
        Weight::Mxfp4x8(m) => mxfp4::mx8matmul(level, m, x, n_tokens, out),
        Weight::Affine4x8(m) => affine8matmul(level, m, x, n_tokens, out),
        Weight::Dense(d) => dmatmul(level, d, x, n_tokens, out),
    })
}

/// Row `r` of the weight in f32 (`q * scale + bias` for affine weights,
/// `e2m1(q) * 2^(s - 127)` for MXFP4).
pub fn dequantize_row(w: &Weight, r: usize, out: &mut [f32]) {
    assert!(r < w.rows(), "dequantize_row: row {r} out of range");
    assert_eq!(
        out.len(),
        w.cols(),
        "dequantize_row: out has the wrong length"
    );
    match w {
        Weight::Quantized(q) => {
            if let Err(e) = q.check() {
                panic!("dequantize_row: {e}");
            }
            let (wpr, gpr, gs) = (q.words_per_row(), q.groups_per_row(), q.spec.group_size);
            unpack_row_generic(&q.packed[r * wpr..(r + 1) * wpr], q.spec.bits, out);
            for (g, o) in out.chunks_exact_mut(gs).enumerate() {
                let (s, b) = (q.scales.get(r * gpr + g), q.biases.get(r * gpr + g));
                for v in o {
                    *v = *v * s + b;
                }
            }
        }
        Weight::Mxfp4(m) => expect_row(m.dequantize_row(r, out)),
        Weight::Mxfp4x8(m) => expect_row(m.dequantize_row(r, out)),
        Weight::Affine4x8(m) => expect_row(m.dequantize_row(r, out)),
        Weight::Dense(d) => match d.data {
            DenseData::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[r * d.cols..(r + 1) * d.cols]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            DenseData::F32(v) => out.copy_from_slice(&v[r * d.cols..(r + 1) * d.cols]),
        },
    }
}

/// A row that could not be dequantized is a caller's error (shapes are
/// checked at load).
fn expect_row(r: Result<(), String>) {
    if let Err(e) = r {
        panic!("dequantize_row: {e}");
    }
}

// ---------------------------------------------------------------------------
// Driver

/// Output pointer shared by the row chunks (each writes disjoint elements).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// One prepared matmul: `run(r0, r1)` computes output rows `r0..r1` for
/// every token (rows of different calls are independent).
struct Job<'a> {
    rows: usize,
    /// Multiply-adds per output row (all tokens).
    work_per_row: usize,
    run: Box<dyn Fn(usize, usize) + Sync + 'a>,
}

/// Runs every job over its rows: inline when the total work is small, else
/// as row chunks (multiples of 4 rows, about `TASKS_PER_THREAD` per thread
/// over all jobs, none under `CHUNK_MIN_WORK`) on the current rayon pool.
fn run_jobs(jobs: &[Job<'_>]) {
    let threads = rayon::current_num_threads();
    let total: usize = jobs
        .iter()
        .map(|j| j.rows.saturating_mul(j.work_per_row))
        .sum();
    if threads <= 1 || total < PAR_MIN_WORK {
        for j in jobs {
            (j.run)(0, j.rows);
        }
        return;
    }
    let task_work = total
        .div_ceil(threads * TASKS_PER_THREAD)
        .max(CHUNK_MIN_WORK);
    let mut tasks = Vec::new();
    for (i, j) in jobs.iter().enumerate() {
        let chunk = task_work
            .div_ceil(j.work_per_row.max(1))
            .next_multiple_of(4)
            .min(j.rows);
        let mut r = 0;
        while r < j.rows {
            tasks.push((i, r, (r + chunk).min(j.rows)));
            r += chunk;
        }
    }
    if tasks.len() <= 1 {
        for j in jobs {
            (j.run)(0, j.rows);
        }
        return;
    }
    tasks
        .into_par_iter()
        .for_each(|(i, r0, r1)| (jobs[i].run)(r0, r1));
}

/// A packed quantized matrix as the shared kernels see it: rows of packed
/// codes in groups, each group with a scale and, for affine formats, a bias
/// (MLX affine here, MXFP4 in `mxfp4`).
trait Packed: Sync {
    /// Whether groups have biases (`dot(biases, xsum)` is added).
    const BIASED: bool;
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn group_size(&self) -> usize;
    fn groups_per_row(&self) -> usize {
        self.cols() / self.group_size()
    }
    /// The first byte of row `r`'s packed codes.
    fn row_codes(&self, r: usize) -> *const u8;
    /// Row `r`'s group scales (and biases, when `BIASED`) in f32.
    fn load_params(&self, r: usize, sc: &mut [f32], bi: &mut [f32]);
    /// Row `r`'s codes in natural order, for unpackers without a SIMD form.
    fn unpack_generic(&self, r: usize, out: &mut [f32]);
}

impl Packed for QMatrix<'_> {
    const BIASED: bool = true;
    fn rows(&self) -> usize {
        self.rows
    }
    fn cols(&self) -> usize {
        self.cols
    }
    fn group_size(&self) -> usize {
        self.spec.group_size
    }
    fn row_codes(&self, r: usize) -> *const u8 {
        self.packed[r * self.words_per_row()..].as_ptr() as *const u8
    }
    #[inline(always)]
    fn load_params(&self, r: usize, sc: &mut [f32], bi: &mut [f32]) {
        let gpr = self.groups_per_row();
        let range = r * gpr..(r + 1) * gpr;
        for (data, dst) in [(self.scales, &mut sc[..gpr]), (self.biases, &mut bi[..gpr])] {
            match data {
                ScaleData::Bf16(s) => {
                    for (d, &h) in dst.iter_mut().zip(&s[range.clone()]) {
                        *d = f32::from_bits((h as u32) << 16);
                    }
                }
                ScaleData::F32(s) => dst.copy_from_slice(&s[range.clone()]),
            }
        }
    }
    fn unpack_generic(&self, r: usize, out: &mut [f32]) {
        let wpr = self.words_per_row();
        unpack_row_generic(&self.packed[r * wpr..(r + 1) * wpr], self.spec.bits, out);
    }
}

/// Per-call state of a quantized matmul.
struct QCtx<'a, P> {
    q: &'a P,
    n: usize,
    /// Activations in the kernel's stream order, `n * cols`.
    xs: Cow<'a, [f32]>,
    /// Per token and group, the sum of the activations, `n * groups` (empty
    /// without biases).
    xsum: Vec<f32>,
}

type QChunkFn<P> = unsafe fn(&QCtx<'_, P>, usize, usize, OutPtr);

/// Prepares `out = W x` for an interleaved affine `W` with f32
/// activations: each group of eight rows put back in row order and
/// multiplied by [`qmatmul`], so the bits are the row-major ones. A
/// fallback (the interleaved form is made for the 8-bit-activation
/// product); the job's "rows" are the groups.
fn affine8matmul<'a>(
    level: SimdLevel,
    m: &'a Affine4x8Matrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    const ROWS: usize = crate::quant::interleave::ROWS;
    Job {
        rows: m.rows / ROWS,
        work_per_row: ROWS * m.cols * n,
        run: Box::new(move |g0, g1| {
            let out = out; // the whole pointer wrapper (Sync), not its field
            let gpr = m.groups_per_row();
            let mut packed = vec![0u32; ROWS * m.cols / 8];
            let (mut scales, mut biases) = (vec![0u16; ROWS * gpr], vec![0u16; ROWS * gpr]);
            let mut y = vec![0.0f32; n * ROWS];
            for g in g0..g1 {
                m.deinterleave_group(g, &mut packed, &mut scales, &mut biases);
                let rows = QMatrix {
                    rows: ROWS,
                    cols: m.cols,
                    spec: crate::config::QuantSpec::affine(4, m.group_size),
                    packed: &packed,
                    scales: ScaleData::Bf16(&scales),
                    biases: ScaleData::Bf16(&biases),
                };
                (qmatmul(level, &rows, x, n, OutPtr(y.as_mut_ptr())).run)(0, ROWS);
                // SAFETY: `job` checked that `out` holds n * rows floats.
                unsafe { scatter_group(&y, n, m.rows, g, out) };
            }
        }),
    }
}

/// Writes row group `g`'s outputs `y` (`[n, 8]`) into `out` (`[n, rows]`)
/// for the kernels of interleaved matrices.
///
/// # Safety
/// `out` holds `n * rows` floats.
unsafe fn scatter_group(y: &[f32], n: usize, rows: usize, g: usize, out: OutPtr) {
    const ROWS: usize = crate::quant::interleave::ROWS;
    for t in 0..n {
        for i in 0..ROWS {
            *out.0.add(t * rows + ROWS * g + i) = y[t * ROWS + i];
        }
    }
}

fn qmatmul<'a>(
    level: SimdLevel,
    q: &'a QMatrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    let (bits, gs) = (q.spec.bits, q.spec.group_size);
    type Q<'b> = QMatrix<'b>;
    if gs < 32 {
        // Groups narrower than the unpackers' 32-code blocks (GGUF's
        // K-quants at group 16): rows unpacked in natural order into a
        // buffer by the 32-code unpackers, tiles of one group per block
        // (the module docs' loop unchanged).
        #[cfg(target_arch = "x86_64")]
        type R512<const B: usize> = Rowwise<A512Gen<B>, 2>;
        #[cfg(target_arch = "x86_64")]
        type R2<const B: usize> = Rowwise<A2Gen<B>, 4>;
        return match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => match bits {
                2 => q_run::<Avx512, R512<2>, 1, _>(q, x, n, out, q_chunk_avx512::<Q, R512<2>, 1>),
                3 => q_run::<Avx512, R512<3>, 1, _>(q, x, n, out, q_chunk_avx512::<Q, R512<3>, 1>),
                4 => q_run::<Avx512, R512<4>, 1, _>(q, x, n, out, q_chunk_avx512::<Q, R512<4>, 1>),
                5 => q_run::<Avx512, R512<5>, 1, _>(q, x, n, out, q_chunk_avx512::<Q, R512<5>, 1>),
                6 => q_run::<Avx512, R512<6>, 1, _>(q, x, n, out, q_chunk_avx512::<Q, R512<6>, 1>),
                8 => q_run::<Avx512, R512<8>, 1, _>(q, x, n, out, q_chunk_avx512::<Q, R512<8>, 1>),
                _ => q_run::<Avx512, Generic, 1, _>(q, x, n, out, q_chunk_avx512::<Q, Generic, 1>),
            },
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => match bits {
                2 => q_run::<Avx2, R2<2>, 2, _>(q, x, n, out, q_chunk_avx2::<Q, R2<2>, 2>),
                3 => q_run::<Avx2, R2<3>, 2, _>(q, x, n, out, q_chunk_avx2::<Q, R2<3>, 2>),
                4 => q_run::<Avx2, R2<4>, 2, _>(q, x, n, out, q_chunk_avx2::<Q, R2<4>, 2>),
                5 => q_run::<Avx2, R2<5>, 2, _>(q, x, n, out, q_chunk_avx2::<Q, R2<5>, 2>),
                6 => q_run::<Avx2, R2<6>, 2, _>(q, x, n, out, q_chunk_avx2::<Q, R2<6>, 2>),
                8 => q_run::<Avx2, R2<8>, 2, _>(q, x, n, out, q_chunk_avx2::<Q, R2<8>, 2>),
                _ => q_run::<Avx2, Generic, 2, _>(q, x, n, out, q_chunk_avx2::<Q, Generic, 2>),
            },
            _ => q_run::<Scalar, Generic, 2, _>(q, x, n, out, q_chunk_scalar::<Q, Generic, 2>),
        };
    }
    match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => match bits {
            8 => q_run::<Avx512, A512U8, 2, _>(q, x, n, out, q_chunk_avx512::<Q, A512U8, 2>),
            4 => q_run::<Avx512, A512U4, 2, _>(q, x, n, out, q_chunk_avx512::<Q, A512U4, 2>),
            2 if gs == 32 => {
                q_run::<Avx512, A512U2x32, 2, _>(q, x, n, out, q_chunk_avx512::<Q, A512U2x32, 2>)
            }
            2 => q_run::<Avx512, A512U2x64, 4, _>(q, x, n, out, q_chunk_avx512::<Q, A512U2x64, 4>),
            3 => {
                q_run::<Avx512, A512Gen<3>, 2, _>(q, x, n, out, q_chunk_avx512::<Q, A512Gen<3>, 2>)
            }
            5 => {
                q_run::<Avx512, A512Gen<5>, 2, _>(q, x, n, out, q_chunk_avx512::<Q, A512Gen<5>, 2>)
            }
            6 => {
                q_run::<Avx512, A512Gen<6>, 2, _>(q, x, n, out, q_chunk_avx512::<Q, A512Gen<6>, 2>)
            }
            _ => q_run::<Avx512, Generic, 2, _>(q, x, n, out, q_chunk_avx512::<Q, Generic, 2>),
        },
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => match bits {
            8 => q_run::<Avx2, A2U8, 4, _>(q, x, n, out, q_chunk_avx2::<Q, A2U8, 4>),
            4 => q_run::<Avx2, A2U4, 4, _>(q, x, n, out, q_chunk_avx2::<Q, A2U4, 4>),
            2 => q_run::<Avx2, A2U2, 4, _>(q, x, n, out, q_chunk_avx2::<Q, A2U2, 4>),
            3 => q_run::<Avx2, A2Gen<3>, 4, _>(q, x, n, out, q_chunk_avx2::<Q, A2Gen<3>, 4>),
            5 => q_run::<Avx2, A2Gen<5>, 4, _>(q, x, n, out, q_chunk_avx2::<Q, A2Gen<5>, 4>),
            6 => q_run::<Avx2, A2Gen<6>, 4, _>(q, x, n, out, q_chunk_avx2::<Q, A2Gen<6>, 4>),
            _ => q_run::<Avx2, Generic, 4, _>(q, x, n, out, q_chunk_avx2::<Q, Generic, 4>),
        },
        _ => q_run::<Scalar, Generic, 4, _>(q, x, n, out, q_chunk_scalar::<Q, Generic, 4>),
    }
}

/// Sum of a group of activations: 8 interleaved partial sums, then a fixed tree.
fn group_sum(x: &[f32]) -> f32 {
    let mut p = [0.0f32; 8];
    let mut it = x.chunks_exact(8);
    for c in &mut it {
        for i in 0..8 {
            p[i] += c[i];
        }
    }
    for (i, &v) in it.remainder().iter().enumerate() {
        p[i] += v;
    }
    tree8(&p)
}

/// The fixed sum of eight partial sums that the scalar reductions share.
#[inline(always)]
fn tree8(p: &[f32; 8]) -> f32 {
    ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
}

/// Prepares a quantized matmul: the activations permuted into stream order
/// (and their group sums for biased formats), and the chunk kernel.
fn q_run<'a, S: Isa, U: Unpack<S, NV>, const NV: usize, P: Packed>(
    q: &'a P,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
    chunk: QChunkFn<P>,
) -> Job<'a> {
    let gs = q.group_size();
    let bw = NV * S::LANES;
    assert_eq!(gs % bw, 0, "group size {gs} not a multiple of the block");
    let xs = if U::IDENTITY {
        Cow::Borrowed(x)
    } else {
        let perm: Vec<usize> = (0..bw).map(U::perm).collect();
        let mut v = vec![0.0f32; x.len()];
        for (d, s) in v.chunks_exact_mut(bw).zip(x.chunks_exact(bw)) {
            for (o, &p) in d.iter_mut().zip(&perm) {
                *o = s[p];
            }
        }
        Cow::Owned(v)
    };
    let xsum: Vec<f32> = if P::BIASED {
        x.chunks_exact(gs).map(group_sum).collect()
    } else {
        Vec::new()
    };
    let ctx = QCtx { q, n, xs, xsum };
    Job {
        rows: q.rows(),
        work_per_row: q.cols() * n,
        // SAFETY: `chunk` matches the CPU (the level was clamped) and writes
        // only rows r0..r1 of `out`, which `job` checked to hold them all.
        run: Box::new(move |r0, r1| unsafe { chunk(&ctx, r0, r1, out) }),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn q_chunk_avx512<P: Packed, U: Unpack<Avx512, NV>, const NV: usize>(
    ctx: &QCtx<'_, P>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    q_chunk_any::<Avx512, P, U, NV, 4, 2, 4>(ctx, r0, r1, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn q_chunk_avx2<P: Packed, U: Unpack<Avx2, NV>, const NV: usize>(
    ctx: &QCtx<'_, P>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    q_chunk_any::<Avx2, P, U, NV, 4, 2, 4>(ctx, r0, r1, out)
}

unsafe fn q_chunk_scalar<P: Packed, U: Unpack<Scalar, NV>, const NV: usize>(
    ctx: &QCtx<'_, P>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    q_chunk_any::<Scalar, P, U, NV, 4, 2, 2>(ctx, r0, r1, out)
}

// ---------------------------------------------------------------------------
// Code sources and the tile kernel

/// Gives block `b` (of `NV` vectors) of tile row `r`.
trait Src<S: Isa, const NV: usize> {
    unsafe fn block(&self, r: usize, b: usize) -> [S::V; NV];
}

/// Codes unpacked from packed rows in registers.
struct Fused<U, const R: usize> {
    p: [*const u8; R],
    /// Prefetch distance in bytes.
    pf: usize,
    _u: PhantomData<U>,
}

impl<S: Isa, U: Unpack<S, NV>, const NV: usize, const R: usize> Src<S, NV> for Fused<U, R> {
    #[inline(always)]
    unsafe fn block(&self, r: usize, b: usize) -> [S::V; NV] {
        let p = self.p[r].add(b * U::BYTES);
        S::prefetch(p.wrapping_add(self.pf));
        U::unpack(p)
    }
}

/// Codes (or dense f32 weights) already in f32, in stream order.
struct Buf<const R: usize> {
    p: [*const f32; R],
}

impl<S: Isa, const NV: usize, const R: usize> Src<S, NV> for Buf<R> {
    #[inline(always)]
    unsafe fn block(&self, r: usize, b: usize) -> [S::V; NV] {
        let p = self.p[r].add(b * NV * S::LANES);
        // (Loops rather than closures in hot code: a closure is compiled
        // without the caller's target features and may not be inlined.)
        let mut c = [S::zero(); NV];
        for (v, cv) in c.iter_mut().enumerate() {
            *cv = S::load(p.add(v * S::LANES));
        }
        c
    }
}

/// Dense bf16 rows.
struct Bf16Rows<const R: usize> {
    p: [*const u16; R],
}

impl<S: Isa, const R: usize> Src<S, 1> for Bf16Rows<R> {
    #[inline(always)]
    unsafe fn block(&self, r: usize, b: usize) -> [S::V; 1] {
        [S::load_bf16(self.p[r].add(b * S::LANES))]
    }
}

/// The `R` rows x `T` tokens tile: returns the lane accumulators `y[r][t]`
/// of the loop in the module docs (`groups` groups of `bpg` blocks; `BPG`,
/// when not 0, is `bpg` known at compile time).
// Register tiles index several arrays by the same row/token/lane counters.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn qtile<
    S: Isa,
    C: Src<S, NV>,
    const NV: usize,
    const R: usize,
    const T: usize,
    const BPG: usize,
>(
    src: &C,
    scales: [*const f32; R],
    xs: [*const f32; T],
    groups: usize,
    bpg: usize,
) -> [[S::V; T]; R] {
    // A compile-time group length unrolls the group loop.
    let bpg = if BPG == 0 { bpg } else { BPG };
    let bw = NV * S::LANES;
    let mut y = [[S::zero(); T]; R];
    let mut b = 0;
    for g in 0..groups {
        let mut acc = [[S::zero(); T]; R];
        for _ in 0..bpg {
            let mut c = [[S::zero(); NV]; R];
            for (r, cr) in c.iter_mut().enumerate() {
                *cr = src.block(r, b);
            }
            for v in 0..NV {
                let mut xv = [S::zero(); T];
                for (t, xt) in xv.iter_mut().enumerate() {
                    *xt = S::load(xs[t].add(b * bw + v * S::LANES));
                }
                for r in 0..R {
                    for t in 0..T {
                        acc[r][t] = S::fma(c[r][v], xv[t], acc[r][t]);
                    }
                }
            }
            b += 1;
        }
        for r in 0..R {
            let s = S::splat(*scales[r].add(g));
            for t in 0..T {
                y[r][t] = S::fma(s, acc[r][t], y[r][t]);
            }
        }
    }
    y
}

// ---------------------------------------------------------------------------
// Quantized chunks

/// Unpacks row `r`'s codes to f32 in stream order.
#[inline(always)]
unsafe fn unpack_row<S: Isa, P: Packed, U: Unpack<S, NV>, const NV: usize>(
    q: &P,
    r: usize,
    out: &mut [f32],
) {
    if U::FUSED {
        let bw = NV * S::LANES;
        let p = q.row_codes(r);
        let o = out.as_mut_ptr();
        for b in 0..q.cols() / bw {
            let v = U::unpack(p.add(b * U::BYTES));
            for (j, &vj) in v.iter().enumerate() {
                S::store(o.add(b * bw + j * S::LANES), vj);
            }
        }
    } else if !U::unpack_row_natural(q.row_codes(r), q.cols(), out.as_mut_ptr()) {
        q.unpack_generic(r, out);
    }
}

/// Writes `hsum(y)` (plus `dot(biases, xsum)` for biased formats) for a tile.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn q_finish<S: Isa, P: Packed, const R: usize, const T: usize>(
    ctx: &QCtx<'_, P>,
    y: [[S::V; T]; R],
    biases: [*const f32; R],
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    let (rows, gpr) = (ctx.q.rows(), ctx.q.groups_per_row());
    for r in 0..R {
        for t in 0..T {
            let mut v = S::hsum(y[r][t]);
            if P::BIASED {
                let xsum = ctx.xsum.as_ptr().add((t0 + t) * gpr);
                v += S::dot(biases[r], xsum, gpr);
            }
            *out.0.add((t0 + t) * rows + r0 + r) = v;
        }
    }
}

/// Dispatches on the number of blocks per group.
#[inline(always)]
unsafe fn q_chunk_any<
    S: Isa,
    P: Packed,
    U: Unpack<S, NV>,
    const NV: usize,
    const RF: usize,
    const RB: usize,
    const TB: usize,
>(
    ctx: &QCtx<'_, P>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    match ctx.q.group_size() / (NV * S::LANES) {
        1 => q_chunk::<S, P, U, NV, RF, RB, TB, 1>(ctx, r0, r1, out),
        2 => q_chunk::<S, P, U, NV, RF, RB, TB, 2>(ctx, r0, r1, out),
        4 => q_chunk::<S, P, U, NV, RF, RB, TB, 4>(ctx, r0, r1, out),
        _ => q_chunk::<S, P, U, NV, RF, RB, TB, 0>(ctx, r0, r1, out),
    }
}

/// Few tokens: `RF` rows at a time, codes unpacked in registers per token
/// pass. More: blocks of rows unpacked once into a buffer, then `RB` x `TB`
/// tiles, token tiles outermost.
#[inline(always)]
unsafe fn q_chunk<
    S: Isa,
    P: Packed,
    U: Unpack<S, NV>,
    const NV: usize,
    const RF: usize,
    const RB: usize,
    const TB: usize,
    const BPG: usize,
>(
    ctx: &QCtx<'_, P>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    let q = ctx.q;
    let (cols, gpr) = (q.cols(), q.groups_per_row());
    let bpg = q.group_size() / (NV * S::LANES);
    if ctx.n < BATCH_MIN_TOKENS {
        let mut sc = vec![0.0f32; RF * gpr];
        let mut bi = vec![0.0f32; RF * gpr];
        let mut buf = vec![0.0f32; if U::FUSED { 0 } else { RF * cols }];
        let mut r = r0;
        while r + RF <= r1 {
            q_rows_direct::<S, P, U, NV, RF, BPG>(ctx, r, bpg, &mut sc, &mut bi, &mut buf, out);
            r += RF;
        }
        while r < r1 {
            q_rows_direct::<S, P, U, NV, 1, BPG>(ctx, r, bpg, &mut sc, &mut bi, &mut buf, out);
            r += 1;
        }
    } else {
        let sub = (BUF_FLOATS / cols / RB * RB).max(RB).min(r1 - r0);
        let mut buf = vec![0.0f32; sub * cols];
        let mut sc = vec![0.0f32; sub * gpr];
        let mut bi = vec![0.0f32; sub * gpr];
        let mut a = r0;
        while a < r1 {
            let m = sub.min(r1 - a);
            for i in 0..m {
                unpack_row::<S, P, U, NV>(q, a + i, &mut buf[i * cols..(i + 1) * cols]);
                q.load_params(a + i, &mut sc[i * gpr..], &mut bi[i * gpr..]);
            }
            let blk = QBlock {
                a,
                m,
                bpg,
                buf: &buf,
                sc: &sc,
                bi: &bi,
            };
            let mut t = 0;
            while t + TB <= ctx.n {
                q_buf_rows::<S, P, NV, RB, TB, BPG>(ctx, &blk, t, out);
                t += TB;
            }
            while t < ctx.n {
                q_buf_rows::<S, P, NV, RB, 1, BPG>(ctx, &blk, t, out);
                t += 1;
            }
            a += m;
        }
    }
}

/// `R` rows for every token (few tokens): codes unpacked per token pass.
#[inline(always)]
unsafe fn q_rows_direct<
    S: Isa,
    P: Packed,
    U: Unpack<S, NV>,
    const NV: usize,
    const R: usize,
    const BPG: usize,
>(
    ctx: &QCtx<'_, P>,
    r: usize,
    bpg: usize,
    sc: &mut [f32],
    bi: &mut [f32],
    buf: &mut [f32],
    out: OutPtr,
) {
    let q = ctx.q;
    let (cols, gpr) = (q.cols(), q.groups_per_row());
    for k in 0..R {
        q.load_params(r + k, &mut sc[k * gpr..], &mut bi[k * gpr..]);
    }
    let scales: [*const f32; R] = std::array::from_fn(|k| sc.as_ptr().add(k * gpr));
    let biases: [*const f32; R] = std::array::from_fn(|k| bi.as_ptr().add(k * gpr));
    if U::FUSED {
        let src = Fused::<U, R> {
            p: std::array::from_fn(|k| q.row_codes(r + k)),
            pf: PREFETCH_BYTES,
            _u: PhantomData,
        };
        for t in 0..ctx.n {
            let xs = [ctx.xs.as_ptr().add(t * cols)];
            let y = qtile::<S, _, NV, R, 1, BPG>(&src, scales, xs, gpr, bpg);
            q_finish::<S, P, R, 1>(ctx, y, biases, r, t, out);
        }
    } else {
        for k in 0..R {
            unpack_row::<S, P, U, NV>(q, r + k, &mut buf[k * cols..(k + 1) * cols]);
        }
        let src = Buf::<R> {
            p: std::array::from_fn(|k| buf.as_ptr().add(k * cols)),
        };
        for t in 0..ctx.n {
            let xs = [ctx.xs.as_ptr().add(t * cols)];
            let y = qtile::<S, _, NV, R, 1, BPG>(&src, scales, xs, gpr, bpg);
            q_finish::<S, P, R, 1>(ctx, y, biases, r, t, out);
        }
    }
}

/// A block of rows unpacked into a buffer.
struct QBlock<'a> {
    /// First row.
    a: usize,
    /// Number of rows.
    m: usize,
    bpg: usize,
    buf: &'a [f32],
    sc: &'a [f32],
    bi: &'a [f32],
}

/// Tokens `t0..t0+T` for every row of the block, `R` rows at a time.
#[inline(always)]
unsafe fn q_buf_rows<
    S: Isa,
    P: Packed,
    const NV: usize,
    const R: usize,
    const T: usize,
    const BPG: usize,
>(
    ctx: &QCtx<'_, P>,
    blk: &QBlock<'_>,
    t0: usize,
    out: OutPtr,
) {
    let mut i = 0;
    while i + R <= blk.m {
        q_buf_tile::<S, P, NV, R, T, BPG>(ctx, blk, i, t0, out);
        i += R;
    }
    while i < blk.m {
        q_buf_tile::<S, P, NV, 1, T, BPG>(ctx, blk, i, t0, out);
        i += 1;
    }
}

#[inline(always)]
unsafe fn q_buf_tile<
    S: Isa,
    P: Packed,
    const NV: usize,
    const R: usize,
    const T: usize,
    const BPG: usize,
>(
    ctx: &QCtx<'_, P>,
    blk: &QBlock<'_>,
    i: usize,
    t0: usize,
    out: OutPtr,
) {
    let (cols, gpr) = (ctx.q.cols(), ctx.q.groups_per_row());
    let src = Buf::<R> {
        p: std::array::from_fn(|k| blk.buf.as_ptr().add((i + k) * cols)),
    };
    let scales: [*const f32; R] = std::array::from_fn(|k| blk.sc.as_ptr().add((i + k) * gpr));
    let biases: [*const f32; R] = std::array::from_fn(|k| blk.bi.as_ptr().add((i + k) * gpr));
    let xs: [*const f32; T] = std::array::from_fn(|t| ctx.xs.as_ptr().add((t0 + t) * cols));
    let y = qtile::<S, _, NV, R, T, BPG>(&src, scales, xs, gpr, blk.bpg);
    q_finish::<S, P, R, T>(ctx, y, biases, blk.a + i, t0, out);
}

// ---------------------------------------------------------------------------
// Dense

/// Per-call state of a dense matmul.
struct DCtx<'a> {
    d: &'a DenseMatrix<'a>,
    n: usize,
    x: &'a [f32],
}

type DChunkFn = unsafe fn(&DCtx<'_>, usize, usize, OutPtr);

fn dmatmul<'a>(
    level: SimdLevel,
    d: &'a DenseMatrix<'a>,
    x: &'a [f32],
    n: usize,
    out: OutPtr,
) -> Job<'a> {
    let chunk: DChunkFn = match level {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => d_chunk_avx512,
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => d_chunk_avx2,
        _ => d_chunk_scalar,
    };
    let ctx = DCtx { d, n, x };
    Job {
        rows: d.rows,
        work_per_row: d.cols * n,
        // SAFETY: as in `q_run`.
        run: Box::new(move |r0, r1| unsafe { chunk(&ctx, r0, r1, out) }),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn d_chunk_avx512(ctx: &DCtx<'_>, r0: usize, r1: usize, out: OutPtr) {
    d_chunk::<Avx512, 4, 2, 4>(ctx, r0, r1, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn d_chunk_avx2(ctx: &DCtx<'_>, r0: usize, r1: usize, out: OutPtr) {
    d_chunk::<Avx2, 4, 2, 2>(ctx, r0, r1, out)
}

unsafe fn d_chunk_scalar(ctx: &DCtx<'_>, r0: usize, r1: usize, out: OutPtr) {
    d_chunk::<Scalar, 4, 2, 2>(ctx, r0, r1, out)
}

/// Dense row storage, for the tail columns and building sources.
trait DenseElem: Copy {
    fn to_f32(self) -> f32;
}
impl DenseElem for u16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}
impl DenseElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

/// Builds the source for `R` rows of dense storage `E`.
trait DenseSrc<S: Isa, E, const R: usize>: Src<S, 1> {
    fn new(p: [*const E; R]) -> Self;
}
impl<S: Isa, const R: usize> DenseSrc<S, u16, R> for Bf16Rows<R> {
    #[inline(always)]
    fn new(p: [*const u16; R]) -> Self {
        Bf16Rows { p }
    }
}
impl<S: Isa, const R: usize> DenseSrc<S, f32, R> for Buf<R> {
    #[inline(always)]
    fn new(p: [*const f32; R]) -> Self {
        Buf { p }
    }
}

#[inline(always)]
unsafe fn d_chunk<S: Isa, const RF: usize, const RB: usize, const TB: usize>(
    ctx: &DCtx<'_>,
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    match ctx.d.data {
        DenseData::Bf16(v) => {
            d_chunk_typed::<S, u16, Bf16Rows<RF>, Bf16Rows<RB>, Bf16Rows<1>, RF, RB, TB>(
                ctx, v, r0, r1, out,
            )
        }
        DenseData::F32(v) => {
            d_chunk_typed::<S, f32, Buf<RF>, Buf<RB>, Buf<1>, RF, RB, TB>(ctx, v, r0, r1, out)
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn d_chunk_typed<
    S: Isa,
    E: DenseElem,
    CF: DenseSrc<S, E, RF>,
    CB: DenseSrc<S, E, RB>,
    C1: DenseSrc<S, E, 1>,
    const RF: usize,
    const RB: usize,
    const TB: usize,
>(
    ctx: &DCtx<'_>,
    data: &[E],
    r0: usize,
    r1: usize,
    out: OutPtr,
) {
    let cols = ctx.d.cols;
    if ctx.n < BATCH_MIN_TOKENS {
        let mut r = r0;
        while r + RF <= r1 {
            for t in 0..ctx.n {
                d_tile::<S, E, CF, RF, 1>(ctx, data, r, t, out);
            }
            r += RF;
        }
        while r < r1 {
            for t in 0..ctx.n {
                d_tile::<S, E, C1, 1, 1>(ctx, data, r, t, out);
            }
            r += 1;
        }
    } else {
        // Row blocks of about BUF_FLOATS weights, token tiles outermost.
        let sub = (BUF_FLOATS / cols / RB * RB).max(RB);
        let mut a = r0;
        while a < r1 {
            let e = (a + sub).min(r1);
            let mut t = 0;
            while t < ctx.n {
                let full = t + TB <= ctx.n;
                let mut r = a;
                while r + RB <= e {
                    if full {
                        d_tile::<S, E, CB, RB, TB>(ctx, data, r, t, out);
                    } else {
                        for u in t..ctx.n {
                            d_tile::<S, E, CB, RB, 1>(ctx, data, r, u, out);
                        }
                    }
                    r += RB;
                }
                while r < e {
                    if full {
                        d_tile::<S, E, C1, 1, TB>(ctx, data, r, t, out);
                    } else {
                        for u in t..ctx.n {
                            d_tile::<S, E, C1, 1, 1>(ctx, data, r, u, out);
                        }
                    }
                    r += 1;
                }
                t = if full { t + TB } else { ctx.n };
            }
            a = e;
        }
    }
}

#[inline(always)]
unsafe fn d_tile<S: Isa, E: DenseElem, C: DenseSrc<S, E, R>, const R: usize, const T: usize>(
    ctx: &DCtx<'_>,
    data: &[E],
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    let (rows, cols) = (ctx.d.rows, ctx.d.cols);
    let rp: [*const E; R] = std::array::from_fn(|k| data.as_ptr().add((r0 + k) * cols));
    let xs: [*const f32; T] = std::array::from_fn(|t| ctx.x.as_ptr().add((t0 + t) * cols));
    let one = 1.0f32;
    let full = cols / S::LANES;
    let y = qtile::<S, C, 1, R, T, 0>(&C::new(rp), [&one as *const f32; R], xs, 1, full);
    for r in 0..R {
        for t in 0..T {
            let mut s = S::hsum(y[r][t]);
            for j in full * S::LANES..cols {
                s += (*rp[r].add(j)).to_f32() * *xs[t].add(j);
            }
            *out.0.add((t0 + t) * rows + r0 + r) = s;
        }
    }
}

#[cfg(test)]
mod tests;
