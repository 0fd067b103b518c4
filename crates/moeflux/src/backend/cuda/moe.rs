//! The MLP half of a layer on the GPU (`model::moe`), shared by every
//! family: a dense SwiGLU MLP, or a mixture of experts (router, shared
//! expert, routed experts through the VRAM expert cache, combine). The
//! routers differ — softmax top-K (Qwen) or `noaux_tc` (DeepSeek-V3, GLM) —
//! and so do the shared experts (Qwen3.5's scaled by a sigmoid gate,
//! DeepSeek's and GLM's added as they are); the expert machinery is the same.

use crate::backend::cpu::moe::{expert_forward_with, ExpertAct};
use crate::config::{ExpertActivation, ModelConfig, QuantMode, RouterKind};
use crate::error::Result;
use crate::model::moe::{ComponentLayout, DenseMlp, ExpertLayout, MoeBlock};
use crate::model::timing::{lap, PhaseTimes};

use super::abi::{ExpertLayoutC, ExpertTask, MoeCombineC};
use super::device::{args, Gpu};
use super::linear::{
    balanced_blocks, kernel_suffix, matmuls, mm, mm_add, mma_layout_fits, mma_q8_enabled,
    mma_q8_kernel, mma_q8_staged, mma_q8_tiles, mma_split, q8_rows, qdot_fit_width, qdot_smem,
    qmv_rows_per_block, qmv_slices, qmv_threads, rows_per_block, swiglu_matmul, MMA_MIN_TOKENS,
    QMV_CHUNKS, QMV_STREAM_CHUNKS,
};
use super::model::{Ctx, DevWeights, Ep};
use super::support::unsupported;

/// Up to this many tokens, the routed experts run per (token, slot) with
/// the router's choice read on the device; longer batches group tokens by
/// expert (each expert's weights read once): on the device when every
/// expert is resident, else from a host copy of the choice (the host brings
/// the missing experts in).
const SLOT_PATH_MAX_TOKENS: usize = 2;

/// With every expert of the layer resident, batches up to this many tokens
/// (the decode steps of several sequences) take the per-slot path too: the
/// router's choice never leaves the GPU, so the step has no host round trip
/// per layer and can be captured as a CUDA graph.
const RESIDENT_SLOT_PATH_MAX_TOKENS: usize = 16;

/// Steps of at most this many tokens run the shared expert beside the
/// routed experts: below the products that take the tensor cores, whose
/// activations go through the workspace the compute stream's launches share.
const SIDE_STREAM_MAX_TOKENS: usize = super::linear::PRODUCT_MMA_MIN_TOKENS - 1;

/// The largest expert count and experts per token the router kernels take
/// (32 experts per lane of a warp; one lane per chosen expert).
const MAX_EXPERTS: usize = 1024;
const MAX_K: usize = 32;

/// Whether the kernels take MoE block `b`: the router kernels' expert and
/// top-K limits, `noaux_tc` groups a lane each, the routed experts'
/// projections quantized alike.
pub(super) fn check(c: &ModelConfig, b: &MoeBlock) -> Result<()> {
    let (e, k) = (c.moe.num_experts, c.moe.num_experts_per_tok);
    if e > MAX_EXPERTS || k > MAX_K {
        return Err(unsupported(format!(
            "{e} experts, {k} per token (at most {MAX_EXPERTS} and {MAX_K})"
        )));
    }
    if let RouterKind::NoauxTc {
        n_group,
        topk_group,
        ..
    } = c.moe.router
    {
        // The kernel gives each group a lane and sums a group's top two.
        if n_group > 1
            && (n_group > 32
                || !e.is_multiple_of(n_group)
                || e / n_group < 2
                || topk_group == 0
                || topk_group > n_group)
        {
            return Err(unsupported(format!(
                "noaux_tc routing of {e} experts in {n_group} groups keeping {topk_group} \
                 (at most 32 groups of at least 2 experts)"
            )));
        }
    }
    expert_layout(b.layer, &b.experts)?;
    match &b.low_width {
        Some(x) => expert_layout(b.layer, x).map(|_| ()),
        None => Ok(()),
    }
}

/// A dense SwiGLU MLP on the normed `xn`, its output added to `x`.
pub(super) fn dense_mlp(cx: &mut Ctx, d: &DenseMlp, xn: u64, n: usize, x: u64) -> Result<()> {
    let w = cx.weights;
    let (gate, up, down) = (w.lin(&d.gate), w.lin(&d.up), w.lin(&d.down));
    let inter = gate.rows();
    let (g, s) = (cx.gpu, &mut *cx.scratch);
    let gu = s.get(g, "gu", 8 * n * inter)?;
    let act = s.get(g, "act", 4 * n * inter)?;
    let ub = gu + (4 * n * inter) as u64;
    matmuls(g, &[mm(gate, gu), mm(up, ub)], xn, n)?;
    swiglu_matmul(g, mm_add(down, x), gu, act, n)
}

