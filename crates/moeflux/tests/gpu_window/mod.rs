//! gpt-oss's sliding-window layers on the GPU keep their rows in a ring
//! bounded by the window and the largest chunk evaluated: logits equal the
//! CPU's through prompts of several windows and decodes past several wraps
//! (alone, in decode batches, through the decode graph), rewinds succeed
//! and fail at the same positions as on the CPU, checkpoints and snapshots
//! move between the backends, and VRAM rows stay bounded.

use moeflux::{Backend, Batch, LogitsMode, Session, SessionOptions, Work};

use super::common::convert_fixture;
use super::{cpu, gpu, max_rel_diff, GUARD};

/// gptoss-q4 (window 8, layers alternating sliding and full) and tokens
/// for 40 windows.
fn setup() -> (tempfile::TempDir, std::path::PathBuf, usize, Vec<u32>) {
    let (tmp, dir) = convert_fixture("gptoss-q4/src", None);
    let s = cpu(&dir);
    let window = s.config().attention_window[0].expect("layer 0 slides");
    let vocab = s.vocab_size();
    let tokens = (0..40 * window)
        .map(|i| ((i * 131 + 7) % vocab) as u32)
        .collect();
    (tmp, dir, window, tokens)
}

/// The rows a window layer's ring may take after chunks of at most
/// `chunk` tokens: the host cache's most rows after a step
/// (`KvCache::max_held`) plus a chunk, to the next power of two.
fn ring_bound(window: usize, chunk: usize) -> usize {
    (window + 2 * window.div_ceil(2) - 2 + chunk).next_power_of_two()
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    let d = max_rel_diff(got, want);
    assert!(d <= GUARD, "{what}: GPU vs CPU max rel diff {d:e}");
}

/// Evaluates `tokens` one at a time on both, comparing every step.
fn decode_both(what: &str, g: &mut Session, c: &mut Session, tokens: &[u32]) {
    for (i, t) in tokens.iter().enumerate() {
        let a = g.eval(&[*t], LogitsMode::Last).unwrap();
        let b = c.eval(&[*t], LogitsMode::Last).unwrap();
        close(&format!("{what}: decode {i}"), &a, &b);
    }
}

/// Checks the window layers' rows against `bound` and the full layers'
/// against the position.
fn check_rows(s: &Session, bound: usize) {
    let windows = &s.config().attention_window;
    for (i, rows) in s.cache_rows().into_iter().enumerate() {
        let rows = rows.expect("an attention layer");
        match windows[i] {
            Some(_) => assert!(rows <= bound, "layer {i}: {rows} rows, bound {bound}"),
            None => assert!(rows >= s.position(), "layer {i}: {rows} rows"),
        }
    }
}

#[test]
#[ignore]
fn gpu_window_layers_match_the_cpu_past_several_wraps_in_bounded_rows() {
    let (_t, dir, w, toks) = setup();
    let (mut g, mut c) = (gpu(&dir), cpu(&dir));
    // Decoded token by token from the start: the ring stays at its least.
    decode_both("from empty", &mut g, &mut c, &toks[..4 * w]);
    check_rows(&g, ring_bound(w, 1));
    decode_both("past several wraps", &mut g, &mut c, &toks[4 * w..8 * w]);
    check_rows(&g, ring_bound(w, 1));
    // The ring is used: fewer rows than positions.
    assert!(g.cache_rows()[0].unwrap() < g.position() / 2);

    // A prompt of five windows and then some in one chunk (the ring grows
    // to hold it), then decode past several wraps of that ring.
    let (mut g, mut c) = (gpu(&dir), cpu(&dir));
    let p = 5 * w + 3;
    let a = g.eval(&toks[..p], LogitsMode::All).unwrap();
    let b = c.eval(&toks[..p], LogitsMode::All).unwrap();
    close("prompt", &a, &b);
    let bound = ring_bound(w, p);
    check_rows(&g, bound);
    let d = p + 3 * bound;
    decode_both("after the prompt", &mut g, &mut c, &toks[p..d]);
    check_rows(&g, bound);
    // Chunks of a few tokens wrapping within themselves.
    for chunk in toks[d..d + 6 * w].chunks(w - 3) {
        let a = g.eval(chunk, LogitsMode::All).unwrap();
        let b = c.eval(chunk, LogitsMode::All).unwrap();
        close("chunks", &a, &b);
    }
    check_rows(&g, bound);

    // The snapshots hold the same rows as the CPU's (equal lengths: only
    // the window's), and each moves to the other backend.
    let (sg, sc) = (g.state_save().unwrap(), c.state_save().unwrap());
    assert_eq!(
        sg.len(),
        sc.len(),
        "GPU and CPU snapshots hold different rows"
    );
    let at = g.position();
    let next = &toks[at..at + 3 * w];
    let mut from_gpu = cpu(&dir);
    from_gpu.state_load(&sg).unwrap();
    let mut from_cpu = gpu(&dir);
    from_cpu.state_load(&sc).unwrap();
    for (i, t) in next.iter().enumerate() {
        let want = c.eval(&[*t], LogitsMode::Last).unwrap();
        let on_cpu = from_gpu.eval(&[*t], LogitsMode::Last).unwrap();
        let on_gpu = from_cpu.eval(&[*t], LogitsMode::Last).unwrap();
        close(&format!("GPU snapshot on the CPU, {i}"), &on_cpu, &want);
        close(&format!("CPU snapshot on the GPU, {i}"), &on_gpu, &want);
    }
    check_rows(&from_cpu, ring_bound(w, 1));
}

