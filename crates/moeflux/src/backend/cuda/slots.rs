//! Which expert each slot of a fixed-size cache holds, and which slot to
//! overwrite next: the replacement policy shared by the VRAM expert cache
//! (`experts.rs`) and the pinned host tier (`host_tier.rs`). No memory
//! here, only bookkeeping, so it is tested without a GPU.
//!
//! Replacement is LFU with dynamic aging (LFU-DA) by default: a slot's
//! priority is the priority of the last evicted slot plus the number of
//! times its expert was used since it came in, so experts that are popular
//! stay while the aging floor lets a once-popular expert leave eventually.
//! LRU is there to compare against (`CachePolicy::Lru`).

use std::collections::{BTreeSet, HashMap};

/// An expert: (model layer, expert index).
pub type Key = (usize, usize);

/// How a cache picks the slot to overwrite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Least frequently used with dynamic aging.
    #[default]
    LfuDa,
    /// Least recently used.
    Lru,
}

impl CachePolicy {
    pub fn parse(s: &str) -> Option<CachePolicy> {
        match s {
            "lfu" | "lfu-da" => Some(CachePolicy::LfuDa),
            "lru" => Some(CachePolicy::Lru),
            _ => None,
        }
    }
}

/// The owners and priorities of `n` slots.
#[derive(Debug)]
pub struct Slots {
    owner: Vec<Option<Key>>,
    index: HashMap<Key, usize>,
    policy: CachePolicy,
    prio: Vec<u64>,
    uses: Vec<u64>,
    /// Occupied slots by (priority, slot): the first is the next victim.
    order: BTreeSet<(u64, usize)>,
    /// Slots holding nothing.
    free: Vec<usize>,
    floor: u64,
    clock: u64,
}

impl Slots {
    pub fn new(n: usize, policy: CachePolicy) -> Slots {
        Slots {
            owner: vec![None; n],
            index: HashMap::new(),
            policy,
            prio: vec![0; n],
            uses: vec![0; n],
            order: BTreeSet::new(),
            free: (0..n).rev().collect(),
            floor: 0,
            clock: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.owner.len()
    }

    /// The slot holding `key`.
    pub fn get(&self, key: Key) -> Option<usize> {
        self.index.get(&key).copied()
    }

    /// Counts a use of occupied slot `s` and updates its priority.
    pub fn touch(&mut self, s: usize) {
        self.order.remove(&(self.prio[s], s));
        self.clock += 1;
        self.uses[s] += 1;
        self.prio[s] = match self.policy {
            CachePolicy::LfuDa => self.floor + self.uses[s],
            CachePolicy::Lru => self.clock,
        };
        self.order.insert((self.prio[s], s));
    }

    /// A slot to overwrite: an empty one, else the lowest priority one for
    /// which `busy` is false; it is left empty. `None` when every occupied
    /// slot is busy and none is empty.
    pub fn take_victim(&mut self, busy: impl Fn(usize) -> bool) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let &(p, s) = self.order.iter().find(|(_, s)| !busy(*s))?;
        self.order.remove(&(p, s));
        if let Some(old) = self.owner[s].take() {
            self.index.remove(&old);
        }
        if self.policy == CachePolicy::LfuDa {
            self.floor = p;
        }
        Some(s)
    }

    /// Makes empty slot `s` (from `take_victim`) hold `key`, used once.
    pub fn assign(&mut self, s: usize, key: Key) {
        debug_assert!(self.owner[s].is_none());
        self.uses[s] = 0;
        self.owner[s] = Some(key);
        self.index.insert(key, s);
        self.touch(s);
    }

    /// Forgets what slot `s` holds (if anything) and makes it free.
    pub fn invalidate(&mut self, s: usize) {
        if let Some(k) = self.owner[s].take() {
            self.index.remove(&k);
            self.order.remove(&(self.prio[s], s));
            self.free.push(s);
        }
    }

    /// Returns an empty slot from `take_victim` unused.
    pub fn release_empty(&mut self, s: usize) {
        debug_assert!(self.owner[s].is_none());
        if !self.free.contains(&s) {
            self.free.push(s);
        }
    }

    /// Slots holding an expert.
    pub fn occupied(&self) -> usize {
        self.index.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lfu_keeps_the_popular_expert_and_lru_the_recent_one() {
        for (policy, kept) in [(CachePolicy::LfuDa, (0, 0)), (CachePolicy::Lru, (0, 1))] {
            let mut s = Slots::new(2, policy);
            let a = s.take_victim(|_| false).unwrap();
            s.assign(a, (0, 0));
            for _ in 0..5 {
                s.touch(a);
            }
            let b = s.take_victim(|_| false).unwrap();
            s.assign(b, (0, 1));
            // A third expert evicts one of the two.
            let v = s.take_victim(|_| false).unwrap();
            s.assign(v, (0, 2));
            assert!(s.get(kept).is_some(), "{policy:?}");
            assert_eq!(s.occupied(), 2);
        }
    }

    #[test]
    fn busy_slots_are_never_victims_and_all_busy_gives_none() {
        let mut s = Slots::new(3, CachePolicy::LfuDa);
        for e in 0..3 {
            let v = s.take_victim(|_| false).unwrap();
            s.assign(v, (1, e));
        }
        let keep = s.get((1, 0)).unwrap();
        for _ in 0..10 {
            let v = s.take_victim(|x| x == keep).unwrap();
            assert_ne!(v, keep);
            s.assign(v, (2, v));
        }
        assert_eq!(s.get((1, 0)), Some(keep));
        assert_eq!(s.take_victim(|_| true), None);
    }

    #[test]
    fn invalidated_and_released_slots_come_back_empty() {
        let mut s = Slots::new(2, CachePolicy::Lru);
        let a = s.take_victim(|_| false).unwrap();
        s.assign(a, (0, 7));
        s.invalidate(a);
        assert_eq!(s.get((0, 7)), None);
        assert_eq!(s.occupied(), 0);
        let b = s.take_victim(|_| false).unwrap();
        s.release_empty(b);
        // Both slots free again: two takes without an eviction.
        let x = s.take_victim(|_| true).unwrap();
        let y = s.take_victim(|_| true).unwrap();
        assert_ne!(x, y);
        assert_eq!(s.take_victim(|_| true), None);
    }
}
