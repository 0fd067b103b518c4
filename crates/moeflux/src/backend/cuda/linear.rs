//! Linear layers on the device and the launches of their products: the
//! quantized matrix descriptor the kernels take, grouped products of one
//! input (up to four matrices per launch, residual adds fused), the
//! activation-stationary one-token kernels' geometry, and per-head products
//! (MLA's absorptions), plus the row-wise RMSNorm and SwiGLU every layer
//! stack uses.

use crate::error::Result;
use crate::model::weights::{DType, LinearRef};

use super::abi::{MultiMatmul, Qw};
use super::device::{args, Gpu};

/// A linear layer on the device.
#[derive(Clone, Copy, Debug)]
pub(super) enum DevLinear {
    Quant(Qw),
    Dense {
        w: u64,
        f32: i32,
        rows: i32,
        cols: i32,
    },
}

impl DevLinear {
    pub fn rows(&self) -> usize {
        match self {
            DevLinear::Quant(q) => q.rows as usize,
            DevLinear::Dense { rows, .. } => *rows as usize,
        }
    }
}

/// `l` inside the dense file uploaded at device address `base`.
pub(super) fn dev_linear(base: u64, l: &LinearRef) -> DevLinear {
    let at = |loc: &crate::model::weights::TensorLoc| base + loc.offset as u64;
    match l.quant {
        Some((spec, s, b)) => DevLinear::Quant(Qw {
            w: at(&l.weight),
            s: at(&s),
            b: at(&b),
            rows: l.rows as i32,
            cols: l.cols as i32,
            bits: spec.bits as i32,
            gs: spec.group_size as i32,
            sf32: (s.dtype == DType::F32) as i32,
        }),
        None => DevLinear::Dense {
            w: at(&l.weight),
            f32: (l.weight.dtype == DType::F32) as i32,
            rows: l.rows as i32,
            cols: l.cols as i32,
        },
    }
}

/// Suffix of the kernels specialised for a code width (`bx`: any width).
pub(super) fn kernel_suffix(bits: i32) -> &'static str {
    match bits {
        4 => "b4",
        8 => "b8",
        2 => "b2",
        _ => "bx",
    }
}

/// Output rows per block of the quantized product kernels for rows of
/// `cols` codes of `bits` bits: 8 warps in groups of 4 rows; for one token
/// the warps of a group split the row (`col_split` in kernels/qmatmul.cu).
pub(super) fn rows_per_block(cols: usize, bits: usize, one_token: bool) -> usize {
    let units = cols * bits / 128;
    let split = match units {
        _ if !one_token => 1,
        256.. => 8,
        128.. => 4,
        64.. => 2,
        _ => 1,
    };
    4 * 8 / split
}

/// Rows of one warp in the quantized product kernels (`RW` in kernels/quant.cuh).
pub(super) const ROWS_PER_WARP: usize = 4;

/// Chunks of a warp in the activation-stationary one-token kernels that
/// take one block's rows (`QMV_NC` in kernels/qmv.cu: `qmv_b48`, the MLA
/// per-head products).
pub(super) const QMV_CHUNKS: usize = 8;

/// Chunks of a warp per set in the streaming one-token kernels of one code
/// width (`QMV_STREAM_NC` in kernels/qmv.cu: `qmv_b2`/`b4`/`b8`), which hold
/// the next set's chunks while they compute the current one's.
pub(super) const QMV_STREAM_CHUNKS: usize = 4;

/// Blocks per SM of the streaming kernels with [`QMV_STREAM_CHUNKS`]
/// chunks: two fit the registers, and on the H100 two beat one, three,
/// four and eight (LM head 181 µs against 184-264; `scripts/gpu/kbench`).
const QMV_STREAM_BLOCKS_PER_SM: u32 = 2;
/// The same with two chunks (half the registers). Launches that small
/// rarely have more sets than this allows.
const QMV_NC2_BLOCKS_PER_SM: u32 = 4;

/// Launches of the one-token kernels whose matrices add up to at most this
/// many bytes of codes use two chunks per warp (`qmv_b*_nc2`): on the H100
/// a 0.6 MB product takes 3.8-4.2 µs that way against 4.3-4.6 µs with
/// four, while from 4.7 MB up four are faster (8.0 vs 8.6 µs;
/// `scripts/gpu/kbench`).
const QMV_SMALL_BYTES: usize = 2 << 20;

/// Slices of a row of `rb` >= 512 bytes in the activation-stationary
/// one-token kernels and the warps of a block that share them (`qmv_geom`
/// in kernels/qmv.cu): 512-byte slices, shared by a power of two of warps,
/// when 512 divides the row; else `ceil(rb / 512)` even slices of 16-byte
/// units, one warp each up to eight.
pub(super) fn qmv_slices(rb: usize) -> (usize, usize) {
    let slices = rb.div_ceil(512);
    let parts = if rb.is_multiple_of(512) {
        1 << slices.min(8).ilog2()
    } else {
        slices.min(8)
    };
    (slices, parts)
}

/// Threads per block of the activation-stationary kernels for rows of
/// `cols` codes of `bits` bits: 8 warps, less those a row group of an
/// uneven split leaves idle (3 slices: 6 warps).
pub(super) fn qmv_threads(cols: usize, bits: usize) -> u32 {
    let rb = cols * bits / 8;
    let parts = if rb >= 512 { qmv_slices(rb).1 } else { 1 };
    (32 * (8 / parts) * parts) as u32
}

