//! Chat templates: a conversation in, the prompt text out, rendered the way
//! Hugging Face `transformers`' `apply_chat_template(..., tokenize=False)`
//! renders it.
//!
//! The template is the model's own Jinja template (see
//! [`ChatTemplate::from_model_dir`]), run by MiniJinja configured like
//! transformers' sandbox: `trim_blocks` and `lstrip_blocks` on, a single
//! trailing newline of the template dropped (Jinja2's
//! `keep_trailing_newline=False`), loop controls (`break`/`continue`),
//! `namespace()` (whose list attributes can be changed in place with
//! `append`, `pop`, `extend`, `insert`, `remove` and `clear`, as the Kimi K2
//! templates do; transformers' immutable sandbox refuses those calls),
//! Python string/dict methods (`.startswith`, `.split`,
//! `.items()`, ...), `raise_exception(msg)`, `strftime_now(fmt)` (local time)
//! and transformers' `tojson` (Python's `json.dumps`: `", "`/`": "`
//! separators, no HTML escaping, non-ASCII kept, `indent`, `ensure_ascii`,
//! `separators` and `sort_keys` keyword arguments).
//!
//! Messages are passed as transformers passes them: keys whose value is
//! `None` are left out, and a message's reasoning is visible under both
//! `reasoning_content` and `thinking` (from whichever of `reasoning_content`,
//! `thinking` or `reasoning` is set). One addition for OpenAI-style input
//! (as vLLM does): a tool call whose `arguments` is a string holding a JSON
//! object is given to the template as that object, since templates iterate
//! over the arguments.
//!
//! Map key order: templates see JSON objects (tools, tool calls, extra
//! fields) in the order of `serde_json::Map`, which is sorted by key unless
//! serde_json's `preserve_order` feature is enabled in the build. Python
//! keeps the order of the request; enable that feature where byte-exact
//! prompts for tool definitions matter.

use std::cell::RefCell;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, ValueOrKwargs};
use minijinja::{Environment, ErrorKind, State, Value};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use crate::error::{Error, Result};
use crate::text::template_budget::{self, TemplateBudget};
use crate::text::tokenizer::{Tokenizer, MAX_TEXT_CONFIG_BYTES, TOOL_CALL_MARKUP};

/// The template used when a model ships none: ChatML, as Qwen models use.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}\
{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] if message['content'] is string else '') + '<|im_end|>' + '\\n' }}\
{%- endfor %}\
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// A message's content: plain text, or OpenAI-style parts
/// (`[{"type": "text", "text": "..."}, ...]`) passed to the template as is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Json>),
}

impl Content {
    /// The text: the string, or the `text` of every text part, concatenated.
    pub fn text(&self) -> String {
        match self {
            Content::Text(s) => s.clone(),
            Content::Parts(parts) => parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Json::as_str))
                .collect(),
        }
    }
}

impl From<String> for Content {
    fn from(s: String) -> Self {
        Content::Text(s)
    }
}

impl From<&str> for Content {
    fn from(s: &str) -> Self {
        Content::Text(s.to_string())
    }
}

