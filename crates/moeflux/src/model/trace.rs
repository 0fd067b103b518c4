//! Per-block outputs of one forward pass, for finding where two backends
//! (or an engine and its oracle) diverge: the embedding, per layer the two
//! RMSNorms' outputs and what the mixer and the MLP added to the residual
//! stream, and the logits. Written as one `.npy` per block plus an index.

use std::path::Path;

use npyz::WriterBuilder;
use serde_json::json;

use crate::error::{Error, Result};
use crate::fsutil::write_file_atomic;
use crate::model::forward::{Activation, BlockExecutor};

/// One block's output, `[rows, cols]` row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceEntry {
    /// `None` for the embedding and the logits.
    pub layer: Option<usize>,
    /// `embed`, `attn_norm`, `full_attention` | `gated_deltanet` | `mla`,
    /// `mlp_norm`, `moe` | `dense_mlp`, `logits`.
    pub block: &'static str,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl TraceEntry {
    /// `embed`, `L003.moe`, `logits`.
    pub fn name(&self) -> String {
        match self.layer {
            Some(l) => format!("L{l:03}.{}", self.block),
            None => self.block.to_string(),
        }
    }
}

/// The blocks of one eval, in evaluation order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Trace {
    /// Tokens of the eval (the rows of every entry but the logits).
    pub tokens: usize,
    /// Rows of the logits (all tokens or the last).
    pub logits_rows: usize,
    pub entries: Vec<TraceEntry>,
    /// Keep no entries, only note the first block whose output is not
    /// finite ([`Trace::checking`]).
    check_only: bool,
    /// `(layer, block)` of the first recorded output holding a NaN or an
    /// infinity, in evaluation order.
    pub first_non_finite: Option<(Option<usize>, &'static str)>,
}

impl Trace {
    pub fn new(tokens: usize, logits_rows: usize) -> Self {
        Trace {
            tokens,
            logits_rows,
            entries: Vec::new(),
            check_only: false,
            first_non_finite: None,
        }
    }

    /// A trace that keeps nothing but [`Trace::first_non_finite`], checking
    /// the residual stream (not what each block added to it) and the norms'
    /// outputs: finds where damaged weights first break a forward pass
    /// without holding every block's output.
    pub fn checking(tokens: usize, logits_rows: usize) -> Self {
        Trace {
            check_only: true,
            ..Trace::new(tokens, logits_rows)
        }
    }

    /// The entry of `block` in `layer`.
    pub fn get(&self, layer: Option<usize>, block: &str) -> Option<&TraceEntry> {
        self.entries
            .iter()
            .find(|e| e.layer == layer && e.block == block)
    }

    fn push(&mut self, layer: Option<usize>, block: &'static str, rows: usize, data: Vec<f32>) {
        if self.first_non_finite.is_none() && data.iter().any(|v| !v.is_finite()) {
            self.first_non_finite = Some((layer, block));
        }
        if self.check_only {
            return;
        }
        let cols = data.len() / rows.max(1);
        self.entries.push(TraceEntry {
            layer,
            block,
            rows,
            cols,
            data,
        });
    }

    /// Records buffer `what` of `ex` as `block`.
    pub(crate) fn record(
        &mut self,
        ex: &mut impl BlockExecutor,
        layer: Option<usize>,
        block: &'static str,
        what: Activation,
    ) -> Result<()> {
        let data = ex.read(what)?;
        let rows = match what {
            Activation::Hidden | Activation::Normed => self.tokens,
            Activation::Logits => self.logits_rows,
        };
        self.push(layer, block, rows, data);
        Ok(())
    }

    /// Records the residual stream as `block` and returns it.
    pub(crate) fn record_hidden(
        &mut self,
        ex: &mut impl BlockExecutor,
        layer: Option<usize>,
        block: &'static str,
    ) -> Result<Vec<f32>> {
        let x = ex.read(Activation::Hidden)?;
        if self.check_only {
            self.push(layer, block, self.tokens, x);
            return Ok(Vec::new());
        }
        self.push(layer, block, self.tokens, x.clone());
        Ok(x)
    }

    /// Records what `block` added to the residual stream since `before`
    /// (then updated to the stream now).
    pub(crate) fn record_delta(
        &mut self,
        ex: &mut impl BlockExecutor,
        layer: usize,
        block: &'static str,
        before: &mut Vec<f32>,
    ) -> Result<()> {
        let x = ex.read(Activation::Hidden)?;
        if self.check_only {
            // The stream itself: non-finite from this block on.
            self.push(Some(layer), block, self.tokens, x);
            return Ok(());
        }
        let delta = x.iter().zip(before.iter()).map(|(a, b)| a - b).collect();
        *before = x;
        self.push(Some(layer), block, self.tokens, delta);
        Ok(())
    }

    /// Writes `dir/NNN-<name>.npy` per entry (float32 `[rows, cols]`) and
    /// `dir/trace.json` listing them in order; the directory is created if
    /// needed, every file written atomically.
    pub fn write_dir(&self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        let mut index = Vec::with_capacity(self.entries.len());
        for (i, e) in self.entries.iter().enumerate() {
            let file = format!("{i:03}-{}.npy", e.name());
            let shape = [e.rows as u64, e.cols as u64];
            write_file_atomic(&dir.join(&file), |w| {
                let mut npy = npyz::WriteOptions::new()
                    .default_dtype()
                    .shape(&shape)
                    .writer(w)
                    .begin_nd()?;
                npy.extend(e.data.iter().copied())?;
                npy.finish()
            })?;
            index.push(json!({
                "file": file,
                "layer": e.layer,
                "block": e.block,
                "shape": [e.rows, e.cols],
            }));
        }
        let text = serde_json::to_vec_pretty(&json!({
            "tokens": self.tokens,
            "blocks": index,
        }))
        .expect("JSON of plain values");
        write_file_atomic(&dir.join("trace.json"), |w| {
            std::io::Write::write_all(w, &text)
        })
    }
}
