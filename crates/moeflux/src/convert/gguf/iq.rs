//! Dequantization of ggml's IQ codebook types (IQ2_XXS, IQ2_XS, IQ2_S,
//! IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) exactly as gguf-py's `quants.py` computes
//! it: the same f32 operations in the same order (numpy's `a * b * c` is
//! `(a * b) * c`; signs are exact factors of ±1). The codebooks are
//! generated from gguf-py's ([`super::iq_grids`]). These types have no
//! affine form (values come from a codebook), so `convert` re-quantizes them.

use super::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};

/// Values per super-block.
const QK_K: usize = 256;
/// IQ1's offset of the codebook values (gguf-py `IQ1_S.delta`).
const IQ1_DELTA: f32 = 0.125;

#[inline]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

#[inline]
fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Value `j` of a grid row (bytes little-endian, two's complement).
#[inline]
fn cell(row: u64, j: usize) -> f32 {
    (row >> (8 * j)) as u8 as i8 as f32
}

/// `(db * grid) * sign` for the 8 values of one grid row, sign bit `j` of
/// `signs` negating value `j`.
#[inline]
fn signed_row(out: &mut [f32], db: f32, row: u64, signs: u8) {
    for (j, o) in out.iter_mut().enumerate() {
        let s = if ((signs >> j) & 1) == 0 { 1.0 } else { -1.0 };
        *o = db * cell(row, j) * s;
    }
}

/// Four-value rows (IQ3): two rows make the 8 values of one sign byte.
#[inline]
fn row4x2(a: u32, b: u32) -> u64 {
    a as u64 | (b as u64) << 32
}

/// Dequantizes one block of the IQ type `name`; false for other types.
pub fn dequant_block(name: &str, b: &[u8], out: &mut [f32]) -> bool {
    match name {
        "IQ2_XXS" => {
            let d = f16_at(b, 0);
            for (ib, o) in out.chunks_exact_mut(32).enumerate() {
                let (grid, aux) = (u32_at(b, 2 + 8 * ib), u32_at(b, 6 + 8 * ib));
                let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
                for (l, o8) in o.chunks_exact_mut(8).enumerate() {
                    let row = IQ2XXS_GRID[((grid >> (8 * l)) & 255) as usize];
                    let signs = KSIGNS[((aux >> (7 * l)) & 127) as usize];
                    signed_row(o8, db, row, signs);
                }
            }
        }
        "IQ2_XS" => {
            let d = f16_at(b, 0);
            let scales = &b[2 + QK_K / 4..];
            for (l, o8) in out.chunks_exact_mut(8).enumerate() {
                let q = u16_at(b, 2 + 2 * l);
                let s = (scales[l / 4] >> (4 * ((l / 2) % 2))) & 15;
                let db = d * (0.5 + s as f32) * 0.25;
                signed_row(
                    o8,
                    db,
                    IQ2XS_GRID[(q & 511) as usize],
                    KSIGNS[(q >> 9) as usize],
                );
            }
        }
        "IQ2_S" => {
            let d = f16_at(b, 0);
            let qs = &b[2..2 + QK_K / 8];
            let signs = &b[2 + QK_K / 8..2 + QK_K / 4];
            let qh = &b[2 + QK_K / 4..2 + QK_K / 4 + QK_K / 32];
            let scales = &b[2 + QK_K / 4 + QK_K / 32..];
            for (l, o8) in out.chunks_exact_mut(8).enumerate() {
                let s = (scales[l / 4] >> (4 * ((l / 2) % 2))) & 15;
                let db = d * (0.5 + s as f32) * 0.25;
                let hi = ((qh[l / 4] >> (2 * (l % 4))) & 3) as usize;
                let row = IQ2S_GRID[qs[l] as usize | hi << 8];
                signed_row(o8, db, row, signs[l]);
            }
        }
        "IQ3_XXS" => {
            let d = f16_at(b, 0);
            let qs = &b[2..2 + QK_K / 4];
            for (ib, o) in out.chunks_exact_mut(32).enumerate() {
                let aux = u32_at(b, 2 + QK_K / 4 + 4 * ib);
                let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
                for (l, o8) in o.chunks_exact_mut(8).enumerate() {
                    let m = 8 * ib + 2 * l;
                    let row = row4x2(IQ3XXS_GRID[qs[m] as usize], IQ3XXS_GRID[qs[m + 1] as usize]);
                    signed_row(o8, db, row, KSIGNS[((aux >> (7 * l)) & 127) as usize]);
                }
            }
        }
        "IQ3_S" => {
            let d = f16_at(b, 0);
            let qs = &b[2..2 + QK_K / 4];
            let qh = &b[2 + QK_K / 4..2 + QK_K / 4 + QK_K / 32];
            let signs = &b[2 + QK_K / 4 + QK_K / 32..2 + QK_K / 4 + QK_K / 32 + QK_K / 8];
            let scales = &b[2 + QK_K / 4 + QK_K / 32 + QK_K / 8..];
            let idx = |m: usize| qs[m] as usize | (((qh[m / 8] >> (m % 8)) & 1) as usize) << 8;
            for (l, o8) in out.chunks_exact_mut(8).enumerate() {
                let s = (scales[l / 8] >> (4 * ((l / 4) % 2))) & 15;
                let db = d * (1 + 2 * s) as f32;
                let row = row4x2(IQ3S_GRID[idx(2 * l)], IQ3S_GRID[idx(2 * l + 1)]);
                signed_row(o8, db, row, signs[l]);
            }
        }
        "IQ1_S" => {
            let d = f16_at(b, 0);
            let qs = &b[2..2 + QK_K / 8];
            for (ib, o) in out.chunks_exact_mut(32).enumerate() {
                let qh = u16_at(b, 2 + QK_K / 8 + 2 * ib);
                let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
                let delta = if (qh & 0x8000) == 0 {
                    IQ1_DELTA
                } else {
                    -IQ1_DELTA
                };
                for (l, o8) in o.chunks_exact_mut(8).enumerate() {
                    let hi = ((qh >> (3 * l)) & 7) as usize;
                    let row = IQ1S_GRID[qs[4 * ib + l] as usize | hi << 8];
                    for (j, v) in o8.iter_mut().enumerate() {
                        *v = dl * (cell(row, j) + delta);
                    }
                }
            }
        }
        "IQ1_M" => {
            let qs = &b[..QK_K / 8];
            let qh = &b[QK_K / 8..QK_K / 8 + QK_K / 16];
            let sc = |i: usize| u16_at(b, QK_K / 8 + QK_K / 16 + 2 * i);
            // The f16 scale: the top nibble of each of the four scale words.
            let dbits = (sc(0) >> 12)
                | ((sc(1) & 0xF000) >> 8)
                | ((sc(2) & 0xF000) >> 4)
                | (sc(3) & 0xF000);
            let d = half::f16::from_bits(dbits).to_f32();
            for (l, o8) in out.chunks_exact_mut(8).enumerate() {
                // Scale k of 16 (16 values each): 3 bits at 3 * (k % 4) of word k / 4.
                let k = l / 2;
                let s = (sc(k / 4) >> (3 * (k % 4))) & 7;
                let dl = d * (2 * s + 1) as f32;
                let nib = (qh[l / 2] >> (4 * (l % 2))) & 15;
                let delta = if (nib & 8) == 0 {
                    IQ1_DELTA
                } else {
                    -IQ1_DELTA
                };
                let row = IQ1S_GRID[qs[l] as usize | ((nib & 7) as usize) << 8];
                for (j, v) in o8.iter_mut().enumerate() {
                    *v = dl * (cell(row, j) + delta);
                }
            }
        }
        _ => return false,
    }
    true
}
