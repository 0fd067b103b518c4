//! The sequence state in VRAM: per layer a row cache (full attention's K
//! and V, or MLA's latent and rotary-key rows) or GatedDeltaNet's conv and
//! recurrent states, with copies to and from the host layout the CPU
//! backend and snapshots use.
//!
//! A full or MLA layer's row of position `p` is row `p`; a sliding-window
//! layer keeps its rows in a ring (`ring.rs`) bounded by its window plus
//! the largest chunk a step wrote, and drops rows by the host cache's rule
//! ([`trimmed_start`]), so both backends hold, download and can return to
//! the same positions.

use crate::error::{Error, Result};
use crate::model::state::{
    first_needed, trimmed_start, KvCache, LayerState, LinearState, MlaCache, ModelState,
    RewindState,
};

use super::device::{copy_dtod, zero_async, DevBuf, Gpu};
use super::ring;

/// Two buffers of rows that grow together: K and V (`a` and `b` rows of
/// `kv_heads * head_dim` floats), or MLA's normed latents (`kv_lora_rank`)
/// and rotated shared keys (`qk_rope_head_dim`).
pub(super) struct RowCache {
    pub a: DevBuf,
    pub b: DevBuf,
    /// Floats per row of `a` and of `b`.
    pub row_a: usize,
    pub row_b: usize,
    cap: usize,
    /// Rows held: positions `start..len` (`start > 0` only on a window
    /// layer, which drops the rows its window no longer sees).
    pub len: usize,
    pub start: usize,
    /// The layer's sliding window (`None`: full attention, or MLA).
    pub window: Option<usize>,
}

impl RowCache {
    pub fn new(gpu: &Gpu, row_a: usize, row_b: usize) -> Result<RowCache> {
        Ok(RowCache {
            a: DevBuf::zeros(gpu, 0)?,
            b: DevBuf::zeros(gpu, 0)?,
            row_a,
            row_b,
            cap: 0,
            len: 0,
            start: 0,
            window: None,
        })
    }

    /// The ring's capacity on a window layer (`None`: row = position).
    fn ring(&self) -> Option<usize> {
        self.window.map(|_| self.cap)
    }

    /// What the kernels mask a position with to find its row.
    pub fn mask(&self) -> i64 {
        ring::mask(self.ring())
    }

    /// Rows allocated in each buffer.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Whether dropping the rows from `n` on keeps what the token at `n`
    /// attends to.
    fn can_truncate(&self, n: usize) -> bool {
        n == 0 || (n <= self.len && self.start <= first_needed(self.window, n))
    }

    /// Keeps positions `..n` (checked by the caller, as `KvCache::truncate`).
    fn truncate(&mut self, n: usize) {
        if n == 0 {
            self.start = 0;
        }
        self.len = self.len.min(n);
    }

    /// Room for positions `start..end` (a window layer: in a ring; else
    /// rows `0..end`), keeping the rows held when `keep`; returns whether
    /// the buffers moved.
    fn make_room(&mut self, gpu: &Gpu, start: usize, end: usize, keep: bool) -> Result<bool> {
        let Some(cap) = ring::room(self.window, start, end, self.cap) else {
            return Ok(false);
        };
        let (a, b) = (
            DevBuf::zeros(gpu, 4 * cap * self.row_a)?,
            DevBuf::zeros(gpu, 4 * cap * self.row_b)?,
        );
        let new = self.window.map(|_| cap);
        if keep {
            for (from, to, rows) in ring::moves(self.start, self.len, self.ring(), new) {
                for (dst, src, row) in [(&a, &self.a, self.row_a), (&b, &self.b, self.row_b)] {
                    copy_dtod(
                        &gpu.stream,
                        dst.ptr() + (4 * to * row) as u64,
                        src.ptr() + (4 * from * row) as u64,
                        4 * rows * row,
                    )?;
                }
            }
        }
        gpu.sync()?;
        self.a = a;
        self.b = b;
        self.cap = cap;
        Ok(true)
    }

