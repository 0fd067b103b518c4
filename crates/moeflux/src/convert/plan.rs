//! The conversion plan: every output tensor and expert component, checked
//! against the architecture's schema (`model::schema`) before anything is
//! written, and how each is produced (copied, converted, quantized,
//! re-quantized).
//!
//! Unquantized sources follow `mlx_lm.convert -q --q-bits 4 --q-group-size 64`:
//! float tensors are cast to the config's `torch_dtype` (qwen3_5 keeps `A_log`
//! as it is: `cast_predicate`), then every linear/embedding/expert weight whose
//! input width is a multiple of 64 is quantized at 4 bits, the router
//! (`mlp.gate`) and `mlp.shared_expert_gate` at 8 bits (`quant_predicate`).

use std::collections::BTreeMap;

use safetensors::Dtype;
use serde_json::{json, Map, Value};

use crate::config::{Architecture, QuantSpec, RouterKind};
use crate::error::{Error, Result};
use crate::format::{
    expert_file_name, ExpertComponent, ExpertLayer, ExpertTensorRef, COMPONENT_ALIGN, EXPERT_ALIGN,
};
use crate::model::schema::{self, WeightKind, EXPERT_COMPONENTS};
use crate::quant::affine::words_per_row;
use crate::quant::mxfp4;

use super::dtype::{self, FloatTy};
use super::kvb::{KvbQuantSrc, KvbSplit};
use super::sanitize::{mlx_module_path, DenseSrc, ExpertSrc, RowPick, Sanitized};
use super::source::Source;

/// mlx-lm's group size and default width for `convert -q`.
pub const DEFAULT_GROUP_SIZE: usize = 64;
pub const DEFAULT_BITS: u32 = 4;
/// Width of the router and shared-expert gate (mlx-lm `quant_predicate`).
pub const GATE_BITS: u32 = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// Already quantized by mlx-lm.
    Mlx,
    /// bf16/f16/f32 weights, quantized here.
    Unquantized,
}

impl SourceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SourceKind::Mlx => "mlx",
            SourceKind::Unquantized => "unquantized",
        }
    }
}

/// One tensor of `dense.safetensors`.
#[derive(Debug, Clone)]
pub struct OutTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl OutTensor {
    pub fn bytes(&self) -> u64 {
        (self.shape.iter().product::<usize>() * dtype::size_of(self.dtype)) as u64
    }
}

/// How one or three output tensors are produced.
#[derive(Debug, Clone)]
pub enum DenseJob {
    /// A source tensor: verbatim when nothing changes, else decoded, shifted
    /// by +1 in the source type, cast to `cast` and stored as `out`'s dtype.
    Tensor {
        out: usize,
        raw: String,
        src_ty: Option<FloatTy>,
        plus_one: bool,
        cast: Option<FloatTy>,
        /// Only every other element of `raw`, from this one (`DenseSrc::interleave`).
        interleave: Option<usize>,
    },
    /// A float `[rows, cols]` weight quantized into `outs` = weight, scales, biases.
    Quantize {
        outs: [usize; 3],
        raw: String,
        src_ty: FloatTy,
        rows: usize,
        cols: usize,
        spec: QuantSpec,
        /// Type the weight is cast to first; scales/biases are rounded to it.
        work: FloatTy,
        /// `raw` is MLA's whole `kv_b_proj`; this output is one half of it.
        kvb: Option<KvbSplit>,
        /// ... and `raw` is quantized (older mlx-lm checkpoints).
        kvb_quant: Option<KvbQuantSrc>,
    },
}

/// How an expert projection is produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertOp {
    /// Codes, scales and biases copied (F16 scales widened to F32).
    Copy,
    /// Dequantized in f32 and re-quantized by flash-moe's 2-bit algorithm.
    Seed2,
    /// Dequantized in f32 and re-quantized by MLX's algorithm.
    Requant,
    /// Float weights quantized by MLX's algorithm after a cast to `work`.
    Quantize { work: FloatTy },
}

#[derive(Debug, Clone)]
pub struct ComponentPlan {
    pub name: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub src: ExpertSrc,
    /// Quantization and scale type of the source (quantized sources).
    pub src_quant: Option<(QuantSpec, FloatTy)>,
    /// Float type of the source (float sources).
    pub src_float: Option<FloatTy>,
    pub op: ExpertOp,
    pub out_spec: QuantSpec,
    pub out_scale_dtype: Dtype,
}

#[derive(Debug, Clone)]
pub struct LayerPlan {
    pub layer: usize,
    pub num_experts: usize,
    pub components: Vec<ComponentPlan>,
    /// The manifest entry (offsets inside an extent, stride).
    pub manifest: ExpertLayer,
}

