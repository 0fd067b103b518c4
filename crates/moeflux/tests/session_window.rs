//! gpt-oss's sliding-window layers keep only their window (plus slack) in
//! the KV cache: short rewinds need no checkpoint, longer ones return to a
//! checkpoint (which keeps the window's rows) or fail with a typed error,
//! and snapshots store only the rows held.

mod common;

use common::{convert_fixture, open};
use moeflux::{Error, LogitsMode, Session, SessionOptions};

/// The fixture's window (8) is shorter than every sequence below.
fn setup() -> (tempfile::TempDir, std::path::PathBuf, usize, Vec<u32>) {
    let (tmp, dir) = convert_fixture("gptoss-q4/src", None);
    let s = open(&dir);
    let window = s.config().attention_window[0].expect("layer 0 slides");
    let vocab = s.vocab_size();
    let tokens = (0..8 * window)
        .map(|i| ((i * 131 + 7) % vocab) as u32)
        .collect();
    (tmp, dir, window, tokens)
}

/// Logits of every position of `tokens`, evaluated as one batch (its
/// attention holds every row while it runs).
fn reference(dir: &std::path::Path, tokens: &[u32]) -> Vec<f32> {
    open(dir).eval(tokens, LogitsMode::All).unwrap()
}

#[test]
fn a_rewind_within_the_slack_needs_no_checkpoint() {
    let (_t, dir, window, tokens) = setup();
    let v = open(&dir).vocab_size();
    let want = reference(&dir, &tokens);
    let mut s = open(&dir);
    let at = 5 * window;
    s.eval(&tokens[..at], LogitsMode::Last).unwrap();
    assert!(s.checkpoints().is_empty());
    // Back one token and a few (within half a window, the guaranteed slack).
    for back in [1, window / 2] {
        s.truncate(at - back).unwrap();
        assert_eq!(s.position(), at - back);
        let again = s.eval(&tokens[at - back..at], LogitsMode::All).unwrap();
        assert_eq!(again, want[(at - back) * v..at * v], "{back} back");
    }
}

#[test]
fn a_rewind_past_the_window_restores_from_a_checkpoint() {
    let (_t, dir, window, tokens) = setup();
    let v = open(&dir).vocab_size();
    let want = reference(&dir, &tokens);
    let mut s = open(&dir);
    let c = window + 3;
    s.eval(&tokens[..c], LogitsMode::Last).unwrap();
    assert_eq!(s.checkpoint(), c);
    let end = 6 * window;
    s.eval(&tokens[c..end], LogitsMode::Last).unwrap();

    // Exactly at the checkpoint: its window rows come back.
    s.restore_to(c).unwrap();
    let again = s.eval(&tokens[c..end], LogitsMode::All).unwrap();
    assert_eq!(again, want[c * v..end * v]);

    // Past it: back to the checkpoint, then the tokens up to n replayed.
    let n = c + 2 * window;
    s.truncate(n).unwrap();
    assert_eq!(s.position(), n);
    let again = s.eval(&tokens[n..], LogitsMode::All).unwrap();
    assert_eq!(again, want[n * v..]);
}

#[test]
fn a_rewind_past_the_window_without_a_checkpoint_is_a_typed_error() {
    let (_t, dir, window, tokens) = setup();
    let mut s = open(&dir);
    s.eval(&tokens[..5 * window], LogitsMode::Last).unwrap();
    let before = s.state_save().unwrap();
    let err = s.truncate(window).unwrap_err();
    assert!(
        matches!(err, Error::NoCheckpoint { requested, .. } if requested == window),
        "{err}"
    );
    assert!(err.to_string().contains("sliding-window"), "{err}");
    assert!(matches!(
        s.restore_to(window).unwrap_err(),
        Error::NoCheckpoint { .. }
    ));
    assert_eq!(
        s.state_save().unwrap(),
        before,
        "a refused rewind changed the state"
    );
    // Position 0 never needs one.
    s.truncate(0).unwrap();
    assert_eq!(s.position(), 0);
}

