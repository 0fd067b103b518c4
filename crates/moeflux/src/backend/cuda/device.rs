//! The GPU: probing for it, the context and streams, the kernel module
//! (compiled by NVRTC for the device's architecture, cached on disk), device
//! buffers and kernel launches.
//!
//! Everything goes through cudarc with dynamic loading: a machine without
//! libcuda runs the rest of moeflux unchanged, and [`probe`] says why no GPU
//! can be used instead of letting cudarc panic.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaStream};

use crate::error::{Error, Result};

/// The parts of the kernel source in `kernels/all.cuh`'s order (a test
/// checks the two agree).
const KERNEL_PARTS: [(&str, &str); 20] = [
    ("common.cuh", include_str!("kernels/common.cuh")),
    ("abi.cuh", include_str!("kernels/abi.cuh")),
    ("quant.cuh", include_str!("kernels/quant.cuh")),
    ("async_copy.cuh", include_str!("kernels/async_copy.cuh")),
    ("qmatmul.cu", include_str!("kernels/qmatmul.cu")),
    ("qmv.cu", include_str!("kernels/qmv.cu")),
    ("qdot.cu", include_str!("kernels/qdot.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("deltanet.cu", include_str!("kernels/deltanet.cu")),
    ("moe.cu", include_str!("kernels/moe.cu")),
    ("moe_route.cu", include_str!("kernels/moe_route.cu")),
    ("probe.cu", include_str!("kernels/probe.cu")),
    ("mla.cu", include_str!("kernels/mla.cu")),
    ("mma.cu", include_str!("kernels/mma.cu")),
    ("mma_q8.cu", include_str!("kernels/mma_q8.cu")),
    ("mma_products.cu", include_str!("kernels/mma_products.cu")),
    ("mma_staged.cu", include_str!("kernels/mma_staged.cu")),
    ("attn_mma.cu", include_str!("kernels/attn_mma.cu")),
    (
        "deltanet_chunk.cu",
        include_str!("kernels/deltanet_chunk.cu"),
    ),
];

/// The kernels, compiled at run time as one source (NVRTC gets no include
/// paths: the parts are concatenated).
static KERNELS: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| KERNEL_PARTS.iter().map(|(_, text)| *text).collect());

/// The kernel source this process compiles: the built-in one, or with
/// `MOEFLUX_CUDA_KERNEL_DIR=DIR` (not empty) the parts found in DIR in place of the
/// built-in ones (a kernel variant timed against the built-in kernels by
/// one binary, `bench/gpu-ab.sh`; the launches' arguments stay the built-in
/// ones, so a variant changes kernel bodies only).
fn kernel_source() -> Result<std::borrow::Cow<'static, str>> {
    match std::env::var_os("MOEFLUX_CUDA_KERNEL_DIR").filter(|d| !d.is_empty()) {
        None => Ok(std::borrow::Cow::Borrowed(KERNELS.as_str())),
        Some(dir) => {
            let dir = PathBuf::from(dir);
            let (source, replaced) = kernel_source_from(&dir)?;
            eprintln!(
                "moeflux: MOEFLUX_CUDA_KERNEL_DIR: kernel parts {replaced:?} read from {}",
                dir.display()
            );
            Ok(std::borrow::Cow::Owned(source))
        }
    }
}

/// The kernel parts with each one that `dir` holds read from there, and the
/// names of those. Every file in `dir` must name a part (a misspelt file
/// would otherwise leave the built-in part in place unnoticed).
fn kernel_source_from(dir: &std::path::Path) -> Result<(String, Vec<String>)> {
    let io =
        |e: std::io::Error| Error::Gpu(format!("MOEFLUX_CUDA_KERNEL_DIR {}: {e}", dir.display()));
    let mut found = HashMap::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !KERNEL_PARTS.iter().any(|(part, _)| *part == name) {
            let parts: Vec<&str> = KERNEL_PARTS.iter().map(|(part, _)| *part).collect();
            return Err(Error::Gpu(format!(
                "MOEFLUX_CUDA_KERNEL_DIR {}: {name} is not a kernel part (the parts: {})",
                dir.display(),
                parts.join(", ")
            )));
        }
        let text = std::fs::read_to_string(entry.path())
            .map_err(|e| Error::Gpu(format!("{}: {e}", entry.path().display())))?;
        found.insert(name, text);
    }
    let mut source = String::new();
    let mut replaced = Vec::new();
    for (part, text) in KERNEL_PARTS {
        match found.get(part) {
            Some(own) => {
                source.push_str(own);
                if !own.ends_with('\n') {
                    source.push('\n');
                }
                replaced.push(part.to_string());
            }
            None => source.push_str(text),
        }
    }
    Ok((source, replaced))
}

