//! Element types: decoding source bytes to f32, rounding to the float types
//! mlx casts between, and encoding to the dtypes a model directory stores.

use safetensors::Dtype;

/// A float type of a checkpoint (what mlx computes and casts in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatTy {
    Bf16,
    F16,
    F32,
}

impl FloatTy {
    pub fn from_dtype(d: Dtype) -> Option<Self> {
        match d {
            Dtype::BF16 => Some(FloatTy::Bf16),
            Dtype::F16 => Some(FloatTy::F16),
            Dtype::F32 => Some(FloatTy::F32),
            _ => None,
        }
    }

    /// `torch_dtype` spellings mlx-lm casts to (`MODEL_CONVERSION_DTYPES`).
    pub fn from_name(s: &str) -> Option<Self> {
        match s {
            "bfloat16" => Some(FloatTy::Bf16),
            "float16" => Some(FloatTy::F16),
            "float32" => Some(FloatTy::F32),
            _ => None,
        }
    }

    /// Rounds `x` to this type (ties to even), returned widened to f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            FloatTy::Bf16 => half::bf16::from_f32(x).to_f32(),
            FloatTy::F16 => half::f16::from_f32(x).to_f32(),
            FloatTy::F32 => x,
        }
    }

    /// Whether rounding values of type `from` to `self` can change them.
    pub fn narrows(self, from: FloatTy) -> bool {
        self != from && self != FloatTy::F32
    }

    /// The dtype moeflux stores values of this type in: the engine reads
    /// BF16 and F32 only, so F16 is widened (losslessly) to F32.
    pub fn stored(self) -> Dtype {
        match self {
            FloatTy::Bf16 => Dtype::BF16,
            FloatTy::F16 | FloatTy::F32 => Dtype::F32,
        }
    }
}

/// Bytes per element of the dtypes convert handles.
pub fn size_of(d: Dtype) -> usize {
    d.bitsize() / 8
}

/// safetensors name of a dtype (`U32`, `BF16`, ...).
pub fn name(d: Dtype) -> String {
    format!("{d:?}")
}

/// Decodes little-endian BF16/F16/F32 bytes to f32 (exact), appending to `out`.
pub fn decode_into(bytes: &[u8], ty: FloatTy, out: &mut Vec<f32>) {
    match ty {
        FloatTy::Bf16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)),
        ),
        FloatTy::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        FloatTy::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
    }
}

pub fn decode(bytes: &[u8], ty: FloatTy) -> Vec<f32> {
    let mut v = Vec::with_capacity(bytes.len() / 2);
    decode_into(bytes, ty, &mut v);
    v
}

/// Decodes little-endian u32 words.
pub fn decode_u32(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Encodes f32 values as `dtype` (BF16 rounds to nearest even; F32 as is).
pub fn encode_into(vals: &[f32], dtype: Dtype, out: &mut [u8]) {
    match dtype {
        Dtype::BF16 => {
            for (o, &v) in out.chunks_exact_mut(2).zip(vals) {
                o.copy_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
            }
        }
        Dtype::F32 => {
            for (o, &v) in out.chunks_exact_mut(4).zip(vals) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        other => unreachable!("encode to {other:?}"),
    }
}

/// Encodes raw bf16 bit patterns.
pub fn encode_bf16_bits(bits: &[u16], out: &mut [u8]) {
    for (o, &b) in out.chunks_exact_mut(2).zip(bits) {
        o.copy_from_slice(&b.to_le_bytes());
    }
}

pub fn encode_u32(words: &[u32], out: &mut [u8]) {
    for (o, &w) in out.chunks_exact_mut(4).zip(words) {
        o.copy_from_slice(&w.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips() {
        let vals = [1.0f32, -2.5, 0.15625, 3.0e-3];
        for ty in [FloatTy::Bf16, FloatTy::F16, FloatTy::F32] {
            let r: Vec<f32> = vals.iter().map(|&v| ty.round(v)).collect();
            let mut bytes = vec![0u8; r.len() * 4];
            let st = ty.stored();
            encode_into(&r, st, &mut bytes[..r.len() * size_of(st)]);
            let back = decode(
                &bytes[..r.len() * size_of(st)],
                FloatTy::from_dtype(st).unwrap(),
            );
            assert_eq!(back, r, "{ty:?}");
        }
        assert_eq!(FloatTy::Bf16.round(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(name(Dtype::BF16), "BF16");
    }
}
