//! `synth`: a model directory with random weights at the real shapes of a
//! model (a [`presets`] entry or any [`SynthSpec`]), optionally only its
//! first layers, for benchmarks and tests at full scale without the
//! checkpoint. What the tensors hold is described in `init.rs`; the router
//! skew (Zipf popularity) in `skew.rs`.
//!
//! The tensors and shapes come from `model::schema` through the same
//! `ModelConfig` the loader reads, and the directory is written like
//! `convert` writes it (same dense layout, expert extents, manifest,
//! atomic temp-directory rename, cancellation), so it opens unchanged.
//!
//! Memory is bounded: the dense file is produced in row blocks of at most
//! `CHUNK_BYTES` per worker, and expert files one extent per worker, each
//! written as soon as it is generated; nothing is held beyond those
//! buffers (about `threads x (CHUNK_BYTES + one expert)`), whatever the
//! model size.

mod init;
pub mod presets;
pub mod skew;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use safetensors::Dtype;
use serde_json::json;

use crate::config::{ModelConfig, QuantSpec};
use crate::convert::dense::layout;
use crate::convert::plan::{
    layout_layer, output_config, ComponentShape, ConfigQuant, OutTensor, DEFAULT_BITS,
    DEFAULT_GROUP_SIZE,
};
use crate::convert::sanitize::mlx_module_path;
use crate::convert::{json_4_spaces, output, ConvertOptions, ConvertProgress, ConvertStage, Ctx};
use crate::error::{Error, Result};
use crate::format::manifest::{SourceInfo, FORMAT_NAME, FORMAT_VERSION};
use crate::format::{
    ExpertLayer, ExpertTensorRef, Manifest, TensorEntry, DENSE_FILE, EXPERTS_DIR, MANIFEST_FILE,
};
use crate::model::schema::{self, WeightKind, EXPERT_COMPONENTS};

pub use presets::{
    find_preset, presets, DeepseekShape, GlmShape, GptOssShape, Preset, Qwen3MoeShape, QwenShape,
    SynthSpec,
};

use init::{Init, LinearInit};

/// Most code bytes generated per work item of the dense file.
const CHUNK_BYTES: usize = 8 << 20;

/// How the routers spread tokens over experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RouterSkew {
    /// Expert popularity ~ rank^-alpha (ranks shuffled per layer).
    Zipf(f64),
}

impl RouterSkew {
    /// Parses `zipf:ALPHA` (ALPHA a finite number >= 0).
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            Error::Invalid(format!(
                "router skew `{s}`: expected zipf:ALPHA with ALPHA >= 0, e.g. zipf:1.0"
            ))
        };
        let alpha: f64 = s
            .strip_prefix("zipf:")
            .ok_or_else(bad)?
            .parse()
            .map_err(|_| bad())?;
        if !alpha.is_finite() || alpha < 0.0 {
            return Err(bad());
        }
        Ok(RouterSkew::Zipf(alpha))
    }
}

impl std::fmt::Display for RouterSkew {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RouterSkew::Zipf(a) => write!(f, "zipf:{a}"),
        }
    }
}

/// Options of [`synth`].
#[derive(Clone)]
pub struct SynthOptions<'a> {
    /// Recorded in config.json and the manifest (the preset's name).
    pub name: String,
    pub spec: SynthSpec,
    /// Write only the first `layers` layers (identical to the full model's).
    pub layers: Option<usize>,
    /// Width of the routed experts: 2, 4 or 8 (affine, group size 64).
    pub expert_bits: u32,
    /// MXFP4 routed experts instead (4 bits, groups of 32): gpt-oss's own
    /// format, the default of its presets.
    pub expert_mxfp4: bool,
    pub seed: u64,
    pub router_skew: Option<RouterSkew>,
    /// A `tokenizer.json` to copy, or a directory whose tokenizer and
    /// chat-template files are copied (as `convert` copies them).
    pub tokenizer: Option<PathBuf>,
    /// Replace an existing destination.
    pub force: bool,
    /// Called (from worker threads) as bytes are written.
    pub progress: Option<&'a (dyn Fn(&ConvertProgress) + Sync)>,
    /// When set, stops with [`Error::Cancelled`] and leaves nothing behind.
    pub cancel: Option<&'a AtomicBool>,
}

