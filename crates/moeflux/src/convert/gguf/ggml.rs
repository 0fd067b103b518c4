//! ggml tensor types: block geometry, dequantization exactly as gguf-py's
//! `quants.py` computes it (f32 products of f16 scales and small integers),
//! and the mapping of each type onto moeflux's stored forms.
//!
//! Exact mappings (every dequantized value equal to gguf-py's bit for bit):
//! a block whose values are `code * s + b` per 32 (or 16) inputs with `s`,
//! `b` exact in f32 and `code * s` exact (few bits) is MLX affine group-32
//! (group-16) with F32 scales and biases, since `code * s + b` rounds once
//! in both. The K-quants whose scales cover 16 inputs take group 16:
//! Q6_K's `(d * sc) * q` (`d` 11 significant bits, `|sc| <= 128` 7, `|q| <=
//! 32` 5: at most 23, exact in f32) is `(q + 32) * (d * sc) - 32 * (d * sc)`,
//! every term exact (the product at most 24 bits), so the sum rounds to the
//! exact value; Q3_K's `(d * sc) * q` (`|sc| <= 32`, `|q| <= 4`) likewise
//! with code `q + 4`; Q2_K's `(d * sc) * q - dmin * m` is code `q`, scale
//! `d * sc`, bias `-(dmin * m)`, one rounding after exact products as in
//! gguf-py. Types whose products can round differently (IQ4_XS) or that
//! have codebooks (the other IQ types) are dequantized and re-quantized
//! (MLX's algorithm, see [`Mapping::Requant`]).

use half::f16;

/// Values per super-block of the K-quants.
const QK_K: usize = 256;

/// How a ggml type becomes moeflux tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapping {
    /// Stored as this float dtype, unchanged.
    Float,
    /// Affine codes of `bits` in groups of `group` (32 or 16) with F32
    /// scales and biases, exact.
    Affine { bits: u32, group: usize },
    /// MXFP4 codes and e8m0 scales, exact.
    Mxfp4,
    /// Dequantized to f32, then MLX affine group-32 quantized at `bits` (lossy).
    Requant { bits: u32 },
}

/// A ggml tensor type this reader knows the geometry of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GgmlType {
    pub id: u32,
    pub name: &'static str,
    /// Values per block and bytes per block.
    pub block: usize,
    pub bytes: usize,
    /// `None`: known but not convertible (TQ1_0, Q8_1, Q8_K, integers).
    pub mapping: Option<Mapping>,
}

const fn t(
    id: u32,
    name: &'static str,
    block: usize,
    bytes: usize,
    m: Option<Mapping>,
) -> GgmlType {
    GgmlType {
        id,
        name,
        block,
        bytes,
        mapping: m,
    }
}

const fn aff(bits: u32) -> Option<Mapping> {
    Some(Mapping::Affine { bits, group: 32 })
}

const fn aff16(bits: u32) -> Option<Mapping> {
    Some(Mapping::Affine { bits, group: 16 })
}

const fn req(bits: u32) -> Option<Mapping> {
    Some(Mapping::Requant { bits })
}

