//! GGUF files (llama.cpp, Ollama, LM Studio) as a `convert` source.
//!
//! [`open`] maps the file (or every part of a split file), reads the
//! metadata into a `config.json` for the family ([`arch`]) and presents each
//! tensor under its mlx-lm name, so the rest of `convert` treats it like an
//! mlx-lm checkpoint: float tensors as they are, quantized ones as affine
//! `weight`/`scales`/`biases` or MXFP4 `weight`/`scales`, transcoded lazily
//! from the ggml blocks row by row ([`View`], [`ggml`]), never all at once.

pub mod arch;
pub mod file;
pub mod ggml;
mod iq;
#[rustfmt::skip]
mod iq_grids;
pub mod tokenizer;

use std::collections::BTreeMap;
use std::path::Path;

use memmap2::Mmap;
use safetensors::Dtype;
use serde_json::{Map, Value as Json};

use crate::config::{ModelConfig, QuantSpec};
use crate::error::{Error, Result};
use crate::quant::{affine, mxfp4};

use self::arch::GgufArch;
use self::file::{TensorInfo, Value};
use self::ggml::{GgmlType, Mapping};
use super::source::{RawTensor, Shard, Source};

/// Which output a quantized GGUF tensor is presented as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Affine codes of `bits`, packed in u32 words.
    Codes,
    Scales,
    Biases,
}

/// A tensor presented from ggml blocks: rows of `cols` values of `ty`.
#[derive(Debug, Clone, Copy)]
pub struct View {
    pub ty: GgmlType,
    pub part: Part,
    pub cols: usize,
    /// Byte range of the ggml tensor in its shard.
    pub src_start: usize,
    pub src_len: usize,
}

impl View {
    fn mxfp4(&self) -> bool {
        self.ty.mapping == Some(Mapping::Mxfp4)
    }

    fn bits(&self) -> u32 {
        match self.ty.mapping {
            Some(Mapping::Affine { bits, .. } | Mapping::Requant { bits }) => bits,
            _ => 4,
        }
    }

    /// Values per scale (and bias) of the presented form.
    fn group(&self) -> usize {
        group_of(self.ty.mapping)
    }

    /// Presented bytes per row.
    pub fn out_row_bytes(&self) -> usize {
        let groups = self.cols / self.group();
        match (self.part, self.mxfp4()) {
            (Part::Codes, _) => self.cols * self.bits() as usize / 8,
            (_, true) => groups,
            (_, false) => groups * 4,
        }
    }

    fn src_row_bytes(&self) -> usize {
        self.cols / self.ty.block * self.ty.bytes
    }

    /// Presented rows `r0..r1` from the shard's bytes.
    pub fn rows(&self, map: &[u8], r0: usize, r1: usize) -> Vec<u8> {
        let srb = self.src_row_bytes();
        let src = &map[self.src_start + r0 * srb..self.src_start + r1 * srb];
        let mut out = Vec::with_capacity((r1 - r0) * self.out_row_bytes());
        let cols = self.cols;
        let groups = cols / self.group();
        let mut codes = vec![0u8; cols];
        let mut sb = vec![(0f32, 0f32); groups];
        let mut words = vec![0u32; affine::words_per_row(cols, self.bits())];
        for row in src.chunks_exact(srb) {
            match self.ty.mapping {
                Some(Mapping::Mxfp4) => {
                    let mut scales = Vec::with_capacity(groups);
                    for (blk, c) in row
                        .chunks_exact(self.ty.bytes)
                        .zip(codes.chunks_exact_mut(32))
                    {
                        scales.push(ggml::mxfp4_block(blk, c));
                    }
                    match self.part {
                        Part::Codes => {
                            mxfp4::pack_codes(&codes, &mut words);
                            out.extend(words.iter().flat_map(|w| w.to_le_bytes()));
                        }
                        _ => out.extend_from_slice(&scales),
                    }
                    continue;
                }
                Some(Mapping::Affine { group, .. }) => {
                    let per = self.ty.block / group;
                    for ((blk, c), s) in row
                        .chunks_exact(self.ty.bytes)
                        .zip(codes.chunks_exact_mut(self.ty.block))
                        .zip(sb.chunks_exact_mut(per))
                    {
                        ggml::affine_block(&self.ty, blk, c, s);
                    }
                    affine::pack_codes(&codes, self.bits(), &mut words);
                }
                Some(Mapping::Requant { bits }) => {
                    let mut w = vec![0f32; cols];
                    ggml::dequant_rows(&self.ty, row, &mut w);
                    let q = affine::quantize(&w, 1, cols, QuantSpec::affine(bits, 32));
                    words.copy_from_slice(&q.packed);
                    for (g, s) in sb.iter_mut().enumerate() {
                        *s = (q.scales[g], q.biases[g]);
                    }
                }
                _ => unreachable!("views are made for quantized mappings"),
            }
            match self.part {
                Part::Codes => out.extend(words.iter().flat_map(|w| w.to_le_bytes())),
                Part::Scales => out.extend(sb.iter().flat_map(|s| s.0.to_le_bytes())),
                Part::Biases => out.extend(sb.iter().flat_map(|s| s.1.to_le_bytes())),
            }
        }
        out
    }
}

