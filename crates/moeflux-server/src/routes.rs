//! The HTTP routes, the API-key check and request intake: read the body
//! (within `body_timeout`), parse and validate, take a place in the queue
//! (429 at once when there is none), bound the prompt's length from its
//! bytes, then render and tokenize it off the async threads, at most
//! `prepare_threads` at once, queue the job and answer (see
//! [`crate::respond`]). A refused request is never tokenized.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use moeflux::text::harmony::HarmonyIds;
use serde_json::json;
use tokio::sync::mpsc::unbounded_channel;
use tower_http::catch_panic::CatchPanicLayer;

use crate::anthropic::{self, MessagesRequest};
use crate::anthropic_respond::{self, MessageAnswer};
use crate::api::{self, ChatRequest, ChatSpec, CompletionRequest, Prompt};
use crate::constrain::Constraint;
use crate::engine::{Admission, EngineEvent, Job};
use crate::error::ApiError;
use crate::prompt::{self, ChatInput, ChatPrompt};
use crate::respond::{self, Answer, CancelOnDrop};
use crate::structured::{self, ForcedCall};
use crate::{random_u64, AppState};

pub fn router(state: Arc<AppState>) -> Router {
    let page = if state.ui {
        crate::ui::routes()
    } else {
        Router::new()
    };
    Router::new()
        .merge(page)
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(DefaultBodyLimit::max(state.max_body_bytes))
        // A bug in a handler answers 500 with an error object; the server
        // and the other requests go on.
        .layer(CatchPanicLayer::custom(
            |_: Box<dyn std::any::Any + Send>| {
                ApiError::internal("internal error: the request handler panicked").into_response()
            },
        ))
        .layer(middleware::from_fn(anthropic_errors))
        .with_state(state)
}

/// What a connection beyond `max_connections` is served: `/health`, and
/// 503 for everything else (see [`crate::conn`]).
pub fn over_limit_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .fallback(|| async {
            ApiError::unavailable("the server has too many open connections; retry later")
        })
        .layer(middleware::from_fn(anthropic_errors))
        .with_state(state)
}

/// Errors under `/v1/messages` in Anthropic's shape, wherever they arose
/// (the key check, the body limit, a panic, an unknown path or method):
/// every [`ApiError`] response carries its error.
async fn anthropic_errors(req: Request, next: Next) -> Response {
    let dialect = anthropic::is_path(req.uri().path());
    let mut resp = next.run(req).await;
    if dialect {
        if let Some(e) = resp.extensions_mut().remove::<ApiError>() {
            return anthropic::error_response(e);
        }
    }
    resp
}

/// `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY`
/// (Anthropic's) on everything but `/health` and the chat page's files
/// (the page asks for the key itself), when a key is set. The
/// scheme is case-insensitive (RFC 9110); the key is compared in constant
/// time.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        let path = req.uri().path();
        if path != "/health" && !(st.ui && crate::ui::is_page(path)) {
            let h = req.headers();
            let value = |name: header::HeaderName| h.get(name).and_then(|v| v.to_str().ok());
            let bearer = value(header::AUTHORIZATION).and_then(bearer_token);
            let x_api_key = value(header::HeaderName::from_static("x-api-key")).map(str::trim);
            let ok = [bearer, x_api_key].into_iter().flatten().any(|given| {
                subtle::ConstantTimeEq::ct_eq(given.as_bytes(), key.as_bytes()).into()
            });
            if !ok {
                st.metrics.request("auth", 401);
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

/// The credentials of a `Bearer` authorization value, any case of the
/// scheme.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once([' ', '\t'])?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint; see /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens, /v1/models, /health, /metrics")
}

/// The request body, read within `body_timeout` (a client trickling it
/// gets 408 and the connection closes).
async fn read_body(st: &AppState, req: Request) -> Result<Bytes, ApiError> {
    let read = tokio::time::timeout(st.body_timeout, Bytes::from_request(req, &()));
    match read.await {
        Ok(body) => body_bytes(st, body),
        Err(_) => Err(ApiError::body_timeout(st.body_timeout)),
    }
}

fn body_bytes(st: &AppState, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(st.max_body_bytes)
        } else {
            ApiError::invalid("", format!("cannot read the request body: {e}"))
        }
    })
}

