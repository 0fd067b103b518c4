//! `Batch`: a sequence's logits inside any step equal its logits evaluated
//! alone with the same chunks, bit for bit on the CPU, through staggered
//! arrivals, cancellations mid-prefill and mid-decode, the context limit
//! and snapshots taken while others run. Every family's fixture; fresh
//! random tokens each run (the seed is printed; `MOEFLUX_TEST_SEED` repeats
//! one).

mod common;

use std::collections::HashMap;
use std::path::Path;

use common::convert_fixture;
use moeflux::{Batch, Error, LogitsMode, Output, SeqId, Session, SessionOptions, Work};

fn opts(max_context: Option<usize>) -> SessionOptions {
    SessionOptions {
        threads: Some(2),
        max_context,
        ..Default::default()
    }
}

/// A small deterministic generator; the seed comes from the clock unless
/// `MOEFLUX_TEST_SEED` is set.
struct Rng(u64);

impl Rng {
    fn new(name: &str) -> Rng {
        let seed = std::env::var("MOEFLUX_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
            });
        eprintln!("{name}: MOEFLUX_TEST_SEED={seed}");
        Rng(seed | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n)
            .map(|_| (self.next() % vocab as u64) as u32)
            .collect()
    }
}

/// The batch under test and, per sequence, a session that evaluates the
/// same chunks alone.
struct Harness<'a> {
    dir: &'a Path,
    max_context: Option<usize>,
    batch: Batch,
    alone: HashMap<SeqId, Session>,
    vocab: usize,
    name: String,
}

impl<'a> Harness<'a> {
    fn new(name: &str, dir: &'a Path, max_context: Option<usize>) -> Self {
        let batch = Batch::open(dir, opts(max_context)).unwrap();
        let vocab = batch.vocab_size();
        Harness {
            dir,
            max_context,
            batch,
            alone: HashMap::new(),
            vocab,
            name: name.to_string(),
        }
    }

    fn add(&mut self) -> SeqId {
        let id = self.batch.add_sequence().unwrap();
        let s = Session::open(self.dir, opts(self.max_context)).unwrap();
        self.alone.insert(id, s);
        id
    }

    fn remove(&mut self, id: SeqId) {
        self.batch.remove_sequence(id).unwrap();
        self.alone.remove(&id);
    }

    /// One step; each item's logits must equal its session's, bit for bit
    /// (a greedy item's token: the first argmax of the session's logits).
    fn step(&mut self, items: &[(SeqId, Vec<u32>, Option<LogitsMode>)]) {
        let work: Vec<Work> = items
            .iter()
            .map(|(seq, tokens, logits)| Work {
                seq: *seq,
                tokens,
                logits: *logits,
            })
            .collect();
        let got = self.batch.step(&work).unwrap();
        for ((id, tokens, logits), got) in items.iter().zip(got) {
            let got = got.unwrap();
            let s = self.alone.get_mut(id).unwrap();
            let mode = match logits {
                Some(LogitsMode::Greedy) | None => LogitsMode::Last,
                Some(m) => *m,
            };
            let want = s.eval(tokens, mode).unwrap();
            if *logits == Some(LogitsMode::Greedy) {
                let first_max =
                    (0..want.len()).fold(0, |b, i| if want[i] > want[b] { i } else { b });
                assert_eq!(got, Output::Token(first_max as u32), "{}: {id}", self.name);
                assert_eq!(self.batch.tokens(*id).unwrap(), s.tokens());
                continue;
            }
            let got = got.into_logits();
            let want = if logits.is_some() { want } else { Vec::new() };
            assert_eq!(got.len(), want.len(), "{}: {id}", self.name);
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            assert_eq!(
                differ,
                0,
                "{}: {id} at {}: {differ} logits differ from the sequence alone",
                self.name,
                s.position()
            );
            assert_eq!(self.batch.tokens(*id).unwrap(), s.tokens());
        }
    }
}