/// MoE block `b` on the normed `xn`, its output added to `x`: router and
/// shared expert in one launch, top-K on the device, the routed experts from
/// the VRAM cache (brought in first when missing), the combine. `next`: the
/// next MoE layer, whose experts a prefetching session starts uploading on
/// a predicted choice. On one GPU the combine is returned, not launched: the
/// caller launches it before anything else reads `x`.
#[allow(clippy::too_many_arguments)]
pub(super) fn moe(
    cx: &mut Ctx,
    b: &MoeBlock,
    next: Option<&MoeBlock>,
    xn: u64,
    n: usize,
    x: u64,
    times: &mut PhaseTimes,
) -> Result<Option<PendingCombine>> {
    let mut clock = std::time::Instant::now();
    let w = cx.weights;
    let i = b.layer;
    let (e, h, k) = (cx.config.moe.num_experts, cx.config.hidden_size, cx.k);
    let inter = b.experts.gate.rows;
    let g = cx.gpu;
    let s = &mut *cx.scratch;
    let logits_d = s.get(g, "router", 4 * n * e)?;
    let d_ids = s.get(g, "route_ids", 4 * n * k)?;
    let d_wts = s.get(g, "wts", 4 * n * k)?;
    let d_bases = s.get(g, "bases", 8 * n * k)?;
    let layout_of = |x: &ExpertLayout| -> Result<ExpertLayoutC> {
        let mut layout = expert_layout(i, x)?;
        // gpt-oss: per-expert biases (rows picked by the router's ids) and
        // the clamped SwiGLU, in the expert kernels' epilogues.
        if let ExpertActivation::SwigluOai { alpha, limit } = cx.config.moe.activation {
            (layout.oai, layout.alpha, layout.limit) = (1, alpha, limit);
        }
        if let Some([bg, bu, bd]) = b.expert_bias {
            (layout.bias_g, layout.bias_u, layout.bias_d) = (w.vec(bg), w.vec(bu), w.vec(bd));
        }
        layout.ids = d_ids;
        Ok(layout)
    };
    let layout = layout_of(&b.experts)?;
    let act = s.get(g, "eact", 4 * n * k * inter)?;
    let slot_out = s.get(g, "slot_out", 4 * n * k * h)?;
    // In a group, this GPU computes only the slots of its own experts (the
    // combine skips the others' rows), unless every GPU holds every expert
    // and the step is small or split by tokens: then each GPU runs the
    // layer alone on its rows, as one GPU does (no all-reduce).
    let alone = cx.ep.is_some_and(|ep| {
        ep.replicated && (n <= RESIDENT_SLOT_PATH_MAX_TOKENS || cx.split.is_some())
    });
    let ep = cx.ep.filter(|_| !alone);
    // The shared expert runs on one GPU of a group; the group's first GPU
    // counts the cache's uses.
    let lead = Ep::leads(ep);
    let counts = Ep::leads(cx.ep);
    let owns = |e: usize| ep.is_none_or(|ep| ep.shard.owns(i, e));

    // Router and shared expert: one launch for the products of xn, or, for
    // a few tokens on one GPU, the shared expert's gate/up and down beside
    // the router, top-K and routed experts (`Gpu::beside`), which then wait
    // for nothing of it; the combine waits for both.
    let router_bias = b.router_bias.map(|v| w.vec(v));
    let mut ops = vec![mm(w.lin(&b.router), logits_d)
        .with_bias(router_bias)
        .exact()];
    let (mut sy, mut sg) = (0u64, 0u64);
    let beside = g.side_stream && n <= SIDE_STREAM_MAX_TOKENS && ep.is_none() && cx.split.is_none();
    let mut rejoin = false;
    if let Some(sh) = b.shared.as_ref().filter(|_| lead) {
        let (sgate, sup, sdown) = (w.lin(&sh.mlp.gate), w.lin(&sh.mlp.up), w.lin(&sh.mlp.down));
        let si = sgate.rows();
        let gu = s.get(g, "sg_gu", 8 * n * si)?;
        let sact = s.get(g, "sg_act", 4 * n * si)?;
        sy = s.get(g, "sg_y", 4 * n * h)?;
        // The gate's one (8-bit) row stays in the router's launch.
        if let Some(gate) = &sh.gate {
            sg = s.get(g, "sg_s", 4 * n)?;
            ops.push(mm(w.lin(gate), sg));
        }
        let shared = [mm(sgate, gu), mm(sup, gu + (4 * n * si) as u64)];
        let down = mm(sdown, sy);
        if beside {
            g.beside(|| {
                matmuls(g, &shared, xn, n)?;
                swiglu_matmul(g, down, gu, sact, n)
            })?;
            rejoin = true;
            matmuls(g, &ops, xn, n)?;
        } else {
            ops.extend(shared);
            matmuls(g, &ops, xn, n)?;
            swiglu_matmul(g, down, gu, sact, n)?;
        }
    } else {
        matmuls(g, &ops, xn, n)?;
    }
    lap(&mut clock, &mut times.shared_mlp);

    let cache = cx
        .cache
        .as_deref_mut()
        .expect("MoE layers have an expert cache");
    let table = cache.table_row(i);
    let slot_path =
        n <= SLOT_PATH_MAX_TOKENS || (table.is_some() && n <= RESIDENT_SLOT_PATH_MAX_TOKENS);
    let route_table = if slot_path { table.unwrap_or(0) } else { 0 };
    let kernels = ExpertKernels::new(layout, slot_path);
    let launches = slot_path.then(|| kernels.slot_launches(g, n * k));
    // Every expert resident, a few tokens: the routed experts' gate/up
    // kernel routes its tokens itself where it has a variant that does (a
    // launch fewer in the step's chain).
    let routes_itself = SoftmaxRoute::of(cx.config, b)
        .filter(|_| route_table != 0 && !cache.uploads_low_width() && route_in_gate_up())
        .filter(|_| {
            launches
                .as_ref()
                .is_some_and(|[gate_up, _]| gate_up.routes())
        })
        .map(|route| RouteInGateUp {
            route,
            logits: logits_d,
            e,
            table: route_table,
            ids: d_ids,
            wts: d_wts,
        });
    if routes_itself.is_none() {
        route(
            g,
            w,
            cx.config,
            b,
            logits_d,
            n,
            k,
            route_table,
            [d_ids, d_wts, d_bases],
        )?;
    }
    // The next MoE layer's router on this layer's input: a guess of its
    // choice (the residual stream changes little in one layer), read
    // with this layer's choice and uploaded while this layer computes.
    let predicted = match next {
        Some(nx) if cx.prefetch && table.is_none() => {
            let s = &mut *cx.scratch;
            let p_logits = s.get(g, "p_router", 4 * n * e)?;
            let p_ids = s.get(g, "p_ids", 4 * n * k)?;
            let p_wts = s.get(g, "p_wts", 4 * n * k)?;
            let p_bases = s.get(g, "p_bases", 8 * n * k)?;
            let bias = nx.router_bias.map(|v| w.vec(v));
            let router = mm(w.lin(&nx.router), p_logits).with_bias(bias).exact();
            matmuls(g, &[router], xn, n)?;
            let bufs = [p_ids, p_wts, p_bases];
            route(g, w, cx.config, nx, p_logits, n, k, 0, bufs)?;
            Some((nx.layer, p_ids, p_wts))
        }
        _ => None,
    };
    // The low-width copies' kernels, for the experts the cache holds as
    // copies (`--low-width-misses`).
    let low_kernels = match &b.low_width {
        Some(x) if cache.uploads_low_width() => Some(ExpertKernels::new(layout_of(x)?, slot_path)),
        _ => None,
    };
    let kernels_of = |low: bool| match low {
        false => &kernels,
        true => low_kernels
            .as_ref()
            .expect("the cache uploads low-width copies only of layers that have them"),
    };
    let mut low_bases: Option<u64> = None;
    let mut guess: Vec<i32> = Vec::new();
    let mut next_ids: Option<(usize, Vec<usize>, Vec<bool>)> = None;
    let mut on_cpu: Vec<usize> = Vec::new();
    let mut cpu_users: Vec<(usize, Vec<i32>)> = Vec::new();
    let mut host_xn: Vec<f32> = Vec::new();
    // Every expert resident (in a group: every expert this GPU owns; the
    // others' slots the grouping leaves out) and a batch past the per-slot
    // path: the choice grouped by expert on the
    // device, so the layer never waits for the host (a prefill's GPU would
    // idle through each layer's round trip and the host's grouping, ~20% of
    // its time at 512-4096 tokens).
    if let Some(table) = table.filter(|_| !slot_path && device_grouping()) {
        if counts {
            cache.count_hits((n * k) as u64);
        }
        let d_tasks = cx.scratch.get(g, "tasks", size_of::<ExpertTask>() * e)?;
        let d_slots = cx.scratch.get(g, "slots", 4 * n * k)?;
        let own = ep
            .and_then(|ep| ep.own.as_ref())
            .map_or(0, |m| m.ptr() + (i * e) as u64);
        group_on_device(g, d_ids, n * k, e, [table, own], d_tasks, d_slots)?;
        lap(&mut clock, &mut times.routing);
        let rows = TaskRows {
            tasks: d_tasks,
            n_tasks: e,
            slots: d_slots,
            n_slots: n * k,
            task_slots: n * k,
        };
        kernels.run_tasks(g, &rows, n, k, xn, act, slot_out)?;
    } else if slot_path && table.is_some() {
        // Every expert resident: the router's choice never leaves the GPU
        // (in a group, the lead counts the group's uses).
        if counts {
            cache.count_hits((n * k) as u64);
        }
    } else {
        // The host needs the choice to bring missing experts in.
        let mut runs = vec![(d_ids, n * k)];
        runs.extend(predicted.map(|(_, p_ids, _)| (p_ids, n * k)));
        let want_xn = slot_path && cx.cpu_experts > 0 && cache.host_pinned(i);
        if want_xn {
            runs.push((xn, n * h));
        }
        // Low-width misses with a weight bound: the router's weights (and
        // the guess's) say which experts travel at full width.
        let below = cache.low_width_below();
        if below.is_some() {
            runs.push((d_wts, n * k));
            runs.extend(predicted.map(|(_, _, p_wts)| (p_wts, n * k)));
        }
        let mut got = cx.downloads.download_runs::<i32>(g, &runs)?.into_iter();
        let ids = got.next().expect("one run per buffer");
        if predicted.is_some() {
            guess = got.next().expect("one run per buffer");
        }
        if want_xn {
            let bits = got.next().expect("one run per buffer");
            host_xn = bytemuck::cast_slice(&bits).to_vec();
        }
        let mut floats = || -> Vec<f32> {
            bytemuck::cast_slice(&got.next().expect("one run per buffer")).to_vec()
        };
        let (wts, guess_wts) = match below {
            Some(_) => (floats(), predicted.map_or(Vec::new(), |_| floats())),
            None => (Vec::new(), Vec::new()),
        };
        cx.arena.reset();
        lap(&mut clock, &mut times.routing);
        let users = ExpertUsers::new(&ids, e)?;
        // Up to `cpu_experts` of the experts neither resident nor on
        // their way are computed by the host from the pinned host tier
        // instead of joining the copy queue (their slots' base stays 0,
        // which the slot kernels skip).
        if want_xn {
            let missing = users
                .experts()
                .filter(|&e| owns(e) && !cache.is_resident(i, e));
            on_cpu.extend(missing.take(cx.cpu_experts));
        }
        let unique: Vec<usize> = users
            .experts()
            .filter(|&e| owns(e) && !on_cpu.contains(&e))
            .collect();
        if let Some((j, ..)) = predicted {
            // The guess's most chosen experts first, this GPU's only.
            let mut ids = ExpertUsers::new(&guess, e)?.most_chosen_first();
            if let Some(ep) = ep {
                ids.retain(|&e| ep.shard.owns(j, e));
            }
            // Without a host tier the guess is read from the files, behind
            // this layer's own reads.
            cache.read_ahead(cx.store, j, &ids);
            let as_copy = match below {
                Some(w) => {
                    let weight = heaviest(&guess, &guess_wts);
                    ids.iter().map(|e| weight[e] < w).collect()
                }
                None => Vec::new(),
            };
            next_ids = Some((j, ids, as_copy));
        }
        let full: Vec<bool> = match below {
            Some(w) => {
                let weight = heaviest(&ids, &wts);
                unique.iter().map(|e| weight[e] >= w).collect()
            }
            None => Vec::new(),
        };
        let placed = cache.ensure(g, cx.store, i, &unique, &full)?;
        lap(&mut clock, &mut times.expert_io);
        if slot_path {
            // Per width, the slots' experts (0: the other width's slot).
            let mut bases = [vec![0u64; n * k], vec![0u64; n * k]];
            for (r, e) in placed.iter().zip(&unique) {
                for &j in &users[*e] {
                    bases[r.low as usize][j as usize] = r.ptr;
                }
            }
            cx.arena.upload(g, d_bases, &bases[0])?;
            if placed.iter().any(|r| r.low) {
                let d = cx.scratch.get(g, "bases_low", 8 * n * k)?;
                cx.arena.upload(g, d, &bases[1])?;
                low_bases = Some(d);
            }
            cpu_users = on_cpu.iter().map(|&e| (e, users[e].to_vec())).collect();
        } else if !unique.is_empty() {
            // (A GPU of a group may own none of the chosen experts: no
            // launch, its partial is the zeroed slots.) One list of slots,
            // so each task's act rows are its own; per width, its tasks.
            let mut slot_list: Vec<i32> = Vec::with_capacity(n * k);
            let mut tasks: [Vec<ExpertTask>; 2] = Default::default();
            for (r, slots) in placed.iter().zip(unique.iter().map(|&e| &users[e])) {
                tasks[r.low as usize].push(ExpertTask {
                    base: r.ptr,
                    first: slot_list.len() as i32,
                    count: slots.len() as i32,
                });
                slot_list.extend(slots);
            }
            let d_slots = cx.scratch.get(g, "slots", 4 * slot_list.len())?;
            cx.arena.upload(g, d_slots, &slot_list)?;
            for (low, (tasks, name)) in tasks.iter().zip(["tasks", "tasks_low"]).enumerate() {
                if tasks.is_empty() {
                    continue;
                }
                let d_tasks = cx
                    .scratch
                    .get(g, name, std::mem::size_of_val(tasks.as_slice()))?;
                cx.arena.upload(g, d_tasks, tasks)?;
                let rows = TaskRows {
                    tasks: d_tasks,
                    n_tasks: tasks.len(),
                    slots: d_slots,
                    n_slots: slot_list.len(),
                    task_slots: tasks.iter().map(|t| t.count as usize).sum(),
                };
                kernels_of(low == 1).run_tasks(g, &rows, n, k, xn, act, slot_out)?;
            }
        }
    }
    if let Some(launches) = launches {
        kernels.run_slots(
            g,
            launches,
            d_bases,
            n * k,
            k,
            xn,
            act,
            slot_out,
            routes_itself,
        )?;
        if let Some(d) = low_bases {
            let low = kernels_of(true);
            let launches = low.slot_launches(g, n * k);
            low.run_slots(g, launches, d, n * k, k, xn, act, slot_out, None)?;
        }
    }
    if let Some((j, ids, as_copy)) = next_ids {
        // From the host tier: queued after this layer's compute was
        // launched, so its own uploads went first.
        cache.prefetch(g, cx.store, j, &ids, &as_copy)?;
    }
    if !cpu_users.is_empty() {
        compute_on_host(cx, b, &cpu_users, &host_xn, slot_out)?;
    }
    // In a group: the lead's partial starts from x and holds the shared
    // expert, the others' from zero; NCCL's sum lands in x on every GPU
    // (the same values).
    let own = ep
        .and_then(|ep| ep.own.as_ref())
        .map_or(0, |m| m.ptr() + (i * e) as u64);
    let combine = MoeCombineC {
        slot_out,
        wts: d_wts,
        ids: d_ids,
        own,
        shared: sy,
        sg,
        base: if lead { x } else { 0 },
        k: k as i32,
        h: h as i32,
    };
    if rejoin {
        g.rejoin()?;
    }
    let Some(ep) = ep else {
        // One GPU: the combine into x is left to the step, which launches
        // it together with the next input norm when one follows.
        lap(&mut clock, &mut times.expert_compute);
        return Ok(Some(PendingCombine {
            args: combine,
            out: x,
            n,
        }));
    };
    let part = cx.scratch.get(g, "moe_part", 4 * n * h)?;
    PendingCombine {
        args: combine,
        out: part,
        n,
    }
    .launch(g, None)?;
    // Profiled as a kernel: its share of a step in MOEFLUX_CUDA_PROFILE.
    g.profiled(
        || format!("nccl_all_reduce [{n}x{h}]"),
        || ep.comm.all_reduce_f32(part, x, n * h, &g.stream),
    )?;
    lap(&mut clock, &mut times.expert_compute);
    Ok(None)
}

