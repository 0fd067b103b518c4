//! The NVIDIA GPU backend (CUDA through cudarc, loaded at run time; kernels
//! in `kernels.cu`, compiled by NVRTC for the device found).
//!
//! The whole dense model and the sequence state live in VRAM; routed
//! experts go through a VRAM cache with a byte budget, filled from the
//! expert files through pinned staging buffers on a separate stream. Both
//! model families run: the Qwen3.5/Qwen3-Next hybrid and the DeepSeek-V3
//! family (MLA), sharing one layer stack (`model.rs`).

pub mod device;
pub mod experts;
mod linear;
mod mla;
pub mod model;
mod moe;
mod qwen;
mod state;

pub use device::{probe, Gpu, GpuInfo};
pub use experts::{CachePolicy, CacheStats};
pub use model::{CudaModel, CudaOptions};