/// Every kernel the backend launches (looked up once at start).
const KERNEL_NAMES: &[&str] = &[
    "qmatmul",
    "qmatmul1",
    "dmatmul",
    "qgather_rows",
    "rms_norm",
    "argmax_parts",
    "argmax_merge",
    "swiglu",
    "attn_prep",
    "attention",
    "attention_plain",
    "deltanet_split",
    "conv_qk_norm",
    "delta_rule",
    "gated_norm",
    "moe_gate_up_b4",
    "moe_gate_up_b8",
    "moe_gate_up_b2",
    "moe_gate_up_bx",
    "moe_down_b4",
    "moe_down_b8",
    "moe_down_b2",
    "moe_down_bx",
    "moe_combine",
    "moe_combine_norm",
    "moe_route_c4",
    "moe_route_c8",
    "moe_route_c16",
    "moe_route_c32",
    "moe_gate_up_qdot16_route_c4",
    "moe_gate_up_qdot16_route_c8",
    "moe_gate_up_qdot16_route_c16",
    "moe_gate_up_qdot16_route_c32",
    "moe_gate_up_qdot8_route_c4",
    "moe_gate_up_qdot8_route_c8",
    "moe_gate_up_qdot8_route_c16",
    "moe_gate_up_qdot8_route_c32",
    "moe_gate_up_qdot4_route_c4",
    "moe_gate_up_qdot4_route_c8",
    "moe_gate_up_qdot4_route_c16",
    "moe_gate_up_qdot4_route_c32",
    "moe_gate_up_qdot2_route_c4",
    "moe_gate_up_qdot2_route_c8",
    "moe_gate_up_qdot2_route_c16",
    "moe_gate_up_qdot2_route_c32",
    "moe_gate_up_slots_b4",
    "moe_gate_up_slots_b8",
    "moe_gate_up_slots_b2",
    "moe_gate_up_slots_bx",
    "moe_down_slots_b4",
    "moe_down_slots_b8",
    "moe_down_slots_b2",
    "moe_down_slots_bx",
    "moe_gate_up_mx",
    "moe_down_mx",
    "moe_gate_up_slots_mx",
    "moe_down_slots_mx",
    "attention_sinks",
    "add_rows",
    "qmv_b4",
    "qmv_b8",
    "qmv_b2",
    "qmv_b4_nc2",
    "qmv_b8_nc2",
    "qmv_b2_nc2",
    "qmv_b4_glu",
    "qmv_b8_glu",
    "qmv_b2_glu",
    "qmv_b4_nc2_glu",
    "qmv_b8_nc2_glu",
    "qmv_b2_nc2_glu",
    "qmv_b48",
    "qmv_b48_nc2",
    "qmv_b4_t4",
    "qmv_b8_t4",
    "qmv_b4q8",
    "qmv_b4q8_nc2",
    "qmv_b4q8_glu",
    "qmv_b4q8_nc2_glu",
    "qmv_b48q8",
    "qmv_b48q8_nc2",
    "qmv_b4q8_t4",
    "qdot_b4q8",
    "qdot_b4q8_glu",
    "qdot_b4q8_t4",
    "qdot_b4q8_r1",
    "qdot_b4q8_glu_r1",
    "qdot_b4q8_t4_r1",
    "qdot_b4q8_l16",
    "qdot_b4q8_glu_l16",
    "qdot_b4q8_t4_l16",
    "qdot_b4q8_l8",
    "qdot_b4q8_glu_l8",
    "qdot_b4q8_t4_l8",
    "moe_gate_up_qmv_b4q8",
    "moe_down_qmv_b4q8",
    "moe_gate_up_stream_b4q8",
    "moe_down_stream_b4q8",
    "moe_gate_up_qdot16",
    "moe_down_qdot16",
    "moe_gate_up_qdot8",
    "moe_down_qdot8",
    "moe_gate_up_qdot4",
    "moe_down_qdot4",
    "moe_gate_up_qdot2",
    "moe_down_qdot2",
    "moe_gate_up_qmv_b4",
    "moe_gate_up_qmv_b8",
    "moe_gate_up_qmv_b2",
    "moe_down_qmv_b4",
    "moe_down_qmv_b8",
    "moe_down_qmv_b2",
    "moe_gate_up_qmv_mx",
    "moe_down_qmv_mx",
    "moe_gate_up_stream_b4",
    "moe_down_stream_b4",
    "moe_gate_up_stream_b8",
    "moe_down_stream_b8",
    "moe_gate_up_stream_mx",
    "moe_down_stream_mx",
    "moe_gate_up_rows_mx2",
    "moe_gate_up_rows_mx3",
    "moe_gate_up_rows_mx4",
    "moe_down_rows_mx2",
    "moe_down_rows_mx3",
    "moe_down_rows_mx4",
    "read_probe",
    "moe_route_noaux",
    "moe_group",
    "qmatmul_heads",
    "qmatmul_heads1",
    "qmv_heads_b4",
    "qmv_heads_b8",
    "qmv_heads_b2",
    "mla_prep",
    "mla_attention",
    "conv_qk_norm_batch",
    "conv_state_update",
    "mma_split",
    "qmma",
    "qmma_m1",
    "moe_gate_up_mma",
    "moe_down_mma",
    "q8_rows",
    "qmma_q8",
    "moe_gate_up_mma_q8",
    "moe_down_mma_q8",
    "qmma_q8_m4",
    "qmma_q8s",
    "moe_gate_up_mma_q8s",
    "moe_down_mma_q8s",
    "moe_gate_up_mma_q8_m4",
    "moe_down_mma_q8_m4",
    "attn_kv_split",
    "attention_mma",
    "attention_mma_plain",
    "gdn_chunk_prep",
    "gdn_chunk_scan",
];

/// Kernels that may take more than the default 48 KiB of dynamic shared
/// memory (up to the device's opt-in maximum, [`Gpu::smem_optin`]).
const LARGE_SMEM_KERNELS: &[&str] = &["attention_mma", "attention_mma_plain", "gdn_chunk_scan"];

/// What [`probe`] found.
#[derive(Debug, Clone)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability.
    pub cc: (i32, i32),
    pub total_bytes: usize,
    pub free_bytes: usize,
}

impl std::fmt::Display for GpuInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GPU {} ({}, sm_{}{}, {:.1} GiB, {:.1} GiB free)",
            self.ordinal,
            self.name,
            self.cc.0,
            self.cc.1,
            self.total_bytes as f64 / (1u64 << 30) as f64,
            self.free_bytes as f64 / (1u64 << 30) as f64
        )
    }
}

fn gpu_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Gpu(format!("{what}: {e}"))
}

/// Whether the NVIDIA driver library can be loaded (a GPU may still be
/// missing or unusable).
pub fn driver_present() -> bool {
    // SAFETY: only tries to load the library.
    unsafe { sys::is_culib_present() }
}

/// GPUs the driver sees, or why CUDA cannot be used (no driver library,
/// or the driver refused). Never panics.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::Gpu(
            "CUDA is not available: the NVIDIA driver library (libcuda.so) was not found".into(),
        ));
    }
    let count = CudaContext::device_count().map_err(|e| gpu_err("CUDA is not usable", e))?;
    Ok(count.max(0) as usize)
}

/// Finds GPU 0, or says why there is none: no CUDA driver library, no
/// device, or the driver refused. Never panics.
pub fn probe() -> Result<GpuInfo> {
    probe_ordinal(0)
}

