//! GPUDirect Storage (cuFile), loaded at run time like NCCL: expert misses
//! of files read with `O_DIRECT` go from the file straight into their VRAM
//! slots, with no pinned staging buffer and no host copy. Where the
//! `nvidia-fs` kernel module is loaded the NVMe controller writes into GPU
//! memory (peer-to-peer DMA); without it cuFile runs in compatibility mode
//! (its own `pread` into pinned memory and a copy), which does nothing the
//! plain path does not, so `Gds::Auto` uses cuFile only with `nvidia-fs`.
//!
//! The library is NVIDIA's `libcufile.so.0` (the `nvidia-cufile` wheel, or
//! the CUDA toolkit's `libcufile` package). cuFile reads its settings from
//! `/etc/cufile.json` or `CUFILE_ENV_PATH_JSON`, and writes `cufile.log` in
//! the working directory by default (`CUFILE_LOGFILE_PATH` moves it).

use std::ffi::{c_int, c_uint, c_void};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;

use crate::error::{Error, Result};
use crate::io::{ExpertStore, ExtentReader};

/// Whether expert misses read from the files use cuFile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Gds {
    /// Where it reads peer-to-peer: cuFile loads, its driver opens and the
    /// `nvidia-fs` kernel module is loaded; the plain path otherwise.
    #[default]
    Auto,
    /// Always (compatibility mode included); an error when cuFile cannot be
    /// loaded or opened.
    On,
    Off,
}

impl Gds {
    pub fn parse(s: &str) -> Option<Gds> {
        match s {
            "auto" => Some(Gds::Auto),
            "on" => Some(Gds::On),
            "off" => Some(Gds::Off),
            _ => None,
        }
    }
}

/// `CUfileError_t`: a cuFile status and, for driver errors, a `CUresult`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Status {
    err: c_int,
    cu_err: c_int,
}

/// `CUfileDescr_t` for a Linux file descriptor.
#[repr(C)]
struct Descr {
    kind: c_uint,
    /// The union `{ int fd; void *handle; }`.
    handle: *mut c_void,
    fs_ops: *const c_void,
}

const HANDLE_TYPE_OPAQUE_FD: c_uint = 1;

/// Where the `nvidia-fs` kernel module shows itself when loaded.
const NVFS_PROC: &str = "/proc/driver/nvidia-fs";

type Handle = *mut c_void;

struct Api {
    _lib: libloading::Library,
    handle_register: unsafe extern "C" fn(*mut Handle, *mut Descr) -> Status,
    handle_deregister: unsafe extern "C" fn(Handle),
    read: unsafe extern "C" fn(Handle, *mut c_void, usize, i64, i64) -> isize,
    /// The `nvidia-fs` kernel module's version, when it is loaded.
    nvfs: Option<(u32, u32)>,
}

/// Where cuFile is looked for: `MOEFLUX_CUFILE` (a path), else the soname
/// on the loader's path.
fn candidates() -> Vec<std::ffi::OsString> {
    let mut c: Vec<std::ffi::OsString> = Vec::new();
    if let Some(p) = std::env::var_os("MOEFLUX_CUFILE") {
        c.push(p);
    }
    c.push("libcufile.so.0".into());
    c.push("libcufile.so".into());
    c
}

/// How a user gets cuFile, for the error when it is missing.
pub const CUFILE_HINT: &str = "install NVIDIA's cuFile (`pip install nvidia-cufile`, then put its \
     nvidia/cufile/lib folder on LD_LIBRARY_PATH, or the CUDA toolkit's libcufile package), or \
     set MOEFLUX_CUFILE to the path of libcufile.so.0";