/// Counts the answer's status for `/metrics`.
fn counted(st: &AppState, endpoint: &'static str, r: Result<Response, ApiError>) -> Response {
    let resp = r.unwrap_or_else(IntoResponse::into_response);
    st.metrics.request(endpoint, resp.status().as_u16());
    resp
}

async fn chat_completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = chat_inner(&st, req).await;
    counted(&st, "chat", r)
}

async fn chat_inner(st: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let body = read_body(st, req).await?;
    let req: ChatRequest = api::parse_body(&body)?;
    drop(body);
    let spec = req.spec(&st.defaults, st.info.max_context, random_u64())?;
    let logprobs = spec.params.logprobs.is_some();
    let job = start_chat(st, spec).await?;
    let answer = Answer {
        chat: true,
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        tools: job.tools,
        forced: job.forced,
        logprobs,
    };
    Ok(respond::answer(st.clone(), answer, job.events, job.cancel).await)
}

/// Anthropic's `POST /v1/messages`: the request in the server's terms,
/// the same chat job, the answer in Anthropic's shapes.
async fn messages(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = messages_inner(&st, req).await;
    anthropic_counted(&st, "messages", r)
}

/// Counts an Anthropic route's answer, its errors in Anthropic's shape.
fn anthropic_counted(
    st: &AppState,
    route: &'static str,
    r: Result<Response, ApiError>,
) -> Response {
    counted(st, route, Ok(r.unwrap_or_else(anthropic::error_response)))
}

/// The body of an Anthropic request, parsed.
async fn messages_request(st: &Arc<AppState>, req: Request) -> Result<MessagesRequest, ApiError> {
    let body = read_body(st, req).await?;
    api::parse_body(&body)
}

async fn messages_inner(st: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let req = messages_request(st, req).await?;
    let spec = req.spec(&st.defaults, st.info.max_context, random_u64())?;
    let job = start_chat(st, spec).await?;
    let answer = MessageAnswer {
        stream: req.stream.unwrap_or(false),
        prompt_tokens: job.prompt_tokens,
        tools: job.tools,
        forced: job.forced,
    };
    Ok(anthropic_respond::answer(st.clone(), answer, job.events, job.cancel).await)
}

/// Anthropic's `POST /v1/messages/count_tokens`: the prompt's tokens, as
/// `/v1/messages` would render them (`usage.input_tokens`).
async fn count_tokens(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = count_tokens_inner(&st, req).await;
    anthropic_counted(&st, "count_tokens", r)
}

async fn count_tokens_inner(st: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let req = messages_request(st, req).await?;
    let spec = req.count_spec(&st.defaults, st.info.max_context)?;
    let (_admission, _, prepared) = prepare_chat(st, spec).await?;
    Ok(Json(json!({"input_tokens": prepared.tokens.len()})).into_response())
}

/// A chat job queued: what its answer needs.
struct ChatJob {
    prompt_tokens: usize,
    /// The request's tools when calls are parsed out of the answer.
    tools: Option<Vec<serde_json::Value>>,
    /// A forced call's opening, appended to the prompt.
    forced: Option<String>,
    cancel: CancelOnDrop,
    events: tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
}

/// Renders and tokenizes a chat request's prompt (see [`prepare_chat`])
/// and queues its job.
async fn start_chat(st: &Arc<AppState>, spec: ChatSpec) -> Result<ChatJob, ApiError> {
    let (admission, spec, prepared) = prepare_chat(st, spec).await?;
    check_length(
        st,
        prepared.tokens.len(),
        spec.params.max_tokens,
        "messages",
    )?;
    let prompt_tokens = prepared.tokens.len();
    let constraint = constraint(st, &spec, &prepared).await?;
    let (cancel, events) = submit(
        st,
        admission,
        Job {
            prompt: prepared.tokens,
            boundaries: prepared.boundaries,
            params: spec.params,
            starts_in_reasoning: prepared.starts_in_reasoning,
            constraint,
            cancel: Arc::new(AtomicBool::new(false)),
            events: unbounded_channel().0,
        },
    )?;
    Ok(ChatJob {
        prompt_tokens,
        tools: prepared.parse_tools.then(|| spec.tools.unwrap_or_default()),
        forced: prepared.forced,
        cancel,
        events,
    })
}

