//! Session behaviour: snapshots, checkpoints, truncation, bad input.

mod common;

use common::{convert_fixture, fixtures, open, Golden};
use moeflux::{Error, LogitsMode};

fn setup() -> (tempfile::TempDir, std::path::PathBuf, Golden) {
    let golden = Golden::load(&fixtures().join("qwen35moe-q4"));
    let (tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    (tmp, dir, golden)
}

#[test]
fn snapshot_roundtrip_reproduces_next_logits_bit_for_bit() {
    let (_t, dir, g) = setup();
    let mut s = open(&dir);
    s.eval(&g.tokens[..20], LogitsMode::Last).unwrap();
    let snap = s.state_save().unwrap();
    let expected = s.eval(&g.tokens[20..23], LogitsMode::All).unwrap();

    // Into a fresh session...
    let mut fresh = open(&dir);
    fresh.state_load(&snap).unwrap();
    assert_eq!(fresh.position(), 20);
    assert_eq!(fresh.tokens(), &g.tokens[..20]);
    assert_eq!(
        fresh.eval(&g.tokens[20..23], LogitsMode::All).unwrap(),
        expected
    );

    // ...and back into the session that moved on.
    s.state_load(&snap).unwrap();
    assert_eq!(
        s.eval(&g.tokens[20..23], LogitsMode::All).unwrap(),
        expected
    );
}

#[test]
fn bad_snapshots_are_rejected_and_leave_the_session_untouched() {
    let (_t, dir, g) = setup();
    let mut s = open(&dir);
    s.eval(&g.tokens[..12], LogitsMode::Last).unwrap();
    let snap = s.state_save().unwrap();
    s.eval(&g.tokens[12..16], LogitsMode::Last).unwrap();
    let before = s.state_save().unwrap();

    let mut cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("truncated", snap[..snap.len() - 9].to_vec()),
        ("header only", snap[..40].to_vec()),
        ("extra byte", [snap.clone(), vec![0]].concat()),
    ];
    let mut bad_magic = snap.clone();
    bad_magic[0] ^= 0xff;
    cases.push(("bad magic", bad_magic));
    let mut bad_version = snap.clone();
    bad_version[8] = 99;
    cases.push(("bad version", bad_version));
    let mut bad_shape = snap.clone();
    bad_shape[16 + 8 * 2] ^= 1; // hidden_size word
    cases.push(("wrong hidden_size", bad_shape));
    let mut flipped = snap.clone();
    let mid = snap.len() / 2;
    flipped[mid] ^= 0x40;
    cases.push(("corrupted body", flipped));

    for (what, bytes) in cases {
        let err = s.state_load(&bytes).unwrap_err();
        assert!(matches!(err, Error::Snapshot(_)), "{what}: {err}");
        assert_eq!(s.state_save().unwrap(), before, "{what}: session changed");
    }

    // A snapshot of a different model (same tiny widths, other weights).
    let (_t2, other) = convert_fixture("qwen35moe-q2/src", None);
    let mut o = open(&other);
    o.eval(&g.tokens[..3], LogitsMode::Last).unwrap();
    let err = s.state_load(&o.state_save().unwrap()).unwrap_err();
    assert!(err.to_string().contains("model_fingerprint"), "{err}");
    assert_eq!(s.state_save().unwrap(), before);
}

#[test]
fn truncate_then_reeval_equals_a_fresh_eval() {
    let (_t, dir, g) = setup();
    let fresh = open(&dir).eval(&g.tokens, LogitsMode::All).unwrap();
    let v = g.vocab;

    let mut s = open(&dir);
    s.eval(&g.tokens[..10], LogitsMode::Last).unwrap();
    assert_eq!(s.checkpoint(), 10);
    s.eval(&g.tokens[10..27], LogitsMode::Last).unwrap();
    // Linear layers restart from the checkpoint at 10 and replay 10..15.
    s.truncate(15).unwrap();
    assert_eq!(s.position(), 15);
    let again = s.eval(&g.tokens[15..], LogitsMode::All).unwrap();
    assert_eq!(again, fresh[15 * v..]);

    // Exactly at a checkpoint, via restore_to.
    s.restore_to(10).unwrap();
    let again = s.eval(&g.tokens[10..], LogitsMode::All).unwrap();
    assert_eq!(again, fresh[10 * v..]);
}

