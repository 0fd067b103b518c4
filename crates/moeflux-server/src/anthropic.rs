//! Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`)
//! in the server's terms: a request becomes the [`ChatSpec`] the OpenAI chat
//! route builds (same template, tool-call spelling, sampler and engine), and
//! an [`ApiError`] takes Anthropic's shape. The answer's shapes are in
//! [`crate::anthropic_respond`].
//!
//! Mapping: `system` (a string or text blocks) is the system message; a user
//! message's `tool_result` blocks are `tool` messages (named after the call
//! they answer), its text blocks a user message; an assistant message's
//! text, `thinking` and `tool_use` blocks are its content, reasoning and
//! `tool_calls`. Text blocks of one message are joined with a blank line.
//! `tools` become OpenAI function tools, `tool_choice` `auto`/`any`/`tool`/
//! `none` OpenAI's `auto`/`required`/named/`none`, `thinking` the template's
//! `enable_thinking`, `output_config.effort` its `reasoning_effort`. What
//! this server cannot do (images, documents, server tools, structured
//! output, a final assistant message to continue) is refused with a 400
//! naming the field.

use std::collections::HashMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use moeflux::text::chat::{ChatMessage, Content};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use crate::api::{self, ChatSpec, Defaults, SamplingFields, Stop};
use crate::error::ApiError;

/// Joins the text blocks of one message (or of `system`).
const BLOCK_SEPARATOR: &str = "\n\n";

/// Whether `path` is one of this API's (its errors take Anthropic's shape).
pub fn is_path(path: &str) -> bool {
    path == "/v1/messages" || path.starts_with("/v1/messages/")
}

/// `POST /v1/messages` (and `count_tokens`, which reads the same fields
/// but `max_tokens` and the sampling ones).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct MessagesRequest {
    /// Any name: the server has one model.
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub messages: Option<Vec<InMessage>>,
    pub system: Option<Content>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    /// `user_id`: accepted, not used.
    pub metadata: Option<Json>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub thinking: Option<Json>,
    /// `effort` (the template's `reasoning_effort`); `format` is refused.
    pub output_config: Option<Json>,
    /// Anthropic-hosted features: refused when given.
    pub container: Option<Json>,
    pub mcp_servers: Option<Vec<Json>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct InMessage {
    pub role: String,
    /// A string, or content blocks.
    pub content: Content,
}

#[derive(Deserialize)]
struct TextBlock {
    text: String,
}

#[derive(Deserialize)]
struct ThinkingBlock {
    thinking: String,
}

#[derive(Deserialize)]
struct ToolUseBlock {
    id: String,
    name: String,
    input: Json,
}

#[derive(Deserialize)]
struct ToolResultBlock {
    tool_use_id: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
struct ToolDef {
    name: String,
    #[serde(default)]
    description: Option<String>,
    input_schema: Json,
    /// The call's input follows `input_schema` exactly (when forced).
    #[serde(default)]
    strict: Option<bool>,
}

impl MessagesRequest {
    /// The request checked, for generation (`ctx`: the context size;
    /// `random_seed`: the sampler's seed, Anthropic's API has none).
    pub fn spec(&self, d: &Defaults, ctx: usize, random_seed: u64) -> Result<ChatSpec, ApiError> {
        if self.max_tokens.is_none() {
            return Err(ApiError::invalid("max_tokens", "`max_tokens` is required"));
        }
        self.build(d, ctx, random_seed)
    }

    /// The request checked, for `count_tokens` (no `max_tokens` needed).
    pub fn count_spec(&self, d: &Defaults, ctx: usize) -> Result<ChatSpec, ApiError> {
        self.build(d, ctx, 0)
    }