/// The grammar of a chat request that asks for structured output
/// (`response_format`, a forced call to a strict tool), compiled off the
/// async threads; `None` when it asks for none.
async fn constraint(
    st: &Arc<AppState>,
    spec: &ChatSpec,
    prepared: &ChatPrompt,
) -> Result<Option<Constraint>, ApiError> {
    if spec.response_schema.is_none() && prepared.forced_call.is_none() {
        return Ok(None);
    }
    let st2 = st.clone();
    let schema = spec.response_schema.clone();
    let tools = spec.tools.clone().unwrap_or_default();
    let forced = prepared.forced_call.clone();
    let in_reasoning = prepared.starts_in_reasoning;
    prepare(st, move || {
        let request = structured::Request {
            schema: schema.as_ref(),
            tools: &tools,
            forced: forced.as_ref().map(|(format, name)| ForcedCall {
                format: *format,
                name: name.as_deref(),
            }),
            harmony: HarmonyIds::from_tokenizer(&st2.tokenizer).is_some(),
        };
        let special = |name: &str| st2.grammars().is_ok_and(|g| g.has_special(name));
        let Some(grammar) = structured::grammar(&request, &special)? else {
            return Ok(None);
        };
        st2.grammars()?
            .constraint(&grammar.lark, in_reasoning)
            .map(Some)
            .map_err(|e| {
                let p = grammar.param;
                ApiError::invalid(
                    p.clone(),
                    format!("cannot constrain the output to `{p}`: {e}"),
                )
            })
    })
    .await
}