#[derive(Debug)]
pub struct Plan {
    pub kind: SourceKind,
    pub outputs: Vec<OutTensor>,
    pub jobs: Vec<DenseJob>,
    pub quantized: BTreeMap<String, QuantSpec>,
    pub layers: Vec<LayerPlan>,
    pub source_expert_bits: Option<u32>,
    pub expert_requantization: Option<String>,
    /// Per-module entries to add to config.json's `quantization`
    /// (mlx module path -> spec); `None` leaves config.json as it is.
    pub config_quant: Option<ConfigQuant>,
}

#[derive(Debug, Clone)]
pub struct ConfigQuant {
    /// Write the default `{"group_size", "bits", "mode"}` too (unquantized source).
    pub default: Option<QuantSpec>,
    /// Written as `{"group_size", "bits"}`, plus `"mode"` when not affine.
    pub overrides: BTreeMap<String, QuantSpec>,
    /// Written with `"mode"` always (mlx-lm's entries for modules it
    /// quantized under a default of another mode).
    pub explicit: BTreeMap<String, QuantSpec>,
}

struct Planner<'a> {
    src: &'a Source,
    san: &'a Sanitized,
    kind: SourceKind,
    /// `torch_dtype` cast of an unquantized source.
    cast: Option<FloatTy>,
    outputs: Vec<OutTensor>,
    jobs: Vec<DenseJob>,
    quantized: BTreeMap<String, QuantSpec>,
    used: Vec<String>,
    gate_overrides: BTreeMap<String, QuantSpec>,
}

fn spec(bits: u32, group_size: usize) -> QuantSpec {
    QuantSpec::affine(bits, group_size)
}

