//! The NVIDIA GPU backend (CUDA through cudarc, loaded at run time; kernels
//! in `kernels/` (`all.cuh` lists the parts), compiled by NVRTC for the device found).
//!
//! The whole dense model and the sequence state live in VRAM; routed
//! experts go through a VRAM cache with a byte budget (`experts.rs`),
//! filled on a separate stream from the pinned host tier (`host_tier.rs`)
//! or the expert files; both caches evict by `slots.rs`.
//! `model.rs` runs the one layer stack (`model::forward`) with the blocks of
//! `attention.rs` (grouped-query attention), `deltanet.rs` (GatedDeltaNet),
//! `mla.rs` (multi-head latent attention) and `moe.rs` (dense MLP, MoE);
//! `support.rs` says which models it can run, without a GPU. `group.rs`
//! runs one model on several GPUs (routed experts sharded by `shard.rs`,
//! MoE outputs summed through NCCL, `nccl.rs`; long batches split by tokens
//! when every GPU holds every expert, `token_split.rs`), or one GPU of a group of
//! processes joined by `rendezvous.rs` (`--dist-init`), whose peers'
//! exits `watchdog.rs` notices.

mod abi;
mod attention;
mod deltanet;
pub mod device;
mod dynlib;
pub mod experts;
pub mod gds;
pub mod group;
mod host_tier;
mod linear;
mod mla;
pub mod model;
mod moe;
pub mod nccl;
mod read_ahead;
pub mod rendezvous;
mod ring;
pub mod shard;
mod slots;
pub mod state;
pub mod support;
mod token_split;
mod watchdog;

pub use device::{probe, Gpu, GpuInfo};
pub use experts::{CachePolicy, CacheStats, HostTierInfo};
pub use group::{CudaGroup, GpuSelection};
pub use model::{CudaModel, CudaOptions, PREFETCH_AUTO_MIN_EXTENT};