/// Finds GPU `ordinal`, or says why it cannot be used (as [`probe`]; a GPU
/// the host does not have names how many it has).
pub fn probe_ordinal(ordinal: usize) -> Result<GpuInfo> {
    let count = device_count()?;
    if count < 1 {
        return Err(Error::Gpu("CUDA is available but there is no GPU".into()));
    }
    if ordinal >= count {
        return Err(Error::Gpu(format!(
            "there is no GPU {ordinal}: this host has {count} (GPUs 0 to {})",
            count - 1
        )));
    }
    let what = format!("GPU {ordinal}");
    let ctx = CudaContext::new(ordinal).map_err(|e| gpu_err(&format!("cannot open {what}"), e))?;
    let (free_bytes, total_bytes) = ctx.mem_get_info().map_err(|e| gpu_err(&what, e))?;
    Ok(GpuInfo {
        ordinal,
        name: ctx.name().map_err(|e| gpu_err(&what, e))?,
        cc: ctx.compute_capability().map_err(|e| gpu_err(&what, e))?,
        total_bytes,
        free_bytes,
    })
}

/// The context, streams and kernels of one GPU.
pub struct Gpu {
    pub info: GpuInfo,
    pub ctx: Arc<CudaContext>,
    /// Where compute runs, in order.
    pub stream: Arc<CudaStream>,
    /// Expert uploads, overlapping compute.
    pub copy: Arc<CudaStream>,
    /// Work that runs beside the compute stream's chain ([`Gpu::beside`]):
    /// a MoE block's shared expert while its router and routed experts run.
    side: Arc<CudaStream>,
    /// Launches go to `side` (inside [`Gpu::beside`]).
    on_side: std::sync::atomic::AtomicBool,
    /// Whether callers may put work beside the chain (set by the model from
    /// `CudaOptions::side_stream`).
    pub side_stream: bool,
    funcs: HashMap<&'static str, CudaFunction>,
    /// `MOEFLUX_CUDA_PROFILE=1`: GPU time and launches per kernel, printed
    /// when the GPU is closed (each launch is timed alone: slow).
    profile: Option<std::sync::Mutex<HashMap<String, (u64, f64)>>>,
    /// Programmatic dependent launches (sm_90+; `MOEFLUX_CUDA_PDL=0` turns
    /// them off).
    pdl: bool,
    /// `MOEFLUX_CUDA_SKIP_KERNELS=prefix,...`: kernels whose names start
    /// with one of these are not launched. Outputs are wrong; it measures
    /// what a kernel class costs inside a captured step, which the
    /// per-launch profile cannot (`bench/gpu-ablate.sh`).
    skip: Vec<String>,
    /// Streaming multiprocessors (grids of the kernels that loop over their
    /// work are sized by it).
    pub sms: u32,
    /// Products of many tokens on the tensor cores (sm_80+;
    /// `MOEFLUX_CUDA_MMA=0` keeps them on the CUDA cores).
    pub mma: bool,
    /// One- and few-token 4-bit affine products take their activations
    /// rounded to 8 bits (`--gpu-activations q8`, the `b4q8` kernels; set
    /// by the model from `CudaOptions::activations`).
    pub q8: bool,
    /// Dynamic shared memory one block may take (the opt-in maximum, set on
    /// the kernels of `LARGE_SMEM_KERNELS`).
    pub smem_optin: usize,
    /// Device memory the products use between two launches of one call
    /// (the tensor-core kernels' split activations), grown on demand.
    workspace: std::sync::Mutex<Option<DevBuf>>,
    /// [`Gpu::blocks_per_sm`]'s answers by kernel and block size.
    occupancy: std::sync::Mutex<HashMap<(String, u32, u32), u32>>,
}

impl Drop for Gpu {
    fn drop(&mut self) {
        let Some(p) = self.profile.take() else {
            return;
        };
        let p = p.into_inner().unwrap_or_else(|e| e.into_inner());
        let mut rows: Vec<_> = p.into_iter().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let total: f64 = rows.iter().map(|r| r.1 .1).sum();
        eprintln!("GPU time per kernel (MOEFLUX_CUDA_PROFILE), {total:.1} ms in all:");
        for (name, (count, ms)) in rows {
            eprintln!(
                "  {name:<34} {ms:>10.2} ms {:>5.1}% {count:>9} launches {:>8.2} us each",
                100.0 * ms / total.max(1e-9),
                1e3 * ms / count.max(1) as f64
            );
        }
    }
}

impl Gpu {
    /// Opens GPU 0 and loads the kernels (compiling them once per kernel
    /// source, architecture and NVRTC version; see [`ptx_cache_dir`]).
    pub fn open() -> Result<Gpu> {
        Gpu::open_ordinal(0)
    }

    /// Opens GPU `ordinal` (see [`Gpu::open`]).
    pub fn open_ordinal(ordinal: usize) -> Result<Gpu> {
        let info = probe_ordinal(ordinal)?;
        let ctx = CudaContext::new(info.ordinal).map_err(|e| gpu_err("cannot open GPU", e))?;
        // Synchronisation between the two streams is explicit (events).
        // SAFETY: no buffer of this context exists yet.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| gpu_err("GPU stream", e))?;
        let copy = ctx.new_stream().map_err(|e| gpu_err("GPU stream", e))?;
        let side = ctx.new_stream().map_err(|e| gpu_err("GPU stream", e))?;
        let ptx = load_or_compile(&info)?;
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(|e| gpu_err("loading the compiled kernels", e))?;
        let mut funcs = HashMap::new();
        for &name in KERNEL_NAMES {
            let f = module
                .load_function(name)
                .map_err(|e| gpu_err(&format!("kernel {name}"), e))?;
            funcs.insert(name, f);
        }
        let profile = std::env::var_os("MOEFLUX_CUDA_PROFILE")
            .is_some_and(|v| v != "0")
            .then(Default::default);
        let pdl = info.cc.0 >= 9 && std::env::var_os("MOEFLUX_CUDA_PDL").is_none_or(|v| v != "0");
        let mma = info.cc.0 >= 8 && std::env::var_os("MOEFLUX_CUDA_MMA").is_none_or(|v| v != "0");
        let skip: Vec<String> = std::env::var("MOEFLUX_CUDA_SKIP_KERNELS")
            .unwrap_or_default()
            .split(',')
            .filter(|p| !p.is_empty())
            .map(String::from)
            .collect();
        if !skip.is_empty() {
            eprintln!(
                "moeflux: MOEFLUX_CUDA_SKIP_KERNELS leaves out kernels {skip:?}: \
                 timing only, every output is wrong"
            );
        }
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT as SMS;
        let sms = ctx
            .attribute(SMS)
            .map_err(|e| gpu_err("GPU attribute", e))? as u32;
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN as SMEM;
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as DYN_SMEM;
        let smem_optin = ctx
            .attribute(SMEM)
            .map_err(|e| gpu_err("GPU attribute", e))?;
        for name in LARGE_SMEM_KERNELS {
            funcs[name]
                .set_attribute(DYN_SMEM, smem_optin)
                .map_err(|e| gpu_err(&format!("kernel {name}: shared memory"), e))?;
        }
        Ok(Gpu {
            info,
            ctx,
            stream,
            copy,
            side,
            on_side: Default::default(),
            side_stream: false,
            funcs,
            occupancy: Default::default(),
            profile,
            pdl,
            skip,
            sms,
            mma,
            q8: false,
            smem_optin: smem_optin as usize,
            workspace: Default::default(),
        })
    }

