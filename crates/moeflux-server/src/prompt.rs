//! From a validated request to prompt tokens: the chat template (with
//! `tools`), a forced tool-call opening for `tool_choice` `required` or a
//! named function (in the template's spelling, after its reasoning block),
//! and the message boundaries worth a prefix snapshot.
//! CPU work (template, tokenizer): run off the async threads.

use moeflux::text::chat::{ChatMessage, ChatTemplate, RenderOptions};
use moeflux::text::tokenizer::Tokenizer;
use serde_json::{Map, Value as Json};

use crate::api::ToolChoice;
use crate::error::ApiError;
use crate::tools::ToolFormat;

pub struct ChatPrompt {
    pub tokens: Vec<u32>,
    /// Ends of whole messages inside `tokens` (ascending, shorter than it).
    pub boundaries: Vec<usize>,
    pub starts_in_reasoning: bool,
    /// Parse `<tool_call>`s out of the answer.
    pub parse_tools: bool,
    /// Text that the tool parser must see as the start of the answer (a
    /// forced call's opening, appended to the prompt).
    pub forced: Option<String>,
    /// The call the prompt forces: the template's spelling, and the
    /// function when the prompt names it.
    pub forced_call: Option<(ToolFormat, Option<String>)>,
}

pub struct ChatInput<'a> {
    pub messages: &'a [ChatMessage],
    pub tools: Option<&'a [Json]>,
    pub choice: &'a ToolChoice,
    pub template_kwargs: Option<&'a Map<String, Json>>,
}

pub fn chat_prompt(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    tool_format: Option<ToolFormat>,
    input: &ChatInput<'_>,
) -> Result<ChatPrompt, ApiError> {
    chat_prompt_checked(template, tokenizer, tool_format, input, &|_| Ok(()))
}

/// [`chat_prompt`], where `before_encode` sees the rendered text before
/// the tokenizer does (the cheap length bound: a prompt refused there is
/// never tokenized).
pub fn chat_prompt_checked(
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    tool_format: Option<ToolFormat>,
    input: &ChatInput<'_>,
    before_encode: &dyn Fn(&str) -> Result<(), ApiError>,
) -> Result<ChatPrompt, ApiError> {
    let use_tools = *input.choice != ToolChoice::None && input.tools.is_some_and(|t| !t.is_empty());
    let format = match (use_tools, tool_format) {
        (false, _) => None,
        (true, Some(f)) => Some(f),
        (true, None) => {
            return Err(ApiError::invalid(
                "tools",
                "this model's chat template does not render tools",
            ))
        }
    };
    let mut opts = RenderOptions {
        add_generation_prompt: true,
        tools: use_tools.then(|| Json::Array(input.tools.unwrap_or_default().to_vec())),
        ..Default::default()
    };
    if let Some(kw) = input.template_kwargs {
        for (k, v) in kw {
            match (k.as_str(), v) {
                ("enable_thinking", Json::Bool(b)) => opts.enable_thinking = Some(*b),
                ("enable_thinking", _) => {
                    return Err(ApiError::invalid(
                        "chat_template_kwargs.enable_thinking",
                        "`enable_thinking` must be a boolean",
                    ))
                }
                _ => {
                    opts.extra.insert(k.clone(), v.clone());
                }
            }
        }
    }
    // Special-token spellings typed in messages stay text: only the
    // template's own markup becomes control tokens.
    let render = |messages: &[ChatMessage], opts: &RenderOptions| {
        template
            .render_prompt(messages, opts, tokenizer)
            .map_err(|e| match e {
                moeflux::Error::Invalid(m) => ApiError::invalid("messages", m),
                other => ApiError::internal(other.to_string()),
            })
    };
    let mut prompt = render(input.messages, &opts)?;
    let mut starts_in_reasoning = prompt.text().trim_end().ends_with("<think>");
    let calls_before = input
        .messages
        .iter()
        .filter(|m| m.role == "assistant")
        .filter_map(|m| m.tool_calls.as_ref()?.as_array().map(Vec::len))
        .sum();
    let forced_name = match (format, input.choice) {
        // With one tool, "required" can only mean that one: force its name.
        (Some(_), ToolChoice::Required) => match input.tools.unwrap_or_default() {
            [only] => Some(only["function"]["name"].as_str()),
            _ => Some(None),
        },
        (Some(_), ToolChoice::Named(n)) => Some(Some(n.as_str())),
        _ => None,
    };
    let mut forced = None;
    let forced_call = format.zip(forced_name.map(|n| n.map(str::to_string)));
    if let (Some(fmt), Some(name)) = (format, forced_name) {
        // The call goes where the model writes one: after the reasoning
        // block, closed (and empty) if the prompt left it open.
        let close = fmt.before_forced_call(prompt.text(), template.source());
        prompt.push_str(close);
        starts_in_reasoning = false;
        let f = fmt.forced_prefix(name, calls_before);
        prompt.push_str(&f);
        forced = fmt.parser_prefix(&f, name);
    }
    before_encode(prompt.text())?;
    let tokens = tokenizer
        .encode_prompt(&prompt)
        .map_err(|e| ApiError::internal(format!("tokenizer: {e}")))?;

    // Message boundaries: the conversation without its last one or two
    // messages, rendered alone, where its tokens are a prefix of the
    // prompt. The next turn of this conversation starts with them.
    let mut boundaries = Vec::new();
    let closed = RenderOptions {
        add_generation_prompt: false,
        ..opts.clone()
    };
    let n = input.messages.len();
    for k in [n.saturating_sub(1), n].into_iter().filter(|&k| k >= 1) {
        let Ok(part) = template.render_prompt(&input.messages[..k], &closed, tokenizer) else {
            continue;
        };
        let Ok(ids) = tokenizer.encode_prompt(&part) else {
            continue;
        };
        if !ids.is_empty() && ids.len() < tokens.len() && tokens.starts_with(&ids) {
            boundaries.push(ids.len());
        }
    }
    boundaries.sort_unstable();
    boundaries.dedup();
    Ok(ChatPrompt {
        tokens,
        boundaries,
        starts_in_reasoning,
        parse_tools: use_tools,
        forced,
        forced_call,
    })
}

pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    tokenizer
        .encode(text, false)
        .map_err(|e| ApiError::internal(format!("tokenizer: {e}")))
}

/// A lower bound on a text's token count from its length in bytes, so that
/// a prompt far beyond the context is refused without tokenizing it.
#[derive(Debug, Clone, Copy)]
pub struct LengthBound {
    /// The longest vocabulary entry, in bytes of its vocabulary form (for
    /// byte-level BPE at least the bytes it stands for).
    max_token_bytes: usize,
}

/// Normalizers may lengthen text before it is split (NFC up to 3 times in
/// UTF-8 bytes); the bound allows for that.
const NORMALIZER_SLACK: usize = 4;

impl LengthBound {
    pub fn from_tokenizer(t: &Tokenizer) -> LengthBound {
        let max = (0..t.vocab_size() as u32)
            .filter_map(|id| t.id_to_token(id))
            .map(|s| s.len())
            .max()
            .unwrap_or(1);
        LengthBound {
            max_token_bytes: max.max(1),
        }
    }

    /// Fewer tokens than this cannot spell `bytes` bytes of text.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes / (self.max_token_bytes * NORMALIZER_SLACK)
    }
}
