//! Platform hooks: uncached opens and page-cache advice. Everything here
//! degrades to "not supported" instead of failing to compile on unixes that
//! lack the call.

use std::fs::File;
use std::io;
use std::path::Path;

pub(super) fn open_buffered(path: &Path) -> io::Result<File> {
    File::open(path)
}

/// Opens `path` read-only bypassing the page cache: `O_DIRECT` where it
/// exists, `F_NOCACHE` on Apple platforms, `Unsupported` elsewhere.
pub(super) fn open_direct(path: &Path) -> io::Result<File> {
    #[cfg(test)]
    if tests_hook::refuse_direct() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    open_direct_impl(path)
}

#[cfg(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "dragonfly",
    target_os = "netbsd",
))]
fn open_direct_impl(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(target_vendor = "apple")]
fn open_direct_impl(path: &Path) -> io::Result<File> {
    use std::os::fd::AsRawFd;
    let f = File::open(path)?;
    // SAFETY: plain fcntl on a descriptor we own.
    if unsafe { libc::fcntl(f.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(f)
}

#[cfg(not(any(
    target_os = "linux",
    target_os = "android",
    target_os = "freebsd",
    target_os = "dragonfly",
    target_os = "netbsd",
    target_vendor = "apple",
)))]
fn open_direct_impl(_path: &Path) -> io::Result<File> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "uncached reads are not supported on this platform",
    ))
}

/// Whether an error from [`open_direct`] or from a first uncached read means
/// "this file system (or platform) does not do direct I/O": fall back to
/// buffered reads rather than fail.
pub(super) fn direct_refused(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL) || e.kind() == io::ErrorKind::Unsupported
}

/// Tells the kernel accesses to `file` are random: no readahead.
/// Returns `Ok(false)` where there is no such advice.
pub(super) fn advise_random(file: &File) -> io::Result<bool> {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    {
        fadvise(file, libc::POSIX_FADV_RANDOM).map(|()| true)
    }
    #[cfg(target_vendor = "apple")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: plain fcntl on a descriptor we own.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDAHEAD, 0) } == -1 {
            return Err(io::Error::last_os_error());
        }
        Ok(true)
    }
    #[cfg(not(any(
        target_os = "linux",
        target_os = "android",
        target_os = "freebsd",
        target_vendor = "apple",
    )))]
    {
        let _ = file;
        Ok(false)
    }
}

/// Drops the cached pages of `file` (clean, unmapped ones). Returns
/// `Ok(false)` where there is no such advice.
pub(super) fn evict(file: &File) -> io::Result<bool> {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    {
        fadvise(file, libc::POSIX_FADV_DONTNEED).map(|()| true)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    {
        let _ = file;
        Ok(false)
    }
}

/// Whether every page of `mem` (inside a file mapping) is in the page
/// cache (`mincore`). `false` where that cannot be asked.
pub(super) fn resident(mem: &[u8]) -> bool {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        const PAGE: usize = 4096;
        let start = mem.as_ptr() as usize;
        let aligned = start & !(PAGE - 1);
        let len = mem.len() + (start - aligned);
        let mut pages = vec![0u8; len.div_ceil(PAGE)];
        // SAFETY: the range lies inside a live mapping (it is borrowed) and
        // `pages` holds one byte per page of it.
        let rc = unsafe { libc::mincore(aligned as *mut libc::c_void, len, pages.as_mut_ptr()) };
        rc == 0 && pages.iter().all(|&p| p & 1 == 1)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        let _ = mem;
        false
    }
}

/// Starts reading `len` bytes at `offset` of `file` into the page cache
/// in the background (`POSIX_FADV_WILLNEED`): one large request instead of
/// a page fault at a time. A no-op where the advice does not exist.
pub(super) fn will_need(file: &File, offset: u64, len: u64) -> io::Result<()> {
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
    {
        fadvise_range(file, offset, len, libc::POSIX_FADV_WILLNEED)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android", target_os = "freebsd")))]
    {
        let _ = (file, offset, len);
        Ok(())
    }
}

#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn fadvise(file: &File, advice: libc::c_int) -> io::Result<()> {
    // Offset 0, len 0: the whole file.
    fadvise_range(file, 0, 0, advice)
}

#[cfg(any(target_os = "linux", target_os = "android", target_os = "freebsd"))]
fn fadvise_range(file: &File, offset: u64, len: u64, advice: libc::c_int) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: advisory call on a descriptor we own.
    let rc = unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            advice,
        )
    };
    // posix_fadvise returns the error number instead of setting errno.
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(rc))
    }
}

/// Whether `MADV_POPULATE_READ` must not be used: only where tests make it
/// look unsupported, to exercise the page-by-page path older kernels take.
pub(super) fn populate_refused() -> bool {
    #[cfg(test)]
    {
        tests_hook::refuse_populate()
    }
    #[cfg(not(test))]
    {
        false
    }
}

#[cfg(test)]
pub(super) mod tests_hook {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Process-wide: populate runs on the I/O threads. Harmless to other
    /// tests, whose files are intact (the fallback reads the same bytes).
    static REFUSE_POPULATE: AtomicBool = AtomicBool::new(false);

    pub(in crate::io) fn set_refuse_populate(on: bool) {
        REFUSE_POPULATE.store(on, Ordering::Relaxed);
    }

    pub(super) fn refuse_populate() -> bool {
        REFUSE_POPULATE.load(Ordering::Relaxed)
    }

    thread_local! {
        static REFUSE_DIRECT: Cell<bool> = const { Cell::new(false) };
    }

    /// Makes `open_direct` on this thread fail like tmpfs used to (EINVAL).
    pub(in crate::io) fn set_refuse_direct(on: bool) {
        REFUSE_DIRECT.with(|c| c.set(on));
    }

    pub(super) fn refuse_direct() -> bool {
        REFUSE_DIRECT.with(|c| c.get())
    }
}
