//! The NVIDIA GPU backend (CUDA through cudarc, loaded at run time; kernels
//! in `kernels.cu`, compiled by NVRTC for the device found).
//!
//! The whole dense model and the sequence state live in VRAM; routed
//! experts go through a VRAM cache with a byte budget, filled from the
//! expert files through pinned staging buffers on a separate stream.

pub mod device;
pub mod experts;
pub mod model;

pub use device::{probe, Gpu, GpuInfo};
pub use experts::{CachePolicy, CacheStats};
pub use model::{CudaModel, CudaOptions};
