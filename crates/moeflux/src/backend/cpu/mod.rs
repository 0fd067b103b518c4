//! The CPU backend: the block executor (`exec`) and the blocks' forward
//! bodies (`attention`, `deltanet`, `mla`, `moe` with `router` and the
//! expert streaming of `experts`), over quantized matmul with runtime-detected
//! SIMD and the f32 elementwise ops.

pub mod attention;
pub mod deltanet;
pub mod exec;
pub mod experts;
pub mod mla;
pub mod moe;
pub mod ops;
pub mod qmatmul;
pub mod repack;
pub mod router;
pub mod simd;
pub mod vec;

/// One sequence's rows of a batch (contiguous), the position of its first
/// row, and its state of the layer being evaluated.
pub struct SeqRows<'s, S> {
    pub rows: std::ops::Range<usize>,
    pub start: usize,
    pub state: &'s mut S,
}
