//! Per-sequence state: a KV cache per full-attention layer, a latent cache per
//! MLA layer and a conv + recurrent state per GatedDeltaNet layer.
//!
//! A sliding-window layer's KV cache keeps only the rows its window can
//! still see, plus a bounded slack ([`KvCache::trim`]): memory is
//! O(window), not O(context). Positions stay absolute (`start` is the
//! position of the first row held). Returning to a position whose window
//! rows were dropped needs a [`RewindState`] taken there (a checkpoint).

use crate::error::{Error, Result};

/// Keys and values of one full-attention layer: row `i` = position
/// `start + i`, each row `[kv_heads * head_dim]`. A layer with a sliding
/// window of `w` attends, at position `p`, to positions `p+1-w..=p` only,
/// so older rows are dropped ([`KvCache::trim`]); a full layer keeps every
/// row (`start` stays 0).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Floats per row.
    pub row: usize,
    /// Position of the first row held.
    pub start: usize,
    /// The layer's sliding window (`None`: full attention).
    pub window: Option<usize>,
}

impl KvCache {
    pub fn new(row: usize, window: Option<usize>) -> Self {
        KvCache {
            k: Vec::new(),
            v: Vec::new(),
            row,
            start: 0,
            window,
        }
    }

    /// Positions covered: the next row's position.
    pub fn len(&self) -> usize {
        self.start + self.held()
    }

