//! Turning a job's engine events into the OpenAI response: one JSON object,
//! or an SSE stream of chunks ending with `data: [DONE]`. Content goes
//! through the tool-call parser when tools are in play. The SSE pump
//! ([`sse`], over an API's [`SseShape`]) and [`drain`] serve Anthropic's
//! answers too ([`crate::anthropic_respond`]).

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use moeflux::generate::FinishReason;
use moeflux::logprobs::TokenLogprobs;
use serde_json::{json, Value as Json_};
use tokio::sync::mpsc::{self, UnboundedReceiver};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crate::engine::{EngineEvent, Outcome};
use crate::error::ApiError;
use crate::logprobs::LogprobsOut;
use crate::tools::{Delta, ToolCallParser};
use crate::{random_id, unix_now, AppState};

/// Raises the job's cancel flag when dropped: the handler future or the
/// stream task ended, so nobody reads the answer any more.
pub struct CancelOnDrop(pub Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// How to answer.
pub struct Answer {
    /// `chat.completion` (else `text_completion`).
    pub chat: bool,
    pub stream: bool,
    pub include_usage: bool,
    /// Parse tool calls (the request's tools, for parameter types).
    pub tools: Option<Vec<Json_>>,
    /// A forced call opening appended to the prompt (the parser's start).
    pub forced: Option<String>,
    /// The request asked for logprobs (the engine sends them).
    pub logprobs: bool,
}

pub async fn answer(
    st: Arc<AppState>,
    a: Answer,
    rx: UnboundedReceiver<EngineEvent>,
    cancel: CancelOnDrop,
) -> Response {
    if a.stream {
        stream(st, a, rx, cancel)
    } else {
        match collect(&st, &a, rx).await {
            Ok(v) => Json(v).into_response(),
            Err(e) => e.into_response(),
        }
        // `cancel` drops here; the job is over anyway.
    }
}

/// What is common to every object of one answer.
struct Ids {
    id: String,
    created: u64,
    model: String,
    chat: bool,
}

impl Ids {
    fn new(st: &AppState, chat: bool) -> Ids {
        Ids {
            id: random_id(if chat { "chatcmpl-" } else { "cmpl-" }),
            created: unix_now(),
            model: st.model_name.clone(),
            chat,
        }
    }

    fn object(&self, choices: Json_, streaming: bool) -> Json_ {
        let object = match (self.chat, streaming) {
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
            (false, _) => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

fn parser(a: &Answer) -> Option<ToolCallParser> {
    a.tools.as_deref().map(|t| tool_parser(t, "call_"))
}

fn logprobs_out(st: &AppState, a: &Answer) -> Option<LogprobsOut> {
    a.logprobs
        .then(|| LogprobsOut::new(st.tokenizer.clone(), a.chat))
}

/// The tool-call parser for a request's `tools`, naming calls
/// `id_prefix` + random digits (or the model's own id, Kimi).
pub(crate) fn tool_parser(tools: &[Json_], id_prefix: &'static str) -> ToolCallParser {
    let tools = Json_::Array(tools.to_vec());
    ToolCallParser::new(Some(&tools), Box::new(move || random_id(id_prefix)))
}

fn finish_reason(o: &Outcome, tool_calls: bool) -> &'static str {
    match o.finish {
        FinishReason::Length => "length",
        _ if tool_calls => "tool_calls",
        _ => "stop",
    }
}

fn usage(o: &Outcome) -> Json_ {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

/// Server-side timings (like llama.cpp's `timings`; not in OpenAI's API).
fn timings(o: &Outcome) -> Json_ {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    json!({
        "queued_ms": ms(o.queued),
        "prompt_ms": ms(o.prefill),
        "ttft_ms": ms(o.ttft),
        "decode_ms": ms(o.decode),
        "prompt_tokens_evaluated": o.prompt_tokens - o.cached_tokens,
    })
}

fn tool_call_json(c: &crate::tools::ToolCall) -> Json_ {
    json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
}

async fn collect(
    st: &AppState,
    a: &Answer,
    mut rx: UnboundedReceiver<EngineEvent>,
) -> Result<Json_, ApiError> {
    let mut parser = parser(a);
    let mut logprobs = logprobs_out(st, a);
    let (mut content, mut reasoning) = (String::new(), String::new());
    let take = |deltas: Vec<Delta>, content: &mut String| {
        for d in deltas {
            if let Delta::Content(s) = d {
                content.push_str(&s);
            }
        }
    };
    if let (Some(p), Some(f)) = (parser.as_mut(), &a.forced) {
        take(p.push(f), &mut content);
    }
    let outcome = drain_with(
        &mut rx,
        |text, is_reasoning| {
            if is_reasoning && a.chat {
                reasoning.push_str(&text);
            } else {
                match parser.as_mut() {
                    Some(p) => take(p.push(&text), &mut content),
                    None => content.push_str(&text),
                }
            }
        },
        |lp| {
            if let Some(out) = logprobs.as_mut() {
                out.push(lp);
            }
        },
    )
    .await?;
    let logprobs = logprobs.as_mut().map_or(Json_::Null, LogprobsOut::take);
    let calls: Vec<Json_> = match parser.as_mut() {
        Some(p) => {
            take(p.finish(), &mut content);
            p.calls().iter().map(tool_call_json).collect()
        }
        None => Vec::new(),
    };
    let ids = Ids::new(st, a.chat);
    let finish = finish_reason(&outcome, !calls.is_empty());
    let choice = if a.chat {
        let mut message = json!({
            "role": "assistant",
            "content": if content.is_empty() && !calls.is_empty() { Json_::Null } else { content.into() },
        });
        if !reasoning.is_empty() {
            message["reasoning_content"] = reasoning.into();
        }
        if !calls.is_empty() {
            message["tool_calls"] = calls.into();
        }
        json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish})
    } else {
        json!({"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish})
    };
    let mut v = ids.object(json!([choice]), false);
    v["usage"] = usage(&outcome);
    v["timings"] = timings(&outcome);
    Ok(v)
}

/// Builds the chunks of a streamed answer.
struct Chunks {
    ids: Ids,
}

impl Chunks {
    fn delta(&self, delta: Json_, finish: Option<&str>) -> Json_ {
        let choice = if self.ids.chat {
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            let text = delta.get("content").cloned().unwrap_or_else(|| "".into());
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
        };
        self.ids.object(json!([choice]), true)
    }

    fn parsed(&self, deltas: Vec<Delta>) -> Vec<Json_> {
        deltas
            .into_iter()
            .map(|d| match d {
                Delta::Content(s) => self.delta(json!({"content": s}), None),
                Delta::CallStart { index, id, name } => self.delta(
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    None,
                ),
                Delta::CallArgs { index, fragment } => self.delta(
                    json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}),
                    None,
                ),
            })
            .collect()
    }
}

fn data(v: &Json_) -> Event {
    Event::default().data(v.to_string())
}

/// A job's engine events until it is done: text to `on_text` (with
/// whether it is reasoning), then its outcome.
pub(crate) async fn drain(
    rx: &mut UnboundedReceiver<EngineEvent>,
    on_text: impl FnMut(String, bool),
) -> Result<Outcome, ApiError> {
    drain_with(rx, on_text, |_| {}).await
}

/// [`drain`], with each token's log-probabilities to `on_logprob`.
async fn drain_with(
    rx: &mut UnboundedReceiver<EngineEvent>,
    mut on_text: impl FnMut(String, bool),
    mut on_logprob: impl FnMut(TokenLogprobs),
) -> Result<Outcome, ApiError> {
    loop {
        match rx.recv().await {
            Some(EngineEvent::Text { text, reasoning }) => on_text(text, reasoning),
            Some(EngineEvent::Logprob(lp)) => on_logprob(lp),
            Some(EngineEvent::Done(r)) => return r,
            None => return Err(ApiError::internal("the engine stopped")),
        }
    }
}

/// One API's SSE events for a job's engine events.
pub(crate) trait SseShape: Send + 'static {
    /// The events before any text.
    fn start(&mut self) -> Vec<Event>;
    fn text(&mut self, text: String, reasoning: bool) -> Vec<Event>;
    /// A token's log-probabilities (sent before the text it completes);
    /// only jobs that asked get them.
    fn logprob(&mut self, _lp: TokenLogprobs) -> Vec<Event> {
        Vec::new()
    }
    /// The job ended (its outcome, or its error): the last events.
    fn done(&mut self, result: Result<Outcome, ApiError>) -> Vec<Event>;
}

/// Streams `shape`'s events for the job behind `rx`, with `keep_alive`
/// every 2 s of silence. The job is cancelled when the client goes away.
pub(crate) fn sse(
    mut shape: impl SseShape,
    mut rx: UnboundedReceiver<EngineEvent>,
    cancel: CancelOnDrop,
    keep_alive: KeepAlive,
) -> Response {
    let (tx, out) = mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        // Dropped when this task ends: early (client gone) cancels the job.
        let _cancel = cancel;
        for e in shape.start() {
            if tx.send(e).await.is_err() {
                return;
            }
        }
        loop {
            let ev = tokio::select! {
                ev = rx.recv() => ev,
                _ = tx.closed() => return,
            };
            let (events, last) = match ev {
                Some(EngineEvent::Text { text, reasoning }) => (shape.text(text, reasoning), false),
                Some(EngineEvent::Logprob(lp)) => (shape.logprob(lp), false),
                Some(EngineEvent::Done(r)) => (shape.done(r), true),
                None => (
                    shape.done(Err(ApiError::internal("the engine stopped"))),
                    true,
                ),
            };
            for e in events {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
            if last {
                return;
            }
        }
    });
    let events = ReceiverStream::new(out).map(Ok::<_, Infallible>);
    // Keep-alives during a long prefill also reveal a client that has gone
    // (the write fails), which cancels the job.
    Sse::new(events)
        .keep_alive(keep_alive.interval(Duration::from_secs(2)))
        .into_response()
}