    /// Device address of the workspace, holding at least `bytes`. What an
    /// earlier call wrote there may be overwritten: it serves the launches
    /// of one call, in stream order. Growing it waits for the stream.
    pub fn workspace(&self, bytes: usize) -> Result<u64> {
        let mut ws = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        if ws.as_ref().is_none_or(|b| b.bytes() < bytes) {
            self.sync()?;
            *ws = None;
            *ws = Some(DevBuf::zeros(self, bytes.max(1 << 20).next_power_of_two())?);
        }
        Ok(ws.as_ref().expect("allocated above").ptr())
    }

    /// Device address of the workspace now (0 before the first use): a
    /// captured graph that used it is stale once this changes.
    pub fn workspace_ptr(&self) -> u64 {
        let ws = self.workspace.lock().unwrap_or_else(|e| e.into_inner());
        ws.as_ref().map_or(0, |b| b.ptr())
    }

    /// Makes the context current on the calling thread (every entry point
    /// that may run on a new thread calls this first).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| gpu_err("GPU context", e))
    }

    /// Blocks of `threads` threads of kernel `name` that one SM holds at
    /// once (its registers and shared memory decide), at least 1.
    pub fn blocks_per_sm(&self, name: &str, threads: u32) -> u32 {
        self.blocks_per_sm_smem(name, threads, 0)
    }

    /// [`Gpu::blocks_per_sm`] for launches with `smem` bytes of dynamic
    /// shared memory.
    pub fn blocks_per_sm_smem(&self, name: &str, threads: u32, smem: u32) -> u32 {
        let mut known = self.occupancy.lock().unwrap_or_else(|e| e.into_inner());
        *known
            .entry((name.to_string(), threads, smem))
            .or_insert_with(|| {
                let f = self.funcs.get(name).expect("kernel listed in KERNEL_NAMES");
                f.occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)
                    .unwrap_or(1)
                    .max(1)
            })
    }

    /// Launches kernel `name` on the compute stream (the side stream inside
    /// [`Gpu::beside`]). `params` point at the
    /// kernel's arguments, in order, with the kernel's exact types.
    ///
    /// # Safety
    /// The argument list must match the kernel's signature and every device
    /// pointer in it must hold what the kernel reads and writes.
    pub unsafe fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        if self.skip.iter().any(|p| name.starts_with(p.as_str())) {
            return Ok(());
        }
        let f = self.funcs.get(name).expect("kernel listed in KERNEL_NAMES");
        self.profiled(
            || format!("{name} [{}x{}]", grid.0, grid.1),
            || {
                self.raw_launch(f, grid, block, smem, params)
                    .map_err(|e| gpu_err(&format!("launching {name}"), e))
            },
        )
    }

    /// The stream launches go to: the compute stream, or the side stream
    /// inside [`Gpu::beside`].
    fn launch_stream(&self) -> &CudaStream {
        match self.on_side.load(std::sync::atomic::Ordering::Relaxed) {
            true => &self.side,
            false => &self.stream,
        }
    }

    /// Queues `queue`'s launches on the side stream, after everything the
    /// compute stream holds so far, so they run beside what the compute
    /// stream is given next; [`Gpu::rejoin`] orders the compute stream after
    /// them. (In a graph capture the side stream joins the capture here.)
    /// Launches only: `queue` must not copy or allocate on the compute
    /// stream, nor use the workspace, which the compute stream's launches
    /// share.
    pub fn beside(&self, queue: impl FnOnce() -> Result<()>) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        stream_wait(&self.side, &self.stream)?;
        self.on_side.store(true, Relaxed);
        let queued = queue();
        self.on_side.store(false, Relaxed);
        if queued.is_err() {
            // Joined even so: a capture must end with every stream joined.
            let _ = self.rejoin();
        }
        queued
    }

    /// Orders the compute stream after the side stream's work.
    pub fn rejoin(&self) -> Result<()> {
        stream_wait(&self.stream, &self.side)
    }

    /// Runs `queue` (which queues work on the compute stream); with
    /// `MOEFLUX_CUDA_PROFILE`, outside graph capture, waits for that work
    /// and adds its GPU time to the profile under `label()`.
    pub fn profiled(
        &self,
        label: impl FnOnce() -> String,
        queue: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        if let Some(p) = &self.profile {
            use cudarc::driver::sys::{CUevent_flags, CUstreamCaptureStatus};
            let stream = self.launch_stream();
            let capturing = stream.capture_status().map_err(|e| gpu_err("GPU", e))?
                != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
            if !capturing {
                let ev = |s: &CudaStream| {
                    s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                        .map_err(|e| gpu_err("GPU event", e))
                };
                let start = ev(stream)?;
                queue()?;
                let end = ev(stream)?;
                let label = label();
                let ms = start
                    .elapsed_ms(&end)
                    .map_err(|e| gpu_err(&format!("running {label}"), e))?;
                let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                let slot = p.entry(label).or_default();
                slot.0 += 1;
                slot.1 += ms as f64;
                return Ok(());
            }
        }
        queue()
    }

    /// Launches on [`Gpu::launch_stream`]; on Hopper and later with
    /// programmatic stream serialisation, so a kernel's launch overlaps the
    /// end of the previous one (every kernel waits for its predecessor
    /// first: `PDL_ENTER` in kernels/common.cuh).
    unsafe fn raw_launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> std::result::Result<(), result::DriverError> {
        if !self.pdl {
            return result::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                smem,
                self.launch_stream().cu_stream(),
                params,
            );
        }
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.launch_stream().cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
    }

    pub fn sync(&self) -> Result<()> {
        self.side.synchronize().map_err(|e| gpu_err("GPU", e))?;
        self.stream.synchronize().map_err(|e| gpu_err("GPU", e))
    }

    /// Device memory read bandwidth in GB/s: the best of a few full reads
    /// of a 1 GiB buffer (the roofline's denominator).
    pub fn hbm_read_gb_s(&self) -> Result<f64> {
        let bytes = 1usize << 30;
        let buf = DevBuf::zeros(self, bytes)?;
        let sink = DevBuf::zeros(self, 4)?;
        let (p, n, s) = (buf.ptr(), (bytes / 16) as i64, sink.ptr());
        let blocks = 4 * self.sms;
        let mut best = f64::MAX;
        for _ in 0..5 {
            self.sync()?;
            let t = std::time::Instant::now();
            // SAFETY: the buffer holds n 16-byte words; sink holds 4 bytes.
            unsafe { self.launch("read_probe", (blocks, 1, 1), 1024, 0, &mut args!(p, n, s))? };
            self.sync()?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best / 1e9)
    }

    /// Host-to-device bandwidth from pinned memory in GB/s (the ceiling of
    /// expert uploads): the best of a few 256 MiB copies.
    pub fn h2d_pinned_gb_s(&self) -> Result<f64> {
        let bytes = 256usize << 20;
        let mut host = vec![1u8; bytes];
        let pin = Pinned::register(self, &mut host)?;
        let dev = DevBuf::zeros(self, bytes)?;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            // SAFETY: `host` is pinned and outlives the synchronised copy.
            unsafe { copy_htod_async(&self.copy, dev.ptr(), &host)? };
            self.copy
                .synchronize()
                .map_err(|e| gpu_err("GPU copy", e))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        drop(pin);
        Ok(bytes as f64 / best / 1e9)
    }

    /// Bytes of device memory free now.
    pub fn free_bytes(&self) -> Result<usize> {
        self.bind()?;
        Ok(self.ctx.mem_get_info().map_err(|e| gpu_err("GPU", e))?.0)
    }
}