impl<'a> Planner<'a> {
    fn raw(&self, raw: &str) -> &'a super::source::RawTensor {
        &self.src.tensors[raw]
    }

    fn err(&self, raw: &str, reason: impl Into<String>) -> Error {
        Error::tensor(self.src.file_of(raw), raw, reason)
    }

    fn missing(&self, canon: &str) -> Error {
        Error::tensor(
            self.src.weights_location(),
            canon,
            "missing from the checkpoint",
        )
    }

    fn dense(&mut self, canon: &str) -> Option<DenseSrc> {
        let d = self.san.dense.get(canon)?.clone();
        self.used.push(canon.to_string());
        Some(d)
    }

    fn float_ty(&self, raw: &str) -> Result<FloatTy> {
        let t = self.raw(raw);
        self.src.float_ty(raw).ok_or_else(|| {
            self.err(
                raw,
                format!(
                    "dtype {:?}, expected a float type (BF16, F16, F32, or F8_E4M3 with block scales)",
                    t.dtype
                ),
            )
        })
    }

    fn check_shape(&self, raw: &str, shape: &[usize], want: &[usize], what: &str) -> Result<()> {
        if shape != want {
            return Err(self.err(raw, format!("shape {shape:?}, expected {want:?} ({what})")));
        }
        Ok(())
    }

    fn push_out(&mut self, name: String, dtype: Dtype, shape: Vec<usize>) -> usize {
        self.outputs.push(OutTensor { name, dtype, shape });
        self.outputs.len() - 1
    }

    /// Cast applied to a float tensor of an unquantized source.
    fn cast_for(&self, canon: &str) -> Option<FloatTy> {
        if self.kind != SourceKind::Unquantized {
            return None;
        }
        // qwen3_5's cast_predicate keeps A_log in its source dtype.
        if self.src.config.arch == Architecture::Qwen3_5Moe && canon.ends_with("A_log") {
            return None;
        }
        // deepseek_v3's and glm4_moe's cast_predicate keeps the router's
        // correction bias.
        if canon.ends_with("e_score_correction_bias") {
            return None;
        }
        self.cast
    }

    /// A float tensor copied (or converted) under its canonical name.
    fn float_tensor(&mut self, canon: &str, want: &[usize], what: &str) -> Result<()> {
        let d = self.dense(canon).ok_or_else(|| self.missing(canon))?;
        let ty = self.float_ty(&d.raw)?;
        self.check_shape(&d.raw, &d.shape, want, what)?;
        if d.kvb.is_some() || self.src.fp8_scales.contains_key(&d.raw) {
            // Only the quantizing path splits kv_b_proj and decodes FP8 blocks.
            return Err(self.err(
                &d.raw,
                format!(
                    "would be stored unquantized as `{canon}` (input width not a multiple of \
                     {DEFAULT_GROUP_SIZE}), which FP8 and kv_b_proj sources do not support"
                ),
            ));
        }
        let cast = self.cast_for(canon);
        let out_ty = cast.unwrap_or(ty);
        let out = self.push_out(canon.to_string(), out_ty.stored(), d.shape.clone());
        self.jobs.push(DenseJob::Tensor {
            out,
            raw: d.raw,
            src_ty: Some(ty),
            plus_one: d.plus_one,
            cast,
            interleave: d.interleave,
        });
        Ok(())
    }

    fn linear(&mut self, module: &str, rows: usize, cols: usize) -> Result<()> {
        let wname = format!("{module}.weight");
        if let Some(d) = self.san.dense.get(&wname).filter(|d| d.kvb_quant.is_some()) {
            let d = d.clone();
            return self.requantized_kvb_half(&wname, d, rows, cols);
        }
        let has_scales = self.san.dense.contains_key(&format!("{module}.scales"));
        if has_scales {
            return self.quantized_linear(module, rows, cols);
        }
        let d = self.dense(&wname).ok_or_else(|| self.missing(&wname))?;
        let ty = self.float_ty(&d.raw)?;
        self.check_shape(&d.raw, &d.shape, &[rows, cols], "[out, in]")?;
        let arch = self.src.config.arch;
        // mlx-lm's MoEGate (the `noaux_tc` router of DeepSeek and GLM) is a
        // plain parameter, never quantized: the router stays in the
        // checkpoint's float type (cast like every float).
        let noaux_router = matches!(self.src.config.moe.router, RouterKind::NoauxTc { .. })
            && module.ends_with("mlp.gate");
        if self.kind == SourceKind::Unquantized
            && cols.is_multiple_of(DEFAULT_GROUP_SIZE)
            && !noaux_router
        {
            let gate = module.ends_with("mlp.gate")
                || module.ends_with("shared_expert_gate")
                || module.ends_with("mlp.router");
            // The Qwen and gpt-oss quant_predicates make routers 8-bit:
            // qwen3_5's only for MoE models, the others' always.
            let gate_active = match arch {
                Architecture::Qwen3_5Moe => self.src.config.moe.num_experts > 0,
                Architecture::Qwen3Next | Architecture::Qwen3Moe | Architecture::GptOss => true,
                Architecture::Glm4Moe
                | Architecture::DeepseekV3
                | Architecture::KimiK2
                | Architecture::KimiK25 => false,
            };
            let bits = if gate && gate_active {
                self.gate_overrides.insert(
                    mlx_module_path(arch, module),
                    spec(GATE_BITS, DEFAULT_GROUP_SIZE),
                );
                GATE_BITS
            } else {
                DEFAULT_BITS
            };
            let sp = spec(bits, DEFAULT_GROUP_SIZE);
            let work = self.cast.unwrap_or(ty);
            let groups = cols / DEFAULT_GROUP_SIZE;
            let w = self.push_out(wname, Dtype::U32, vec![rows, words_per_row(cols, bits)]);
            let s = self.push_out(
                format!("{module}.scales"),
                work.stored(),
                vec![rows, groups],
            );
            let b = self.push_out(
                format!("{module}.biases"),
                work.stored(),
                vec![rows, groups],
            );
            self.quantized.insert(module.to_string(), sp);
            self.jobs.push(DenseJob::Quantize {
                outs: [w, s, b],
                raw: d.raw,
                src_ty: ty,
                rows,
                cols,
                spec: sp,
                work,
                kvb: d.kvb,
                kvb_quant: None,
            });
        } else {
            // Left unquantized (mlx-lm skips inputs not divisible by the group size).
            self.used.pop();
            self.float_tensor(&wname, &[rows, cols], "[out, in]")?;
        }
        Ok(())
    }

    /// One half of an unsplit quantized `kv_b_proj`: dequantized in its
    /// scales' type, split and quantized again with its bits and group size,
    /// as mlx-lm's `deepseek_v3.sanitize` (which infers both from the shapes).
    fn requantized_kvb_half(
        &mut self,
        wname: &str,
        d: DenseSrc,
        rows: usize,
        cols: usize,
    ) -> Result<()> {
        self.used.push(wname.to_string());
        let (Some(k), Some((scales, biases))) = (d.kvb, d.kvb_quant.clone()) else {
            unreachable!("called for quantized kv_b_proj halves");
        };
        let w = self.raw(&d.raw);
        let (s, b) = (self.raw(&scales), self.raw(&biases));
        if w.dtype != Dtype::U32 || w.shape.len() != 2 || s.shape.len() != 2 {
            return Err(self.err(
                &d.raw,
                "quantized kv_b_proj: expected U32 [rows, packed] codes",
            ));
        }
        let (packed, groups) = (w.shape[1], s.shape[1]);
        let bits = (packed * 32 / k.kv_lora) as u32;
        let group_size = k.kv_lora.checked_div(groups).unwrap_or(0);
        let q = spec(bits, group_size);
        q.validate().map_err(|r| self.err(&d.raw, r))?;
        let sty = self.float_ty(&scales)?;
        if self.float_ty(&biases)? != sty || s.shape != b.shape {
            return Err(self.err(&biases, "scales and biases differ in dtype or shape"));
        }
        let rows_src = k.source_rows();
        if w.shape != [rows_src, words_per_row(k.kv_lora, bits)]
            || s.shape != [rows_src, k.kv_lora / group_size]
            || !cols.is_multiple_of(group_size)
        {
            return Err(self.err(
                &d.raw,
                format!(
                    "quantized kv_b_proj {:?} with scales {:?} does not fit \
                     [{rows_src}, {}] at {bits} bits, group {group_size}",
                    w.shape, s.shape, k.kv_lora
                ),
            ));
        }
        let module = wname.trim_end_matches(".weight");
        let groups_out = cols / group_size;
        let outs = [
            self.push_out(
                wname.to_string(),
                Dtype::U32,
                vec![rows, words_per_row(cols, bits)],
            ),
            self.push_out(
                format!("{module}.scales"),
                sty.stored(),
                vec![rows, groups_out],
            ),
            self.push_out(
                format!("{module}.biases"),
                sty.stored(),
                vec![rows, groups_out],
            ),
        ];
        self.quantized.insert(module.to_string(), q);
        self.jobs.push(DenseJob::Quantize {
            outs,
            raw: d.raw,
            src_ty: sty,
            rows,
            cols,
            spec: q,
            work: sty,
            kvb: Some(k),
            kvb_quant: Some(KvbQuantSrc {
                scales,
                biases,
                spec: q,
                scale_ty: sty,
            }),
        });
        Ok(())
    }

    fn quantized_linear(&mut self, module: &str, rows: usize, cols: usize) -> Result<()> {
        let wname = format!("{module}.weight");
        let w = self.dense(&wname).ok_or_else(|| self.missing(&wname))?;
        let q = self
            .src
            .config
            .quantization
            .as_ref()
            .and_then(|q| q.for_module(module))
            .ok_or_else(|| {
                self.err(
                    &w.raw,
                    "has scales but config.json `quantization` gives no bits for it",
                )
            })?;
        q.validate().map_err(|r| self.err(&w.raw, r))?;
        if q.is_mxfp4() {
            return Err(self.err(
                &w.raw,
                "MXFP4; moeflux reads MXFP4 for routed experts only, not for dense modules",
            ));
        }
        q.check_cols(cols).map_err(|r| self.err(&w.raw, r))?;
        let wt = self.raw(&w.raw);
        if wt.dtype != Dtype::U32 {
            return Err(self.err(
                &w.raw,
                format!("dtype {:?}, expected U32 (quantized codes)", wt.dtype),
            ));
        }
        let packed = vec![rows, words_per_row(cols, q.bits)];
        self.check_shape(
            &w.raw,
            &w.shape,
            &packed,
            &format!("{}-bit codes of [{rows}, {cols}]", q.bits),
        )?;
        let wo = self.push_out(wname, Dtype::U32, packed);
        self.jobs.push(DenseJob::Tensor {
            out: wo,
            raw: w.raw,
            src_ty: None,
            plus_one: false,
            cast: None,
            interleave: None,
        });
        let groups = vec![rows, cols / q.group_size];
        let mut sty = None;
        for part in ["scales", "biases"] {
            let n = format!("{module}.{part}");
            let d = self.dense(&n).ok_or_else(|| self.missing(&n))?;
            let ty = self.float_ty(&d.raw)?;
            if *sty.get_or_insert(ty) != ty {
                return Err(self.err(&d.raw, "scales and biases differ in dtype"));
            }
            self.check_shape(&d.raw, &d.shape, &groups, "[out, in/group_size]")?;
            let out = self.push_out(n, ty.stored(), groups.clone());
            self.jobs.push(DenseJob::Tensor {
                out,
                raw: d.raw,
                src_ty: Some(ty),
                plus_one: false,
                cast: None,
                interleave: None,
            });
        }
        self.quantized.insert(module.to_string(), q);
        Ok(())
    }

    fn expert_component(
        &self,
        layer: usize,
        ci: usize,
        rows: usize,
        cols: usize,
        num_experts: usize,
        target_bits: Option<u32>,
    ) -> Result<ComponentPlan> {
        let name = EXPERT_COMPONENTS[ci];
        let module = format!("model.layers.{layer}.mlp.switch_mlp.{name}");
        let src = self
            .san
            .experts
            .get(&(layer, ci))
            .ok_or_else(|| self.missing(&format!("{module}.weight")))?
            .clone();
        let e = num_experts;
        let mut plan = ComponentPlan {
            name,
            rows,
            cols,
            src: src.clone(),
            src_quant: None,
            src_float: None,
            op: ExpertOp::Copy,
            out_spec: spec(DEFAULT_BITS, DEFAULT_GROUP_SIZE),
            out_scale_dtype: Dtype::BF16,
        };
        match &src {
            ExpertSrc::Quantized {
                weight,
                scales,
                biases,
            } => {
                let q = self.expert_quant(&module).ok_or_else(|| {
                    self.err(
                        weight,
                        "has scales but config.json `quantization` gives no bits for it",
                    )
                })?;
                q.validate().map_err(|r| self.err(weight, r))?;
                if q.is_mxfp4() {
                    return Err(self.err(
                        biases,
                        "config.json declares these experts MXFP4, which have no biases",
                    ));
                }
                q.check_cols(cols).map_err(|r| self.err(weight, r))?;
                let wt = self.raw(weight);
                if wt.dtype != Dtype::U32 {
                    return Err(self.err(
                        weight,
                        format!("dtype {:?}, expected U32 (quantized codes)", wt.dtype),
                    ));
                }
                self.check_shape(
                    weight,
                    &wt.shape,
                    &[e, rows, words_per_row(cols, q.bits)],
                    &format!("{}-bit codes of {e} experts x [{rows}, {cols}]", q.bits),
                )?;
                let sty = self.float_ty(scales)?;
                for n in [scales, biases] {
                    let ty = self.float_ty(n)?;
                    if ty != sty {
                        return Err(self.err(n, "scales and biases differ in dtype"));
                    }
                    self.check_shape(
                        n,
                        &self.raw(n).shape,
                        &[e, rows, cols / q.group_size],
                        "[experts, out, in/group_size]",
                    )?;
                }
                plan.src_quant = Some((q, sty));
                match target_bits {
                    None => {
                        plan.op = ExpertOp::Copy;
                        plan.out_spec = q;
                        plan.out_scale_dtype = sty.stored();
                    }
                    Some(b) if b == q.bits => {
                        plan.op = ExpertOp::Copy;
                        plan.out_spec = q;
                        plan.out_scale_dtype = sty.stored();
                    }
                    Some(2) => {
                        plan.op = ExpertOp::Seed2;
                        plan.out_spec = spec(2, q.group_size);
                        plan.out_scale_dtype = Dtype::BF16;
                    }
                    Some(b) => {
                        plan.op = ExpertOp::Requant;
                        plan.out_spec = spec(b, q.group_size);
                        plan.out_scale_dtype = if sty == FloatTy::Bf16 {
                            Dtype::BF16
                        } else {
                            Dtype::F32
                        };
                    }
                }
            }
            ExpertSrc::Mxfp4 {
                weight,
                scales,
                pick,
            } => self.mxfp4_component(
                &module,
                weight,
                scales,
                *pick,
                rows,
                cols,
                e,
                target_bits,
                &mut plan,
            )?,
            ExpertSrc::Stacked {
                raw,
                row_start,
                rows: src_rows,
            } => {
                let t = self.raw(raw);
                let ty = self.float_ty(raw)?;
                let full = t.shape.get(1).copied().unwrap_or(0);
                let want = if *row_start == 0 && *src_rows == full {
                    vec![e, rows, cols]
                } else {
                    // Fused gate_up: [E, 2I, H].
                    vec![e, 2 * rows, cols]
                };
                if t.shape.len() != 3 || t.shape != want || *src_rows != rows {
                    return Err(self.err(
                        raw,
                        format!(
                            "shape {:?}, expected {want:?} ({name} of {e} experts, [{rows}, {cols}] each)",
                            t.shape
                        ),
                    ));
                }
                plan.src_float = Some(ty);
            }
            ExpertSrc::PerExpert(raws) => {
                let mut ty0 = None;
                for r in raws {
                    let ty = self.float_ty(r)?;
                    ty0.get_or_insert(ty);
                    self.check_shape(r, &self.raw(r).shape, &[rows, cols], "[out, in]")?;
                }
                plan.src_float = ty0;
            }
        }
        if let Some(ty) = plan.src_float {
            let bits = target_bits.unwrap_or(DEFAULT_BITS);
            if !cols.is_multiple_of(DEFAULT_GROUP_SIZE) {
                return Err(self.err(
                    src.first_raw(),
                    format!(
                        "{cols} input columns not divisible by {DEFAULT_GROUP_SIZE}; \
                         experts must be quantized"
                    ),
                ));
            }
            let work = self.cast.unwrap_or(ty);
            plan.op = ExpertOp::Quantize { work };
            plan.out_spec = spec(bits, DEFAULT_GROUP_SIZE);
            plan.out_scale_dtype = work.stored();
        }
        Ok(plan)
    }
}

