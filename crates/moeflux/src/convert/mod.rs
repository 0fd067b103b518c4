//! `convert`: an mlx-lm (quantized) or Hugging Face / mlx unquantized
//! checkpoint, or a GGUF file ([`gguf`]) -> a moeflux model directory
//! (format v1, see `crate::format`).
//!
//! Pipeline: [`source`] maps the shards and reads config.json; [`sanitize`]
//! maps tensor names to canonical ones the way mlx-lm's `sanitize()` does;
//! [`plan`] checks every tensor against `model::schema` and decides how each
//! output is produced (copy, convert, quantize, re-quantize) — all before
//! anything is written; [`dense`] streams `dense.safetensors`; [`experts`]
//! packs `experts/layer_NNN.bin`; [`output`] makes the directory appear
//! atomically.

pub mod dense;
pub mod dropped;
pub mod dtype;
pub mod experts;
pub mod fp8;
pub mod gguf;
pub mod kvb;
pub mod low_width;
pub mod output;
pub mod plan;
pub mod sanitize;
pub mod source;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::format::manifest::{SourceInfo, FORMAT_NAME, FORMAT_VERSION};
use crate::format::{Manifest, DENSE_FILE, EXPERTS_DIR, MANIFEST_FILE};

pub use plan::SourceKind;

/// Tokenizer, generation and chat-template files copied when present.
pub const AUX_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
];

/// Options of [`convert`].
#[derive(Default, Clone, Copy)]
pub struct ConvertOptions<'a> {
    /// Width of the routed experts in the output (2, 4 or 8); `None` keeps the
    /// source's (4 for unquantized sources).
    pub expert_bits: Option<u32>,
    /// Replace an existing destination.
    pub force: bool,
    /// Called (from worker threads) as bytes are written.
    pub progress: Option<&'a (dyn Fn(&ConvertProgress) + Sync)>,
    /// Checked between tensors and experts; when set the conversion stops
    /// with [`Error::Cancelled`] and leaves nothing behind.
    pub cancel: Option<&'a AtomicBool>,
}

/// What the conversion is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConvertStage {
    /// Writing `dense.safetensors`.
    Dense,
    /// Writing the expert file of `ConvertProgress::layer`.
    Experts,
    /// Writing config, tokenizer and manifest; syncing; renaming into place.
    Finishing,
}

#[derive(Debug, Clone)]
pub struct ConvertProgress {
    pub stage: ConvertStage,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Model layer whose experts are being written.
    pub layer: Option<usize>,
    /// Expert files finished so far, and in all.
    pub moe_layers_done: usize,
    pub moe_layers_total: usize,
}

/// Summary of a finished conversion.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub dst: PathBuf,
    pub architecture: String,
    pub source_kind: SourceKind,
    /// Tensors in `dense.safetensors`.
    pub tensors: usize,
    /// Size of `dense.safetensors`.
    pub dense_bytes: u64,
    /// Total size of the expert files.
    pub expert_bytes: u64,
    /// Transformer layers, and MoE layers (expert files).
    pub layers: usize,
    pub moe_layers: usize,
    /// Expert width in the source (quantized sources) and in the output.
    pub source_expert_bits: Option<u32>,
    pub expert_bits: Option<u32>,
    pub expert_requantization: Option<String>,
    /// Checkpoint tensors intentionally left out (vision tower, MTP head, tied lm_head),
    /// sorted; [`ConvertReport::dropped_groups`] says what they are.
    pub dropped: Vec<String>,
    /// GGUF tensors without an exact form, re-quantized (one line per type).
    pub warnings: Vec<String>,
    /// GGUF sources: tensors per ggml type.
    pub gguf_types: Vec<(String, usize)>,
    pub elapsed: Duration,
}

impl ConvertReport {
    /// The left-out tensors grouped by what they are (MTP layer N, vision
    /// tower, ...).
    pub fn dropped_groups(&self) -> Vec<dropped::DroppedGroup> {
        dropped::group(&self.dropped)
    }