    fn build(&self, d: &Defaults, ctx: usize, random_seed: u64) -> Result<ChatSpec, ApiError> {
        if self.container.as_ref().is_some_and(|c| !c.is_null()) {
            return Err(ApiError::invalid(
                "container",
                "containers are not supported",
            ));
        }
        if self.mcp_servers.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                "mcp_servers",
                "MCP servers are not supported; give their tools as `tools`",
            ));
        }
        let messages = self.chat_messages()?;
        let tools = self.openai_tools()?;
        let choice = api::tool_choice(tools.as_deref(), self.openai_tool_choice()?.as_ref())?;
        let mut template_kwargs = Map::new();
        if let Some(on) = self.enable_thinking()? {
            template_kwargs.insert("enable_thinking".into(), on.into());
        }
        if let Some(effort) = self.reasoning_effort()? {
            template_kwargs.insert("reasoning_effort".into(), effort.into());
        }
        let template_kwargs = (!template_kwargs.is_empty()).then_some(template_kwargs);
        let params = api::gen_params(&self.sampling(), d, ctx, random_seed).map_err(|mut e| {
            if e.param.as_deref() == Some("stop") {
                e.param = Some("stop_sequences".into());
            }
            e
        })?;
        Ok(ChatSpec {
            messages,
            tools,
            choice,
            template_kwargs,
            params,
            response_schema: self.output_format()?,
        })
    }

    fn sampling(&self) -> SamplingFields {
        SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            stop: self.stop_sequences.clone().map(Stop::Many),
            max_tokens: self.max_tokens.map(|n| (n, "max_tokens")),
            ..Default::default()
        }
    }

    /// `system` and `messages` as chat messages.
    fn chat_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        let messages = self
            .messages
            .as_ref()
            .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        if messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must hold at least one message",
            ));
        }
        let mut out = Vec::with_capacity(messages.len() + 1);
        if let Some(system) = &self.system {
            let text = texts(system, "system")?;
            if !text.is_empty() {
                out.push(ChatMessage::new("system", text));
            }
        }
        // Tool names by call id: a tool message is named after its call.
        let mut names = HashMap::new();
        for (i, m) in messages.iter().enumerate() {
            let path = format!("messages[{i}]");
            match m.role.as_str() {
                "user" => user_messages(&m.content, &path, &names, &mut out)?,
                "assistant" if i + 1 == messages.len() => {
                    return Err(ApiError::invalid(
                        path,
                        "a final assistant message (a prefill for the answer to continue) is not supported",
                    ))
                }
                "assistant" => out.push(assistant_message(&m.content, &path, &mut names)?),
                other => {
                    return Err(ApiError::invalid(
                        format!("{path}.role"),
                        format!(
                            "unknown role `{other}`; expected user or assistant (the system prompt is the `system` field)"
                        ),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// `tools` as OpenAI function tools.
    fn openai_tools(&self) -> Result<Option<Vec<Json>>, ApiError> {
        let Some(tools) = &self.tools else {
            return Ok(None);
        };
        let mut out = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let path = format!("tools[{i}]");
            match t.get("type") {
                None | Some(Json::Null) => {}
                Some(Json::String(s)) if s == "custom" => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!("{path}.type"),
                        format!(
                            "server tools ({other}) are not supported; give client tools: {{\"name\", \"description\", \"input_schema\"}}"
                        ),
                    ))
                }
            }
            let def: ToolDef = typed(t, &path)?;
            if def.name.is_empty() {
                return Err(ApiError::invalid(
                    format!("{path}.name"),
                    "a tool needs a non-empty `name`",
                ));
            }
            if !def.input_schema.is_object() {
                return Err(ApiError::invalid(
                    format!("{path}.input_schema"),
                    "`input_schema` must be a JSON schema object",
                ));
            }
            let mut function = json!({"name": def.name, "parameters": def.input_schema});
            if let Some(d) = def.description {
                function["description"] = d.into();
            }
            if let Some(strict) = def.strict {
                function["strict"] = strict.into();
            }
            out.push(json!({"type": "function", "function": function}));
        }
        Ok(Some(out))
    }

    /// `tool_choice` in OpenAI's spelling (checked against the tools by
    /// [`api::tool_choice`]). `disable_parallel_tool_use` is accepted and
    /// not enforced, as OpenAI's `parallel_tool_calls` is.
    fn openai_tool_choice(&self) -> Result<Option<Json>, ApiError> {
        let Some(c) = self.tool_choice.as_ref().filter(|c| !c.is_null()) else {
            return Ok(None);
        };
        let choice = match c.get("type").and_then(Json::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => match c.get("name").and_then(Json::as_str) {
                Some(n) => json!({"type": "function", "function": {"name": n}}),
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice.name",
                        "`tool_choice` {\"type\": \"tool\"} needs the tool's `name`",
                    ))
                }
            },
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or {\"type\": \"tool\", \"name\": ...}",
                ))
            }
        };
        Ok(Some(choice))
    }

    /// `thinking` as the template's `enable_thinking` (`None`: the
    /// template's default). `budget_tokens` is checked, not enforced:
    /// `max_tokens` bounds reasoning and answer together.
    fn enable_thinking(&self) -> Result<Option<bool>, ApiError> {
        let Some(t) = self.thinking.as_ref().filter(|t| !t.is_null()) else {
            return Ok(None);
        };
        match t.get("type").and_then(Json::as_str) {
            Some("enabled") => match t.get("budget_tokens") {
                None => Ok(Some(true)),
                Some(b) if b.as_u64().is_some_and(|n| n >= 1) => Ok(Some(true)),
                Some(_) => Err(ApiError::invalid(
                    "thinking.budget_tokens",
                    "`budget_tokens` must be a positive integer",
                )),
            },
            Some("between_tools") => Ok(Some(true)),
            Some("disabled") => Ok(Some(false)),
            // The model decides: what its template does by default.
            Some("adaptive") => Ok(None),
            _ => Err(ApiError::invalid(
                "thinking.type",
                "`thinking.type` must be \"enabled\", \"adaptive\", \"between_tools\" or \"disabled\"",
            )),
        }
    }

    /// `output_config.format` (`{"type": "json_schema", "schema": ..}`):
    /// the JSON schema the answer must follow, as OpenAI's `response_format`.
    fn output_format(&self) -> Result<Option<Json>, ApiError> {
        match self.output_config.as_ref().and_then(|c| c.get("format")) {
            None | Some(Json::Null) => Ok(None),
            Some(f) => crate::structured::anthropic_format(f).map(Some),
        }
    }

    /// `output_config.effort` as the template variable `reasoning_effort`
    /// (what OpenAI's `reasoning_effort` sets; gpt-oss's template reads it):
    /// `xhigh` and `max` are `high`.
    fn reasoning_effort(&self) -> Result<Option<&'static str>, ApiError> {
        let Some(c) = self.output_config.as_ref().filter(|c| !c.is_null()) else {
            return Ok(None);
        };
        match c.get("effort") {
            None | Some(Json::Null) => Ok(None),
            Some(Json::String(e)) => match e.as_str() {
                "low" => Ok(Some("low")),
                "medium" => Ok(Some("medium")),
                "high" | "xhigh" | "max" => Ok(Some("high")),
                _ => Err(ApiError::invalid(
                    "output_config.effort",
                    "`effort` must be low, medium, high, xhigh or max",
                )),
            },
            Some(_) => Err(ApiError::invalid(
                "output_config.effort",
                "`effort` must be a string",
            )),
        }
    }
}

