//! Sequence state of MLA models: snapshots hold the latent and rotary-key
//! rows and restore them exactly; truncation is exact (every layer is
//! attention); `auto` picks the GPU for the family when there is one.
//! Also: version 1 snapshots (before MLA) of Qwen models still load.

mod common;

use common::{convert_fixture, fixtures, open, Golden};
use moeflux::{Backend, LogitsMode, Session, SessionOptions};

#[test]
fn mla_snapshot_roundtrip_and_exact_truncate() {
    let golden = Golden::load(&fixtures().join("deepseekv3-q4"));
    let (_tmp, dir) = convert_fixture("deepseekv3-q4/src", None);
    let toks = &golden.tokens;

    let mut a = open(&dir);
    a.eval(&toks[..20], LogitsMode::All).unwrap();
    let snap = a.state_save().unwrap();
    let want = a.eval(&toks[20..], LogitsMode::All).unwrap();

    let mut b = open(&dir);
    b.eval(&toks[..3], LogitsMode::Last).unwrap();
    b.state_load(&snap).unwrap();
    assert_eq!(b.position(), 20);
    assert_eq!(b.eval(&toks[20..], LogitsMode::All).unwrap(), want);

    // A corrupted snapshot is refused and leaves the session as it was.
    let mut bad = snap.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 1;
    assert!(b.state_load(&bad).is_err());
    assert_eq!(b.position(), 32);

    // Truncate: no checkpoint needed, rows dropped exactly.
    a.truncate(10).unwrap();
    let after = a.eval(&toks[10..], LogitsMode::All).unwrap();
    let mut fresh = open(&dir);
    fresh.eval(&toks[..10], LogitsMode::All).unwrap();
    assert_eq!(fresh.eval(&toks[10..], LogitsMode::All).unwrap(), after);
}

/// `auto` runs the DeepSeek family on a GPU when one can be used, and on
/// the CPU (saying why) when not; an MLA snapshot taken on whichever
/// backend `auto` chose loads on the CPU backend and continues identically
/// there. (GPU-side agreement with the CPU and the goldens: tests/gpu.rs.)
#[test]
fn deepseek_auto_backend_follows_the_gpu() {
    let golden = Golden::load(&fixtures().join("deepseekv3-q4"));
    let (_tmp, dir) = convert_fixture("deepseekv3-q4/src", None);
    let gpu_usable = moeflux::backend::cuda::Gpu::open().is_ok();
    let mut auto = Session::open(
        &dir,
        SessionOptions {
            backend: Backend::Auto,
            threads: Some(2),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(auto.on_gpu(), gpu_usable, "{}", auto.backend());
    if !gpu_usable {
        assert!(
            auto.backend().starts_with("cpu (no GPU: "),
            "{}",
            auto.backend()
        );
    }
    let toks = &golden.tokens;
    auto.eval(&toks[..12], LogitsMode::All).unwrap();
    let snap = auto.state_save().unwrap();
    let mut cpu = open(&dir);
    cpu.state_load(&snap).unwrap();
    assert_eq!(cpu.position(), 12);
    let a = auto.eval(&toks[12..], LogitsMode::All).unwrap();
    let b = cpu.eval(&toks[12..], LogitsMode::All).unwrap();
    if gpu_usable {
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let d = a
            .iter()
            .zip(&b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(d <= 1e-4 * scale, "GPU vs CPU after a snapshot: {d:e}");
    } else {
        assert_eq!(a, b);
    }
}

/// Rewrites a version 3 snapshot of a model without MLA or sliding windows
/// as version 1 (15 shape words, no kv_lora_rank / qk_rope_head_dim, no
/// first-position words), with its checksum.
fn as_v1(v3: &[u8]) -> Vec<u8> {
    assert_eq!(u32::from_le_bytes(v3[8..12].try_into().unwrap()), 3);
    let words = u32::from_le_bytes(v3[12..16].try_into().unwrap()) as usize;
    assert_eq!(words, 17);
    let tail_words = &v3[16 + 15 * 8..16 + 17 * 8];
    assert!(tail_words.iter().all(|&b| b == 0), "model has MLA words");
    // Shape word 11: attention layers, one first-position word each.
    let attention = u64::from_le_bytes(v3[16 + 11 * 8..16 + 12 * 8].try_into().unwrap()) as usize;
    let starts = 16 + 17 * 8..16 + 17 * 8 + 8 * attention;
    assert!(v3[starts.clone()].iter().all(|&b| b == 0), "rows dropped");
    let mut out = Vec::new();
    out.extend_from_slice(&v3[..8]);
    out.extend_from_slice(&1u32.to_le_bytes());
    out.extend_from_slice(&15u32.to_le_bytes());
    out.extend_from_slice(&v3[16..16 + 15 * 8]);
    out.extend_from_slice(&v3[starts.end..v3.len() - 8]);
    let sum = moeflux::hash::fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

#[test]
fn qwen_version_1_snapshot_still_loads() {
    let golden = Golden::load(&fixtures().join("qwen35moe-q4"));
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let mut a = open(&dir);
    a.eval(&golden.tokens[..12], LogitsMode::All).unwrap();
    let v1 = as_v1(&a.state_save().unwrap());
    let want = a.eval(&golden.tokens[12..], LogitsMode::All).unwrap();
    let mut b = open(&dir);
    b.state_load(&v1).unwrap();
    assert_eq!(b.eval(&golden.tokens[12..], LogitsMode::All).unwrap(), want);
}
