//! Request types of the OpenAI API subset served, and their validation into
//! what the engine runs. Every error names the field at fault.

use std::path::Path;

use moeflux::sample::SamplerConfig;
use moeflux::text::chat::{ChatMessage, Content};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value as Json};

use crate::error::ApiError;

/// Parses a JSON body; a failure names the path of the bad field
/// (`messages[2].content`, `temperature`, ...).
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() {
            ApiError::invalid("", format!("request body is not valid JSON: {inner}"))
        } else if path == "." {
            ApiError::invalid("", format!("invalid request body: {inner}"))
        } else {
            ApiError::invalid(path.clone(), format!("invalid `{path}`: {inner}"))
        }
    })
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// The sampling and length fields both endpoints share.
#[derive(Debug, Clone, Default)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    /// `max_completion_tokens`, else `max_tokens`, with the field's name.
    pub max_tokens: Option<(i64, &'static str)>,
    pub n: Option<i64>,
    pub ignore_eos: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Option<Vec<ChatMessage>>,
    pub tools: Option<Vec<Json>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub n: Option<i64>,
    /// Keep generating past end-of-sequence (vLLM's extension; benchmarks).
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub logit_bias: Option<Map<String, Json>>,
    pub response_format: Option<Json>,
    /// Extra chat-template variables (vLLM's extension), e.g.
    /// `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// OpenAI's `low` / `medium` / `high`: the template variable
    /// `reasoning_effort` (gpt-oss's template writes it into the system
    /// message; other templates ignore it).
    pub reasoning_effort: Option<Json>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Option<Json>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub max_tokens: Option<i64>,
    pub n: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub best_of: Option<i64>,
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub logit_bias: Option<Map<String, Json>>,
}

/// A chat request validated, in the server's terms, whichever API it came
/// through (OpenAI's chat completions or Anthropic's messages): what the
/// prompt is rendered from and what generation runs with.
#[derive(Debug, Clone)]
pub struct ChatSpec {
    pub messages: Vec<ChatMessage>,
    /// OpenAI-form tools (`{"type": "function", "function": {..}}`).
    pub tools: Option<Vec<Json>>,
    pub choice: ToolChoice,
    pub template_kwargs: Option<Map<String, Json>>,
    pub params: GenParams,
    /// The JSON schema the answer must follow (`response_format`), if any.
    pub response_schema: Option<Json>,
}