    /// `skipped N tensors: multi-token-prediction layer 3 (11), ...`, or
    /// `None` when nothing was left out.
    pub fn dropped_summary(&self) -> Option<String> {
        dropped::summary(&self.dropped)
    }
}

/// Progress accounting and cancellation shared by the writers.
pub struct Ctx<'a> {
    opts: &'a ConvertOptions<'a>,
    done: AtomicU64,
    total: u64,
    stage: AtomicUsize,
    layer: AtomicUsize,
    layers_done: AtomicUsize,
    layers_total: usize,
}

impl<'a> Ctx<'a> {
    /// Progress towards `total` bytes over `layers_total` expert files.
    pub(crate) fn new(opts: &'a ConvertOptions<'a>, total: u64, layers_total: usize) -> Self {
        Ctx {
            opts,
            done: AtomicU64::new(0),
            total,
            stage: AtomicUsize::new(ConvertStage::Dense as usize),
            layer: AtomicUsize::new(usize::MAX),
            layers_done: AtomicUsize::new(0),
            layers_total,
        }
    }

    pub fn check_cancel(&self) -> Result<()> {
        match self.opts.cancel {
            Some(c) if c.load(Ordering::Relaxed) => Err(Error::Cancelled),
            _ => Ok(()),
        }
    }

    pub fn advance(&self, bytes: u64) {
        let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.report(done);
    }

    pub(crate) fn set_stage(&self, stage: ConvertStage, layer: Option<usize>) {
        self.stage.store(stage as usize, Ordering::Relaxed);
        self.layer
            .store(layer.unwrap_or(usize::MAX), Ordering::Relaxed);
        self.report(self.done.load(Ordering::Relaxed));
    }

    /// One more expert file is complete.
    pub(crate) fn layer_done(&self) {
        self.layers_done.fetch_add(1, Ordering::Relaxed);
    }

    fn report(&self, done: u64) {
        if let Some(cb) = self.opts.progress {
            let stage = match self.stage.load(Ordering::Relaxed) {
                0 => ConvertStage::Dense,
                1 => ConvertStage::Experts,
                _ => ConvertStage::Finishing,
            };
            let layer = self.layer.load(Ordering::Relaxed);
            cb(&ConvertProgress {
                stage,
                bytes_done: done.min(self.total),
                bytes_total: self.total,
                layer: (layer != usize::MAX).then_some(layer),
                moe_layers_done: self.layers_done.load(Ordering::Relaxed),
                moe_layers_total: self.layers_total,
            });
        }
    }
}

/// JSON with 4-space indentation (as mlx-lm writes config.json).
pub(crate) fn json_4_spaces(v: &serde_json::Value) -> Vec<u8> {
    use serde::Serialize;
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    v.serialize(&mut ser).expect("JSON value serializes");
    out.push(b'\n');
    out
}

