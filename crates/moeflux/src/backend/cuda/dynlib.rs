//! Libraries loaded at run time beside the driver (NCCL, cuFile), so a
//! build needs none of them: the first of several names that loads, and
//! its functions by name.

use std::ffi::OsString;

/// Loads the first of `names` that the dynamic loader finds; the error
/// lists every name tried and why it failed.
pub fn open_first(names: Vec<OsString>, what: &str) -> Result<libloading::Library, String> {
    let mut tried = Vec::new();
    for name in names {
        // SAFETY: loading runs the library's initialisers, which for these
        // libraries only set themselves up.
        match unsafe { libloading::Library::new(&name) } {
            Ok(l) => return Ok(l),
            Err(e) => tried.push(format!("{}: {e}", name.to_string_lossy())),
        }
    }
    Err(format!("{what} could not be loaded ({})", tried.join("; ")))
}

/// The function `name` (NUL-terminated) of `lib`.
///
/// # Safety
/// `T` must be the function's C type.
pub unsafe fn function<T: Copy>(
    lib: &libloading::Library,
    name: &[u8],
    what: &str,
) -> Result<T, String> {
    // SAFETY: the caller guarantees the type.
    unsafe { lib.get::<T>(name) }.map(|f| *f).map_err(|e| {
        format!(
            "the {what} library lacks {}: {e}",
            String::from_utf8_lossy(&name[..name.len().saturating_sub(1)])
        )
    })
}
