//! One model on one or several GPUs of this process (`--gpus`). Each GPU is
//! a [`CudaModel`] holding the whole dense model and its own copy of every
//! sequence's state; the routed experts are sharded (`shard.rs`): each GPU
//! caches, uploads and computes only its own, and each MoE layer's partial
//! outputs are summed by one NCCL all-reduce (`moe.rs`), so every GPU ends
//! the layer with the same residual stream and the next layer's routers
//! agree. A step runs on one host thread per GPU; the logits and snapshots
//! are the first GPU's (the lead), and the host samples once for all.

use crate::error::{Error, Result};
use crate::io::ExpertStore;
use crate::model::forward::{Segment, SegmentOutput};
use crate::model::state::{ModelState, RewindState};
use crate::model::timing::PhaseTimes;
use crate::model::trace::Trace;
use crate::model::Model;

use super::device::Gpu;
use super::experts::{CacheStats, HostTierInfo};
use super::model::{CudaModel, CudaOptions, Ep, GpuSegment, GroupShared};
use super::nccl::{self, Aborter, Comm, UniqueId};
use super::rendezvous::{self, DistInit};
use super::shard::Shard;
use super::state::GpuState;
use super::support;
use super::watchdog::{Watchdog, PEER_GRACE};

/// The GPUs a session runs on.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum GpuSelection {
    /// GPU 0.
    #[default]
    First,
    /// These GPUs, by CUDA ordinal (distinct, in the order given; the first
    /// is the lead).
    List(Vec<usize>),
    /// Every GPU of the host.
    All,
}

impl GpuSelection {
    /// `all`, or a comma-separated list of distinct GPU ordinals (`0,1`).
    pub fn parse(s: &str) -> std::result::Result<GpuSelection, String> {
        let s = s.trim();
        if s == "all" {
            return Ok(GpuSelection::All);
        }
        let mut list = Vec::new();
        for part in s.split(',') {
            let p = part.trim();
            let n: usize = p.parse().map_err(|_| {
                format!("`{p}` is not a GPU number (give `all` or numbers such as `0,1`)")
            })?;
            if list.contains(&n) {
                return Err(format!("GPU {n} is listed twice"));
            }
            list.push(n);
        }
        Ok(GpuSelection::List(list))
    }

    /// Whether it asks for anything but the default single GPU 0.
    pub fn is_explicit(&self) -> bool {
        *self != GpuSelection::First
    }

    /// The CUDA ordinals, checked against the GPUs the driver sees.
    pub fn ordinals(&self) -> Result<Vec<usize>> {
        match self {
            GpuSelection::First => Ok(vec![0]),
            GpuSelection::All => {
                let n = super::device::device_count()?;
                if n == 0 {
                    return Err(Error::Gpu("CUDA is available but there is no GPU".into()));
                }
                Ok((0..n).collect())
            }
            GpuSelection::List(l) => Ok(l.clone()),
        }
    }
}

impl std::fmt::Display for GpuSelection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuSelection::First => f.write_str("0"),
            GpuSelection::All => f.write_str("all"),
            GpuSelection::List(l) => {
                let s: Vec<String> = l.iter().map(|n| n.to_string()).collect();
                f.write_str(&s.join(","))
            }
        }
    }
}

/// The GPUs of a selection opened, each checked (a missing one is an error
/// naming it), before anything is uploaded. Several GPUs must be of one
/// compute capability, so their kernels, and so their routers, agree.
pub fn open_gpus(sel: &GpuSelection) -> Result<Vec<Gpu>> {
    let named = |e: Error| match e {
        Error::Gpu(m) if sel.is_explicit() => Error::Gpu(format!("--gpus {sel}: {m}")),
        e => e,
    };
    let ordinals = sel.ordinals().map_err(named)?;
    let gpus = ordinals
        .iter()
        .map(|&o| Gpu::open_ordinal(o))
        .collect::<Result<Vec<_>>>()
        .map_err(named)?;
    if let Some(odd) = gpus.iter().find(|g| g.info.cc != gpus[0].info.cc) {
        return Err(named(Error::Gpu(format!(
            "{} and {} differ in compute capability; a group takes GPUs of one kind",
            gpus[0].info, odd.info
        ))));
    }
    if gpus.len() > 1 {
        nccl::version().map_err(named)?;
    }
    Ok(gpus)
}