/// Output rows per block of the activation-stationary one-token kernels
/// (`qmv_geom` in kernels/qmv.cu) for rows of `cols` codes of `bits` bits and
/// `chunks` chunks per warp, or `None` when the matrix does not fit their
/// layout: 2/4/8-bit codes, a 16-byte lane chunk inside one quantization
/// group, rows of at least 512 bytes in whole 16-byte units or a power of
/// two of bytes below.
pub(super) fn qmv_rows_per_block(
    cols: usize,
    bits: usize,
    gs: usize,
    chunks: usize,
) -> Option<usize> {
    if !matches!(bits, 2 | 4 | 8)
        || !gs.is_multiple_of(128 / bits)
        || !(cols * bits).is_multiple_of(8)
    {
        return None;
    }
    let rb = cols * bits / 8;
    if rb >= 512 {
        if !rb.is_multiple_of(16) {
            return None;
        }
        let (_, parts) = qmv_slices(rb);
        Some(8 / parts * chunks)
    } else if rb >= 16 && rb.is_power_of_two() {
        Some(8 * chunks * (512 / rb))
    } else {
        None
    }
}

/// The activation-stationary one-token product kernel for matrices of
/// `bits` bits (`None`: 4- and 8-bit ones together), `chunks` per warp (2,
/// else the kernel's own) and the input `act`; `q8`: its 4-bit matrices
/// take 8-bit activations (the `b4q8` kernels; other widths have none).
fn qmv_kernel(bits: Option<i32>, chunks: usize, act: Input, q8: bool) -> String {
    let nc = if chunks == 2 { "_nc2" } else { "" };
    let glu = if act == Input::Glu { "_glu" } else { "" };
    let width = match bits {
        None if q8 => "b48q8",
        None => "b48",
        Some(4) if q8 => "b4q8",
        Some(b) => kernel_suffix(b),
    };
    format!("qmv_{width}{nc}{glu}")
}

/// Whether product `o` of matrix `q` may share a launch of the one- and
/// few-token kernels that take 8-bit activations for 4-bit matrices
/// (`--gpu-activations q8`): every product but the 4-bit ones that keep
/// exact activations (routers); other widths are dotted in f32 either way.
fn in_q8_launch(gpu: &Gpu, q: &Qw, o: &Mm) -> bool {
    gpu.q8 && !(q.bits == 4 && o.exact)
}

/// Which one-token products may share a launch: 4- and 8-bit matrices
/// (`qmv_b48` picks the width per block), 2-bit ones apart (their longer
/// runs of codes per lane need more registers).
fn qmv_class(bits: i32) -> i32 {
    if bits == 2 {
        2
    } else {
        48
    }
}

/// What a product's input buffer holds.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Input {
    /// The activations.
    Plain,
    /// One token's [gate | up] (each as wide as the matrix's rows are
    /// long); the product's input is silu(gate) * up.
    Glu,
}

/// Rows one warp of the activation-stationary kernels covers (its chunks
/// times the rows per 512-byte chunk) for rows of `cols` codes of `bits`
/// bits; [`qmv_rows_per_block`] must have accepted the layout.
fn qmv_warp_rows(cols: usize, bits: usize) -> usize {
    let rb = cols * bits / 8;
    QMV_CHUNKS * if rb >= 512 { 1 } else { 512 / rb }
}

/// Rows per block of the activation-stationary kernels with
/// [`QMV_CHUNKS`] chunks for `q`, when it fits them (see
/// [`qmv_rows_per_block`]; the codes must also be 16-byte aligned).
fn qmv_fit(q: &Qw) -> Option<usize> {
    if !q.w.is_multiple_of(16) {
        return None;
    }
    qmv_rows_per_block(q.cols as usize, q.bits as usize, q.gs as usize, QMV_CHUNKS)
}

/// Tokens per block row of the few-token activation-stationary kernels
/// (`QMV_TOKENS` in kernels/qmv.cu: `qmv_b4_t4`, `qmv_b8_t4`).
const QMV_TOKENS: usize = 4;

/// Whether the few-token kernels take `q`: the one-token kernels' layout
/// in its streaming form (a warp for every slice of a row), 4- or 8-bit
/// codes (2-bit ones would need twice the registers).
fn qmv_multi_fit(q: &Qw) -> bool {
    let rb = q.cols as usize * q.bits as usize / 8;
    matches!(q.bits, 4 | 8)
        && qmv_fit(q).is_some()
        && (rb < 512 || {
            let (slices, parts) = qmv_slices(rb);
            slices == parts
        })
}

/// Products of a few tokens (2 to [`MMA_MIN_TOKENS`] - 1: the decode steps
/// of several sequences) with the one-token kernels' arithmetic: each
/// token's activations stay in registers while the weights stream past, so
/// the weights are read once per [`QMV_TOKENS`] tokens and every token's
/// result is bitwise what it would be alone. Matrices of one width, four
/// to a launch; [`qmv_multi_fit`] must hold for each.
fn qmv_multi_products(gpu: &Gpu, ops: &[Mm], x: u64, n: usize) -> Result<()> {
    const CHUNKS: usize = 2; // the kernels' chunks per warp and set
    let nn = n as i32;
    for (bits, q8) in [(4, false), (4, true), (8, false)] {
        let same: Vec<(Qw, &Mm)> = ops
            .iter()
            .filter_map(|o| match o.w {
                DevLinear::Quant(q)
                    if q.bits == bits && (bits != 4 || in_q8_launch(gpu, &q, o) == q8) =>
                {
                    Some((q, o))
                }
                _ => None,
            })
            .collect();
        for group in same.chunks(4) {
            let rows_per_block = |q: &Qw| {
                qmv_rows_per_block(q.cols as usize, q.bits as usize, q.gs as usize, CHUNKS)
                    .expect("qmv_multi_fit accepted the layout")
            };
            let (p, sets) = multi_matmul(group, rows_per_block, true);
            let grid = ((sets as u32).min(gpu.sms), n.div_ceil(QMV_TOKENS) as u32, 1);
            let threads = qmv_threads(group[0].0.cols as usize, bits as usize);
            // SAFETY: `qmv_b*_t4` in kernels/qmv.cu; qmv_multi_fit checked the
            // layouts, the caller sized x and every output for n tokens.
            unsafe {
                gpu.launch(
                    &format!("qmv_{}_t4", if q8 { "b4q8" } else { kernel_suffix(bits) }),
                    grid,
                    threads,
                    0,
                    &mut args!(p, x, nn),
                )?
            };
        }
    }
    Ok(())
}

