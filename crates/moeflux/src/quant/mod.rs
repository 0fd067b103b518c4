//! Quantized weight representation (MLX affine, group-wise; MXFP4 as
//! released) and the quantizer used by `convert`.

pub mod affine;
pub mod interleave;
pub mod mxfp4;

pub use interleave::{Affine4x8Matrix, Mxfp4x8Matrix};
pub use mxfp4::Mxfp4Matrix;

pub use crate::config::{QuantMode, QuantSpec};

/// Per-group scales or biases as stored in the checkpoint.
#[derive(Debug, Clone, Copy)]
pub enum ScaleData<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

impl ScaleData<'_> {
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            ScaleData::Bf16(s) => affine::bf16_to_f32(s[i]),
            ScaleData::F32(s) => s[i],
        }
    }
    pub fn len(&self) -> usize {
        match self {
            ScaleData::Bf16(s) => s.len(),
            ScaleData::F32(s) => s.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A row-major quantized matrix `[rows, cols]`: `packed` holds
/// `rows * cols * bits / 32` words, scales and biases `rows * cols / group_size`.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub spec: QuantSpec,
    pub packed: &'a [u32],
    pub scales: ScaleData<'a>,
    pub biases: ScaleData<'a>,
}

impl<'a> QMatrix<'a> {
    pub fn words_per_row(&self) -> usize {
        affine::words_per_row(self.cols, self.spec.bits)
    }
    pub fn groups_per_row(&self) -> usize {
        self.cols / self.spec.group_size
    }
    /// Row `r` dequantized into `out` (`cols` floats): `q * scale + bias`
    /// per element, as `mx.dequantize`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (wpr, groups) = (self.words_per_row(), self.groups_per_row());
        let s: Vec<f32> = (0..groups)
            .map(|g| self.scales.get(r * groups + g))
            .collect();
        let b: Vec<f32> = (0..groups)
            .map(|g| self.biases.get(r * groups + g))
            .collect();
        affine::dequantize_row(&self.packed[r * wpr..(r + 1) * wpr], &s, &b, self.spec, out);
    }
    /// Checks that the slices have the sizes the shape implies.
    pub fn check(&self) -> Result<(), String> {
        self.spec.validate()?;
        self.spec.check_cols(self.cols)?;
        let words = self.rows * self.words_per_row();
        if self.packed.len() != words {
            return Err(format!(
                "packed weight has {} words, expected {words}",
                self.packed.len()
            ));
        }
        let groups = self.rows * self.groups_per_row();
        if self.scales.len() != groups || self.biases.len() != groups {
            return Err(format!(
                "scales/biases have {}/{} entries, expected {groups}",
                self.scales.len(),
                self.biases.len()
            ));
        }
        Ok(())
    }
}

/// Unquantized weight data.
#[derive(Debug, Clone, Copy)]
pub enum DenseData<'a> {
    Bf16(&'a [u16]),
    F32(&'a [f32]),
}

/// A row-major unquantized matrix `[rows, cols]`.
#[derive(Debug, Clone, Copy)]
pub struct DenseMatrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub data: DenseData<'a>,
}