/// A MoE layer's combine of `n` tokens into `out` (`moe_combine`), not yet
/// launched: `GpuStep` holds it back until its next operation, so that an
/// input norm of the same rows shares its launch (`moe_combine_norm`, one
/// kernel boundary fewer a layer, the same values bit for bit).
pub(super) struct PendingCombine {
    args: MoeCombineC,
    out: u64,
    n: usize,
}

impl PendingCombine {
    /// Whether the combine writes `rows` rows from `x` (then a norm of
    /// those rows can follow in its launch).
    pub(super) fn writes(&self, x: u64, rows: usize) -> bool {
        self.out == x && self.n == rows
    }

    /// Launches the combine, and with `norm` = (weight, eps, xn) the norm
    /// of its output into xn in the same launch.
    pub(super) fn launch(self, g: &Gpu, norm: Option<(u64, f32, u64)>) -> Result<()> {
        let (combine, out, n) = (self.args, self.out, self.n);
        // SAFETY: `moe_combine` and `moe_combine_norm` in kernels/moe.cu; the
        // combine's buffers hold n tokens (shared and sg null or n rows),
        // out and xn n rows of its width, the weight one row.
        unsafe {
            match norm {
                None => g.launch(
                    "moe_combine",
                    (n as u32, (combine.h as u32).div_ceil(256), 1),
                    256,
                    0,
                    &mut args!(combine, out),
                ),
                // One token a block of 1024 threads, as `rms_norm`.
                Some((w, eps, xn)) => g.launch(
                    "moe_combine_norm",
                    (n as u32, 1, 1),
                    1024,
                    0,
                    &mut args!(combine, out, w, eps, xn),
                ),
            }
        }
    }
}

