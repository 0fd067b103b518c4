//! A request body as the server parses it: JSON into the request types,
//! field validation, sampling parameters, tool choice, then the prompt
//! (chat template and tokenizer) that would be queued. Every refusal is an
//! OpenAI error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeflux_server::api::{self, ChatRequest, CompletionRequest, Defaults};
use moeflux_server::prompt::{self, ChatInput};
use moeflux_server::tools::ToolFormat;

mod common;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else {
        return;
    };
    let defaults = Defaults::default();
    if which & 1 == 1 {
        let Ok(req) = api::parse_body::<CompletionRequest>(body) else {
            return;
        };
        let _ = req.check_unsupported();
        let _ = api::completion_prompt(req.prompt.as_ref());
        let _ = api::gen_params(&req.sampling(), &defaults, 256, 7);
        return;
    }
    let Ok(req) = api::parse_body::<ChatRequest>(body) else {
        return;
    };
    if req.check_unsupported().is_err() {
        return;
    }
    let Ok(messages) = req.checked_messages() else {
        return;
    };
    if api::gen_params(&req.sampling(), &defaults, 256, 7).is_err() {
        return;
    }
    let Ok(choice) = api::tool_choice(req.tools.as_deref(), req.tool_choice.as_ref()) else {
        return;
    };
    let template = common::template(which >> 1);
    let _ = prompt::chat_prompt(
        template,
        common::tokenizer(),
        ToolFormat::detect(template.source()),
        &ChatInput {
            messages: &messages,
            tools: req.tools.as_deref(),
            choice: &choice,
            template_kwargs: req.chat_template_kwargs.as_ref(),
        },
    );
});