/// A block deserialized as `T`; a failure names the field under `path`.
fn typed<T: DeserializeOwned>(block: &Json, path: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(block).map_err(|e| {
        let inner = e.path().to_string();
        let p = if inner == "." {
            path.to_string()
        } else {
            format!("{path}.{inner}")
        };
        ApiError::invalid(p.clone(), format!("invalid `{p}`: {}", e.into_inner()))
    })
}

fn block_type<'a>(block: &'a Json, path: &str) -> Result<&'a str, ApiError> {
    block.get("type").and_then(Json::as_str).ok_or_else(|| {
        ApiError::invalid(
            format!("{path}.type"),
            "a content block needs a string `type`",
        )
    })
}

fn unsupported_block(kind: &str, path: &str, here: &str) -> ApiError {
    ApiError::invalid(
        path,
        format!("`{kind}` content blocks are not supported {here} (this server serves text: text, tool_use, tool_result and thinking blocks)"),
    )
}

/// The text of a string or of text blocks (`system`, a tool result).
fn texts(content: &Content, path: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(s) => Ok(s.clone()),
        Content::Parts(blocks) => {
            let mut out = Vec::with_capacity(blocks.len());
            for (j, b) in blocks.iter().enumerate() {
                let p = format!("{path}[{j}]");
                match block_type(b, &p)? {
                    "text" => out.push(typed::<TextBlock>(b, &p)?.text),
                    other => return Err(unsupported_block(other, &p, "here")),
                }
            }
            Ok(out.join(BLOCK_SEPARATOR))
        }
    }
}

