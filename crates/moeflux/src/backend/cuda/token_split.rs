//! Long batches (prefill) of a group, split by tokens: each GPU does the
//! per-token work of its own share of the rows (norms, the mixers' input
//! and output projections) and the mixers' sequence part (the KV append
//! and attention, the conv and the delta rule) on every row, after NCCL
//! has given every GPU the projections the others computed. Every GPU's
//! state therefore ends the same, and decode runs as before.
//!
//! When every GPU holds every routed expert, the MLP (router, shared and
//! routed experts) runs on the GPU's own rows too, and the rows meet again
//! only before the LM head. When each holds a shard, the mixer's output
//! rows are shared and the MLP runs on every row with the experts split,
//! as without the token split.
//!
//! Splitting only the experts leaves the dense products, half of a one-GPU
//! prefill at Qwen3.6-35B-A3B's widths, on every GPU; by tokens only the
//! sequence part (about a tenth there) is repeated. Each token's products
//! are computed as one GPU computes them, so a group holding every expert
//! gives one GPU's bits, and a sharded one the bits it gives unsplit.

use std::ops::Range;

/// Batches of at least this many tokens are split (below, a GPU's share
/// fills too little of a tensor-core tile to gain on the broadcasts).
/// `MOEFLUX_TOKEN_SPLIT` overrides it: `0` never splits, another number is
/// the minimum.
const MIN_TOKENS: usize = 256;

fn min_tokens() -> Option<usize> {
    static MIN: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| match std::env::var("MOEFLUX_TOKEN_SPLIT") {
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(0) => None,
            Ok(n) => Some(n.max(2)),
            Err(_) => Some(MIN_TOKENS),
        },
        Err(_) => Some(MIN_TOKENS),
    })
}

/// Which rows of an eval each GPU of the group computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RowSplit {
    /// Per rank, its rows (consecutive, together all of them).
    pub rows: Vec<Range<usize>>,
    pub rank: usize,
    /// Every GPU holds every routed expert: the MLP runs on its own rows.
    pub experts_local: bool,
}

impl RowSplit {
    /// `n` rows over `world` GPUs as evenly as they go, or `None` when the
    /// batch is too short to split.
    pub fn for_batch(n: usize, world: usize, rank: usize, experts_local: bool) -> Option<RowSplit> {
        let min = min_tokens()?;
        (world > 1 && n >= min).then(|| RowSplit::even(n, world, rank, experts_local))
    }

    fn even(n: usize, world: usize, rank: usize, experts_local: bool) -> RowSplit {
        let rows = (0..world)
            .map(|r| r * n / world..(r + 1) * n / world)
            .collect();
        RowSplit {
            rows,
            rank,
            experts_local,
        }
    }

    /// This GPU's rows.
    pub fn own(&self) -> Range<usize> {
        self.rows[self.rank].clone()
    }

    /// The split of the rows `rows` of the eval (one sequence's), counted
    /// from its first: each GPU's share of them, empty for a GPU whose
    /// rows lie elsewhere.
    pub fn within(&self, rows: &Range<usize>) -> RowSplit {
        let clip = |i: usize| i.clamp(rows.start, rows.end) - rows.start;
        RowSplit {
            rows: self
                .rows
                .iter()
                .map(|r| clip(r.start)..clip(r.end))
                .collect(),
            ..self.clone()
        }
    }

    /// The rows of the norms and the MLP this GPU computes: its own, or
    /// all of them when the experts are sharded.
    pub fn mlp_rows(&self) -> Range<usize> {
        match self.experts_local {
            true => self.own(),
            false => 0..self.rows.last().map_or(0, |r| r.end),
        }
    }
}

/// Device address of row `row` of a buffer of rows of `width` floats.
pub(super) fn row(buf: u64, row: usize, width: usize) -> u64 {
    buf + (4 * row * width) as u64
}

#[cfg(test)]
mod tests {
    use super::RowSplit;

    #[test]
    fn rows_cover_the_batch_once_and_evenly() {
        for n in [2, 3, 255, 256, 4097] {
            for world in 1..=5 {
                let all: Vec<_> = (0..world)
                    .map(|r| RowSplit::even(n, world, r, true).own())
                    .collect();
                assert_eq!(all[0].start, 0);
                assert_eq!(all[world - 1].end, n);
                for w in all.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                let lens: Vec<usize> = all.iter().map(|r| r.len()).collect();
                let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
                assert!(hi - lo <= 1, "{n} over {world}: {lens:?}");
            }
        }
    }

    #[test]
    fn a_sequences_share_is_counted_from_its_first_row() {
        let s = RowSplit::even(301, 2, 1, true);
        let within = |rows| {
            let w = s.within(&rows);
            (w.rows.clone(), w.own())
        };
        assert_eq!(within(100..200), (vec![0..50, 50..100], 50..100));
        assert_eq!(within(0..120), (vec![0..120, 120..120], 120..120));
        assert_eq!(within(200..301), (vec![0..0, 0..101], 0..101));
    }

    #[test]
    fn short_batches_and_one_gpu_are_not_split() {
        assert_eq!(RowSplit::for_batch(4096, 1, 0, true), None);
        assert_eq!(RowSplit::for_batch(16, 2, 0, true), None);
        let s = RowSplit::for_batch(4096, 2, 1, true).expect("split");
        assert_eq!((s.own(), s.mlp_rows()), (2048..4096, 2048..4096));
        let s = RowSplit::for_batch(4097, 2, 0, false).expect("split");
        assert_eq!((s.own(), s.mlp_rows()), (0..2048, 0..4097));
    }
}
