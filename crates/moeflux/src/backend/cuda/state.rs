//! The sequence state in VRAM: per layer a row cache (full attention's K
//! and V, or MLA's latent and rotary-key rows; row = position) or
//! GatedDeltaNet's conv and recurrent states, with copies to and from the
//! host layout the CPU backend and snapshots use.

use crate::error::{Error, Result};
use crate::model::state::{KvCache, LayerState, LinearState, MlaCache, ModelState};

use super::device::{copy_dtod, zero_async, DevBuf, Gpu};

/// Two buffers of position-indexed rows that grow together by doubling:
/// K and V (`a` and `b` rows of `kv_heads * head_dim` floats), or MLA's
/// normed latents (`kv_lora_rank`) and rotated shared keys
/// (`qk_rope_head_dim`).
pub(super) struct RowCache {
    pub a: DevBuf,
    pub b: DevBuf,
    /// Floats per row of `a` and of `b`.
    pub row_a: usize,
    pub row_b: usize,
    cap: usize,
    pub len: usize,
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
        })
    }

    /// Room for at least `rows` rows, keeping the existing ones; returns
    /// whether the buffers moved.
    pub fn reserve(&mut self, gpu: &Gpu, rows: usize) -> Result<bool> {
        if rows <= self.cap {
            return Ok(false);
        }
        let cap = rows.next_power_of_two().max(256);
        let (a, b) = (
            DevBuf::zeros(gpu, 4 * cap * self.row_a)?,
            DevBuf::zeros(gpu, 4 * cap * self.row_b)?,
        );
        copy_dtod(
            &gpu.stream,
            a.ptr(),
            self.a.ptr(),
            4 * self.len * self.row_a,
        )?;
        copy_dtod(
            &gpu.stream,
            b.ptr(),
            self.b.ptr(),
            4 * self.len * self.row_b,
        )?;
        gpu.sync()?;
        self.a = a;
        self.b = b;
        self.cap = cap;
        Ok(true)
    }

    /// The first `len` rows of each buffer.
    fn download(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut a = vec![0.0f32; self.len * self.row_a];
        let mut b = vec![0.0f32; self.len * self.row_b];
        self.a.download(&mut a)?;
        self.b.download(&mut b)?;
        Ok((a, b))
    }

    /// Replaces the rows with `rows` rows from the host; returns whether
    /// the buffers moved.
    fn upload(&mut self, gpu: &Gpu, rows: usize, a: &[f32], b: &[f32]) -> Result<bool> {
        if a.len() != rows * self.row_a || b.len() != rows * self.row_b {
            return Err(mismatch());
        }
        let moved = self.reserve(gpu, rows)?;
        self.a.upload(a)?;
        self.b.upload(b)?;
        self.len = rows;
        Ok(moved)
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
                GpuLayerState::Full(c) | GpuLayerState::Mla(c) => c.len = 0,
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
            moved |= c.reserve(gpu, start + n)?;
            c.len = start + n;
        }
        Ok(moved)
    }

    /// A host copy (the CPU backend's layout). The caller synchronises.
    pub(super) fn download(&self) -> Result<ModelState> {
        let layers = self
            .layers
            .iter()
            .map(|s| {
                Ok(match s {
                    GpuLayerState::Full(c) => {
                        let (k, v) = c.download()?;
                        LayerState::Full(KvCache { k, v, row: c.row_a })
                    }
                    GpuLayerState::Mla(c) => {
                        let (latent, rope) = c.download()?;
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

    /// The linear-attention states only (checkpoints).
    pub(super) fn linear_states(&self) -> Result<Vec<LinearState>> {
        self.layers
            .iter()
            .filter_map(|s| match s {
                GpuLayerState::Linear(ls) => Some(ls.download()),
                GpuLayerState::Full(_) | GpuLayerState::Mla(_) => None,
            })
            .collect()
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
                    moved |= c.upload(gpu, h.len(), &h.k, &h.v)?;
                }
                (GpuLayerState::Mla(c), LayerState::Mla(h)) => {
                    moved |= c.upload(gpu, h.len(), &h.latent, &h.rope)?;
                }
                (GpuLayerState::Linear(ls), LayerState::Linear(h)) => ls.upload(h)?,
                _ => return Err(mismatch()),
            }
        }
        Ok(moved)
    }

    /// Keeps the first `pos` rows of every row cache and puts `linear` (one
    /// per linear layer, in order) into the linear layers.
    pub(super) fn rewind(&mut self, pos: usize, linear: &[LinearState]) -> Result<()> {
        let mut lin = linear.iter();
        for s in &mut self.layers {
            match s {
                GpuLayerState::Full(c) | GpuLayerState::Mla(c) => c.len = c.len.min(pos),
                GpuLayerState::Linear(ls) => {
                    if let Some(h) = lin.next() {
                        ls.upload(h)?;
                    }
                }
            }
        }
        Ok(())
    }
}