/// Group size of a quantized mapping's presented form (MXFP4 and
/// re-quantized tensors: 32).
fn group_of(m: Option<Mapping>) -> usize {
    match m {
        Some(Mapping::Affine { group, .. }) => group,
        _ => 32,
    }
}

/// What a GGUF source carries beyond its tensors.
#[derive(Debug, Clone)]
pub struct GgufInfo {
    /// Metadata of the first part.
    pub kv: BTreeMap<String, Value>,
    /// `(tensor, ggml type, bits)` of tensors dequantized and re-quantized.
    pub requantized: Vec<(String, &'static str, u32)>,
    /// Tensors by ggml type name, for the report.
    pub types: BTreeMap<&'static str, usize>,
}

impl GgufInfo {
    /// One warning line per ggml type that was re-quantized, naming its tensors.
    pub fn warnings(&self) -> Vec<String> {
        let mut by: BTreeMap<(&str, u32), Vec<&str>> = BTreeMap::new();
        for (t, ty, bits) in &self.requantized {
            by.entry((ty, *bits)).or_default().push(t);
        }
        by.into_iter()
            .map(|((ty, bits), ts)| {
                format!(
                    "{} {ty} tensor(s) have no exact form; dequantized and re-quantized to \
                     {bits}-bit affine, group 32: {}",
                    ts.len(),
                    ts.join(", ")
                )
            })
            .collect()
    }
}

/// Whether `path` is a GGUF file (by its magic).
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut m = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut m))
            .is_ok()
        && &m == file::MAGIC
}

fn map_file(path: &Path) -> Result<Mmap> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: read-only map of a model file; like every GGUF reader we
    // assume nobody truncates it meanwhile.
    unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))
}

/// The llama.cpp architecture `name` (`general.architecture` of `path`),
/// or why it cannot be converted.
pub fn architecture(name: &str, path: &Path) -> Result<GgufArch> {
    GgufArch::from_name(name).ok_or_else(|| Error::UnsupportedModel {
        path: path.to_path_buf(),
        model_type: format!("GGUF architecture `{name}`"),
        supported: if arch::NOT_YET.contains(&name) {
            "for GGUF files: qwen3moe, gpt-oss, glm4moe (this family converts from its Hugging Face or mlx-lm checkpoint)".into()
        } else {
            "for GGUF files: qwen3moe, gpt-oss, glm4moe".into()
        },
    })
}

