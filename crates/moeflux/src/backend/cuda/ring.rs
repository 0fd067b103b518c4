//! Where a K/V row lives in VRAM. A full layer's row of position `p` is
//! row `p` (the buffer grows with the sequence); a sliding-window layer's
//! is slot `p mod cap` of a ring whose capacity `cap` (a power of two, so
//! the kernels mask rather than divide) covers the rows the host cache
//! would hold ([`KvCache::max_held_of`]) plus the rows of the largest chunk
//! a step wrote: O(window + chunk), not O(context).

use crate::model::state::KvCache;

/// The smallest ring for a window of `window` that holds `rows` rows at
/// once, and never less than a trimmed host cache plus one decode token.
pub fn capacity(window: usize, rows: usize) -> usize {
    rows.max(KvCache::max_held_of(window) + 1)
        .next_power_of_two()
}

/// The rows a layer's buffers must grow to so that they hold positions
/// `start..end`, or `None` when `cap` rows do: a window layer's ring
/// ([`capacity`]), else rows `0..end`, doubling from 256.
pub fn room(window: Option<usize>, start: usize, end: usize, cap: usize) -> Option<usize> {
    let need = match window {
        Some(w) => capacity(w, end - start),
        None => end.next_power_of_two().max(256),
    };
    (need > cap).then_some(need)
}

/// The mask the kernels apply to a position to find its row: `cap - 1` for
/// a ring, all ones (the row is the position) for a growing buffer.
pub fn mask(ring: Option<usize>) -> i64 {
    match ring {
        Some(cap) => {
            debug_assert!(cap.is_power_of_two());
            cap as i64 - 1
        }
        None => -1,
    }
}

/// The row of position `p`.
pub fn slot(p: usize, ring: Option<usize>) -> usize {
    ring.map_or(p, |cap| p & (cap - 1))
}

/// A run of consecutive positions stored in consecutive rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub pos: usize,
    pub slot: usize,
    pub rows: usize,
}

/// Positions `from..to` as runs of consecutive rows, in position order
/// (at most two in a ring holding them all).
pub fn runs(from: usize, to: usize, ring: Option<usize>) -> Vec<Run> {
    let mut out = Vec::new();
    let mut pos = from;
    while pos < to {
        let slot = slot(pos, ring);
        let rows = ring.map_or(to - pos, |cap| (cap - slot).min(to - pos));
        out.push(Run { pos, slot, rows });
        pos += rows;
    }
    out
}