    /// Rows held in memory (`len() - start`).
    pub fn held(&self) -> usize {
        self.k.len() / self.row
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first position the query at `pos` attends to.
    pub fn first_needed(&self, pos: usize) -> usize {
        first_needed(self.window, pos)
    }

    /// Rows a window layer keeps beyond the `window - 1` the next token
    /// needs: short rewinds (up to this many tokens) need no checkpoint,
    /// and rows are dropped this many at a time, so each append moves
    /// O(1) rows on average.
    pub fn slack(window: usize) -> usize {
        window.div_ceil(2).max(1)
    }

    /// The most rows a window layer holds after a step (trimmed),
    /// `window - 2 + 2 x slack`, under `2 x window`; within a step, a chunk
    /// of `n` tokens adds `n` more until its attention is done. `None` for
    /// a full layer.
    pub fn max_held(&self) -> Option<usize> {
        self.window.map(Self::max_held_of)
    }

    /// [`KvCache::max_held`] of a window of `w`.
    pub fn max_held_of(w: usize) -> usize {
        w + 2 * Self::slack(w) - 2
    }

    /// Whether `truncate(n)` keeps what the next token at `n` attends to.
    pub fn can_truncate(&self, n: usize) -> bool {
        n == 0 || (n <= self.len() && self.start <= self.first_needed(n))
    }

    /// Keeps positions `..n` (see [`KvCache::can_truncate`]).
    pub fn truncate(&mut self, n: usize) {
        assert!(
            self.can_truncate(n),
            "truncate to {n}: rows from {} held, the window needs {}",
            self.start,
            self.first_needed(n)
        );
        if n == 0 {
            self.start = 0;
        }
        let keep = (n - self.start) * self.row;
        self.k.truncate(keep);
        self.v.truncate(keep);
    }

    /// Drops, on a window layer, the rows no position within the last
    /// `slack` can attend to any more, once there are `slack` of them
    /// (amortised: a drop moves the rows kept to the front). A no-op on a
    /// full layer. Run after a chunk's attention, never within it: a
    /// chunk's first query may need rows its last one does not.
    pub fn trim(&mut self) {
        let keep_from = trimmed_start(self.window, self.start, self.len());
        if keep_from > self.start {
            self.drop_before(keep_from);
        }
    }

    /// Drops the rows before position `p`.
    fn drop_before(&mut self, p: usize) {
        let n = (p.min(self.len()) - self.start) * self.row;
        self.k.drain(..n);
        self.v.drain(..n);
        self.start += n / self.row;
    }

    /// A copy of the rows the next token attends to (those of positions
    /// `first_needed(len)..len`): what a checkpoint keeps of a window layer.
    pub fn window_rows(&self) -> KvCache {
        let from = self.first_needed(self.len()).max(self.start);
        let skip = (from - self.start) * self.row;
        KvCache {
            k: self.k[skip..].to_vec(),
            v: self.v[skip..].to_vec(),
            row: self.row,
            start: from,
            window: self.window,
        }
    }
}

/// The first position a cache of `window` holding positions `start..len`
/// keeps after [`KvCache::trim`] (the GPU's ring follows the same rule, so
/// both backends can return to the same positions).
pub fn trimmed_start(window: Option<usize>, start: usize, len: usize) -> usize {
    let Some(w) = window else { return start };
    let r = KvCache::slack(w);
    let keep_from = first_needed(window, len.saturating_sub(r));
    if keep_from >= start + r {
        keep_from.min(len)
    } else {
        start
    }
}

/// The first position the query at `pos` attends to with `window`.
pub fn first_needed(window: Option<usize>, pos: usize) -> usize {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

/// The cache of one MLA layer (DeepSeek-V3), row `p` = position `p`: the
/// normalised KV latent `[kv_lora_rank]` and the rotated key part shared by all
/// heads `[qk_rope_head_dim]`. Keys and values of every head are recovered from
/// the latent (absorbed into the query / output, or decompressed for a batch).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MlaCache {
    pub latent: Vec<f32>,
    pub rope: Vec<f32>,
    pub kv_lora_rank: usize,
    pub rope_dim: usize,
}

impl MlaCache {
    pub fn new(kv_lora_rank: usize, rope_dim: usize) -> Self {
        MlaCache {
            latent: Vec::new(),
            rope: Vec::new(),
            kv_lora_rank,
            rope_dim,
        }
    }
    pub fn len(&self) -> usize {
        self.latent.len() / self.kv_lora_rank
    }
    pub fn is_empty(&self) -> bool {
        self.latent.is_empty()
    }
    pub fn truncate(&mut self, n: usize) {
        self.latent.truncate(n * self.kv_lora_rank);
        self.rope.truncate(n * self.rope_dim);
    }
}

/// State of one GatedDeltaNet layer: the last `kernel-1` conv inputs
/// `[kernel-1][conv_dim]` and the recurrent state `[v_heads][v_dim][k_dim]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LinearState {
    pub conv: Vec<f32>,
    pub ssm: Vec<f32>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum LayerState {
    Full(KvCache),
    Linear(LinearState),
    Mla(MlaCache),
}

/// What returning to a position needs besides truncating the attention
/// caches: the GatedDeltaNet states and, per sliding-window layer, the rows
/// its window sees from there (a checkpoint, taken by
/// [`ModelState::rewind_state`]). Full layers need nothing: they keep
/// every row.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RewindState {
    /// One per linear layer, in layer order.
    pub linear: Vec<LinearState>,
    /// One per sliding-window layer, in layer order
    /// ([`KvCache::window_rows`]).
    pub windows: Vec<KvCache>,
}

/// The whole model's state for one sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelState {
    pub layers: Vec<LayerState>,
}