/// An MoE step's expert slots grouped by expert (`moe_*` task kernels):
/// the tasks on the device, and the one list of slots they index (a
/// slot_list entry's position is its row of the activations).
struct TaskRows {
    tasks: u64,
    n_tasks: usize,
    slots: u64,
    /// Entries of the slot list (all widths' tasks).
    n_slots: usize,
    /// Slots of these tasks.
    task_slots: usize,
}

/// One expert width's layout and the kernels a step of it takes: the
/// experts, or their low-width copies (`--low-width-misses`).
struct ExpertKernels {
    layout: ExpertLayoutC,
    /// Kernel suffixes of gate/up and of down (whose width may differ).
    sfx: &'static str,
    down_sfx: &'static str,
    /// The activation-stationary per-slot kernels' grids, when the step
    /// takes the per-slot path and the layout fits them.
    qmv: Option<(u32, u32)>,
    gate_up_blocks: u32,
    down_blocks: u32,
}

impl ExpertKernels {
    fn new(layout: ExpertLayoutC, slot_path: bool) -> ExpertKernels {
        let (sfx, down_sfx) = if layout.mx != 0 {
            ("mx", "mx")
        } else {
            (kernel_suffix(layout.bits), kernel_suffix(layout.down_bits))
        };
        let (h, inter) = (layout.hidden as usize, layout.inter as usize);
        let (bits, down_bits) = (layout.bits as usize, layout.down_bits as usize);
        // Per-slot kernels take one token: rows split across warps, or the
        // activation-stationary kernels when the layout fits them.
        let qmv = slot_path.then(|| qmv_slot_grids(&layout)).flatten();
        let (gate_up_blocks, down_blocks) = match qmv {
            Some(grids) => grids,
            None => (
                inter.div_ceil(rows_per_block(h, bits, slot_path)) as u32,
                h.div_ceil(rows_per_block(inter, down_bits, slot_path)) as u32,
            ),
        };
        ExpertKernels {
            layout,
            sfx,
            down_sfx,
            qmv,
            gate_up_blocks,
            down_blocks,
        }
    }

    /// The per-slot launches (gate/up, down) of `slots` slots.
    fn slot_launches(&self, g: &Gpu, slots: usize) -> [SlotLaunch; 2] {
        match self.qmv {
            Some(grids) => slot_launches(g, &self.layout, self.sfx, slots, grids),
            None => [
                SlotLaunch::rows(
                    format!("moe_gate_up_slots_{}", self.sfx),
                    self.gate_up_blocks,
                ),
                SlotLaunch::rows(
                    format!("moe_down_slots_{}", self.down_sfx),
                    self.down_blocks,
                ),
            ],
        }
    }

    /// The per-slot path (`launches`: [`ExpertKernels::slot_launches`] of
    /// them): each of `slots` (token, rank) slots with its expert's address
    /// at `bases` (0: skipped, its `slot_out` row left
    /// as it is), or, with `route`, the gate/up kernel's own choice, which
    /// it writes to `bases` and the route's ids and weights.
    #[allow(clippy::too_many_arguments)]
    fn run_slots(
        &self,
        g: &Gpu,
        [gate_up, down]: [SlotLaunch; 2],
        bases: u64,
        slots: usize,
        k: usize,
        xn: u64,
        act: u64,
        slot_out: u64,
        route: Option<RouteInGateUp>,
    ) -> Result<()> {
        let (layout, k_i) = (self.layout, k as i32);
        let slots = slots as u32;
        // SAFETY (all launches): arguments match the kernels in
        // kernels/moe.cu and moe_route.cu; bases hold resident experts of
        // this layout or 0 (with `route`, room for them), the route's
        // logits a row of e per token, buffers are sized for n * k slots.
        unsafe {
            match route {
                None => g.launch(
                    &gate_up.kernel,
                    (gate_up.blocks, slots, 1),
                    gate_up.threads,
                    gate_up.smem,
                    &mut args!(bases, layout, k_i, xn, act),
                )?,
                Some(r) => {
                    let (e_i, norm) = (r.e as i32, r.route.norm);
                    g.launch(
                        &format!("{}_route_c{}", gate_up.kernel, r.route.per_lane),
                        (gate_up.blocks, slots, 1),
                        gate_up.threads,
                        gate_up.smem,
                        &mut args!(
                            r.logits, e_i, k_i, norm, r.table, r.ids, r.wts, bases, layout, xn, act
                        ),
                    )?
                }
            }
            g.launch(
                &down.kernel,
                (down.blocks, slots, 1),
                down.threads,
                down.smem,
                &mut args!(bases, layout, act, slot_out),
            )?;
        }
        Ok(())
    }

    /// The grouped path: `rows`' tasks over the `n` tokens of `xn`, each
    /// expert's weights read once for its tokens (on tensor cores from
    /// [`MMA_MIN_TOKENS`] tokens where the layout fits them).
    #[allow(clippy::too_many_arguments)]
    fn run_tasks(
        &self,
        g: &Gpu,
        rows: &TaskRows,
        n: usize,
        k: usize,
        xn: u64,
        act: u64,
        slot_out: u64,
    ) -> Result<()> {
        let (layout, k_i) = (self.layout, k as i32);
        let (h, inter) = (layout.hidden as usize, layout.inter as usize);
        let (d_tasks, d_slots, n_tasks) = (rows.tasks, rows.slots, rows.n_tasks as u32);
        if n >= MMA_MIN_TOKENS && g.mma && mma_experts_fit(&layout) {
            if mma_q8_enabled(g) && mma_q8_experts_fit(&layout) {
                let (xq, dxs) = q8_rows(g, xn, n, h)?;
                // Staged (mma_staged.cu) where tasks average
                // STAGED_MIN_TASK_TOKENS or more (kbench, H200: 2x at ~128
                // tokens a task, gate/up -7% and down +9% at 16, both ~20%
                // slower at ~10, where a block streams its rows for a mostly
                // empty token tile).
                let staged = mma_q8_staged()
                    && h % 64 == 0
                    && inter % 64 == 0
                    && rows.task_slots >= STAGED_MIN_TASK_TOKENS * rows.n_tasks;
                // (gate/up kernel, its intermediate rows a block, down
                // kernel, its hidden rows a block, threads a block). Unstaged,
                // a warp's row tiles (gate/up: half of them gate's). kbench
                // (H200, A3B): 4 win gate/up with ~128 tokens a task (2870
                // -> 2668 us at 4096 tokens), not with ~16 (442 -> 448 at
                // 512), and lose down at both (1201 -> 1344, 209 -> 246).
                let (gate_up, gate_up_rows, down, down_rows, threads) = if staged {
                    (
                        "moe_gate_up_mma_q8s".to_string(),
                        64,
                        "moe_down_mma_q8s".to_string(),
                        128,
                        256,
                    )
                } else {
                    let tiles = mma_q8_tiles(rows.task_slots >= 64 * rows.n_tasks);
                    let down_tiles = mma_q8_tiles(false);
                    (
                        mma_q8_kernel("moe_gate_up_mma_q8", tiles),
                        32 * tiles,
                        mma_q8_kernel("moe_down_mma_q8", down_tiles),
                        64 * down_tiles,
                        128,
                    )
                };
                // SAFETY: `moe_gate_up_mma_q8*` in mma_products.cu or
                // `moe_gate_up_mma_q8s` in mma_staged.cu (gate_up_rows
                // intermediate rows a block); tasks point at resident
                // experts, xq / dxs were rounded from xn (n tokens), act
                // holds a row per slot list entry.
                unsafe {
                    g.launch(
                        &gate_up,
                        (inter.div_ceil(gate_up_rows) as u32, n_tasks, 1),
                        threads,
                        0,
                        &mut args!(d_tasks, layout, d_slots, k_i, xq, dxs, act),
                    )?
                };
                let (aq, adxs) = q8_rows(g, act, rows.n_slots, inter)?;
                // SAFETY: `moe_down_mma_q8*` / `moe_down_mma_q8s` (down_rows
                // hidden rows a block); aq / adxs were rounded from act,
                // slot_out holds n * k rows.
                unsafe {
                    g.launch(
                        &down,
                        (h.div_ceil(down_rows) as u32, n_tasks, 1),
                        threads,
                        0,
                        &mut args!(d_tasks, layout, d_slots, aq, adxs, slot_out),
                    )?
                };
            } else {
                let (xp, xs) = mma_split(g, xn, n, h, layout.gs as usize)?;
                // SAFETY: `moe_gate_up_mma` in mma_products.cu; tasks point
                // at resident experts, xp / xs were split from xn (n
                // tokens), act holds a row per slot list entry.
                unsafe {
                    g.launch(
                        "moe_gate_up_mma",
                        (inter.div_ceil(MMA_GATE_UP_ROWS) as u32, n_tasks, 1),
                        128,
                        0,
                        &mut args!(d_tasks, layout, d_slots, k_i, xp, xs, act),
                    )?
                };
                let down_gs = layout.down_gs as usize;
                let (ap, asum) = mma_split(g, act, rows.n_slots, inter, down_gs)?;
                // SAFETY: `moe_down_mma` in mma_products.cu; ap / asum were
                // split from act, slot_out holds n * k rows.
                unsafe {
                    g.launch(
                        "moe_down_mma",
                        (h.div_ceil(MMA_DOWN_ROWS) as u32, n_tasks, 1),
                        128,
                        0,
                        &mut args!(d_tasks, layout, d_slots, ap, asum, slot_out),
                    )?
                };
            }
            return Ok(());
        }
        // SAFETY (both launches): arguments match the kernels in
        // kernels/moe.cu; tasks point at resident experts, buffers are sized
        // for n * k slots.
        unsafe {
            g.launch(
                &format!("moe_gate_up_{}", self.sfx),
                (self.gate_up_blocks, n_tasks, 1),
                256,
                0,
                &mut args!(d_tasks, layout, d_slots, k_i, xn, act),
            )?;
            g.launch(
                &format!("moe_down_{}", self.down_sfx),
                (self.down_blocks, n_tasks, 1),
                256,
                0,
                &mut args!(d_tasks, layout, d_slots, act, slot_out),
            )?;
        }
        Ok(())
    }
}

