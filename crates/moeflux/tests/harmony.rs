//! OpenAI's harmony format (gpt-oss) in generation: the decoder, fed a
//! harmony answer token by token, shows the `analysis` channel as
//! reasoning and the rest as the answer, hides the markup, passes a tool
//! call on in the spelling the server's parser reads, and ends at
//! `<|return|>` / `<|call|>`.

#[path = "support/harmony_tokenizer.rs"]
mod harmony_tokenizer;

use moeflux::generate::{Decoder, Event, FinishReason, GenerateOptions};
use moeflux::text::harmony::{
    parse_header, Channels, Marker, Part, Shown, Transition, CALL, MAX_HEADER,
};
use moeflux::text::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_bytes(harmony_tokenizer::harmony_tokenizer_json().as_bytes()).unwrap()
}

/// What the decoder shows of `answer` after `prompt`: (reasoning, content,
/// finish, tokens accepted).
fn decode(
    tok: &Tokenizer,
    opts: &GenerateOptions,
    prompt: &str,
    answer: &str,
) -> (String, String, Option<FinishReason>, usize) {
    let mut dec = Decoder::new(tok, opts);
    dec.prime(&tok.encode(prompt, false).unwrap()).unwrap();
    let (mut reasoning, mut content) = (String::new(), String::new());
    let mut on_event = |e: Event<'_>| {
        if let Event::Text { text, reasoning: r } = e {
            if r {
                reasoning.push_str(text)
            } else {
                content.push_str(text)
            }
        }
    };
    let mut finish = None;
    let ids = tok.encode(answer, false).unwrap();
    let mut n = 0;
    for &id in &ids {
        n += 1;
        let (_, done) = dec.accept(id, &mut on_event).unwrap();
        if done.is_some() {
            finish = done;
            break;
        }
    }
    dec.finish(finish.unwrap_or(FinishReason::Length), &mut on_event)
        .unwrap();
    (reasoning, content, finish, n)
}

const PROMPT: &str = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant";

#[test]
fn the_tokenizer_has_the_markers() {
    let tok = tokenizer();
    for (i, m) in harmony_tokenizer::HARMONY_MARKERS.iter().enumerate() {
        let id = tok.token_to_id(m).unwrap();
        assert_eq!(u64::from(id), harmony_tokenizer::FIRST_MARKER_ID + i as u64);
        assert!(tok.is_special(id));
    }
    assert!(tok.vocab_size() <= 1024);
    assert!(moeflux::text::harmony::HarmonyIds::from_tokenizer(&tok).is_some());
}

#[test]
fn analysis_is_reasoning_and_final_is_the_answer() {
    let tok = tokenizer();
    let answer = "<|channel|>analysis<|message|>The user asks. Simple.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, héllo 👋.<|return|>ignored";
    let (reasoning, content, finish, n) = decode(&tok, &GenerateOptions::default(), PROMPT, answer);
    assert_eq!(reasoning, "The user asks. Simple.");
    assert_eq!(content, "Sunny, héllo 👋.");
    // `<|return|>` ends the answer although nothing names it EOS here.
    assert!(tok.eos_ids().is_empty());
    assert_eq!(finish, Some(FinishReason::Eos));
    assert_eq!(
        n,
        tok.encode(answer, false).unwrap().len() - tok.encode("ignored", false).unwrap().len()
    );
}

#[test]
fn a_tool_call_is_passed_on_in_one_spelling() {
    let tok = tokenizer();
    let want =
        "<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Paris\"}<|call|>";
    for answer in [
        "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
        // The recipient before the channel, as the template writes calls.
        "<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>",
    ] {
        let (reasoning, content, finish, _) =
            decode(&tok, &GenerateOptions::default(), PROMPT, answer);
        assert_eq!(reasoning, "Need the tool.");
        assert_eq!(content, want);
        assert_eq!(finish, Some(FinishReason::Eos));
    }
    // A preamble on `commentary` without a recipient is shown as the answer.
    let (_, content, _, _) = decode(
        &tok,
        &GenerateOptions::default(),
        PROMPT,
        "<|channel|>commentary<|message|>Checking.<|end|>",
    );
    assert_eq!(content, "Checking.");
}

