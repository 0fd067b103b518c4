//! Two GPUs of one process (`--gpus 0,1`: routed experts sharded, each MoE
//! layer's partial outputs summed by NCCL) against one GPU and the
//! goldens: every family's fixtures (batch, incremental, prefill+decode),
//! synthetic models through evicting caches, the host tier, prefetch and
//! host-computed experts, snapshots that move to one GPU and the CPU, and
//! exact truncation; long batches split by tokens (one GPU's bits when
//! every GPU holds every expert); decode steps replayed as CUDA graphs
//! against eager ones; a GPU failing mid-step while its peer waits; two
//! processes joined by `--dist-init` against one process, and a rank that
//! is killed or cannot open its model stopping the other.
//! Skipped, with a message, where fewer than two GPUs exist.

use moeflux::backend::cuda::{CachePolicy, GpuSelection};
use moeflux::session::{Gds, Prefetch};
use moeflux::{Backend, LogitsMode, Session, SessionOptions};

use super::common::EVAL_MODES;
use super::common::{check_against_golden, convert_fixture, eval_three_ways, fixtures, Golden};
use super::{
    cpu, gpu, gpu_with, max_rel_diff, one_token_at_a_time, qwen_check, random_tokens, Check, GUARD,
};

/// Whether two GPUs exist; says why not otherwise.
fn two_gpus() -> bool {
    match moeflux::backend::cuda::device::device_count() {
        Ok(n) if n >= 2 => true,
        Ok(n) => {
            eprintln!("skipped: needs 2 GPUs, this host has {n}");
            false
        }
        Err(e) => {
            eprintln!("skipped: needs 2 GPUs ({e})");
            false
        }
    }
}

/// A session on GPUs 0 and 1 with `opts`' other settings.
fn two(dir: &std::path::Path, opts: SessionOptions) -> Session {
    let s = Session::open(
        dir,
        SessionOptions {
            backend: Backend::Cuda,
            gpus: GpuSelection::List(vec![0, 1]),
            ..opts
        },
    )
    .unwrap_or_else(|e| panic!("opening {} on GPUs 0,1: {e}", dir.display()));
    assert!(
        s.backend().contains("sharded over 2 GPUs"),
        "{}",
        s.backend()
    );
    s
}

fn two_default(dir: &std::path::Path) -> Session {
    two(dir, SessionOptions::default())
}

/// Two GPUs that each hold every expert (`replicate`, what a small model
/// gets by default) or only their shard.
fn two_replicating(dir: &std::path::Path, replicate: bool) -> Session {
    let s = two(
        dir,
        SessionOptions {
            replicate_experts: replicate,
            ..Default::default()
        },
    );
    assert_eq!(
        s.backend().contains("every GPU holds every expert"),
        replicate,
        "{}",
        s.backend()
    );
    s
}

/// A fixture on two GPUs, three ways, against its golden (`check`) and
/// against one GPU (the GPU guard), with the experts sharded and
/// replicated; replicated, one token at a time is one GPU's arithmetic,
/// bit for bit.
fn fixture_on_two(name: &str, check: Check) {
    let golden = Golden::load(&fixtures().join(name));
    let (_tmp, dir) = convert_fixture(&format!("{name}/src"), None);
    let rows1 = eval_three_ways(&golden, || gpu(&dir));
    for replicate in [false, true] {
        let rows2 = eval_three_ways(&golden, || two_replicating(&dir, replicate));
        for ((mode, got), one) in EVAL_MODES.iter().zip(&rows2).zip(&rows1) {
            let what = format!("{name} 2 GPUs (replicated: {replicate}) {mode}");
            check(&what, &golden, got);
            let d = max_rel_diff(got, one);
            eprintln!("{what}: vs 1 GPU max rel diff {d:e}");
            assert!(d <= GUARD, "{what}: vs 1 GPU max rel diff {d:e}");
            if replicate && *mode == "incremental" {
                assert!(got == one, "{what}: not one GPU's bits");
            }
        }
    }
}

