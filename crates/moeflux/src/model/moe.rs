//! The MLP half of a layer: a dense SwiGLU MLP, or a sparse MoE block — a
//! router (softmax top-K, or DeepSeek/GLM `noaux_tc` with its correction
//! bias), routed SwiGLU experts streamed from the expert store (their layout
//! inside an expert's extent), and an optional shared expert (Qwen's scaled
//! by `sigmoid(shared_expert_gate x)`; DeepSeek's and GLM's added as is).

use crate::config::{ModelConfig, QuantMode, QuantSpec, RouterKind};
use crate::error::{Error, Result};
use crate::format::ExpertLayer;
use crate::model::weights::{LinearRef, VectorRef, WeightsLoader};
use crate::quant::interleave;
use crate::quant::mxfp4::GROUP;
use crate::quant::{
    affine, Affine4x8Matrix, Mxfp4Matrix, Mxfp4x8Matrix, QMatrix, ScaleData, Weight,
};

/// A shared expert: a SwiGLU MLP, scaled by `sigmoid(gate x)` when it has
/// a gate.
pub struct SharedExpert {
    pub mlp: DenseMlp,
    /// Qwen's `shared_expert_gate` (one row).
    pub gate: Option<LinearRef>,
}

pub struct MoeBlock {
    pub layer: usize,
    pub router: LinearRef,
    /// Added to the router's logits (gpt-oss).
    pub router_bias: Option<VectorRef>,
    /// `noaux_tc`'s `e_score_correction_bias`.
    pub score_bias: Option<VectorRef>,
    /// Per-expert biases of gate, up and down, `[experts, rows]` each
    /// (gpt-oss).
    pub expert_bias: Option<[VectorRef; 3]>,
    pub shared: Option<SharedExpert>,
    pub experts: ExpertLayout,
    /// The layout of the experts' low-width copies (`convert
    /// --low-width-copies`), when the model has them: what the GPU's
    /// `--low-width-misses` uploads on a miss.
    pub low_width: Option<ExpertLayout>,
}

impl MoeBlock {
    pub fn load(
        w: &mut WeightsLoader,
        c: &ModelConfig,
        prefix: &str,
        layer: usize,
        experts: ExpertLayout,
    ) -> Result<Self> {
        let (h, m) = (c.hidden_size, &c.moe);
        let p = format!("{prefix}mlp.");
        let score_bias = match m.router {
            RouterKind::NoauxTc { .. } => Some(w.vector(
                &format!("{p}gate.e_score_correction_bias"),
                &[m.num_experts],
            )?),
            RouterKind::Softmax | RouterKind::TopKSoftmax => None,
        };
        let router = crate::model::schema::router_module(c);
        let router_bias = if m.router_bias {
            Some(w.vector(&format!("{p}{router}.bias"), &[m.num_experts])?)
        } else {
            None
        };
        let expert_bias = if m.expert_bias {
            let i = m.moe_intermediate;
            let table = |w: &mut WeightsLoader, proj: &str, rows: usize| {
                w.vector(
                    &format!("{p}switch_mlp.{proj}.bias"),
                    &[m.num_experts, rows],
                )
            };
            Some([
                table(w, "gate_proj", i)?,
                table(w, "up_proj", i)?,
                table(w, "down_proj", h)?,
            ])
        } else {
            None
        };
        let shared = if m.shared_intermediate == 0 {
            None
        } else if m.shared_gate {
            Some(SharedExpert {
                mlp: DenseMlp::load_at(w, &format!("{p}shared_expert."), m.shared_intermediate, h)?,
                gate: Some(w.linear(&format!("{p}shared_expert_gate"), 1, h)?),
            })
        } else {
            Some(SharedExpert {
                mlp: DenseMlp::load_at(
                    w,
                    &format!("{p}shared_experts."),
                    m.shared_intermediate,
                    h,
                )?,
                gate: None,
            })
        };
        Ok(MoeBlock {
            layer,
            router: w.linear(&format!("{p}{router}"), m.num_experts, h)?,
            router_bias,
            score_bias,
            expert_bias,
            shared,
            experts,
            low_width: None,
        })
    }
}

/// A dense SwiGLU MLP (dense layers, and the shared experts).
pub struct DenseMlp {
    pub gate: LinearRef,
    pub up: LinearRef,
    pub down: LinearRef,
}

impl DenseMlp {
    pub fn load(w: &mut WeightsLoader, c: &ModelConfig, prefix: &str) -> Result<Self> {
        Self::load_at(
            w,
            &format!("{prefix}mlp."),
            c.intermediate_size,
            c.hidden_size,
        )
    }

