//! NCCL, loaded at run time: the communicators of a multi-GPU run and the
//! collectives they use (a sum all-reduce of f32 for sharded MoE layers,
//! and grouped broadcasts that give every GPU the rows the others computed
//! in a prefill split by tokens).
//!
//! Why not cudarc's `nccl` feature: its loader looks for `libnccl.so` and
//! `libnccl.so.{1,9..13}`, but NVIDIA's `nvidia-nccl-cu13` wheel and the
//! distributions' `libnccl2` package ship only `libnccl.so.2` (the soname),
//! so it would miss exactly the installs users have. The ABI used here is
//! NCCL 2's stable C API: a handful of functions, declared below.
//!
//! NVLink multicast (NVLS) stays off: where `NCCL_NVLS_ENABLE` is unset it
//! is set to 0 before NCCL is loaded, and a value the environment gives is
//! never changed (on a shared host multicast objects can take every GPU
//! out of service). Nothing here calls `cuMulticastCreate`.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock, RwLock};

use cudarc::driver::CudaStream;

use crate::error::{Error, Result};

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub bytes: [u8; 128],
}

type RawComm = *mut c_void;
type NcclResult = c_int;
/// `ncclFloat32`, `ncclSum`.
const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

/// The functions used, resolved once from the loaded library.
struct Api {
    _lib: libloading::Library,
    version: i32,
    get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> NcclResult,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int) -> NcclResult,
    comm_init_all: unsafe extern "C" fn(*mut RawComm, c_int, *const c_int) -> NcclResult,
    comm_destroy: unsafe extern "C" fn(RawComm) -> NcclResult,
    comm_abort: unsafe extern "C" fn(RawComm) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> NcclResult,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        RawComm,
        *mut c_void,
    ) -> NcclResult,
    group_start: unsafe extern "C" fn() -> NcclResult,
    group_end: unsafe extern "C" fn() -> NcclResult,
}

/// Where NCCL is looked for: `MOEFLUX_NCCL` (a path), else the soname and
/// the development link, on the loader's path (`LD_LIBRARY_PATH`).
fn candidates() -> Vec<std::ffi::OsString> {
    let mut c: Vec<std::ffi::OsString> = Vec::new();
    if let Some(p) = std::env::var_os("MOEFLUX_NCCL") {
        c.push(p);
    }
    c.push("libnccl.so.2".into());
    c.push("libnccl.so".into());
    c
}

/// How a user gets NCCL, for the error when it is missing.
pub const NCCL_HINT: &str = "install NVIDIA's NCCL (`pip install nvidia-nccl-cu13`, then put its \
     nvidia/nccl/lib folder on LD_LIBRARY_PATH, or the CUDA toolkit's libnccl2 package), or set \
     MOEFLUX_NCCL to the path of libnccl.so.2";

fn load() -> std::result::Result<Api, String> {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: set before NCCL, which reads it, is loaded; moeflux reads
        // no environment concurrently here (the model is being opened).
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let lib = super::dynlib::open_first(candidates(), "NCCL")?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is NCCL 2's C declaration.
            unsafe { super::dynlib::function(&lib, $name, "NCCL") }?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult = sym!(b"ncclGetVersion\0");
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { get_version(&mut version) };
    if version < 21800 {
        return Err(format!(
            "NCCL {version} is too old (2.18 or newer is needed)"
        ));
    }
    Ok(Api {
        version,
        get_error_string: sym!(b"ncclGetErrorString\0"),
        get_unique_id: sym!(b"ncclGetUniqueId\0"),
        comm_init_rank: sym!(b"ncclCommInitRank\0"),
        comm_init_all: sym!(b"ncclCommInitAll\0"),
        comm_destroy: sym!(b"ncclCommDestroy\0"),
        comm_abort: sym!(b"ncclCommAbort\0"),
        all_reduce: sym!(b"ncclAllReduce\0"),
        broadcast: sym!(b"ncclBroadcast\0"),
        group_start: sym!(b"ncclGroupStart\0"),
        group_end: sym!(b"ncclGroupEnd\0"),
        _lib: lib,
    })
}

/// The loaded library, or why it could not be loaded (with where to get
/// it).
fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load)
        .as_ref()
        .map_err(|e| Error::Gpu(format!("{e}: {NCCL_HINT}")))
}

