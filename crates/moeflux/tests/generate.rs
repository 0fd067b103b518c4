//! `generate` on a converted fixture, whose greedy continuation is known from
//! mlx-lm: reasoning split at `<think>`/`</think>` or by harmony channel, EOS, a full context,
//! cancellation and reuse of the prefix a session already holds.

mod common;

use std::path::Path;
use std::sync::atomic::AtomicBool;

use common::*;
use moeflux::generate::{generate, Event, FinishReason, GenerateOptions, GenerationStats};
use moeflux::text::tokenizer::Tokenizer;
use moeflux::{Session, SessionOptions};

const FIXTURE: &str = "qwen35moe-q4";

/// (prompt, greedy continuation) of the fixture's golden.
fn golden_ids() -> (Vec<u32>, Vec<u32>) {
    let g = Golden::load(&fixtures().join(FIXTURE));
    let (p, c) = g.tokens.split_at(g.prompt_len);
    (p.to_vec(), c.to_vec())
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Runs `generate`, returning (content text, reasoning text, stats).
fn run(
    s: &mut Session,
    tok: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> (String, String, GenerationStats) {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let stats = generate(s, tok, prompt, opts, None, &mut |e| {
        if let Event::Text { text, reasoning: r } = e {
            if r { &mut reasoning } else { &mut content }.push_str(text);
        }
    })
    .unwrap();
    (content, reasoning, stats)
}

/// Renames vocabulary entry `id` of the model's BPE tokenizer.json to
/// `content`, dropping the merges that made or used the old string.
fn rename_token(model: &Path, id: u32, content: &str) {
    let path = model.join("tokenizer.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let old = vocab
        .iter()
        .find(|(_, v)| v.as_u64() == Some(id as u64))
        .map(|(k, _)| k.clone())
        .unwrap();
    vocab.remove(&old);
    vocab.insert(content.to_string(), id.into());
    t["model"]["merges"].as_array_mut().unwrap().retain(|m| {
        let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
        a != old && b != old && format!("{a}{b}") != old
    });
    std::fs::write(&path, serde_json::to_vec(&t).unwrap()).unwrap();
}

#[test]
fn think_tokens_split_reasoning_from_content() {
    let (prompt, c) = golden_ids();
    for (open_at_2, starts_in_reasoning) in [(false, true), (true, false)] {
        let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
        // The continuation's third token becomes `</think>` (or `<think>`);
        // the other marker takes an id the continuation does not use.
        let spare = (0..1024).rev().find(|i| !c.contains(i)).unwrap();
        let (open, close) = if open_at_2 {
            (c[2], spare)
        } else {
            (spare, c[2])
        };
        rename_token(&model, open, "<think>");
        rename_token(&model, close, "</think>");
        let tok = Tokenizer::from_model_dir(&model).unwrap();
        assert_eq!(tok.think_ids(), Some((open, close)));
        let mut s = open_session(&model, None);
        let opts = GenerateOptions {
            starts_in_reasoning,
            ..greedy(c.len())
        };
        let (content, reasoning, stats) = run(&mut s, &tok, &prompt, &opts);
        assert_eq!(stats.generated_tokens, c.len());
        // `c` holds no token the renaming touched besides c[2].
        let before = tok.decode(&c[..2], true).unwrap();
        let after = tok.decode(&c[3..], true).unwrap();
        if starts_in_reasoning {
            assert_eq!((reasoning, content), (before, after));
        } else {
            assert_eq!((content, reasoning), (before, after));
        }
    }
}

fn open_session(model: &Path, max_context: Option<usize>) -> Session {
    Session::open(
        model,
        SessionOptions {
            threads: Some(2),
            max_context,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn eos_ends_generation_and_stays_pending() {
    let (prompt, c) = golden_ids();
    let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
    std::fs::write(
        model.join("generation_config.json"),
        format!("{{\"eos_token_id\": [{}]}}", c[4]),
    )
    .unwrap();
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let mut s = open_session(&model, None);
    let opts = GenerateOptions {
        ignore_eos: false,
        ..greedy(c.len())
    };
    let (content, _, stats) = run(&mut s, &tok, &prompt, &opts);
    assert_eq!(stats.finish, FinishReason::Eos);
    assert_eq!(stats.generated_tokens, 5);
    assert_eq!(stats.pending, Some(c[4]));
    assert_eq!(content, tok.decode(&c[..4], true).unwrap());
    assert_eq!(s.position(), prompt.len() + 4);

    // ignore_eos goes on past it.
    let mut s = open_session(&model, None);
    let (_, _, stats) = run(&mut s, &tok, &prompt, &greedy(c.len()));
    assert_eq!(stats.finish, FinishReason::Length);
    assert_eq!(stats.generated_tokens, c.len());
}

#[test]
fn full_context_ends_generation_without_error() {
    let (prompt, c) = golden_ids();
    let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let mut s = open_session(&model, Some(prompt.len() + 3));
    let (content, _, stats) = run(&mut s, &tok, &prompt, &greedy(c.len()));
    assert_eq!(stats.finish, FinishReason::Length);
    // The prompt's logits give the first token, each of 3 evals one more.
    assert_eq!(stats.generated_tokens, 4);
    assert_eq!(content, tok.decode(&c[..4], true).unwrap());
    assert_eq!(s.position(), prompt.len() + 3);
}

#[test]
fn a_prompt_longer_than_the_context_is_refused_before_any_prefill() {
    let (prompt, _) = golden_ids();
    let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let limit = prompt.len() - 1;
    let mut s = open_session(&model, Some(limit));
    s.eval(&prompt[..3], moeflux::LogitsMode::Last).unwrap();
    let mut events = 0;
    let opts = GenerateOptions {
        prefill_chunk: 2,
        ..greedy(4)
    };
    let r = generate(&mut s, &tok, &prompt, &opts, None, &mut |_| events += 1);
    match r {
        Err(moeflux::Error::ContextFull {
            requested,
            limit: l,
        }) => {
            assert_eq!((requested, l), (prompt.len(), limit));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(events, 0, "prefill started");
    assert_eq!(s.tokens(), &prompt[..3], "the session changed");
}

#[test]
fn a_raised_cancel_flag_stops_before_any_work() {
    let (prompt, _) = golden_ids();
    let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let mut s = open_session(&model, None);
    let cancel = AtomicBool::new(true);
    let r = generate(
        &mut s,
        &tok,
        &prompt,
        &greedy(4),
        Some(&cancel),
        &mut |_| {},
    );
    assert!(matches!(r, Err(moeflux::Error::Cancelled)), "{r:?}");
    assert_eq!(s.position(), 0);
}

#[test]
fn a_longer_prompt_reuses_the_held_prefix_and_continues_exactly() {
    let (prompt, c) = golden_ids();
    let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
    let tok = Tokenizer::from_model_dir(&model).unwrap();
    let mut s = open_session(&model, None);
    let opts = GenerateOptions {
        checkpoint_after_prefill: true,
        ..greedy(c.len())
    };
    let (first, _, stats) = run(&mut s, &tok, &prompt, &opts);
    assert_eq!(
        (stats.prompt_tokens, stats.reused_tokens),
        (prompt.len(), 0)
    );
    assert_eq!(first, tok.decode(&c, true).unwrap());

    // The session holds prompt + c[..7]; the new prompt is prompt + c[..3].
    let longer: Vec<u32> = prompt.iter().chain(&c[..3]).copied().collect();
    let (second, _, stats) = run(&mut s, &tok, &longer, &greedy(c.len() - 3));
    assert_eq!(stats.reused_tokens, longer.len() - 1);
    assert_eq!(stats.prompt_tokens, 1);
    assert_eq!(second, tok.decode(&c[3..], true).unwrap());

    // A prompt that diverges before the only checkpoint starts over, and
    // gives what a fresh session gives.
    let other: Vec<u32> = prompt[..prompt.len() - 1]
        .iter()
        .chain(&[c[0]])
        .copied()
        .collect();
    let (text, _, stats) = run(&mut s, &tok, &other, &greedy(4));
    assert_eq!((stats.reused_tokens, stats.prompt_tokens), (0, other.len()));
    let (fresh, _, _) = run(&mut open_session(&model, None), &tok, &other, &greedy(4));
    assert_eq!(text, fresh);
}

/// [`rename_token`] to a special (added) token.
fn make_special(model: &Path, id: u32, content: &str) {
    rename_token(model, id, content);
    let path = model.join("tokenizer.json");
    let mut t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    t["added_tokens"].as_array_mut().unwrap().push(
        serde_json::json!({"id": id, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
    );
    std::fs::write(&path, serde_json::to_vec(&t).unwrap()).unwrap();
}

/// OpenAI's harmony markers (gpt-oss) through `generate`: the fixture's
/// known continuation, with tokens renamed, becomes a harmony answer. The
/// prompt ends `<|start|>` + a role (the template's generation prompt), so
/// the answer starts in a header: `generate` primes the decoder with the
/// prompt. The `analysis` body is reasoning, headers are hidden, a call is
/// passed on in one spelling and `<|call|>` ends generation though no
/// config names it end-of-sequence.
#[test]
fn harmony_channels_split_reasoning_answer_and_calls() {
    let (prompt, c) = golden_ids();
    assert_eq!(
        (&prompt[prompt.len() - 2..], c.as_slice()),
        (
            &[1001, 966][..],
            &[348, 39, 454, 715, 666, 666, 537, 388][..]
        )
    );
    for call in [false, true] {
        let (_tmp, model) = convert_fixture(&format!("{FIXTURE}/src"), None);
        make_special(&model, 1001, "<|start|>");
        make_special(&model, c[0], "<|channel|>");
        make_special(&model, c[2], "<|message|>");
        if call {
            rename_token(&model, c[1], "commentaryĠto=functions.get_weather");
            make_special(&model, c[6], "<|call|>");
            // Not generated, but harmony needs it.
            let spare = (0..1024)
                .rev()
                .find(|i| !c.contains(i) && !prompt.contains(i))
                .unwrap();
            make_special(&model, spare, "<|end|>");
        } else {
            rename_token(&model, c[1], "analysis");
            make_special(&model, c[6], "<|end|>");
        }
        let tok = Tokenizer::from_model_dir(&model).unwrap();
        assert!(!tok.is_eos(c[6]));
        let mut s = open_session(&model, None);
        let opts = GenerateOptions {
            ignore_eos: false,
            ..greedy(c.len())
        };
        let (content, reasoning, stats) = run(&mut s, &tok, &prompt, &opts);
        let body = tok.decode(&c[3..6], true).unwrap();
        if call {
            assert_eq!(reasoning, "");
            assert_eq!(
                content,
                format!("<|channel|>commentary to=functions.get_weather<|message|>{body}<|call|>")
            );
            assert_eq!(stats.finish, FinishReason::Eos);
            assert_eq!(stats.generated_tokens, 7);
        } else {
            // After `<|end|>`, text outside a message is the answer.
            assert_eq!(reasoning, body);
            assert_eq!(content, tok.decode(&c[7..], true).unwrap());
            assert_eq!(stats.generated_tokens, c.len());
        }
    }
}
