//! A job's engine events as Anthropic's answer: one `message` object, or
//! its SSE stream (`message_start`, then per content block
//! `content_block_start` / `content_block_delta`s / `content_block_stop`,
//! then `message_delta` with the stop reason and usage, `message_stop`;
//! `ping` while nothing else is sent). Both come from one block builder
//! ([`Blocks`]): the message's blocks are the streamed ones, applied.
//!
//! Blocks: reasoning is `thinking` (`signature` empty: nothing here signs
//! it), answer text `text`, each parsed tool call `tool_use` (id `toolu_..`).
//! A tool call's block is sent when the call is complete, its whole input
//! in one `input_json_delta`, so that it is always a JSON object: a call
//! whose arguments are not one (a model's mistake in the JSON spellings;
//! the XML and GLM ones are built by the parser) has the input `{}`.

use std::sync::Arc;

use axum::response::sse::{Event, KeepAlive};
use axum::response::{IntoResponse, Response};
use axum::Json;
use moeflux::generate::FinishReason;
use serde_json::{json, Value as Json_};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::anthropic;
use crate::engine::{EngineEvent, Outcome};
use crate::error::ApiError;
use crate::respond::{drain, sse, tool_parser, CancelOnDrop, SseShape};
use crate::tools::{Delta, ToolCallParser};
use crate::{random_id, AppState};

/// How to answer a messages request.
pub struct MessageAnswer {
    pub stream: bool,
    /// Prompt tokens (`usage.input_tokens`, known before generation).
    pub prompt_tokens: usize,
    /// Parse tool calls (the request's tools, in OpenAI form).
    pub tools: Option<Vec<Json_>>,
    /// A forced call's opening appended to the prompt (the parser's start).
    pub forced: Option<String>,
}

pub async fn answer(
    st: Arc<AppState>,
    a: MessageAnswer,
    mut rx: UnboundedReceiver<EngineEvent>,
    cancel: CancelOnDrop,
) -> Response {
    let head = Head {
        id: random_id("msg_"),
        model: st.model_name.clone(),
        prompt_tokens: a.prompt_tokens,
    };
    let mut blocks = Blocks::new(&a);
    if a.stream {
        let keep_alive = KeepAlive::new().event(event("ping", json!({"type": "ping"})));
        return sse(Stream { head, blocks }, rx, cancel, keep_alive);
    }
    let mut content = Vec::new();
    let mut apply_all = |evs: Vec<BlockEvent>| evs.iter().for_each(|e| apply(&mut content, e));
    apply_all(blocks.forced());
    let outcome = drain(&mut rx, |text, reasoning| {
        apply_all(blocks.text(&text, reasoning))
    })
    .await;
    let o = match outcome {
        Ok(o) => o,
        Err(e) => return anthropic::error_response(e),
    };
    apply_all(blocks.finish());
    let (reason, sequence) = stop_reason(&o, blocks.calls > 0);
    let mut message = head.message(json!(content));
    message["stop_reason"] = reason.into();
    message["stop_sequence"] = sequence.into();
    message["usage"] = usage(o.prompt_tokens, o.completion_tokens);
    Json(message).into_response()
}

/// What every form of one answer shares.
struct Head {
    id: String,
    model: String,
    prompt_tokens: usize,
}

impl Head {
    /// The message object with `content` (stop reason and sequence null).
    fn message(&self, content: Json_) -> Json_ {
        json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": null,
            "stop_sequence": null,
            "usage": usage(self.prompt_tokens, 0),
        })
    }
}

/// Anthropic's usage (no prompt caching of theirs: the cache fields are 0).
fn usage(input: usize, output: usize) -> Json_ {
    json!({
        "input_tokens": input,
        "output_tokens": output,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    })
}

/// `stop_reason` and `stop_sequence`.
fn stop_reason(o: &Outcome, tool_use: bool) -> (&'static str, Option<String>) {
    match o.finish {
        FinishReason::Length => ("max_tokens", None),
        _ if tool_use => ("tool_use", None),
        FinishReason::Stop => ("stop_sequence", o.stop_sequence.clone()),
        _ => ("end_turn", None),
    }
}