/// A cuFile status as text (the header's names for the common ones).
fn status_text(err: c_int) -> String {
    let name = match err {
        5001 => "driver not initialized",
        5004 => "driver version mismatch",
        5007 => "platform not supported",
        5008 => "IO not supported",
        5009 => "device not supported",
        5010 => "nvidia-fs driver error",
        5011 => "CUDA driver error",
        5012 => "invalid CUDA pointer",
        5015 => "CUDA context mismatch",
        5018 => "invalid file type",
        5019 => "invalid file open flag",
        5020 => "file not opened with O_DIRECT",
        5022 => "invalid value",
        _ => "",
    };
    if name.is_empty() {
        format!("cuFile error {err}")
    } else {
        format!("cuFile error {err} ({name})")
    }
}

fn load() -> std::result::Result<Api, String> {
    let lib = super::dynlib::open_first(candidates(), "cuFile")?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is cuFile's C declaration.
            unsafe { super::dynlib::function(&lib, $name, "cuFile") }?
        };
    }
    let driver_open: unsafe extern "C" fn() -> Status = sym!(b"cuFileDriverOpen\0");
    let get_properties: unsafe extern "C" fn(*mut c_void) -> Status =
        sym!(b"cuFileDriverGetProperties\0");
    // SAFETY: no arguments; opens cuFile's driver state for the process
    // (kept open until exit).
    let st = unsafe { driver_open() };
    if st.err != 0 {
        return Err(format!("cuFileDriverOpen: {}", status_text(st.err)));
    }
    // `CUfileDrvProps_t` begins with the nvidia-fs major and minor versions
    // (0 when the kernel module is not loaded); the buffer is larger than
    // any version of the struct.
    let mut props = [0u64; 64];
    // SAFETY: writes at most `sizeof(CUfileDrvProps_t)` bytes.
    let st = unsafe { get_properties(props.as_mut_ptr().cast()) };
    let nvfs = (st.err == 0)
        .then(|| (props[0] as u32, (props[0] >> 32) as u32))
        .filter(|&(major, _)| major > 0);
    Ok(Api {
        handle_register: sym!(b"cuFileHandleRegister\0"),
        handle_deregister: sym!(b"cuFileHandleDeregister\0"),
        read: sym!(b"cuFileRead\0"),
        nvfs,
        _lib: lib,
    })
}

/// The loaded library with its driver open, or why not.
fn api() -> std::result::Result<&'static Api, &'static str> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(String::as_str)
}

/// What `--gds` decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    /// Read through cuFile; how, for the startup line.
    Use(String),
    /// The plain path; with `Gds::Auto`, why not cuFile.
    Plain(Option<String>),
}

/// Decides for `mode`; an error when `Gds::On` cannot be honoured.
pub fn choose(mode: Gds) -> Result<Choice> {
    if mode == Gds::Off {
        return Ok(Choice::Plain(None));
    }
    // Without the kernel module `auto` would read the plain way anyway:
    // cuFile is not loaded at all (opening it writes `cufile.log` into the
    // working directory).
    if mode == Gds::Auto && !std::path::Path::new(NVFS_PROC).exists() {
        return Ok(Choice::Plain(Some(format!(
            "the nvidia-fs kernel module is not loaded ({NVFS_PROC} is missing)"
        ))));
    }
    match (api(), mode) {
        (
            Ok(Api {
                nvfs: Some((major, minor)),
                ..
            }),
            _,
        ) => Ok(Choice::Use(format!(
            "GPUDirect Storage (cuFile, nvidia-fs {major}.{minor})"
        ))),
        (Ok(_), Gds::On) => Ok(Choice::Use(
            "cuFile in compatibility mode (the nvidia-fs kernel module is not loaded)".into(),
        )),
        (Ok(_), _) => Ok(Choice::Plain(Some(
            "the nvidia-fs kernel module is not loaded (cuFile would only run in \
             compatibility mode)"
                .into(),
        ))),
        (Err(e), Gds::On) => Err(Error::Gpu(format!("--gds on: {e}: {CUFILE_HINT}"))),
        (Err(e), _) => Ok(Choice::Plain(Some(e.to_string()))),
    }
}