/// The widest input the `qdot` kernels (4-bit products on 8-bit
/// activations) round into shared memory (`QD_MAX_COLS` in kernels/qdot.cu).
const QDOT_MAX_COLS: usize = 8192;
/// Tokens per block row of `qdot_b4q8_t4` (`T`).
const QDOT_TOKENS: usize = 4;
/// Blocks of a grid that loops over `sets` row sets per row of blocks
/// (`rows` rows: slots, token groups) when `resident` blocks fit the GPU at
/// once: every set in one wave where they fit, else the fewest waves with
/// every block taking as many sets (a block taking one set more than the
/// others sets the launch's time: kbench, H200, 397B experts' gate/up 24.1
/// µs with 52 blocks a slot for 64 sets, 17.3 with 64).
pub(super) fn balanced_blocks(sets: usize, rows: usize, resident: usize) -> u32 {
    let waves = (sets * rows).div_ceil(resident.max(1)).max(1);
    sets.div_ceil(waves).max(1) as u32
}

/// Whether the `qdot` products' grid is balanced ([`balanced_blocks`];
/// `MOEFLUX_CUDA_QDOT_GRID=4` instead: four blocks per SM, to compare).
fn qdot_balanced() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_QDOT_GRID").map_or(true, |v| v != "4"))
}

/// Blocks per SM of the unbalanced `qdot` grid (`MOEFLUX_CUDA_QDOT_GRID=4`)
/// and the grid below which one row a warp is taken.
const QDOT_BLOCKS_PER_SM: u32 = 4;

/// Whether the `qdot` kernels take `q`: 4-bit codes in groups of a
/// multiple of 32, whole 32-column blocks, an input that fits shared
/// memory, 16-byte aligned codes.
fn qdot_fit(q: &Qw) -> bool {
    qdot_fit_width(q.bits as usize, q.gs as usize, q.cols as usize) && q.w.is_multiple_of(16)
}

/// Whether the `qdot` kernels take rows of `cols` codes of `bits` bits in
/// groups of `gs` (the codes' alignment aside).
pub(super) fn qdot_fit_width(bits: usize, gs: usize, cols: usize) -> bool {
    bits == 4 && gs.is_multiple_of(32) && cols.is_multiple_of(32) && cols <= QDOT_MAX_COLS
}

/// Shared memory of a `qdot` block rounding `tokens` inputs of `cols`:
/// a byte a column, and a dx and a sum per 32 columns.
pub(super) fn qdot_smem(tokens: usize, cols: usize) -> u32 {
    (tokens * cols * 5 / 4) as u32
}

/// The quantized products of `ops` with their matrices.
fn quantized(ops: &[Mm]) -> Vec<(Qw, &Mm)> {
    ops.iter()
        .filter_map(|o| match o.w {
            DevLinear::Quant(q) => Some((q, o)),
            DevLinear::Dense { .. } => None,
        })
        .collect()
}

/// Whether the `qdot` products pick their lanes a row by shape
/// ([`qdot_shape`]; `MOEFLUX_CUDA_QDOT_LANES=32`: always 32, to compare).
fn qdot_lanes_by_shape() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_QDOT_LANES").map_or(true, |v| v != "32"))
}

/// Sets of four rows a warp a group of products must number at least to
/// take them (16 lanes a row, two rows each): below, the grid would be
/// short of sets.
const QDOT_MANY_ROW_SETS: usize = 384;

/// Rows a set and the kernel suffix of one `qdot` launch over `group`
/// (lanes a row `LPR` and rows a lane group `R` in kernels/qdot.cu; a
/// row's sums depend on the group's shape only, never on the tokens, so a
/// decode batch still equals each sequence alone). kbench, H200, µs:
/// inputs under 1024 columns take 8 lanes a row, two rows each (A3B shared
/// down 3.11 -> 2.65); products of many rows 16 lanes, two rows (A3B
/// GatedDeltaNet input 9.77 -> 8.62, 397B's 16.34 -> 15.56, A3B LM head
/// 90.6 -> 81.4); the rest 32 lanes, two rows, or one where the two-row sets
/// would not fill `grid` blocks (A3B's 2048-row output projection 9.1 ->
/// 7.3, 397B's 4096-row one 16.6 -> 12.8; fewer lanes lose there).
fn qdot_shape(group: &[(Qw, &Mm)], grid: usize) -> (usize, &'static str) {
    let sets = |rows_a_set: usize| -> usize {
        group
            .iter()
            .map(|(q, _)| (q.rows as usize).div_ceil(rows_a_set))
            .sum()
    };
    if qdot_lanes_by_shape() {
        if group[0].0.cols < 1024 {
            return (64, "_l8");
        }
        if sets(32) >= QDOT_MANY_ROW_SETS {
            return (32, "_l16");
        }
    }
    if sets(16) < grid {
        (8, "_r1")
    } else {
        (16, "")
    }
}