impl SynthOptions<'_> {
    pub fn new(name: &str, spec: SynthSpec) -> Self {
        SynthOptions {
            expert_mxfp4: matches!(spec, SynthSpec::GptOss(_)),
            name: name.to_string(),
            spec,
            layers: None,
            expert_bits: 4,
            seed: 0,
            router_skew: None,
            tokenizer: None,
            force: false,
            progress: None,
            cancel: None,
        }
    }
}

/// Summary of a finished [`synth`].
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub dst: PathBuf,
    pub architecture: String,
    pub layers: usize,
    pub preset_layers: usize,
    pub tensors: usize,
    pub dense_bytes: u64,
    pub expert_bytes: u64,
    pub elapsed: Duration,
}

/// One output tensor group of the dense file.
enum Job {
    /// A quantized linear layer: codes, scales, biases.
    Linear {
        cols: usize,
        init: LinearInit,
        outs: [usize; 3],
    },
    /// A float tensor (vector or conv weight), produced whole.
    Floats { out: usize, kind: WeightKind },
}

/// Rows `start..end` of job `job`.
struct Item {
    job: usize,
    start: usize,
    end: usize,
}

/// Writes a synthetic model directory `dst`.
pub fn synth(dst: &Path, opts: &SynthOptions) -> Result<SynthReport> {
    let t0 = Instant::now();
    let depth = opts.spec.num_layers();
    let layers = opts.layers.unwrap_or(depth);
    if layers == 0 || layers > depth {
        return Err(Error::Invalid(format!(
            "layers must be between 1 and {depth} (the model's), got {layers}"
        )));
    }
    if opts.expert_mxfp4 && opts.expert_bits != 4 {
        return Err(Error::Invalid(format!(
            "MXFP4 experts are 4-bit, not {}",
            opts.expert_bits
        )));
    }
    if !matches!(opts.expert_bits, 2 | 4 | 8) {
        return Err(Error::Invalid(format!(
            "expert bits must be 2, 4 or 8, got {}",
            opts.expert_bits
        )));
    }
    output::check_destination(dst, opts.force, opts.tokenizer.as_deref())?;
    if let Some(t) = &opts.tokenizer {
        // Refuse a missing tokenizer before writing gigabytes.
        let json = match t.is_dir() {
            true => t.join("tokenizer.json"),
            false => t.clone(),
        };
        if !json.is_file() {
            return Err(Error::Invalid(format!(
                "{}: no such tokenizer file",
                json.display()
            )));
        }
    }

    let config_json = config_json(opts, layers)?;
    let config = ModelConfig::from_json(&config_json, Path::new("config.json"))?;
    let init = Init {
        seed: opts.seed,
        depth,
        hidden: config.hidden_size,
        experts_per_token: config.moe.num_experts_per_tok,
        num_experts: config.moe.num_experts,
        skew: opts.router_skew.map(|RouterSkew::Zipf(a)| a),
    };

    // The dense tensors, as `convert` would write them.
    let mut outputs = Vec::new();
    let mut jobs = Vec::new();
    let mut quantized = std::collections::BTreeMap::new();
    let mut push = |name: String, dtype: Dtype, shape: Vec<usize>| {
        outputs.push(OutTensor { name, dtype, shape });
        outputs.len() - 1
    };
    for w in schema::dense_weights(&config) {
        match w.kind {
            WeightKind::Linear { rows, cols } => {
                if !cols.is_multiple_of(DEFAULT_GROUP_SIZE) {
                    return Err(Error::Invalid(format!(
                        "{}: {cols} input columns, not a multiple of {DEFAULT_GROUP_SIZE}",
                        w.name
                    )));
                }
                let init = init.linear(&w.name, cols);
                let groups = vec![rows, cols / DEFAULT_GROUP_SIZE];
                let outs = [
                    push(
                        format!("{}.weight", w.name),
                        Dtype::U32,
                        vec![rows, init.row_bytes(cols) / 4],
                    ),
                    push(format!("{}.scales", w.name), Dtype::BF16, groups.clone()),
                    push(format!("{}.biases", w.name), Dtype::BF16, groups),
                ];
                quantized.insert(w.name.clone(), init.spec);
                jobs.push(Job::Linear { cols, init, outs });
            }
            WeightKind::Vector { len } => {
                // mlx-lm keeps A_log (qwen3_5) and the router's correction
                // bias (deepseek_v3) in float32 (cast_predicate).
                let dtype =
                    if w.name.ends_with("A_log") || w.name.ends_with("e_score_correction_bias") {
                        Dtype::F32
                    } else {
                        Dtype::BF16
                    };
                let out = push(w.name, dtype, vec![len]);
                jobs.push(Job::Floats { out, kind: w.kind });
            }
            WeightKind::Conv { channels, kernel } => {
                let out = push(w.name, Dtype::BF16, vec![channels, kernel, 1]);
                jobs.push(Job::Floats { out, kind: w.kind });
            }
            WeightKind::Table { rows, cols } => {
                let out = push(w.name, Dtype::BF16, vec![rows, cols]);
                jobs.push(Job::Floats { out, kind: w.kind });
            }
        }
    }
    let lay = layout(&outputs);

    let expert_layers = expert_layouts(&config, expert_spec(opts));
    let expert_total: u64 = expert_layers
        .iter()
        .map(|l| l.stride * l.num_experts as u64)
        .sum();

    let copts = ConvertOptions {
        progress: opts.progress,
        cancel: opts.cancel,
        ..Default::default()
    };
    let ctx = Ctx::new(&copts, lay.file_size + expert_total, expert_layers.len());
    ctx.check_cancel()?;
    output::check_space(dst, lay.file_size + expert_total + (1 << 20))?;
    let tmp = output::TempDir::create(dst)?;

    ctx.set_stage(ConvertStage::Dense, None);
    let dense_path = tmp.path.join(DENSE_FILE);
    write_dense(&init, &outputs, &jobs, &lay, &dense_path, &ctx)?;

    let experts_dir = tmp.path.join(EXPERTS_DIR);
    std::fs::create_dir(&experts_dir).map_err(|e| Error::io(&experts_dir, e))?;
    for el in &expert_layers {
        ctx.check_cancel()?;
        ctx.set_stage(ConvertStage::Experts, Some(el.layer));
        write_experts(&init, el, &tmp.path.join(&el.file), &ctx)?;
        ctx.layer_done();
    }
    output::fsync_dir(&experts_dir)?;

    ctx.check_cancel()?;
    ctx.set_stage(ConvertStage::Finishing, None);
    output::write_file(&tmp.path.join("config.json"), &json_4_spaces(&config_json))?;
    if let Some(t) = &opts.tokenizer {
        copy_tokenizer(t, &tmp.path)?;
    }
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        architecture: config.arch.model_type().into(),
        source: SourceInfo {
            path: format!("synth:{}", opts.name),
            kind: "synthetic".into(),
            expert_bits: Some(opts.expert_bits),
            expert_requantization: None,
        },
        dense_file: DENSE_FILE.into(),
        tensors: outputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let entry = TensorEntry {
                    dtype: crate::convert::dtype::name(t.dtype),
                    shape: t.shape.clone(),
                    offset: lay.offsets[i],
                    bytes: t.bytes(),
                };
                (t.name.clone(), entry)
            })
            .collect(),
        quantized,
        experts: expert_layers,
        low_width_experts: Vec::new(),
    };
    let text = manifest.file_text();
    output::write_file(&tmp.path.join(MANIFEST_FILE), text.as_bytes())?;
    ctx.check_cancel()?;
    tmp.commit(dst, opts.force)?;

    Ok(SynthReport {
        dst: dst.to_path_buf(),
        architecture: manifest.architecture,
        layers,
        preset_layers: depth,
        tensors: outputs.len(),
        dense_bytes: lay.file_size,
        expert_bytes: expert_total,
        elapsed: t0.elapsed(),
    })
}