/// A content block's event; its index is the block's place in `content`.
#[derive(Debug, Clone, PartialEq)]
enum BlockEvent {
    Start { index: usize, block: Json_ },
    Delta { index: usize, delta: Json_ },
    Stop { index: usize },
}

impl BlockEvent {
    fn sse(&self) -> Event {
        match self {
            BlockEvent::Start { index, block } => event(
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            ),
            BlockEvent::Delta { index, delta } => event(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": delta}),
            ),
            BlockEvent::Stop { index } => event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ),
        }
    }
}

/// The message's content after `e` (what a client accumulating the stream
/// does).
fn apply(content: &mut Vec<Json_>, e: &BlockEvent) {
    match e {
        BlockEvent::Start { block, .. } => content.push(block.clone()),
        BlockEvent::Delta { index, delta } => {
            let Some(block) = content.get_mut(*index) else {
                return;
            };
            let append = |field: &mut Json_, s: &Json_| {
                let mut t = field.as_str().unwrap_or_default().to_string();
                t.push_str(s.as_str().unwrap_or_default());
                *field = t.into();
            };
            match delta["type"].as_str() {
                Some("text_delta") => append(&mut block["text"], &delta["text"]),
                Some("thinking_delta") => append(&mut block["thinking"], &delta["thinking"]),
                Some("input_json_delta") => {
                    // One delta holds the whole input (see `Blocks::close`).
                    let input = delta["partial_json"].as_str().unwrap_or("{}");
                    block["input"] = serde_json::from_str(input).unwrap_or_else(|_| json!({}));
                }
                _ => {}
            }
        }
        BlockEvent::Stop { .. } => {}
    }
}

/// The block being written.
enum Open {
    Text,
    Thinking,
    /// A tool call, sent whole when it is complete.
    Call {
        id: String,
        name: String,
        args: String,
    },
}

/// Engine text -> content block events: reasoning as `thinking`, the rest
/// through the tool-call parser (when tools are in play) as `text` and
/// `tool_use` blocks.
struct Blocks {
    parser: Option<ToolCallParser>,
    forced: Option<String>,
    open: Option<Open>,
    /// Blocks started so far (the next one's index).
    started: usize,
    /// `tool_use` blocks sent.
    calls: usize,
}

impl Blocks {
    fn new(a: &MessageAnswer) -> Blocks {
        Blocks {
            parser: a.tools.as_deref().map(|t| tool_parser(t, "toolu_")),
            forced: a.forced.clone(),
            open: None,
            started: 0,
            calls: 0,
        }
    }