/// Products of 1 to [`MMA_MIN_TOKENS`] - 1 tokens of 4-bit matrices on
/// 8-bit activations (`--gpu-activations q8`; [`qdot_fit`] must hold):
/// up to four matrices a launch, each block rounding the input into shared
/// memory once, biases and residual adds inside; every token's sums are
/// what that token alone would get.
fn qdot_products(gpu: &Gpu, ops: &[Mm], x: u64, n: usize, input: Input) -> Result<()> {
    let quant = quantized(ops);
    let (kernel, tokens) = match input {
        Input::Glu => ("qdot_b4q8_glu", 1),
        Input::Plain if n == 1 => ("qdot_b4q8", 1),
        Input::Plain => ("qdot_b4q8_t4", QDOT_TOKENS),
    };
    let nn = n as i32;
    for group in quant.chunks(4) {
        let (rows_a_set, sfx) = qdot_shape(group, (QDOT_BLOCKS_PER_SM * gpu.sms) as usize);
        let (p, sets) = multi_matmul(group, |_| rows_a_set, true);
        let name = format!("{kernel}{sfx}");
        let token_groups = n.div_ceil(tokens);
        let smem = qdot_smem(tokens, group[0].0.cols as usize);
        let blocks = if qdot_balanced() {
            let resident = gpu.blocks_per_sm_smem(&name, 256, smem) * gpu.sms;
            balanced_blocks(sets as usize, token_groups, resident as usize)
        } else {
            (sets as u32).min(QDOT_BLOCKS_PER_SM * gpu.sms)
        };
        let grid = (blocks, token_groups as u32, 1);
        // SAFETY: `qdot_b4q8*` in kernels/qdot.cu; qdot_fit accepted every
        // matrix, all share x's width, the caller sized x and every output
        // for n tokens; smem holds the rounded input of `tokens` tokens.
        unsafe { gpu.launch(&name, grid, 256, smem, &mut args!(p, x, nn))? };
    }
    Ok(())
}

/// Products of one launch: the `qmv` width class and whether its 4-bit
/// matrices take 8-bit activations (`None`: the general kernels), and
/// each matrix.
type LaunchGroup<'a> = (Option<(i32, bool)>, Vec<(Qw, &'a Mm)>);

/// A matrix product of a [`matmuls`] group: `out (+)= x W^T (+ bias)`.
#[derive(Clone, Copy)]
pub(super) struct Mm {
    pub w: DevLinear,
    pub out: u64,
    pub accumulate: bool,
    /// A vector added to every output row after the product (0: none):
    /// inside the one-token kernels, by an `add_rows` launch after others.
    pub bias: u64,
    /// Exact f32 activations even under `--gpu-activations q8` (a router,
    /// whose rounding would change which experts run, as on the CPU).
    pub exact: bool,
}

/// `out = x W^T`.
pub(super) fn mm(w: DevLinear, out: u64) -> Mm {
    Mm {
        w,
        out,
        accumulate: false,
        bias: 0,
        exact: false,
    }
}

/// `out += x W^T` (a residual connection).
pub(super) fn mm_add(w: DevLinear, out: u64) -> Mm {
    Mm {
        accumulate: true,
        ..mm(w, out)
    }
}

impl Mm {
    /// The product with `bias` (a device vector of one float per output
    /// row) added, when there is one.
    pub(super) fn with_bias(self, bias: Option<u64>) -> Mm {
        Mm {
            bias: bias.unwrap_or(0),
            ..self
        }
    }

    /// The product with exact f32 activations whatever the GPU's mode.
    pub(super) fn exact(self) -> Mm {
        Mm {
            exact: true,
            ..self
        }
    }

    fn rows(&self) -> usize {
        match self.w {
            DevLinear::Quant(q) => q.rows as usize,
            DevLinear::Dense { rows, .. } => rows as usize,
        }
    }
}

/// The biases of products whose kernels did not add them, one `add_rows`
/// launch each.
fn add_biases<'a>(gpu: &Gpu, ops: impl IntoIterator<Item = &'a Mm>, n: usize) -> Result<()> {
    for o in ops.into_iter().filter(|o| o.bias != 0) {
        add_rows(gpu, o.out, o.bias, n, o.rows())?;
    }
    Ok(())
}

/// `x[t] += b` for `n` rows of `cols` floats (a projection's bias).
pub(super) fn add_rows(g: &Gpu, x: u64, b: u64, n: usize, cols: usize) -> Result<()> {
    let cols_i = cols as i32;
    // SAFETY: `add_rows` in kernels/elementwise.cu; x holds n rows of cols floats, b cols.
    unsafe {
        g.launch(
            "add_rows",
            (n as u32, cols.div_ceil(256) as u32, 1),
            256,
            0,
            &mut args!(x, b, cols_i),
        )
    }
}

/// Several products of the same input `x[n, cols]`: quantized ones four
/// to a launch (on the tensor cores from [`PRODUCT_MMA_MIN_TOKENS`]
/// tokens), dense ones one each.
pub(super) fn matmuls(gpu: &Gpu, ops: &[Mm], x: u64, n: usize) -> Result<()> {
    launch_products(gpu, ops, x, n, Input::Plain)
}

/// An MLP's down product of `silu(gate) * up` for `n` tokens: `gu` holds
/// gate (n x cols) then up. One token whose product fits the
/// activation-stationary kernels applies the SwiGLU as it loads its input
/// (one launch); otherwise it is computed into `act` (n x cols) first.
pub(super) fn swiglu_matmul(gpu: &Gpu, down: Mm, gu: u64, act: u64, n: usize) -> Result<()> {
    match down.w {
        DevLinear::Quant(q) if n == 1 && qmv_fit(&q).is_some() => {
            launch_products(gpu, &[down], gu, 1, Input::Glu)
        }
        w => {
            let cols = match w {
                DevLinear::Quant(q) => q.cols,
                DevLinear::Dense { cols, .. } => cols,
            } as usize;
            swiglu(gpu, gu, gu + (4 * n * cols) as u64, act, n * cols)?;
            matmuls(gpu, &[down], act, n)
        }
    }
}