/// ggml's type table (ggml.h `enum ggml_type`, `type_traits`).
pub const TYPES: [GgmlType; 31] = [
    t(0, "F32", 1, 4, Some(Mapping::Float)),
    t(1, "F16", 1, 2, Some(Mapping::Float)),
    t(2, "Q4_0", 32, 18, aff(4)),
    t(3, "Q4_1", 32, 20, aff(4)),
    t(6, "Q5_0", 32, 22, aff(8)),
    t(7, "Q5_1", 32, 24, aff(8)),
    t(8, "Q8_0", 32, 34, aff(8)),
    t(9, "Q8_1", 32, 36, None),
    t(10, "Q2_K", QK_K, 84, aff16(2)),
    t(11, "Q3_K", QK_K, 110, aff16(3)),
    t(12, "Q4_K", QK_K, 144, aff(4)),
    t(13, "Q5_K", QK_K, 176, aff(8)),
    t(14, "Q6_K", QK_K, 210, aff16(6)),
    t(15, "Q8_K", QK_K, 292, None),
    t(16, "IQ2_XXS", QK_K, 66, req(4)),
    t(17, "IQ2_XS", QK_K, 74, req(4)),
    t(18, "IQ3_XXS", QK_K, 98, req(4)),
    t(19, "IQ1_S", QK_K, 50, req(4)),
    t(20, "IQ4_NL", 32, 18, aff(8)),
    t(21, "IQ3_S", QK_K, 110, req(4)),
    t(22, "IQ2_S", QK_K, 82, req(4)),
    t(23, "IQ4_XS", QK_K, 136, req(8)),
    t(24, "I8", 1, 1, None),
    t(25, "I16", 1, 2, None),
    t(26, "I32", 1, 4, None),
    t(27, "I64", 1, 8, None),
    t(28, "F64", 1, 8, None),
    t(29, "IQ1_M", QK_K, 56, req(4)),
    t(30, "BF16", 1, 2, Some(Mapping::Float)),
    t(34, "TQ1_0", QK_K, 54, None),
    t(39, "MXFP4", 32, 17, Some(Mapping::Mxfp4)),
];

impl GgmlType {
    pub fn from_id(id: u32) -> Option<GgmlType> {
        TYPES.iter().copied().find(|t| t.id == id)
    }

    /// Whether the mapping is exact (float, affine, MXFP4).
    pub fn exact(&self) -> bool {
        !matches!(self.mapping, Some(Mapping::Requant { .. }) | None)
    }
}

