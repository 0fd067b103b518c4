//! Resident dense weights: `dense.safetensors` memory-mapped, every tensor
//! checked against the manifest and the architecture's schema at open; the
//! descriptors blocks hold ([`LinearRef`] into the mapped file, [`VectorRef`]
//! into the f32 vectors decoded at load), which every backend resolves.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::config::{ModelConfig, QuantSpec};
use crate::error::{Error, Result};
use crate::format::{Manifest, TensorEntry};
use crate::model::schema::{self, WeightKind};
use crate::quant::interleave::{interleave_affine, OwnedAffine4x8};
use crate::quant::{affine, DenseData, DenseMatrix, QMatrix, ScaleData, Weight};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    U32,
    Bf16,
    F32,
}

impl DType {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "U32" => Some(DType::U32),
            "BF16" => Some(DType::Bf16),
            "F32" => Some(DType::F32),
            _ => None,
        }
    }
    fn size(self) -> usize {
        match self {
            DType::Bf16 => 2,
            DType::U32 | DType::F32 => 4,
        }
    }
}

/// Where a tensor lives in the mapped file.
#[derive(Debug, Clone, Copy)]
pub struct TensorLoc {
    pub dtype: DType,
    pub offset: usize,
    pub elems: usize,
}

/// A linear layer's tensors; `view` turns it into a `Weight` borrowing the map.
#[derive(Debug, Clone, Copy)]
pub struct LinearRef {
    pub rows: usize,
    pub cols: usize,
    pub weight: TensorLoc,
    /// `(spec, scales, biases)` when quantized.
    pub quant: Option<(QuantSpec, TensorLoc, TensorLoc)>,
}

/// A float vector of the model (norm weights, biases, conv taps, router
/// correction bias, ...), decoded to f32 once at load into [`Weights`]'
/// vector arena (the GPU uploads the arena as one buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VectorRef {
    /// First float in the arena (a multiple of [`VECTOR_ALIGN`]).
    pub offset: usize,
    pub len: usize,
}

/// Floats each vector's start is aligned to in the arena (256 bytes, so a
/// kernel may read any vector with wide loads).
pub const VECTOR_ALIGN: usize = 64;

/// What a model's block descriptors point into: the mapped dense file
/// (matrices, by [`LinearRef`]) and the f32 vector arena (by [`VectorRef`]).
pub struct Weights {
    pub dense: DenseStore,
    floats: Vec<f32>,
    /// Interleaved copies of 4-bit affine linears, by the offset of their
    /// codes in the dense file (a CPU session's, see
    /// [`Weights::interleave_affine`]).
    interleaved: BTreeMap<usize, OwnedAffine4x8>,
}

impl Weights {
    /// A borrowed view of a linear layer for the CPU kernels (its
    /// interleaved copy where there is one).
    pub fn view(&self, l: &LinearRef) -> Weight<'_> {
        match self.interleaved.get(&l.weight.offset) {
            Some(m) => Weight::Affine4x8(m.view()),
            None => self.dense.view(l),
        }
    }

    /// Makes eight-row interleaved copies of those of `linears` that are
    /// 4-bit affine in groups of a multiple of 64 (the others stay as they
    /// are), which [`Weights::view`] then returns: the CPU's 8-bit-activation
    /// products stream them faster with the same results. Returns how many
    /// were made and their bytes.
    pub fn interleave_affine(&mut self, linears: &[LinearRef]) -> (usize, u64) {
        let (mut count, mut bytes) = (0, 0u64);
        for l in linears {
            if self.interleaved.contains_key(&l.weight.offset) {
                continue;
            }
            let Weight::Quantized(q) = self.dense.view(l) else {
                continue;
            };
            if let Ok(m) = interleave_affine(&q) {
                bytes += (m.codes.len() + 2 * m.params.len()) as u64;
                count += 1;
                self.interleaved.insert(l.weight.offset, m);
            }
        }
        (count, bytes)
    }

    pub fn vector(&self, v: VectorRef) -> &[f32] {
        &self.floats[v.offset..v.offset + v.len]
    }

    /// The whole vector arena (offsets of [`VectorRef`]s index it).
    pub fn arena(&self) -> &[f32] {
        &self.floats
    }
}

/// Builds [`Weights`] while a model's blocks are loaded: matrices are
/// checked and referenced in place, vectors decoded into the arena.
pub struct WeightsLoader {
    dense: DenseStore,
    floats: Vec<f32>,
}

impl WeightsLoader {
    pub fn new(dense: DenseStore) -> Self {
        WeightsLoader {
            dense,
            floats: Vec::new(),
        }
    }

    /// The linear layer `module` with the expected `[rows, cols]`.
    pub fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<LinearRef> {
        self.dense.linear(module, rows, cols)
    }