/// The code width of every matrix of `group`, if they share one.
fn one_width(group: &[(Qw, &Mm)]) -> Option<i32> {
    let bits = group[0].0.bits;
    group.iter().all(|(q, _)| q.bits == bits).then_some(bits)
}

/// The launch parameters of `group` (at most four matrices) and its blocks
/// in all, `rows_per_block(q)` output rows per block of matrix `q`;
/// `biases`: the kernel adds the products' biases (the one-token qmv
/// kernels), else the caller does ([`add_biases`]).
fn multi_matmul(
    group: &[(Qw, &Mm)],
    rows_per_block: impl Fn(&Qw) -> usize,
    biases: bool,
) -> (MultiMatmul, i32) {
    let mut p = MultiMatmul {
        q: [group[0].0; 4],
        out: [0; 4],
        bias: [0; 4],
        first_block: [0; 5],
        count: group.len() as i32,
        accumulate: 0,
    };
    let mut blocks = 0i32;
    for (j, (q, o)) in group.iter().enumerate() {
        p.q[j] = *q;
        p.out[j] = o.out;
        if biases {
            p.bias[j] = o.bias;
        }
        p.first_block[j] = blocks;
        p.accumulate |= (o.accumulate as i32) << j;
        blocks += (q.rows as usize).div_ceil(rows_per_block(q)) as i32;
    }
    for j in group.len()..5 {
        p.first_block[j] = blocks;
    }
    (p, blocks)
}

/// Batches of at least this many tokens take the tensor-core experts and
/// attention (`moe_*_mma`, `attention_mma`).
pub(super) const MMA_MIN_TOKENS: usize = 16;

/// Products of at least this many tokens that the few-token kernels do not
/// take ([`qmv_multi_fit`]) go to the tensor cores (`qmma` in mma_products.cu) where
/// the matrices fit them: a `qmma` tile reads each weight once for all its
/// tokens, where the general kernel loads every token's activations per
/// weight word and its cost grows with the tokens (an LM head of eight
/// decode steps: 0.6 ms against 2.6 on the H100). Their rounding (x split
/// into bf16 hi/lo pairs) is prefill's.
pub(super) const PRODUCT_MMA_MIN_TOKENS: usize = 4;

/// Output rows and tokens per block of `qmma`.
const MMA_BLOCK_ROWS: usize = 64;
const MMA_BLOCK_TOKENS: usize = 64;

/// Whether the tensor-core kernels take a matrix of `bits`-bit codes in
/// groups of `gs` with rows of `cols` codes starting at `w`: 4- or 8-bit
/// codes, groups of 32, 64 or 128, whole groups, 16-byte aligned codes.
pub(super) fn mma_layout_fits(bits: i32, gs: i32, cols: i32, w: u64) -> bool {
    matches!(bits, 4 | 8) && matches!(gs, 32 | 64 | 128) && cols % gs == 0 && w.is_multiple_of(16)
}

fn mma_fits(q: &Qw) -> bool {
    mma_layout_fits(q.bits, q.gs, q.cols, q.w)
}

/// `x[n, cols]` split for the tensor-core kernels (`mma_split`) into the
/// GPU's workspace: the addresses of the bf16 hi/lo pairs and of the group
/// sums. Valid until the next call that uses the workspace.
pub(super) fn mma_split(gpu: &Gpu, x: u64, n: usize, cols: usize, gs: usize) -> Result<(u64, u64)> {
    let pairs = 4 * n * cols;
    let ws = gpu.workspace(pairs + 4 * n * (cols / gs))?;
    let (xp, xs) = (ws, ws + pairs as u64);
    let (nn, c, g) = (n as i64, cols as i32, gs as i32);
    let blocks = (n * cols / 4).div_ceil(256) as u32;
    // SAFETY: `mma_split` in mma.cu; x holds n x cols floats, the workspace
    // the pairs (as many bytes as x) and n x cols / gs sums.
    unsafe {
        gpu.launch(
            "mma_split",
            (blocks, 1, 1),
            256,
            0,
            &mut args!(x, nn, c, g, xp, xs),
        )?
    };
    Ok((xp, xs))
}

/// Whether the many-token products and experts on the tensor cores take
/// 8-bit activations under `--gpu-activations q8` (`qmma_q8`,
/// `moe_*_mma_q8`; `MOEFLUX_CUDA_MMA_Q8=0`: the bf16 hi/lo kernels instead,
/// to compare).
pub(super) fn mma_q8_enabled(gpu: &Gpu) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    gpu.q8 && *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_MMA_Q8").map_or(true, |v| v != "0"))
}

/// Row tiles a warp of the q8 tensor-core kernels: 4 (the `_m4` kernels,
/// each token's activations loaded once for twice the rows) where `wide`,
/// else 2; `MOEFLUX_CUDA_MMA_Q8_TILES=2` or `=4` forces one (to compare).
/// kbench (H200): 4 tiles win where the launch has several waves of blocks
/// (A3B GatedDeltaNet input at 512 tokens 363 -> 338 us, output projection
/// at 4096 tokens 1271 -> 1074) and lose where they leave SMs idle (that
/// projection at 512 tokens, 128 blocks: 168 -> 197 us).
pub(super) fn mma_q8_tiles(wide: bool) -> usize {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let forced =
        FORCED.get_or_init(
            || match std::env::var("MOEFLUX_CUDA_MMA_Q8_TILES").as_deref() {
                Ok("2") => Some(2),
                Ok("4") => Some(4),
                _ => None,
            },
        );
    forced.unwrap_or(if wide { 4 } else { 2 })
}