/// One conversation turn; (de)serializes as an OpenAI chat message.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool` (templates may know others).
    pub role: String,
    /// `None` for `"content": null` or a missing content (e.g. an assistant
    /// turn that only calls tools).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// The assistant's reasoning (the text inside `<think>...</think>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// OpenAI `tool_calls`: `[{"id", "type": "function", "function": {"name",
    /// "arguments"}}]`; `arguments` may be an object or a JSON string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Json>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// For `tool` messages: the id of the call answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// Any other fields; passed to the template as message attributes.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(Content::Text(content.into())),
            ..Default::default()
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }

    /// A tool result answering the call `tool_call_id`.
    pub fn tool(content: impl Into<String>, tool_call_id: impl Into<String>) -> Self {
        ChatMessage {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::new("tool", content)
        }
    }

    /// The content's text ("" when there is none).
    pub fn text(&self) -> String {
        self.content.as_ref().map(Content::text).unwrap_or_default()
    }

    /// The message as the template sees it (see the module docs).
    fn to_template_value(&self) -> Value {
        let mut fields: Vec<(String, Json)> = Vec::new();
        fields.push(("role".into(), Json::String(self.role.clone())));
        if let Some(c) = &self.content {
            let v = match c {
                Content::Text(s) => Json::String(s.clone()),
                Content::Parts(p) => Json::Array(p.clone()),
            };
            fields.push(("content".into(), v));
        }
        if let Some(r) = &self.reasoning_content {
            fields.push(("reasoning_content".into(), Json::String(r.clone())));
        }
        if let Some(t) = &self.tool_calls {
            if !t.is_null() {
                fields.push(("tool_calls".into(), parse_tool_arguments(t)));
            }
        }
        if let Some(n) = &self.name {
            fields.push(("name".into(), Json::String(n.clone())));
        }
        if let Some(id) = &self.tool_call_id {
            fields.push(("tool_call_id".into(), Json::String(id.clone())));
        }
        for (k, v) in &self.extra {
            if !v.is_null() && !fields.iter().any(|(f, _)| f == k) {
                fields.push((k.clone(), v.clone()));
            }
        }
        // transformers: {"thinking": r, **message, "reasoning_content": r}
        // with r the first of reasoning_content, thinking, reasoning.
        let reasoning = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|k| fields.iter().find(|(f, _)| f == k).map(|(_, v)| v.clone()));
        if let Some(r) = reasoning {
            if !fields.iter().any(|(f, _)| f == "thinking") {
                fields.insert(0, ("thinking".into(), r.clone()));
            }
            match fields.iter_mut().find(|(f, _)| f == "reasoning_content") {
                Some(slot) => slot.1 = r,
                None => fields.push(("reasoning_content".into(), r)),
            }
        }
        Value::from_pairs(fields.into_iter().map(|(k, v)| (k, json_to_value(&v))))
    }
}

/// Tool calls with string `arguments` holding a JSON object parsed into it.
fn parse_tool_arguments(calls: &Json) -> Json {
    fn fix(obj: &mut Map<String, Json>) {
        if let Some(Json::String(s)) = obj.get("arguments") {
            if let Ok(v @ Json::Object(_)) = serde_json::from_str::<Json>(s) {
                obj.insert("arguments".into(), v);
            }
        }
    }
    let mut calls = calls.clone();
    if let Json::Array(items) = &mut calls {
        for item in items {
            if let Json::Object(call) = item {
                fix(call);
                if let Some(Json::Object(f)) = call.get_mut("function") {
                    fix(f);
                }
            }
        }
    }
    calls
}

/// What to render besides the messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RenderOptions {
    /// End with the header of an assistant turn, for generation.
    pub add_generation_prompt: bool,
    /// Passed as `enable_thinking` when set (Qwen3/Qwen3.5 templates);
    /// left undefined otherwise.
    pub enable_thinking: Option<bool>,
    /// Tool definitions (OpenAI: `[{"type": "function", "function": {...}}]`),
    /// passed as `tools`; `None` passes `tools=None` as transformers does.
    pub tools: Option<Json>,
    /// More template variables (e.g. `date_string`, `preserve_thinking`);
    /// they override the special tokens but not the fields above.
    pub extra: Map<String, Json>,
}

/// A rendered prompt that knows which special-token spellings came from
/// the messages' text (to be encoded as text) rather than from the
/// template. Made by [`ChatTemplate::render_prompt`], encoded by
/// [`Tokenizer::encode_prompt`]; text appended with
/// [`push_str`](Self::push_str) is markup, like the template's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Prompt {
    text: String,
    literal: Vec<Range<usize>>,
}

impl Prompt {
    /// `text` with the given byte ranges to be encoded as text (ascending,
    /// not overlapping, on character boundaries).
    pub fn with_literal_spans(text: String, literal: Vec<Range<usize>>) -> Self {
        Prompt { text, literal }
    }

    /// The prompt text, as [`ChatTemplate::render`] returns it.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Byte ranges of special-token spellings that came from message text.
    pub fn literal_spans(&self) -> &[Range<usize>] {
        &self.literal
    }

    /// Appends markup (special tokens in it are special).
    pub fn push_str(&mut self, s: &str) {
        self.text.push_str(s);
    }

    pub fn into_text(self) -> String {
        self.text
    }
}