/// The row copies `(from_row, to_row, rows)` that move positions
/// `from..to` from layout `old` to layout `new`.
pub fn moves(
    from: usize,
    to: usize,
    old: Option<usize>,
    new: Option<usize>,
) -> Vec<(usize, usize, usize)> {
    runs(from, to, old)
        .into_iter()
        .flat_map(|r| {
            runs(r.pos, r.pos + r.rows, new)
                .into_iter()
                .map(move |d| (r.slot + (d.pos - r.pos), d.slot, d.rows))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_a_power_of_two_over_the_trimmed_window_and_the_rows() {
        // gpt-oss: window 128 keeps at most 254 rows after a step, so a
        // decode token fits 256.
        assert_eq!(capacity(128, 1), 256);
        assert_eq!(capacity(128, 256), 256);
        assert_eq!(capacity(128, 257), 512);
        assert_eq!(capacity(8, 1), 16);
        assert_eq!(capacity(1, 1), 2);
        for w in [1, 2, 3, 8, 100, 128] {
            for rows in [1, 5, 64, 300, 1000] {
                let c = capacity(w, rows);
                assert!(c.is_power_of_two() && c >= rows && c > KvCache::max_held_of(w));
                // Bounded: under twice what it must hold.
                assert!(
                    c < 2 * rows.max(KvCache::max_held_of(w) + 1),
                    "{w} {rows}: {c}"
                );
            }
        }
    }

    #[test]
    fn runs_cover_the_positions_in_order_each_at_its_slot() {
        for ring in [None, Some(1), Some(4), Some(16)] {
            let cap = ring.unwrap_or(usize::MAX);
            for from in 0..40 {
                for to in from..from + cap.min(40) + 1 {
                    let rs = runs(from, to, ring);
                    let mut pos = from;
                    for r in &rs {
                        assert_eq!((r.pos, r.slot), (pos, slot(pos, ring)));
                        assert!(r.rows > 0 && r.slot + r.rows <= cap);
                        pos += r.rows;
                    }
                    assert_eq!(pos, to);
                    // Within one ring's worth a run wraps at most once.
                    assert!(rs.len() <= 2, "{from}..{to} in {ring:?}: {rs:?}");
                }
            }
        }
        assert_eq!(
            runs(6, 11, Some(8)),
            [
                Run {
                    pos: 6,
                    slot: 6,
                    rows: 2
                },
                Run {
                    pos: 8,
                    slot: 0,
                    rows: 3
                }
            ]
        );
    }

    #[test]
    fn moves_put_every_position_where_the_new_layout_reads_it() {
        let layouts = [None, Some(4), Some(8), Some(16), Some(32)];
        for old in layouts {
            for new in layouts {
                for from in 0..20 {
                    let held = old.unwrap_or(64).min(new.unwrap_or(64));
                    for to in from..=from + held {
                        let mut seen = vec![false; to - from];
                        for (s, d, n) in moves(from, to, old, new) {
                            for i in 0..n {
                                // The position in row s + i of the old layout.
                                let p = (from..to)
                                    .find(|&p| slot(p, old) == s + i)
                                    .expect("a held row");
                                assert_eq!(slot(p, new), d + i);
                                assert!(!seen[p - from]);
                                seen[p - from] = true;
                            }
                        }
                        assert!(seen.iter().all(|&s| s), "{from}..{to} {old:?}->{new:?}");
                    }
                }
            }
        }
    }

    /// `RowCache`'s rules (room for the rows held plus a chunk, then the
    /// host cache's trim) on a ring of slots that records which position
    /// each holds: no chunk's write lands on a row still held, and the rows
    /// held are the host cache's, through chunks of every size and rewinds.
    #[test]
    fn a_ring_holds_what_the_host_cache_holds() {
        use crate::model::state::trimmed_start;
        for w in [1, 3, 8, 128] {
            let mut host = KvCache::new(1, Some(w));
            let mut slots: Vec<Option<usize>> = Vec::new();
            let (mut start, mut len, mut most) = (0, 0, 0);
            let mut seed = 7u64;
            for step in 0..400 {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = (seed >> 33) as usize;
                if step % 7 == 6 {
                    // A rewind the host allows (or to 0).
                    let back = if r.is_multiple_of(5) { len } else { r % 3 + 1 };
                    let n = len.saturating_sub(back);
                    if host.can_truncate(n) {
                        host.truncate(n);
                        (start, len) = (if n == 0 { 0 } else { start }, n);
                        // The rows dropped are no longer held.
                        for s in slots.iter_mut().filter(|s| s.is_some_and(|p| p >= n)) {
                            *s = None;
                        }
                    }
                    assert_eq!((start, len), (host.start, host.len()));
                    continue;
                }
                let n = if r.is_multiple_of(4) {
                    1 + r % (3 * w + 5)
                } else {
                    1
                };
                most = most.max(n);
                let end = len + n;
                if let Some(cap) = room(Some(w), start, end, slots.len()) {
                    let mut grown = vec![None; cap];
                    for (from, to, rows) in moves(start, len, Some(slots.len()), Some(cap)) {
                        grown[to..to + rows].copy_from_slice(&slots[from..from + rows]);
                    }
                    slots = grown;
                }
                let ring = Some(slots.len());
                for p in len..end {
                    let s = slot(p, ring);
                    if let Some(old) = slots[s] {
                        assert!(old < start, "window {w}: position {p} overwrote held {old}");
                    }
                    slots[s] = Some(p);
                }
                // What the chunk's first query attends to is there.
                for p in first_needed_of(w, len).max(start)..end {
                    assert_eq!(slots[slot(p, ring)], Some(p), "window {w}: {p} missing");
                }
                len = end;
                start = trimmed_start(Some(w), start, len);
                for _ in 0..n {
                    host.k.push(0.0);
                    host.v.push(0.0);
                }
                host.trim();
                assert_eq!((start, len), (host.start, host.len()), "window {w}");
                assert!(slots.len() <= capacity(w, KvCache::max_held_of(w) + most));
            }
        }
    }

    fn first_needed_of(w: usize, pos: usize) -> usize {
        crate::model::state::first_needed(Some(w), pos)
    }

    #[test]
    fn the_mask_finds_the_slot() {
        assert_eq!(mask(None), -1);
        assert_eq!(mask(Some(16)), 15);
        for p in [0usize, 1, 15, 16, 17, 1000] {
            assert_eq!((p as i64 & mask(Some(16))) as usize, slot(p, Some(16)));
            assert_eq!((p as i64 & mask(None)) as usize, p);
        }
    }
}
