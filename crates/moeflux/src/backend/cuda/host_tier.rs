//! The host tier (`--host-cache`) between the VRAM expert cache and the
//! expert files. Two shapes:
//! * **layers**: when the budget holds every mapped expert file, the
//!   mappings themselves are pinned and VRAM misses are copied straight
//!   from them (nothing is ever read twice);
//! * **arena**: otherwise, a fixed number of pinned expert-sized slots with
//!   the VRAM cache's replacement policy ([`Slots`]): a VRAM miss found
//!   here is copied from its slot, else it is read from the files into a
//!   victim slot and copied from there. So a tier smaller than the model
//!   keeps its most used experts in pinned RAM.
//!
//! The GPUs of a group share one tier. A slot's buffer is *checked out*
//! (taken from the arena) while a GPU reads into it or copies from it, so
//! another GPU never picks it as a victim; a filled slot is entered in the
//! index only when its read succeeded (`check_in`), so a failed or short
//! read never leaves a slot that claims an expert it does not hold.
//! Bookkeeping only here, generic over the pin, so it is tested without a
//! GPU; the copies are in `experts.rs`.

use crate::error::{Error, Result};
use crate::io::{ExpertBuf, ExpertStore};

use super::device::Pinned;
use super::slots::{CachePolicy, Key, Slots};

/// The expert-granular tier: slots of pinned host memory.
pub struct Arena<P> {
    slots: Slots,
    /// Each slot's registration and buffer; `None` while checked out.
    bufs: Vec<Option<(P, ExpertBuf)>>,
}

/// A slot checked out for one expert.
pub enum Claim<P> {
    /// Slot `slot` holds the expert: copy from `buf`.
    Hit { slot: usize, pin: P, buf: ExpertBuf },
    /// Slot `slot` was emptied for the expert: read it into `buf`.
    Fill { slot: usize, pin: P, buf: ExpertBuf },
    /// No slot can take it now (the expert, or every slot, is checked out
    /// by someone else): read it elsewhere.
    Bypass,
}

impl<P> Claim<P> {
    /// The buffer to copy from or read into, if any.
    pub fn buf(&self) -> Option<&ExpertBuf> {
        match self {
            Claim::Hit { buf, .. } | Claim::Fill { buf, .. } => Some(buf),
            Claim::Bypass => None,
        }
    }
}

impl<P> Arena<P> {
    /// `n` slots of the given buffers (their pins made by `pin`).
    pub fn new(
        n: usize,
        extent: usize,
        policy: CachePolicy,
        mut pin: impl FnMut(&mut ExpertBuf) -> Result<P>,
    ) -> Result<Arena<P>> {
        let bufs = (0..n)
            .map(|_| {
                let mut buf = ExpertBuf::new(extent);
                Ok(Some((pin(&mut buf)?, buf)))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Arena {
            slots: Slots::new(n, policy),
            bufs,
        })
    }

    pub fn len(&self) -> usize {
        self.bufs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }

    /// Whether `key` is held and not checked out.
    pub fn holds(&self, key: Key) -> bool {
        self.slots.get(key).is_some_and(|s| self.bufs[s].is_some())
    }

    /// Slots holding an expert.
    pub fn occupied(&self) -> usize {
        self.slots.occupied()
    }

    /// One claim per key (keys distinct): a hit counts as a use; with
    /// `fill`, a key not held takes a victim slot, else it is `Bypass`.
    pub fn check_out(&mut self, keys: &[Key], fill: bool) -> Vec<Claim<P>> {
        keys.iter()
            .map(|&key| match self.slots.get(key) {
                Some(slot) => match self.bufs[slot].take() {
                    Some((pin, buf)) => {
                        self.slots.touch(slot);
                        Claim::Hit { slot, pin, buf }
                    }
                    None => Claim::Bypass,
                },
                None if fill => {
                    let bufs = &self.bufs;
                    match self.slots.take_victim(|s| bufs[s].is_none()) {
                        Some(slot) => {
                            let (pin, buf) =
                                self.bufs[slot].take().expect("a victim is checked in");
                            Claim::Fill { slot, pin, buf }
                        }
                        None => Claim::Bypass,
                    }
                }
                None => Claim::Bypass,
            })
            .collect()
    }

    /// Returns a claim for `key`; a `Fill` becomes the slot of `key` only
    /// if `filled` (its read succeeded and nobody filled `key` meanwhile),
    /// else the slot is left empty.
    pub fn check_in(&mut self, key: Key, claim: Claim<P>, filled: bool) {
        match claim {
            Claim::Hit { slot, pin, buf } => self.bufs[slot] = Some((pin, buf)),
            Claim::Fill { slot, pin, buf } => {
                self.bufs[slot] = Some((pin, buf));
                if filled && self.slots.get(key).is_none() {
                    self.slots.assign(slot, key);
                } else {
                    self.slots.release_empty(slot);
                }
            }
            Claim::Bypass => {}
        }
    }
}

/// The pinned expert-sized slots of an arena tier.
pub type PinnedArena = Arena<Pinned>;

/// Where [`serve`] got an expert from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Its slot in the arena.
    Host,
    /// The expert file, read into a slot that now holds it.
    File,
    /// Nowhere: no slot could take it (see [`Claim::Bypass`]); the caller
    /// reads it some other way.
    Bypass,
    /// Its read failed (the error is [`Served::error`]).
    Failed,
}