/// The routed experts' quantization.
fn expert_spec(opts: &SynthOptions) -> QuantSpec {
    if opts.expert_mxfp4 {
        QuantSpec::MXFP4
    } else {
        QuantSpec::affine(opts.expert_bits, DEFAULT_GROUP_SIZE)
    }
}

/// The expert files' layouts, as `convert` lays them out (BF16 scales, or
/// MXFP4's e8m0 bytes).
fn expert_layouts(config: &ModelConfig, spec: QuantSpec) -> Vec<ExpertLayer> {
    let scale_dtype = if spec.is_mxfp4() {
        Dtype::U8
    } else {
        Dtype::BF16
    };
    schema::expert_weights(config)
        .iter()
        .map(|s| {
            let shapes: Vec<ComponentShape> = s
                .projections
                .iter()
                .map(|&(name, rows, cols)| (name, rows, cols, spec, scale_dtype))
                .collect();
            layout_layer(s.layer, s.num_experts, &shapes)
        })
        .collect()
}

/// config.json: the spec's, with mlx-lm's `quantization` block (4-bit g64,
/// every MoE layer's router and Qwen3.5's shared-expert gate at 8 bits,
/// experts at `expert_bits`) and a `moeflux_synth` record of how it was made.
fn config_json(opts: &SynthOptions, layers: usize) -> Result<serde_json::Value> {
    let base = opts.spec.config_json(layers);
    // The layer pattern as the loader will read it (dense layers have no
    // router and no experts to declare).
    let shape = ModelConfig::from_json(&base, Path::new("config.json"))?;
    let arch = shape.arch;
    let spec = |bits| QuantSpec::affine(bits, DEFAULT_GROUP_SIZE);
    let mut overrides = std::collections::BTreeMap::new();
    for l in (0..layers).filter(|&l| shape.is_moe_layer(l)) {
        let p = format!("model.layers.{l}.mlp.");
        // The router at 8 bits (mlx-lm's Qwen quant_predicates; DeepSeek and
        // GLM checkpoints keep their `noaux_tc` router in bf16, a synthetic
        // model quantizes it too), and Qwen3.5's shared-expert gate.
        let mut gates = vec![schema::router_module(&shape)];
        if shape.moe.shared_gate && shape.moe.shared_intermediate > 0 {
            gates.push("shared_expert_gate");
        }
        for m in gates {
            overrides.insert(mlx_module_path(arch, &format!("{p}{m}")), spec(8));
        }
        let experts = expert_spec(opts);
        if experts != spec(DEFAULT_BITS) {
            for c in EXPERT_COMPONENTS {
                let m = format!("{p}switch_mlp.{c}");
                overrides.insert(mlx_module_path(arch, &m), experts);
            }
        }
    }
    let cq = ConfigQuant {
        default: Some(spec(DEFAULT_BITS)),
        overrides,
        explicit: Default::default(),
    };
    let mut v = output_config(&base, None, &cq);
    v["moeflux_synth"] = json!({
        "preset": opts.name,
        "seed": opts.seed,
        "layers": layers,
        "preset_layers": opts.spec.num_layers(),
        "expert_bits": opts.expert_bits,
        "expert_mode": if opts.expert_mxfp4 { "mxfp4" } else { "affine" },
        "router_skew": opts.router_skew.map(|s| s.to_string()),
    });
    Ok(v)
}