/// Opens a GGUF file (all parts of a split one) as a convert [`Source`].
pub fn open(path: &Path) -> Result<Source> {
    let parts = file::split_parts(path)?;
    let mut shards = Vec::new();
    let mut infos: BTreeMap<String, (usize, TensorInfo)> = BTreeMap::new();
    let mut kv0 = None;
    for (i, p) in parts.iter().enumerate() {
        if !p.is_file() {
            return Err(Error::format(
                p,
                format!(
                    "part {} of the split GGUF {} is missing",
                    i + 1,
                    path.display()
                ),
            ));
        }
        let map = map_file(p)?;
        let parsed = file::parse(&map, p)?;
        if parts.len() > 1 {
            let no = parsed.kv.get("split.no").and_then(Value::as_u64);
            let count = parsed.kv.get("split.count").and_then(Value::as_u64);
            if no != Some(i as u64) || count != Some(parts.len() as u64) {
                return Err(Error::format(
                    p,
                    format!(
                        "split.no {no:?} / split.count {count:?}; expected {i} / {} from the file name",
                        parts.len()
                    ),
                ));
            }
        }
        for t in parsed.tensors {
            if infos.contains_key(&t.name) {
                return Err(Error::tensor(p, &t.name, "also present in another part"));
            }
            infos.insert(t.name.clone(), (i, t));
        }
        if kv0.is_none() {
            kv0 = Some(parsed.kv);
        }
        shards.push(Shard {
            path: p.clone(),
            map,
        });
    }
    let kv = kv0.expect("at least one part");
    let arch_name = kv
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::format(path, "GGUF metadata has no `general.architecture`"))?
        .to_string();
    let a = architecture(&arch_name, path)?;

    let by_name: BTreeMap<String, TensorInfo> = infos
        .iter()
        .map(|(k, (_, t))| (k.clone(), t.clone()))
        .collect();
    let meta = arch::Meta {
        kv: &kv,
        arch: &arch_name,
        path,
    };
    let mut config = arch::config(a, &meta, &by_name)?;

    let mut tensors = BTreeMap::new();
    let mut quant = Map::new();
    let mut info = GgufInfo {
        kv,
        requantized: Vec::new(),
        types: BTreeMap::new(),
    };
    for (name, (shard, t)) in &infos {
        let sp = &parts[*shard];
        let Some(mlx) = arch::mlx_name(a, name) else {
            if arch::ignorable(name) {
                continue;
            }
            return Err(Error::tensor(
                sp,
                name,
                format!("not a tensor of llama.cpp's `{arch_name}` that moeflux knows; refusing to drop it"),
            ));
        };
        *info.types.entry(t.ty.name).or_default() += 1;
        let shape = t.shape();
        let mapping = t.ty.mapping.ok_or_else(|| {
            Error::tensor(
                sp,
                name,
                format!("ggml type {} is not supported (yet)", t.ty.name),
            )
        })?;
        let raw = |dtype, shape: Vec<usize>, view: Option<View>| RawTensor {
            shard: *shard,
            dtype,
            len: match &view {
                Some(v) => shape[..shape.len() - 1].iter().product::<usize>() * v.out_row_bytes(),
                None => t.len,
            },
            shape,
            start: t.start,
            view,
        };
        if mapping == Mapping::Float {
            let dtype = match t.ty.name {
                "F32" => Dtype::F32,
                "F16" => Dtype::F16,
                _ => Dtype::BF16,
            };
            tensors.insert(mlx, raw(dtype, shape, None));
            continue;
        }
        let module = mlx.strip_suffix(".weight").ok_or_else(|| {
            Error::tensor(
                sp,
                name,
                format!("a quantized ({}) bias or vector", t.ty.name),
            )
        })?;
        let cols = t.dims[0];
        let view = |part| View {
            ty: t.ty,
            part,
            cols,
            src_start: t.start,
            src_len: t.len,
        };
        let lead = &shape[..shape.len() - 1];
        let with_last = |n: usize| [lead, &[n]].concat();
        let (spec, parts): (QuantSpec, Vec<(&str, Dtype, usize, Part)>) = match mapping {
            Mapping::Mxfp4 => (
                QuantSpec::MXFP4,
                vec![
                    ("weight", Dtype::U32, cols / 8, Part::Codes),
                    ("scales", Dtype::U8, cols / 32, Part::Scales),
                ],
            ),
            Mapping::Affine { bits, .. } | Mapping::Requant { bits } => {
                if let Mapping::Requant { .. } = mapping {
                    info.requantized.push((name.clone(), t.ty.name, bits));
                }
                let group = group_of(Some(mapping));
                (
                    QuantSpec::affine(bits, group),
                    vec![
                        (
                            "weight",
                            Dtype::U32,
                            affine::words_per_row(cols, bits),
                            Part::Codes,
                        ),
                        ("scales", Dtype::F32, cols / group, Part::Scales),
                        ("biases", Dtype::F32, cols / group, Part::Biases),
                    ],
                )
            }
            Mapping::Float => unreachable!("handled above"),
        };
        for (suffix, dtype, last, part) in parts {
            tensors.insert(
                format!("{module}.{suffix}"),
                raw(dtype, with_last(last), Some(view(part))),
            );
        }
        quant.insert(
            module.to_string(),
            serde_json::to_value(spec).expect("spec"),
        );
    }
    if !quant.is_empty() {
        config["quantization"] = Json::Object(quant);
    }
    let config_path = path.to_path_buf();
    let model = ModelConfig::from_json(&config, &config_path)?;
    Ok(Source {
        dir: path.parent().map(Path::to_path_buf).unwrap_or_default(),
        config_path,
        config_json: config,
        config: model,
        index_path: None,
        shards,
        tensors,
        fp8_scales: BTreeMap::new(),
        gguf: Some(info),
    })
}