    /// Takes `n` more rows after the `len` held (room made now, before any
    /// graph replay writes them) and then drops, on a window layer, the
    /// rows the host cache would drop after this step: the ring keeps them
    /// until the step's writes wrap onto them, after its attention read
    /// them. Returns whether the buffers moved.
    fn grow(&mut self, gpu: &Gpu, n: usize) -> Result<bool> {
        let end = self.len + n;
        let moved = self.make_room(gpu, self.start, end, true)?;
        self.len = end;
        self.start = trimmed_start(self.window, self.start, end);
        Ok(moved)
    }

    /// Rows `from..len` of each buffer.
    fn download(&self, from: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = self.len - from;
        let mut a = vec![0.0f32; rows * self.row_a];
        let mut b = vec![0.0f32; rows * self.row_b];
        for r in ring::runs(from, self.len, self.ring()) {
            let i = r.pos - from;
            let (ha, hb) = (
                &mut a[i * self.row_a..(i + r.rows) * self.row_a],
                &mut b[i * self.row_b..(i + r.rows) * self.row_b],
            );
            self.a.download_at(4 * r.slot * self.row_a, ha)?;
            self.b.download_at(4 * r.slot * self.row_b, hb)?;
        }
        Ok((a, b))
    }

    /// Replaces the rows with host rows of positions `start..end`; returns
    /// whether the buffers moved.
    fn upload(
        &mut self,
        gpu: &Gpu,
        start: usize,
        end: usize,
        a: &[f32],
        b: &[f32],
    ) -> Result<bool> {
        let rows = end - start;
        if a.len() != rows * self.row_a || b.len() != rows * self.row_b {
            return Err(mismatch());
        }
        let moved = self.make_room(gpu, start, end, false)?;
        for r in ring::runs(start, end, self.ring()) {
            let i = r.pos - start;
            self.a.upload_at(
                4 * r.slot * self.row_a,
                &a[i * self.row_a..(i + r.rows) * self.row_a],
            )?;
            self.b.upload_at(
                4 * r.slot * self.row_b,
                &b[i * self.row_b..(i + r.rows) * self.row_b],
            )?;
        }
        self.start = start;
        self.len = end;
        Ok(moved)
    }

    /// A host copy of a K/V cache: the rows held, trimmed to the window as
    /// the CPU keeps them.
    fn download_kv(&self, from: usize) -> Result<KvCache> {
        let (k, v) = self.download(from)?;
        let mut kv = KvCache {
            k,
            v,
            row: self.row_a,
            start: from,
            window: self.window,
        };
        kv.trim();
        Ok(kv)
    }

    /// Takes a host K/V cache (of this layer's window; a full layer's holds
    /// every row).
    fn upload_kv(&mut self, gpu: &Gpu, h: &KvCache) -> Result<bool> {
        if h.window != self.window || (self.window.is_none() && h.start != 0) {
            return Err(mismatch());
        }
        self.upload(gpu, h.start, h.len(), &h.k, &h.v)
    }
}

pub(super) struct GpuLinearState {
    pub conv: DevBuf,
    pub ssm: DevBuf,
}

impl GpuLinearState {
    fn download(&self) -> Result<LinearState> {
        let mut conv = vec![0.0f32; self.conv.bytes() / 4];
        let mut ssm = vec![0.0f32; self.ssm.bytes() / 4];
        self.conv.download(&mut conv)?;
        self.ssm.download(&mut ssm)?;
        Ok(LinearState { conv, ssm })
    }

    fn upload(&self, h: &LinearState) -> Result<()> {
        if 4 * h.conv.len() != self.conv.bytes() || 4 * h.ssm.len() != self.ssm.bytes() {
            return Err(mismatch());
        }
        self.conv.upload(&h.conv)?;
        self.ssm.upload(&h.ssm)
    }
}

pub(super) enum GpuLayerState {
    /// Full attention: K in `a`, V in `b`.
    Full(RowCache),
    /// MLA: normed latents in `a`, rotated shared keys in `b`.
    Mla(RowCache),
    Linear(GpuLinearState),
}