    /// The float tensor `name` of exactly `shape`, decoded into the arena.
    pub fn vector(&mut self, name: &str, shape: &[usize]) -> Result<VectorRef> {
        let v = self.dense.floats(name, shape)?;
        let offset = self.floats.len().next_multiple_of(VECTOR_ALIGN);
        self.floats.resize(offset, 0.0);
        self.floats.extend_from_slice(&v);
        Ok(VectorRef {
            offset,
            len: v.len(),
        })
    }

    pub fn finish(self) -> Weights {
        Weights {
            dense: self.dense,
            floats: self.floats,
            interleaved: BTreeMap::new(),
        }
    }
}

pub struct DenseStore {
    path: PathBuf,
    /// Kept open to see the file shrink under the map ([`DenseStore::check_unchanged`]).
    file: File,
    map: Mmap,
    tensors: BTreeMap<String, (TensorLoc, Vec<usize>)>,
    quantized: BTreeMap<String, QuantSpec>,
}

impl DenseStore {
    /// Maps the dense file and validates the manifest's table against the
    /// safetensors header.
    pub fn open(dir: &Path, manifest: &Manifest) -> Result<Self> {
        let path = crate::format::resolve_in_dir(dir, &manifest.dense_file, "dense_file")?;
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the file is opened read-only; moeflux never writes a model
        // directory in place (convert renames a complete one into place).
        // The dense file must not be truncated or rewritten while a model
        // is loaded: a page past a shrunk end faults (SIGBUS). Sessions
        // check its size before each eval (`check_unchanged`).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let st = safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| Error::format(&path, format!("not a valid safetensors file: {e}")))?;
        let base = map.as_ptr() as usize;
        let mut tensors = BTreeMap::new();
        for (name, entry) in &manifest.tensors {
            let view = st.tensor(name).map_err(|_| {
                Error::tensor(
                    &path,
                    name,
                    "listed in moeflux.json but missing from the file",
                )
            })?;
            let loc = Self::check_entry(&path, name, entry, &view, base)?;
            tensors.insert(name.clone(), (loc, entry.shape.clone()));
        }
        Ok(DenseStore {
            path,
            file,
            map,
            tensors,
            quantized: manifest.quantized.clone(),
        })
    }

