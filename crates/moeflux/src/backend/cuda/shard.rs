//! Which GPU of a multi-GPU group owns each routed expert: every layer's
//! experts dealt out so each GPU holds about the same bytes, and each
//! layer's experts spread over all GPUs (so every GPU has work in every
//! MoE layer).

use std::sync::Arc;

/// The owners of every (layer, expert), and the rank this copy is for.
#[derive(Clone, Debug)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
    /// Per model layer, the owning rank of each expert (empty for layers
    /// without routed experts).
    owner: Arc<Vec<Vec<u16>>>,
}

impl Shard {
    /// Owners for `world` GPUs of the MoE layers `layers` (`(layer,
    /// expert bytes)`), `experts` per layer, of a model of `num_layers`
    /// layers: each expert, in (layer, expert) order, goes to the GPU
    /// holding the fewest bytes so far (the lowest rank on a tie). With
    /// equal expert sizes this deals each layer's experts out in turn, and
    /// the counts of any two GPUs differ by at most one per layer.
    pub fn balanced(
        layers: &[(usize, usize)],
        num_layers: usize,
        experts: usize,
        world: usize,
    ) -> Vec<Shard> {
        let world = world.max(1);
        let mut owner = vec![Vec::new(); num_layers];
        let mut bytes = vec![0u64; world];
        for &(l, extent) in layers {
            owner[l] = (0..experts)
                .map(|_| {
                    let r = (0..world)
                        .min_by_key(|&r| (bytes[r], r))
                        .expect("at least one rank");
                    bytes[r] += extent as u64;
                    r as u16
                })
                .collect();
        }
        let owner = Arc::new(owner);
        (0..world)
            .map(|rank| Shard {
                rank,
                world,
                owner: owner.clone(),
            })
            .collect()
    }

    /// Whether this rank owns expert `e` of `layer`.
    pub fn owns(&self, layer: usize, e: usize) -> bool {
        self.owner
            .get(layer)
            .and_then(|o| o.get(e))
            .is_some_and(|&r| r as usize == self.rank)
    }

    /// 1 for each expert this rank owns, 0 otherwise, [layers x experts]
    /// (rows of layers without routed experts all 0): the device's copy
    /// tells the combine which slots are this GPU's.
    pub fn owned_mask(&self, experts: usize) -> Vec<u8> {
        (0..self.owner.len())
            .flat_map(|l| (0..experts).map(move |e| (l, e)))
            .map(|(l, e)| u8::from(self.owns(l, e)))
            .collect()
    }

    /// The most experts this rank owns in any layer.
    pub fn max_owned_per_layer(&self) -> usize {
        self.owner
            .iter()
            .map(|o| o.iter().filter(|&&r| r as usize == self.rank).count())
            .max()
            .unwrap_or(0)
    }

    /// Experts this rank owns in all layers.
    pub fn owned_total(&self) -> usize {
        self.owner
            .iter()
            .map(|o| o.iter().filter(|&&r| r as usize == self.rank).count())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::Shard;

    #[test]
    fn equal_experts_are_dealt_out_in_turn() {
        let s = Shard::balanced(&[(1, 100), (3, 100)], 4, 5, 2);
        assert_eq!(s.len(), 2);
        // Layer 1: 0 1 0 1 0; layer 3 continues from 3 vs 2 experts.
        let owners = |l| (0..5).map(|e| s[1].owns(l, e) as u8).collect::<Vec<_>>();
        assert_eq!(owners(1), vec![0, 1, 0, 1, 0]);
        assert_eq!(owners(3), vec![1, 0, 1, 0, 1]);
        assert!(!s[0].owns(0, 0) && !s[1].owns(0, 0), "a dense layer");
        assert_eq!(s[0].owned_total() + s[1].owned_total(), 10);
        assert_eq!(s[0].owned_total(), 5);
        assert_eq!(s[0].max_owned_per_layer(), 3);
        // The device's mask: [layers x experts], dense layers all 0.
        assert_eq!(
            s[1].owned_mask(5),
            [[0; 5], [0, 1, 0, 1, 0], [0; 5], [1, 0, 1, 0, 1]].concat()
        );
    }

    #[test]
    fn bytes_balance_across_layers_of_different_sizes() {
        // One layer of 4 large experts, one of 4 small ones, 3 GPUs.
        let s = Shard::balanced(&[(0, 300), (1, 100)], 2, 4, 3);
        let bytes = |r: usize| -> u64 {
            (0..4).filter(|&e| s[r].owns(0, e)).count() as u64 * 300
                + (0..4).filter(|&e| s[r].owns(1, e)).count() as u64 * 100
        };
        let b: Vec<u64> = (0..3).map(bytes).collect();
        assert_eq!(b.iter().sum::<u64>(), 1600);
        assert!(
            b.iter().max().unwrap() - b.iter().min().unwrap() <= 300,
            "{b:?}"
        );
        for l in 0..2 {
            for e in 0..4 {
                assert_eq!((0..3).filter(|&r| s[r].owns(l, e)).count(), 1);
            }
        }
    }

    #[test]
    fn one_gpu_owns_everything() {
        let s = Shard::balanced(&[(0, 10)], 1, 8, 1);
        assert!((0..8).all(|e| s[0].owns(0, e)));
    }
}