impl From<String> for Prompt {
    /// Text that is all markup.
    fn from(text: String) -> Self {
        Prompt {
            text,
            literal: Vec::new(),
        }
    }
}

/// A model's chat template, compiled.
///
/// It renders on a [`TemplateBudget`] (fuel and bytes; see
/// [`crate::text::template_budget`]): by default that of a 128K-token
/// context; [`with_context_window`](Self::with_context_window) sets the
/// session's.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    /// `source` as compiled (`{% generation %}` tags rewritten).
    compiled_source: String,
    budget: TemplateBudget,
    origin: PathBuf,
    builtin: bool,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("builtin", &self.builtin)
            .field("special_tokens", &self.special_tokens)
            .finish_non_exhaustive()
    }
}

const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

fn read_json(path: &Path) -> Result<Json> {
    let text = crate::format::read_small_text(path, MAX_TEXT_CONFIG_BYTES)?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        path: path.to_path_buf(),
        source,
    })
}

fn format_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// A special token as tokenizer_config.json writes it: a string or an
/// AddedToken object with `content`.
fn token_string(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
        _ => None,
    }
}

/// The `chat_template` field of tokenizer_config.json: a string, or a list
/// of `{"name", "template"}` of which "default" is used.
fn template_field(v: &Json, path: &Path) -> Result<Option<String>> {
    match v {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Array(list) => {
            for t in list {
                if t.get("name").and_then(Json::as_str) == Some("default") {
                    return match t.get("template").and_then(Json::as_str) {
                        Some(s) => Ok(Some(s.to_string())),
                        None => Err(format_err(
                            path,
                            "chat_template: the \"default\" entry has no string \"template\"",
                        )),
                    };
                }
            }
            Err(format_err(
                path,
                "chat_template: a list of named templates without a \"default\" one",
            ))
        }
        _ => Err(format_err(
            path,
            "chat_template: expected a string or a list of {name, template}",
        )),
    }
}