/// Whether the q8 tensor-core products stage their operands in shared
/// memory (`qmma_q8s`, `moe_*_mma_q8s` in mma_staged.cu: the same integer
/// sums, scaled in another f32 order) where the widths are multiples of 64;
/// `MOEFLUX_CUDA_MMA_STAGED=0`: the unstaged kernels, to compare.
pub(super) fn mma_q8_staged() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_MMA_STAGED").map_or(true, |v| v != "0"))
}

/// The q8 tensor-core kernel `base` with `tiles` row tiles a warp.
pub(super) fn mma_q8_kernel(base: &str, tiles: usize) -> String {
    if tiles == 4 {
        format!("{base}_m4")
    } else {
        base.to_string()
    }
}

/// `x[n, cols]` rounded by the q8 contract (`q8_rows` in mma_q8.cu) into
/// the GPU's workspace: the addresses of the rounded rows (`cols` bytes a
/// token) and of their `{dx, sum}` per 32 columns. Valid until the next
/// call that uses the workspace.
pub(super) fn q8_rows(gpu: &Gpu, x: u64, n: usize, cols: usize) -> Result<(u64, u64)> {
    let codes = n * cols;
    let ws = gpu.workspace(codes + 8 * n * (cols / 32))?;
    let (xq, dxs) = (ws, ws + codes as u64);
    let (nn, c) = (n as i64, cols as i32);
    let blocks = (n * cols / 8).div_ceil(256) as u32;
    // SAFETY: `q8_rows` in mma_q8.cu; x holds n x cols floats (cols a
    // multiple of 32), the workspace n x cols bytes and n x cols / 32 pairs.
    unsafe {
        gpu.launch(
            "q8_rows",
            (blocks, 1, 1),
            256,
            0,
            &mut args!(x, nn, c, xq, dxs),
        )?
    };
    Ok((xq, dxs))
}

/// Quantized products of many tokens on the tensor cores: under
/// `--gpu-activations q8` the 4-bit ones on `x` rounded once (`qmma_q8`),
/// the rest on `x` split once per group size (`qmma`), up to four matrices
/// a launch.
fn mma_products(gpu: &Gpu, ops: &[Mm], x: u64, n: usize) -> Result<()> {
    let (on_q8, quant): (Vec<_>, Vec<_>) = quantized(ops)
        .into_iter()
        .partition(|(q, o)| mma_q8_enabled(gpu) && q.bits == 4 && !o.exact);
    let nn = n as i32;
    let ty = n.div_ceil(MMA_BLOCK_TOKENS) as u32;
    if !on_q8.is_empty() {
        let (xq, dxs) = q8_rows(gpu, x, n, on_q8[0].0.cols as usize)?;
        let staged = mma_q8_staged() && on_q8.iter().all(|(q, _)| q.cols % 64 == 0);
        for group in on_q8.chunks(4) {
            // (kernel, rows a block, threads a block)
            let (kernel, rows, threads) = if staged {
                ("qmma_q8s".to_string(), 128, 256)
            } else {
                let blocks_at_4: usize = group
                    .iter()
                    .map(|(q, _)| (q.rows as usize).div_ceil(128))
                    .sum();
                let tiles = mma_q8_tiles(blocks_at_4 * ty as usize >= 2 * gpu.sms as usize);
                (mma_q8_kernel("qmma_q8", tiles), 32 * tiles, 128)
            };
            let (p, blocks) = multi_matmul(group, |_| rows, false);
            // SAFETY: `qmma_q8*` in mma_products.cu (32 * tiles rows a block
            // of 128 threads) or `qmma_q8s` in mma_staged.cu (128 rows a
            // block of 256 threads, columns a multiple of 64), 64 tokens a
            // block; xq / dxs were rounded from x (n tokens), every output
            // holds n rows.
            unsafe {
                gpu.launch(
                    &kernel,
                    (blocks as u32, ty, 1),
                    threads,
                    0,
                    &mut args!(p, xq, dxs, nn),
                )?
            };
            add_biases(gpu, group.iter().map(|(_, o)| *o), n)?;
        }
    }
    let mut sizes: Vec<i32> = quant.iter().map(|(q, _)| q.gs).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for gs in sizes {
        let same: Vec<(Qw, &Mm)> = quant.iter().filter(|(q, _)| q.gs == gs).copied().collect();
        let (xp, xs) = mma_split(gpu, x, n, same[0].0.cols as usize, gs as usize)?;
        for group in same.chunks(4) {
            let (mut p, mut blocks) = multi_matmul(group, |_| MMA_BLOCK_ROWS, false);
            let mut kernel = "qmma";
            if (blocks as usize) * (ty as usize) < gpu.sms as usize {
                // Less than a block an SM (a short prefill's routers): 32
                // rows a block, the same sums.
                (p, blocks) = multi_matmul(group, |_| MMA_BLOCK_ROWS / 2, false);
                kernel = "qmma_m1";
            }
            // SAFETY: `qmma` / `qmma_m1` in mma_products.cu (64 / 32 rows a
            // block); xp / xs were split from x (n tokens) with this group
            // size, every output holds n rows.
            unsafe {
                gpu.launch(
                    kernel,
                    (blocks as u32, ty, 1),
                    128,
                    0,
                    &mut args!(p, xp, xs, nn),
                )?
            };
            add_biases(gpu, group.iter().map(|(_, o)| *o), n)?;
        }
    }
    Ok(())
}