/// What [`serve`] did.
pub struct Served {
    pub from: Vec<Source>,
    /// The first failed read's error (it names the file).
    pub error: Option<crate::error::Error>,
}

/// Brings experts `ids` (distinct) of `layer` through the arena: each held
/// one is handed to `copy(i, buf)` at once, each missing one is read from
/// the files into a victim slot and handed over as it lands. After `wait`
/// (every copy finished with the buffers) the slots are checked back in,
/// a filled one valid only when its read and copy succeeded. The lock is
/// not held during reads or copies.
pub fn serve<P>(
    arena: &std::sync::Mutex<Arena<P>>,
    store: &ExpertStore,
    layer: usize,
    ids: &[usize],
    mut copy: impl FnMut(usize, &ExpertBuf) -> Result<()>,
    wait: impl FnOnce() -> Result<()>,
) -> Result<Served> {
    let lock = || arena.lock().unwrap_or_else(|p| p.into_inner());
    let keys: Vec<Key> = ids.iter().map(|&e| (layer, e)).collect();
    let claims = lock().check_out(&keys, true);
    let mut from: Vec<Source> = claims
        .iter()
        .map(|c| match c {
            Claim::Hit { .. } => Source::Host,
            Claim::Fill { .. } => Source::File,
            Claim::Bypass => Source::Bypass,
        })
        .collect();
    let mut error = None;
    let mut fail = |i: usize, e, from: &mut Vec<Source>| {
        from[i] = Source::Failed;
        error.get_or_insert(e);
    };
    for (i, c) in claims.iter().enumerate() {
        if let Claim::Hit { buf, .. } = c {
            if let Err(e) = copy(i, buf) {
                fail(i, e, &mut from);
            }
        }
    }
    // The fills' buffers go to the reads and come back in order.
    let fills: Vec<usize> = (0..ids.len())
        .filter(|&i| from[i] == Source::File)
        .collect();
    let mut claims: Vec<Option<Claim<P>>> = claims.into_iter().map(Some).collect();
    let mut pins = Vec::with_capacity(fills.len());
    let mut bufs = Vec::with_capacity(fills.len());
    for &i in &fills {
        let Some(Claim::Fill { slot, pin, buf }) = claims[i].take() else {
            unreachable!("fills are Fill claims")
        };
        pins.push((slot, pin));
        bufs.push(buf);
    }
    let fill_ids: Vec<usize> = fills.iter().map(|&i| ids[i]).collect();
    let read = read_into(store, layer, &fill_ids, bufs, |j, buf| copy(fills[j], buf));
    // Wait for the copies before any buffer goes back.
    let waited = wait();
    match read {
        Ok((bufs, results)) => {
            for ((&i, (slot, pin)), (buf, r)) in
                fills.iter().zip(pins).zip(bufs.into_iter().zip(results))
            {
                if let Err(e) = r {
                    fail(i, e, &mut from);
                }
                claims[i] = Some(Claim::Fill { slot, pin, buf });
            }
        }
        Err(e) => {
            // The request failed as a whole (its buffers are gone with it:
            // those slots stay checked out, never valid).
            for &i in &fills {
                from[i] = Source::Failed;
            }
            error.get_or_insert(e);
        }
    }
    let mut a = lock();
    for (i, c) in claims.into_iter().enumerate() {
        if let Some(c) = c {
            let ok = waited.is_ok() && from[i] != Source::Failed;
            a.check_in(keys[i], c, ok);
        }
    }
    drop(a);
    waited?;
    Ok(Served { from, error })
}