impl ChatRequest {
    pub fn sampling(&self) -> SamplingFields {
        SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            max_tokens: match (self.max_completion_tokens, self.max_tokens) {
                (Some(n), _) => Some((n, "max_completion_tokens")),
                (None, Some(n)) => Some((n, "max_tokens")),
                _ => None,
            },
            n: self.n,
            ignore_eos: self.ignore_eos,
        }
    }

    /// The chat template's extra variables: `chat_template_kwargs`, with
    /// `reasoning_effort` added (as vLLM passes it to gpt-oss's template);
    /// one given in `chat_template_kwargs` wins.
    pub fn template_kwargs(&self) -> Result<Option<Map<String, Json>>, ApiError> {
        let mut kw = self.chat_template_kwargs.clone();
        match &self.reasoning_effort {
            None | Some(Json::Null) => {}
            Some(Json::String(e)) if matches!(e.as_str(), "low" | "medium" | "high") => {
                kw.get_or_insert_with(Map::new)
                    .entry("reasoning_effort")
                    .or_insert_with(|| e.clone().into());
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "reasoning_effort",
                    "`reasoning_effort` must be \"low\", \"medium\" or \"high\"",
                ))
            }
        }
        Ok(kw)
    }

    /// The request checked and in the server's terms (`ctx`: the context
    /// size; `random_seed`: the seed when none is given).
    pub fn spec(&self, d: &Defaults, ctx: usize, random_seed: u64) -> Result<ChatSpec, ApiError> {
        self.check_unsupported()?;
        let template_kwargs = self.template_kwargs()?;
        let messages = self.checked_messages()?;
        let choice = tool_choice(self.tools.as_deref(), self.tool_choice.as_ref())?;
        let mut params = gen_params(&self.sampling(), d, ctx, random_seed)?;
        params.logprobs = crate::logprobs::chat_request(self.logprobs, self.top_logprobs)?;
        let response_schema = crate::structured::response_format(self.response_format.as_ref())?;
        Ok(ChatSpec {
            messages,
            tools: self.tools.clone(),
            choice,
            template_kwargs,
            params,
            response_schema,
        })
    }

    /// Options this server does not implement: refused rather than ignored.
    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        Ok(())
    }

    /// The messages, checked: at least one, known roles (`developer` is
    /// read as `system`), text-only content.
    pub fn checked_messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        let messages = self
            .messages
            .clone()
            .ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
        if messages.is_empty() {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must hold at least one message",
            ));
        }
        let mut out = Vec::with_capacity(messages.len());
        for (i, mut m) in messages.into_iter().enumerate() {
            match m.role.as_str() {
                "system" | "user" | "assistant" | "tool" => {}
                "developer" => m.role = "system".into(),
                other => {
                    return Err(ApiError::invalid(
                        format!("messages[{i}].role"),
                        format!(
                            "unknown role `{other}`; expected system, developer, user, assistant or tool"
                        ),
                    ))
                }
            }
            if let Some(Content::Parts(parts)) = &m.content {
                for (j, p) in parts.iter().enumerate() {
                    let t = p.get("type").and_then(Json::as_str);
                    if t != Some("text") || !p.get("text").is_some_and(Json::is_string) {
                        return Err(ApiError::invalid(
                            format!("messages[{i}].content[{j}]"),
                            "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                        ));
                    }
                }
            }
            if m.role != "assistant" && m.tool_calls.as_ref().is_some_and(|t| !t.is_null()) {
                return Err(ApiError::invalid(
                    format!("messages[{i}].tool_calls"),
                    "only assistant messages carry tool_calls",
                ));
            }
            if m.content.is_none() && m.role != "assistant" {
                return Err(ApiError::invalid(
                    format!("messages[{i}].content"),
                    format!("a {} message needs content", m.role),
                ));
            }
            out.push(m);
        }
        Ok(out)
    }
}

impl CompletionRequest {
    pub fn sampling(&self) -> SamplingFields {
        SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            stop: self.stop.clone(),
            max_tokens: self.max_tokens.map(|n| (n, "max_tokens")),
            n: self.n,
            ignore_eos: self.ignore_eos,
        }
    }

    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("best_of", "only best_of 1 is supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix", "suffix is not supported"));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::invalid(
                "logit_bias",
                "logit_bias is not supported",
            ));
        }
        Ok(())
    }
}

/// A completion prompt: text, or token ids.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// `prompt`: a string, a list of one string, a list of token ids or a list
/// of one such list (one prompt per request).
pub fn completion_prompt(p: Option<&Json>) -> Result<Prompt, ApiError> {
    let bad = || {
        ApiError::invalid(
            "prompt",
            "`prompt` must be a string, a list of token ids, or a list holding one of those",
        )
    };
    let p = p.ok_or_else(|| ApiError::invalid("prompt", "`prompt` is required"))?;
    let p = match p {
        Json::Array(items) if items.len() == 1 && !items[0].is_number() => &items[0],
        Json::Array(items) if items.iter().any(|v| !v.is_number()) => {
            return Err(ApiError::invalid(
                "prompt",
                "one prompt per request is supported",
            ))
        }
        other => other,
    };
    match p {
        Json::String(s) => Ok(Prompt::Text(s.clone())),
        Json::Array(ids) => ids
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<Vec<u32>>>()
            .map(Prompt::Tokens)
            .ok_or_else(bad),
        _ => Err(bad()),
    }
}

/// Sampling defaults: the model's `generation_config.json`, else OpenAI's.
#[derive(Debug, Clone, PartialEq)]
pub struct Defaults {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub repetition_penalty: f32,
}