impl GpuLayerState {
    /// The device addresses of its two buffers (K and V, latents and
    /// rotated keys, or the conv and recurrent states), as a decode batch's
    /// kernels take them from the sequence table.
    pub fn buffers(&self) -> [u64; 2] {
        match self {
            GpuLayerState::Full(c) | GpuLayerState::Mla(c) => [c.a.ptr(), c.b.ptr()],
            GpuLayerState::Linear(l) => [l.conv.ptr(), l.ssm.ptr()],
        }
    }

    /// The mask a kernel applies to a position to find its row in this
    /// layer's cache (`RowCache::mask`; all ones where there is none).
    pub fn row_mask(&self) -> i64 {
        match self {
            GpuLayerState::Full(c) | GpuLayerState::Mla(c) => c.mask(),
            GpuLayerState::Linear(_) => -1,
        }
    }

    /// The row cache of an attention layer.
    pub fn rows_mut(&mut self) -> Option<&mut RowCache> {
        match self {
            GpuLayerState::Full(c) | GpuLayerState::Mla(c) => Some(c),
            GpuLayerState::Linear(_) => None,
        }
    }
}

fn mismatch() -> Error {
    Error::Invalid("state does not match the model's layers".into())
}

/// Every layer's state of one sequence.
pub struct GpuState {
    pub(super) layers: Vec<GpuLayerState>,
    /// Unique per state: a captured graph holds its buffers' addresses.
    pub(super) id: u64,
}

