//! The source checkpoint: `config.json` and memory-mapped safetensors shards
//! (`model.safetensors.index.json` + shards, a single `model.safetensors`, or
//! every `*.safetensors` of the directory).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::error::{Error, Result};

use super::dtype::{self, FloatTy};
use super::fp8;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

/// One mapped shard.
pub struct Shard {
    pub path: PathBuf,
    pub(crate) map: Mmap,
}

/// Where a source tensor's bytes are.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range in the shard's map; for a GGUF view, its start and the
    /// presented length (the source range is the view's).
    pub start: usize,
    pub len: usize,
    /// Produced from ggml blocks on read (GGUF sources).
    pub view: Option<super::gguf::View>,
}

impl RawTensor {
    /// Bytes of one slice along the leading dimension.
    pub fn bytes_per_leading(&self) -> usize {
        match self.shape.first() {
            Some(&n) if n > 0 => self.len / n,
            _ => 0,
        }
    }
}

pub struct Source {
    pub dir: PathBuf,
    pub config_path: PathBuf,
    pub config_json: Value,
    pub config: ModelConfig,
    /// The index file, when the checkpoint has one.
    pub index_path: Option<PathBuf>,
    pub shards: Vec<Shard>,
    /// Every tensor of every shard by its name in the checkpoint.
    pub tensors: BTreeMap<String, RawTensor>,
    /// FP8 (`F8_E4M3`) weight -> its `<name>_scale_inv` block scales.
    pub fp8_scales: BTreeMap<String, String>,
    /// Set for a GGUF file (`convert::gguf`).
    pub gguf: Option<super::gguf::GgufInfo>,
}

impl Source {
    pub fn open(dir: &Path) -> Result<Self> {
        let meta = std::fs::metadata(dir).map_err(|e| Error::io(dir, e))?;
        if !meta.is_dir() {
            return Err(Error::format(dir, "source is not a directory"));
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let config_json: Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: config_path.clone(),
            source,
        })?;
        check_foreign_quantization(&config_json, &config_path)?;
        let config = ModelConfig::from_json(&config_json, &config_path)?;