/// Builds the kernel argument list for [`Gpu::launch`]: `args!(a, b, c)`.
macro_rules! args {
    ($($a:expr),* $(,)?) => {
        [$( &$a as *const _ as *mut ::std::ffi::c_void ),*]
    };
}
pub(crate) use args;

/// Where compiled kernels are kept: `$MOEFLUX_CUDA_CACHE`, else
/// `$XDG_CACHE_HOME/moeflux/cuda`, else `~/.cache/moeflux/cuda`.
pub fn ptx_cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MOEFLUX_CUDA_CACHE") {
        return Some(PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("moeflux").join("cuda"))
}

/// The oldest architecture the kernels are written for (`sm_75`, Turing).
const MIN_ARCH: i32 = 75;

/// Architectures NVRTC 12 and 13 compile for, when the library cannot list
/// its own (`nvrtcGetSupportedArchs`).
const KNOWN_ARCHS: &[i32] = &[75, 80, 86, 87, 89, 90, 100, 120];

/// The architecture (major x 10 + minor) the kernels are compiled for on a
/// device of compute capability `cc`, among `supported` (what this NVRTC
/// compiles for): the newest one that is neither newer than the device nor
/// older than [`MIN_ARCH`]. The driver compiles PTX of an older
/// architecture for a newer device, so a card missing from every table
/// (8.7 Orin, 10.3, 12.1 GB10, the next one) gets its family's base (or an
/// earlier family's) instead of a failure. `Err` says why none fits.
pub(crate) fn pick_arch(cc: (i32, i32), supported: &[i32]) -> std::result::Result<i32, String> {
    let device = cc.0 * 10 + cc.1;
    if device < MIN_ARCH {
        return Err(format!(
            "compute capability {}.{} is older than sm_{MIN_ARCH}, the oldest architecture \
             moeflux's GPU kernels are written for",
            cc.0, cc.1
        ));
    }
    supported
        .iter()
        .copied()
        .filter(|&a| (MIN_ARCH..=device).contains(&a))
        .max()
        .ok_or_else(|| {
            let list: Vec<String> = supported.iter().map(|a| format!("sm_{a}")).collect();
            format!(
                "this NVRTC compiles for {}, none of them between sm_{MIN_ARCH} and the \
                 device's compute capability {}.{}",
                if list.is_empty() {
                    "no architecture".to_string()
                } else {
                    list.join(", ")
                },
                cc.0,
                cc.1
            )
        })
}

/// The architectures this NVRTC compiles for (major x 10 + minor).
fn nvrtc_archs() -> Vec<i32> {
    use cudarc::nvrtc::sys;
    // SAFETY: only called once the library was found; the array is sized
    // by the count NVRTC reports.
    unsafe {
        if !sys::is_culib_present() {
            return KNOWN_ARCHS.to_vec();
        }
        let mut n = 0;
        if sys::nvrtcGetNumSupportedArchs(&mut n).result().is_err() || n <= 0 {
            return KNOWN_ARCHS.to_vec();
        }
        let mut archs = vec![0; n as usize];
        match sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()).result() {
            Ok(()) => archs,
            Err(_) => KNOWN_ARCHS.to_vec(),
        }
    }
}