    /// `{module}gate_proj`, `up_proj`, `down_proj` of width `i`.
    pub fn load_at(w: &mut WeightsLoader, module: &str, i: usize, h: usize) -> Result<Self> {
        Ok(DenseMlp {
            gate: w.linear(&format!("{module}gate_proj"), i, h)?,
            up: w.linear(&format!("{module}up_proj"), i, h)?,
            down: w.linear(&format!("{module}down_proj"), h, i)?,
        })
    }
}

/// Where one projection of an expert lives inside its extent.
#[derive(Debug, Clone, Copy)]
pub struct ComponentLayout {
    pub rows: usize,
    pub cols: usize,
    pub spec: QuantSpec,
    pub weight: usize,
    pub scales: usize,
    /// Affine only (MXFP4 has no biases).
    pub biases: Option<usize>,
    pub scales_f32: bool,
}

/// gate, up and down projections of every expert of a layer.
#[derive(Debug, Clone)]
pub struct ExpertLayout {
    pub num_experts: usize,
    pub extent: usize,
    pub gate: ComponentLayout,
    pub up: ComponentLayout,
    pub down: ComponentLayout,
}

impl ExpertLayout {
    /// Checks the manifest's description of a layer against the config.
    pub fn from_manifest(
        l: &ExpertLayer,
        c: &ModelConfig,
        manifest_path: &std::path::Path,
    ) -> Result<Self> {
        let err = |reason: String| {
            Error::format(
                manifest_path,
                format!("experts of layer {}: {reason}", l.layer),
            )
        };
        if l.num_experts != c.moe.num_experts {
            return Err(err(format!(
                "{} experts, config says {}",
                l.num_experts, c.moe.num_experts
            )));
        }
        if !l.stride.is_multiple_of(crate::format::EXPERT_ALIGN as u64) || l.expert_bytes > l.stride
        {
            return Err(err(format!(
                "stride {} is not a multiple of 4096 holding {} bytes",
                l.stride, l.expert_bytes
            )));
        }
        let (h, i) = (c.hidden_size, c.moe.moe_intermediate);
        // Byte ranges of every component part, to refuse overlaps.
        let mut ranges: Vec<(u64, u64, String)> = Vec::new();
        let mut comp = |name: &str, rows: usize, cols: usize| -> Result<ComponentLayout> {
            let cp = l
                .component(name)
                .ok_or_else(|| err(format!("component {name} missing")))?;
            if cp.rows != rows || cp.cols != cols {
                return Err(err(format!(
                    "{name} is [{}, {}], expected [{rows}, {cols}]",
                    cp.rows, cp.cols
                )));
            }
            cp.quant
                .validate()
                .map_err(|r| err(format!("{name}: {r}")))?;
            cp.quant
                .check_cols(cols)
                .map_err(|r| err(format!("{name}: {r}")))?;
            let wbytes = rows * affine::words_per_row(cols, cp.quant.bits) * 4;
            let groups = rows * cols / cp.quant.group_size;
            // Scales: bf16/f32 with as many biases (affine), or e8m0 bytes (MXFP4).
            let (scale_size, scales_f32) = match (cp.quant.mode, cp.scales.dtype.as_str()) {
                (QuantMode::Affine, "F32") => (4, true),
                (QuantMode::Affine, "BF16") => (2, false),
                (QuantMode::Mxfp4, "U8") => (1, false),
                (mode, other) => {
                    return Err(err(format!(
                        "{name}: scale dtype {other} not supported for mode {mode:?}"
                    )))
                }
            };
            let mut parts = vec![
                (&cp.weight, wbytes, 4usize, "weight"),
                (&cp.scales, groups * scale_size, scale_size, "scales"),
            ];
            match (&cp.biases, cp.quant.mode) {
                (Some(b), QuantMode::Affine) => {
                    if b.dtype != cp.scales.dtype {
                        return Err(err(format!("{name}: scales and biases differ in dtype")));
                    }
                    parts.push((b, groups * scale_size, scale_size, "biases"));
                }
                (None, QuantMode::Affine) => {
                    return Err(err(format!("{name}: affine component without biases")))
                }
                (Some(_), QuantMode::Mxfp4) => {
                    return Err(err(format!("{name}: an mxfp4 component has no biases")))
                }
                (None, QuantMode::Mxfp4) => {}
            }
            for (r, bytes, align, what) in parts {
                if r.bytes != bytes as u64
                    || r.offset
                        .checked_add(r.bytes)
                        .is_none_or(|e| e > l.expert_bytes)
                    || !r.offset.is_multiple_of(align as u64)
                {
                    return Err(err(format!(
                        "{name}.{what}: bad byte range {}+{} (expected {bytes} bytes, \
                         {align}-aligned, inside expert_bytes {})",
                        r.offset, r.bytes, l.expert_bytes
                    )));
                }
                ranges.push((r.offset, r.offset + r.bytes, format!("{name}.{what}")));
            }
            if cp.weight.dtype != "U32" {
                return Err(err(format!(
                    "{name}.weight dtype {}, expected U32",
                    cp.weight.dtype
                )));
            }
            Ok(ComponentLayout {
                rows,
                cols,
                spec: cp.quant,
                weight: cp.weight.offset as usize,
                scales: cp.scales.offset as usize,
                biases: cp.biases.as_ref().map(|b| b.offset as usize),
                scales_f32,
            })
        };
        let (gate, up, down) = (
            comp("gate_proj", i, h)?,
            comp("up_proj", i, h)?,
            comp("down_proj", h, i)?,
        );
        ranges.sort();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(err(format!(
                    "{} ({}..{}) overlaps {} ({}..{})",
                    w[1].2, w[1].0, w[1].1, w[0].2, w[0].0, w[0].1
                )));
            }
        }
        Ok(ExpertLayout {
            num_experts: l.num_experts,
            extent: l.stride as usize,
            gate,
            up,
            down,
        })
    }
}