#[test]
fn truncate_without_a_checkpoint_is_a_typed_error() {
    let (_t, dir, g) = setup();
    let mut s = open(&dir);
    s.eval(&g.tokens[..8], LogitsMode::Last).unwrap();
    let before = s.state_save().unwrap();
    let err = s.truncate(5).unwrap_err();
    assert!(
        matches!(err, Error::NoCheckpoint { requested: 5, .. }),
        "{err}"
    );
    assert!(matches!(
        s.restore_to(6).unwrap_err(),
        Error::NoCheckpoint { .. }
    ));
    assert!(matches!(
        s.truncate(9).unwrap_err(),
        Error::PositionBeyondEnd { .. }
    ));
    assert_eq!(s.state_save().unwrap(), before);
    // Truncating to 0 is always possible.
    s.truncate(0).unwrap();
    assert_eq!(s.position(), 0);
}

#[test]
fn checkpoints_are_capped_and_dropped_after_restore() {
    let (_t, dir, g) = setup();
    let mut s = moeflux::Session::open(
        &dir,
        moeflux::SessionOptions {
            max_checkpoints: 2,
            ..Default::default()
        },
    )
    .unwrap();
    for i in 0..4 {
        s.eval(&g.tokens[i * 2..i * 2 + 2], LogitsMode::Last)
            .unwrap();
        s.checkpoint();
    }
    assert_eq!(s.checkpoints(), vec![6, 8]);
    s.restore_to(6).unwrap();
    assert_eq!(s.checkpoints(), vec![6]);
    s.clear();
    assert!(s.checkpoints().is_empty());
}

#[test]
fn bad_tokens_are_rejected_without_changing_state() {
    let (_t, dir, g) = setup();
    let mut s = open(&dir);
    s.eval(&g.tokens[..4], LogitsMode::Last).unwrap();
    let before = s.state_save().unwrap();
    let err = s
        .eval(&[1, 2, g.vocab as u32], LogitsMode::Last)
        .unwrap_err();
    assert!(
        matches!(err, Error::TokenOutOfRange { index: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&g.vocab.to_string()));
    assert!(matches!(
        s.eval(&[], LogitsMode::Last).unwrap_err(),
        Error::EmptyTokens
    ));
    assert_eq!(s.state_save().unwrap(), before);
    assert_eq!(s.position(), 4);
}

#[test]
fn fewer_experts_per_token_runs_and_differs() {
    let (_t, dir, g) = setup();
    let full = open(&dir).eval(&g.tokens[..6], LogitsMode::Last).unwrap();
    let mut s = moeflux::Session::open(
        &dir,
        moeflux::SessionOptions {
            experts_per_token: Some(1),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(s.experts_per_token(), 1);
    let one = s.eval(&g.tokens[..6], LogitsMode::Last).unwrap();
    assert!(one.iter().all(|v| v.is_finite()));
    assert_ne!(one, full);
    let err = moeflux::Session::open(
        &dir,
        moeflux::SessionOptions {
            experts_per_token: Some(99),
            ..Default::default()
        },
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("99"), "{err}");
}

#[test]
fn max_snapshot_len_is_the_snapshot_at_the_context_limit() {
    let (_t, dir, g) = setup();
    let mut s = moeflux::Session::open(
        &dir,
        moeflux::SessionOptions {
            threads: Some(2),
            max_context: Some(20),
            ..Default::default()
        },
    )
    .unwrap();
    let bound = s.max_snapshot_len();
    assert!(bound > s.state_save().unwrap().len() as u64);
    s.eval(&g.tokens[..20], LogitsMode::Last).unwrap();
    assert_eq!(s.state_save().unwrap().len() as u64, bound);
}