/// PTX of the kernels for `info`'s device, from the disk cache or compiled
/// now (and cached; a cache that cannot be written only costs the compile
/// next time).
fn load_or_compile(info: &GpuInfo) -> Result<String> {
    let arch = pick_arch(info.cc, &nvrtc_archs()).map_err(|why| {
        Error::Gpu(format!(
            "GPU {} ({}): {why}; run on the CPU with --backend cpu",
            info.ordinal, info.name
        ))
    })?;
    let source = kernel_source()?;
    let key = format!(
        "{:016x}-sm_{arch}.ptx",
        crate::hash::fnv1a(format!("{source}\0sm_{arch}\0{:?}", nvrtc_version()).as_bytes())
    );
    let cached = ptx_cache_dir().map(|d| d.join(&key));
    if let Some(text) = cached
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
    {
        return Ok(text);
    }
    let ptx = compile_source(&source, arch)?;
    if let Some(path) = cached {
        let _ = path
            .parent()
            .map(std::fs::create_dir_all)
            .map(|_| crate::fsutil::write_file_atomic(&path, |w| w.write_all(ptx.as_bytes())));
    }
    Ok(ptx)
}

/// NVRTC's version (major, minor), part of the cache key.
fn nvrtc_version() -> Option<(i32, i32)> {
    // SAFETY: only called after the library was found (it is loaded by the
    // compile path or here); plain out-parameters.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .ok()
        .map(|()| (major, minor))
}

/// Compiles the built-in kernels for architecture `arch` (major x 10 +
/// minor) with NVRTC.
pub fn compile(arch: i32) -> Result<String> {
    compile_source(&KERNELS, arch)
}

/// Compiles `source` (the kernel parts concatenated) for `arch` with NVRTC.
fn compile_source(source: &str, arch: i32) -> Result<String> {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Gpu(
            "NVRTC (libnvrtc.so) was not found: it compiles moeflux's GPU kernels".into(),
        ));
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=sm_{arch}"), "-std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| Error::Gpu(format!("compiling the GPU kernels for sm_{arch}: {e}")))?;
    Ok(ptx.to_src())
}

use std::io::Write as _;

/// A device allocation, freed on drop.
pub struct DevBuf {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    /// `bytes` of device memory, zeroed.
    pub fn zeros(gpu: &Gpu, bytes: usize) -> Result<DevBuf> {
        gpu.bind()?;
        let n = bytes.max(1);
        // SAFETY: a fresh allocation of n bytes, then zeroed.
        let ptr = unsafe { result::malloc_sync(n) }
            .map_err(|e| gpu_err(&format!("allocating {n} bytes of GPU memory"), e))?;
        let buf = DevBuf {
            ptr,
            bytes: n,
            ctx: gpu.ctx.clone(),
        };
        // SAFETY: the allocation holds n bytes.
        unsafe { result::memset_d8_sync(ptr, 0, n) }.map_err(|e| gpu_err("GPU memset", e))?;
        Ok(buf)
    }

    /// A device copy of `data`.
    pub fn from_slice<T: Copy>(gpu: &Gpu, data: &[T]) -> Result<DevBuf> {
        let buf = DevBuf::zeros(gpu, std::mem::size_of_val(data))?;
        buf.upload(data)?;
        Ok(buf)
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies `data` to the start of the buffer (synchronous).
    pub fn upload<T: Copy>(&self, data: &[T]) -> Result<()> {
        self.upload_at(0, data)
    }

    /// Copies `data` to byte `offset` of the buffer (synchronous).
    pub fn upload_at<T: Copy>(&self, offset: usize, data: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(data);
        assert!(
            offset + n <= self.bytes,
            "upload past the end of a GPU buffer"
        );
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside the allocation; the copy is synchronous.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, data) }
            .map_err(|e| gpu_err("copy to GPU", e))
    }

    /// Copies the start of the buffer into `out` (synchronous; call after the
    /// stream that wrote it is synchronised).
    pub fn download<T: Copy>(&self, out: &mut [T]) -> Result<()> {
        self.download_at(0, out)
    }

    pub fn download_at<T: Copy>(&self, offset: usize, out: &mut [T]) -> Result<()> {
        let n = std::mem::size_of_val(out);
        assert!(
            offset + n <= self.bytes,
            "download past the end of a GPU buffer"
        );
        if n == 0 {
            return Ok(());
        }
        // SAFETY: the range lies inside the allocation; the copy is synchronous.
        unsafe { result::memcpy_dtoh_sync(out, self.ptr + offset as u64) }
            .map_err(|e| gpu_err("copy from GPU", e))
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by malloc_sync in this context, freed once.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

// SAFETY: a device pointer is usable from any thread that binds the context.
unsafe impl Send for DevBuf {}
unsafe impl Sync for DevBuf {}

/// Copies `bytes` from `src` to `dst` on `stream` (device to device, async).
pub fn copy_dtod(stream: &CudaStream, dst: u64, src: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: callers pass ranges inside live allocations.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
        .map_err(|e| gpu_err("GPU copy", e))
}

/// Host memory the GPU can copy from at full speed: an existing allocation
/// registered as page-locked, unregistered on drop.
pub struct Pinned {
    ptr: *mut c_void,
    ctx: Arc<CudaContext>,
}

impl Pinned {
    /// Registers `mem` (which must outlive the returned value and not move).
    pub fn register(gpu: &Gpu, mem: &mut [u8]) -> Result<Pinned> {
        gpu.bind()?;
        let ptr = mem.as_mut_ptr() as *mut c_void;
        // SAFETY: the range is a live allocation of the caller's.
        unsafe { sys::cuMemHostRegister_v2(ptr, mem.len(), 0) }
            .result()
            .map_err(|e| gpu_err("pinning host memory", e))?;
        Ok(Pinned {
            ptr,
            ctx: gpu.ctx.clone(),
        })
    }
}

impl Pinned {
    /// [`Pinned::register`], portable: every GPU of the process copies
    /// from it at full speed (the host tier's arena, shared by a group).
    pub fn register_portable(gpu: &Gpu, mem: &mut [u8]) -> Result<Pinned> {
        gpu.bind()?;
        let ptr = mem.as_mut_ptr() as *mut c_void;
        // SAFETY: the range is a live allocation of the caller's.
        unsafe { sys::cuMemHostRegister_v2(ptr, mem.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) }
            .result()
            .map_err(|e| gpu_err("pinning host memory", e))?;
        Ok(Pinned {
            ptr,
            ctx: gpu.ctx.clone(),
        })
    }

    /// Registers read-only memory (e.g. a read-only file mapping) as pinned
    /// so every GPU of the process can copy from it at full speed (portable:
    /// the GPUs of a multi-GPU group share one host tier).
    pub fn register_read_only(gpu: &Gpu, mem: &[u8]) -> Result<Pinned> {
        gpu.bind()?;
        let ptr = mem.as_ptr() as *mut c_void;
        // SAFETY: the range is a live mapping of the caller's; the GPU only
        // reads it.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr,
                mem.len(),
                sys::CU_MEMHOSTREGISTER_READ_ONLY | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| gpu_err("pinning host memory", e))?;
        Ok(Pinned {
            ptr,
            ctx: gpu.ctx.clone(),
        })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered by `register`, unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr) }.result();
        }
    }
}