/// OpenAI's chunks, ending with `data: [DONE]`.
struct OpenAiStream {
    chunks: Chunks,
    answer: Answer,
    parser: Option<ToolCallParser>,
    /// Tokens' log-probabilities waiting for the next chunk.
    logprobs: Option<LogprobsOut>,
}

impl OpenAiStream {
    /// Puts the tokens that arrived since the last chunk on the first of
    /// `chunks` (tokens whose text is held back, a stop string's start or
    /// a tool call's markup, ride on a later chunk).
    fn with_logprobs(&mut self, mut chunks: Vec<Json_>) -> Vec<Json_> {
        if let (Some(out), Some(first)) = (self.logprobs.as_mut(), chunks.first_mut()) {
            if let Some(lp) = out.take_some() {
                first["choices"][0]["logprobs"] = lp;
            }
        }
        chunks
    }
}

impl SseShape for OpenAiStream {
    fn start(&mut self) -> Vec<Event> {
        let c = &self.chunks;
        let mut first: Vec<Json_> = Vec::new();
        if self.answer.chat {
            first.push(c.delta(json!({"role": "assistant", "content": ""}), None));
        }
        if let (Some(p), Some(f)) = (self.parser.as_mut(), &self.answer.forced) {
            first.extend(c.parsed(p.push(f)));
        }
        first.iter().map(data).collect()
    }

