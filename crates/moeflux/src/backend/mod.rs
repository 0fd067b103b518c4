//! Compute backends: each implements the blocks of the one layer stack
//! (`model::forward::BlockExecutor`). `cpu` runs everything on the host,
//! `cuda` on an NVIDIA GPU.

pub mod cpu;
pub mod cuda;
pub mod prefetch;