// SAFETY: only the registration is owned; the memory belongs to the caller.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

/// Sets `bytes` bytes at `dst` to zero on `stream`.
pub fn zero_async(stream: &CudaStream, dst: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: callers pass ranges inside live allocations.
    unsafe { result::memset_d8_async(dst, 0, bytes, stream.cu_stream()) }
        .map_err(|e| gpu_err("GPU memset", e))
}

/// A growable host buffer registered as pinned (the registration is
/// dropped before the memory it covers).
struct PinnedVec<T> {
    pin: Option<Pinned>,
    mem: Vec<T>,
}

impl<T: Copy + Default> PinnedVec<T> {
    fn new() -> Self {
        PinnedVec {
            pin: None,
            mem: Vec::new(),
        }
    }

    /// Room for at least `len` elements; growing first waits for the
    /// compute stream (a pending copy may still read the old memory).
    fn reserve(&mut self, gpu: &Gpu, len: usize) -> Result<()> {
        if self.mem.len() >= len {
            return Ok(());
        }
        gpu.sync()?;
        self.pin = None;
        self.mem = vec![T::default(); len];
        let bytes = std::mem::size_of_val(self.mem.as_slice());
        // SAFETY: viewing the buffer of plain values as bytes.
        let view =
            unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr() as *mut u8, bytes) };
        self.pin = Some(Pinned::register(gpu, view)?);
        Ok(())
    }
}

/// Pinned host memory for the small per-step uploads (token ids, position,
/// expert addresses), handed out bump-style and copied on the compute
/// stream. Regions are reused after [`PinnedArena::reset`], which callers
/// invoke only right after the compute stream was synchronised (so no copy
/// from the arena is pending).
pub struct PinnedArena {
    buf: PinnedVec<u64>,
    used: usize,
}

impl PinnedArena {
    pub fn new() -> PinnedArena {
        PinnedArena {
            buf: PinnedVec::new(),
            used: 0,
        }
    }

    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// Copies `data` to device address `dst` on the compute stream, through
    /// the arena.
    pub fn upload<T: Copy>(&mut self, gpu: &Gpu, dst: u64, data: &[T]) -> Result<()> {
        let n = std::mem::size_of_val(data);
        if n == 0 {
            return Ok(());
        }
        let start = self.used.next_multiple_of(16);
        if start + n > self.buf.mem.len() * 8 {
            self.buf
                .reserve(gpu, ((start + n) * 2).div_ceil(8).max(1 << 13))?;
        }
        // SAFETY: the range lies inside `mem`; `T: Copy` is plain data.
        let region = unsafe {
            let p = (self.buf.mem.as_mut_ptr() as *mut u8).add(start);
            std::ptr::copy_nonoverlapping(data.as_ptr() as *const u8, p, n);
            std::slice::from_raw_parts(p, n)
        };
        self.used = start + n;
        // SAFETY: pinned; not rewritten before the stream is synchronised
        // (see `reset`).
        unsafe { copy_htod_async(&gpu.stream, dst, region) }
    }
}

impl Default for PinnedArena {
    fn default() -> Self {
        Self::new()
    }
}

/// A pinned host buffer for results copied back from the GPU (pinned
/// copies run at full PCIe speed; pageable ones at a fraction).
pub struct PinnedDownload {
    buf: PinnedVec<f32>,
}

impl Default for PinnedDownload {
    fn default() -> Self {
        PinnedDownload {
            buf: PinnedVec::new(),
        }
    }
}

impl PinnedDownload {
    /// Copies `n` f32 from device address `src` once the compute stream has
    /// done everything before it.
    pub fn download_f32(&mut self, gpu: &Gpu, src: u64, n: usize) -> Result<Vec<f32>> {
        Ok(self.download_runs(gpu, &[(src, n)])?.remove(0))
    }

    /// Copies each run `(src, n)` of `n` 4-byte values once the compute
    /// stream has done everything before it: all in one wait (each
    /// synchronous copy would cost a round trip of its own).
    pub fn download_runs<T: bytemuck::Pod>(
        &mut self,
        gpu: &Gpu,
        runs: &[(u64, usize)],
    ) -> Result<Vec<Vec<T>>> {
        const { assert!(std::mem::size_of::<T>() == 4) };
        self.buf.reserve(gpu, runs.iter().map(|r| r.1).sum())?;
        let mut at = 0;
        for &(src, n) in runs {
            // SAFETY: `mem` holds these n values and is pinned; the stream
            // is synchronised before they are read.
            unsafe {
                result::memcpy_dtoh_async(
                    &mut self.buf.mem[at..at + n],
                    src,
                    gpu.stream.cu_stream(),
                )
            }
            .map_err(|e| gpu_err("copy from GPU", e))?;
            at += n;
        }
        gpu.sync()?;
        let mut at = 0;
        Ok(runs
            .iter()
            .map(|&(_, n)| {
                at += n;
                bytemuck::cast_slice(&self.buf.mem[at - n..at]).to_vec()
            })
            .collect())
    }
}

/// Starts recording what the compute stream is given into a CUDA graph
/// (nothing runs until the graph is launched); [`end_capture`] finishes.
pub fn begin_capture(gpu: &Gpu) -> Result<()> {
    use cudarc::driver::sys::CUstreamCaptureMode;
    gpu.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(|e| gpu_err("starting a CUDA graph capture", e))
}