#[test]
#[ignore]
fn two_gpus_match_one_on_the_goldens() {
    if !two_gpus() {
        return;
    }
    // Qwen3.5's gated shared expert, GLM's ungated one and noaux_tc
    // routing, gpt-oss's expert biases and MXFP4 experts, DeepSeek's MLA.
    for name in ["qwen35moe-q4", "qwen3next-q4", "glm4moe-q4", "gptoss-mxfp4"] {
        fixture_on_two(name, qwen_check);
    }
    fixture_on_two("deepseekv3-q4", check_against_golden);
}

/// Random tokens on two GPUs whose caches hold a layer's share of experts
/// plus a few (every layer evicts), in one batch and one token at a time,
/// then through the shared host tier with prefetch and host-computed
/// experts: one GPU's logits within the GPU guard.
fn synth_on_two(dir: &std::path::Path) {
    let mut one = gpu(dir);
    // Two GPUs sum the experts' partials in another order than one: tokens
    // whose routing nearly ties could pick other experts (gpu_ties).
    let toks = crate::gpu_ties::random_tokens_clear_of_ties(&mut cpu(dir), dir, 40);
    let want = one.eval(&toks, LogitsMode::All).unwrap();
    let experts = one.config().moe.num_experts;
    let store = one.expert_store();
    let extent = store.extent_bytes(store.layers().next().unwrap());
    let layers = store.layers().count();
    // Per GPU: a layer's half of the experts and a few more, less than its
    // share of all layers.
    let slots = experts.div_ceil(2) + 4;
    assert!(slots < layers * experts / 2, "nothing to evict");
    let budget = Some((slots * extent) as u64);
    for policy in [CachePolicy::LfuDa, CachePolicy::Lru] {
        let opts = || SessionOptions {
            gpu_memory: budget,
            cache_policy: policy,
            ..Default::default()
        };
        let mut g = two(dir, opts());
        let got = g.eval(&toks, LogitsMode::All).unwrap();
        let d = max_rel_diff(&got, &want);
        assert!(
            d <= GUARD,
            "{policy:?} batch: 2 GPUs vs 1 max rel diff {d:e}"
        );
        let s = g.gpu_cache_stats();
        assert!(s.misses > 0, "{policy:?}: never missed: {s:?}");
        let mut g = two(dir, opts());
        let rows = one_token_at_a_time(&mut g, &toks);
        let d = max_rel_diff(&rows, &want);
        assert!(
            d <= GUARD,
            "{policy:?} incremental: 2 GPUs vs 1 max rel diff {d:e}"
        );
        eprintln!("2 GPUs {policy:?}: {:?}", g.gpu_cache_stats());
    }
    // Misses read by cuFile into each GPU's slots (the group registers the
    // files once).
    if super::gds_usable(dir) {
        let mut g = two(
            dir,
            SessionOptions {
                gpu_memory: budget,
                direct_io: true,
                gds: Gds::On,
                ..Default::default()
            },
        );
        assert!(g.backend().contains("cuFile"), "{}", g.backend());
        let rows = one_token_at_a_time(&mut g, &toks);
        let d = max_rel_diff(&rows, &want);
        assert!(d <= GUARD, "cuFile incremental: 2 GPUs vs 1 {d:e}");
        let s = g.gpu_cache_stats();
        eprintln!("2 GPUs cuFile: {s:?}");
        assert!(s.file_reads > 0 && s.host_hits == 0, "{s:?}");
    }
    for (prefetch, cpu_experts) in [(Prefetch::Off, 0), (Prefetch::On, 1)] {
        let mut g = two(
            dir,
            SessionOptions {
                gpu_memory: budget,
                host_cache: Some(1 << 40),
                prefetch,
                cpu_experts,
                ..Default::default()
            },
        );
        assert!(g.backend().contains("host tier"), "{}", g.backend());
        let rows = one_token_at_a_time(&mut g, &toks);
        let d = max_rel_diff(&rows, &want);
        assert!(
            d <= GUARD,
            "host tier (prefetch {prefetch:?}, cpu {cpu_experts}): 2 GPUs vs 1 {d:e}"
        );
        let stats = g.gpu_cache_stats();
        eprintln!("2 GPUs host tier {prefetch:?} cpu {cpu_experts}: {stats:?}");
        assert_eq!(stats.cpu_computed > 0, cpu_experts > 0);
        assert_eq!(stats.prefetched > 0, prefetch == Prefetch::On);
    }
    // Every expert resident on its GPU (decode by the device's table),
    // sharded and replicated (then one GPU's bits: one token per step runs
    // on each GPU alone); a batch of 40 tokens splits the experts either way.
    let mut one_rows = gpu(dir);
    let want_rows = one_token_at_a_time(&mut one_rows, &toks);
    for replicate in [false, true] {
        let mut g = two_replicating(dir, replicate);
        let rows = one_token_at_a_time(&mut g, &toks);
        let d = max_rel_diff(&rows, &want);
        assert!(
            d <= GUARD,
            "resident incremental ({replicate}): 2 GPUs vs 1 {d:e}"
        );
        if replicate {
            assert!(rows == want_rows, "replicated decode: not one GPU's bits");
            // The group counts each use once (the lead), graphs or not.
            let k = g.config().moe.num_experts_per_tok;
            let uses = toks.len() * k * g.expert_store().layers().count();
            assert_eq!(g.gpu_cache_stats().hits, uses as u64);
        }
        let mut g = two_replicating(dir, replicate);
        let got = g.eval(&toks, LogitsMode::All).unwrap();
        let d = max_rel_diff(&got, &want);
        assert!(
            d <= GUARD,
            "resident batch ({replicate}): 2 GPUs vs 1 {d:e}"
        );
    }
}

