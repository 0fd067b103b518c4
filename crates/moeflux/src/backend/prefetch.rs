//! Speculative expert prefetch, as an option and its counters (the CPU's
//! runs in `cpu::experts`, the GPU's host-tier uploads in `cuda::moe`).
//!
//! While a MoE layer computes, the *next* MoE layer's router is applied to
//! this layer's (post-attention, normed) hidden state, and the experts it
//! picks are fetched ahead. The residual stream changes little from one
//! layer to the next, so the guess is often right; a right guess turns that
//! expert's read into time overlapped with this layer's compute, a wrong one
//! costs a read nobody uses.

use std::collections::BTreeMap;

/// Speculative expert prefetch (the next MoE layer's router on the
/// current layer's input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Prefetch {
    /// Where it was measured to pay: GPU uploads from the pinned host tier
    /// when experts are large enough that copies, not launches, take the
    /// time (`backend::cuda::PREFETCH_AUTO_MIN_EXTENT`); off on the
    /// CPU.
    #[default]
    Auto,
    On,
    Off,
}

impl Prefetch {
    pub fn parse(s: &str) -> Option<Prefetch> {
        match s {
            "auto" => Some(Prefetch::Auto),
            "on" => Some(Prefetch::On),
            "off" => Some(Prefetch::Off),
            _ => None,
        }
    }
}

/// Counters of speculative prefetch, cumulative.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Experts fetched ahead.
    pub predicted: u64,
    /// Experts a layer used (each once per batch) while a prefetch for that
    /// layer existed.
    pub used: u64,
    /// Of `used`, those that had been fetched ahead.
    pub hits: u64,
}

impl PrefetchStats {
    /// Share of used experts that were fetched ahead.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.used > 0).then(|| self.hits as f64 / self.used as f64)
    }

    /// Share of fetched-ahead experts that were used.
    pub fn precision(&self) -> Option<f64> {
        (self.predicted > 0).then(|| self.hits as f64 / self.predicted as f64)
    }

    pub fn plus(&self, other: &PrefetchStats) -> PrefetchStats {
        PrefetchStats {
            predicted: self.predicted + other.predicted,
            used: self.used + other.used,
            hits: self.hits + other.hits,
        }
    }

    pub fn since(&self, earlier: &PrefetchStats) -> PrefetchStats {
        PrefetchStats {
            predicted: self.predicted.saturating_sub(earlier.predicted),
            used: self.used.saturating_sub(earlier.used),
            hits: self.hits.saturating_sub(earlier.hits),
        }
    }
}

/// The `limit` experts chosen most often in `choices` (ties to the lower
/// id), in ascending id order.
pub fn most_chosen(choices: &[usize], limit: usize) -> Vec<usize> {
    let mut count: BTreeMap<usize, usize> = BTreeMap::new();
    for &e in choices {
        *count.entry(e).or_default() += 1;
    }
    let mut by_use: Vec<(usize, usize)> = count.into_iter().collect();
    by_use.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut ids: Vec<usize> = by_use.into_iter().take(limit).map(|(e, _)| e).collect();
    ids.sort_unstable();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_chosen_keeps_the_popular_ones() {
        assert_eq!(most_chosen(&[5, 1, 5, 2, 1, 5, 9], 2), vec![1, 5]);
        assert_eq!(most_chosen(&[3, 2, 1], 2), vec![1, 2]);
        assert_eq!(most_chosen(&[4, 4], 8), vec![4]);
        assert!(most_chosen(&[], 3).is_empty());
    }

    #[test]
    fn rates() {
        let s = PrefetchStats {
            predicted: 10,
            used: 8,
            hits: 6,
        };
        assert_eq!(s.hit_rate(), Some(0.75));
        assert_eq!(s.precision(), Some(0.6));
        assert_eq!(PrefetchStats::default().hit_rate(), None);
        assert_eq!(s.since(&s), PrefetchStats::default());
    }
}