        let index_path = dir.join(INDEX_FILE);
        let (index_path, shard_files, weight_map) = if index_path.exists() {
            let (files, map) = read_index(&index_path)?;
            (Some(index_path), files, Some(map))
        } else if dir.join(SINGLE_FILE).exists() {
            (None, vec![SINGLE_FILE.to_string()], None)
        } else {
            let mut files = Vec::new();
            for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
                let entry = entry.map_err(|e| Error::io(dir, e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.ends_with(".safetensors") && !name.starts_with('.') {
                    files.push(name);
                }
            }
            files.sort();
            if files.is_empty() {
                return Err(Error::format(
                    dir,
                    format!("no {INDEX_FILE}, {SINGLE_FILE} or other *.safetensors file"),
                ));
            }
            (None, files, None)
        };

        let mut shards = Vec::with_capacity(shard_files.len());
        let mut tensors: BTreeMap<String, RawTensor> = BTreeMap::new();
        for (si, fname) in shard_files.iter().enumerate() {
            let path = dir.join(fname);
            let file = File::open(&path).map_err(|e| match &index_path {
                Some(ip) if e.kind() == std::io::ErrorKind::NotFound => Error::format(
                    &path,
                    format!("shard named in {} does not exist", ip.display()),
                ),
                _ => Error::io(&path, e),
            })?;
            // SAFETY: read-only map of a checkpoint file. Like every
            // safetensors reader we assume nobody truncates it meanwhile.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
            let base = map.as_ptr() as usize;
            let st = SafeTensors::deserialize(&map).map_err(|e| {
                Error::format(
                    &path,
                    format!("not a valid safetensors file (truncated or corrupt?): {e}"),
                )
            })?;
            for (name, view) in st.iter() {
                let data = view.data();
                let raw = RawTensor {
                    shard: si,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    start: data.as_ptr() as usize - base,
                    len: data.len(),
                    view: None,
                };
                if let Some(prev) = tensors.insert(name.to_string(), raw) {
                    return Err(Error::tensor(
                        &path,
                        name,
                        format!(
                            "also present in {}",
                            dir.join(&shard_files[prev.shard]).display()
                        ),
                    ));
                }
            }
            drop(st);
            shards.push(Shard { path, map });
        }

        if let (Some(ip), Some(map)) = (&index_path, &weight_map) {
            for (name, fname) in map {
                match tensors.get(name) {
                    Some(t) if shard_files[t.shard] == *fname => {}
                    Some(t) => {
                        return Err(Error::tensor(
                            ip,
                            name,
                            format!("listed in {fname} but found in {}", shard_files[t.shard]),
                        ))
                    }
                    None => {
                        return Err(Error::tensor(
                            dir.join(fname),
                            name,
                            format!("listed in {} but not in the shard", ip.display()),
                        ))
                    }
                }
            }
        }

        let mut fp8_scales = BTreeMap::new();
        for (name, t) in &tensors {
            if t.dtype != Dtype::F8_E4M3 {
                continue;
            }
            let path = dir.join(&shard_files[t.shard]);
            let sname = format!("{name}_scale_inv");
            let Some(st) = tensors.get(&sname) else {
                return Err(Error::tensor(
                    &path,
                    name,
                    format!("FP8 (F8_E4M3) weight without its block scales `{sname}`"),
                ));
            };
            if t.shape.len() != 2 {
                return Err(Error::tensor(
                    &path,
                    name,
                    format!(
                        "FP8 weight of shape {:?}; only 2-D weights are supported",
                        t.shape
                    ),
                ));
            }
            let want = fp8::scale_shape(t.shape[0], t.shape[1]);
            if st.shape != want || !matches!(st.dtype, Dtype::F32 | Dtype::BF16) {
                return Err(Error::tensor(
                    dir.join(&shard_files[st.shard]),
                    &sname,
                    format!(
                        "{:?} {:?}; expected F32 or BF16 {want:?} (one scale per {b}x{b} block of {:?})",
                        st.dtype,
                        st.shape,
                        t.shape,
                        b = fp8::BLOCK
                    ),
                ));
            }
            fp8_scales.insert(name.clone(), sname);
        }

        Ok(Source {
            dir: dir.to_path_buf(),
            config_path,
            config_json,
            config,
            index_path,
            shards,
            tensors,
            fp8_scales,
            gguf: None,
        })
    }

    /// The float type a tensor's values are read in: FP8 weights come out of
    /// block dequantization as bf16 (as in mlx-lm); `None` for non-floats.
    pub fn float_ty(&self, raw: &str) -> Option<FloatTy> {
        let t = self.tensors.get(raw)?;
        if self.fp8_scales.contains_key(raw) {
            return Some(FloatTy::Bf16);
        }
        FloatTy::from_dtype(t.dtype)
    }

    /// Rows `r0..r1` of a 2-D float (or FP8 block-scaled) tensor in f32.
    pub fn float_rows(&self, raw: &str, r0: usize, r1: usize) -> Vec<f32> {
        let t = &self.tensors[raw];
        let cols = t.shape.get(1).copied().unwrap_or(1);
        match self.fp8_scales.get(raw) {
            Some(sname) => {
                let st = &self.tensors[sname];
                let sty = FloatTy::from_dtype(st.dtype).expect("checked at open");
                let scales = dtype::decode(&self.bytes(st), sty);
                fp8::decode_rows(&self.bytes(t), &scales, cols, r0, r1)
            }
            None => {
                let ty = FloatTy::from_dtype(t.dtype).expect("float tensor");
                let es = dtype::size_of(t.dtype);
                dtype::decode(&self.byte_range(t, r0 * cols * es..r1 * cols * es), ty)
            }
        }
    }

    pub fn get(&self, name: &str) -> Option<&RawTensor> {
        self.tensors.get(name)
    }

