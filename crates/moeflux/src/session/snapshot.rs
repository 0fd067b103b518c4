//! Session snapshots: a versioned, self-describing byte format.
//!
//! ```text
//! b"MFLXSNAP" | u32 version | u32 word count W | W x u64 shape words
//! | per attention layer (full or MLA): u64 first position held (S)
//! | n_tokens x u32 token ids
//! | per layer: full attention: K then V, (position - S) x kv_heads*head_dim f32
//! |            MLA: latent rows (position x kv_lora_rank f32) then rotary
//! |                 key rows (position x qk_rope_head_dim f32)
//! |            linear: conv state then recurrent state, f32
//! | u64 FNV-1a of everything before
//! ```
//! Everything is little-endian. Loading validates every word, the exact
//! length and the checksum before anything is decoded into the session.
//!
//! Version 3 added the first-position words: a sliding-window layer holds
//! only the rows its window can still see (S > 0), every other attention
//! layer all rows (S = 0). Version 2 added the MLA layer kind and two
//! shape words (`kv_lora_rank`, `qk_rope_head_dim`, 0 for models without
//! MLA). Versions 1 (15 words, Qwen models) and 2 still load: their
//! layers hold every row (S = 0), the missing words read as 0; a window
//! layer's rows are then trimmed to its window.

use crate::config::ModelConfig;
use crate::hash::fnv1a;
use crate::model::state::{KvCache, LayerState, LinearState, MlaCache, ModelState};

pub const MAGIC: &[u8; 8] = b"MFLXSNAP";
pub const VERSION: u32 = 3;
/// Shape words of a version 1 snapshot (before MLA).
const V1_WORDS: usize = 15;
/// Index of the `full_attention_layers` (full or MLA) shape word.
const ATTENTION_LAYERS_WORD: usize = 11;

const WORD_NAMES: [&str; 17] = [
    "architecture",
    "num_layers",
    "hidden_size",
    "vocab_size",
    "num_kv_heads",
    "head_dim",
    "conv_dim",
    "conv_kernel",
    "linear_v_heads",
    "linear_value_head_dim",
    "linear_key_head_dim",
    "full_attention_layers",
    "linear_attention_layers",
    "model_fingerprint",
    "position",
    "kv_lora_rank",
    "qk_rope_head_dim",
];

fn shape_words(c: &ModelConfig, fingerprint: u64, position: usize) -> [u64; 17] {
    let l = &c.linear;
    let full = c.num_full_attention_layers();
    [
        c.arch.code(),
        c.num_layers as u64,
        c.hidden_size as u64,
        c.vocab_size as u64,
        c.num_kv_heads as u64,
        c.head_dim as u64,
        l.conv_dim() as u64,
        l.conv_kernel as u64,
        l.num_v_heads as u64,
        l.value_head_dim as u64,
        l.key_head_dim as u64,
        full as u64,
        (c.num_layers - full) as u64,
        fingerprint,
        position as u64,
        c.mla.map_or(0, |m| m.kv_lora_rank) as u64,
        c.mla.map_or(0, |m| m.qk_rope_head_dim) as u64,
    ]
}

fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.reserve(v.len() * 4);
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

pub fn save(c: &ModelConfig, fingerprint: u64, tokens: &[u32], state: &ModelState) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    let words = shape_words(c, fingerprint, tokens.len());
    out.extend_from_slice(&(words.len() as u32).to_le_bytes());
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    for l in &state.layers {
        match l {
            LayerState::Full(kv) => out.extend_from_slice(&(kv.start as u64).to_le_bytes()),
            LayerState::Mla(_) => out.extend_from_slice(&0u64.to_le_bytes()),
            LayerState::Linear(_) => {}
        }
    }
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for l in &state.layers {
        match l {
            LayerState::Full(kv) => {
                put_f32s(&mut out, &kv.k);
                put_f32s(&mut out, &kv.v);
            }
            LayerState::Mla(m) => {
                put_f32s(&mut out, &m.latent);
                put_f32s(&mut out, &m.rope);
            }
            LayerState::Linear(s) => {
                put_f32s(&mut out, &s.conv);
                put_f32s(&mut out, &s.ssm);
            }
        }
    }
    let sum = fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.b.len())
            .ok_or_else(|| {
                format!(
                    "truncated: needs more than {} bytes, has {}",
                    self.at.saturating_add(n),
                    self.b.len()
                )
            })?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>, String> {
        let bytes = self.take(n.checked_mul(4).ok_or("length overflow")?)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect())
    }
}