/// Reads experts `ids` of `layer` into `bufs` (one each, at least
/// `extent_bytes(layer)` long): from the mapping for a mapped layer (after
/// the store made its pages resident), else with the store's reads.
/// `landed(i, buf)` runs as expert `i` lands, so its upload can start while
/// the rest are in flight. Returns the buffers in order and each read's
/// result (a failed `landed` counts as failed); `Err` only for an invalid
/// request, whose buffers are then lost.
fn read_into(
    store: &ExpertStore,
    layer: usize,
    ids: &[usize],
    bufs: Vec<ExpertBuf>,
    mut landed: impl FnMut(usize, &ExpertBuf) -> Result<()>,
) -> Result<(Vec<ExpertBuf>, Vec<Result<()>>)> {
    if ids.is_empty() {
        return Ok((bufs, Vec::new()));
    }
    let extent = store.extent_bytes(layer);
    let mapped = store.is_mapped(layer) == Some(true);
    let mut out: Vec<Option<ExpertBuf>> = Vec::with_capacity(ids.len());
    let mut results: Vec<Result<()>> = (0..ids.len()).map(|_| Ok(())).collect();
    let mut fetch = if mapped {
        match store.fetch(layer, ids, Vec::new()) {
            Ok(f) => {
                out.extend(bufs.into_iter().map(Some));
                f
            }
            // (A file that shrank.) The buffers were not lent: back empty.
            Err(e) => {
                results[0] = Err(e);
                for r in &mut results[1..] {
                    *r = Err(Error::Invalid(format!(
                        "experts of layer {layer} not read: the request failed"
                    )));
                }
                return Ok((bufs, results));
            }
        }
    } else {
        // Valid by construction (ids from the router, one buffer each).
        out.resize_with(ids.len(), || None);
        store.fetch(layer, ids, bufs)?
    };
    while let Some(l) = fetch.next_landed() {
        if let Some(buf) = l.buf {
            out[l.index] = Some(buf);
        }
        let buf = out[l.index].as_mut().expect("every buffer comes back");
        let r = l.result.and_then(|()| {
            if mapped {
                let src = store
                    .mapped(layer, ids[l.index])
                    .expect("a mapped layer serves its extents");
                buf.as_bytes_mut()[..extent].copy_from_slice(src);
            }
            landed(l.index, buf)
        });
        results[l.index] = r;
    }
    let bufs = out
        .into_iter()
        .map(|b| b.expect("every fetched expert lands"))
        .collect();
    Ok((bufs, results))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(n: usize) -> Arena<()> {
        Arena::new(n, 4096, CachePolicy::LfuDa, |_| Ok(())).unwrap()
    }

    fn fill(a: &mut Arena<()>, key: Key, ok: bool) -> Option<usize> {
        match a.check_out(&[key], true).pop().unwrap() {
            c @ Claim::Fill { slot, .. } => {
                a.check_in(key, c, ok);
                Some(slot)
            }
            c => {
                a.check_in(key, c, ok);
                None
            }
        }
    }

    #[test]
    fn a_miss_fills_a_slot_and_then_hits() {
        let mut a = arena(2);
        assert!(fill(&mut a, (0, 1), true).is_some());
        assert!(a.holds((0, 1)));
        let c = a.check_out(&[(0, 1)], true);
        assert!(matches!(c[0], Claim::Hit { .. }));
        a.check_in((0, 1), c.into_iter().next().unwrap(), true);
        assert_eq!(a.occupied(), 1);
    }

    #[test]
    fn a_failed_fill_leaves_the_slot_empty_not_valid() {
        let mut a = arena(1);
        fill(&mut a, (0, 0), true);
        // The victim was (0, 0); the read of (0, 5) failed.
        assert!(fill(&mut a, (0, 5), false).is_some());
        assert!(!a.holds((0, 5)) && !a.holds((0, 0)));
        assert_eq!(a.occupied(), 0);
        // The slot is free for the next expert.
        assert!(fill(&mut a, (0, 6), true).is_some());
        assert!(a.holds((0, 6)));
    }

    #[test]
    fn checked_out_slots_are_neither_victims_nor_hits() {
        let mut a = arena(2);
        fill(&mut a, (0, 0), true);
        fill(&mut a, (0, 1), true);
        // A GPU copies from (0, 0) and fills a slot for (1, 0).
        let held = a.check_out(&[(0, 0), (1, 0)], true);
        assert!(matches!(held[0], Claim::Hit { .. }));
        let Claim::Fill { slot, .. } = held[1] else {
            panic!("a victim for (1, 0)")
        };
        // Its victim was (0, 1), the one not checked out.
        assert_eq!(a.slots.get((0, 1)), None);
        let _ = slot;
        // Another GPU meanwhile: (0, 0) is out, and no slot is left to fill.
        let other = a.check_out(&[(0, 0), (2, 0)], true);
        assert!(other.iter().all(|c| matches!(c, Claim::Bypass)));
        for (k, c) in [(0, 0), (2, 0)].into_iter().zip(other) {
            a.check_in(k, c, true);
        }
        for (k, c) in [(0, 0), (1, 0)].into_iter().zip(held) {
            a.check_in(k, c, true);
        }
        assert!(a.holds((0, 0)) && a.holds((1, 0)) && !a.holds((0, 1)));
    }

    #[test]
    fn two_fills_of_one_expert_keep_one_slot() {
        let mut a = arena(3);
        let first = a.check_out(&[(4, 4)], true);
        let second = a.check_out(&[(4, 4)], true);
        for c in first.into_iter().chain(second) {
            assert!(matches!(c, Claim::Fill { .. }));
            a.check_in((4, 4), c, true);
        }
        assert_eq!(a.occupied(), 1);
        // The other slot went back empty: two more experts fit unevicted.
        fill(&mut a, (5, 0), true);
        fill(&mut a, (5, 1), true);
        assert!(a.holds((4, 4)) && a.holds((5, 0)) && a.holds((5, 1)));
    }

    /// `serve` on the io tests' expert files (layer 1: 6 experts), mapped
    /// and read: misses land in slots and hit next time; then, the file
    /// emptied under the store, a miss fails naming the file and its slot
    /// is left empty while the hit is still served.
    #[test]
    fn serve_fills_then_hits_and_a_truncated_file_leaves_no_slot_valid() {
        use crate::io::tests::{check_expert, fixture};
        use crate::io::ExpertStoreOptions;
        use std::sync::Mutex;
        for mmap in [true, false] {
            let (dir, m) = fixture();
            let opts = ExpertStoreOptions {
                mmap,
                ..Default::default()
            };
            let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
            let arena = Mutex::new(Arena::new(3, 16384, CachePolicy::LfuDa, |_| Ok(())).unwrap());
            let run = |ids: &[usize]| {
                let mut copied = Vec::new();
                let served = serve(
                    &arena,
                    &store,
                    1,
                    ids,
                    |i, buf| {
                        check_expert(&m, 1, ids[i], buf);
                        copied.push(i);
                        Ok(())
                    },
                    || Ok(()),
                )
                .unwrap();
                (served, copied)
            };
            let (s, mut copied) = run(&[0, 2, 5]);
            assert!(s.error.is_none());
            assert_eq!(s.from, [Source::File; 3]);
            copied.sort();
            assert_eq!(copied, [0, 1, 2]);
            // 2 and 5 hit; 3 evicts 0 (used once, as they were until now).
            let (s, _) = run(&[2, 5, 3]);
            assert_eq!(s.from, [Source::Host, Source::Host, Source::File]);
            let held = |e| arena.lock().unwrap().holds((1, e));
            assert!(held(2) && held(5) && held(3) && !held(0));
            let path = dir.path().join(crate::format::expert_file_name(1));
            std::fs::OpenOptions::new()
                .write(true)
                .open(&path)
                .unwrap()
                .set_len(0)
                .unwrap();
            let (s, copied) = run(&[2, 4]);
            let msg = s
                .error
                .expect("a read of an emptied file fails")
                .to_string();
            assert!(
                msg.contains(&path.display().to_string()),
                "mmap {mmap}: {msg}"
            );
            assert_eq!(s.from, [Source::Host, Source::Failed]);
            assert_eq!(copied, [0]);
            assert!(held(2) && !held(4));
            assert_eq!(arena.lock().unwrap().occupied(), 2, "mmap {mmap}");
        }
    }

    #[test]
    fn without_fill_a_miss_is_bypassed_and_takes_nothing() {
        let mut a = arena(1);
        let c = a.check_out(&[(0, 0)], false);
        assert!(matches!(c[0], Claim::Bypass));
        assert_eq!(a.occupied(), 0);
    }
}