impl ChatTemplate {
    /// Loads the chat template of a model directory, in the order
    /// transformers uses: `chat_template.jinja`, else the `chat_template`
    /// of `tokenizer_config.json`, else `chat_template.json`; if there is
    /// none, the built-in ChatML template ([`is_builtin`](Self::is_builtin)).
    /// Special tokens (`bos_token`, `eos_token`, ...) come from
    /// `tokenizer_config.json`, else `special_tokens_map.json`.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            Some(read_json(&config_path)?)
        } else {
            None
        };
        let map_path = dir.join("special_tokens_map.json");
        let map = if map_path.is_file() {
            Some(read_json(&map_path)?)
        } else {
            None
        };
        let mut special_tokens = Vec::new();
        for key in SPECIAL_TOKEN_KEYS {
            let found = [&config, &map]
                .into_iter()
                .flatten()
                .find_map(|j| j.get(key).and_then(token_string));
            if let Some(tok) = found {
                special_tokens.push((key.to_string(), tok));
            }
        }

        let jinja_path = dir.join("chat_template.jinja");
        let json_path = dir.join("chat_template.json");
        let (source, origin) = if jinja_path.is_file() {
            let s = crate::format::read_small_text(&jinja_path, MAX_TEXT_CONFIG_BYTES)?;
            (Some(s), jinja_path)
        } else if let Some(t) = config
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .map(|v| template_field(v, &config_path))
            .transpose()?
            .flatten()
        {
            (Some(t), config_path)
        } else if json_path.is_file() {
            let j = read_json(&json_path)?;
            match j.get("chat_template") {
                Some(v) => (template_field(v, &json_path)?, json_path),
                None => {
                    return Err(format_err(&json_path, "no \"chat_template\" field"));
                }
            }
        } else {
            (None, PathBuf::new())
        };
        let mut t = match source {
            Some(s) => Self::compile(s, origin, false)?,
            None => Self::chatml(),
        };
        t.special_tokens = special_tokens;
        Ok(t)
    }

    /// A template from its text; `origin` names it in error messages.
    pub fn from_source(source: impl Into<String>, origin: impl Into<PathBuf>) -> Result<Self> {
        Self::compile(source.into(), origin.into(), false)
    }

    /// The built-in ChatML template: `<|im_start|>{role}\n{content}<|im_end|>\n`
    /// per message, then `<|im_start|>assistant\n` as the generation prompt.
    pub fn chatml() -> Self {
        Self::compile(
            CHATML_TEMPLATE.to_string(),
            PathBuf::from("<built-in ChatML template>"),
            true,
        )
        .expect("the built-in template compiles")
    }

    /// Sets a special token variable (e.g. `bos_token`) for rendering.
    pub fn with_special_token(mut self, key: &str, token: impl Into<String>) -> Self {
        let token = token.into();
        match self.special_tokens.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = token,
            None => self.special_tokens.push((key.to_string(), token)),
        }
        self
    }

    /// Renders within `budget` from now on.
    pub fn with_budget(mut self, budget: TemplateBudget) -> Self {
        template_budget::install(&mut self.env, budget);
        self.budget = budget;
        self
    }

    /// Renders within the budget of a context of `tokens` tokens
    /// ([`TemplateBudget::for_context`]).
    pub fn with_context_window(self, tokens: usize) -> Self {
        self.with_budget(TemplateBudget::for_context(tokens))
    }

    /// The budget each render runs on.
    pub fn budget(&self) -> TemplateBudget {
        self.budget
    }

    fn compile(source: String, origin: PathBuf, builtin: bool) -> Result<Self> {
        let mut env = Environment::new();
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("namespace", namespace);
        env.add_function("strftime_now", strftime_now);
        env.add_test("sequence", is_sequence);
        env.add_test("iterable", is_iterable);
        let budget = TemplateBudget::default();
        template_budget::install(&mut env, budget);
        let compiled_source = rewrite_generation_tags(&source);
        let meter = template_budget::Render::start(budget);
        let compiled = template_budget::compile(TEMPLATE_NAME, &compiled_source, syntax());
        let over = meter.finish();
        compiled.map_err(|e| {
            let what = match over {
                Some(why) => format!("chat template goes over its budget: {why}"),
                None => format!("chat template syntax error: {}", describe(&e)),
            };
            format_err(&origin, what)
        })?;
        Ok(ChatTemplate {
            env,
            source,
            compiled_source,
            budget,
            origin,
            builtin,
            special_tokens: Vec::new(),
        })
    }

    /// True for the built-in ChatML fallback (the model shipped none).
    pub fn is_builtin(&self) -> bool {
        self.builtin
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The file the template came from (a placeholder for the built-in).
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// A special token string from the tokenizer config (`"bos_token"`,
    /// `"eos_token"`, ...).
    pub fn special_token(&self, key: &str) -> Option<&str> {
        self.special_tokens
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.special_token("bos_token")
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.special_token("eos_token")
    }

    /// Renders the conversation like [`render`](Self::render), marking
    /// the special-token spellings (of `tokenizer`) written in the messages'
    /// `content` and `reasoning_content` so that
    /// [`Tokenizer::encode_prompt`] keeps them text: a user cannot close
    /// their turn or open another role's by typing `<|im_end|>`. Assistant
    /// messages keep `<think>`/`</think>` and tool-call markup as the
    /// template and the model's own output spell them.
    ///
    /// How: each such spelling is replaced by a placeholder that occurs
    /// nowhere in the input, the template is rendered, and the placeholders
    /// that come out are put back as the spelling, recorded as literal.
    pub fn render_prompt(
        &self,
        messages: &[ChatMessage],
        opts: &RenderOptions,
        tokenizer: &Tokenizer,
    ) -> Result<Prompt> {
        let keep_for_assistant: Vec<&str> = ["<think>", "</think>"]
            .into_iter()
            .chain(TOOL_CALL_MARKUP)
            .collect();
        let escapable = |m: &ChatMessage, text: &str| -> Vec<Range<usize>> {
            tokenizer
                .special_spans(text)
                .into_iter()
                .filter(|r| {
                    m.role != "assistant" || !keep_for_assistant.contains(&&text[r.clone()])
                })
                .collect()
        };
        let needs = messages.iter().any(|m| {
            message_texts(m)
                .into_iter()
                .any(|t| !escapable(m, t).is_empty())
        });
        if !needs {
            return Ok(Prompt::from(self.render(messages, opts)?));
        }
        // A placeholder prefix found in no input: `\u{F8F0}{n}\u{F8F1}`.
        let haystack = format!(
            "{}{}{:?}{:?}",
            serde_json::to_string(messages).unwrap_or_default(),
            self.source,
            opts.tools,
            opts.extra
        );
        let open = (0u64..)
            .map(|n| format!("\u{F8F0}{n}\u{F8F1}"))
            .find(|o| !haystack.contains(o.as_str()))
            .expect("some placeholder is free");
        const CLOSE: char = '\u{F8F2}';
        let mut spellings: Vec<String> = Vec::new();
        let mut escape = |m: &ChatMessage, text: &str| -> String {
            let mut out = String::with_capacity(text.len());
            let mut at = 0;
            for r in escapable(m, text) {
                out.push_str(&text[at..r.start]);
                let sp = &text[r.clone()];
                let i = match spellings.iter().position(|x| x == sp) {
                    Some(i) => i,
                    None => {
                        spellings.push(sp.to_string());
                        spellings.len() - 1
                    }
                };
                out.push_str(&format!("{open}{i}{CLOSE}"));
                at = r.end;
            }
            out.push_str(&text[at..]);
            out
        };
        let escaped: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                let mut e = m.clone();
                e.content = match &m.content {
                    Some(Content::Text(t)) => Some(Content::Text(escape(m, t))),
                    Some(Content::Parts(parts)) => Some(Content::Parts(
                        parts
                            .iter()
                            .map(|p| {
                                let mut p = p.clone();
                                if let Some(Json::String(t)) = p.get_mut("text") {
                                    *t = escape(m, t);
                                }
                                p
                            })
                            .collect(),
                    )),
                    None => None,
                };
                e.reasoning_content = m.reasoning_content.as_deref().map(|r| escape(m, r));
                e
            })
            .collect();
        let rendered = self.render(&escaped, opts)?;
        let mut text = String::with_capacity(rendered.len());
        let mut literal = Vec::new();
        let mut rest = rendered.as_str();
        while let Some(i) = rest.find(open.as_str()) {
            text.push_str(&rest[..i]);
            let after = &rest[i + open.len()..];
            let spelling = after.split_once(CLOSE).and_then(|(n, tail)| {
                let sp = spellings.get(n.parse::<usize>().ok()?)?;
                Some((sp, tail))
            });
            match spelling {
                Some((sp, tail)) => {
                    literal.push(text.len()..text.len() + sp.len());
                    text.push_str(sp);
                    rest = tail;
                }
                // Cannot happen (the prefix is in no input); kept as text.
                None => {
                    text.push_str(&open);
                    rest = after;
                }
            }
        }
        text.push_str(rest);
        Ok(Prompt::with_literal_spans(text, literal))
    }

    /// Renders the conversation to prompt text.
    ///
    /// Errors: a template's `raise_exception(msg)` (the conversation is not
    /// acceptable to it, e.g. "System message must be at the beginning.")
    /// gives [`Error::Invalid`] with the message; any other failure is an
    /// [`Error::Format`] naming the template file.
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        let mut ctx: Vec<(String, Value)> = Vec::new();
        let mut set = |k: &str, v: Value| match ctx.iter_mut().find(|(n, _)| n == k) {
            Some(slot) => slot.1 = v,
            None => ctx.push((k.to_string(), v)),
        };
        for (k, v) in &self.special_tokens {
            set(k, Value::from(v.as_str()));
        }
        for (k, v) in &opts.extra {
            set(k, json_to_value(v));
        }
        if let Some(t) = opts.enable_thinking {
            set("enable_thinking", Value::from(t));
        }
        set(
            "messages",
            Value::from(
                messages
                    .iter()
                    .map(ChatMessage::to_template_value)
                    .collect::<Vec<_>>(),
            ),
        );
        set(
            "tools",
            opts.tools.as_ref().map_or(Value::from(()), json_to_value),
        );
        set("documents", Value::from(()));
        set(
            "add_generation_prompt",
            Value::from(opts.add_generation_prompt),
        );
        let ctx = Value::from_pairs(ctx);

        let budget = self
            .budget
            .for_input(input_bytes(messages, opts), messages.len());
        RAISED.with(|r| r.borrow_mut().take());
        let meter = template_budget::Render::start(budget);
        let result = template_budget::compile(TEMPLATE_NAME, &self.compiled_source, syntax())
            .and_then(|t| template_budget::eval(&self.env, &t, ctx));
        let over = meter.finish();
        let raised = RAISED.with(|r| r.borrow_mut().take());
        result.map_err(|e| match (raised, over) {
            (Some(msg), _) => Error::Invalid(format!("chat template: {msg}")),
            (None, Some(why)) => format_err(
                &self.origin,
                format!(
                    "chat template goes over its budget: {why} ({}); the context window sets it",
                    describe(&e)
                ),
            ),
            (None, None) if e.kind() == ErrorKind::OutOfFuel => format_err(
                &self.origin,
                format!(
                    "chat template ran out of fuel: more than {} instructions ({})",
                    budget.fuel,
                    describe(&e)
                ),
            ),
            (None, None) => format_err(
                &self.origin,
                format!("chat template render error: {}", describe(&e)),
            ),
        })
    }
}