fn scenario(name: &str, fixture: &str) {
    let (_tmp, dir) = convert_fixture(fixture, None);
    let mut h = Harness::new(name, &dir, None);
    let mut rng = Rng::new(name);
    let v = h.vocab;
    let last = Some(LogitsMode::Last);

    // Staggered arrivals: A prefills, B arrives while A decodes, C later.
    let a = h.add();
    h.step(&[(a, rng.tokens(5, v), last)]);
    let b = h.add();
    h.step(&[(a, rng.tokens(1, v), last), (b, rng.tokens(7, v), None)]);
    let c = h.add();
    h.step(&[
        (a, rng.tokens(1, v), last),
        (b, rng.tokens(3, v), last),
        (c, rng.tokens(4, v), Some(LogitsMode::All)),
    ]);
    // A checkpoint of B for the truncation below.
    h.batch.checkpoint(b).unwrap();
    h.alone.get_mut(&b).unwrap().checkpoint();
    // B decodes greedily (its token picked where its logits are).
    for _ in 0..3 {
        h.step(&[
            (c, rng.tokens(1, v), last),
            (a, rng.tokens(1, v), last),
            (b, rng.tokens(1, v), Some(LogitsMode::Greedy)),
        ]);
    }

    // A snapshot of A taken while the others run, loaded into a new
    // sequence E: E goes on exactly as A does.
    let snap = h.batch.state_save(a).unwrap();
    let e = h.add();
    h.batch.state_load(e, &snap).unwrap();
    h.alone.get_mut(&e).unwrap().state_load(&snap).unwrap();
    let next = rng.tokens(1, v);
    h.step(&[
        (a, next.clone(), last),
        (b, rng.tokens(2, v), last),
        (e, next, last),
    ]);
    assert_eq!(h.batch.tokens(a).unwrap(), h.batch.tokens(e).unwrap());

    // Cancelled mid-prefill: D leaves after one of its chunks; mid-decode:
    // C leaves. The others go on unchanged.
    let d = h.add();
    h.step(&[(d, rng.tokens(6, v), None), (a, rng.tokens(1, v), last)]);
    h.remove(d);
    h.remove(c);
    h.step(&[(b, rng.tokens(1, v), last), (a, rng.tokens(1, v), last)]);

    // B returns to its checkpoint and goes on; its rewind touches no one else.
    let at = h.batch.checkpoints(b).unwrap()[0];
    h.batch.truncate(b, at).unwrap();
    h.alone.get_mut(&b).unwrap().truncate(at).unwrap();
    h.step(&[
        (e, rng.tokens(1, v), last),
        (b, rng.tokens(3, v), last),
        (a, rng.tokens(1, v), last),
    ]);
}

#[test]
fn qwen35moe_sequences_in_a_batch_equal_themselves_alone() {
    scenario("qwen35moe", "qwen35moe-q4/src");
}

#[test]
fn qwen3next_sequences_in_a_batch_equal_themselves_alone() {
    scenario("qwen3next", "qwen3next-q4/src");
}

#[test]
fn qwen3moe_sequences_in_a_batch_equal_themselves_alone() {
    scenario("qwen3moe", "qwen3moe-q4/src");
}

#[test]
fn glm4moe_sequences_in_a_batch_equal_themselves_alone() {
    scenario("glm4moe", "glm4moe-q4/src");
}

#[test]
fn gpt_oss_sequences_in_a_batch_equal_themselves_alone() {
    scenario("gptoss", "gptoss-q4/src");
}

#[test]
fn deepseek_v3_sequences_in_a_batch_equal_themselves_alone() {
    scenario("deepseekv3", "deepseekv3-q4/src");
}

#[test]
fn a_sequence_at_its_context_limit_is_refused_and_the_others_go_on() {
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let mut h = Harness::new("context", &dir, Some(12));
    let mut rng = Rng::new("context");
    let v = h.vocab;
    let last = Some(LogitsMode::Last);
    let (a, b) = (h.add(), h.add());
    h.step(&[(a, rng.tokens(10, v), last), (b, rng.tokens(3, v), last)]);
    // A would pass 12: the whole step is refused, nothing changes.
    let over = rng.tokens(3, v);
    let one = rng.tokens(1, v);
    let work = [
        Work {
            seq: b,
            tokens: &one,
            logits: last,
        },
        Work {
            seq: a,
            tokens: &over,
            logits: last,
        },
    ];
    match h.batch.step(&work) {
        Err(Error::ContextFull { requested, limit }) => assert_eq!((requested, limit), (13, 12)),
        other => panic!("expected ContextFull, got {other:?}"),
    }
    assert_eq!(h.batch.position(a).unwrap(), 10);
    assert_eq!(h.batch.position(b).unwrap(), 3);
    // A fills its context exactly; B goes on.
    h.step(&[(a, rng.tokens(2, v), last), (b, one, last)]);
    h.step(&[(b, rng.tokens(1, v), last)]);
}

#[test]
fn bad_steps_are_refused_before_any_work() {
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let mut batch = Batch::open(&dir, opts(None)).unwrap();
    let a = batch.add_sequence().unwrap();
    let t = [1u32, 2];
    let w = |seq| Work {
        seq,
        tokens: &t,
        logits: Some(LogitsMode::Last),
    };
    let twice = batch.step(&[w(a), w(a)]).unwrap_err().to_string();
    assert!(twice.contains("twice in one step"), "{twice}");
    let b = batch.add_sequence().unwrap();
    batch.remove_sequence(b).unwrap();
    let gone = batch.step(&[w(a), w(b)]).unwrap_err().to_string();
    assert!(gone.contains("no sequence"), "{gone}");
    assert!(batch.remove_sequence(b).is_err());
    let huge = [u32::MAX];
    let bad = [
        w(a),
        Work {
            seq: a,
            tokens: &huge,
            logits: None,
        },
    ];
    assert!(batch.step(&bad[1..]).is_err());
    assert_eq!(batch.position(a).unwrap(), 0);
    // Still usable.
    batch.step(&[w(a)]).unwrap().remove(0).unwrap();
    assert_eq!(batch.position(a).unwrap(), 2);
}