/// The model on its GPUs (one, or an expert-parallel group).
pub struct CudaGroup {
    ranks: Vec<CudaModel>,
    aborters: Vec<Aborter>,
    /// Why the group stopped (a GPU failed mid-step): it evaluates no more.
    broken: Option<String>,
    /// In a group of processes: rank 0's seed, the same in every process.
    shared_seed: Option<u64>,
    /// In a group of processes: notices a peer that is gone.
    watchdog: Option<Watchdog>,
    /// In a group of GPUs of this process: threads that drive the GPUs
    /// after the first (which the caller's thread drives), kept for the
    /// session: a thread started per step, with the CUDA driver's
    /// per-thread setup, cost a decode step a quarter of a millisecond.
    workers: Option<rayon::ThreadPool>,
}

/// How long a process waits for the others at `--dist-init`
/// (`MOEFLUX_DIST_TIMEOUT`, seconds; default 300).
fn dist_timeout() -> std::time::Duration {
    let s = std::env::var("MOEFLUX_DIST_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    std::time::Duration::from_secs(s)
}

/// Each MoE layer and its expert size, for [`Shard::balanced`].
fn moe_extents(model: &Model) -> Vec<(usize, usize)> {
    model
        .layers
        .iter()
        .filter_map(|l| l.mlp.moe())
        .map(|b| (b.layer, b.experts.extent))
        .collect()
}

/// One sequence's state on every GPU of the group (the same values).
pub struct GroupState {
    states: Vec<GpuState>,
}

impl GroupState {
    fn lead(&self) -> &GpuState {
        &self.states[0]
    }

    pub fn can_truncate(&self, pos: usize) -> bool {
        self.lead().can_truncate(pos)
    }

    pub fn row_capacity(&self) -> Vec<Option<usize>> {
        self.lead().row_capacity()
    }
}

/// One sequence's rows of a group eval and its state.
pub struct GroupSegment<'s> {
    pub state: &'s mut GroupState,
    pub seg: Segment,
}

impl CudaGroup {
    /// `model` on `gpus` (from [`open_gpus`]): one GPU as it always ran;
    /// several as an expert-parallel group over NCCL.
    pub fn new(
        gpus: Vec<Gpu>,
        model: &Model,
        store: &ExpertStore,
        opts: &CudaOptions,
    ) -> Result<CudaGroup> {
        support::check(model)?;
        if gpus.len() == 1 {
            let gpu = gpus.into_iter().next().expect("one GPU");
            return Ok(CudaGroup {
                ranks: vec![CudaModel::new(gpu, model, store, opts)?],
                aborters: Vec::new(),
                broken: None,
                shared_seed: None,
                watchdog: None,
                workers: None,
            });
        }
        let ordinals: Vec<usize> = gpus.iter().map(|g| g.info.ordinal).collect();
        let comms = Comm::init_all(&ordinals)?;
        let aborters = comms.iter().map(Comm::aborter).collect();
        let shards = Shard::balanced(
            &moe_extents(model),
            model.layers.len(),
            model.config.moe.num_experts,
            gpus.len(),
        );
        let mut shared = GroupShared::default();
        let mut ranks = gpus
            .into_iter()
            .zip(comms)
            .zip(shards)
            .map(|((gpu, comm), shard)| {
                let ep = Some(Ep {
                    shard,
                    comm,
                    own: None,
                    replicated: false,
                });
                CudaModel::new_in_group(gpu, model, store, opts, ep, &mut shared)
            })
            .collect::<Result<Vec<_>>>()?;
        let agreed = ranks.iter().all(CudaModel::replicated);
        for m in &mut ranks {
            m.set_replicated(agreed);
        }
        let workers = rayon::ThreadPoolBuilder::new()
            .num_threads(ranks.len() - 1)
            .thread_name(|i| format!("moeflux-gpu-{}", i + 1))
            .build()
            .map_err(|e| Error::Gpu(format!("cannot start the GPUs' threads: {e}")))?;
        Ok(CudaGroup {
            ranks,
            aborters,
            broken: None,
            shared_seed: None,
            watchdog: None,
            workers: Some(workers),
        })
    }