/// The size of a render's input as JSON (what its prompt may carry).
fn input_bytes(messages: &[ChatMessage], opts: &RenderOptions) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    let _ = serde_json::to_writer(&mut n, messages);
    let _ = serde_json::to_writer(&mut n, &opts.tools);
    let _ = serde_json::to_writer(&mut n, &opts.extra);
    n.0
}

/// transformers' sandbox settings: `trim_blocks`, `lstrip_blocks`, one
/// trailing newline dropped.
fn syntax() -> minijinja::syntax::SyntaxConfig {
    minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .expect("default delimiters are valid")
}

/// The texts of a message that [`ChatTemplate::render_prompt`] escapes.
fn message_texts(m: &ChatMessage) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    match &m.content {
        Some(Content::Text(t)) => out.push(t),
        Some(Content::Parts(parts)) => out.extend(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Json::as_str)),
        ),
        None => {}
    }
    out.extend(m.reasoning_content.as_deref());
    out
}

/// transformers' `{% generation %}...{% endgeneration %}` (marks assistant
/// text for training masks; renders its body) as `{% if true %}...{% endif %}`,
/// keeping whitespace-control modifiers.
fn rewrite_generation_tags(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("{%") {
        out.push_str(&rest[..i]);
        let tag = &rest[i..];
        let Some(end) = tag.find("%}") else {
            break;
        };
        let inner = &tag[2..end];
        let (pre, inner) = match inner.strip_prefix(['-', '+']) {
            Some(s) => (&inner[..1], s),
            None => ("", inner),
        };
        let (inner, post) = match inner.strip_suffix(['-', '+']) {
            Some(s) => (s, &inner[inner.len() - 1..]),
            None => (inner, ""),
        };
        let replacement = match inner.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.push_str(pre);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.push_str(post);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

thread_local! {
    /// The message of the last `raise_exception` on this thread.
    static RAISED: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// A MiniJinja error with its causes, on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    RAISED.with(|r| *r.borrow_mut() = Some(msg.clone()));
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// Jinja2's `namespace(dict?, **kwargs)`, except that list attributes are
/// given as [`NsList`]s, which the template may change in place.
fn namespace(defaults: Option<ValueOrKwargs>) -> std::result::Result<Value, minijinja::Error> {
    let Some(defaults) = defaults else {
        return minijinja::functions::namespace(None);
    };
    let defaults = defaults.into_value();
    let mut pairs = Vec::new();
    if let Ok(keys) = defaults.try_iter() {
        for key in keys {
            let v = defaults.get_item(&key)?;
            let v = match v.kind() {
                minijinja::value::ValueKind::Seq => {
                    Value::from_object(NsList(Mutex::new(v.try_iter()?.collect())))
                }
                _ => v,
            };
            pairs.push((key, v));
        }
    }
    if defaults.kind() != minijinja::value::ValueKind::Map {
        // Let the builtin explain what it accepts.
        return minijinja::functions::namespace(Some(defaults.into()));
    }
    minijinja::functions::namespace(Some(Value::from_pairs(pairs).into()))
}

/// A list held by a `namespace()`: a sequence with Python's list methods
/// that modify it (`append`, `pop`, `extend`, `insert`, `remove`, `clear`).
#[derive(Debug)]
struct NsList(Mutex<Vec<Value>>);

impl NsList {
    fn items(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn list_error(msg: impl Into<String>) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, msg.into())
}

impl Object for NsList {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Seq
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let items = self.items();
        let i = key.as_i64()?;
        let i = if i < 0 { i + items.len() as i64 } else { i };
        items.get(usize::try_from(i).ok()?).cloned()
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.items().clone())
    }

    fn call_method(
        self: &Arc<Self>,
        _state: &mut State<'_, '_>,
        method: &str,
        args: &[Value],
    ) -> std::result::Result<Value, minijinja::Error> {
        // Read before the lock: `ns.l.extend(ns.l)` iterates this list.
        let extension: Option<Vec<Value>> = match (method, args) {
            ("extend", [xs]) => {
                template_budget::check_items(xs.len().unwrap_or(0))?;
                Some(xs.try_iter()?.collect())
            }
            _ => None,
        };
        let mut items = self.items();
        let index = |v: &Value, len: usize| -> std::result::Result<i64, minijinja::Error> {
            let i = v
                .as_i64()
                .ok_or_else(|| list_error(format!("{method}: the index must be an integer")))?;
            Ok(if i < 0 { i + len as i64 } else { i })
        };
        match (method, args) {
            ("append", [x]) => {
                template_budget::check_items(items.len() + 1)?;
                items.push(x.clone());
            }
            ("extend", [_]) => {
                let xs = extension.unwrap_or_default();
                template_budget::check_items(items.len().saturating_add(xs.len()))?;
                items.extend(xs);
            }
            ("insert", [i, x]) => {
                let at = index(i, items.len())?.clamp(0, items.len() as i64) as usize;
                template_budget::check_items(items.len() + 1)?;
                items.insert(at, x.clone());
            }
            ("pop", [] | [_]) => {
                if items.is_empty() {
                    return Err(list_error("pop from empty list"));
                }
                let i = match args.first() {
                    Some(i) => index(i, items.len())?,
                    None => items.len() as i64 - 1,
                };
                if i < 0 || i >= items.len() as i64 {
                    return Err(list_error("pop index out of range"));
                }
                return Ok(items.remove(i as usize));
            }
            ("remove", [x]) => match items.iter().position(|v| v == x) {
                Some(i) => {
                    items.remove(i);
                }
                None => return Err(list_error("list.remove(x): x not in list")),
            },
            ("clear", []) => items.clear(),
            ("append" | "extend" | "insert" | "pop" | "remove" | "clear", _) => {
                return Err(list_error(format!(
                    "list.{method}: wrong number of arguments ({})",
                    args.len()
                )))
            }
            _ => return Err(minijinja::Error::from(ErrorKind::UnknownMethod)),
        }
        Ok(Value::from(()))
    }
}

/// Python's `datetime.now().strftime(fmt)` in local time.
fn strftime_now(fmt: String) -> std::result::Result<Value, minijinja::Error> {
    let now = jiff::Zoned::now();
    jiff::fmt::strtime::format(fmt.as_str(), &now)
        .map(Value::from)
        .map_err(|e| {
            minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("strftime_now({fmt:?}): {e}"),
            )
        })
}