    fn text(&mut self, text: String, reasoning: bool) -> Vec<Event> {
        let c = &self.chunks;
        let chunks = if reasoning && self.answer.chat {
            vec![c.delta(json!({"reasoning_content": text}), None)]
        } else {
            match self.parser.as_mut() {
                Some(p) => c.parsed(p.push(&text)),
                None => vec![c.delta(json!({"content": text}), None)],
            }
        };
        self.with_logprobs(chunks).iter().map(data).collect()
    }

    fn logprob(&mut self, lp: TokenLogprobs) -> Vec<Event> {
        if let Some(out) = self.logprobs.as_mut() {
            out.push(lp);
        }
        Vec::new()
    }

    fn done(&mut self, result: Result<Outcome, ApiError>) -> Vec<Event> {
        let c = &self.chunks;
        let mut v = Vec::new();
        match result {
            Ok(o) => {
                if let Some(p) = self.parser.as_mut() {
                    v = c.parsed(p.finish());
                }
                let calls = self.parser.as_ref().is_some_and(|p| !p.calls().is_empty());
                let mut last = c.delta(json!({}), Some(finish_reason(&o, calls)));
                // Usage on the final chunk always (clients that did not
                // ask ignore it), and OpenAI's usage-only chunk on request.
                last["usage"] = usage(&o);
                last["timings"] = timings(&o);
                v.push(last);
                v = self.with_logprobs(v);
                if self.answer.include_usage {
                    let mut u = self.chunks.ids.object(json!([]), true);
                    u["usage"] = usage(&o);
                    v.push(u);
                }
            }
            Err(e) => v.push(e.body()),
        }
        let mut events: Vec<Event> = v.iter().map(data).collect();
        events.push(Event::default().data("[DONE]"));
        events
    }
}

fn stream(
    st: Arc<AppState>,
    a: Answer,
    rx: UnboundedReceiver<EngineEvent>,
    cancel: CancelOnDrop,
) -> Response {
    let shape = OpenAiStream {
        chunks: Chunks {
            ids: Ids::new(&st, a.chat),
        },
        parser: parser(&a),
        logprobs: logprobs_out(&st, &a),
        answer: a,
    };
    sse(shape, rx, cancel, KeepAlive::new())
}