    /// `model` on this process's GPU as rank `d.rank` of `d.world`
    /// processes (`--dist-init`): rank 0 serves NCCL's id over the TCP
    /// rendezvous, every rank joins one NCCL group and owns its shard of
    /// the experts, exactly as the GPUs of one process do.
    pub fn new_dist(
        gpu: Gpu,
        d: &DistInit,
        model: &Model,
        store: &ExpertStore,
        opts: &CudaOptions,
    ) -> Result<CudaGroup> {
        support::check(model)?;
        nccl::version()?;
        let id = match d.rank {
            0 => nccl::unique_id()?.bytes,
            _ => [0; 128],
        };
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|t| t.as_nanos() as u64)
            .unwrap_or(0);
        let (joined, link) = rendezvous::join(d, id, seed, dist_timeout())?;
        let watchdog = Watchdog::start(link, d, PEER_GRACE)
            .map_err(|e| Error::Gpu(format!("--dist-init: cannot watch the peers: {e}")))?;
        let comm = init_rank_watched(&gpu, &joined.id, d, &watchdog)?;
        let aborters = vec![comm.aborter()];
        let abort = aborters.clone();
        watchdog.on_abort(move || Aborter::abort(&abort));
        let shard = Shard::balanced(
            &moe_extents(model),
            model.layers.len(),
            model.config.moe.num_experts,
            d.world,
        )
        .swap_remove(d.rank);
        let ep = Some(Ep {
            shard,
            comm,
            own: None,
            replicated: false,
        });
        let m = CudaModel::new_in_group(gpu, model, store, opts, ep, &mut GroupShared::default())
            .and_then(|mut m| {
                let agreed = m.all_ranks_replicate()?;
                m.set_replicated(agreed);
                Ok(m)
            })
            .inspect_err(|_| {
                // Tell the peers now (they may wait in their first step).
                watchdog.fail()
            })?;
        Ok(CudaGroup {
            ranks: vec![m],
            aborters,
            broken: None,
            shared_seed: Some(joined.seed),
            watchdog: Some(watchdog),
            workers: None,
        })
    }

    /// In a group of processes: a seed every process got from rank 0 (so
    /// they sample the same tokens).
    pub fn shared_seed(&self) -> Option<u64> {
        self.shared_seed
    }

    /// The lead GPU's model (rank 0).
    pub fn lead(&self) -> &CudaModel {
        &self.ranks[0]
    }

    /// Whether every GPU of a group holds every routed expert (steps of a
    /// few tokens then run on each GPU alone).
    pub fn replicated(&self) -> bool {
        self.ranks[0].replicated()
    }

    /// GPUs in the group.
    pub fn gpus(&self) -> usize {
        self.ranks.len()
    }

    /// Every GPU, `GPU n (name, ...)`, comma-separated.
    pub fn describe(&self) -> String {
        let gpus: Vec<String> = self
            .ranks
            .iter()
            .map(|m| m.gpu().info.to_string())
            .collect();
        gpus.join(", ")
    }

    /// The caches' counters summed over the GPUs.
    pub fn cache_stats(&self) -> CacheStats {
        self.ranks
            .iter()
            .fold(CacheStats::default(), |a, m| a.plus(&m.cache_stats()))
    }

    /// What the host tier holds (one tier, shared by the group).
    pub fn host_tier(&self) -> HostTierInfo {
        self.ranks
            .iter()
            .map(|m| m.host_tier())
            .find(HostTierInfo::is_some)
            .unwrap_or_default()
    }

    /// Whether misses read from the files go through cuFile (the lead's
    /// choice; every GPU makes the same one).
    pub fn gds(&self) -> Option<&super::gds::Choice> {
        self.ranks[0].gds()
    }

    pub fn prefetching(&self) -> bool {
        self.ranks.iter().any(|m| m.prefetching())
    }

    pub fn low_width_misses(&self) -> bool {
        self.ranks.iter().any(|m| m.low_width_misses())
    }

    /// Expert slots in VRAM, all GPUs together.
    pub fn cache_slots(&self) -> usize {
        self.ranks.iter().map(|m| m.cache_slots()).sum()
    }

    pub fn new_state(&self, model: &Model) -> Result<GroupState> {
        let states = self
            .ranks
            .iter()
            .map(|m| m.new_state(model))
            .collect::<Result<_>>()?;
        Ok(GroupState { states })
    }

    pub fn clear(&mut self, s: &mut GroupState) -> Result<()> {
        for (m, st) in self.ranks.iter_mut().zip(&mut s.states) {
            m.clear(st)?;
        }
        Ok(())
    }

    pub fn rewind_state(&self, s: &GroupState) -> Result<RewindState> {
        self.lead().rewind_state(s.lead())
    }

    pub fn download_state(&self, s: &GroupState) -> Result<ModelState> {
        self.lead().download_state(s.lead())
    }

    pub fn upload_state(&mut self, s: &mut GroupState, host: &ModelState) -> Result<()> {
        for (m, st) in self.ranks.iter_mut().zip(&mut s.states) {
            m.upload_state(st, host)?;
        }
        Ok(())
    }

    pub fn rewind(
        &mut self,
        s: &mut GroupState,
        pos: usize,
        from: Option<&RewindState>,
    ) -> Result<()> {
        for (m, st) in self.ranks.iter_mut().zip(&mut s.states) {
            m.rewind(st, pos, from)?;
        }
        Ok(())
    }

    /// [`CudaModel::forward`] on every GPU, one host thread each (the
    /// calling thread drives the lead); the lead's outputs. A GPU that
    /// fails aborts the group's communicators, so no other waits forever
    /// on its all-reduce, and the group refuses further steps.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &mut self,
        model: &Model,
        store: &ExpertStore,
        pool: &rayon::ThreadPool,
        k: usize,
        tokens: &[u32],
        segs: Vec<GroupSegment<'_>>,
        times: &mut PhaseTimes,
        trace: Option<&mut Trace>,
    ) -> Result<Vec<SegmentOutput>> {
        if let Some(why) = &self.broken {
            return Err(Error::Gpu(format!(
                "the GPU group stopped after a failure ({why}); reopen the model"
            )));
        }
        let world = self.ranks.len();
        let mut per_rank: Vec<Vec<GpuSegment<'_>>> = (0..world).map(|_| Vec::new()).collect();
        for s in segs {
            for (r, state) in s.state.states.iter_mut().enumerate() {
                per_rank[r].push(GpuSegment {
                    state,
                    seg: s.seg.clone(),
                });
            }
        }
        if world == 1 {
            let segs = per_rank.pop().expect("one rank");
            if let Some(w) = &self.watchdog {
                if let Err(why) = w.begin_step() {
                    self.stop_rank(&why);
                    return Err(Error::Gpu(why));
                }
            }
            let out = self.ranks[0].forward(model, store, pool, k, tokens, segs, times, trace);
            // A peer gone during the step voids it, whatever it returned.
            if let Some(why) = self.watchdog.as_ref().and_then(Watchdog::end_step) {
                self.stop_rank(&why);
                return Err(Error::Gpu(why));
            }
            if let Err(e) = &out {
                if !self.aborters.is_empty() {
                    // One rank of several processes: stop this one's part.
                    self.stop_rank(&e.to_string());
                }
            }
            return out;
        }
        let aborters = &self.aborters;
        let first_failed = std::sync::atomic::AtomicUsize::new(usize::MAX);
        let run = |r: usize,
                   m: &mut CudaModel,
                   segs: Vec<GpuSegment<'_>>,
                   times: &mut PhaseTimes,
                   trace: Option<&mut Trace>| {
            let out = m.forward(model, store, pool, k, tokens, segs, times, trace);
            if out.is_err() {
                use std::sync::atomic::Ordering::SeqCst;
                let _ = first_failed.compare_exchange(usize::MAX, r, SeqCst, SeqCst);
                Aborter::abort(aborters);
            }
            out
        };
        let mut ranks = self.ranks.iter_mut();
        let lead = ranks.next().expect("a group has a lead");
        let mut segs = per_rank.into_iter();
        let lead_segs = segs.next().expect("a lead's segments");
        let workers = self.workers.as_ref().expect("a group of GPUs has workers");
        let mut others: Vec<Option<Result<Vec<SegmentOutput>>>> =
            (1..world).map(|_| None).collect();
        // The caller's thread drives the lead while the workers drive the
        // others; the scope ends when all are done.
        let lead_out = workers.in_place_scope(|sc| {
            for (i, ((m, segs), slot)) in ranks.zip(segs).zip(others.iter_mut()).enumerate() {
                let run = &run;
                sc.spawn(move |_| {
                    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run(i + 1, m, segs, &mut PhaseTimes::default(), None)
                    }));
                    *slot = Some(out.unwrap_or_else(|_| {
                        Aborter::abort(aborters);
                        Err(Error::Gpu("a GPU's thread panicked".into()))
                    }));
                });
            }
            run(0, lead, lead_segs, times, trace)
        });
        let results: Vec<Result<Vec<SegmentOutput>>> = std::iter::once(lead_out)
            .chain(
                others
                    .into_iter()
                    .map(|o| o.expect("the scope ran every GPU's step")),
            )
            .collect();
        let failed = first_failed.into_inner();
        let mut results = results.into_iter();
        let lead_out = results.next().expect("the lead's result");
        let others: Vec<_> = results.collect();
        if lead_out.is_ok() && others.iter().all(|r| r.is_ok()) {
            return lead_out;
        }
        // The error of the GPU that failed first (the others only saw the
        // abort), else any.
        let mut all: Vec<Result<_>> = std::iter::once(lead_out).chain(others).collect();
        let pick = if failed < all.len() && all[failed].is_err() {
            failed
        } else {
            all.iter().position(|r| r.is_err()).expect("one failed")
        };
        let err = std::mem::replace(&mut all[pick], Ok(Vec::new())).expect_err("picked an error");
        self.broken = Some(format!(
            "GPU {}: {err}",
            self.ranks[pick].gpu().info.ordinal
        ));
        Err(err)
    }
}