    /// The forced call's opening, fed to the parser before the answer.
    fn forced(&mut self) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        if let (Some(p), Some(f)) = (self.parser.as_mut(), self.forced.take()) {
            let deltas = p.push(&f);
            self.deltas(deltas, &mut out);
        }
        out
    }

    fn text(&mut self, text: &str, reasoning: bool) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        if reasoning {
            self.append(false, text, &mut out);
        } else if let Some(p) = self.parser.as_mut() {
            let deltas = p.push(text);
            self.deltas(deltas, &mut out);
        } else {
            self.append(true, text, &mut out);
        }
        out
    }

    /// The answer is over: what the parser held back, the last block closed.
    fn finish(&mut self) -> Vec<BlockEvent> {
        let mut out = Vec::new();
        if let Some(p) = self.parser.as_mut() {
            let deltas = p.finish();
            self.deltas(deltas, &mut out);
        }
        self.close(&mut out);
        out
    }

    fn deltas(&mut self, deltas: Vec<Delta>, out: &mut Vec<BlockEvent>) {
        for d in deltas {
            match d {
                Delta::Content(s) => self.append(true, &s, out),
                Delta::CallStart { id, name, .. } => {
                    self.close(out);
                    self.open = Some(Open::Call {
                        id,
                        name,
                        args: String::new(),
                    });
                }
                // The parser sends a call's arguments before anything
                // else: they belong to the open call.
                Delta::CallArgs { fragment, .. } => {
                    if let Some(Open::Call { args, .. }) = &mut self.open {
                        args.push_str(&fragment);
                    }
                }
            }
        }
    }

    /// `text` into a text (`answer`) or thinking block, started if another
    /// kind of block is open.
    fn append(&mut self, answer: bool, text: &str, out: &mut Vec<BlockEvent>) {
        if text.is_empty() {
            return;
        }
        let same = matches!(
            (&self.open, answer),
            (Some(Open::Text), true) | (Some(Open::Thinking), false)
        );
        if !same {
            self.close(out);
            let block = if answer {
                json!({"type": "text", "text": ""})
            } else {
                json!({"type": "thinking", "thinking": "", "signature": ""})
            };
            out.push(BlockEvent::Start {
                index: self.started,
                block,
            });
            self.started += 1;
            self.open = Some(if answer { Open::Text } else { Open::Thinking });
        }
        let delta = if answer {
            json!({"type": "text_delta", "text": text})
        } else {
            json!({"type": "thinking_delta", "thinking": text})
        };
        out.push(BlockEvent::Delta {
            index: self.started - 1,
            delta,
        });
    }

    /// Ends the open block; a tool call is sent here, whole.
    fn close(&mut self, out: &mut Vec<BlockEvent>) {
        let Some(open) = self.open.take() else {
            return;
        };
        if let Open::Call { id, name, args } = open {
            let input = match serde_json::from_str::<Json_>(&args) {
                Ok(v @ Json_::Object(_)) => v,
                _ => json!({}),
            };
            out.push(BlockEvent::Start {
                index: self.started,
                block: json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
            });
            out.push(BlockEvent::Delta {
                index: self.started,
                delta: json!({"type": "input_json_delta", "partial_json": input.to_string()}),
            });
            self.started += 1;
            self.calls += 1;
        }
        out.push(BlockEvent::Stop {
            index: self.started - 1,
        });
    }
}

fn event(name: &str, data: Json_) -> Event {
    Event::default().event(name).data(data.to_string())
}

/// Anthropic's stream.
struct Stream {
    head: Head,
    blocks: Blocks,
}

impl SseShape for Stream {
    fn start(&mut self) -> Vec<Event> {
        let start = json!({"type": "message_start", "message": self.head.message(json!([]))});
        let mut v = vec![event("message_start", start)];
        v.extend(self.blocks.forced().iter().map(BlockEvent::sse));
        v
    }

    fn text(&mut self, text: String, reasoning: bool) -> Vec<Event> {
        self.blocks
            .text(&text, reasoning)
            .iter()
            .map(BlockEvent::sse)
            .collect()
    }