fn write_dense(
    init: &Init,
    outputs: &[OutTensor],
    jobs: &[Job],
    lay: &crate::convert::dense::DenseLayout,
    path: &Path,
    ctx: &Ctx,
) -> Result<()> {
    let io = |e| Error::io(path, e);
    let file = File::create(path).map_err(io)?;
    let mut head = (lay.header.len() as u64).to_le_bytes().to_vec();
    head.extend_from_slice(&lay.header);
    file.write_all_at(&head, 0).map_err(io)?;
    file.set_len(lay.file_size).map_err(io)?;

    let mut items = Vec::new();
    for (j, job) in jobs.iter().enumerate() {
        let (rows, per) = match job {
            Job::Linear {
                init, cols, outs, ..
            } => {
                let rows = outputs[outs[0]].shape[0];
                (rows, (CHUNK_BYTES / init.row_bytes(*cols)).max(1))
            }
            Job::Floats { .. } => (1, 1),
        };
        items.extend((0..rows).step_by(per).map(|start| Item {
            job: j,
            start,
            end: (start + per).min(rows),
        }));
    }
    items.par_iter().try_for_each(|it| -> Result<()> {
        ctx.check_cancel()?;
        let n = match &jobs[it.job] {
            Job::Linear {
                cols, init, outs, ..
            } => {
                let groups = cols / DEFAULT_GROUP_SIZE;
                let rows = it.end - it.start;
                let rb = init.row_bytes(*cols);
                let mut codes = vec![0u8; rows * rb];
                let mut scales = vec![0u8; rows * groups * 2];
                let mut biases = vec![0u8; rows * groups * 2];
                init.fill(*cols, it.start, &mut codes, &mut scales, &mut biases);
                let at = |k: usize, row_bytes: usize| {
                    lay.offsets[outs[k]] + (it.start * row_bytes) as u64
                };
                file.write_all_at(&codes, at(0, rb)).map_err(io)?;
                file.write_all_at(&scales, at(1, groups * 2)).map_err(io)?;
                file.write_all_at(&biases, at(2, groups * 2)).map_err(io)?;
                codes.len() + scales.len() + biases.len()
            }
            Job::Floats { out, kind } => {
                let t = &outputs[*out];
                let vals = match *kind {
                    WeightKind::Conv { channels, kernel } => init.conv(&t.name, channels, kernel),
                    _ => init.vector(&t.name, t.shape.iter().product()),
                };
                let mut buf = vec![0u8; t.bytes() as usize];
                crate::convert::dtype::encode_into(&vals, t.dtype, &mut buf);
                file.write_all_at(&buf, lay.offsets[*out]).map_err(io)?;
                buf.len()
            }
        };
        ctx.advance(n as u64);
        Ok(())
    })?;
    ctx.advance(head.len() as u64);
    file.sync_all().map_err(io)
}