/// The experts `users` (expert, its slots) of layer `i` computed by the
/// host on the layer's input `xn` (n x hidden, on the host) from the
/// pinned host tier, while the GPU computes the rest and the copy stream
/// carries the prefetch; each result lands in its slot's row of
/// `slot_out` on the compute stream, before the combine reads it.
fn compute_on_host(
    cx: &mut Ctx,
    b: &MoeBlock,
    users: &[(usize, Vec<i32>)],
    xn: &[f32],
    slot_out: u64,
) -> Result<()> {
    let (h, k) = (cx.config.hidden_size, cx.k);
    let act = ExpertAct::of(b, cx.host_weights, cx.config);
    let mut y = vec![0.0f32; h];
    for (e, slots) in users {
        let bytes = cx
            .store
            .mapped(b.layer, *e)
            .expect("host-tier layers are mapped");
        for &j in slots {
            let t = j as usize / k;
            let x = &xn[t * h..(t + 1) * h];
            cx.pool
                .install(|| expert_forward_with(&b.experts, &act, *e, bytes, false, x, 1, &mut y));
            cx.arena
                .upload(cx.gpu, slot_out + 4 * (j as u64) * h as u64, &y)?;
        }
    }
    if let Some(cache) = cx.cache.as_deref_mut() {
        cache.stats.cpu_computed += users.len() as u64;
    }
    Ok(())
}

/// Block `b`'s router choice for `n` tokens from their logits: expert ids
/// and weights per (token, slot) into `out` = [ids, weights, bases], and,
/// with `table` (the layer's row of the resident experts' addresses), each
/// slot's expert address.
#[allow(clippy::too_many_arguments)]
fn route(
    g: &Gpu,
    w: DevWeights,
    c: &ModelConfig,
    b: &MoeBlock,
    logits: u64,
    n: usize,
    k: usize,
    table: u64,
    out: [u64; 3],
) -> Result<()> {
    let [ids, wts, bases] = out;
    let (nn, e_i, k_i) = (n as i32, c.moe.num_experts as i32, k as i32);
    let grid = (n.div_ceil(4) as u32, 1, 1);
    if let Some(SoftmaxRoute { per_lane, norm }) = SoftmaxRoute::of(c, b) {
        // SAFETY: `moe_route_c*` in kernels/moe_route.cu (4 tokens per block
        // of 128, e <= 32 C: MAX_EXPERTS is checked at load); logits hold n
        // rows, outputs n * k slots.
        return unsafe {
            g.launch(
                &format!("moe_route_c{per_lane}"),
                grid,
                128,
                0,
                &mut args!(logits, nn, e_i, k_i, norm, table, ids, wts, bases),
            )
        };
    }
    let (
        RouterKind::NoauxTc {
            n_group,
            topk_group,
            routed_scaling_factor,
        },
        Some(bias),
    ) = (c.moe.router, b.score_bias)
    else {
        unreachable!("SoftmaxRoute::of takes every router but noaux_tc with its bias");
    };
    // As the CPU: renormalised only when more than one is chosen.
    let norm = (c.moe.norm_topk_prob && k > 1) as i32;
    let (bias, ng, tg, rsf) = (
        w.vec(bias),
        n_group as i32,
        topk_group as i32,
        routed_scaling_factor,
    );
    // SAFETY: `moe_route_noaux` in kernels/moe_route.cu, as above; bias holds
    // one float per expert.
    unsafe {
        g.launch(
            "moe_route_noaux",
            grid,
            128,
            0,
            &mut args!(logits, bias, nn, e_i, k_i, ng, tg, norm, rsf, table, ids, wts, bases),
        )
    }
}

/// A softmax router's top-K left to the routed experts' gate/up kernel:
/// its logits (`e` a token), the layer's row of the resident experts'
/// addresses, where the choice goes.
#[derive(Clone, Copy)]
struct RouteInGateUp {
    route: SoftmaxRoute,
    logits: u64,
    e: usize,
    table: u64,
    ids: u64,
    wts: u64,
}

/// The softmax routers' top-K (`moe_route_c{per_lane}`, and the routed
/// gate/up kernels that route themselves): logits a lane and whether the
/// weights are renormalised.
#[derive(Clone, Copy)]
struct SoftmaxRoute {
    per_lane: usize,
    norm: i32,
}

impl SoftmaxRoute {
    /// None for `noaux_tc` with its correction bias (`moe_route_noaux`).
    fn of(c: &ModelConfig, b: &MoeBlock) -> Option<SoftmaxRoute> {
        if matches!(c.moe.router, RouterKind::NoauxTc { .. }) && b.score_bias.is_some() {
            return None;
        }
        Some(SoftmaxRoute {
            // The variant whose lanes hold just enough logits.
            per_lane: [4, 8, 16, 32]
                .into_iter()
                .find(|&per| 32 * per >= c.moe.num_experts)
                .unwrap_or(32),
            // gpt-oss's softmax over the top-K logits is the softmax over all
            // of them, top-K (the same order), renormalised.
            norm: (c.moe.norm_topk_prob || c.moe.router == RouterKind::TopKSoftmax) as i32,
        })
    }
}

/// `MOEFLUX_CUDA_ROUTE_IN_GATE_UP=0`: the top-K always in its own launch,
/// to compare.
fn route_in_gate_up() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_ROUTE_IN_GATE_UP").map_or(true, |v| v != "0"))
}

