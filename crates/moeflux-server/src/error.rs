//! OpenAI-style error responses:
//! `{"error": {"message", "type", "param", "code"}}` with the HTTP status
//! (Anthropic's shape of the same error: [`crate::anthropic::error_response`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault, e.g. `messages[1].role`.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429 and 503.
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 about the request field `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            message.into(),
        );
        let p = param.into();
        e.param = (!p.is_empty()).then_some(p);
        e
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or invalid API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
        )
        .with_code("invalid_api_key")
    }

    pub fn queue_full(retry_after: u64) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the server is busy: the request queue is full; retry later",
        )
        .with_code("queue_full");
        e.retry_after = Some(retry_after.max(1));
        e
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.retry_after = Some(1);
        e
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed for this endpoint",
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body exceeds the server's limit of {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    /// 408: the body did not arrive in time. The connection is closed
    /// after it (the rest of the body is never read).
    pub fn body_timeout(after: std::time::Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body did not arrive within {} s",
                after.as_secs_f64()
            ),
        )
        .with_code("request_timeout")
    }

    /// The JSON body (also sent as an SSE `error` event mid-stream).
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl ApiError {
    /// The headers that go with this error's status: `Retry-After`,
    /// `Connection: close` after a body timeout, `WWW-Authenticate`.
    pub fn add_headers(&self, resp: &mut Response) {
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.status == StatusCode::REQUEST_TIMEOUT {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        self.add_headers(&mut resp);
        // Kept on the response, so that a layer can answer in another API's
        // shape (Anthropic's, under `/v1/messages`).
        resp.extensions_mut().insert(self);
        resp
    }
}