#[test]
#[ignore]
fn two_gpus_match_one_through_evicting_caches() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    synth_on_two(&dir);
    let dir = tmp.path().join("synth-ds");
    super::synth_deepseek(&dir);
    synth_on_two(&dir);
}

/// A long batch on two GPUs that each hold every expert is split by tokens
/// (`token_split.rs`): each GPU projects and runs the MLP of its half of
/// the rows, every GPU runs the mixers' sequence part on all of them. Each
/// token's products are one GPU's, so the logits are one GPU's bits: a
/// prompt of odd length (the halves differ by a row), the decode steps
/// after it (the states every GPU built), and a batch of several
/// sequences that the split cuts inside a sequence. (Unsplit, the group
/// would sum the experts' partials in another order: not one GPU's bits.)
fn split_batches_are_one_gpus_bits(name: &str, dir: &std::path::Path) {
    use moeflux::{Batch, Work};
    let mut one = gpu(dir);
    let mut two = two_replicating(dir, true);
    let toks = random_tokens(301 + 8 + 400, one.vocab_size());
    let (prompt, rest) = toks.split_at(301);
    let want = one.eval(prompt, LogitsMode::All).unwrap();
    let got = two.eval(prompt, LogitsMode::All).unwrap();
    let d = max_rel_diff(&got, &want);
    assert!(got == want, "{name}: 301-token prompt: max rel diff {d:e}");
    for (i, t) in rest[..8].iter().enumerate() {
        let want = one.eval(&[*t], LogitsMode::Last).unwrap();
        let got = two.eval(&[*t], LogitsMode::Last).unwrap();
        assert!(
            got == want,
            "{name}: decode step {i} after the split prompt"
        );
    }
    // Three sequences in one step of 337 rows: the second GPU's half
    // starts inside the third prompt (the first two lie wholly in the
    // first GPU's; MLA attends per sequence, each GPU its share, at least
    // 16 rows so every product takes one GPU's kernels); then a step of
    // their three decodes.
    let opts = |gpus: Vec<usize>| SessionOptions {
        backend: moeflux::Backend::Cuda,
        gpus: GpuSelection::List(gpus),
        ..Default::default()
    };
    let mut b1 = Batch::open(dir, opts(vec![0])).unwrap();
    let mut b2 = Batch::open(dir, opts(vec![0, 1])).unwrap();
    let prompts = [&rest[8..128], &rest[128..135], &rest[135..345]];
    let next = [&rest[345..346], &rest[346..347], &rest[347..348]];
    let ids1: Vec<_> = (0..3).map(|_| b1.add_sequence().unwrap()).collect();
    let ids2: Vec<_> = (0..3).map(|_| b2.add_sequence().unwrap()).collect();
    for (what, parts) in [("prompts", prompts), ("decodes", next)] {
        let work = |ids: &[moeflux::SeqId]| -> Vec<Work> {
            ids.iter()
                .zip(parts)
                .map(|(&seq, tokens)| Work {
                    seq,
                    tokens,
                    logits: Some(LogitsMode::Last),
                })
                .collect()
        };
        let want = b1.step(&work(&ids1)).unwrap();
        let got = b2.step(&work(&ids2)).unwrap();
        for (s, (g, w)) in got.into_iter().zip(want).enumerate() {
            let (g, w) = (g.unwrap().into_logits(), w.unwrap().into_logits());
            let d = max_rel_diff(&g, &w);
            assert!(g == w, "{name}: batch of {what}, sequence {s}: {d:e}");
        }
    }
    eprintln!("{name}: split by tokens on 2 GPUs == 1 GPU bit for bit");
}