/// `MOEFLUX_CUDA_DEVICE_GROUPING=0`: resident layers' batches grouped by
/// expert on the host as the others are, to compare (and decode steps of
/// more than 16 sequences then not captured as graphs).
pub(super) fn device_grouping() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_DEVICE_GROUPING").map_or(true, |v| v != "0"))
}

/// The `slots` router choices at `ids` grouped by expert on the device:
/// `tasks` gets each of the `e` experts' task (its address from the layer's
/// row of the resident table, its run of the slot list; experts nobody chose
/// and, where `own` (a byte per expert of the layer, 0: none) is given, the
/// experts it does not mark have empty runs, which the expert kernels skip),
/// `slot_list` the runs.
fn group_on_device(
    g: &Gpu,
    ids: u64,
    slots: usize,
    e: usize,
    [table, own]: [u64; 2],
    tasks: u64,
    slot_list: u64,
) -> Result<()> {
    let (n_slots, e_i) = (slots as i32, e as i32);
    // SAFETY: `moe_group` in kernels/moe_route.cu (one block of 1024
    // threads, e <= MAX_EXPERTS = 1024, checked at load); ids holds `slots`
    // expert indices below e, table e addresses, own (unless 0) e bytes,
    // tasks room for e tasks and slot_list for `slots` entries.
    unsafe {
        g.launch(
            "moe_group",
            (1, 1, 1),
            1024,
            0,
            &mut args!(ids, n_slots, e_i, table, own, tasks, slot_list),
        )
    }
}

/// Per expert of a step's choice (`ids`, `wts`: expert and weight per
/// (token, rank)), the largest weight a token gives it: how important the
/// expert is to the step.
fn heaviest(ids: &[i32], wts: &[f32]) -> std::collections::HashMap<usize, f32> {
    let mut m = std::collections::HashMap::new();
    for (&id, &x) in ids.iter().zip(wts) {
        let w = m.entry(id as usize).or_insert(x);
        *w = w.max(x);
    }
    m
}

/// A step's router choice grouped by expert on the host: each chosen
/// expert's slots (token * k + rank), in slot order. A counting sort: a
/// 4096-token step has 32768 slots, which a map of vectors took 1.6-2.2 ms
/// a layer to group on an EPYC core (the GPU idle meanwhile), this ~0.2 ms.
struct ExpertUsers {
    /// Expert x's slots are `slots[first[x]..first[x + 1]]`.
    first: Vec<usize>,
    slots: Vec<i32>,
}

impl ExpertUsers {
    /// `ids`: the chosen expert of each slot, each below `e`.
    fn new(ids: &[i32], e: usize) -> Result<ExpertUsers> {
        let mut first = vec![0usize; e + 1];
        for &id in ids {
            match usize::try_from(id).ok().filter(|&x| x < e) {
                Some(x) => first[x + 1] += 1,
                None => {
                    return Err(crate::error::Error::Gpu(format!(
                        "the router chose expert {id} of {e}"
                    )))
                }
            }
        }
        for x in 0..e {
            first[x + 1] += first[x];
        }
        let mut next = first.clone();
        let mut slots = vec![0i32; ids.len()];
        for (j, &id) in ids.iter().enumerate() {
            let at = &mut next[id as usize];
            slots[*at] = j as i32;
            *at += 1;
        }
        Ok(ExpertUsers { first, slots })
    }

    /// The chosen experts, in increasing order.
    fn experts(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.first.len() - 1).filter(|&x| self.first[x + 1] > self.first[x])
    }

    /// The chosen experts, those more slots chose first (ties: lower id
    /// first): a predicted choice's upload order.
    fn most_chosen_first(&self) -> Vec<usize> {
        let mut by_count: Vec<usize> = self.experts().collect();
        by_count.sort_by_key(|&x| std::cmp::Reverse(self[x].len()));
        by_count
    }
}

impl std::ops::Index<usize> for ExpertUsers {
    type Output = [i32];

    /// Expert `x`'s slots (empty when no slot chose it).
    fn index(&self, x: usize) -> &[i32] {
        &self.slots[self.first[x]..self.first[x + 1]]
    }
}

/// Blocks of the activation-stationary per-slot kernels (gate/up, down)
/// when the experts' layout fits them (every piece 16-byte aligned; the
/// cache's slots are; gate/up and down of one code width and group size,
/// which the one kernel suffix of [`slot_launches`] assumes).
fn qmv_slot_grids(l: &ExpertLayoutC) -> Option<(u32, u32)> {
    let offsets = [l.gate_w, l.up_w, l.down_w];
    if offsets.iter().any(|o| o % 16 != 0) || !uniform(l) {
        return None;
    }
    let (h, inter) = (l.hidden as usize, l.inter as usize);
    let (bits, gs) = (l.bits as usize, l.gs as usize);
    let gate_up = qmv_rows_per_block(h, bits, gs, QMV_CHUNKS / 2)?;
    let down = qmv_rows_per_block(inter, bits, gs, QMV_CHUNKS)?;
    Some((inter.div_ceil(gate_up) as u32, h.div_ceil(down) as u32))
}

/// Whether the down projection is quantized as gate and up are.
fn uniform(l: &ExpertLayoutC) -> bool {
    (l.bits, l.gs, l.sf32) == (l.down_bits, l.down_gs, l.down_sf32)
}

/// Intermediate rows per block of `moe_gate_up_mma` and hidden rows per
/// block of `moe_down_mma`.
const MMA_GATE_UP_ROWS: usize = 64;
const MMA_DOWN_ROWS: usize = 128;

/// Whether the tensor-core expert kernels take the experts' layout (see
/// [`mma_layout_fits`]; every projection's codes 16-byte aligned in the
/// extent, whose cache slot is).
fn mma_experts_fit(l: &ExpertLayoutC) -> bool {
    let aligned = [l.gate_w, l.up_w, l.down_w].iter().all(|o| o % 16 == 0);
    aligned
        && mma_layout_fits(l.bits, l.gs, l.hidden, 0)
        && mma_layout_fits(l.down_bits, l.down_gs, l.inter, 0)
}

/// Expert tasks that average fewer tokens keep the unstaged q8 kernels
/// (see `run_tasks`).
const STAGED_MIN_TASK_TOKENS: usize = 16;

/// Whether the tensor-core experts on 8-bit activations take the layout:
/// 4-bit affine codes in every projection (MXFP4 and other widths keep
/// their own kernels).
fn mma_q8_experts_fit(l: &ExpertLayoutC) -> bool {
    l.mx == 0 && l.bits == 4 && l.down_bits == 4
}

/// One per-slot expert kernel's launch: blocks per slot, threads per block.
struct SlotLaunch {
    kernel: String,
    blocks: u32,
    threads: u32,
    /// Dynamic shared memory bytes.
    smem: u32,
}

impl SlotLaunch {
    fn new(kernel: String, blocks: u32, threads: u32) -> SlotLaunch {
        SlotLaunch {
            kernel,
            blocks,
            threads,
            smem: 0,
        }
    }

    /// The general per-slot kernels (rows split across warps).
    fn rows(kernel: String, blocks: u32) -> SlotLaunch {
        SlotLaunch::new(kernel, blocks, 256)
    }

    /// Whether this gate/up kernel has a variant that routes its tokens
    /// itself (the row kernels on 8-bit activations,
    /// `moe_gate_up_qdot{LPR}_route_c{C}` in kernels/moe_route.cu).
    fn routes(&self) -> bool {
        self.kernel.starts_with("moe_gate_up_qdot")
    }
}

/// Waves of the SMs the one-pass gate/up kernel must take for the
/// streaming per-slot kernels to replace it: on the H200 gpt-oss-20b's
/// experts (1,440 blocks, 5.5 waves) decode 13% faster streamed, where
/// Qwen3.6-35B-A3B's (256 blocks, one wave) are 1% slower.
const STREAM_MIN_WAVES: usize = 2;