#[test]
#[ignore]
fn gpu_window_rewinds_succeed_and_fail_where_the_cpus_do() {
    let (_t, dir, w, toks) = setup();
    let (mut g, mut c) = (gpu(&dir), cpu(&dir));
    let p = 3 * w + 1;
    g.eval(&toks[..p], LogitsMode::Last).unwrap();
    c.eval(&toks[..p], LogitsMode::Last).unwrap();
    decode_both("before", &mut g, &mut c, &toks[p..6 * w]);

    // Every position back to 0: within the slack both truncate, past it
    // both refuse (a typed error, nothing changed), and 0 always works.
    let mut refused = 0;
    for n in (0..g.position()).rev() {
        let (a, b) = (g.truncate(n), c.truncate(n));
        assert_eq!(
            a.is_ok(),
            b.is_ok(),
            "truncate to {n}: GPU {a:?}, CPU {b:?}"
        );
        if let Err(e) = a {
            assert!(
                matches!(e, moeflux::Error::NoCheckpoint { requested, .. } if requested == n),
                "{e}"
            );
            refused += 1;
        }
        assert_eq!(g.position(), c.position());
        if n == 6 * w - 2 {
            // Re-decode after a short rewind, then come back.
            decode_both("after 2 back", &mut g, &mut c, &toks[n..n + 2]);
        }
    }
    assert!(refused > 0, "no position needed a checkpoint");
    assert_eq!(g.position(), 0);

    // A checkpoint keeps the window's rows: back to it from far past, and
    // past it (replaying from it), on the GPU as on the CPU.
    let ck = 2 * w + 3;
    g.eval(&toks[..ck], LogitsMode::Last).unwrap();
    c.eval(&toks[..ck], LogitsMode::Last).unwrap();
    assert_eq!(g.checkpoint(), ck);
    c.checkpoint();
    decode_both("past the checkpoint", &mut g, &mut c, &toks[ck..ck + 5 * w]);
    g.restore_to(ck).unwrap();
    c.restore_to(ck).unwrap();
    decode_both("restored", &mut g, &mut c, &toks[ck..ck + 3 * w]);
    let n = ck + 2 * w;
    g.truncate(n).unwrap();
    c.truncate(n).unwrap();
    assert_eq!(g.position(), n);
    decode_both(
        "truncated past the checkpoint",
        &mut g,
        &mut c,
        &toks[n..n + 2 * w],
    );
}

/// Sequences whose rings differ (one grown by a long prompt) decode
/// together: one launch reads each sequence's ring with its own mask.
#[test]
#[ignore]
fn gpu_window_decode_batches_read_each_ring() {
    let (_t, dir, w, toks) = setup();
    let mut b = Batch::open(
        &dir,
        SessionOptions {
            backend: Backend::Cuda,
            ..Default::default()
        },
    )
    .unwrap();
    let prompts = [&toks[..1], &toks[w..6 * w + 5], &toks[2 * w..4 * w]];
    let ids: Vec<_> = prompts.iter().map(|_| b.add_sequence().unwrap()).collect();
    let mut alone: Vec<Session> = prompts.iter().map(|_| cpu(&dir)).collect();
    for (s, p) in prompts.iter().enumerate() {
        b.eval(ids[s], p, LogitsMode::Last).unwrap();
        alone[s].eval(p, LogitsMode::Last).unwrap();
    }
    let rings: Vec<_> = ids.iter().map(|&id| b.cache_rows(id).unwrap()[0]).collect();
    assert_ne!(rings[0], rings[1], "the rings should differ: {rings:?}");
    for step in 0..6 * w {
        let tokens: Vec<[u32; 1]> = (0..ids.len())
            .map(|s| [toks[(7 * step + 11 * s) % toks.len()]])
            .collect();
        let work: Vec<Work> = ids
            .iter()
            .zip(&tokens)
            .map(|(&seq, t)| Work {
                seq,
                tokens: t,
                logits: Some(LogitsMode::Last),
            })
            .collect();
        for (s, got) in b.step(&work).unwrap().into_iter().enumerate() {
            let want = alone[s].eval(&tokens[s], LogitsMode::Last).unwrap();
            close(
                &format!("batch step {step}, sequence {s}"),
                &got.unwrap().into_logits(),
                &want,
            );
        }
    }
}