#[test]
#[ignore]
fn two_gpus_split_long_batches_by_tokens() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    split_batches_are_one_gpus_bits("synth", &dir);
    // Sharded experts: the mixers split by tokens, their output rows
    // shared, the MLP on every row with the experts split (partials summed
    // in another order than one GPU's: within the guard, on tokens clear
    // of routing ties), and the decode steps after it.
    let toks = crate::gpu_ties::random_tokens_clear_of_ties(&mut cpu(&dir), &dir, 264);
    let (prompt, rest) = toks.split_at(257);
    let mut one = gpu(&dir);
    let mut two = two_replicating(&dir, false);
    let want = one.eval(prompt, LogitsMode::All).unwrap();
    let got = two.eval(prompt, LogitsMode::All).unwrap();
    let d = max_rel_diff(&got, &want);
    eprintln!("synth sharded, 257-token prompt split by tokens: vs 1 GPU {d:e}");
    assert!(d <= GUARD, "sharded split prompt: vs 1 GPU {d:e}");
    let want = one_token_at_a_time(&mut one, rest);
    let got = one_token_at_a_time(&mut two, rest);
    let d = max_rel_diff(&got, &want);
    assert!(d <= GUARD, "sharded: decode after the split prompt: {d:e}");
    // Fused GatedDeltaNet projections, attention biases and GLM's dense
    // first layer, gpt-oss's sinks, windows and MXFP4 experts, DeepSeek's
    // MLA (latents shared, queries and attention split).
    let dir = tmp.path().join("synth-ds");
    super::synth_deepseek(&dir);
    split_batches_are_one_gpus_bits("synth-ds", &dir);
    for name in [
        "qwen3next-q4",
        "glm4moe-q4",
        "gptoss-mxfp4",
        "deepseekv3-q4",
    ] {
        let (_tmp, dir) = convert_fixture(&format!("{name}/src"), None);
        split_batches_are_one_gpus_bits(name, &dir);
    }
}

