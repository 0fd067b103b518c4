//! Routed experts held in RAM with their 4-bit projections (MXFP4, or MLX
//! affine in groups of a multiple of 64) interleaved by eight rows
//! ([`crate::quant::interleave`]), made once at load.
//! The 8-bit-activation product streams that layout at about 1.6x the rate
//! of the row-major files (one sequential stream per eight rows instead of
//! eight short ones; `examples/stream_rate.rs`), and gives the same bits.
//! It costs the experts' bytes in anonymous memory, which, unlike the page
//! cache, the kernel cannot drop: so it is made only when asked, or (the
//! default) when the experts fit in available memory with room to spare,
//! the activations are 8-bit, and the experts are not read with O_DIRECT.

use std::time::Instant;

use rayon::prelude::*;

use crate::backend::cpu::qmatmul::Activations;
use crate::error::{Error, Result};
use crate::io::{procfs, ExpertBuf, ExpertStore};
use crate::model::moe::MoeBlock;
use crate::model::Model;

/// When a CPU session interleaves 4-bit experts into RAM at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Repack {
    /// With 8-bit activations, without O_DIRECT, and when the experts fit
    /// in available memory less [`RESERVE_BYTES`].
    #[default]
    Auto,
    /// Whenever the model has experts that interleave (an error if one of
    /// them does not).
    On,
    Off,
}

impl Repack {
    pub fn parse(s: &str) -> Option<Repack> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Repack::Auto),
            "on" => Some(Repack::On),
            "off" => Some(Repack::Off),
            _ => None,
        }
    }
}

/// Memory `Repack::Auto` leaves free for everything else.
pub const RESERVE_BYTES: u64 = 2 << 30;

/// Experts read at once while repacking.
const BATCH: usize = 8;

/// One layer's experts, interleaved, one extent after another.
struct Layer {
    mem: memmap2::MmapMut,
    extent: usize,
    num_experts: usize,
}

/// The interleaved experts of every MoE layer whose layout interleaves.
pub struct RepackedExperts {
    layers: Vec<Option<Layer>>,
    bytes: u64,
    seconds: f64,
}

impl RepackedExperts {
    /// Bytes of the experts that interleave (what repacking holds).
    fn interleavable_bytes(model: &Model, store: &ExpertStore) -> u64 {
        interleavable_blocks(model)
            .filter_map(|b| {
                let l = b.layer;
                store
                    .num_experts(l)
                    .map(|n| (n * store.extent_bytes(l)) as u64)
            })
            .sum()
    }

    /// Repacks per `policy`; `None` when there is nothing to do or `Auto`
    /// decides against it.
    pub fn make(
        policy: Repack,
        activations: Activations,
        direct_io: bool,
        model: &Model,
        store: &ExpertStore,
    ) -> Result<Option<RepackedExperts>> {
        let bytes = Self::interleavable_bytes(model, store);
        let go = match policy {
            Repack::Off => false,
            Repack::On => true,
            Repack::Auto => {
                activations == Activations::Q8
                    && !direct_io
                    && procfs::mem_available_bytes()
                        .is_some_and(|avail| bytes.saturating_add(RESERVE_BYTES) <= avail)
            }
        };
        if !go || bytes == 0 {
            return Ok(None);
        }
        match Self::build(model, store)? {
            Ok(r) => Ok(Some(r)),
            // `auto` streams what does not interleave; `on` was a request.
            Err(_) if policy == Repack::Auto => Ok(None),
            Err(why) => Err(Error::Invalid(format!("--cpu-repack on: {why}"))),
        }
    }

    /// Reads every interleavable layer's experts and interleaves them into
    /// anonymous memory; the inner error says which expert does not
    /// interleave and why.
    pub fn build(
        model: &Model,
        store: &ExpertStore,
    ) -> Result<std::result::Result<RepackedExperts, String>> {
        let start = Instant::now();
        let mut layers: Vec<Option<Layer>> = Vec::new();
        let mut total = 0u64;
        for b in interleavable_blocks(model) {
            let l = b.layer;
            let num_experts = store
                .num_experts(l)
                .ok_or_else(|| Error::Invalid(format!("layer {l}: no expert file in the store")))?;
            let extent = store.extent_bytes(l);
            let len = num_experts * extent;
            let mut mem = memmap2::MmapOptions::new()
                .len(len)
                .map_anon()
                .map_err(|e| {
                    Error::Invalid(format!(
                        "cannot allocate {len} bytes for the interleaved experts of layer {l}: {e}"
                    ))
                })?;
            // Fewer TLB misses on a stream of gigabytes; the advice is only
            // a hint (an error changes nothing).
            #[cfg(target_os = "linux")]
            let _ = mem.advise(memmap2::Advice::HugePage);
            let mut bufs: Vec<ExpertBuf> = (0..BATCH).map(|_| ExpertBuf::new(extent)).collect();
            for first in (0..num_experts).step_by(BATCH) {
                let ids: Vec<usize> = (first..(first + BATCH).min(num_experts)).collect();
                store.read_experts(l, &ids, &mut bufs[..ids.len()])?;
                let dst = &mut mem[first * extent..(first + ids.len()) * extent];
                let done = dst
                    .par_chunks_mut(extent)
                    .zip(&bufs[..ids.len()])
                    .zip(&ids)
                    .try_for_each(|((dst, buf), &e)| {
                        b.experts
                            .interleave_extent(&buf.as_bytes()[..extent], dst)
                            .map_err(|why| {
                                format!("expert {e} of layer {l} does not interleave: {why}")
                            })
                    });
                if let Err(why) = done {
                    return Ok(Err(why));
                }
            }
            if layers.len() <= l {
                layers.resize_with(l + 1, || None);
            }
            layers[l] = Some(Layer {
                mem,
                extent,
                num_experts,
            });
            total += len as u64;
        }
        // The files' pages are not read again: let the page cache go.
        store.evict_page_cache()?;
        Ok(Ok(RepackedExperts {
            layers,
            bytes: total,
            seconds: start.elapsed().as_secs_f64(),
        }))
    }

    /// Whether `layer`'s experts are here.
    pub fn has(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(Option::is_some)
    }

    /// Expert `e` of `layer` (its extent), interleaved.
    pub fn expert(&self, layer: usize, e: usize) -> Option<&[u8]> {
        let l = self.layers.get(layer)?.as_ref()?;
        (e < l.num_experts).then(|| &l.mem[e * l.extent..(e + 1) * l.extent])
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Seconds the repacking took.
    pub fn seconds(&self) -> f64 {
        self.seconds
    }
}

/// MoE blocks whose routed experts' layout interleaves (4-bit codes in
/// the shapes [`crate::quant::interleave`] takes).
fn interleavable_blocks(model: &Model) -> impl Iterator<Item = &MoeBlock> {
    model
        .layers
        .iter()
        .filter_map(|l| l.mlp.moe())
        .filter(|b| b.experts.interleave_refusal().is_none())
}