/// NCCL's version as `major.minor.patch` (loading it if needed).
pub fn version() -> Result<String> {
    let v = api()?.version;
    Ok(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}

fn check(what: &str, r: NcclResult) -> Result<()> {
    if r == 0 {
        return Ok(());
    }
    let msg = api()
        .ok()
        .map(|a| {
            // SAFETY: NCCL returns a static string for any result code.
            let s = unsafe { (a.get_error_string)(r) };
            if s.is_null() {
                format!("error {r}")
            } else {
                // SAFETY: a NUL-terminated static string.
                unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
            }
        })
        .unwrap_or_else(|| format!("error {r}"));
    Err(Error::Gpu(format!("NCCL {what}: {msg}")))
}

/// A new unique id (rank 0 of a group makes it; the others receive it).
pub fn unique_id() -> Result<UniqueId> {
    let a = api()?;
    let mut id = UniqueId { bytes: [0; 128] };
    // SAFETY: writes the 128-byte id.
    check("unique id", unsafe { (a.get_unique_id)(&mut id) })?;
    Ok(id)
}

/// Set once any communicator of a group was aborted: the others refuse
/// work (their peers are gone) and skip their destroy.
#[derive(Clone, Default)]
pub struct AbortFlag(Arc<RwLock<bool>>);

impl AbortFlag {
    fn aborted(&self) -> bool {
        *self.0.read().unwrap_or_else(|e| e.into_inner())
    }
}

/// One rank's communicator. Collectives are queued on the caller's stream.
pub struct Comm {
    raw: RawComm,
    pub rank: usize,
    pub world: usize,
    flag: AbortFlag,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time
// (`&mut self` or a single owner thread per rank).
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Communicators for the GPUs `ordinals` of this process, one per GPU
    /// (rank i on `ordinals[i]`), sharing one abort flag.
    pub fn init_all(ordinals: &[usize]) -> Result<Vec<Comm>> {
        let a = api()?;
        let devs: Vec<c_int> = ordinals.iter().map(|&o| o as c_int).collect();
        let mut raw = vec![std::ptr::null_mut(); devs.len()];
        // SAFETY: `raw` holds one handle per device of `devs`.
        check("init", unsafe {
            (a.comm_init_all)(raw.as_mut_ptr(), devs.len() as c_int, devs.as_ptr())
        })?;
        let flag = AbortFlag::default();
        Ok(raw
            .into_iter()
            .enumerate()
            .map(|(rank, raw)| Comm {
                raw,
                rank,
                world: devs.len(),
                flag: flag.clone(),
            })
            .collect())
    }

    /// Rank `rank` of `world` in the group `id` names (one per process);
    /// the calling thread's current CUDA context picks the GPU. Blocks until
    /// every rank has joined.
    pub fn init_rank(id: &UniqueId, rank: usize, world: usize) -> Result<Comm> {
        let a = api()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: writes one handle.
        check("init", unsafe {
            (a.comm_init_rank)(&mut raw, world as c_int, *id, rank as c_int)
        })?;
        Ok(Comm {
            raw,
            rank,
            world,
            flag: AbortFlag::default(),
        })
    }

    /// `recv[i] = sum over ranks of send[i]` for `count` floats, queued on
    /// `stream` (`send == recv` reduces in place).
    pub fn all_reduce_f32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        let _guard = self.live()?;
        let a = api()?;
        // SAFETY: `send` and `recv` are device buffers of `count` floats on
        // this rank's GPU, valid until `stream` has run the reduction; the
        // read lock keeps the communicator from being aborted meanwhile.
        check("all-reduce", unsafe {
            (a.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                NCCL_FLOAT32,
                NCCL_SUM,
                self.raw,
                stream.cu_stream() as *mut c_void,
            )
        })
    }

    /// Every rank's rows of `bufs` onto every rank, in place: a buffer
    /// `(ptr, width)` holds rows of `width` floats, rank `r` computed rows
    /// `rows[r]` of each, and they are broadcast from it. One NCCL group
    /// for all the broadcasts, queued on `stream`.
    pub fn share_rows(
        &self,
        bufs: &[(u64, usize)],
        rows: &[std::ops::Range<usize>],
        stream: &CudaStream,
    ) -> Result<()> {
        let _guard = self.live()?;
        let a = api()?;
        // SAFETY: no arguments; paired with the group end below.
        check("group start", unsafe { (a.group_start)() })?;
        let mut queued = Ok(());
        'all: for &(buf, width) in bufs {
            for (root, r) in rows.iter().enumerate() {
                let at = buf + (4 * r.start * width) as u64;
                // SAFETY: every rank's `buf` holds all rows of `width`
                // floats on its GPU, valid until `stream` has run the
                // group; in place (send == recv), as NCCL allows.
                queued = check("broadcast", unsafe {
                    (a.broadcast)(
                        at as *const c_void,
                        at as *mut c_void,
                        r.len() * width,
                        NCCL_FLOAT32,
                        root as c_int,
                        self.raw,
                        stream.cu_stream() as *mut c_void,
                    )
                });
                if queued.is_err() {
                    break 'all;
                }
            }
        }
        // SAFETY: closes the group opened above, whatever was queued.
        let ended = check("group end", unsafe { (a.group_end)() });
        queued.and(ended)
    }

    /// A read lock on the abort flag while a collective is queued (an
    /// abort waits for it), or the error of a group already stopped.
    fn live(&self) -> Result<std::sync::RwLockReadGuard<'_, bool>> {
        let guard = self.flag.0.read().unwrap_or_else(|e| e.into_inner());
        if *guard {
            return Err(Error::Gpu(
                "another GPU of this group failed; the group is stopped".into(),
            ));
        }
        Ok(guard)
    }

    /// What aborts this group from any thread (see [`Aborter::abort`]).
    pub fn aborter(&self) -> Aborter {
        Aborter {
            raw: self.raw as usize,
            flag: self.flag.clone(),
        }
    }
}

/// Aborts a rank's communicator from another thread: the queued
/// collectives of every rank stop waiting for it, so a rank whose step
/// failed does not leave its peers blocked forever.
#[derive(Clone)]
pub struct Aborter {
    raw: usize,
    flag: AbortFlag,
}

impl Aborter {
    /// Aborts every communicator of `group` once (the first call wins).
    pub fn abort(group: &[Aborter]) {
        let Some(first) = group.first() else {
            return;
        };
        {
            // Waits out an all-reduce being queued; none is queued after.
            let mut done = first.flag.0.write().unwrap_or_else(|e| e.into_inner());
            if *done {
                return;
            }
            *done = true;
        }
        // Outside the lock: NCCL's abort can hang (freeing memory a dead
        // peer process mapped), and the flag's readers must not wait on it.
        if let Ok(a) = api() {
            for c in group {
                // SAFETY: a live communicator (never destroyed while the
                // flag was clear), aborted once.
                unsafe { (a.comm_abort)(c.raw as RawComm) };
            }
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if self.flag.aborted() {
            return;
        }
        if let Ok(a) = api() {
            // SAFETY: created by init, destroyed once.
            unsafe { (a.comm_destroy)(self.raw) };
        }
    }
}