/// Chunks per warp and set of the MXFP4 streaming per-slot kernels
/// (`MX_STREAM_NC` in kernels/moe.cu; the 4- and 8-bit ones take
/// [`QMV_STREAM_CHUNKS`]). Measured on an H200 with gpt-oss's experts, four
/// slots of 2880 x 2880 (`scripts/gpu/kbench`, "gpt-oss-20b experts"):
/// gate/up 38.6 and down 22.6 µs with four chunks (two blocks per SM fit),
/// 33.0 and 20.3 µs with two (four blocks per SM).
const MX_STREAM_CHUNKS: usize = 2;

/// Slices per row (of 512 bytes at most, as the streaming kernels cut
/// them) the MXFP4 by-rows kernels (`moe_*_rows_mx{2,3,4}` in
/// kernels/moe.cu) take: rows of 513 to 2,048 bytes (gpt-oss's 2,880
/// columns: 3).
const MX_ROWS_SLICES: std::ops::RangeInclusive<usize> = 2..=4;

/// The slices of an MXFP4 row of `cols` columns (half as many bytes) when
/// the by-rows kernels take it.
fn mx_rows_slices(cols: usize) -> Option<usize> {
    Some((cols / 2).div_ceil(512)).filter(|s| MX_ROWS_SLICES.contains(s))
}

/// Whether the MXFP4 per-slot products go by whole rows where they fit
/// (`MOEFLUX_CUDA_MX_ROWS=0`: the streaming or one-pass kernels instead, to
/// compare).
fn mx_rows_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_MX_ROWS").map_or(true, |v| v != "0"))
}

/// The MXFP4 by-rows launch of `kernel` ("moe_gate_up_rows_mx" or
/// "moe_down_rows_mx") over rows of `cols` columns, `units` units per slot
/// (a warp's turn: one intermediate row of gate and up, or two hidden rows
/// of down), or `None` where the row width does not fit
/// ([`MX_ROWS_SLICES`]): 8 warps a block, as many blocks per slot as the SMs
/// hold at once, shared by the slots, each warp looping over its slot's
/// units.
fn mx_rows_launch(
    g: &Gpu,
    kernel: &str,
    cols: usize,
    units: usize,
    slots: usize,
) -> Option<SlotLaunch> {
    let slices = mx_rows_slices(cols).filter(|_| mx_rows_enabled())?;
    let kernel = format!("{kernel}{slices}");
    let threads = 256;
    let resident = (g.blocks_per_sm(&kernel, threads) * g.sms) as usize;
    let blocks = (resident / slots).clamp(1, units.div_ceil(8)) as u32;
    Some(SlotLaunch::new(kernel, blocks, threads))
}

/// Whether the streaming per-slot kernels are used where they fit
/// (`MOEFLUX_CUDA_SLOT_STREAM=0`: the one-pass `_qmv` kernels instead, to
/// compare the two).
fn slot_stream_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_SLOT_STREAM").map_or(true, |v| v != "0"))
}

/// The activation-stationary per-slot kernels (gate/up, down) for `slots`
/// slots of experts whose layout fits them (`grids`: the one-pass kernels'
/// blocks per slot, [`qmv_slot_grids`]): MXFP4 by whole rows where the row
/// width fits ([`mx_rows_launch`], each projection on its own), else
/// [`slot_launches_qmv`]'s.
fn slot_launches(
    g: &Gpu,
    l: &ExpertLayoutC,
    sfx: &str,
    slots: usize,
    grids: (u32, u32),
) -> [SlotLaunch; 2] {
    // 4-bit affine experts with `--gpu-activations q8`: by rows where the
    // widths fit, else the streaming `b4q8` kernels.
    if g.q8 && sfx == "b4" {
        if let Some(launches) = qdot_slot_launches(g, l, slots) {
            return launches;
        }
    }
    let sfx = if g.q8 && sfx == "b4" { "b4q8" } else { sfx };
    let [gate_up, down] = slot_launches_qmv(g, l, sfx, slots, grids);
    if sfx != "mx" {
        return [gate_up, down];
    }
    let (h, inter) = (l.hidden as usize, l.inter as usize);
    [
        mx_rows_launch(g, "moe_gate_up_rows_mx", h, inter, slots).unwrap_or(gate_up),
        mx_rows_launch(g, "moe_down_rows_mx", inter, h.div_ceil(2), slots).unwrap_or(down),
    ]
}

/// Whether the per-slot row kernels on 8-bit activations are used where
/// they fit (`MOEFLUX_CUDA_SLOT_QDOT=0`: the streaming `b4q8` ones instead,
/// to compare the two).
fn slot_qdot_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOEFLUX_CUDA_SLOT_QDOT").map_or(true, |v| v != "0"))
}

/// Lanes a row of the experts' row kernels on 8-bit activations: fewer
/// lanes a row put more rows' loads in flight a warp. kbench, H200, µs per
/// layer's experts by lanes 32 / 16 / 8 (balanced grids): A3B gate/up 7.34 /
/// **6.55** / 8.56 and down 6.34 / 4.36 / **4.24**; 397B gate/up 18.16 /
/// **17.16** / 19.94 and down 10.57 / 8.88 / **8.48**.
const QDOT_GATE_UP_LANES: usize = 16;
const QDOT_DOWN_LANES: usize = 8;

/// The per-slot row kernels on 8-bit activations (`moe_gate_up_qdot{LPR}`,
/// `moe_down_qdot{LPR}` in kernels/moe.cu) for `slots` slots of 4-bit affine
/// experts (gate/up and down alike, [`qdot_fit_width`]'s widths): LPR
/// lanes a row ([`QDOT_GATE_UP_LANES`], [`QDOT_DOWN_LANES`], fewer where
/// the input has fewer 32-column blocks); blocks per slot balanced
/// ([`balanced_blocks`]). Every slot's sums are the same whatever the grid
/// (a decode batch equals each sequence alone).
fn qdot_slot_launches(g: &Gpu, l: &ExpertLayoutC, slots: usize) -> Option<[SlotLaunch; 2]> {
    let (h, inter) = (l.hidden as usize, l.inter as usize);
    let fits = |cols: usize| qdot_fit_width(4, l.gs as usize, cols);
    if !slot_qdot_enabled() || l.mx != 0 || l.bits != 4 || !uniform(l) || !fits(h) || !fits(inter) {
        return None;
    }
    let lanes = |most: usize, cols: usize| {
        [16, 8, 4, 2]
            .into_iter()
            .find(|&lpr| lpr <= most && cols / 32 >= lpr)
    };
    // `rows` rows of `units` rows a lane group (gate/up: a row of both).
    let launch = |kernel: String, lanes: usize, rows: usize, units: usize, cols: usize| {
        let sets = rows.div_ceil(8 * 32 / lanes * units);
        let smem = qdot_smem(1, cols);
        let resident = g.blocks_per_sm_smem(&kernel, 256, smem) * g.sms;
        SlotLaunch {
            blocks: balanced_blocks(sets, slots, resident as usize),
            kernel,
            threads: 256,
            smem,
        }
    };
    let (gate_up, down) = (
        lanes(QDOT_GATE_UP_LANES, h)?,
        lanes(QDOT_DOWN_LANES, inter)?,
    );
    Some([
        launch(format!("moe_gate_up_qdot{gate_up}"), gate_up, inter, 1, h),
        launch(format!("moe_down_qdot{down}"), down, h, 2, inter),
    ])
}