fn launch_products(gpu: &Gpu, ops: &[Mm], x: u64, n: usize, input: Input) -> Result<()> {
    if gpu.q8 && n < MMA_MIN_TOKENS && (input == Input::Plain || n == 1) {
        let (dot, rest): (Vec<Mm>, Vec<Mm>) = ops
            .iter()
            .partition(|o| matches!(o.w, DevLinear::Quant(q) if !o.exact && qdot_fit(&q)));
        if !dot.is_empty() {
            qdot_products(gpu, &dot, x, n, input)?;
            return launch_products(gpu, &rest, x, n, input);
        }
    }
    if n > 1 && n < MMA_MIN_TOKENS && input == Input::Plain {
        let (few, rest): (Vec<Mm>, Vec<Mm>) = ops
            .iter()
            .partition(|o| matches!(o.w, DevLinear::Quant(q) if qmv_multi_fit(&q)));
        if !few.is_empty() {
            qmv_multi_products(gpu, &few, x, n)?;
            return launch_products(gpu, &rest, x, n, input);
        }
    }
    if n >= PRODUCT_MMA_MIN_TOKENS && gpu.mma && input == Input::Plain {
        let (tc, rest): (Vec<Mm>, Vec<Mm>) = ops
            .iter()
            .partition(|o| matches!(o.w, DevLinear::Quant(q) if mma_fits(&q)));
        if !tc.is_empty() {
            mma_products(gpu, &tc, x, n)?;
            return launch_products(gpu, &rest, x, n, input);
        }
    }
    let nn = n as i32;
    let ty = n.div_ceil(4).min(64) as u32;
    // One token: matrices that fit the activation-stationary kernels go
    // to them, grouped by code width; the rest to the general kernels.
    let mut groups: Vec<LaunchGroup> = Vec::new();
    for o in ops {
        let DevLinear::Quant(q) = o.w else { continue };
        let key = (n == 1 && qmv_fit(&q).is_some())
            .then(|| (qmv_class(q.bits), in_q8_launch(gpu, &q, o)));
        debug_assert!(
            input == Input::Plain || key.is_some(),
            "only qmv applies a SwiGLU"
        );
        match groups.iter_mut().find(|g| g.0 == key && g.1.len() < 4) {
            Some(g) => g.1.push((q, o)),
            None => groups.push((key, vec![(q, o)])),
        }
    }
    for (key, group) in &groups {
        let code_bytes: usize = group
            .iter()
            .map(|(q, _)| q.rows as usize * q.cols as usize * q.bits as usize / 8)
            .sum();
        let width = one_width(group);
        let chunks = match width {
            _ if code_bytes <= QMV_SMALL_BYTES => 2,
            Some(_) => QMV_STREAM_CHUNKS,
            None => QMV_CHUNKS,
        };
        let rows_per_block = |q: &Qw| match key {
            Some(_) => qmv_rows_per_block(q.cols as usize, q.bits as usize, q.gs as usize, chunks)
                .expect("qmv_fit accepted the layout"),
            None => rows_per_block(q.cols as usize, q.bits as usize, n == 1),
        };
        let (p, blocks) = multi_matmul(group, rows_per_block, key.is_some());
        // SAFETY: arguments match the kernels in kernels/ (qmatmul.cu, qmv.cu); the caller
        // sized x and every output for n tokens.
        unsafe {
            match key {
                Some((_, q8)) => {
                    // The streaming kernels loop over the sets (`blocks`
                    // counts them) with a few blocks per SM.
                    let per_sm = match chunks {
                        2 => QMV_NC2_BLOCKS_PER_SM,
                        _ => QMV_STREAM_BLOCKS_PER_SM,
                    };
                    // Mixed widths (`None`) give each block its own split.
                    let (grid, threads) = match width {
                        Some(b) => (
                            (blocks as u32).min(per_sm * gpu.sms),
                            qmv_threads(group[0].0.cols as usize, b as usize),
                        ),
                        None => (blocks as u32, 256),
                    };
                    gpu.launch(
                        &qmv_kernel(width, chunks, input, *q8),
                        (grid, 1, 1),
                        threads,
                        0,
                        &mut args!(p, x),
                    )?
                }
                None => {
                    let kernel = if n == 1 { "qmatmul1" } else { "qmatmul" };
                    gpu.launch(kernel, (blocks as u32, ty, 1), 256, 0, &mut args!(p, x, nn))?;
                    add_biases(gpu, group.iter().map(|(_, o)| *o), n)?
                }
            }
        };
    }
    for o in ops {
        if let DevLinear::Dense { w, f32, rows, cols } = o.w {
            let (acc, out) = (o.accumulate as i32, o.out);
            let blocks = (rows as usize).div_ceil(8) as u32;
            // SAFETY: as above (`dmatmul`).
            unsafe {
                gpu.launch(
                    "dmatmul",
                    (blocks, n.min(64) as u32, 1),
                    256,
                    0,
                    &mut args!(w, f32, rows, cols, x, nn, acc, out),
                )?
            };
            add_biases(gpu, [o], n)?;
        }
    }
    Ok(())
}

/// The layout of a [`head_matmul`]: the rows of `w` come in blocks of
/// `rows_per_head`, one per head, and head `h` of token `t` reads its input
/// at `x + 4 * (t * x_token + h * x_head)` (strides in floats).
#[derive(Clone, Copy, Debug)]
pub(super) struct PerHead {
    pub rows_per_head: usize,
    pub x_token: usize,
    pub x_head: usize,
}

