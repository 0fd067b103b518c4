//! CPU kernels: quantized matmul with runtime-detected SIMD, and the f32
//! elementwise ops of the forward pass.

pub mod ops;
pub mod qmatmul;
pub mod simd;
pub mod vec;