#[inline]
fn h(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// gpt-oss's e2m1 values doubled (gguf-py `MXFP4.kvalues`).
const MXFP4_X2: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
/// IQ4_NL's codebook (gguf-py `IQ4_NL.kvalues`).
const IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// `ggml_e8m0_to_fp32_half`: `2^(e - 128)` (0 and 1 subnormal; 255 finite).
fn e8m0_half(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// Q4_K / Q5_K 6-bit scale and min of sub-block `j` (gguf-py `get_scale_min`).
fn scale_min_k4(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Affine form of one block of an exactly mapped type: codes and, per group
/// of its mapping (32 or 16 values), `(scale, bias)` with `value = code *
/// scale + bias` in f32. Returns false for types without one.
pub fn affine_block(ty: &GgmlType, b: &[u8], codes: &mut [u8], sb: &mut [(f32, f32)]) -> bool {
    let nib = |i: usize| -> u8 {
        // Q4_0/Q4_1/IQ4_NL/MXFP4 layout: low nibbles are values 0..16, high 16..32.
        let q = &b[b.len() - 16..];
        if i < 16 {
            q[i] & 15
        } else {
            q[i - 16] >> 4
        }
    };
    match ty.name {
        "Q8_0" => {
            let d = h(b, 0);
            for (i, c) in codes.iter_mut().enumerate() {
                *c = (b[2 + i] as i8 as i16 + 128) as u8;
            }
            sb[0] = (d, -128.0 * d);
        }
        "Q4_0" => {
            let d = h(b, 0);
            for (i, c) in codes.iter_mut().enumerate() {
                *c = nib(i);
            }
            sb[0] = (d, -8.0 * d);
        }
        "Q4_1" => {
            for (i, c) in codes.iter_mut().enumerate() {
                *c = nib(i);
            }
            sb[0] = (h(b, 0), h(b, 2));
        }
        "IQ4_NL" => {
            let d = h(b, 0);
            for (i, c) in codes.iter_mut().enumerate() {
                *c = (IQ4NL[nib(i) as usize] as i16 + 128) as u8;
            }
            sb[0] = (d, -128.0 * d);
        }
        "Q5_0" | "Q5_1" => {
            let off = if ty.name == "Q5_0" { 2 } else { 4 };
            let qh = u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]]);
            for (i, c) in codes.iter_mut().enumerate() {
                *c = nib(i) | ((((qh >> i) & 1) as u8) << 4);
            }
            let d = h(b, 0);
            sb[0] = if ty.name == "Q5_0" {
                (d, -16.0 * d)
            } else {
                (d, h(b, 2))
            };
        }
        "Q4_K" | "Q5_K" => {
            let (d, dmin) = (h(b, 0), h(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = if ty.name == "Q4_K" {
                (None, &b[16..144])
            } else {
                (Some(&b[16..48]), &b[48..176])
            };
            for (e, c) in codes.iter_mut().enumerate() {
                let (j, i) = (e / 32, e % 32);
                let byte = qs[(j / 2) * 32 + i];
                let mut q = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                if let Some(qh) = qh {
                    q |= ((qh[i] >> j) & 1) << 4;
                }
                *c = q;
            }
            for (j, s) in sb.iter_mut().enumerate().take(8) {
                let (scale, min) = scale_min_k4(sc, j);
                *s = (d * scale as f32, -(dmin * min as f32));
            }
        }
        "Q6_K" => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            for (e, c) in codes.iter_mut().enumerate() {
                let (k, i) = (e / 32, e % 32);
                let (half, r) = (k / 4, k % 4);
                let lo = (ql[half * 64 + (r % 2) * 32 + i] >> (4 * (r / 2))) & 15;
                let hi = (qh[half * 32 + i] >> (2 * r)) & 3;
                *c = lo | (hi << 4);
            }
            for (s, &l) in sb.iter_mut().zip(sc) {
                let scale = d * (l as i8) as f32;
                *s = (scale, -32.0 * scale);
            }
        }
        "Q3_K" => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = h(b, 108);
            for (e, c) in codes.iter_mut().enumerate() {
                let (half, sh, i) = (e / 128, (e % 128) / 32, e % 32);
                let ql = (qs[half * 32 + i] >> (2 * sh)) & 3;
                // q = ql - 4 (high bit clear) or ql (set): code q + 4.
                *c = ql | (((hmask[i] >> (e / 32)) & 1) << 2);
            }
            for (j, s) in sb.iter_mut().enumerate() {
                let scale = d * q3k_scale(sc, j) as f32;
                *s = (scale, -4.0 * scale);
            }
        }
        "Q2_K" => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (h(b, 80), h(b, 82));
            for (e, c) in codes.iter_mut().enumerate() {
                let (half, sh, i) = (e / 128, (e % 128) / 32, e % 32);
                *c = (qs[half * 32 + i] >> (2 * sh)) & 3;
            }
            for (s, &l) in sb.iter_mut().zip(sc) {
                *s = (d * (l & 15) as f32, -(dmin * (l >> 4) as f32));
            }
        }
        _ => return false,
    }
    true
}

/// Q3_K's signed 6-bit scale of sub-block `i` (of 16).
fn q3k_scale(sc: &[u8], i: usize) -> i8 {
    let l = if i < 8 { sc[i] & 15 } else { sc[i - 8] >> 4 };
    let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
    (l | (hi << 4)) as i8 - 32
}