/// The expert files of a store registered with cuFile (one registration per
/// file, shared by the GPUs of a group): each file's descriptor and handle.
pub struct GdsFiles {
    api: &'static Api,
    handles: Vec<(c_int, usize)>,
}

// SAFETY: cuFile handles may be used from any thread (cuFile is thread
// safe); they are only deregistered on drop.
unsafe impl Send for GdsFiles {}
unsafe impl Sync for GdsFiles {}

impl GdsFiles {
    /// Registers every expert file of `store` read with `O_DIRECT`.
    pub fn register(store: &ExpertStore) -> Result<GdsFiles> {
        let api = api().map_err(|e| Error::Gpu(format!("{e}: {CUFILE_HINT}")))?;
        let mut files = GdsFiles {
            api,
            handles: Vec::new(),
        };
        for l in store.layers() {
            let Some(file) = store.direct_file(l) else {
                continue;
            };
            let mut descr = Descr {
                kind: HANDLE_TYPE_OPAQUE_FD,
                handle: file.as_raw_fd() as isize as *mut c_void,
                fs_ops: std::ptr::null(),
            };
            let mut h: Handle = std::ptr::null_mut();
            // SAFETY: a valid descriptor of an open file the store keeps
            // open; cuFile writes the handle.
            let st = unsafe { (api.handle_register)(&mut h, &mut descr) };
            if st.err != 0 {
                return Err(Error::Gpu(format!(
                    "registering the expert file of layer {l} with cuFile: {}",
                    status_text(st.err)
                )));
            }
            files.handles.push((file.as_raw_fd(), h as usize));
        }
        Ok(files)
    }

    fn handle(&self, fd: c_int) -> Option<Handle> {
        self.handles
            .iter()
            .find(|(f, _)| *f == fd)
            .map(|&(_, h)| h as Handle)
    }
}

impl Drop for GdsFiles {
    fn drop(&mut self) {
        for &(_, h) in &self.handles {
            // SAFETY: registered by `register`, deregistered once.
            unsafe { (self.api.handle_deregister)(h as Handle) };
        }
    }
}

/// Reads for one GPU: its context is made current on the I/O thread
/// (cuFile resolves device addresses in it).
pub struct GdsReader {
    pub files: Arc<GdsFiles>,
    pub ctx: Arc<CudaContext>,
}

impl ExtentReader for GdsReader {
    fn read(&self, file: &File, dst: u64, len: usize, offset: u64) -> std::io::Result<usize> {
        let h = self.files.handle(file.as_raw_fd()).ok_or_else(|| {
            std::io::Error::other("the expert file is not registered with cuFile")
        })?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| std::io::Error::other(format!("GPU context: {e}")))?;
        // SAFETY: `dst..dst+len` lies in a VRAM slot of this GPU that no
        // queued work reads (the cache picked it for this miss); the call
        // returns once the bytes are in device memory.
        let n = unsafe { (self.files.api.read)(h, dst as *mut c_void, len, offset as i64, 0) };
        match n {
            n if n >= 0 => Ok(n as usize),
            -1 => Err(std::io::Error::last_os_error()),
            n => Err(std::io::Error::other(status_text((-n) as c_int))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_auto_needs_the_kernel_module() {
        assert_eq!(Gds::parse("auto"), Some(Gds::Auto));
        assert_eq!(Gds::parse("on"), Some(Gds::On));
        assert_eq!(Gds::parse("off"), Some(Gds::Off));
        assert_eq!(Gds::parse("yes"), None);
        assert_eq!(choose(Gds::Off).unwrap(), Choice::Plain(None));
        if !std::path::Path::new(NVFS_PROC).exists() {
            // Decided without loading cuFile.
            match choose(Gds::Auto).unwrap() {
                Choice::Plain(Some(why)) => assert!(why.contains("nvidia-fs"), "{why}"),
                other => panic!("auto without nvidia-fs: {other:?}"),
            }
        }
    }
}