impl CudaGroup {
    /// One rank of several processes stops: its communicator aborted, its
    /// peers told (its connections closed), further steps refused.
    fn stop_rank(&mut self, why: &str) {
        Aborter::abort(&self.aborters);
        if let Some(w) = &self.watchdog {
            w.fail();
        }
        self.broken = Some(why.to_string());
    }
}

/// `Comm::init_rank` on a thread of its own, bound to `gpu`: NCCL's init
/// waits for every rank with no timeout, so the caller gives up when the
/// watchdog says a peer is gone or the rendezvous's timeout passes (the
/// thread is left blocked; the process is failing anyway).
fn init_rank_watched(gpu: &Gpu, id: &[u8; 128], d: &DistInit, w: &Watchdog) -> Result<Comm> {
    let (tx, rx) = std::sync::mpsc::channel();
    let ctx = gpu.ctx.clone();
    let (id, rank, world) = (UniqueId { bytes: *id }, d.rank, d.world);
    std::thread::Builder::new()
        .name("moeflux-nccl-init".into())
        .spawn(move || {
            let r = ctx
                .bind_to_thread()
                .map_err(|e| Error::Gpu(format!("GPU context: {e}")))
                .and_then(|()| Comm::init_rank(&id, rank, world));
            let _ = tx.send(r);
        })
        .map_err(|e| Error::Gpu(format!("cannot start NCCL's init: {e}")))?;
    let deadline = std::time::Instant::now() + dist_timeout();
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(50)) {
            Ok(r) => return r,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(Error::Gpu(
                    "NCCL's init thread ended without an answer".into(),
                ))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
        }
        if let Some(why) = w.gone() {
            w.fail();
            return Err(Error::Gpu(format!("{why} (during NCCL's init)")));
        }
        if std::time::Instant::now() >= deadline {
            w.fail();
            return Err(Error::Gpu(format!(
                "--dist-init tcp://{} (rank {} of {}): NCCL's init did not finish within \
                 MOEFLUX_DIST_TIMEOUT ({} s)",
                d.addr,
                d.rank,
                d.world,
                dist_timeout().as_secs()
            )));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::GpuSelection;

    #[test]
    fn gpu_lists_parse_and_print() {
        assert_eq!(GpuSelection::parse("all"), Ok(GpuSelection::All));
        assert_eq!(
            GpuSelection::parse(" 0, 1,3"),
            Ok(GpuSelection::List(vec![0, 1, 3]))
        );
        assert_eq!(GpuSelection::List(vec![2, 0]).to_string(), "2,0");
        for bad in ["", "0,", "x", "-1", "0,0", "1;2"] {
            assert!(GpuSelection::parse(bad).is_err(), "{bad:?}");
        }
        assert!(GpuSelection::parse("0,0").unwrap_err().contains("twice"));
        assert!(!GpuSelection::First.is_explicit());
        assert!(GpuSelection::List(vec![0]).is_explicit());
    }
}