impl Planner<'_> {
    /// What config.json's `quantization` says of the canonical expert module.
    fn expert_quant(&self, module: &str) -> Option<QuantSpec> {
        let q = self.src.config.quantization.as_ref()?;
        q.for_module(&mlx_module_path(self.src.config.arch, module))
    }

    /// MXFP4 experts, copied as released: config.json must declare them
    /// (mlx-lm layout; a Hugging Face release says so by its `_blocks`), and
    /// no other width is made from them.
    #[allow(clippy::too_many_arguments)]
    fn mxfp4_component(
        &self,
        module: &str,
        weight: &str,
        scales: &str,
        pick: RowPick,
        rows: usize,
        cols: usize,
        e: usize,
        target_bits: Option<u32>,
        plan: &mut ComponentPlan,
    ) -> Result<()> {
        let (w, s) = (self.raw(weight), self.raw(scales));
        let src_rows = pick.source_rows(rows);
        let groups = cols / mxfp4::GROUP;
        if !cols.is_multiple_of(mxfp4::GROUP) {
            return Err(self.err(weight, format!("{cols} input columns not divisible by 32")));
        }
        if w.dtype == Dtype::U32 {
            let q = self.expert_quant(module);
            if let Some(q) = q.filter(|q| q.mode.is_affine()) {
                let biases = weight.strip_suffix(".weight").unwrap_or(weight);
                return Err(self.err(
                    weight,
                    format!(
                        "`{biases}.biases` is missing from the checkpoint (config.json declares \
                         {}-bit affine experts, which have biases)",
                        q.bits
                    ),
                ));
            }
            if q != Some(QuantSpec::MXFP4) {
                return Err(self.err(
                    weight,
                    format!(
                        "has scales and no biases, but config.json `quantization` declares it \
                         {q:?}, not MXFP4 (bits 4, group_size 32, mode mxfp4)"
                    ),
                ));
            }
            self.check_shape(
                weight,
                &w.shape,
                &[e, src_rows, cols / mxfp4::CODES_PER_WORD],
                &format!("MXFP4 codes of {e} experts x [{rows}, {cols}]"),
            )?;
        } else if w.dtype == Dtype::U8 {
            self.check_shape(
                weight,
                &w.shape,
                &[e, src_rows, groups, 16],
                &format!("MXFP4 blocks of {e} experts x [{src_rows}, {cols}]"),
            )?;
        } else {
            return Err(self.err(
                weight,
                format!("dtype {:?}, expected U32 or U8 (MXFP4 codes)", w.dtype),
            ));
        }
        if s.dtype != Dtype::U8 {
            return Err(self.err(
                scales,
                format!("dtype {:?}, expected U8 (e8m0 scales)", s.dtype),
            ));
        }
        self.check_shape(
            scales,
            &s.shape,
            &[e, src_rows, groups],
            "[experts, out, in/32] e8m0 scales",
        )?;
        if let Some(b) = target_bits {
            return Err(self.err(
                weight,
                format!(
                    "MXFP4 experts are kept as released; --expert-bits {b} would re-quantize them"
                ),
            ));
        }
        plan.op = ExpertOp::Copy;
        plan.out_spec = QuantSpec::MXFP4;
        plan.out_scale_dtype = Dtype::U8;
        Ok(())
    }
}