/// A user message: its `tool_result` blocks as `tool` messages, its text
/// blocks as user messages, in their order.
fn user_messages(
    content: &Content,
    path: &str,
    names: &HashMap<String, String>,
    out: &mut Vec<ChatMessage>,
) -> Result<(), ApiError> {
    let blocks = match content {
        Content::Text(s) => {
            out.push(ChatMessage::new("user", s.clone()));
            return Ok(());
        }
        Content::Parts(b) if b.is_empty() => {
            return Err(ApiError::invalid(
                format!("{path}.content"),
                "a user message needs content",
            ))
        }
        Content::Parts(b) => b,
    };
    let mut text = Vec::new();
    let flush = |text: &mut Vec<String>, out: &mut Vec<ChatMessage>| {
        if !text.is_empty() {
            out.push(ChatMessage::new("user", text.join(BLOCK_SEPARATOR)));
            text.clear();
        }
    };
    for (j, b) in blocks.iter().enumerate() {
        let p = format!("{path}.content[{j}]");
        match block_type(b, &p)? {
            "text" => text.push(typed::<TextBlock>(b, &p)?.text),
            "tool_result" => {
                flush(&mut text, out);
                let r: ToolResultBlock = typed(b, &p)?;
                let result = match &r.content {
                    None => String::new(),
                    Some(c) => texts(c, &format!("{p}.content"))?,
                };
                out.push(ChatMessage {
                    role: "tool".into(),
                    content: Some(Content::Text(result)),
                    name: names.get(&r.tool_use_id).cloned(),
                    tool_call_id: Some(r.tool_use_id),
                    ..Default::default()
                });
            }
            other => return Err(unsupported_block(other, &p, "in a user message")),
        }
    }
    flush(&mut text, out);
    Ok(())
}

/// An assistant message: text as content, `thinking` as reasoning,
/// `tool_use` as OpenAI `tool_calls` (their names noted in `names`).
/// `redacted_thinking` is Anthropic's encrypted reasoning: nothing to render.
fn assistant_message(
    content: &Content,
    path: &str,
    names: &mut HashMap<String, String>,
) -> Result<ChatMessage, ApiError> {
    let blocks = match content {
        Content::Text(s) => return Ok(ChatMessage::new("assistant", s.clone())),
        Content::Parts(b) => b,
    };
    let (mut text, mut thinking, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let p = format!("{path}.content[{j}]");
        match block_type(b, &p)? {
            "text" => text.push(typed::<TextBlock>(b, &p)?.text),
            "thinking" => thinking.push(typed::<ThinkingBlock>(b, &p)?.thinking),
            "redacted_thinking" => {}
            "tool_use" => {
                let u: ToolUseBlock = typed(b, &p)?;
                if !u.input.is_object() {
                    return Err(ApiError::invalid(
                        format!("{p}.input"),
                        "a tool_use block's `input` must be an object",
                    ));
                }
                names.insert(u.id.clone(), u.name.clone());
                calls.push(json!({"id": u.id, "type": "function",
                    "function": {"name": u.name, "arguments": u.input}}));
            }
            other => return Err(unsupported_block(other, &p, "in an assistant message")),
        }
    }
    Ok(ChatMessage {
        role: "assistant".into(),
        content: (!text.is_empty()).then(|| Content::Text(text.join(BLOCK_SEPARATOR))),
        reasoning_content: (!thinking.is_empty()).then(|| thinking.join(BLOCK_SEPARATOR)),
        tool_calls: (!calls.is_empty()).then_some(Json::Array(calls)),
        ..Default::default()
    })
}

/// The HTTP status and Anthropic error type for an error: the server's
/// 503 (stopping, too many connections) is Anthropic's 529 `overloaded_error`.
fn status_and_type(status: StatusCode) -> (StatusCode, &'static str) {
    match status.as_u16() {
        400 | 405 | 408 | 422 => (status, "invalid_request_error"),
        401 => (status, "authentication_error"),
        403 => (status, "permission_error"),
        404 => (status, "not_found_error"),
        413 => (status, "request_too_large"),
        429 => (status, "rate_limit_error"),
        503 | 529 => (
            StatusCode::from_u16(529).unwrap_or(status),
            "overloaded_error",
        ),
        _ => (status, "api_error"),
    }
}