/// Ends the capture begun by [`begin_capture`]; `recorded` is how the
/// launches went (an error there wins and drops the graph).
pub fn end_capture(gpu: &Gpu, recorded: Result<()>) -> Result<cudarc::driver::CudaGraph> {
    use cudarc::driver::sys::CUgraphInstantiate_flags;
    let graph = gpu
        .stream
        .end_capture(CUgraphInstantiate_flags(0))
        .map_err(|e| gpu_err("finishing a CUDA graph capture", e));
    recorded?;
    graph?.ok_or_else(|| Error::Gpu("CUDA graph capture recorded nothing".into()))
}

/// Copies host `src` (pinned for full speed) to device `dst` on `stream`.
///
/// # Safety
/// `src` must stay alive and unchanged until the stream has done the copy.
pub unsafe fn copy_htod_async(stream: &CudaStream, dst: u64, src: &[u8]) -> Result<()> {
    result::memcpy_htod_async(dst, src, stream.cu_stream()).map_err(|e| gpu_err("copy to GPU", e))
}

/// An event recorded on one stream that another stream waits for.
pub fn stream_wait(waiter: &CudaStream, after: &CudaStream) -> Result<()> {
    let ev = after
        .record_event(None)
        .map_err(|e| gpu_err("GPU event", e))?;
    waiter.wait(&ev).map_err(|e| gpu_err("GPU event", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts NVRTC compiles are `kernels/all.cuh`'s, in its order (the
    /// emulation and the micro-benchmark read that file), and each part
    /// ends its last line.
    #[test]
    fn kernel_parts_follow_all_cuh() {
        let listed: Vec<&str> = include_str!("kernels/all.cuh")
            .lines()
            .filter_map(|l| l.strip_prefix("#include \""))
            .map(|l| l.trim_end_matches('"'))
            .collect();
        let parts: Vec<&str> = KERNEL_PARTS.iter().map(|(name, _)| *name).collect();
        assert_eq!(parts, listed);
        for (name, text) in KERNEL_PARTS {
            assert!(text.ends_with('\n'), "{name}");
            assert!(
                !text.contains("#include \""),
                "{name}: NVRTC gets no include paths"
            );
        }
    }

    /// A kernel directory replaces the parts it holds, keeps the others,
    /// and refuses a file that names no part.
    #[test]
    fn kernel_dir_replaces_the_parts_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("qdot.cu"), "// variant qdot").unwrap();
        let (source, replaced) = kernel_source_from(dir.path()).unwrap();
        assert_eq!(replaced, ["qdot.cu"]);
        let built_in: String = KERNEL_PARTS
            .iter()
            .map(|(name, text)| {
                if *name == "qdot.cu" {
                    "// variant qdot\n"
                } else {
                    text
                }
            })
            .collect();
        assert_eq!(source, built_in);
        std::fs::write(dir.path().join("qdto.cu"), "").unwrap();
        let err = kernel_source_from(dir.path()).unwrap_err().to_string();
        assert!(err.contains("qdto.cu is not a kernel part"), "{err}");
        let missing = dir.path().join("absent");
        let err = kernel_source_from(&missing).unwrap_err().to_string();
        assert!(err.contains("absent"), "{err}");
    }

    /// The kernels compile for the GPU architectures moeflux targets. Needs
    /// NVRTC only (no GPU): CI installs it from PyPI (`nvidia-cuda-nvrtc`)
    /// and runs this with `--ignored`.
    #[test]
    #[ignore]
    fn kernels_compile_with_nvrtc() {
        // One thread per architecture: NVRTC compiles separate programs
        // concurrently, and this is one of CI's longer steps.
        std::thread::scope(|s| {
            for arch in [90, 80, MIN_ARCH] {
                s.spawn(move || {
                    let ptx = compile(arch).unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
                    for name in KERNEL_NAMES {
                        assert!(
                            ptx.contains(&format!(".entry {name}(")),
                            "sm_{arch}: kernel {name} missing from the PTX"
                        );
                    }
                });
            }
        });
        // Every architecture `pick_arch` can choose is one NVRTC lists.
        let listed = nvrtc_archs();
        assert!(
            listed.contains(&90) && listed.contains(&MIN_ARCH),
            "{listed:?}"
        );
    }

    #[test]
    fn unlisted_gpus_get_the_nearest_older_architecture() {
        // NVRTC 13.0's list, and an older NVRTC's without 8.7 and Blackwell.
        let cuda13 = [75, 80, 86, 87, 88, 89, 90, 100, 103, 110, 120, 121];
        let older = [75, 80, 86, 89, 90];
        for (cc, list, want) in [
            ((9, 0), &cuda13[..], 90),
            ((8, 7), &cuda13, 87),
            ((8, 7), &older, 86),
            ((10, 3), &cuda13, 103),
            ((10, 3), &[75, 80, 90, 100, 120], 100),
            ((12, 1), &cuda13, 121),
            ((12, 1), &older, 90),
            ((13, 0), &cuda13, 121),
            ((7, 5), &older, 75),
            ((8, 0), KNOWN_ARCHS, 80),
        ] {
            assert_eq!(pick_arch(cc, list), Ok(want), "cc {cc:?} with {list:?}");
        }
        // Older than the kernels: named, whatever NVRTC supports.
        let e = pick_arch((6, 1), &cuda13).unwrap_err();
        assert!(e.contains("6.1") && e.contains("sm_75"), "{e}");
        let e = pick_arch((7, 0), &[70, 75]).unwrap_err();
        assert!(e.contains("7.0"), "{e}");
        // An NVRTC that compiles for nothing the device can run.
        let e = pick_arch((8, 0), &[86, 90]).unwrap_err();
        assert!(e.contains("sm_86, sm_90") && e.contains("8.0"), "{e}");
        let e = pick_arch((8, 0), &[]).unwrap_err();
        assert!(e.contains("no architecture"), "{e}");
    }

    #[test]
    fn probe_never_panics() {
        // Either a GPU or a message saying why not.
        match probe() {
            Ok(info) => assert!(!info.name.is_empty()),
            Err(e) => assert!(matches!(e, Error::Gpu(_)), "{e}"),
        }
    }
}