    fn check_entry(
        path: &Path,
        name: &str,
        entry: &TensorEntry,
        view: &safetensors::tensor::TensorView,
        base: usize,
    ) -> Result<TensorLoc> {
        let dtype = DType::parse(&entry.dtype).ok_or_else(|| {
            Error::tensor(
                path,
                name,
                format!("dtype {} is not supported", entry.dtype),
            )
        })?;
        let file_dtype = format!("{:?}", view.dtype());
        if file_dtype != entry.dtype {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "dtype is {file_dtype} in the file but {} in moeflux.json",
                    entry.dtype
                ),
            ));
        }
        if view.shape() != entry.shape.as_slice() {
            return Err(Error::tensor(
                path,
                name,
                format!(
                    "shape is {:?} in the file but {:?} in moeflux.json",
                    view.shape(),
                    entry.shape
                ),
            ));
        }
        let data = view.data();
        let offset = data.as_ptr() as usize - base;
        if offset as u64 != entry.offset || data.len() as u64 != entry.bytes {
            return Err(Error::tensor(
                path,
                name,
                "byte range disagrees with moeflux.json",
            ));
        }
        if !offset.is_multiple_of(dtype.size()) {
            return Err(Error::tensor(
                path,
                name,
                "data is not aligned to its element size; re-run `moeflux convert`",
            ));
        }
        Ok(TensorLoc {
            dtype,
            offset,
            elems: data.len() / dtype.size(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fails when the file has shrunk since it was mapped (truncated under a
    /// running process): reading the map past the new end would kill the
    /// process with SIGBUS. One `fstat`; sessions call it before each eval,
    /// so only a truncation during an eval can still fault.
    pub fn check_unchanged(&self) -> Result<()> {
        let now = self
            .file
            .metadata()
            .map_err(|e| Error::io(&self.path, e))?
            .len();
        if now < self.map.len() as u64 {
            return Err(Error::format(
                &self.path,
                format!(
                    "dense file is now {now} bytes, {} when loaded (the model directory was \
                     modified while loaded)",
                    self.map.len()
                ),
            ));
        }
        Ok(())
    }

    fn err(&self, tensor: &str, reason: impl Into<String>) -> Error {
        Error::tensor(&self.path, tensor, reason)
    }

    fn get(&self, name: &str) -> Result<&(TensorLoc, Vec<usize>)> {
        self.tensors
            .get(name)
            .ok_or_else(|| self.err(name, "missing"))
    }

    /// The linear layer `module` with the expected `[rows, cols]`.
    pub fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<LinearRef> {
        let wname = format!("{module}.weight");
        let (wloc, wshape) = self.get(&wname)?;
        match self.quantized.get(module) {
            Some(&spec) => {
                spec.validate().map_err(|r| self.err(&wname, r))?;
                if !spec.mode.is_affine() {
                    return Err(self.err(
                        &wname,
                        "mode mxfp4 is read for routed experts only, not for dense modules",
                    ));
                }
                spec.check_cols(cols).map_err(|r| self.err(&wname, r))?;
                let packed_cols = affine::words_per_row(cols, spec.bits);
                let groups = cols / spec.group_size;
                self.expect(&wname, wloc, wshape, DType::U32, &[rows, packed_cols])?;
                let mut sb = [*wloc; 2];
                for (i, suffix) in ["scales", "biases"].iter().enumerate() {
                    let n = format!("{module}.{suffix}");
                    let (loc, shape) = self.get(&n)?;
                    if loc.dtype == DType::U32 {
                        return Err(self.err(&n, "dtype U32, expected BF16 or F32"));
                    }
                    self.expect(&n, loc, shape, loc.dtype, &[rows, groups])?;
                    sb[i] = *loc;
                }
                Ok(LinearRef {
                    rows,
                    cols,
                    weight: *wloc,
                    quant: Some((spec, sb[0], sb[1])),
                })
            }
            None => {
                if wloc.dtype == DType::U32 {
                    return Err(self.err(
                        &wname,
                        "packed U32 weight but moeflux.json lists no quantization for it",
                    ));
                }
                self.expect(&wname, wloc, wshape, wloc.dtype, &[rows, cols])?;
                Ok(LinearRef {
                    rows,
                    cols,
                    weight: *wloc,
                    quant: None,
                })
            }
        }
    }

    fn expect(
        &self,
        name: &str,
        loc: &TensorLoc,
        shape: &[usize],
        dtype: DType,
        want: &[usize],
    ) -> Result<()> {
        if loc.dtype != dtype {
            return Err(self.err(name, format!("dtype {:?}, expected {dtype:?}", loc.dtype)));
        }
        if shape != want {
            return Err(self.err(name, format!("shape {shape:?}, expected {want:?}")));
        }
        Ok(())
    }

    /// A float tensor of exactly `shape`, upcast to f32.
    pub fn floats(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (loc, s) = self.get(name)?;
        if s.as_slice() != shape {
            return Err(self.err(name, format!("shape {s:?}, expected {shape:?}")));
        }
        Ok(match loc.dtype {
            DType::Bf16 => self
                .u16s(loc)
                .iter()
                .map(|&b| affine::bf16_to_f32(b))
                .collect(),
            DType::F32 => self.f32s(loc).to_vec(),
            DType::U32 => return Err(self.err(name, "dtype U32, expected a float type")),
        })
    }

    /// Every tensor the schema requires, with the shapes it requires.
    pub fn validate_schema(&self, config: &ModelConfig) -> Result<()> {
        for w in schema::dense_weights(config) {
            match w.kind {
                WeightKind::Linear { rows, cols } => {
                    self.linear(&w.name, rows, cols)?;
                }
                WeightKind::Vector { len } => {
                    self.floats(&w.name, &[len])?;
                }
                WeightKind::Conv { channels, kernel } => {
                    self.floats(&w.name, &[channels, kernel, 1])?;
                }
                WeightKind::Table { rows, cols } => {
                    self.floats(&w.name, &[rows, cols])?;
                }
            }
        }
        Ok(())
    }

    fn bytes(&self, loc: &TensorLoc) -> &[u8] {
        &self.map[loc.offset..loc.offset + loc.elems * loc.dtype.size()]
    }
    fn u32s(&self, loc: &TensorLoc) -> &[u32] {
        bytemuck::cast_slice(self.bytes(loc))
    }
    fn u16s(&self, loc: &TensorLoc) -> &[u16] {
        bytemuck::cast_slice(self.bytes(loc))
    }
    fn f32s(&self, loc: &TensorLoc) -> &[f32] {
        bytemuck::cast_slice(self.bytes(loc))
    }

    fn scale_data(&self, loc: &TensorLoc) -> ScaleData<'_> {
        match loc.dtype {
            DType::Bf16 => ScaleData::Bf16(self.u16s(loc)),
            _ => ScaleData::F32(self.f32s(loc)),
        }
    }

    /// The whole dense file (tensor locations are offsets into it).
    pub fn file_bytes(&self) -> &[u8] {
        &self.map
    }

    /// A borrowed view of a linear layer for the kernels.
    pub fn view(&self, l: &LinearRef) -> Weight<'_> {
        match l.quant {
            Some((spec, s, b)) => Weight::Quantized(QMatrix {
                rows: l.rows,
                cols: l.cols,
                spec,
                packed: self.u32s(&l.weight),
                scales: self.scale_data(&s),
                biases: self.scale_data(&b),
            }),
            None => Weight::Dense(DenseMatrix {
                rows: l.rows,
                cols: l.cols,
                data: match l.weight.dtype {
                    DType::Bf16 => DenseData::Bf16(self.u16s(&l.weight)),
                    _ => DenseData::F32(self.f32s(&l.weight)),
                },
            }),
        }
    }
}