    /// A tensor's bytes (produced from ggml blocks for a GGUF view).
    pub fn bytes(&self, t: &RawTensor) -> Cow<'_, [u8]> {
        self.byte_range(t, 0..t.len)
    }

    /// Bytes `r` of a tensor; a GGUF view produces only the rows covering them.
    pub fn byte_range(&self, t: &RawTensor, r: Range<usize>) -> Cow<'_, [u8]> {
        let map = &self.shards[t.shard].map;
        match &t.view {
            None => Cow::Borrowed(&map[t.start + r.start..t.start + r.end]),
            Some(v) => {
                let rb = v.out_row_bytes();
                let (r0, r1) = (r.start / rb, r.end.div_ceil(rb));
                let rows = v.rows(map, r0, r1);
                let at = r.start - r0 * rb;
                Cow::Owned(rows[at..at + r.len()].to_vec())
            }
        }
    }

    /// Drops `name`'s pages from this process's mapping once it has been
    /// consumed, so the resident size stays near one layer instead of
    /// growing to the whole checkpoint (the pages stay in the page cache).
    pub fn release(&self, name: &str) {
        let Some(t) = self.tensors.get(name) else {
            return;
        };
        let map = &self.shards[t.shard].map;
        let page = page_size();
        let len = t.view.map_or(t.len, |v| v.src_len);
        let start = t.start / page * page;
        let end = (t.start + len).next_multiple_of(page).min(map.len());
        if end > start {
            // SAFETY: the map is a read-only shared file mapping: after
            // MADV_DONTNEED the next access faults the same file bytes back
            // in, so nothing observable changes (it is advice only).
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
            };
        }
    }

    /// File holding `name` (for messages); the index or the directory when
    /// the tensor is not there at all.
    pub fn file_of(&self, name: &str) -> PathBuf {
        match self.tensors.get(name) {
            Some(t) => self.shards[t.shard].path.clone(),
            None => self.weights_location(),
        }
    }

    /// Where a missing tensor was looked for.
    pub fn weights_location(&self) -> PathBuf {
        match &self.index_path {
            Some(p) => p.clone(),
            None if self.shards.len() == 1 => self.shards[0].path.clone(),
            None => self.dir.clone(),
        }
    }

    /// True when config.json declares an mlx-lm `quantization` block.
    pub fn is_quantized(&self) -> bool {
        self.config.quantization.is_some()
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// Refuses Hugging Face quantization formats (fp8, gptq, awq, ...): their
/// tensors are not MLX affine codes.
pub(crate) fn check_foreign_quantization(v: &Value, path: &Path) -> Result<()> {
    if v.get("quantization").is_some() {
        return Ok(());
    }
    if let Some(method) = v
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(Value::as_str)
    {
        // DeepSeek-V3 / Kimi-K2 releases: e4m3 weights with 128x128 block scales
        // (`weight_scale_inv`), decoded by convert (see `convert::fp8`).
        // gpt-oss releases: MXFP4 experts (`*_blocks` / `*_scales`), kept as they are.
        let arch = v
            .get("model_type")
            .and_then(Value::as_str)
            .and_then(crate::config::Architecture::from_model_type);
        match (method, arch) {
            ("fp8", Some(a)) if a.is_deepseek() => return Ok(()),
            ("mxfp4", Some(crate::config::Architecture::GptOss)) => return Ok(()),
            _ => {}
        }
        return Err(Error::Config {
            path: path.to_path_buf(),
            field: "quantization_config.quant_method".into(),
            reason: format!(
                "`{method}` checkpoints are not supported for this model type (FP8 is read \
                 for DeepSeek-V3 and Kimi-K2, MXFP4 for gpt-oss); convert from the \
                 bf16/f16/f32 checkpoint or an mlx-lm one"
            ),
        });
    }
    Ok(())
}

/// Shard file names (sorted, unique) and the tensor -> shard map.
pub(crate) fn read_index(path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let v: Value = serde_json::from_str(&text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let wm = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| Error::format(path, "missing `weight_map` object"))?;
    let mut map = BTreeMap::new();
    let mut files = BTreeSet::new();
    for (k, f) in wm {
        let f = f
            .as_str()
            .ok_or_else(|| Error::tensor(path, k, "weight_map entry is not a file name"))?;
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(Error::tensor(
                path,
                k,
                format!("shard `{f}` is not a plain file name"),
            ));
        }
        files.insert(f.to_string());
        map.insert(k.clone(), f.to_string());
    }
    if files.is_empty() {
        return Err(Error::format(path, "`weight_map` is empty"));
    }
    Ok((files.into_iter().collect(), map))
}