/// Decodes a snapshot for this model; returns the token history and state.
/// Nothing outside is touched, so a rejected snapshot changes nothing.
pub fn load(
    c: &ModelConfig,
    fingerprint: u64,
    max_context: usize,
    template: &ModelState,
    bytes: &[u8],
) -> Result<(Vec<u32>, ModelState), String> {
    let mut r = Reader { b: bytes, at: 0 };
    if r.take(8)? != MAGIC {
        return Err("bad magic: not a moeflux snapshot".into());
    }
    let version = r.u32()?;
    let expect_words = match version {
        1 => V1_WORDS,
        2 | VERSION => WORD_NAMES.len(),
        _ => {
            return Err(format!(
                "version {version} is not supported (this build reads 1 to {VERSION})"
            ))
        }
    };
    let count = r.u32()? as usize;
    if count != expect_words {
        return Err(format!(
            "header has {count} shape words, expected {expect_words} for version {version}"
        ));
    }
    // Words a version 1 snapshot lacks read as 0 (no MLA).
    let mut words = [0u64; 17];
    for w in &mut words[..count] {
        *w = r.u64()?;
    }
    let position = words[14];
    if position > max_context as u64 {
        return Err(format!(
            "position {position} exceeds the context limit {max_context}"
        ));
    }
    let expect = shape_words(c, fingerprint, position as usize);
    for (i, (got, want)) in words.iter().zip(expect.iter()).enumerate() {
        if got != want {
            return Err(format!(
                "{} is {got} in the snapshot but {want} for this model",
                WORD_NAMES[i]
            ));
        }
    }
    let position = position as usize;
    // Per attention layer, the first position it holds (before version 3:
    // every row, 0).
    let attention_layers = words[ATTENTION_LAYERS_WORD] as usize;
    let mut starts = vec![0usize; attention_layers];
    if version >= 3 {
        for s in &mut starts {
            *s = r
                .u64()?
                .try_into()
                .map_err(|_| "first position overflows")?;
        }
    }
    let body_end = bytes.len().checked_sub(8).ok_or("truncated")?;
    let tokens: Vec<u32> = {
        let raw = r.take(position.checked_mul(4).ok_or("length overflow")?)?;
        raw.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    if let Some((i, t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= c.vocab_size)
    {
        return Err(format!(
            "token {i} is {t}, outside the vocabulary of {}",
            c.vocab_size
        ));
    }
    let mut starts = starts.into_iter();
    let mut layers = Vec::with_capacity(template.layers.len());
    for (i, l) in template.layers.iter().enumerate() {
        let start = match l {
            LayerState::Linear(_) => 0,
            LayerState::Full(_) | LayerState::Mla(_) => starts.next().ok_or("layer count")?,
        };
        let first_needed = match l {
            LayerState::Full(kv) => kv.first_needed(position),
            _ => 0,
        };
        // Only a window layer drops rows, and never one its next token sees.
        if start > first_needed.min(position) {
            return Err(format!(
                "layer {i} holds positions from {start}, but position {position} attends to \
                 positions from {first_needed}"
            ));
        }
        layers.push(match l {
            LayerState::Full(kv) => {
                let n = (position - start)
                    .checked_mul(kv.row)
                    .ok_or("length overflow")?;
                let mut kv = KvCache {
                    k: r.f32s(n)?,
                    v: r.f32s(n)?,
                    row: kv.row,
                    start,
                    window: kv.window,
                };
                // Rows an older snapshot keeps beyond the window go now.
                kv.trim();
                LayerState::Full(kv)
            }
            LayerState::Mla(m) => LayerState::Mla(MlaCache {
                latent: r.f32s(
                    position
                        .checked_mul(m.kv_lora_rank)
                        .ok_or("length overflow")?,
                )?,
                rope: r.f32s(position.checked_mul(m.rope_dim).ok_or("length overflow")?)?,
                kv_lora_rank: m.kv_lora_rank,
                rope_dim: m.rope_dim,
            }),
            LayerState::Linear(s) => LayerState::Linear(LinearState {
                conv: r.f32s(s.conv.len())?,
                ssm: r.f32s(s.ssm.len())?,
            }),
        });
    }
    if r.at != body_end {
        return Err(format!(
            "length is {} bytes, expected {}",
            bytes.len(),
            r.at + 8
        ));
    }
    let sum = r.u64()?;
    if sum != fnv1a(&bytes[..body_end]) {
        return Err("checksum mismatch: the snapshot is corrupted".into());
    }
    Ok((tokens, ModelState { layers }))
}

/// The largest byte length of a snapshot at `position` (the layout of
/// [`save`], every attention layer holding every row), so a reader can
/// refuse a file that no valid snapshot could be before reading it.
pub fn len_at(template: &ModelState, position: usize) -> u64 {
    let p = position as u64;
    let mut n = 8 + 4 + 4 + 8 * WORD_NAMES.len() as u64 + 4 * p + 8;
    for l in &template.layers {
        if !matches!(l, LayerState::Linear(_)) {
            n += 8;
        }
        n += 4 * match l {
            LayerState::Full(kv) => 2 * p * kv.row as u64,
            LayerState::Mla(m) => p * (m.kv_lora_rank + m.rope_dim) as u64,
            LayerState::Linear(s) => (s.conv.len() + s.ssm.len()) as u64,
        };
    }
    n
}