/// Jinja2's `sequence` test: has a length and items (strings, lists,
/// dicts, undefined); MiniJinja's excludes strings and dicts.
fn is_sequence(v: &Value) -> bool {
    use minijinja::value::ValueKind;
    matches!(
        v.kind(),
        ValueKind::Undefined
            | ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
    )
}

/// Jinja2's `iterable` test: `iter(value)` works (not for None, which
/// MiniJinja iterates as empty).
fn is_iterable(v: &Value) -> bool {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::Undefined => true,
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        _ => v.try_iter().is_ok(),
    }
}

/// serde_json to a template value (objects keep the map's order).
pub(crate) fn json_to_value(v: &Json) -> Value {
    match v {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(a) => Value::from(a.iter().map(json_to_value).collect::<Vec<_>>()),
        Json::Object(o) => Value::from_pairs(o.iter().map(|(k, v)| (k.as_str(), json_to_value(v)))),
    }
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` with those keywords.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.as_str() {
            Some(s) => Some(s.to_string()),
            None => {
                let n = v.as_i64().ok_or_else(|| {
                    minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: indent must be an integer, a string or none",
                    )
                })?;
                let n = n.max(0) as usize;
                if n > template_budget::max_bytes() {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        format!("tojson: indent {n} is more than the template's byte budget"),
                    ));
                }
                Some(" ".repeat(n))
            }
        },
    };
    let (item_sep, key_sep) = match separators.filter(|v| !v.is_none()) {
        Some(v) => {
            let a = v.get_item_by_index(0)?;
            let b = v.get_item_by_index(1)?;
            match (a.as_str(), b.as_str()) {
                (Some(a), Some(b)) => (a.to_string(), b.to_string()),
                _ => {
                    return Err(minijinja::Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ))
                }
            }
        }
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    dump(value, &opts, 0, &mut out)?;
    Ok(Value::from(out))
}

/// `dump`'s output so far within the template's byte budget (a list may
/// hold one long string many times).
fn dump_within_budget(out: &str) -> std::result::Result<(), minijinja::Error> {
    let max = template_budget::max_bytes();
    if out.len() > max {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: the JSON is longer than the template's budget of {max} bytes"),
        ));
    }
    Ok(())
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

fn newline_indent(opts: &JsonOpts, level: usize, out: &mut String) {
    if let Some(ind) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(ind);
        }
    }
}

fn dump(
    v: &Value,
    opts: &JsonOpts,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    use minijinja::value::ValueKind;
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&py_float_repr(f));
            }
        }
        ValueKind::String => dump_str(v.as_str().unwrap_or_default(), opts.ensure_ascii, out),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, level + 1, out);
                dump(item, opts, level + 1, out)?;
                dump_within_budget(out)?;
            }
            newline_indent(opts, level, out);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries: Vec<(String, Value)> = Vec::new();
            for key in v.try_iter()? {
                let val = v.get_item(&key)?;
                let k = match key.kind() {
                    ValueKind::String => key.as_str().unwrap_or_default().to_string(),
                    ValueKind::None => "null".into(),
                    ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).into(),
                    ValueKind::Number if key.is_integer() => key.to_string(),
                    ValueKind::Number => py_float_repr(f64::try_from(key.clone())?),
                    _ => {
                        return Err(minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            format!(
                                "tojson: keys must be str, int, float, bool or None, not {}",
                                key.kind()
                            ),
                        ))
                    }
                };
                entries.push((k, val));
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (k, val)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(opts, level + 1, out);
                dump_str(k, opts.ensure_ascii, out);
                out.push_str(&opts.key_sep);
                dump(val, opts, level + 1, out)?;
                dump_within_budget(out)?;
            }
            newline_indent(opts, level, out);
            out.push('}');
        }
        kind => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a value of type {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// A JSON string literal as Python's json module writes it.
fn dump_str(s: &str, ensure_ascii: bool, out: &mut String) {
    use std::fmt::Write;
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (as json.dumps writes floats).
fn py_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Shortest round-trip digits and the decimal exponent.
    let sci = format!("{:e}", f.abs());
    let (mant, exp) = sci.split_once('e').expect("LowerExp has an exponent");
    let exp: i32 = exp.parse().expect("LowerExp exponent");
    let digits: String = mant.chars().filter(|c| *c != '.').collect();
    let sign = if f.is_sign_negative() { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let body = if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{digits}{}.0", "0".repeat((int_len - n) as usize))
            } else {
                format!(
                    "{}.{}",
                    &digits[..int_len as usize],
                    &digits[int_len as usize..]
                )
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        let es = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{es}{:02}", exp.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_like_python() {
        let cases = [
            (1.0, "1.0"),
            (0.5, "0.5"),
            (-2.25, "-2.25"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1e100, "1e+100"),
            (f64::NAN, "NaN"),
        ];
        for (f, want) in cases {
            assert_eq!(py_float_repr(f), want, "{f}");
        }
    }
}