/// Dequantizes one block as gguf-py does (same f32 operations, same order).
/// Returns false for types without a dequantizer here.
pub fn dequant_block(ty: &GgmlType, b: &[u8], out: &mut [f32]) -> bool {
    match ty.name {
        "F32" => out[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        "F16" => out[0] = h(b, 0),
        "BF16" => out[0] = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16),
        "Q8_0" => {
            let d = h(b, 0);
            for (i, o) in out.iter_mut().enumerate() {
                *o = (b[2 + i] as i8) as f32 * d;
            }
        }
        "Q4_0" | "Q5_0" | "IQ4_NL" => {
            // d * integer: exact, so the order of gguf-py's product is moot.
            let mut codes = [0u8; 32];
            let mut sb = [(0f32, 0f32); 1];
            affine_block(ty, b, &mut codes, &mut sb);
            let d = h(b, 0);
            let shift = match ty.name {
                "Q4_0" => 8,
                "Q5_0" => 16,
                _ => 128,
            };
            for (o, &c) in out.iter_mut().zip(&codes) {
                *o = d * (c as i32 - shift) as f32;
            }
        }
        "Q4_1" | "Q5_1" | "Q4_K" | "Q5_K" => {
            // gguf-py: (d * q) + m, and (d * sc) * q - dmin * m: one rounding
            // after exact products, which is code * scale + bias.
            let n = ty.block / 32;
            let mut codes = [0u8; QK_K];
            let mut sb = [(0f32, 0f32); 8];
            affine_block(ty, b, &mut codes[..ty.block], &mut sb[..n]);
            for (e, o) in out.iter_mut().enumerate() {
                let (s, bias) = sb[e / 32];
                *o = codes[e] as f32 * s + bias;
            }
        }
        "MXFP4" => {
            let d = e8m0_half(b[0]);
            for (i, o) in out.iter_mut().enumerate() {
                let q = &b[1..];
                let n = if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 };
                *o = d * MXFP4_X2[n as usize] as f32;
            }
        }
        "Q2_K" => {
            let (sc, qs) = (&b[0..16], &b[16..80]);
            let (d, dmin) = (h(b, 80), h(b, 82));
            for (e, o) in out.iter_mut().enumerate() {
                let s = sc[e / 16];
                let dl = d * (s & 15) as f32;
                let ml = dmin * (s >> 4) as f32;
                let (half, sh, i) = (e / 128, (e % 128) / 32, e % 32);
                let q = (qs[half * 32 + i] >> (2 * sh)) & 3;
                *o = dl * q as f32 - ml;
            }
        }
        "Q3_K" => {
            let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
            let d = h(b, 108);
            for (e, o) in out.iter_mut().enumerate() {
                let dl = d * q3k_scale(sc, e / 16) as f32;
                let (half, sh, i) = (e / 128, (e % 128) / 32, e % 32);
                let ql = ((qs[half * 32 + i] >> (2 * sh)) & 3) as i8;
                let qh = ((hmask[i] >> (e / 32)) & 1) ^ 1;
                *o = dl * (ql - ((qh << 2) as i8)) as f32;
            }
        }
        "Q6_K" => {
            let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
            let d = h(b, 208);
            for (e, o) in out.iter_mut().enumerate() {
                let (k, i) = (e / 32, e % 32);
                let (half, r) = (k / 4, k % 4);
                let lo = (ql[half * 64 + (r % 2) * 32 + i] >> (4 * (r / 2))) & 15;
                let hi = (qh[half * 32 + i] >> (2 * r)) & 3;
                let q = (lo | (hi << 4)) as i8 - 32;
                *o = (d * (sc[e / 16] as i8) as f32) * q as f32;
            }
        }
        "IQ4_XS" => {
            let d = h(b, 0);
            let sh = u16::from_le_bytes([b[2], b[3]]);
            let (sl, qs) = (&b[4..8], &b[8..136]);
            for (e, o) in out.iter_mut().enumerate() {
                let (j, t) = (e / 32, e % 32);
                let l = (sl[j / 2] >> (4 * (j % 2))) & 15;
                let hi = ((sh >> (2 * j)) & 3) as u8;
                let dl = d * ((l | (hi << 4)) as i8 - 32) as f32;
                let n = (qs[j * 16 + t % 16] >> (4 * (t / 16))) & 15;
                *o = dl * IQ4NL[n as usize] as f32;
            }
        }
        _ => return super::iq::dequant_block(ty.name, b, out),
    }
    true
}

/// Dequantizes whole rows (`bytes` a multiple of the block size).
pub fn dequant_rows(ty: &GgmlType, bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes
        .chunks_exact(ty.bytes)
        .zip(out.chunks_exact_mut(ty.block))
    {
        let ok = dequant_block(ty, blk, o);
        debug_assert!(ok, "dequantizer for {}", ty.name);
    }
}

/// MXFP4 block -> its 32 e2m1 codes in order and its e8m0 byte.
pub fn mxfp4_block(b: &[u8], codes: &mut [u8]) -> u8 {
    for (i, c) in codes.iter_mut().enumerate() {
        *c = if i < 16 {
            b[1 + i] & 15
        } else {
            b[1 + i - 16] >> 4
        };
    }
    b[0]
}