/// `out[t, r] = W[r] . x[t, head(r)]` for `n` tokens, every head in one
/// launch (MLA's absorptions: `embed_q` on each head's `q_nope`,
/// `unembed_out` on each head's attended latent). `rows_per_head` must be a
/// multiple of [`ROWS_PER_WARP`] (checked when the model is loaded), so the
/// rows of a warp share one head.
pub(super) fn head_matmul(gpu: &Gpu, w: Qw, h: PerHead, x: u64, n: usize, out: u64) -> Result<()> {
    debug_assert!(h.rows_per_head.is_multiple_of(ROWS_PER_WARP));
    let one = n == 1;
    // One token: the activation-stationary kernels when a warp's rows stay
    // inside one head and every head's input is 16-byte aligned.
    let qmv = qmv_fit(&w).filter(|_| {
        one && (4 * h.x_head).is_multiple_of(16)
            && x.is_multiple_of(16)
            && h.rows_per_head
                .is_multiple_of(qmv_warp_rows(w.cols as usize, w.bits as usize))
    });
    if let Some(rpb) = qmv {
        let blocks = (w.rows as usize).div_ceil(rpb) as u32;
        let (x_head, rph) = (h.x_head as i64, h.rows_per_head as i32);
        let kernel = match w.bits {
            4 => "qmv_heads_b4",
            8 => "qmv_heads_b8",
            _ => "qmv_heads_b2",
        };
        // SAFETY: `qmv_heads_b*` in mla.cu; x holds every head's input of
        // one token, out one row per matrix row.
        return unsafe {
            gpu.launch(
                kernel,
                (blocks, 1, 1),
                256,
                0,
                &mut args!(w, x, x_head, rph, out),
            )
        };
    }
    let blocks = (w.rows as usize).div_ceil(rows_per_block(w.cols as usize, w.bits as usize, one));
    let ty = n.div_ceil(4).min(64) as u32;
    let (x_tok, x_head) = (h.x_token as i64, h.x_head as i64);
    let (rph, nn) = (h.rows_per_head as i32, n as i32);
    let kernel = if one {
        "qmatmul_heads1"
    } else {
        "qmatmul_heads"
    };
    // SAFETY: arguments match `qmatmul_heads*` in mla.cu; the caller sized x
    // and out for n tokens of every head.
    unsafe {
        gpu.launch(
            kernel,
            (blocks as u32, ty, 1),
            256,
            0,
            &mut args!(w, x, x_tok, x_head, rph, nn, out),
        )
    }
}

/// `out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w` for `rows` rows of `width`.
pub(super) fn rms_norm(
    gpu: &Gpu,
    x: u64,
    w: u64,
    rows: usize,
    width: usize,
    eps: f32,
    out: u64,
) -> Result<()> {
    let wd = width as i32;
    // SAFETY: `rms_norm` in kernels/elementwise.cu; x and out hold rows x width floats.
    unsafe {
        gpu.launch(
            "rms_norm",
            (rows as u32, 1, 1),
            1024,
            0,
            &mut args!(x, w, wd, eps, out),
        )
    }
}

/// `out = silu(gate) * up` over `n` floats.
pub(super) fn swiglu(gpu: &Gpu, gate: u64, up: u64, out: u64, n: usize) -> Result<()> {
    let nn = n as i64;
    let blocks = n.div_ceil(256).min(4096) as u32;
    // SAFETY: `swiglu` in kernels/elementwise.cu; every buffer holds n floats.
    unsafe {
        gpu.launch(
            "swiglu",
            (blocks, 1, 1),
            256,
            0,
            &mut args!(gate, up, out, nn),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{qmv_rows_per_block, qmv_slices};

    #[test]
    fn qmv_geometry_matches_the_kernel_layout() {
        // Long rows: 512-byte slices shared by up to 8 warps of a block.
        assert_eq!(qmv_rows_per_block(2048, 4, 64, 8), Some(32)); // 2 slices
        assert_eq!(qmv_rows_per_block(4096, 4, 64, 8), Some(16)); // 4 slices
        assert_eq!(qmv_rows_per_block(8192, 8, 64, 8), Some(8)); // 16 slices
        assert_eq!(qmv_rows_per_block(3072, 4, 64, 8), Some(32)); // 3 slices: 2 warps
        assert_eq!(qmv_rows_per_block(1024, 4, 64, 8), Some(64)); // one slice

        // Short rows: 512 / row bytes rows per chunk.
        assert_eq!(qmv_rows_per_block(512, 4, 64, 8), Some(128));
        assert_eq!(qmv_rows_per_block(64, 4, 64, 4), Some(32 * 16));
        // Rows 512 does not divide: ceil(rb / 512) slices, a warp each.
        assert_eq!(qmv_rows_per_block(2560, 4, 64, 8), Some(16)); // 1280 bytes: 3 slices
        assert_eq!(qmv_rows_per_block(2880, 4, 64, 8), Some(16)); // gpt-oss: 1440 bytes
        assert_eq!(qmv_rows_per_block(2880, 8, 64, 4), Some(4)); // 2880 bytes: 6 slices
        assert_eq!(qmv_rows_per_block(2880, 4, 32, 4), Some(8)); // MXFP4 codes
        assert_eq!(qmv_rows_per_block(9000, 8, 64, 8), None); // 9000 bytes: not 16-byte units
        assert_eq!(qmv_slices(1440), (3, 3));
        assert_eq!(qmv_slices(20 * 512 + 16), (21, 8));
        assert_eq!(qmv_slices(3 * 512), (3, 2));
        // Not the layout: odd short rows, a chunk across groups, other widths.
        assert_eq!(qmv_rows_per_block(768, 4, 64, 8), None); // 384 bytes
        assert_eq!(qmv_rows_per_block(2048, 2, 32, 8), None); // 64 codes > gs
        assert_eq!(qmv_rows_per_block(2048, 3, 64, 8), None);
        assert_eq!(qmv_rows_per_block(16, 4, 16, 8), None); // 8-byte rows
    }
}
