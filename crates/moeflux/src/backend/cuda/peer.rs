//! The all-reduce of a group's GPUs in one process through peer access:
//! each GPU reads the others' partial sums from their memory in one kernel
//! that also combines the layer's expert outputs (`moe_combine_peer`,
//! kernels/peer.cu). A decode step sums one small row per
//! MoE layer, where NCCL's per-call latency is most of the cost; NCCL keeps
//! the larger sums (prefill), groups of processes, and GPUs without peer
//! access. `MOEFLUX_EP_ALLREDUCE=nccl` sends every sum through NCCL.

use std::sync::Arc;

use cudarc::driver::sys;

use super::abi::{MoeCombineC, PeerReduceC};
use super::device::{args, DevBuf, Gpu};
use crate::error::{Error, Result};

/// Ranks and blocks the kernel's signal words have room for
/// (`PEER_MAX_RANKS`, `PEER_MAX_BLOCKS`).
const MAX_RANKS: usize = 8;
const MAX_BLOCKS: usize = 32;
/// Floats per half of a rank's exchange buffer: the largest sum taken here
/// (64 rows of 4096, or 32 of 8192; 2 MiB of VRAM per GPU).
const CAP: usize = 1 << 18;
const THREADS: usize = 256;

/// A pinned host word every rank's kernel polls while it waits for its
/// peers; set when the group aborts (a rank failed and will not arrive).
pub struct AbortWord {
    ptr: *mut u32,
}

// SAFETY: the word is written with volatile stores and only read by GPUs.
unsafe impl Send for AbortWord {}
unsafe impl Sync for AbortWord {}

impl AbortWord {
    fn new(gpu: &Gpu) -> Result<AbortWord> {
        gpu.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: four bytes of page-locked memory, zeroed before any use.
        let ptr = unsafe { cudarc::driver::result::malloc_host(4, flags) }
            .map_err(|e| Error::Gpu(format!("pinned host memory for the peer all-reduce: {e}")))?
            as *mut u32;
        // SAFETY: just allocated, four bytes.
        unsafe { ptr.write_volatile(0) };
        Ok(AbortWord { ptr })
    }

    /// Makes every waiting `peer_all_reduce` give up (its result is void).
    pub fn set(&self) {
        // SAFETY: live until drop.
        unsafe { self.ptr.write_volatile(1) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }

    /// The address the GPUs read it at (the same in every context: the
    /// allocation is portable and mapped, and addresses are unified).
    fn device_ptr(&self, gpu: &Gpu) -> Result<u64> {
        gpu.bind()?;
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: a mapped allocation of this process.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, self.ptr.cast(), 0) }
            .result()
            .map_err(|e| Error::Gpu(format!("mapping the peer all-reduce's abort word: {e}")))?;
        Ok(d)
    }
}

impl Drop for AbortWord {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host, freed once (no kernel runs:
        // the ranks that read it are dropped first).
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr.cast()) };
    }
}

/// One rank's side of the peer all-reduce.
pub struct PeerRank {
    abi: PeerReduceC,
    _buffers: [DevBuf; 3],
    _abort: Arc<AbortWord>,
}

impl PeerRank {
    /// `out = sum over ranks of each rank's combine `c`` (`count` floats:
    /// tokens x hidden), the same call on every rank of the group, in the
    /// same order, queued on `gpu`'s compute stream; `false` (nothing
    /// queued) when it does not fit this path, for NCCL to take.
    pub(super) fn combine_all_reduce(
        &self,
        gpu: &Gpu,
        c: MoeCombineC,
        out: u64,
        count: usize,
    ) -> Result<bool> {
        if count == 0
            || count > CAP
            || !count.is_multiple_of(4)
            || c.h % 4 != 0
            || !out.is_multiple_of(16)
        {
            return Ok(false);
        }
        // A float4 per thread, at least one block.
        let blocks = (count / 4).div_ceil(THREADS).clamp(1, MAX_BLOCKS) as u32;
        let (p, count) = (self.abi, count as i32);
        // SAFETY: `moe_combine_peer` in kernels/peer.cu; c's buffers hold
        // count / h tokens and out `count` floats on this GPU; every rank
        // launches the same grid for the same call, so the waits pair up.
        unsafe {
            gpu.launch(
                "moe_combine_peer",
                (blocks, 1, 1),
                THREADS as u32,
                0,
                &mut args!(p, c, out, count),
            )?;
        }
        Ok(true)
    }
}

/// Peer access between every pair of `gpus` (rank i on `gpus[i]`), then
/// each rank's exchange buffer, signal words and counters; the abort word
/// the group sets when a rank fails. Why not, when a pair lacks peer access
/// or the group is too large.
pub fn open(gpus: &[&Gpu]) -> std::result::Result<(Vec<PeerRank>, Arc<AbortWord>), String> {
    if gpus.len() < 2 || gpus.len() > MAX_RANKS {
        return Err(format!(
            "{} GPUs (the peer path takes 2 to {MAX_RANKS})",
            gpus.len()
        ));
    }
    for a in gpus {
        for b in gpus {
            if a.info.ordinal == b.info.ordinal {
                continue;
            }
            let mut can = 0;
            // SAFETY: two device handles of this process.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, a.ctx.cu_device(), b.ctx.cu_device()) }
                .result()
                .map_err(|e| format!("asking for peer access: {e}"))?;
            if can == 0 {
                return Err(format!(
                    "GPU {} cannot access GPU {}'s memory",
                    a.info.ordinal, b.info.ordinal
                ));
            }
            a.bind().map_err(|e| e.to_string())?;
            // SAFETY: b's context is live; enabling twice is reported, not harmful.
            match unsafe { sys::cuCtxEnablePeerAccess(b.ctx.cu_ctx(), 0) } {
                sys::CUresult::CUDA_SUCCESS
                | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {}
                e => {
                    return Err(format!(
                        "enabling GPU {}'s access to GPU {}: {e:?}",
                        a.info.ordinal, b.info.ordinal
                    ))
                }
            }
        }
    }
    let setup = || -> Result<(Vec<PeerRank>, Arc<AbortWord>)> {
        let abort = Arc::new(AbortWord::new(gpus[0])?);
        let buffers = gpus
            .iter()
            .map(|g| {
                Ok([
                    DevBuf::zeros(g, 4 * 2 * CAP)?,
                    DevBuf::zeros(g, 4 * MAX_BLOCKS * MAX_RANKS)?,
                    DevBuf::zeros(g, 4 * MAX_BLOCKS)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let (mut data, mut sig) = ([0u64; MAX_RANKS], [0u64; MAX_RANKS]);
        for (r, [d, s, _]) in buffers.iter().enumerate() {
            (data[r], sig[r]) = (d.ptr(), s.ptr());
        }
        let ranks = buffers
            .into_iter()
            .enumerate()
            .map(|(r, bufs)| {
                let abi = PeerReduceC {
                    data,
                    sig,
                    epoch: bufs[2].ptr(),
                    abort: abort.device_ptr(gpus[r])?,
                    cap: CAP as i32,
                    rank: r as i32,
                    world: gpus.len() as i32,
                    pad: 0,
                };
                Ok(PeerRank {
                    abi,
                    _buffers: bufs,
                    _abort: abort.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((ranks, abort))
    };
    setup().map_err(|e| e.to_string())
}

/// Whether the user keeps every sum on NCCL (`MOEFLUX_EP_ALLREDUCE=nccl`).
pub fn nccl_only() -> bool {
    std::env::var("MOEFLUX_EP_ALLREDUCE").is_ok_and(|v| v.eq_ignore_ascii_case("nccl"))
}
