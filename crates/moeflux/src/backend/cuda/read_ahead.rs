//! Reads of the next MoE layer's predicted experts from the expert files,
//! started while the current layer's own misses are being read (no host
//! tier, `--prefetch`). A decode step's layers are serial (a layer's router
//! needs the previous layer's output), so without them each layer pays the
//! disk's latency once more; issued a layer early, the guesses that come
//! true are in pinned staging buffers by the time their layer asks, and the
//! disk has more requests in flight. The VRAM cache (`experts.rs`) decides
//! what to read and where the bytes go; this holds the reads in flight.

use crate::io::{ExpertBuf, ExpertStore, Fetch};

use super::device::Pinned;
use super::experts::Staged;

/// Experts of one layer being read into staging buffers.
pub(super) struct ReadAhead {
    pub layer: usize,
    ids: Vec<usize>,
    fetch: Fetch,
    /// The registrations of the buffers the reads hold, by position in `ids`.
    pins: Vec<Option<Pinned>>,
}

impl ReadAhead {
    /// Starts reading experts `ids` of `layer` (not mapped), one staging
    /// buffer each. `None` when the store refuses the request (a guess
    /// that cannot be read is dropped: the layer's own read reports it).
    pub fn start(
        store: &ExpertStore,
        layer: usize,
        ids: Vec<usize>,
        staged: Vec<Staged>,
    ) -> Option<ReadAhead> {
        debug_assert_eq!(ids.len(), staged.len());
        let (pins, bufs): (Vec<Pinned>, Vec<ExpertBuf>) =
            staged.into_iter().map(|s| (s.pin, s.buf)).unzip();
        let fetch = store.fetch(layer, &ids, bufs).ok()?;
        Some(ReadAhead {
            layer,
            ids,
            fetch,
            pins: pins.into_iter().map(Some).collect(),
        })
    }

    /// Waits for every read; `land(expert, bytes)` for each that landed in
    /// full (a failed read is dropped). Returns the staging buffers, which
    /// must not be reused before whatever `land` queued from them is done.
    pub fn finish(mut self, mut land: impl FnMut(usize, &[u8])) -> Vec<Staged> {
        let mut back = Vec::with_capacity(self.ids.len());
        while let Some(l) = self.fetch.next_landed() {
            let pin = self.pins[l.index].take();
            if let Some(buf) = l.buf {
                if l.result.is_ok() {
                    land(self.ids[l.index], buf.as_bytes());
                }
                if let Some(pin) = pin {
                    back.push(Staged { pin, buf });
                }
            }
        }
        back
    }
}