impl GpuState {
    pub(super) fn new(layers: Vec<GpuLayerState>) -> GpuState {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        GpuState {
            layers,
            id: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Forgets the sequence: empty row caches, zero recurrent states (in
    /// place: buffers keep their addresses and capacity).
    pub(super) fn clear(&mut self, gpu: &Gpu) -> Result<()> {
        for s in &mut self.layers {
            match s {
                GpuLayerState::Full(c) | GpuLayerState::Mla(c) => {
                    c.len = 0;
                    c.start = 0;
                }
                GpuLayerState::Linear(ls) => {
                    zero_async(&gpu.stream, ls.conv.ptr(), ls.conv.bytes())?;
                    zero_async(&gpu.stream, ls.ssm.ptr(), ls.ssm.bytes())?;
                }
            }
        }
        gpu.sync()
    }

    /// Makes every row cache take `n` rows after its `start` rows (room made
    /// now, before any graph replay writes them); returns whether a buffer
    /// moved.
    pub(super) fn grow_for_eval(&mut self, gpu: &Gpu, start: usize, n: usize) -> Result<bool> {
        let mut moved = false;
        for c in self.layers.iter_mut().filter_map(GpuLayerState::rows_mut) {
            if c.len != start {
                return Err(Error::Invalid(format!(
                    "GPU attention cache holds {} rows, eval starts at {start}",
                    c.len
                )));
            }
            moved |= c.grow(gpu, n)?;
        }
        Ok(moved)
    }

    /// Rows allocated per layer for its attention cache (`None`: a linear
    /// layer): what a window layer's ring bounds.
    pub fn row_capacity(&self) -> Vec<Option<usize>> {
        self.layers
            .iter()
            .map(|s| match s {
                GpuLayerState::Full(c) | GpuLayerState::Mla(c) => Some(c.capacity()),
                GpuLayerState::Linear(_) => None,
            })
            .collect()
    }

    /// A host copy (the CPU backend's layout). The caller synchronises.
    pub(super) fn download(&self) -> Result<ModelState> {
        let layers = self
            .layers
            .iter()
            .map(|s| {
                Ok(match s {
                    GpuLayerState::Full(c) => LayerState::Full(c.download_kv(c.start)?),
                    GpuLayerState::Mla(c) => {
                        let (latent, rope) = c.download(0)?;
                        LayerState::Mla(MlaCache {
                            latent,
                            rope,
                            kv_lora_rank: c.row_a,
                            rope_dim: c.row_b,
                        })
                    }
                    GpuLayerState::Linear(ls) => LayerState::Linear(ls.download()?),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelState { layers })
    }

    /// What a checkpoint keeps: the linear-attention states and the rows
    /// the window layers see from the current position (as the host's
    /// [`ModelState::rewind_state`]).
    pub(super) fn rewind_state(&self) -> Result<RewindState> {
        let mut r = RewindState::default();
        for s in &self.layers {
            match s {
                GpuLayerState::Linear(ls) => r.linear.push(ls.download()?),
                GpuLayerState::Full(c) if c.window.is_some() => {
                    let from = first_needed(c.window, c.len).max(c.start);
                    r.windows.push(c.download_kv(from)?);
                }
                GpuLayerState::Full(_) | GpuLayerState::Mla(_) => {}
            }
        }
        Ok(r)
    }

    /// Whether the row caches alone can return to position `n` (see
    /// [`ModelState::can_truncate`]).
    pub fn can_truncate(&self, n: usize) -> bool {
        self.layers.iter().all(|s| match s {
            GpuLayerState::Full(c) => c.can_truncate(n),
            GpuLayerState::Mla(_) | GpuLayerState::Linear(_) => true,
        })
    }

    /// Replaces the state with a host copy (from `download` or a snapshot
    /// of either backend); returns whether a buffer moved. The caller
    /// synchronises first.
    pub(super) fn upload(&mut self, gpu: &Gpu, s: &ModelState) -> Result<bool> {
        if s.layers.len() != self.layers.len() {
            return Err(mismatch());
        }
        let mut moved = false;
        for (dst, src) in self.layers.iter_mut().zip(&s.layers) {
            match (dst, src) {
                (GpuLayerState::Full(c), LayerState::Full(h)) => {
                    moved |= c.upload_kv(gpu, h)?;
                }
                (GpuLayerState::Mla(c), LayerState::Mla(h)) => {
                    moved |= c.upload(gpu, 0, h.len(), &h.latent, &h.rope)?;
                }
                (GpuLayerState::Linear(ls), LayerState::Linear(h)) => ls.upload(h)?,
                _ => return Err(mismatch()),
            }
        }
        Ok(moved)
    }

    /// Returns to position `pos` as the host's [`ModelState::rewind`]: row
    /// caches keep the first `pos` positions (a window layer whose rows
    /// `pos` needs are gone takes `from`'s), linear layers take `from`'s
    /// states. Checked first: on error nothing changed. Returns whether a
    /// buffer moved.
    pub(super) fn rewind(
        &mut self,
        gpu: &Gpu,
        pos: usize,
        from: Option<&RewindState>,
    ) -> Result<bool> {
        // Checked before anything changes: a window layer whose rows are
        // gone needs rows from `from` that end at `pos`.
        let mut win = from.map(|f| f.windows.iter());
        for (i, s) in self.layers.iter().enumerate() {
            let GpuLayerState::Full(c) = s else { continue };
            if c.window.is_none() {
                continue;
            }
            let saved = win.as_mut().and_then(|w| w.next());
            if c.can_truncate(pos) {
                continue;
            }
            let fits = saved.is_some_and(|h| {
                h.len() == pos && h.row == c.row_a && h.start <= first_needed(c.window, pos)
            });
            if !fits {
                return Err(Error::Invalid(format!(
                    "layer {i}: its sliding window dropped the rows position {pos} needs, \
                     and no checkpoint at {pos} holds them"
                )));
            }
        }
        let mut lin = from.map(|f| f.linear.iter());
        let mut win = from.map(|f| f.windows.iter());
        let mut moved = false;
        for s in &mut self.layers {
            match s {
                GpuLayerState::Full(c) => {
                    let saved = match (c.window, &mut win) {
                        (Some(_), Some(w)) => w.next(),
                        _ => None,
                    };
                    match saved {
                        Some(h) if !c.can_truncate(pos) => moved |= c.upload_kv(gpu, h)?,
                        _ => c.truncate(pos),
                    }
                }
                GpuLayerState::Mla(c) => c.truncate(pos),
                GpuLayerState::Linear(ls) => {
                    if let Some(h) = lin.as_mut().and_then(|l| l.next()) {
                        ls.upload(h)?;
                    }
                }
            }
        }
        Ok(moved)
    }
}
