//! Two GPUs of one process (`--gpus 0,1`: routed experts sharded, each MoE
//! layer's partial outputs summed by NCCL) against one GPU and the
//! goldens: every family's fixtures (batch, incremental, prefill+decode),
//! synthetic models through evicting caches, the host tier, prefetch and
//! host-computed experts, snapshots that move to one GPU and the CPU, and
//! exact truncation. Skipped, with a message, where fewer than two GPUs
//! exist.

use moeflux::backend::cuda::{CachePolicy, GpuSelection};
use moeflux::session::Prefetch;
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

/// A fixture on two GPUs, three ways, against its golden (`check`) and
/// against one GPU (the GPU guard).
fn fixture_on_two(name: &str, check: Check) {
    let golden = Golden::load(&fixtures().join(name));
    let (_tmp, dir) = convert_fixture(&format!("{name}/src"), None);
    let rows2 = eval_three_ways(&golden, || two_default(&dir));
    let rows1 = eval_three_ways(&golden, || gpu(&dir));
    for ((mode, got), one) in EVAL_MODES.iter().zip(&rows2).zip(&rows1) {
        check(&format!("{name} 2 GPUs {mode}"), &golden, got);
        let d = max_rel_diff(got, one);
        eprintln!("{name} {mode}: 2 GPUs vs 1 max rel diff {d:e}");
        assert!(d <= GUARD, "{name} {mode}: 2 GPUs vs 1 max rel diff {d:e}");
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
    let toks = random_tokens(40, one.vocab_size());
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
    // Every expert resident on its GPU (decode by the device's table).
    let mut g = two_default(dir);
    let rows = one_token_at_a_time(&mut g, &toks);
    let d = max_rel_diff(&rows, &want);
    assert!(d <= GUARD, "resident incremental: 2 GPUs vs 1 {d:e}");
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