#[test]
#[ignore]
fn snapshots_from_two_gpus_load_on_one_and_the_cpu() {
    if !two_gpus() {
        return;
    }
    let golden = Golden::load(&fixtures().join("qwen35moe-q4"));
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let (p, toks) = (golden.prompt_len, &golden.tokens);
    let next = &toks[p..p + 1];

    let mut g2 = two_default(&dir);
    g2.eval(&toks[..p], LogitsMode::Last).unwrap();
    let snap = g2.state_save().unwrap();
    let want = g2.eval(next, LogitsMode::Last).unwrap();
    for (name, mut s) in [
        ("1 GPU", gpu_with(&dir, None, CachePolicy::default())),
        ("CPU", cpu(&dir)),
    ] {
        s.state_load(&snap).unwrap();
        let got = s.eval(next, LogitsMode::Last).unwrap();
        let d = max_rel_diff(&got, &want);
        assert!(d <= GUARD, "2-GPU snapshot on the {name}: {d:e}");
    }
    // And back: a CPU snapshot on two GPUs (uploaded to both).
    let mut c = cpu(&dir);
    c.eval(&toks[..p], LogitsMode::Last).unwrap();
    let snap = c.state_save().unwrap();
    let from_cpu = c.eval(next, LogitsMode::Last).unwrap();
    let mut g2 = two_default(&dir);
    g2.state_load(&snap).unwrap();
    let got = g2.eval(next, LogitsMode::Last).unwrap();
    let d = max_rel_diff(&got, &from_cpu);
    assert!(d <= GUARD, "CPU snapshot on 2 GPUs: {d:e}");

    // Truncation rewinds every GPU's copy: the same as a fresh eval of the
    // same batches, bit for bit.
    let mut g2 = two_default(&dir);
    g2.eval(&toks[..p - 4], LogitsMode::Last).unwrap();
    g2.checkpoint();
    g2.eval(&toks[p - 4..], LogitsMode::Last).unwrap();
    g2.truncate(p).unwrap();
    let again = g2.eval(next, LogitsMode::Last).unwrap();
    let mut fresh = two_default(&dir);
    fresh.eval(&toks[..p - 4], LogitsMode::Last).unwrap();
    fresh.eval(&toks[p - 4..p], LogitsMode::Last).unwrap();
    let want = fresh.eval(next, LogitsMode::Last).unwrap();
    assert_eq!(
        again, want,
        "truncate + re-eval on 2 GPUs differs from a fresh eval"
    );
}

#[test]
#[ignore]
fn a_missing_gpu_is_named() {
    if !two_gpus() {
        return;
    }
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let n = moeflux::backend::cuda::device::device_count().unwrap();
    let e = Session::open(
        &dir,
        SessionOptions {
            backend: Backend::Auto,
            gpus: GpuSelection::List(vec![0, n]),
            ..Default::default()
        },
    )
    .err()
    .expect("a GPU the host lacks");
    assert!(
        e.to_string().contains(&format!("there is no GPU {n}")),
        "{e}"
    );
}

/// Decode steps of two GPUs replayed as CUDA graphs (NCCL's all-reduces
/// captured with the kernels, the default) give exactly the eager steps'
/// logits, across KV-cache growth and `clear`; and through an evicting
/// cache (never graphed: not every expert resident) graphs on and off
/// agree too.
#[test]
#[ignore]
fn two_gpus_graph_decode_equals_eager_decode() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    let (experts, extent) = {
        let one = gpu(&dir);
        let store = one.expert_store();
        let extent = store.extent_bytes(store.layers().next().unwrap());
        (one.config().moe.num_experts, extent)
    };
    // Per GPU: a layer's half of the experts and a few, so every layer
    // evicts.
    let small = Some(((experts.div_ceil(2) + 4) * extent) as u64);
    for (gpu_memory, replicate_experts) in [(None, false), (None, true), (small, true)] {
        let open = |graphs: bool| {
            two(
                &dir,
                SessionOptions {
                    cuda_graphs: graphs,
                    gpu_memory,
                    replicate_experts,
                    ..Default::default()
                },
            )
        };
        let (mut eager, mut graph) = (open(false), open(true));
        let toks = random_tokens(150, eager.vocab_size());
        for round in 0..2 {
            eager.clear();
            graph.clear();
            let n = if round == 0 { toks.len() } else { 20 };
            for (i, &t) in toks[..n].iter().enumerate() {
                let a = eager.eval(&[t], LogitsMode::Last).unwrap();
                let b = graph.eval(&[t], LogitsMode::Last).unwrap();
                assert_eq!(
                    a, b,
                    "cache {gpu_memory:?}, round {round}, token {i}: 2-GPU graph replay differs"
                );
            }
        }
        let replayed = graph.times().gpu_graph > std::time::Duration::ZERO;
        assert_eq!(
            replayed,
            gpu_memory.is_none(),
            "cache {gpu_memory:?}: graphs replayed: {replayed}"
        );
        assert_eq!(eager.times().gpu_graph, std::time::Duration::ZERO);
    }
}