/// A linear layer's weight, quantized or not (mlx-lm leaves layers whose
/// input width is not a multiple of the group size unquantized).
#[derive(Debug, Clone, Copy)]
pub enum Weight<'a> {
    Quantized(QMatrix<'a>),
    /// MXFP4 codes and e8m0 scales, kept as released (gpt-oss experts).
    Mxfp4(Mxfp4Matrix<'a>),
    /// MXFP4 with eight rows interleaved (made at load for the CPU's
    /// products; see [`interleave`]).
    Mxfp4x8(Mxfp4x8Matrix<'a>),
    /// MLX affine 4-bit with eight rows interleaved (made at load for the
    /// CPU's products).
    Affine4x8(Affine4x8Matrix<'a>),
    Dense(DenseMatrix<'a>),
}

impl Weight<'_> {
    pub fn rows(&self) -> usize {
        match self {
            Weight::Quantized(q) => q.rows,
            Weight::Mxfp4(m) => m.rows,
            Weight::Mxfp4x8(m) => m.rows,
            Weight::Affine4x8(m) => m.rows,
            Weight::Dense(d) => d.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            Weight::Quantized(q) => q.cols,
            Weight::Mxfp4(m) => m.cols,
            Weight::Mxfp4x8(m) => m.cols,
            Weight::Affine4x8(m) => m.cols,
            Weight::Dense(d) => d.cols,
        }
    }
}

/// Rows `r0..r1` of an interleaved matrix as its row groups.
fn interleaved_groups(r0: usize, r1: usize) -> (usize, usize) {
    let rows = interleave::ROWS;
    assert!(
        r0.is_multiple_of(rows) && r1.is_multiple_of(rows),
        "row block {r0}..{r1} of an interleaved matrix"
    );
    (r0 / rows, r1 / rows)
}

impl<'a> ScaleData<'a> {
    fn range(&self, a: usize, b: usize) -> ScaleData<'a> {
        match *self {
            ScaleData::Bf16(s) => ScaleData::Bf16(&s[a..b]),
            ScaleData::F32(s) => ScaleData::F32(&s[a..b]),
        }
    }
}

impl<'a> Weight<'a> {
    /// Rows `r0..r1` as a matrix of their own (a per-head block of MLA's
    /// `embed_q` / `unembed_out`, stored as `[heads * rows, cols]`).
    pub fn row_block(&self, r0: usize, r1: usize) -> Weight<'a> {
        assert!(r0 <= r1 && r1 <= self.rows(), "row block {r0}..{r1}");
        match *self {
            Weight::Quantized(q) => {
                let (wpr, gpr) = (q.words_per_row(), q.groups_per_row());
                Weight::Quantized(QMatrix {
                    rows: r1 - r0,
                    cols: q.cols,
                    spec: q.spec,
                    packed: &q.packed[r0 * wpr..r1 * wpr],
                    scales: q.scales.range(r0 * gpr, r1 * gpr),
                    biases: q.biases.range(r0 * gpr, r1 * gpr),
                })
            }
            Weight::Mxfp4(m) => Weight::Mxfp4(m.row_block(r0, r1)),
            Weight::Mxfp4x8(m) => {
                let (g0, g1) = interleaved_groups(r0, r1);
                Weight::Mxfp4x8(m.groups(g0, g1))
            }
            Weight::Affine4x8(m) => {
                let (g0, g1) = interleaved_groups(r0, r1);
                Weight::Affine4x8(m.groups(g0, g1))
            }
            Weight::Dense(d) => {
                let (a, b) = (r0 * d.cols, r1 * d.cols);
                Weight::Dense(DenseMatrix {
                    rows: r1 - r0,
                    cols: d.cols,
                    data: match d.data {
                        DenseData::Bf16(x) => DenseData::Bf16(&x[a..b]),
                        DenseData::F32(x) => DenseData::F32(&x[a..b]),
                    },
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quant_spec_mode_parses_defaults_to_affine_and_refuses_unknown() {
        let old: QuantSpec = serde_json::from_str(r#"{"bits": 4, "group_size": 64}"#).unwrap();
        assert_eq!(old, QuantSpec::affine(4, 64));
        let a: QuantSpec =
            serde_json::from_str(r#"{"bits": 8, "group_size": 64, "mode": "affine"}"#).unwrap();
        assert_eq!(a, QuantSpec::affine(8, 64));
        let m: QuantSpec =
            serde_json::from_str(r#"{"bits": 4, "group_size": 32, "mode": "mxfp4"}"#).unwrap();
        assert_eq!(m, QuantSpec::MXFP4);
        assert!(m.validate().is_ok());
        let bad = QuantSpec {
            mode: QuantMode::Mxfp4,
            ..QuantSpec::affine(4, 64)
        };
        assert!(bad.validate().unwrap_err().contains("mxfp4"));
        let err =
            serde_json::from_str::<QuantSpec>(r#"{"bits": 4, "group_size": 32, "mode": "nvfp4"}"#)
                .unwrap_err();
        assert!(err.to_string().contains("unknown variant `nvfp4`"), "{err}");
        // Affine entries are written as before; MXFP4 ones name their mode.
        assert_eq!(
            serde_json::to_string(&QuantSpec::affine(4, 64)).unwrap(),
            r#"{"bits":4,"group_size":64}"#
        );
        assert_eq!(
            serde_json::to_string(&QuantSpec::MXFP4).unwrap(),
            r#"{"bits":4,"group_size":32,"mode":"mxfp4"}"#
        );
    }

    #[test]
    fn group_16_needs_rows_of_whole_32_code_blocks() {
        for bits in [2, 3, 6] {
            assert!(QuantSpec::affine(bits, 16).validate().is_ok());
        }
        assert!(QuantSpec::affine(4, 8).validate().is_err());
        let g16 = QuantSpec::affine(6, 16);
        assert!(g16.check_cols(256).is_ok());
        let e = g16.check_cols(48).unwrap_err();
        assert!(e.contains("group size 16 and 32"), "{e}");
        assert!(QuantSpec::affine(4, 64).check_cols(96).is_err());
    }
}