/// `{"type": "error", "error": {"type", "message"}}` (also an SSE `error`
/// event's data).
pub fn error_body(e: &ApiError) -> Json {
    let (_, kind) = status_and_type(e.status);
    json!({"type": "error", "error": {"type": kind, "message": e.message}})
}

/// An error in Anthropic's shape, with the headers the error carries.
pub fn error_response(e: ApiError) -> Response {
    let (status, _) = status_and_type(e.status);
    let mut resp = (status, axum::Json(error_body(&e))).into_response();
    e.add_headers(&mut resp);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::ToolChoice;

    fn req(body: Json) -> MessagesRequest {
        api::parse_body(body.to_string().as_bytes()).unwrap()
    }

    fn spec(body: Json) -> Result<ChatSpec, ApiError> {
        req(body).spec(&Defaults::default(), 100, 7)
    }

    fn param(r: Result<ChatSpec, ApiError>) -> String {
        r.unwrap_err().param.unwrap_or_default()
    }

    #[test]
    fn a_conversation_maps_onto_chat_messages() {
        let s = spec(json!({
            "model": "claude", "max_tokens": 20,
            "system": [{"type": "text", "text": "Be brief."},
                       {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Call the tool.", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Paris"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "21 C"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_9", "content": "?", "is_error": true},
                    {"type": "text", "text": "And tomorrow?"}]}],
            "tools": [{"name": "get_weather", "description": "Weather of a city",
                       "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "stop_sequences": ["END"], "temperature": 0.5, "top_k": 5, "metadata": {"user_id": "u"},
        }))
        .unwrap();
        let roles: Vec<&str> = s.messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "tool", "user"]
        );
        let text = |i: usize| s.messages[i].content.as_ref().map(Content::text);
        assert_eq!(text(0).as_deref(), Some("Be brief.\n\nUse tools."));
        let a = &s.messages[2];
        assert_eq!(text(2).as_deref(), Some("Checking."));
        assert_eq!(a.reasoning_content.as_deref(), Some("Call the tool."));
        assert_eq!(
            a.tool_calls.as_ref().unwrap(),
            &json!([{"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
        );
        assert_eq!(s.messages[3].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(s.messages[3].name.as_deref(), Some("get_weather"));
        assert_eq!(text(3).as_deref(), Some("21 C"));
        assert_eq!(s.messages[4].name, None);
        assert_eq!(text(5).as_deref(), Some("And tomorrow?"));
        assert_eq!(
            s.tools.unwrap(),
            vec![
                json!({"type": "function", "function": {"name": "get_weather",
                "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
            ]
        );
        assert_eq!(s.choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(s.template_kwargs.unwrap()["enable_thinking"], true);
        assert_eq!(s.params.max_tokens, Some(20));
        assert_eq!(s.params.stop, vec!["END"]);
        assert_eq!(s.params.sampler.temperature, 0.5);
        assert_eq!(s.params.sampler.top_k, 5);
    }

    #[test]
    fn tool_choice_and_thinking_forms() {
        let base = |extra: Json| {
            let mut b = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"name": "f", "input_schema": {"type": "object"}}]});
            for (k, v) in extra.as_object().unwrap() {
                b[k] = v.clone();
            }
            spec(b)
        };
        for (choice, want) in [
            (json!(null), ToolChoice::Auto),
            (json!({"type": "auto"}), ToolChoice::Auto),
            (json!({"type": "any"}), ToolChoice::Required),
            (json!({"type": "none"}), ToolChoice::None),
        ] {
            assert_eq!(base(json!({"tool_choice": choice})).unwrap().choice, want);
        }
        for (extra, p) in [
            (json!({"tool_choice": {"type": "tool"}}), "tool_choice.name"),
            (
                json!({"tool_choice": {"type": "tool", "name": "g"}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"thinking": {"type": "on"}}), "thinking.type"),
            (
                json!({"thinking": {"type": "enabled", "budget_tokens": -1}}),
                "thinking.budget_tokens",
            ),
            (
                json!({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}),
                "tools[0].type",
            ),
            (json!({"tools": [{"name": "f"}]}), "tools[0]"),
            (
                json!({"tools": [{"name": "f", "input_schema": 3}]}),
                "tools[0].input_schema",
            ),
            (json!({"mcp_servers": [{"url": "x"}]}), "mcp_servers"),
            (json!({"stop_sequences": [""]}), "stop_sequences"),
            (json!({"temperature": 3}), "temperature"),
        ] {
            assert_eq!(param(base(extra.clone())), p, "{extra}");
        }
        let kw = |t: Json| base(json!({"thinking": t})).unwrap().template_kwargs;
        assert_eq!(
            kw(json!({"type": "disabled"})).unwrap()["enable_thinking"],
            false
        );
        assert_eq!(
            kw(json!({"type": "between_tools"})).unwrap()["enable_thinking"],
            true
        );
        assert_eq!(kw(json!({"type": "adaptive"})), None);
        let effort = |c: Json| base(json!({"output_config": c}));
        let k = effort(json!({"effort": "max"}))
            .unwrap()
            .template_kwargs
            .unwrap();
        assert_eq!(k["reasoning_effort"], "high");
        assert_eq!(
            param(effort(json!({"effort": "huge"}))),
            "output_config.effort"
        );
        let format = |f: Json| base(json!({"output_config": {"format": f}}));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let s = format(json!({"type": "json_schema", "schema": schema})).unwrap();
        assert_eq!(s.response_schema, Some(schema));
        assert_eq!(
            param(format(json!({"type": "xml"}))),
            "output_config.format.type"
        );
        assert_eq!(
            param(format(json!({"type": "json_schema", "schema": 3}))),
            "output_config.format.schema"
        );
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_field() {
        let m = |messages: Json| spec(json!({"max_tokens": 5, "messages": messages}));
        assert_eq!(
            param(spec(
                json!({"messages": [{"role": "user", "content": "x"}]})
            )),
            "max_tokens"
        );
        // count_tokens needs no max_tokens.
        req(json!({"messages": [{"role": "user", "content": "x"}]}))
            .count_spec(&Defaults::default(), 100)
            .unwrap();
        assert_eq!(param(m(json!([]))), "messages");
        assert_eq!(param(spec(json!({"max_tokens": 5}))), "messages");
        for (messages, p) in [
            (
                json!([{"role": "system", "content": "x"}]),
                "messages[0].role",
            ),
            (
                json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure"}]),
                "messages[1]",
            ),
            (
                json!([{"role": "user", "content": []}]),
                "messages[0].content",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": [{"text": "no type"}]}]),
                "messages[0].content[0].type",
            ),
            (
                json!([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
                "messages[0].content[0].text",
            ),
            (
                json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                "content": [{"type": "image"}]}]}]),
                "messages[0].content[0].content[0]",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]},
                    {"role": "user", "content": "x"}]),
                "messages[0].content[0].input",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "document"}]},
                    {"role": "user", "content": "x"}]),
                "messages[0].content[0]",
            ),
        ] {
            assert_eq!(param(m(messages.clone())), p, "{messages}");
        }
        let e =
            m(json!([{"role": "user", "content": [{"type": "image", "source": {}}]}])).unwrap_err();
        assert!(e.message.contains("`image`"), "{}", e.message);
    }

    #[test]
    fn errors_take_anthropics_shape() {
        for (e, status, kind) in [
            (ApiError::invalid("x", "bad"), 400, "invalid_request_error"),
            (ApiError::unauthorized(), 401, "authentication_error"),
            (ApiError::not_found("no"), 404, "not_found_error"),
            (ApiError::too_large(10), 413, "request_too_large"),
            (ApiError::queue_full(2), 429, "rate_limit_error"),
            (ApiError::internal("boom"), 500, "api_error"),
            (ApiError::unavailable("stopping"), 529, "overloaded_error"),
        ] {
            let body = error_body(&e);
            assert_eq!(body["type"], "error");
            assert_eq!(body["error"]["type"], kind);
            assert_eq!(body["error"]["message"], e.message.as_str());
            let resp = error_response(e.clone());
            assert_eq!(resp.status().as_u16(), status);
            if let Some(s) = e.retry_after {
                assert_eq!(resp.headers()["retry-after"], s.to_string().as_str());
            }
        }
        assert!(is_path("/v1/messages") && is_path("/v1/messages/count_tokens"));
        assert!(!is_path("/v1/messagesx") && !is_path("/v1/chat/completions"));
    }
}
