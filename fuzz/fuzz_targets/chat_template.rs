//! Arbitrary conversations (roles, contents, reasoning, tool calls, tools)
//! rendered through the committed real chat templates: a template may
//! refuse a conversation with an error, never panic.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use moeflux::text::chat::{ChatMessage, Content, RenderOptions};
use serde_json::json;

mod common;

#[derive(Arbitrary, Debug)]
struct Call {
    name: String,
    arguments: String,
    as_object: bool,
}

#[derive(Arbitrary, Debug)]
struct Msg {
    role: u8,
    content: Option<String>,
    parts: bool,
    reasoning: Option<String>,
    calls: Vec<Call>,
    tool_call_id: Option<String>,
}

#[derive(Arbitrary, Debug)]
struct Input {
    template: u8,
    messages: Vec<Msg>,
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
    tools: Option<Vec<(String, String)>>,
}

fn message(m: Msg) -> ChatMessage {
    let role = ["system", "user", "assistant", "tool", "developer", ""]
        .get(m.role as usize % 7)
        .map(|r| r.to_string())
        .unwrap_or_else(|| format!("role{}", m.role));
    let content = m.content.map(|c| {
        if m.parts {
            Content::Parts(vec![json!({"type": "text", "text": c})])
        } else {
            Content::Text(c)
        }
    });
    let tool_calls = (!m.calls.is_empty()).then(|| {
        json!(m
            .calls
            .into_iter()
            .map(|c| {
                let args = if c.as_object {
                    serde_json::from_str(&c.arguments).unwrap_or(json!({"x": c.arguments}))
                } else {
                    json!(c.arguments)
                };
                json!({"id": "call_1", "type": "function", "function": {"name": c.name, "arguments": args}})
            })
            .collect::<Vec<_>>())
    });
    ChatMessage {
        role,
        content,
        reasoning_content: m.reasoning,
        tool_calls,
        tool_call_id: m.tool_call_id,
        ..Default::default()
    }
}

fuzz_target!(|input: Input| {
    let template = common::template(input.template);
    let messages: Vec<ChatMessage> = input.messages.into_iter().take(16).map(message).collect();
    let tools = input.tools.map(|t| {
        json!(t
            .into_iter()
            .map(
                |(name, description)| json!({"type": "function", "function": {
                    "name": name, "description": description,
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}
                }})
            )
            .collect::<Vec<_>>())
    });
    let opts = RenderOptions {
        add_generation_prompt: input.add_generation_prompt,
        enable_thinking: input.enable_thinking,
        tools,
        ..Default::default()
    };
    let _ = template.render(&messages, &opts);
});
