//! The HTTP routes, the API-key check and request intake: parse and
//! validate, build the prompt off the async threads, queue the job, answer
//! (see [`crate::respond`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use tokio::sync::mpsc::unbounded_channel;
use tower_http::catch_panic::CatchPanicLayer;

use crate::api::{self, ChatRequest, CompletionRequest, Prompt};
use crate::engine::Job;
use crate::error::ApiError;
use crate::prompt::{self, ChatInput};
use crate::respond::{self, Answer, CancelOnDrop};
use crate::{random_u64, AppState};

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
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
        .with_state(state)
}

/// `Authorization: Bearer KEY` on everything but `/health`, when a key is
/// set. Compared in constant time.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        if req.uri().path() != "/health" {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "))
                .unwrap_or("");
            if !constant_time_eq(given.trim().as_bytes(), key.as_bytes()) {
                st.metrics.request("auth", 401);
                return ApiError::unauthorized().into_response();
            }
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint; see /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics")
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

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = chat_inner(&st, body).await;
    counted(&st, "chat", r)
}

async fn chat_inner(
    st: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(st, body)?;
    let req: ChatRequest = api::parse_body(&body)?;
    req.check_unsupported()?;
    let messages = req.checked_messages()?;
    let choice = api::tool_choice(req.tools.as_deref(), req.tool_choice.as_ref())?;
    let params = api::gen_params(
        &req.sampling(),
        &st.defaults,
        st.info.max_context,
        random_u64(),
    )?;
    let (st2, tools, kwargs, choice2) = (
        st.clone(),
        req.tools.clone(),
        req.chat_template_kwargs.clone(),
        choice.clone(),
    );
    let prepared = tokio::task::spawn_blocking(move || {
        prompt::chat_prompt(
            &st2.template,
            &st2.tokenizer,
            st2.tool_format,
            &ChatInput {
                messages: &messages,
                tools: tools.as_deref(),
                choice: &choice2,
                template_kwargs: kwargs.as_ref(),
            },
        )
    })
    .await
    .map_err(|e| ApiError::internal(format!("prompt task failed: {e}")))??;
    check_length(st, prepared.tokens.len(), params.max_tokens, "messages")?;
    let answer = Answer {
        chat: true,
        stream: req.stream.unwrap_or(false),
        include_usage: req
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        tools: prepared
            .parse_tools
            .then(|| req.tools.clone().unwrap_or_default()),
        forced: prepared.forced.clone(),
    };
    let (cancel, rx) = submit(
        st,
        Job {
            prompt: prepared.tokens,
            boundaries: prepared.boundaries,
            params,
            starts_in_reasoning: prepared.starts_in_reasoning,
            cancel: Arc::new(AtomicBool::new(false)),
            events: unbounded_channel().0,
        },
    )?;
    Ok(respond::answer(st.clone(), answer, rx, cancel).await)
}

async fn completions(
    State(st): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = completions_inner(&st, body).await;
    counted(&st, "completions", r)
}

async fn completions_inner(
    st: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body_bytes(st, body)?;
    let req: CompletionRequest = api::parse_body(&body)?;
    req.check_unsupported()?;
    let prompt = api::completion_prompt(req.prompt.as_ref())?;
    let params = api::gen_params(
        &req.sampling(),
        &st.defaults,
        st.info.max_context,
        random_u64(),
    )?;
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
            tokio::task::spawn_blocking(move || prompt::encode(&st2.tokenizer, &text))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))??
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
    };
    let (cancel, rx) = submit(
        st,
        Job {
            prompt: tokens,
            boundaries: Vec::new(),
            params,
            starts_in_reasoning: false,
            cancel: Arc::new(AtomicBool::new(false)),
            events: unbounded_channel().0,
        },
    )?;
    Ok(respond::answer(st.clone(), answer, rx, cancel).await)
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
    st.engine.submit(job)?;
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