impl ExpertLayout {
    /// Why this layer's experts cannot be interleaved, from the layout
    /// alone (None: they can, unless an MXFP4 scale byte refuses).
    pub fn interleave_refusal(&self) -> Option<String> {
        [("gate", &self.gate), ("up", &self.up), ("down", &self.down)]
            .into_iter()
            .find_map(|(name, c)| {
                c.interleave_refusal()
                    .map(|why| format!("the {name} projection: {why}"))
            })
    }

    /// Writes one expert's bytes `src` into `dst` (as long) with its
    /// 4-bit projections interleaved by eight rows ([`interleave`]):
    /// MXFP4 codes and scale bytes in place, MLX affine codes in place and
    /// their bf16 scales and biases together where the two stood (they
    /// must be adjacent); everything else copied. The error says why the
    /// expert does not interleave.
    pub fn interleave_extent(&self, src: &[u8], dst: &mut [u8]) -> std::result::Result<(), String> {
        if let Some(why) = self.interleave_refusal() {
            return Err(why);
        }
        dst.copy_from_slice(src);
        for (name, c) in [("gate", &self.gate), ("up", &self.up), ("down", &self.down)] {
            match c.view(src) {
                Weight::Mxfp4(m) => {
                    if let Some(why) = interleave::interleavable(&m) {
                        return Err(format!("the {name} projection: {why}"));
                    }
                    let (mut codes, mut scales) =
                        (vec![0u8; m.codes.len() * 4], vec![0u8; m.scales.len()]);
                    interleave::interleave(&m, &mut codes, &mut scales);
                    dst[c.weight..c.weight + codes.len()].copy_from_slice(&codes);
                    dst[c.scales..c.scales + scales.len()].copy_from_slice(&scales);
                }
                Weight::Quantized(q) => {
                    let m = interleave::interleave_affine(&q)
                        .map_err(|why| format!("the {name} projection: {why}"))?;
                    let params: &[u8] = bytemuck::cast_slice(&m.params);
                    dst[c.weight..c.weight + m.codes.len()].copy_from_slice(&m.codes);
                    dst[c.scales..c.scales + params.len()].copy_from_slice(params);
                }
                _ => return Err(format!("the {name} projection is neither MXFP4 nor affine")),
            }
        }
        Ok(())
    }
}