/// One expert projection as stored: name, rows, cols, quantization and
/// the dtype of its scales (and, affine only, biases).
pub type ComponentShape<'a> = (&'a str, usize, usize, QuantSpec, Dtype);

/// Byte layout of one expert extent: each piece at a multiple of 64.
pub fn layout_layer(layer: usize, num_experts: usize, comps: &[ComponentShape]) -> ExpertLayer {
    let mut off = 0u64;
    let mut place = |bytes: u64, dtype: Dtype| {
        let o = off.next_multiple_of(COMPONENT_ALIGN as u64);
        off = o + bytes;
        ExpertTensorRef {
            dtype: dtype::name(dtype),
            offset: o,
            bytes,
        }
    };
    let mut components = Vec::new();
    for &(name, rows, cols, q, scale_dtype) in comps {
        let wbytes = (rows * words_per_row(cols, q.bits) * 4) as u64;
        let sbytes = (rows * (cols / q.group_size) * dtype::size_of(scale_dtype)) as u64;
        let weight = place(wbytes, Dtype::U32);
        let scales = place(sbytes, scale_dtype);
        let biases = q.mode.is_affine().then(|| place(sbytes, scale_dtype));
        components.push(ExpertComponent {
            name: name.to_string(),
            rows,
            cols,
            quant: q,
            weight,
            scales,
            biases,
        });
    }
    let expert_bytes = off;
    ExpertLayer {
        layer,
        file: expert_file_name(layer),
        num_experts,
        expert_bytes,
        stride: expert_bytes.next_multiple_of(EXPERT_ALIGN as u64),
        components,
    }
}