/// A GPU that fails mid-step (expert files cut short under the running
/// session, every miss read from them) stops its peer waiting in the
/// all-reduce: the step fails naming a file, the group refuses the next,
/// nothing hangs.
#[test]
#[ignore]
fn a_failing_gpu_stops_its_peer() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    let (experts, extent, vocab) = {
        let one = gpu(&dir);
        let store = one.expert_store();
        let extent = store.extent_bytes(store.layers().next().unwrap());
        (one.config().moe.num_experts, extent, one.vocab_size())
    };
    let small = Some(((experts.div_ceil(2) + 4) * extent) as u64);
    let toks = random_tokens(48, vocab);
    let mut s = two(
        &dir,
        SessionOptions {
            gpu_memory: small,
            direct_io: true,
            ..Default::default()
        },
    );
    one_token_at_a_time(&mut s, &toks[..16]);
    // The last quarter of every layer's experts, owned by both GPUs in turn:
    // a step where one GPU misses them and the other does not leaves the
    // other waiting for it.
    let cut = (experts - experts / 4) * extent;
    let mut files = Vec::new();
    for l in s.expert_store().layers() {
        let path = dir.join(moeflux::format::expert_file_name(l));
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.set_len(cut as u64).unwrap();
        files.push(path.display().to_string());
    }
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(120));
        if !watch.load(std::sync::atomic::Ordering::SeqCst) {
            eprintln!("a GPU's failure left its peer waiting for 120 s");
            std::process::exit(1);
        }
    });
    let mut failed = None;
    for &t in toks[16..].iter().cycle().take(200) {
        if let Err(e) = s.eval(&[t], LogitsMode::Last) {
            failed = Some(e.to_string());
            break;
        }
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let msg = failed.expect("no step failed on the cut expert files");
    assert!(
        files.iter().any(|p| msg.contains(p.as_str())),
        "the error names no expert file: {msg}"
    );
    s.clear();
    let again = s
        .eval(&toks[..1], LogitsMode::Last)
        .unwrap_err()
        .to_string();
    assert!(again.contains("stopped"), "{again}");
}

// Two processes, one GPU each, joined by `--dist-init` (`DistInit`): the
// test executable runs itself again as each rank, the child's role in
// these variables (`dist_rank_child` does nothing without them).
const CHILD_RANK: &str = "MOEFLUX_TEST_DIST_RANK";
const CHILD_URL: &str = "MOEFLUX_TEST_DIST_URL";
const CHILD_MODEL: &str = "MOEFLUX_TEST_DIST_MODEL";
const CHILD_TOKENS: &str = "MOEFLUX_TEST_DIST_TOKENS";
const CHILD_OUT: &str = "MOEFLUX_TEST_DIST_OUT";
/// After this many one-token steps the child writes `OUT.stop` and
/// waits; the parent then kills it (SIGKILL: a crash, without the core
/// dump an abort may spend minutes writing while its sockets stay open).
const CHILD_KILL_AFTER: &str = "MOEFLUX_TEST_DIST_KILL_AFTER";
/// Set: the child keeps to its shard of the experts (every step then
/// waits on the other rank's all-reduce).
const CHILD_SHARDED: &str = "MOEFLUX_TEST_DIST_SHARDED";
/// A child's exit status when an eval or the open failed (its error in
/// `OUT.err`).
const CHILD_FAILED: i32 = 3;

/// One rank of a two-process group, when run as a child: the tokens in one
/// batch (every row's logits), then one at a time after `clear`, written
/// to `OUT` as little-endian f32.
#[test]
#[ignore]
fn dist_rank_child() {
    let Ok(rank) = std::env::var(CHILD_RANK) else {
        return; // not a child: only the tests below run it
    };
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} unset"));
    let out = std::path::PathBuf::from(var(CHILD_OUT));
    let fail = |e: moeflux::Error| -> ! {
        std::fs::write(out.with_extension("err"), e.to_string()).unwrap();
        std::process::exit(CHILD_FAILED)
    };
    let toks: Vec<u32> = var(CHILD_TOKENS)
        .split(',')
        .map(|t| t.parse().unwrap())
        .collect();
    let kill_after: Option<usize> = std::env::var(CHILD_KILL_AFTER)
        .ok()
        .map(|n| n.parse().unwrap());
    let dist = moeflux::session::DistInit::new(&var(CHILD_URL), rank.parse().unwrap(), 2).unwrap();
    let mut s = Session::open(
        std::path::Path::new(&var(CHILD_MODEL)),
        SessionOptions {
            backend: Backend::Cuda,
            dist: Some(dist),
            replicate_experts: std::env::var_os(CHILD_SHARDED).is_none(),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| fail(e));
    let mut logits = s.eval(&toks, LogitsMode::All).unwrap_or_else(|e| fail(e));
    s.clear();
    let t0 = std::time::Instant::now();
    for (i, &t) in toks.iter().enumerate() {
        if kill_after == Some(i) {
            std::fs::write(out.with_extension("stop"), b"").unwrap();
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        eprintln!("rank {rank}: step {i} at {:?}", t0.elapsed());
        logits.extend(s.eval(&[t], LogitsMode::Last).unwrap_or_else(|e| fail(e)));
    }
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&out, bytes).unwrap();
}