impl ModelState {
    pub fn clear(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Full(kv) => kv.truncate(0),
                LayerState::Mla(m) => m.truncate(0),
                LayerState::Linear(s) => {
                    s.conv.fill(0.0);
                    s.ssm.fill(0.0);
                }
            }
        }
    }

    pub fn has_linear_layers(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l, LayerState::Linear(_)))
    }

    /// What [`ModelState::rewind`] needs to return here later: copies of
    /// the GatedDeltaNet states and of the window layers' visible rows.
    pub fn rewind_state(&self) -> RewindState {
        let mut r = RewindState::default();
        for l in &self.layers {
            match l {
                LayerState::Linear(s) => r.linear.push(s.clone()),
                LayerState::Full(kv) if kv.window.is_some() => r.windows.push(kv.window_rows()),
                LayerState::Full(_) | LayerState::Mla(_) => {}
            }
        }
        r
    }

    /// Whether the attention caches alone can return to position `n`
    /// (every window layer still holds the rows the token at `n` attends
    /// to). Linear layers always need a checkpoint.
    pub fn can_truncate(&self, n: usize) -> bool {
        self.layers.iter().all(|l| match l {
            LayerState::Full(kv) => kv.can_truncate(n),
            LayerState::Mla(_) | LayerState::Linear(_) => true,
        })
    }

    /// Returns to position `n`: full and MLA caches drop later rows; a
    /// window layer does the same when it still holds the rows `n` needs,
    /// else takes them from `from` (taken at `n`); linear layers take
    /// `from`'s states. An error (and nothing changed) when `from` is
    /// needed but missing or was not taken at `n`.
    pub fn rewind(&mut self, n: usize, from: Option<&RewindState>) -> Result<()> {
        self.check_rewind(n, from)?;
        let mut lin = from.map(|f| f.linear.iter());
        let mut win = from.map(|f| f.windows.iter());
        for l in &mut self.layers {
            match l {
                LayerState::Full(kv) => {
                    let saved = match (kv.window, &mut win) {
                        (Some(_), Some(w)) => w.next(),
                        _ => None,
                    };
                    match saved {
                        Some(saved) if !kv.can_truncate(n) => kv.clone_from(saved),
                        _ => kv.truncate(n),
                    }
                }
                LayerState::Mla(m) => m.truncate(n),
                LayerState::Linear(s) => {
                    if let Some(saved) = lin.as_mut().and_then(|l| l.next()) {
                        s.clone_from(saved);
                    }
                }
            }
        }
        Ok(())
    }

    fn check_rewind(&self, n: usize, from: Option<&RewindState>) -> Result<()> {
        let (mut lin, mut win) = (0, 0);
        for (i, l) in self.layers.iter().enumerate() {
            match l {
                LayerState::Full(kv) if kv.window.is_some() => {
                    let saved = from.and_then(|f| f.windows.get(win));
                    win += 1;
                    if kv.can_truncate(n) {
                        continue;
                    }
                    match saved {
                        Some(s) if s.len() == n && s.row == kv.row && s.can_truncate(n) => {}
                        Some(_) => {
                            return Err(Error::Invalid(format!(
                                "layer {i}: the checkpoint's window rows do not end at position {n}"
                            )))
                        }
                        None => {
                            return Err(Error::Invalid(format!(
                                "layer {i}: its sliding window dropped the rows before position \
                                 {}, position {n} needs them from {}; return to a checkpoint",
                                kv.start,
                                kv.first_needed(n)
                            )))
                        }
                    }
                }
                LayerState::Full(kv) => {
                    if n > kv.len() {
                        return Err(Error::Invalid(format!(
                            "layer {i}: cannot rewind to {n}, the cache holds {} positions",
                            kv.len()
                        )));
                    }
                }
                LayerState::Mla(_) => {}
                LayerState::Linear(s) => {
                    let saved = from.and_then(|f| f.linear.get(lin));
                    lin += 1;
                    match saved {
                        Some(h) if h.conv.len() == s.conv.len() && h.ssm.len() == s.ssm.len() => {}
                        _ => {
                            return Err(Error::Invalid(format!(
                                "layer {i}: a linear-attention layer returns only to a checkpoint"
                            )))
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Appends the rows of positions `len..len+n` (row of position `p`:
    /// `[p, -p]`), then trims, as an attention step does.
    fn append(kv: &mut KvCache, n: usize) {
        for _ in 0..n {
            let p = kv.len() as f32;
            kv.k.extend_from_slice(&[p, -p]);
            kv.v.extend_from_slice(&[-p, p]);
        }
        kv.trim();
    }

    /// The cache holds exactly positions `start..len`, each its own row.
    fn check_rows(kv: &KvCache) {
        for (i, r) in kv.k.chunks_exact(2).enumerate() {
            assert_eq!(r[0], (kv.start + i) as f32);
        }
        assert_eq!(kv.k.len(), kv.v.len());
    }

    #[test]
    fn a_window_cache_never_exceeds_window_plus_slack() {
        for w in [1, 2, 7, 8, 128] {
            let mut kv = KvCache::new(2, Some(w));
            let max = kv.max_held().unwrap();
            assert!(max < 2 * w.max(2), "window {w}: bound {max}");
            let mut trims = 0;
            for pos in 0..20 * w {
                let start = kv.start;
                append(&mut kv, 1);
                trims += usize::from(kv.start != start);
                assert_eq!(kv.len(), pos + 1);
                assert!(kv.held() <= max, "window {w} at {pos}: {}", kv.held());
                // What the next token attends to is held.
                assert!(kv.start <= kv.first_needed(kv.len()));
                check_rows(&kv);
            }
            // Drops are batched (each moves the rows kept once).
            assert!(trims <= 20 * w / KvCache::slack(w), "window {w}: {trims}");
        }
        // A full layer keeps everything.
        let mut full = KvCache::new(2, None);
        append(&mut full, 1000);
        assert_eq!((full.start, full.held()), (0, 1000));
    }

    #[test]
    fn a_window_cache_rewinds_within_its_slack_only() {
        let w = 8;
        let mut kv = KvCache::new(2, Some(w));
        append(&mut kv, 100);
        let r = KvCache::slack(w);
        // At least `slack` positions back are always reachable.
        assert!(kv.can_truncate(100 - r));
        let far = 100 - w - kv.held();
        assert!(!kv.can_truncate(far));
        assert!(kv.can_truncate(0));
        kv.truncate(100 - r);
        assert_eq!(kv.len(), 100 - r);
        check_rows(&kv);
        kv.truncate(0);
        assert_eq!((kv.start, kv.len()), (0, 0));
    }

    fn state(w: usize) -> ModelState {
        ModelState {
            layers: vec![
                LayerState::Full(KvCache::new(2, Some(w))),
                LayerState::Full(KvCache::new(2, None)),
            ],
        }
    }

    fn append_all(s: &mut ModelState, n: usize) {
        for l in &mut s.layers {
            if let LayerState::Full(kv) = l {
                append(kv, n);
            }
        }
    }

    #[test]
    fn a_rewind_past_the_window_needs_a_checkpoint_taken_there() {
        let w = 8;
        let mut s = state(w);
        append_all(&mut s, 20);
        let saved = s.rewind_state();
        assert_eq!(saved.windows.len(), 1);
        assert_eq!(saved.windows[0].held(), w - 1);
        let at_20 = s.clone();
        append_all(&mut s, 60);
        assert!(!s.can_truncate(20));

        // Without the checkpoint: a clear error, nothing changed.
        let before = s.clone();
        let err = s.rewind(20, None).unwrap_err().to_string();
        assert!(err.contains("sliding window"), "{err}");
        assert_eq!(s, before);
        // A checkpoint of another position is refused too.
        let mut other = at_20.clone();
        append_all(&mut other, 1);
        assert!(s.rewind(20, Some(&other.rewind_state())).is_err());
        assert_eq!(s, before);

        // With it: the window rows come back, the full layer truncates.
        s.rewind(20, Some(&saved)).unwrap();
        let (LayerState::Full(a), LayerState::Full(b)) = (&s.layers[0], &s.layers[1]) else {
            unreachable!()
        };
        assert_eq!((a.len(), a.start, a.held()), (20, 20 - (w - 1), w - 1));
        check_rows(a);
        assert_eq!((b.len(), b.held()), (20, 20));
        let LayerState::Full(orig) = &at_20.layers[1] else {
            unreachable!()
        };
        assert_eq!(b, orig);

        // Going on from there appends as usual.
        append_all(&mut s, 30);
        let LayerState::Full(a) = &s.layers[0] else {
            unreachable!()
        };
        assert_eq!(a.len(), 50);
        check_rows(a);
    }
}