/// The cast target of an unquantized source: `torch_dtype`, else
/// `text_config.dtype` (as mlx-lm's `convert`).
fn cast_target(config: &Value) -> Option<FloatTy> {
    let name = config
        .get("torch_dtype")
        .and_then(Value::as_str)
        .or_else(|| {
            config
                .get("text_config")
                .and_then(|t| t.get("dtype"))
                .and_then(Value::as_str)
        })?;
    FloatTy::from_name(name)
}

pub fn plan(src: &Source, san: &Sanitized, expert_bits: Option<u32>) -> Result<Plan> {
    if let Some(b) = expert_bits {
        if !matches!(b, 2 | 4 | 8) {
            return Err(Error::Invalid(format!(
                "expert bits must be 2, 4 or 8, got {b}"
            )));
        }
    }
    let cfg = &src.config;
    let kind = if src.is_quantized() {
        SourceKind::Mlx
    } else {
        SourceKind::Unquantized
    };
    let mut p = Planner {
        src,
        san,
        kind,
        cast: match kind {
            SourceKind::Unquantized => cast_target(&src.config_json),
            SourceKind::Mlx => None,
        },
        outputs: Vec::new(),
        jobs: Vec::new(),
        quantized: BTreeMap::new(),
        used: Vec::new(),
        gate_overrides: BTreeMap::new(),
    };

    for w in schema::dense_weights(cfg) {
        match w.kind {
            WeightKind::Linear { rows, cols } => p.linear(&w.name, rows, cols)?,
            WeightKind::Vector { len } => p.float_tensor(&w.name, &[len], "vector")?,
            WeightKind::Conv { channels, kernel } => {
                p.float_tensor(&w.name, &[channels, kernel, 1], "[channels, kernel, 1]")?
            }
            WeightKind::Table { rows, cols } => {
                p.float_tensor(&w.name, &[rows, cols], "[experts, rows]")?
            }
        }
    }
    // Anything left over is unknown: refuse rather than silently drop it.
    let used: std::collections::BTreeSet<&str> = p.used.iter().map(String::as_str).collect();
    if let Some((canon, d)) = san.dense.iter().find(|(k, _)| !used.contains(k.as_str())) {
        return Err(p.err(
            &d.raw,
            format!(
                "not part of a {} model with this config (canonical name `{canon}`); \
                 refusing to drop an unknown tensor",
                cfg.arch.model_type()
            ),
        ));
    }

    let expert_specs = schema::expert_weights(cfg);
    let moe: std::collections::BTreeSet<usize> = expert_specs.iter().map(|s| s.layer).collect();
    if let Some(((l, ci), es)) = san.experts.iter().find(|((l, _), _)| !moe.contains(l)) {
        return Err(p.err(
            es.first_raw(),
            format!(
                "experts ({}) for layer {l}, which is not an MoE layer in config.json",
                EXPERT_COMPONENTS[*ci]
            ),
        ));
    }
    let mut layers = Vec::new();
    for s in &expert_specs {
        let mut comps = Vec::new();
        for (ci, (_, rows, cols)) in s.projections.iter().enumerate() {
            comps.push(p.expert_component(
                s.layer,
                ci,
                *rows,
                *cols,
                s.num_experts,
                expert_bits,
            )?);
        }
        let shapes: Vec<ComponentShape> = comps
            .iter()
            .map(|c| (c.name, c.rows, c.cols, c.out_spec, c.out_scale_dtype))
            .collect();
        let manifest = layout_layer(s.layer, s.num_experts, &shapes);
        layers.push(LayerPlan {
            layer: s.layer,
            num_experts: s.num_experts,
            components: comps,
            manifest,
        });
    }

    let first = layers.first().map(|l| &l.components[0]);
    let source_expert_bits = first.and_then(|c| c.src_quant.map(|(q, _)| q.bits));
    let requant = layers
        .iter()
        .flat_map(|l| &l.components)
        .find(|c| matches!(c.op, ExpertOp::Seed2 | ExpertOp::Requant))
        .map(|c| {
            let (q, _) = c.src_quant.expect("requant from a quantized source");
            match c.op {
                ExpertOp::Seed2 => format!(
                    "{}-bit -> 2-bit g{} (flash-moe: scale=(max-min)/3, bias=min, \
                     round half away from zero, bf16 scales/biases by truncation)",
                    q.bits, q.group_size
                ),
                _ => format!(
                    "{}-bit -> {}-bit g{} (dequantize f32, mlx affine quantize)",
                    q.bits, c.out_spec.bits, q.group_size
                ),
            }
        });
    let requant = requant.or_else(|| match (kind, expert_bits) {
        (SourceKind::Unquantized, Some(b)) if b != DEFAULT_BITS => Some(format!(
            "quantized to {b}-bit g{DEFAULT_GROUP_SIZE} instead of {DEFAULT_BITS}-bit (mlx affine)"
        )),
        _ => None,
    });

    // Expert entries of config.json's quantization block.
    let mut expert_overrides = BTreeMap::new();
    let default_bits = match kind {
        SourceKind::Unquantized => Some(DEFAULT_BITS),
        SourceKind::Mlx => None,
    };
    for l in &layers {
        for c in &l.components {
            let module = format!("model.layers.{}.mlp.switch_mlp.{}", l.layer, c.name);
            let changed = match (kind, c.op) {
                (SourceKind::Unquantized, _) => Some(c.out_spec.bits) != default_bits,
                (SourceKind::Mlx, ExpertOp::Copy) => false,
                (SourceKind::Mlx, _) => true,
            };
            if changed {
                expert_overrides.insert(mlx_module_path(cfg.arch, &module), c.out_spec);
            }
        }
    }
    // A Hugging Face MXFP4 release: mlx-lm keeps the experts' mode as the
    // default and names every module it quantizes (the routers as their
    // quant_predicate gives them).
    let hf_mxfp4 = kind == SourceKind::Unquantized
        && layers
            .iter()
            .flat_map(|l| &l.components)
            .any(|c| c.out_spec.is_mxfp4());
    let config_quant = match kind {
        SourceKind::Unquantized if hf_mxfp4 => {
            let overrides = std::mem::take(&mut p.gate_overrides);
            let explicit = p
                .quantized
                .iter()
                .map(|(m, s)| (mlx_module_path(cfg.arch, m), *s))
                .filter(|(m, _)| !overrides.contains_key(m))
                .collect();
            Some(ConfigQuant {
                default: Some(QuantSpec::MXFP4),
                overrides,
                explicit,
            })
        }
        SourceKind::Unquantized => {
            let mut overrides = std::mem::take(&mut p.gate_overrides);
            overrides.extend(expert_overrides);
            Some(ConfigQuant {
                default: Some(spec(DEFAULT_BITS, DEFAULT_GROUP_SIZE)),
                overrides,
                explicit: BTreeMap::new(),
            })
        }
        SourceKind::Mlx if !expert_overrides.is_empty() => Some(ConfigQuant {
            default: None,
            overrides: expert_overrides,
            explicit: BTreeMap::new(),
        }),
        SourceKind::Mlx => None,
    };

    Ok(Plan {
        kind,
        outputs: p.outputs,
        jobs: p.jobs,
        quantized: p.quantized,
        layers,
        source_expert_bits,
        expert_requantization: requant,
        config_quant,
    })
}

