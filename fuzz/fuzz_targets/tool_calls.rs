//! Generated text fed to the tool-call parser in arbitrary pieces (every
//! spelling: Qwen XML, JSON, GLM, Kimi): it never panics, and every call
//! it reports has arguments that are one JSON object (what clients parse).
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use moeflux_server::tools::ToolCallParser;
use serde_json::json;

#[derive(Arbitrary, Debug)]
struct Input {
    pieces: Vec<String>,
    typed_tools: bool,
}

fuzz_target!(|input: Input| {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "hourly": {"type": "boolean"}, "tags": {"type": "array"}}}}}]);
    let mut n = 0;
    let mut p = ToolCallParser::new(
        input.typed_tools.then_some(&tools),
        Box::new(move || {
            n += 1;
            format!("call_{n}")
        }),
    );
    for piece in &input.pieces {
        let _ = p.push(piece);
    }
    let _ = p.finish();
    for call in p.calls() {
        let args: serde_json::Value = serde_json::from_str(&call.arguments)
            .unwrap_or_else(|e| panic!("arguments {:?} are not JSON: {e}", call.arguments));
        assert!(
            args.is_object(),
            "arguments {:?} are not an object",
            call.arguments
        );
    }
});
