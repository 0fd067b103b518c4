//! A request body as the server parses it: JSON into the request types,
//! field validation, sampling parameters, tool choice, then the prompt
//! (chat template and tokenizer) that would be queued. Every refusal is an
//! error object, never a panic. A chat body is also read as an Anthropic
//! Messages request.
#![no_main]

use libfuzzer_sys::fuzz_target;
use moeflux_server::anthropic::MessagesRequest;
use moeflux_server::api::{self, ChatRequest, ChatSpec, CompletionRequest, Defaults};
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
        let _ = moeflux_server::logprobs::completion_request(req.logprobs, req.echo);
        let _ = api::completion_prompt(req.prompt.as_ref());
        let _ = api::gen_params(&req.sampling(), &defaults, 256, 7);
        return;
    }
    let template = common::template(which >> 1);
    let render = |spec: &ChatSpec| {
        let _ = prompt::chat_prompt(
            template,
            common::tokenizer(),
            ToolFormat::detect(template.source()),
            &ChatInput {
                messages: &spec.messages,
                tools: spec.tools.as_deref(),
                choice: &spec.choice,
                template_kwargs: spec.template_kwargs.as_ref(),
            },
        );
    };
    if let Ok(req) = api::parse_body::<MessagesRequest>(body) {
        if let Ok(spec) = req.spec(&defaults, 256, 7) {
            render(&spec);
        }
    }
    if let Ok(spec) =
        api::parse_body::<ChatRequest>(body).and_then(|req| req.spec(&defaults, 256, 7))
    {
        render(&spec);
    }
});