/// Python truthiness, as mlx-lm's `if eos := generation_config.get(...)`.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// config.json for the model directory, as mlx-lm's `load_config` +
/// `save_config` would write it: the source's, `eos_token_id` taken from
/// `generation_config.json` when that has one, `vision_config` and
/// `_name_or_path` dropped, plus the quantization entries (as both
/// `quantization` and `quantization_config`).
pub fn output_config(src_config: &Value, generation: Option<&Value>, cq: &ConfigQuant) -> Value {
    let mut v = src_config.clone();
    let Some(top) = v.as_object_mut() else {
        return v;
    };
    if let Some(eos) = generation
        .and_then(|g| g.get("eos_token_id"))
        .filter(|e| truthy(e))
    {
        top.insert("eos_token_id".into(), eos.clone());
    }
    top.remove("vision_config");
    top.remove("_name_or_path");
    let mut q: Map<String, Value> = match top.get("quantization") {
        Some(Value::Object(m)) => m.clone(),
        _ => Map::new(),
    };
    let entry = |s: &QuantSpec, with_mode: bool| {
        let mut e = json!({"group_size": s.group_size, "bits": s.bits});
        if with_mode || !s.mode.is_affine() {
            e["mode"] = json!(s.mode);
        }
        e
    };
    if let Some(Value::Object(d)) = cq.default.map(|d| entry(&d, true)) {
        q.extend(d);
    }
    for (k, s) in &cq.overrides {
        q.insert(k.clone(), entry(s, false));
    }
    for (k, s) in &cq.explicit {
        q.insert(k.clone(), entry(s, true));
    }
    top.insert("quantization".into(), Value::Object(q.clone()));
    top.insert("quantization_config".into(), Value::Object(q));
    v
}