#[test]
fn the_prompt_says_where_the_answer_starts() {
    let tok = tokenizer();
    let opts = GenerateOptions::default();
    // A forced call: the prompt opened the body; only the body is shown.
    let forced = format!(
        "{PROMPT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    );
    let (_, content, finish, _) = decode(&tok, &opts, &forced, "{\"city\": \"Rome\"}<|call|>");
    assert_eq!(content, "{\"city\": \"Rome\"}<|call|>");
    assert_eq!(finish, Some(FinishReason::Eos));
    // A forced call whose name the model writes: the whole header is passed
    // on once complete.
    let open = format!("{PROMPT}<|channel|>commentary to=functions.");
    let (_, content, _, _) = decode(
        &tok,
        &opts,
        &open,
        "now <|constrain|>json<|message|>{}<|call|>",
    );
    assert_eq!(
        content,
        "<|channel|>commentary to=functions.now<|message|>{}<|call|>"
    );
    // A prompt that opened the analysis: reasoning first.
    let thinking = format!("{PROMPT}<|channel|>analysis<|message|>");
    let (reasoning, content, _, _) = decode(&tok, &opts, &thinking, "Hmm.<|end|>");
    assert_eq!((reasoning.as_str(), content.as_str()), ("Hmm.", ""));
    // Without harmony markup in the prompt, text is the answer.
    let (reasoning, content, finish, _) = decode(&tok, &opts, "Hello", " world");
    assert_eq!((reasoning.as_str(), content.as_str()), ("", " world"));
    assert_eq!(finish, None);
}

#[test]
fn stops_and_ignore_eos() {
    let tok = tokenizer();
    let answer = "<|channel|>final<|message|>one two three<|return|><|start|>assistant<|channel|>final<|message|>again";
    let opts = GenerateOptions {
        stop: vec!["two".into()],
        ..Default::default()
    };
    let (_, content, finish, _) = decode(&tok, &opts, PROMPT, answer);
    assert_eq!(
        (content.as_str(), finish),
        ("one ", Some(FinishReason::Stop))
    );
    // Benchmarks go on past `<|return|>`; the markup stays hidden.
    let opts = GenerateOptions {
        ignore_eos: true,
        ..Default::default()
    };
    let (_, content, finish, _) = decode(&tok, &opts, PROMPT, answer);
    assert_eq!((content.as_str(), finish), ("one two threeagain", None));
}

#[test]
fn headers() {
    assert_eq!(
        parse_header("assistant<|channel|>analysis"),
        (Some("analysis"), None)
    );
    assert_eq!(
        parse_header("<|channel|>commentary to=functions.get_weather <|constrain|>json"),
        (Some("commentary"), Some("functions.get_weather"))
    );
    assert_eq!(
        parse_header("assistant to=functions.f<|channel|>commentary json"),
        (Some("commentary"), Some("functions.f"))
    );
    // A tool's reply is addressed to the assistant: not a call.
    assert_eq!(
        parse_header("functions.f to=assistant<|channel|>commentary"),
        (Some("commentary"), None)
    );
    assert_eq!(parse_header("assistant"), (None, None));
    assert_eq!(parse_header("assistant goto=x"), (None, None));
}

#[test]
fn channels_route_text() {
    let mut c = Channels::new();
    assert_eq!(c.text("plain").text, "plain");
    c.marker(Marker::Start);
    assert_eq!(c.text("assistant"), Shown::default());
    c.marker(Marker::Channel);
    c.text("analysis");
    assert_eq!(c.marker(Marker::Message), Transition::default());
    assert_eq!(
        c.text("think"),
        Shown {
            text: "think".into(),
            reasoning: true
        }
    );
    assert!(!c.marker(Marker::End).ends);
    c.marker(Marker::Start);
    c.text("assistant");
    c.marker(Marker::Channel);
    c.text("commentary to=functions.f ");
    c.marker(Marker::Constrain);
    c.text("json");
    assert_eq!(
        c.marker(Marker::Message).text,
        "<|channel|>commentary to=functions.f<|message|>"
    );
    assert_eq!(c.part(), &Part::Call);
    assert!(!c.text("{}").reasoning);
    assert_eq!(
        c.marker(Marker::Call),
        Transition {
            text: CALL.into(),
            ends: true
        }
    );
    // A header that never ends is shown after all.
    c.marker(Marker::Start);
    assert_eq!(c.text(&"x".repeat(MAX_HEADER)).text, "");
    assert_eq!(c.text("y").text.len(), MAX_HEADER + 1);
    assert_eq!(c.part(), &Part::Content);
}