#[test]
fn a_snapshot_holds_only_the_window_and_restores_exactly() {
    let (_t, dir, window, tokens) = setup();
    let at = 6 * window;
    let mut s = open(&dir);
    s.eval(&tokens[..at], LogitsMode::Last).unwrap();
    let snap = s.state_save().unwrap();
    let want = s.eval(&tokens[at..], LogitsMode::All).unwrap();

    // Smaller than a snapshot holding every row at this position.
    let full = Session::open(
        &dir,
        SessionOptions {
            max_context: Some(at),
            ..Default::default()
        },
    )
    .unwrap()
    .max_snapshot_len();
    assert!(
        (snap.len() as u64) < full,
        "{} bytes, every row takes {full}",
        snap.len()
    );

    let mut fresh = open(&dir);
    fresh.state_load(&snap).unwrap();
    assert_eq!(fresh.position(), at);
    assert_eq!(fresh.eval(&tokens[at..], LogitsMode::All).unwrap(), want);
    // And a short rewind after it needs no checkpoint, as before.
    fresh.state_load(&snap).unwrap();
    fresh.eval(&tokens[at..at + 2], LogitsMode::Last).unwrap();
    fresh.truncate(at + 1).unwrap();
    assert_eq!(
        fresh.eval(&tokens[at + 1..], LogitsMode::All).unwrap(),
        want[fresh.vocab_size()..]
    );
}

/// Rewrites a version 3 snapshot whose attention layers all start at
/// position 0 as version 2 (no first-position words), with its checksum.
fn as_v2(v3: &[u8], attention_layers: usize) -> Vec<u8> {
    assert_eq!(u32::from_le_bytes(v3[8..12].try_into().unwrap()), 3);
    let words = u32::from_le_bytes(v3[12..16].try_into().unwrap()) as usize;
    let header = 16 + 8 * words;
    let starts = &v3[header..header + 8 * attention_layers];
    assert!(starts.iter().all(|&b| b == 0), "a layer dropped rows");
    let mut out = Vec::new();
    out.extend_from_slice(&v3[..8]);
    out.extend_from_slice(&2u32.to_le_bytes());
    out.extend_from_slice(&v3[12..header]);
    out.extend_from_slice(&v3[header + 8 * attention_layers..v3.len() - 8]);
    let sum = moeflux::hash::fnv1a(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

#[test]
fn a_version_2_snapshot_still_loads_and_is_trimmed_to_the_window() {
    let (_t, dir, window, tokens) = setup();
    let layers = open(&dir).config().num_layers;
    // Short enough that no row was dropped yet: every layer starts at 0.
    let at = window + 1;
    let mut s = open(&dir);
    s.eval(&tokens[..at], LogitsMode::Last).unwrap();
    let v2 = as_v2(&s.state_save().unwrap(), layers);
    let want = s.eval(&tokens[at..], LogitsMode::All).unwrap();
    let mut fresh = open(&dir);
    fresh.state_load(&v2).unwrap();
    assert_eq!(fresh.eval(&tokens[at..], LogitsMode::All).unwrap(), want);

    // A version 3 snapshot whose window layer lacks rows its next token
    // needs is refused, naming the layer.
    let mut bad = s.state_save().unwrap();
    let words = u32::from_le_bytes(bad[12..16].try_into().unwrap()) as usize;
    let first = 16 + 8 * words;
    bad[first..first + 8].copy_from_slice(&(s.position() as u64).to_le_bytes());
    let body = bad.len() - 8;
    let sum = moeflux::hash::fnv1a(&bad[..body]);
    bad[body..].copy_from_slice(&sum.to_le_bytes());
    let err = fresh.state_load(&bad).unwrap_err().to_string();
    assert!(err.contains("layer 0 holds positions from"), "{err}");
}