/// One MoE layer's expert file: every extent generated in a per-thread
/// buffer (its gaps stay zero: every expert writes the same ranges) and
/// written at its offset at once.
fn write_experts(init: &Init, el: &ExpertLayer, path: &Path, ctx: &Ctx) -> Result<()> {
    let io = |e| Error::io(path, e);
    let stride = el.stride as usize;
    let file = File::create(path).map_err(io)?;
    file.set_len(el.stride * el.num_experts as u64)
        .map_err(io)?;
    (0..el.num_experts).into_par_iter().try_for_each_init(
        || vec![0u8; stride],
        |buf, e| -> Result<()> {
            ctx.check_cancel()?;
            for c in &el.components {
                let li = init.expert(el.layer, e, &c.name, c.cols, c.quant);
                let range = |r: &ExpertTensorRef| r.offset as usize..(r.offset + r.bytes) as usize;
                let (w, s) = (range(&c.weight), range(&c.scales));
                let Some(b) = c.biases.as_ref().map(range) else {
                    let (head, rest) = buf.split_at_mut(s.start);
                    li.fill_mxfp4(c.cols, &mut head[w], &mut rest[..s.len()]);
                    continue;
                };
                let (head, rest) = buf.split_at_mut(s.start);
                let (sc, bi) = rest.split_at_mut(b.start - s.start);
                li.fill(
                    c.cols,
                    0,
                    &mut head[w],
                    &mut sc[..s.len()],
                    &mut bi[..b.len()],
                );
            }
            file.write_all_at(buf, (e * stride) as u64).map_err(io)?;
            ctx.advance(stride as u64);
            Ok(())
        },
    )?;
    file.sync_all().map_err(io)?;
    // Durable: drop the pages rather than evict more useful data (as convert).
    // SAFETY: plain fadvise on an open descriptor.
    unsafe {
        libc::posix_fadvise(
            std::os::fd::AsRawFd::as_raw_fd(&file),
            0,
            0,
            libc::POSIX_FADV_DONTNEED,
        );
    }
    Ok(())
}