/// Takes a place in the queue (a refused request is never tokenized), then
/// renders and tokenizes the chat prompt off the async threads.
async fn prepare_chat(
    st: &Arc<AppState>,
    spec: ChatSpec,
) -> Result<(Admission, ChatSpec, ChatPrompt), ApiError> {
    // Every message renders to at least one token.
    if spec.messages.len() > st.info.max_context {
        return Err(ApiError::invalid(
            "messages",
            format!(
                "{} messages cannot fit in the context of {} tokens",
                spec.messages.len(),
                st.info.max_context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    let admission = st.engine.admit()?;
    let st2 = st.clone();
    let (spec, prepared) = prepare(st, move || {
        let max_tokens = spec.params.max_tokens;
        let prepared = prompt::chat_prompt_checked(
            &st2.template,
            &st2.tokenizer,
            st2.tool_format,
            &ChatInput {
                messages: &spec.messages,
                tools: spec.tools.as_deref(),
                choice: &spec.choice,
                template_kwargs: spec.template_kwargs.as_ref(),
            },
            &|text| before_tokenizing(&st2, text, max_tokens, "messages"),
        )?;
        Ok((spec, prepared))
    })
    .await?;
    Ok((admission, spec, prepared))
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let r = completions_inner(&st, req).await;
    counted(&st, "completions", r)
}

async fn completions_inner(st: &Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let body = read_body(st, req).await?;
    let req: CompletionRequest = api::parse_body(&body)?;
    drop(body);
    req.check_unsupported()?;
    let logprobs = crate::logprobs::completion_request(req.logprobs, req.echo)?;
    let prompt = api::completion_prompt(req.prompt.as_ref())?;
    let mut params = api::gen_params(
        &req.sampling(),
        &st.defaults,
        st.info.max_context,
        random_u64(),
    )?;
    params.logprobs = logprobs;
    let admission = st.engine.admit()?;
    let tokens = match prompt {
        Prompt::Tokens(ids) => {
            if let Some((i, t)) = ids
                .iter()
                .enumerate()
                .find(|(_, &t)| t as usize >= st.info.vocab_size)
            {
                return Err(ApiError::invalid(
                    format!("prompt[{i}]"),
                    format!(
                        "token id {t} is outside the vocabulary of {}",
                        st.info.vocab_size
                    ),
                ));
            }
            ids
        }
        Prompt::Text(text) => {
            let st2 = st.clone();
            let max_tokens = params.max_tokens;
            prepare(st, move || {
                before_tokenizing(&st2, &text, max_tokens, "prompt")?;
                prompt::encode(&st2.tokenizer, &text)
            })
            .await?
        }
    };
    if tokens.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt is empty"));
    }
    check_length(st, tokens.len(), params.max_tokens, "prompt")?;
    let answer = Answer {
        chat: false,
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        tools: None,
        forced: None,
        logprobs: params.logprobs.is_some(),
    };
    let (cancel, rx) = submit(
        st,
        admission,
        Job {
            prompt: tokens,
            boundaries: Vec::new(),
            params,
            starts_in_reasoning: false,
            constraint: None,
            cancel: Arc::new(AtomicBool::new(false)),
            events: unbounded_channel().0,
        },
    )?;
    Ok(respond::answer(st.clone(), answer, rx, cancel).await)
}

/// Runs `work` (template, tokenizer) on the blocking pool once one of the
/// `prepare_threads` places is free.
async fn prepare<T: Send + 'static>(
    st: &AppState,
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let place = st
        .prepare
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::unavailable("the server is stopping"))?;
    // The place goes with the work: a client that leaves does not free it
    // while its prompt is still being tokenized.
    tokio::task::spawn_blocking(move || {
        let _place = place;
        work()
    })
    .await
    .map_err(|e| ApiError::internal(format!("prompt task failed: {e}")))?
}

/// Refuses, from its length in bytes alone, a text that cannot fit the
/// context; counts the prompts that go on to the tokenizer.
fn before_tokenizing(
    st: &AppState,
    text: &str,
    max_tokens: Option<usize>,
    param: &str,
) -> Result<(), ApiError> {
    let at_least = st.length_bound.min_tokens(text.len());
    if at_least + max_tokens.unwrap_or(1) > st.info.max_context {
        return Err(ApiError::invalid(
            param,
            format!(
                "the prompt is {} bytes, at least {at_least} tokens; the context size is {}",
                text.len(),
                st.info.max_context
            ),
        )
        .with_code("context_length_exceeded"));
    }
    st.metrics.prompts_tokenized.fetch_add(1, Ordering::Relaxed);
    Ok(())
}

/// The prompt must leave room for at least one token, and for
/// `max_tokens` when given.
fn check_length(
    st: &AppState,
    prompt: usize,
    max_tokens: Option<usize>,
    param: &str,
) -> Result<(), ApiError> {
    let ctx = st.info.max_context;
    let need = prompt + max_tokens.unwrap_or(1);
    if need > ctx {
        let msg = match max_tokens {
            Some(m) => format!(
                "the context size is {ctx} tokens, but {need} were requested ({prompt} in the prompt, {m} to generate)"
            ),
            None => format!("the prompt is {prompt} tokens; the context size is {ctx}"),
        };
        return Err(ApiError::invalid(param, msg).with_code("context_length_exceeded"));
    }
    Ok(())
}

/// Queues `job` with a fresh event channel; the guard cancels the job when
/// the answer is dropped (the client went away).
fn submit(
    st: &AppState,
    admission: Admission,
    mut job: Job,
) -> Result<
    (
        CancelOnDrop,
        tokio::sync::mpsc::UnboundedReceiver<crate::engine::EngineEvent>,
    ),
    ApiError,
> {
    let (tx, rx) = unbounded_channel();
    job.events = tx;
    let cancel = CancelOnDrop(job.cancel.clone());
    st.engine.submit(admission, job)?;
    Ok((cancel, rx))
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    let r = Ok(Json(json!({"object": "list", "data": [model_object(&st)]})).into_response());
    counted(&st, "models", r)
}

async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let r = if id == st.model_name {
        Ok(Json(model_object(&st)).into_response())
    } else {
        Err(ApiError::not_found(format!(
            "no model `{id}`; this server has `{}`",
            st.model_name
        )))
    };
    counted(&st, "models", r)
}

fn model_object(st: &AppState) -> serde_json::Value {
    json!({
        "id": st.model_name,
        "object": "model",
        "created": st.started,
        "owned_by": "moeflux",
        "max_model_len": st.info.max_context,
    })
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if !st.engine.alive() {
        return ApiError::unavailable("the engine has stopped").into_response();
    }
    Json(json!({
        "status": "ok",
        "model": st.model_name,
        "backend": st.info.backend,
        "queue_depth": st.metrics.queue_depth.load(Ordering::Relaxed),
        "running": st.metrics.running.load(Ordering::Relaxed),
    }))
    .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.metrics.render(),
    )
        .into_response()
}