/// Converts the checkpoint in `src` into a moeflux model directory `dst`.
///
/// Everything is validated against the architecture's schema before
/// anything is written; the directory appears atomically when complete.
pub fn convert(src: &Path, dst: &Path, opts: &ConvertOptions) -> Result<ConvertReport> {
    let t0 = Instant::now();
    output::check_destination(dst, opts.force, Some(src))?;
    let source = if gguf::is_gguf(src) {
        gguf::open(src)?
    } else {
        source::Source::open(src)?
    };
    // Tokenizer, template and generation files sit beside a GGUF file.
    let aux_dir = match &source.gguf {
        Some(_) => src.parent().unwrap_or(Path::new(".")),
        None => src,
    };
    let san = sanitize::sanitize(&source)?;
    let plan = plan::plan(&source, &san, opts.expert_bits)?;
    let layout = dense::layout(&plan.outputs);
    let expert_total: u64 = plan
        .layers
        .iter()
        .map(|l| l.manifest.stride * l.num_experts as u64)
        .sum();
    let ctx = Ctx::new(opts, layout.file_size + expert_total, plan.layers.len());
    ctx.check_cancel()?;
    output::check_space(dst, ctx.total + (1 << 20))?;

    let tmp = output::TempDir::create(dst)?;
    ctx.set_stage(ConvertStage::Dense, None);
    let tensors = dense::write(&source, &plan, &layout, &tmp.path.join(DENSE_FILE), &ctx)?;

    let experts_dir = tmp.path.join(EXPERTS_DIR);
    std::fs::create_dir(&experts_dir).map_err(|e| Error::io(&experts_dir, e))?;
    for lp in &plan.layers {
        ctx.check_cancel()?;
        ctx.set_stage(ConvertStage::Experts, Some(lp.layer));
        experts::write_layer(&source, lp, &tmp.path.join(&lp.manifest.file), &ctx)?;
        ctx.layer_done();
    }
    output::fsync_dir(&experts_dir)?;

    ctx.check_cancel()?;
    ctx.set_stage(ConvertStage::Finishing, None);
    let cfg_out = tmp.path.join("config.json");
    match &plan.config_quant {
        Some(cq) => {
            let gen_path = aux_dir.join("generation_config.json");
            let generation: Option<serde_json::Value> = std::fs::read_to_string(&gen_path)
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
            let v = plan::output_config(&source.config_json, generation.as_ref(), cq);
            output::write_file(&cfg_out, &json_4_spaces(&v))?;
        }
        None if source.gguf.is_some() => {
            output::write_file(&cfg_out, &json_4_spaces(&source.config_json))?
        }
        None => output::copy_file(&source.config_path, &cfg_out)?,
    }
    match &source.gguf {
        Some(g) if !aux_dir.join("tokenizer.json").is_file() => {
            for (name, bytes) in gguf::tokenizer::files(&g.kv, src)? {
                output::write_file(&tmp.path.join(name), &bytes)?;
            }
        }
        _ => {
            for f in AUX_FILES {
                let p = aux_dir.join(f);
                if p.is_file() {
                    output::copy_file(&p, &tmp.path.join(f))?;
                }
            }
        }
    }

    let expert_bits = plan.layers.first().map(|l| l.components[0].out_spec.bits);
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        architecture: source.config.arch.model_type().into(),
        source: SourceInfo {
            path: src.display().to_string(),
            kind: if source.gguf.is_some() {
                "gguf".into()
            } else {
                plan.kind.as_str().into()
            },
            expert_bits: plan.source_expert_bits,
            expert_requantization: plan.expert_requantization.clone(),
        },
        dense_file: DENSE_FILE.into(),
        tensors,
        quantized: plan.quantized.clone(),
        experts: plan.layers.iter().map(|l| l.manifest.clone()).collect(),
        low_width_experts: Vec::new(),
    };
    let text = manifest.file_text();
    output::write_file(&tmp.path.join(MANIFEST_FILE), text.as_bytes())?;
    ctx.check_cancel()?;
    tmp.commit(dst, opts.force)?;

    Ok(ConvertReport {
        dst: dst.to_path_buf(),
        architecture: manifest.architecture.clone(),
        source_kind: plan.kind,
        tensors: plan.outputs.len(),
        dense_bytes: layout.file_size,
        expert_bytes: expert_total,
        layers: source.config.num_layers,
        moe_layers: plan.layers.len(),
        source_expert_bits: plan.source_expert_bits,
        expert_bits,
        expert_requantization: plan.expert_requantization,
        dropped: san.dropped,
        warnings: source
            .gguf
            .as_ref()
            .map(|g| g.warnings())
            .unwrap_or_default(),
        gguf_types: source
            .gguf
            .as_ref()
            .map(|g| g.types.iter().map(|(k, v)| (k.to_string(), *v)).collect())
            .unwrap_or_default(),
        elapsed: t0.elapsed(),
    })
}