impl Default for Defaults {
    fn default() -> Self {
        Defaults {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl Defaults {
    pub fn from_model_dir(dir: &Path) -> Defaults {
        let gc: Json = moeflux::format::read_small_text(
            &dir.join("generation_config.json"),
            moeflux::text::tokenizer::MAX_TEXT_CONFIG_BYTES,
        )
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(Json::Null);
        let num = |k: &str| gc.get(k).and_then(Json::as_f64);
        let d = Defaults::default();
        let greedy = gc.get("do_sample").and_then(Json::as_bool) == Some(false);
        Defaults {
            temperature: if greedy {
                0.0
            } else {
                num("temperature").map_or(d.temperature, |v| v as f32)
            },
            top_p: num("top_p").map_or(d.top_p, |v| v as f32),
            top_k: num("top_k").map_or(d.top_k, |v| v.max(0.0) as usize),
            min_p: num("min_p").map_or(d.min_p, |v| v as f32),
            repetition_penalty: num("repetition_penalty")
                .map_or(d.repetition_penalty, |v| v as f32),
        }
    }
}

/// What the engine needs besides the prompt.
#[derive(Debug, Clone, PartialEq)]
pub struct GenParams {
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    /// `None`: until the context is full.
    pub max_tokens: Option<usize>,
    pub ignore_eos: bool,
    /// Report each generated token's log-probability and this many of the
    /// most likely tokens' (`None`: no logprobs; `crate::logprobs`).
    pub logprobs: Option<usize>,
}

/// Checks the sampling fields (OpenAI's ranges) and fills in defaults.
/// `ctx` is the context size: `max_tokens` beyond it is refused.
pub fn gen_params(
    f: &SamplingFields,
    d: &Defaults,
    ctx: usize,
    random_seed: u64,
) -> Result<GenParams, ApiError> {
    if let Some(n) = f.n {
        if n != 1 {
            return Err(ApiError::invalid(
                "n",
                format!("only n = 1 is supported, got {n}"),
            ));
        }
    }
    let range = |name: &str, v: Option<f32>, lo: f32, hi: f32, lo_open: bool| match v {
        Some(x) if !x.is_finite() || x > hi || x < lo || (lo_open && x == lo) => {
            let open = if lo_open { "(" } else { "[" };
            Err(ApiError::invalid(
                name,
                format!("`{name}` must be in {open}{lo}, {hi}], got {x}"),
            ))
        }
        _ => Ok(()),
    };
    range("temperature", f.temperature, 0.0, 2.0, false)?;
    range("top_p", f.top_p, 0.0, 1.0, true)?;
    range("min_p", f.min_p, 0.0, 1.0, false)?;
    range("presence_penalty", f.presence_penalty, -2.0, 2.0, false)?;
    range("frequency_penalty", f.frequency_penalty, -2.0, 2.0, false)?;
    range("repetition_penalty", f.repetition_penalty, 0.0, 10.0, true)?;
    if let Some(k) = f.top_k {
        if k < -1 {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be >= 0 (0 or -1 = off), got {k}"),
            ));
        }
    }
    let max_tokens = match f.max_tokens {
        None => None,
        Some((n, name)) if n < 1 => {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` must be at least 1, got {n}"),
            ))
        }
        Some((n, name)) if n as u64 > ctx as u64 => {
            return Err(ApiError::invalid(
                name,
                format!("`{name}` is {n}, more than the context size of {ctx} tokens"),
            ))
        }
        Some((n, _)) => Some(n as usize),
    };
    let stop = match &f.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 16 {
        return Err(ApiError::invalid("stop", "at most 16 stop strings"));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop strings must not be empty"));
    }
    let sampler = SamplerConfig {
        temperature: f.temperature.unwrap_or(d.temperature),
        top_p: f.top_p.unwrap_or(d.top_p),
        top_k: f.top_k.map_or(d.top_k, |k| k.max(0) as usize),
        min_p: f.min_p.unwrap_or(d.min_p),
        repetition_penalty: f.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        seed: f.seed.map_or(random_seed, |s| s as u64),
        ..SamplerConfig::default()
    };
    sampler.validate().map_err(|m| ApiError::invalid("", m))?;
    Ok(GenParams {
        sampler,
        stop,
        max_tokens,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs: None,
    })
}

/// How `tool_choice` asks for tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// No tools rendered, no calls parsed.
    None,
    Auto,
    Required,
    Named(String),
}

/// `tool_choice` against the `tools` given.
pub fn tool_choice(tools: Option<&[Json]>, choice: Option<&Json>) -> Result<ToolChoice, ApiError> {
    let tools = tools.unwrap_or_default();
    for (i, t) in tools.iter().enumerate() {
        let named = t["function"]["name"]
            .as_str()
            .is_some_and(|s| !s.is_empty());
        if t.get("type").and_then(Json::as_str) != Some("function") || !named {
            return Err(ApiError::invalid(
                format!("tools[{i}]"),
                "a tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": ...}}",
            ));
        }
    }
    let name_of = |t: &Json| {
        t["function"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let choice = match choice {
        None | Some(Json::Null) => {
            if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            }
        }
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` must be none, auto, required or a function, got `{other}`"),
                ))
            }
        },
        Some(obj) => match obj["function"]["name"].as_str() {
            Some(n) if obj.get("type").and_then(Json::as_str) == Some("function") => {
                if !tools.iter().any(|t| name_of(t) == n) {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("`tool_choice` names `{n}`, which is not in `tools`"),
                    ));
                }
                ToolChoice::Named(n.to_string())
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if tools.is_empty() && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` requires a tool but `tools` is empty",
        ));
    }
    Ok(choice)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ChatRequest, ApiError> {
        parse_body(body.as_bytes())
    }

    fn params(body: &str) -> Result<GenParams, ApiError> {
        gen_params(&chat(body)?.sampling(), &Defaults::default(), 100, 7)
    }

    #[test]
    fn errors_name_the_field() {
        let e = chat("{\"messages\": [{\"role\": \"user\", \"content\": 5}]}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"), "{e:?}");
        let e = chat("{\"temperature\": \"hot\"}").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(e.message.contains("temperature"), "{}", e.message);
        let e = chat("{\"messages\": [").unwrap_err();
        assert_eq!(e.param, None);
        assert!(e.message.contains("not valid JSON"));
        let e = chat("[1, 2]").unwrap_err();
        assert_eq!(e.status, 400);
        let e = chat("{\"max_tokens\": -3}").map(|r| r.sampling()).unwrap();
        let e = gen_params(&e, &Defaults::default(), 100, 0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn ranges_and_limits() {
        for (body, param) in [
            ("{\"temperature\": 2.5}", "temperature"),
            ("{\"top_p\": 0}", "top_p"),
            ("{\"presence_penalty\": 3}", "presence_penalty"),
            ("{\"frequency_penalty\": -2.1}", "frequency_penalty"),
            ("{\"max_tokens\": 0}", "max_tokens"),
            ("{\"max_completion_tokens\": 101}", "max_completion_tokens"),
            ("{\"n\": 2}", "n"),
            ("{\"stop\": [\"\"]}", "stop"),
            ("{\"top_k\": -5}", "top_k"),
        ] {
            let e = params(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
            assert!(e.message.contains(param), "{body}: {}", e.message);
        }
        let p = params(
            "{\"temperature\": 0, \"top_p\": 0.5, \"max_tokens\": 100, \"stop\": \"x\", \"seed\": 3, \"presence_penalty\": 1, \"frequency_penalty\": 0.5}",
        )
        .unwrap();
        assert_eq!(p.max_tokens, Some(100));
        assert_eq!(p.stop, vec!["x"]);
        assert_eq!(p.sampler.seed, 3);
        assert_eq!(p.sampler.temperature, 0.0);
        assert_eq!(p.sampler.top_p, 0.5);
        assert_eq!(p.sampler.presence_penalty, 1.0);
        assert_eq!(p.sampler.frequency_penalty, 0.5);
        // max_completion_tokens wins over max_tokens; no seed: the random one.
        let p = params("{\"max_tokens\": 5, \"max_completion_tokens\": 9}").unwrap();
        assert_eq!(p.max_tokens, Some(9));
        assert_eq!(p.sampler.seed, 7);
    }

    #[test]
    fn messages_are_checked() {
        let e = chat("{}").unwrap().checked_messages().unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = chat("{\"messages\": []}")
            .unwrap()
            .checked_messages()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let r = chat("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"robot\", \"content\": \"b\"}]}").unwrap();
        assert_eq!(
            r.checked_messages().unwrap_err().param.as_deref(),
            Some("messages[1].role")
        );
        let r = chat("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {}}]}]}").unwrap();
        assert_eq!(
            r.checked_messages().unwrap_err().param.as_deref(),
            Some("messages[0].content[0]")
        );
        let r = chat("{\"messages\": [{\"role\": \"developer\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"c\", \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": \"{}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": \"c\", \"content\": \"1\"}]}").unwrap();
        let m = r.checked_messages().unwrap();
        assert_eq!(m[0].role, "system");
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c"));
    }

    #[test]
    fn reasoning_effort_is_a_template_variable() {
        let kw = |body: &str| chat(body).unwrap().template_kwargs();
        assert_eq!(kw("{}").unwrap(), None);
        let k = kw("{\"reasoning_effort\": \"high\"}").unwrap().unwrap();
        assert_eq!(k["reasoning_effort"], "high");
        let k = kw("{\"reasoning_effort\": \"high\", \"chat_template_kwargs\": {\"reasoning_effort\": \"low\", \"x\": 1}}")
            .unwrap()
            .unwrap();
        assert_eq!(
            (&k["reasoning_effort"], &k["x"]),
            (&"low".into(), &1.into())
        );
        for bad in ["\"extreme\"", "3"] {
            let e = kw(&format!("{{\"reasoning_effort\": {bad}}}")).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("reasoning_effort"));
        }
    }

    #[test]
    fn unsupported_options_are_refused() {
        let e = chat("{\"logit_bias\": {\"5\": 1}}")
            .unwrap()
            .check_unsupported()
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
        chat("{\"logprobs\": false, \"response_format\": {\"type\": \"text\"}}")
            .unwrap()
            .check_unsupported()
            .unwrap();
    }

    #[test]
    fn tool_choice_forms() {
        let tools = vec![serde_json::json!({"type": "function", "function": {"name": "f"}})];
        let t = Some(tools.as_slice());
        assert_eq!(tool_choice(t, None).unwrap(), ToolChoice::Auto);
        assert_eq!(tool_choice(None, None).unwrap(), ToolChoice::None);
        assert_eq!(
            tool_choice(t, Some(&"none".into())).unwrap(),
            ToolChoice::None
        );
        assert_eq!(
            tool_choice(t, Some(&"required".into())).unwrap(),
            ToolChoice::Required
        );
        let named = serde_json::json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(
            tool_choice(t, Some(&named)).unwrap(),
            ToolChoice::Named("f".into())
        );
        let other = serde_json::json!({"type": "function", "function": {"name": "g"}});
        assert_eq!(
            tool_choice(t, Some(&other)).unwrap_err().param.as_deref(),
            Some("tool_choice")
        );
        assert!(tool_choice(None, Some(&"required".into())).is_err());
        let bad = vec![serde_json::json!({"type": "function"})];
        assert_eq!(
            tool_choice(Some(&bad), None).unwrap_err().param.as_deref(),
            Some("tools[0]")
        );
    }

    #[test]
    fn completion_prompts() {
        let p = |v: Json| completion_prompt(Some(&v));
        assert_eq!(p("hi".into()).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(
            p(serde_json::json!(["hi"])).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            p(serde_json::json!([1, 2])).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        assert_eq!(
            p(serde_json::json!([[1, 2]])).unwrap(),
            Prompt::Tokens(vec![1, 2])
        );
        assert!(p(serde_json::json!(["a", "b"])).is_err());
        assert!(p(serde_json::json!([-1])).is_err());
        assert!(p(serde_json::json!(5)).is_err());
        assert!(completion_prompt(None).is_err());
    }
}