/// The streaming per-slot kernels where every slice of a row has its own
/// warp (4-, 8-bit or MXFP4 codes) and the one-pass grid would take
/// [`STREAM_MIN_WAVES`] waves of the SMs: as many blocks per slot as the SMs
/// hold at once, shared by the slots, each looping over its slot's row
/// groups; else the one-pass ones, one block per row group.
fn slot_launches_qmv(
    g: &Gpu,
    l: &ExpertLayoutC,
    sfx: &str,
    slots: usize,
    grids: (u32, u32),
) -> [SlotLaunch; 2] {
    let (h, inter, bits) = (l.hidden as usize, l.inter as usize, l.bits as usize);
    let streams = |cols: usize| {
        let rb = cols * bits / 8;
        rb < 512 || {
            let (slices, parts) = qmv_slices(rb);
            slices == parts
        }
    };
    let (gate_up_threads, down_threads) = (qmv_threads(h, bits), qmv_threads(inter, bits));
    let waves = (grids.0 as usize * slots).div_ceil(
        (g.blocks_per_sm(&format!("moe_gate_up_qmv_{sfx}"), gate_up_threads) * g.sms) as usize,
    );
    let stream = slot_stream_enabled()
        && matches!(sfx, "b4" | "b8" | "mx" | "b4q8")
        && streams(h)
        && streams(inter)
        && waves >= STREAM_MIN_WAVES;
    if !stream {
        return [
            SlotLaunch::new(format!("moe_gate_up_qmv_{sfx}"), grids.0, gate_up_threads),
            SlotLaunch::new(format!("moe_down_qmv_{sfx}"), grids.1, down_threads),
        ];
    }
    let gs = l.gs as usize;
    let chunks = if sfx == "mx" {
        MX_STREAM_CHUNKS
    } else {
        QMV_STREAM_CHUNKS
    };
    let launch = |kernel: String, threads: u32, rows: usize, rows_per_set: Option<usize>| {
        let sets = rows.div_ceil(rows_per_set.expect("qmv_slot_grids accepted the layout"));
        let resident = (g.blocks_per_sm(&kernel, threads) * g.sms) as usize;
        let blocks = (resident / slots).clamp(1, sets) as u32;
        SlotLaunch::new(kernel, blocks, threads)
    };
    [
        launch(
            format!("moe_gate_up_stream_{sfx}"),
            gate_up_threads,
            inter,
            qmv_rows_per_block(h, bits, gs, chunks / 2),
        ),
        launch(
            format!("moe_down_stream_{sfx}"),
            down_threads,
            h,
            qmv_rows_per_block(inter, bits, gs, chunks),
        ),
    ]
}

fn expert_layout(layer: usize, x: &ExpertLayout) -> Result<ExpertLayoutC> {
    let same =
        |a: &ComponentLayout, b: &ComponentLayout| a.spec == b.spec && a.scales_f32 == b.scales_f32;
    // Gate and up share one kernel launch; down has its own (and its own
    // width and group size), but MXFP4 and affine do not mix.
    if !same(&x.gate, &x.up) || x.gate.spec.mode != x.down.spec.mode {
        return Err(unsupported(format!(
            "layer {}: routed expert gate and up projections quantized differently, or \
             MXFP4 beside affine",
            layer
        )));
    }
    let (inter, hidden) = (x.gate.rows, x.gate.cols);
    let mx = x.gate.spec.mode == QuantMode::Mxfp4;
    let (gate_b, up_b, down_b) = if mx {
        // The MXFP4 kernels read a group's codes as one 16-byte load.
        let fits = x.gate.spec.group_size == 32
            && x.gate.spec.bits == 4
            && hidden.is_multiple_of(32)
            && inter.is_multiple_of(32)
            && [x.gate.weight, x.up.weight, x.down.weight]
                .iter()
                .all(|o| o.is_multiple_of(16));
        if !fits {
            return Err(unsupported(format!(
                "layer {}: MXFP4 routed experts of {inter} x {hidden} with codes at byte offsets \
                 {}, {}, {} (the kernels take groups of 32 columns, widths that are multiples of \
                 32 and 16-byte aligned codes)",
                layer, x.gate.weight, x.up.weight, x.down.weight
            )));
        }
        (0, 0, 0)
    } else {
        match (x.gate.biases, x.up.biases, x.down.biases) {
            (Some(g), Some(u), Some(d)) => (g, u, d),
            _ => {
                return Err(unsupported(format!(
                    "layer {}: affine routed experts without group biases",
                    layer
                )))
            }
        }
    };
    Ok(ExpertLayoutC {
        gate_w: x.gate.weight as i64,
        gate_s: x.gate.scales as i64,
        gate_b: gate_b as i64,
        up_w: x.up.weight as i64,
        up_s: x.up.scales as i64,
        up_b: up_b as i64,
        down_w: x.down.weight as i64,
        down_s: x.down.scales as i64,
        down_b: down_b as i64,
        inter: inter as i32,
        hidden: hidden as i32,
        bits: x.gate.spec.bits as i32,
        gs: x.gate.spec.group_size as i32,
        sf32: x.gate.scales_f32 as i32,
        down_bits: x.down.spec.bits as i32,
        down_gs: x.down.spec.group_size as i32,
        down_sf32: x.down.scales_f32 as i32,
        mx: mx as i32,
        oai: 0,
        alpha: 0.0,
        limit: 0.0,
        bias_g: 0,
        bias_u: 0,
        bias_d: 0,
        ids: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::{heaviest, mx_rows_slices, ExpertUsers};

    #[test]
    fn mx_rows_take_rows_of_two_to_four_slices() {
        // gpt-oss's 2,880 columns: 1,440 bytes, three slices; the small
        // synth model's 1,088 and 5,440 (two, eleven).
        assert_eq!(mx_rows_slices(2880), Some(3));
        assert_eq!(mx_rows_slices(1088), Some(2));
        assert_eq!(mx_rows_slices(4096), Some(4));
        assert_eq!(mx_rows_slices(1024), None);
        assert_eq!(mx_rows_slices(4128), None);
        assert_eq!(mx_rows_slices(5440), None);
    }

    #[test]
    fn an_expert_weighs_what_its_heaviest_slot_gives_it() {
        let w = heaviest(&[3, 5, 3, 7], &[0.2, 0.6, 0.5, 0.1]);
        assert_eq!((w[&3], w[&5], w[&7]), (0.5, 0.6, 0.1));
        assert_eq!(w.len(), 3);
    }

    #[test]
    fn predicted_experts_most_chosen_first() {
        let order = |ids: &[i32]| ExpertUsers::new(ids, 10).unwrap().most_chosen_first();
        // Two tokens x top-3: experts 2 and 7 twice, 4 and 9 once.
        assert_eq!(order(&[9, 7, 2, 7, 4, 2]), vec![2, 7, 4, 9]);
        assert_eq!(order(&[5, 1, 3]), vec![1, 3, 5]);
        assert!(order(&[]).is_empty());
    }

    #[test]
    fn a_choice_groups_by_expert_as_a_map_of_slot_lists() {
        // Random choices, as many slots as a 512-token step of top-8 over
        // 256 experts, and a few with most experts unchosen.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        for (slots, e, spread) in [(4096, 256, 256), (40, 128, 7), (0, 16, 16), (1, 1, 1)] {
            let ids: Vec<i32> = (0..slots).map(|_| (next() % spread) as i32).collect();
            let mut want = std::collections::BTreeMap::<usize, Vec<i32>>::new();
            for (j, &id) in ids.iter().enumerate() {
                want.entry(id as usize).or_default().push(j as i32);
            }
            let got = ExpertUsers::new(&ids, e).unwrap();
            assert_eq!(
                got.experts().collect::<Vec<_>>(),
                want.keys().copied().collect::<Vec<_>>()
            );
            for x in 0..e {
                assert_eq!(
                    &got[x],
                    want.get(&x).map_or(&[][..], |v| &v[..]),
                    "expert {x}"
                );
            }
        }
        let err = ExpertUsers::new(&[3, 16], 16).err().unwrap().to_string();
        assert!(err.contains("expert 16 of 16"), "{err}");
        assert!(ExpertUsers::new(&[-1], 16).is_err());
    }
}