/// A finished child rank: its exit status, the logits it wrote, its error.
struct Child {
    status: std::process::ExitStatus,
    logits: Option<Vec<f32>>,
    error: Option<String>,
    /// Its stdout and stderr.
    log: String,
}

/// Runs ranks 0 and 1 on GPUs 0 and 1 (each child's role from `env(rank)`)
/// over `dir`'s model and `toks`, joined on a free local port; both must
/// end within `limit`.
fn run_two_ranks(
    tmp: &std::path::Path,
    dir: &std::path::Path,
    toks: &[u32],
    env: impl Fn(usize) -> Vec<(&'static str, String)>,
    limit: std::time::Duration,
) -> (Vec<Child>, std::time::Duration) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let toks: Vec<String> = toks.iter().map(|t| t.to_string()).collect();
    let start = std::time::Instant::now();
    let mut procs: Vec<_> = (0..2)
        .map(|rank| {
            let out = tmp.join(format!("rank{rank}.f32"));
            let log = std::fs::File::create(tmp.join(format!("rank{rank}.log"))).unwrap();
            let mut c = std::process::Command::new(&exe);
            c.args(["gpu_multi::dist_rank_child", "--exact", "--ignored"])
                .args(["--nocapture", "--test-threads=1"])
                .env(CHILD_RANK, rank.to_string())
                .env(CHILD_URL, format!("tcp://127.0.0.1:{port}"))
                .env(CHILD_MODEL, dir)
                .env(CHILD_TOKENS, toks.join(","))
                .env(CHILD_OUT, &out)
                .stdout(log.try_clone().unwrap())
                .stderr(log);
            for (k, v) in env(rank) {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    let mut statuses = vec![None; 2];
    while statuses.iter().any(Option::is_none) {
        if start.elapsed() > limit {
            for (rank, p) in procs.iter_mut().enumerate() {
                let _ = p.kill();
                let log = std::fs::read_to_string(tmp.join(format!("rank{rank}.log")));
                let err = std::fs::read_to_string(tmp.join(format!("rank{rank}.err")));
                eprintln!(
                    "--- rank {rank}, killed ({}):\n{}",
                    err.unwrap_or_default(),
                    log.unwrap_or_default()
                );
            }
            panic!("the two ranks did not end within {limit:?}");
        }
        for (rank, (p, s)) in procs.iter_mut().zip(&mut statuses).enumerate() {
            if s.is_none() {
                if tmp.join(format!("rank{rank}.stop")).exists() {
                    p.kill().unwrap();
                }
                *s = p.try_wait().unwrap();
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let took = start.elapsed();
    let children = statuses
        .into_iter()
        .enumerate()
        .map(|(rank, status)| {
            let out = tmp.join(format!("rank{rank}.f32"));
            let log = std::fs::read_to_string(tmp.join(format!("rank{rank}.log"))).unwrap();
            eprintln!("--- rank {rank}: {status:?}\n{log}");
            Child {
                status: status.unwrap(),
                logits: std::fs::read(&out).ok().map(|b| {
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                        .collect()
                }),
                error: std::fs::read_to_string(out.with_extension("err")).ok(),
                log,
            }
        })
        .collect();
    (children, took)
}

const NO_ENV: fn(usize) -> Vec<(&'static str, String)> = |_| Vec::new();

/// Two processes, one GPU each, give exactly the logits of one process on
/// the same two GPUs, in one batch (long enough to be split by tokens) and
/// one token at a time, on both ranks.
#[test]
#[ignore]
fn two_processes_match_one_process_on_two_gpus() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    let mut one = two_default(&dir);
    let vocab = one.vocab_size();
    let toks = random_tokens(260, vocab);
    let mut want = one.eval(&toks, LogitsMode::All).unwrap();
    one.clear();
    want.extend(one_token_at_a_time(&mut one, &toks));
    drop(one);
    let limit = std::time::Duration::from_secs(90);
    let (children, _) = run_two_ranks(tmp.path(), &dir, &toks, NO_ENV, limit);
    for (rank, c) in children.iter().enumerate() {
        assert!(
            c.status.success(),
            "rank {rank}: {:?} {:?}",
            c.status,
            c.error
        );
        let got = c.logits.as_ref().expect("logits written");
        assert_eq!(got.len(), want.len(), "rank {rank}");
        let batch = toks.len() * vocab;
        assert!(
            got[..batch] == want[..batch],
            "rank {rank}: batch logits differ from one process's"
        );
        assert!(
            got[batch..] == want[batch..],
            "rank {rank}: one-token logits differ from one process's"
        );
    }
}

fn one_vocab(dir: &std::path::Path) -> usize {
    gpu(dir).vocab_size()
}

/// A rank killed mid-run: the other fails within the watchdog's grace
/// (and `ABORT_WAIT`), naming the rank gone, instead of waiting on its
/// all-reduce forever. (Sharded: with every expert on both ranks, decode
/// steps never wait on the other, and the survivor may finish first.)
#[test]
#[ignore]
fn a_rank_that_is_killed_stops_the_other() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    let toks = random_tokens(24, one_vocab(&dir));
    let env = |rank: usize| {
        let mut e = vec![(CHILD_SHARDED, "1".to_string())];
        if rank == 1 {
            e.push((CHILD_KILL_AFTER, "5".to_string()));
        }
        e
    };
    let limit = std::time::Duration::from_secs(60);
    let (children, took) = run_two_ranks(tmp.path(), &dir, &toks, env, limit);
    eprintln!("rank 0 stopped after {took:?}");
    assert!(!children[1].status.success());
    // Its step fails with the error, or, where NCCL's abort cannot end the
    // step, the watchdog prints it and ends the process.
    let c = &children[0];
    assert!(!c.status.success(), "rank 0: {:?}", c.status);
    let said = format!("{}{}", c.error.as_deref().unwrap_or(""), c.log);
    assert!(
        said.contains("rank 1 (") && said.contains("left the group"),
        "{said}"
    );
}

/// A rank that cannot open its model never joins: the other gives up at
/// the rendezvous's timeout, naming the missing rank.
#[test]
#[ignore]
fn a_rank_with_a_bad_model_path_times_out_the_other() {
    if !two_gpus() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("synth");
    super::synth_model(&dir);
    let toks = random_tokens(4, one_vocab(&dir));
    let missing = tmp.path().join("no-such-model");
    let env = |rank: usize| {
        let mut v = vec![("MOEFLUX_DIST_TIMEOUT", "5".to_string())];
        if rank == 1 {
            v.push((CHILD_MODEL, missing.display().to_string()));
        }
        v
    };
    let limit = std::time::Duration::from_secs(45);
    let (children, _) = run_two_ranks(tmp.path(), &dir, &toks, env, limit);
    for (rank, c) in children.iter().enumerate() {
        assert_eq!(
            c.status.code(),
            Some(CHILD_FAILED),
            "rank {rank}: {:?}",
            c.error
        );
    }
    let e1 = children[1].error.as_deref().unwrap();
    assert!(e1.contains("no-such-model"), "{e1}");
    let e0 = children[0].error.as_deref().unwrap();
    assert!(
        e0.contains("timed out waiting for ranks") && e0.contains(": 1"),
        "{e0}"
    );
}