impl ComponentLayout {
    /// Why this projection cannot be interleaved, from the layout alone:
    /// MXFP4, or MLX affine 4-bit codes in groups of a multiple of 64 with
    /// bf16 biases right after the scales (their interleaved form takes
    /// both regions), eight-row and 64-column multiples.
    fn interleave_refusal(&self) -> Option<String> {
        if !self.rows.is_multiple_of(interleave::ROWS)
            || !self.cols.is_multiple_of(interleave::UNIT_COLS)
        {
            return Some(format!(
                "{} x {} is not a multiple of {} x {}",
                self.rows,
                self.cols,
                interleave::ROWS,
                interleave::UNIT_COLS
            ));
        }
        // MXFP4 (no biases) interleaves whenever the shape does.
        let biases = self.biases?;
        let groups = self.rows * self.cols / self.spec.group_size;
        if self.spec.bits != 4 || !self.spec.group_size.is_multiple_of(interleave::UNIT_COLS) {
            Some(format!(
                "{}-bit codes in groups of {}",
                self.spec.bits, self.spec.group_size
            ))
        } else if self.scales_f32 {
            Some("f32 scales".into())
        } else if biases != self.scales + 2 * groups {
            Some("biases not right after the scales".into())
        } else {
            None
        }
    }

    /// The projection in bytes made by [`ExpertLayout::interleave_extent`].
    pub fn view_interleaved<'a>(&self, bytes: &'a [u8]) -> Weight<'a> {
        let codes = &bytes[self.weight..self.weight + self.rows * self.cols / 2];
        if self.biases.is_some() {
            let groups = self.rows * self.cols / self.spec.group_size;
            return Weight::Affine4x8(Affine4x8Matrix {
                rows: self.rows,
                cols: self.cols,
                group_size: self.spec.group_size,
                codes,
                params: cast(&bytes[self.scales..self.scales + 4 * groups]),
            });
        }
        let groups = self.rows * self.cols / GROUP;
        Weight::Mxfp4x8(Mxfp4x8Matrix {
            rows: self.rows,
            cols: self.cols,
            codes,
            scales: &bytes[self.scales..self.scales + groups],
        })
    }

    /// The projection inside one expert's bytes (a buffer or the mapping,
    /// both 4096-aligned; offsets were validated against the extent).
    pub fn view<'a>(&self, bytes: &'a [u8]) -> Weight<'a> {
        let words = self.rows * affine::words_per_row(self.cols, self.spec.bits);
        let groups = self.rows * self.cols / self.spec.group_size;
        let packed = cast(&bytes[self.weight..self.weight + 4 * words]);
        let Some(biases) = self.biases else {
            return Weight::Mxfp4(Mxfp4Matrix {
                rows: self.rows,
                cols: self.cols,
                codes: packed,
                scales: &bytes[self.scales..self.scales + groups],
            });
        };
        let scales = |off: usize| {
            if self.scales_f32 {
                ScaleData::F32(cast(&bytes[off..off + 4 * groups]))
            } else {
                ScaleData::Bf16(cast(&bytes[off..off + 2 * groups]))
            }
        };
        Weight::Quantized(QMatrix {
            rows: self.rows,
            cols: self.cols,
            spec: self.spec,
            packed,
            scales: scales(self.scales),
            biases: scales(biases),
        })
    }
}

fn cast<T: bytemuck::Pod>(b: &[u8]) -> &[T] {
    bytemuck::try_cast_slice(b).expect("expert layout validated for alignment")
}

#[cfg(test)]
mod tests {
    use super::ComponentLayout;
    use crate::config::QuantSpec;

    /// A 64 x 128 affine projection whose biases start `gap` bytes after
    /// its scales end.
    fn affine(bits: u32, group_size: usize, gap: usize, scales_f32: bool) -> ComponentLayout {
        let groups = 64 * 128 / group_size;
        let scale_bytes = if scales_f32 { 4 } else { 2 } * groups;
        ComponentLayout {
            rows: 64,
            cols: 128,
            spec: QuantSpec::affine(bits, group_size),
            weight: 0,
            scales: 4096,
            biases: Some(4096 + scale_bytes + gap),
            scales_f32,
        }
    }

    #[test]
    fn affine_projections_interleave_with_4_bit_codes_and_adjacent_bf16_parameters() {
        assert_eq!(affine(4, 64, 0, false).interleave_refusal(), None);
        assert_eq!(affine(4, 128, 0, false).interleave_refusal(), None);
        for (c, why) in [
            (affine(4, 64, 2, false), "biases not right after the scales"),
            (affine(4, 64, 0, true), "f32 scales"),
            (affine(8, 64, 0, false), "8-bit codes in groups of 64"),
            (affine(4, 32, 0, false), "4-bit codes in groups of 32"),
        ] {
            assert_eq!(c.interleave_refusal().as_deref(), Some(why));
        }
        let odd = ComponentLayout {
            rows: 60,
            ..affine(4, 64, 0, false)
        };
        assert!(odd.interleave_refusal().unwrap().contains("60 x 128"));
    }
}