    fn done(&mut self, result: Result<Outcome, ApiError>) -> Vec<Event> {
        let o = match result {
            Ok(o) => o,
            Err(e) => return vec![event("error", anthropic::error_body(&e))],
        };
        let mut v: Vec<Event> = self.blocks.finish().iter().map(BlockEvent::sse).collect();
        let (reason, sequence) = stop_reason(&o, self.blocks.calls > 0);
        v.push(event(
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"input_tokens": o.prompt_tokens, "output_tokens": o.completion_tokens},
            }),
        ));
        v.push(event("message_stop", json!({"type": "message_stop"})));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Json_> {
        vec![
            json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
        ]
    }

    /// Feeds `pieces` ((text, reasoning)), returns the events and the
    /// content they build.
    fn run(a: &MessageAnswer, pieces: &[(&str, bool)]) -> (Vec<BlockEvent>, Vec<Json_>) {
        let mut b = Blocks::new(a);
        let mut events = b.forced();
        for (t, r) in pieces {
            events.extend(b.text(t, *r));
        }
        events.extend(b.finish());
        let mut content = Vec::new();
        for e in &events {
            apply(&mut content, e);
        }
        (events, content)
    }

    fn answer(tools: Option<Vec<Json_>>, forced: Option<&str>) -> MessageAnswer {
        MessageAnswer {
            stream: false,
            prompt_tokens: 3,
            tools,
            forced: forced.map(str::to_string),
        }
    }

    #[test]
    fn reasoning_then_text_are_two_blocks() {
        let (events, content) = run(
            &answer(None, None),
            &[
                ("Let me ", true),
                ("think.", true),
                ("", false),
                ("Hi", false),
                ("!", false),
            ],
        );
        assert_eq!(
            content,
            vec![
                json!({"type": "thinking", "thinking": "Let me think.", "signature": ""}),
                json!({"type": "text", "text": "Hi!"}),
            ]
        );
        // start, delta, delta, stop; start, delta, delta, stop: indices in order.
        let kinds: Vec<(char, usize)> = events
            .iter()
            .map(|e| match e {
                BlockEvent::Start { index, .. } => ('s', *index),
                BlockEvent::Delta { index, .. } => ('d', *index),
                BlockEvent::Stop { index } => ('e', *index),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ('s', 0),
                ('d', 0),
                ('d', 0),
                ('e', 0),
                ('s', 1),
                ('d', 1),
                ('d', 1),
                ('e', 1)
            ]
        );
        // Nothing generated: no block.
        assert_eq!(run(&answer(None, None), &[]).1, Vec::<Json_>::new());
    }

    #[test]
    fn tool_calls_are_whole_tool_use_blocks() {
        let a = answer(Some(tools()), None);
        let (events, content) = run(
            &a,
            &[
                (
                    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa",
                    false,
                ),
                ("ris\n</parameter>\n</function>\n</tool_call>", false),
            ],
        );
        assert_eq!(content.len(), 2);
        assert_eq!(content[0], json!({"type": "text", "text": "Checking."}));
        let call = &content[1];
        assert_eq!(call["type"], "tool_use");
        assert_eq!(call["name"], "get_weather");
        assert!(call["id"].as_str().unwrap().starts_with("toolu_"));
        assert_eq!(call["input"], json!({"city": "Paris"}));
        // The input is one delta, after the block's start.
        let deltas: Vec<&Json_> = events
            .iter()
            .filter_map(|e| match e {
                BlockEvent::Delta { index: 1, delta } => Some(delta),
                _ => None,
            })
            .collect();
        assert_eq!(
            deltas,
            [&json!({"type": "input_json_delta", "partial_json": "{\"city\":\"Paris\"}"})]
        );
    }

    #[test]
    fn a_forced_call_and_bad_arguments() {
        // A forced JSON-spelling call whose arguments are not an object.
        let forced = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ";
        let (_, content) = run(
            &answer(Some(tools()), Some(forced)),
            &[("[1, 2]}\n</tool_call>", false)],
        );
        assert_eq!(content.len(), 1, "{content:?}");
        assert_eq!(content[0]["name"], "get_weather");
        assert_eq!(content[0]["input"], json!({}));
        // Two calls: two blocks, in order.
        let two = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}\n</tool_call>\n\
                   <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"B\"}}\n</tool_call>";
        let (_, content) = run(&answer(Some(tools()), None), &[(two, false)]);
        let cities: Vec<&Json_> = content.iter().map(|b| &b["input"]["city"]).collect();
        assert_eq!(cities, [&json!("A"), &json!("B")]);
        assert_ne!(content[0]["id"], content[1]["id"]);
    }

    #[test]
    fn stop_reasons() {
        let o = |finish, stop: Option<&str>| Outcome {
            prompt_tokens: 1,
            cached_tokens: 0,
            completion_tokens: 1,
            finish,
            stop_sequence: stop.map(str::to_string),
            ttft: Default::default(),
            prefill: Default::default(),
            decode: Default::default(),
            queued: Default::default(),
        };
        assert_eq!(
            stop_reason(&o(FinishReason::Eos, None), false),
            ("end_turn", None)
        );
        assert_eq!(
            stop_reason(&o(FinishReason::Eos, None), true),
            ("tool_use", None)
        );
        assert_eq!(
            stop_reason(&o(FinishReason::Length, None), true),
            ("max_tokens", None)
        );
        assert_eq!(
            stop_reason(&o(FinishReason::Stop, Some("END")), false),
            ("stop_sequence", Some("END".into()))
        );
    }
}
