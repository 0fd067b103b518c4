//! [`ExpertBuf`]: a page-aligned heap buffer that expert reads land in.

use std::alloc::{self, Layout};
use std::fmt;
use std::ptr::NonNull;

use crate::format::EXPERT_ALIGN;

/// A 4096-aligned, zero-initialised heap buffer, reused across reads.
///
/// The alignment makes it a valid O_DIRECT destination and lets typed views
/// ([`ExpertBuf::u32s`] and friends) be checked against the absolute address
/// by checking the offset alone. The allocation is rounded up to a whole
/// number of 4096-byte pages (at least one), so `len` may be any value,
/// including 0.
pub struct ExpertBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: `ExpertBuf` uniquely owns its allocation (like `Vec<u8>`); shared
// references only hand out `&[u8]`, mutation needs `&mut self`.
unsafe impl Send for ExpertBuf {}
// SAFETY: see above; no interior mutability.
unsafe impl Sync for ExpertBuf {}

impl ExpertBuf {
    /// Alignment of every buffer (bytes).
    pub const ALIGN: usize = EXPERT_ALIGN;

    /// A zeroed buffer of `len` bytes, aligned to [`ExpertBuf::ALIGN`].
    ///
    /// # Panics
    /// If `len` rounded up to 4096 overflows `isize` (as `Vec` would);
    /// aborts via [`alloc::handle_alloc_error`] when out of memory.
    pub fn new(len: usize) -> Self {
        let cap = len
            .max(1)
            .checked_next_multiple_of(Self::ALIGN)
            .expect("ExpertBuf length overflows");
        let layout = Layout::from_size_align(cap, Self::ALIGN).expect("ExpertBuf layout is valid");
        // SAFETY: `layout` has non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        ExpertBuf { ptr, len, layout }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: the allocation holds at least `len` initialised bytes (it
        // was zeroed at creation) and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// `count` little-endian `u32`s starting `offset` bytes into the buffer,
    /// or `None` if the range is out of bounds or `offset` is not a multiple
    /// of 4.
    pub fn u32s(&self, offset: usize, count: usize) -> Option<&[u32]> {
        self.view(offset, count)
    }

    /// `count` `u16`s (e.g. bf16 bit patterns) starting `offset` bytes into
    /// the buffer, or `None` if out of bounds or `offset` is odd.
    pub fn u16s(&self, offset: usize, count: usize) -> Option<&[u16]> {
        self.view(offset, count)
    }

    /// `count` `f32`s starting `offset` bytes into the buffer, or `None` if
    /// out of bounds or `offset` is not a multiple of 4.
    pub fn f32s(&self, offset: usize, count: usize) -> Option<&[f32]> {
        self.view(offset, count)
    }

    fn view<T: bytemuck::Pod>(&self, offset: usize, count: usize) -> Option<&[T]> {
        let size = std::mem::size_of::<T>();
        if !offset.is_multiple_of(std::mem::align_of::<T>()) {
            return None;
        }
        let end = count.checked_mul(size)?.checked_add(offset)?;
        let bytes = self.as_bytes().get(offset..end)?;
        // The base is 4096-aligned and `offset` is aligned to `T`, so this
        // only fails on a bug; keep it checked anyway.
        bytemuck::try_cast_slice(bytes).ok()
    }
}

impl Drop for ExpertBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with exactly this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl Clone for ExpertBuf {
    fn clone(&self) -> Self {
        let mut b = ExpertBuf::new(self.len);
        b.as_bytes_mut().copy_from_slice(self.as_bytes());
        b
    }
}

impl fmt::Debug for ExpertBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpertBuf")
            .field("len", &self.len)
            .field("ptr", &self.ptr)
            .finish()
    }
}