/// Copies `src` as `tokenizer.json`, or the tokenizer files of directory `src`.
fn copy_tokenizer(src: &Path, dir: &Path) -> Result<()> {
    if !src.is_dir() {
        return output::copy_file(src, &dir.join("tokenizer.json"));
    }
    for f in crate::convert::AUX_FILES {
        let p = src.join(f);
        if p.is_file() {
            output::copy_file(&p, &dir.join(f))?;
        }
    }
    Ok(())
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LayerKind;

    #[test]
    fn presets_have_the_real_shapes() {
        // Bytes per expert from the reference's table (4-bit, and A17B at 2 bits).
        for (name, bits, expert_bytes, conv_dim) in [
            ("qwen3.6-35b-a3b", 4, 1_769_472, 8192),
            ("qwen3.5-397b-a17b", 4, 7_077_888, 12288),
            ("qwen3.5-397b-a17b", 2, 3_932_160, 12288),
        ] {
            let p = find_preset(name).unwrap();
            let depth = p.spec.num_layers();
            let mut o = SynthOptions::new(name, p.spec);
            o.expert_bits = bits;
            let c =
                ModelConfig::from_json(&config_json(&o, depth).unwrap(), Path::new("c")).unwrap();
            let full: Vec<usize> = (0..depth)
                .filter(|&i| c.layer_kinds[i] == LayerKind::FullAttention)
                .collect();
            assert_eq!(full.len(), depth / 4);
            assert_eq!(full[..2], [3, 7]);
            assert_eq!(c.linear.conv_dim(), conv_dim);
            assert_eq!(c.rope.rotary_dim, 64);
            let q = c.quantization.as_ref().unwrap();
            assert_eq!(q.for_module("model.layers.5.mlp.gate").unwrap().bits, 8);
            let e = q
                .for_module("model.layers.5.mlp.switch_mlp.up_proj")
                .unwrap();
            assert_eq!(e.bits, bits);
            let layers = expert_layouts(&c, QuantSpec::affine(bits, DEFAULT_GROUP_SIZE));
            assert_eq!(layers.len(), depth);
            assert_eq!(layers[0].expert_bytes, expert_bytes, "{name} {bits}-bit");
            assert_eq!(layers[0].stride, expert_bytes, "already 4096-aligned");
        }
    }

    /// Expert bytes at 4-bit g64 with bf16 scales: 3 projections of
    /// `moe x hidden` codes (half a byte each) plus 2 bytes of scale and of
    /// bias per 64: `3 * moe * hidden * 9 / 16`.
    fn expert_bytes_4bit(moe: usize, hidden: usize) -> u64 {
        (3 * moe * hidden * 9 / 16) as u64
    }

    fn preset_config(name: &str, layers: Option<usize>) -> ModelConfig {
        let p = find_preset(name).unwrap();
        let depth = layers.unwrap_or(p.spec.num_layers());
        let o = SynthOptions::new(name, p.spec);
        ModelConfig::from_json(&config_json(&o, depth).unwrap(), Path::new("c")).unwrap()
    }

    #[test]
    fn gpt_oss_presets_have_the_real_shapes() {
        for (name, layers, experts) in [("gpt-oss-120b", 36, 128), ("gpt-oss-20b", 24, 32)] {
            let c = preset_config(name, None);
            assert_eq!(c.arch, crate::Architecture::GptOss);
            assert_eq!(
                (c.num_layers, c.hidden_size, c.vocab_size),
                (layers, 2880, 201_088)
            );
            assert_eq!(
                (c.num_attention_heads, c.num_kv_heads, c.head_dim),
                (64, 8, 64)
            );
            assert_eq!((c.moe.num_experts, c.moe.num_experts_per_tok), (experts, 4));
            assert_eq!(c.moe.moe_intermediate, 2880);
            assert_eq!(c.attention_window[0], Some(128));
            assert_eq!(c.attention_window[1], None);
            assert!(c.attention.sinks && c.attention.o_bias && c.moe.expert_bias);
            assert_eq!(c.rope.yarn.unwrap().factor, 32.0);
            let q = c.quantization.as_ref().unwrap();
            let router = mlx_module_path(c.arch, "model.layers.3.mlp.router");
            assert_eq!(q.for_module(&router).unwrap().bits, 8);
            // Each expert: gate, up (2880 x 2880) and down, 4-bit g64.
            let layers = expert_layouts(&c, QuantSpec::affine(4, DEFAULT_GROUP_SIZE));
            assert_eq!(layers[0].expert_bytes, expert_bytes_4bit(2880, 2880));
        }
    }

    #[test]
    fn qwen3_moe_presets_have_the_real_shapes() {
        for (name, layers, hidden, heads, experts_moe, ffn) in [
            ("qwen3-235b-a22b", 94, 4096, 64, 1536, 12_288),
            ("qwen3-30b-a3b", 48, 2048, 32, 768, 6144),
        ] {
            let c = preset_config(name, None);
            assert_eq!(c.arch, crate::Architecture::Qwen3Moe);
            assert_eq!(
                (c.num_layers, c.hidden_size, c.vocab_size),
                (layers, hidden, 151_936),
                "{name}"
            );
            assert_eq!(
                (c.num_attention_heads, c.num_kv_heads, c.head_dim),
                (heads, 4, 128)
            );
            assert_eq!(
                c.attention,
                crate::config::AttentionConfig {
                    output_gate: false,
                    qk_norm: true,
                    qkv_bias: false,
                    ..Default::default()
                }
            );
            assert!(c.layer_kinds.iter().all(|k| *k == LayerKind::FullAttention));
            assert!(c
                .mlp_kinds
                .iter()
                .all(|k| *k == crate::config::MlpKind::Moe));
            assert_eq!(
                (
                    c.moe.num_experts,
                    c.moe.num_experts_per_tok,
                    c.moe.moe_intermediate,
                    c.moe.shared_intermediate
                ),
                (128, 8, experts_moe, 0)
            );
            assert_eq!(c.moe.router, crate::config::RouterKind::Softmax);
            assert!(c.moe.norm_topk_prob);
            assert_eq!(c.intermediate_size, ffn);
            assert_eq!((c.rope.rotary_dim, c.rope.theta), (128, 1e6));
            assert!(!c.rope.interleaved && !c.tie_word_embeddings);
            assert_eq!(c.max_position_embeddings, 40_960);
            assert_eq!(c.eos_token_ids, [151_645, 151_643]);
            let q = c.quantization.as_ref().unwrap();
            assert_eq!(q.for_module("model.layers.7.mlp.gate").unwrap().bits, 8);
            assert_eq!(
                q.for_module("model.layers.7.self_attn.q_proj")
                    .unwrap()
                    .bits,
                4
            );
            assert!(!q.overrides.keys().any(|k| k.contains("shared_expert")));
            let e = expert_layouts(&c, QuantSpec::affine(4, DEFAULT_GROUP_SIZE));
            assert_eq!(e.len(), layers);
            assert_eq!(e[0].num_experts, 128);
            assert_eq!(e[0].expert_bytes, expert_bytes_4bit(experts_moe, hidden));
            assert_eq!(e[0].stride, e[0].expert_bytes, "already 4096-aligned");
            // No biases in Qwen3's attention; q/k norms of head_dim.
            let w = schema::dense_weights(&c);
            assert!(!w.iter().any(|w| w.name.ends_with(".bias")));
            assert!(w
                .iter()
                .any(|w| w.name == "model.layers.3.self_attn.k_norm.weight"));
        }
    }

    #[test]
    fn glm_presets_have_the_real_shapes() {
        // (name, layers, hidden, first dense, dense ffn, experts, moe, scaling, qk norm, positions)
        for (name, layers, hidden, dense, ffn, experts, moe, scaling, qk_norm, positions) in [
            (
                "glm-4.6", 92, 5120, 3, 12_288, 160, 1536, 2.5, true, 202_752,
            ),
            (
                "glm-4.5-air",
                46,
                4096,
                1,
                10_944,
                128,
                1408,
                1.0,
                false,
                131_072,
            ),
        ] {
            let c = preset_config(name, None);
            assert_eq!(c.arch, crate::Architecture::Glm4Moe);
            assert_eq!(
                (c.num_layers, c.hidden_size, c.vocab_size),
                (layers, hidden, 151_552),
                "{name}"
            );
            assert_eq!(
                (c.num_attention_heads, c.num_kv_heads, c.head_dim),
                (96, 8, 128)
            );
            assert_eq!(
                c.attention,
                crate::config::AttentionConfig {
                    output_gate: false,
                    qk_norm,
                    qkv_bias: true,
                    ..Default::default()
                }
            );
            let moe_layers: Vec<usize> = (0..layers).filter(|&l| c.is_moe_layer(l)).collect();
            assert_eq!(moe_layers, (dense..layers).collect::<Vec<_>>());
            assert_eq!(c.intermediate_size, ffn);
            assert_eq!(
                (
                    c.moe.num_experts,
                    c.moe.num_experts_per_tok,
                    c.moe.moe_intermediate,
                    c.moe.shared_intermediate,
                    c.moe.shared_gate,
                    c.moe.norm_topk_prob
                ),
                (experts, 8, moe, moe, false, true)
            );
            assert_eq!(
                c.moe.router,
                crate::config::RouterKind::NoauxTc {
                    n_group: 1,
                    topk_group: 1,
                    routed_scaling_factor: scaling
                }
            );
            // Half of each head rotates, half-split pairs.
            assert_eq!((c.rope.rotary_dim, c.rope.theta), (64, 1e6));
            assert!(!c.rope.interleaved && !c.tie_word_embeddings);
            assert_eq!(c.rms_norm_eps, 1e-5);
            assert_eq!(c.max_position_embeddings, positions);
            assert_eq!(c.eos_token_ids, [151_329, 151_336, 151_338]);
            let q = c.quantization.as_ref().unwrap();
            let router = |l: usize| mlx_module_path(c.arch, &format!("model.layers.{l}.mlp.gate"));
            assert_eq!(q.overrides[&router(dense)], Some(spec8()));
            assert!(!q.overrides.contains_key(&router(dense - 1)), "dense layer");
            let e = expert_layouts(&c, QuantSpec::affine(4, DEFAULT_GROUP_SIZE));
            assert_eq!(e.len(), layers - dense);
            assert_eq!(e[0].layer, dense);
            assert_eq!(e[0].num_experts, experts);
            assert_eq!(e[0].expert_bytes, expert_bytes_4bit(moe, hidden));
            assert_eq!(e[0].stride, e[0].expert_bytes, "already 4096-aligned");
            let w = schema::dense_weights(&c);
            let has = |n: &str| w.iter().any(|w| w.name == n);
            let a = format!("model.layers.{dense}.");
            assert!(has(&format!("{a}self_attn.q_proj.bias")));
            assert!(has(&format!("{a}self_attn.v_proj.bias")));
            assert_eq!(has(&format!("{a}self_attn.q_norm.weight")), qk_norm);
            assert!(has(&format!("{a}mlp.gate.e_score_correction_bias")));
            assert!(has(&format!("{a}mlp.shared_experts.down_proj")));
            assert!(has("model.layers.0.mlp.gate_proj"));

            // Truncated to the dense layers: no router, no experts.
            let t = preset_config(name, Some(dense));
            assert_eq!(t.num_layers, dense);
            assert!(expert_layouts(&t, QuantSpec::affine(4, DEFAULT_GROUP_SIZE)).is_empty());
            assert!(t
                .quantization
                .unwrap()
                .overrides
                .keys()
                .all(|k| !k.contains("mlp.gate")));
        }
    }

    fn spec8() -> QuantSpec {
        QuantSpec::affine(8, DEFAULT_GROUP_SIZE)
    }
}
