//! Structured output requests as grammars for [`crate::constrain`]:
//! OpenAI's `response_format` (`json_object`, `json_schema`), Anthropic's
//! `output_config.format`, and forced calls (`tool_choice` `required` or
//! a named function) to tools marked `"strict": true`, whose arguments then
//! follow the tool's `parameters` schema in the template's tool-call
//! spelling. Grammars are llguidance's Lark dialect with JSON schemas
//! embedded (`%json {..}`); JSON comes out with Python's `json.dumps`
//! separators (`", "`, `": "`) and no other whitespace, so a model cannot
//! pad it without end.
//!
//! Not constrained: calls the model may or may not make (`tool_choice`
//! `auto`: `strict` is accepted there but not enforced); refused: strict
//! forced calls in GLM's spelling, and JSON answers from harmony-format
//! models (gpt-oss), whose answer channel the grammar would have to spell.

use serde_json::{json, Map, Value as Json};

use crate::error::ApiError;
use crate::tools::ToolFormat;

/// A grammar for one request, and the request field it comes from (named
/// in the error when llguidance cannot compile it).
#[derive(Debug, Clone, PartialEq)]
pub struct Grammar {
    pub lark: String,
    pub param: String,
}

/// OpenAI's `response_format`: `None` for text, else the JSON schema the
/// answer must follow (`{"type": "object"}` for `json_object`).
pub fn response_format(v: Option<&Json>) -> Result<Option<Json>, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let kind = v.get("type").and_then(Json::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => {
            let js = v.get("json_schema").ok_or_else(|| {
                ApiError::invalid(
                    "response_format.json_schema",
                    "`response_format.json_schema` is required for type json_schema",
                )
            })?;
            match js.get("name") {
                Some(Json::String(n)) if valid_name(n) => {}
                _ => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` must be a string of 1 to 64 letters, digits, `_` or `-`",
                    ))
                }
            }
            if !matches!(
                js.get("strict"),
                None | Some(Json::Null) | Some(Json::Bool(_))
            ) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.strict",
                    "`strict` must be a boolean",
                ));
            }
            schema(js.get("schema"), "response_format.json_schema.schema").map(Some)
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// Anthropic's `output_config.format`: `{"type": "json_schema", "schema": ..}`.
pub fn anthropic_format(v: &Json) -> Result<Json, ApiError> {
    if v.get("type").and_then(Json::as_str) != Some("json_schema") {
        return Err(ApiError::invalid(
            "output_config.format.type",
            "`output_config.format.type` must be \"json_schema\"",
        ));
    }
    schema(v.get("schema"), "output_config.format.schema")
}

/// A schema given (an object; absent: any JSON value).
fn schema(s: Option<&Json>, param: &str) -> Result<Json, ApiError> {
    match s {
        None | Some(Json::Null) => Ok(json!({})),
        Some(s @ Json::Object(_)) => Ok(s.clone()),
        Some(_) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a JSON schema object"),
        )),
    }
}

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A tool call forced by the prompt: the template's spelling, and the
/// function when the prompt names it (else the model picks one).
#[derive(Debug, Clone, Copy)]
pub struct ForcedCall<'a> {
    pub format: ToolFormat,
    pub name: Option<&'a str>,
}

/// What a request asks to constrain, checked for one template.
pub struct Request<'a> {
    /// The answer's JSON schema (`response_format`).
    pub schema: Option<&'a Json>,
    /// OpenAI-form tools.
    pub tools: &'a [Json],
    /// The call the prompt forces, if any.
    pub forced: Option<ForcedCall<'a>>,
    /// Harmony-format answers (gpt-oss).
    pub harmony: bool,
}

/// The grammar for a request, or `None` when nothing is constrained.
/// `special(name)`: whether the vocabulary has `name` as one special token
/// (the grammar then names it as a token, else spells it as text).
pub fn grammar(
    r: &Request<'_>,
    special: &dyn Fn(&str) -> bool,
) -> Result<Option<Grammar>, ApiError> {
    for (i, t) in r.tools.iter().enumerate() {
        if !matches!(
            t["function"].get("strict"),
            None | Some(Json::Null) | Some(Json::Bool(_))
        ) {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.strict"),
                "`strict` must be a boolean",
            ));
        }
    }
    if let Some(f) = r.forced {
        return call_grammar(r.tools, f, special);
    }
    let Some(schema) = r.schema else {
        return Ok(None);
    };
    if r.harmony {
        return Err(ApiError::invalid(
            "response_format",
            "JSON output is not supported for harmony-format (gpt-oss) models",
        ));
    }
    Ok(Some(Grammar {
        lark: format!("start: {}\n", json_rule(schema)),
        param: "response_format".into(),
    }))
}

/// `%json {schema}` with the output's separators.
fn json_rule(schema: &Json) -> String {
    let mut s = schema.clone();
    if let Json::Object(m) = &mut s {
        m.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    format!("%json {s}")
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    Json::from(s).to_string()
}

fn is_strict(t: &Json) -> bool {
    t["function"]["strict"] == Json::Bool(true)
}

fn name_of(t: &Json) -> &str {
    t["function"]["name"].as_str().unwrap_or_default()
}

/// A tool's `parameters` (an object schema; absent: no arguments).
fn params_of(t: &Json) -> Json {
    match &t["function"]["parameters"] {
        p @ Json::Object(_) => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    }
}

/// The grammar of a forced call's remainder, when a tool it may call is
/// strict (a non-strict one among them takes any JSON object).
fn call_grammar(
    tools: &[Json],
    f: ForcedCall<'_>,
    special: &dyn Fn(&str) -> bool,
) -> Result<Option<Grammar>, ApiError> {
    let candidates: Vec<(usize, &Json)> = tools
        .iter()
        .enumerate()
        .filter(|(_, t)| f.name.is_none_or(|n| name_of(t) == n))
        .collect();
    let Some(&(first, _)) = candidates.iter().find(|(_, t)| is_strict(t)) else {
        return Ok(None);
    };
    let param = format!("tools[{first}].function.parameters");
    let tok = |s: &str| if special(s) { s.to_string() } else { lit(s) };
    let args = |t: &Json| {
        if is_strict(t) {
            json_rule(&params_of(t))
        } else {
            json_rule(&json!({"type": "object"}))
        }
    };
    let refuse = |why: &str| {
        Err(ApiError::invalid(
            format!("tools[{first}].function.strict"),
            format!("a strict tool call cannot be enforced {why}"),
        ))
    };
    let lark = match (f.format, f.name) {
        // Prompt: `<tool_call>\n{"name": "NAME", "arguments": `.
        (ToolFormat::Json, Some(_)) => {
            format!("start: {} \"}}\\n\" {}\n", args(candidates[0].1), tok("</tool_call>"))
        }
        // Prompt: `<tool_call>\n`.
        (ToolFormat::Json, None) => {
            let mut g = format!("start: call \"}}\\n\" {}\ncall: ", tok("</tool_call>"));
            let alts: Vec<String> = candidates
                .iter()
                .map(|(_, t)| {
                    let head = format!("{{\"name\": {}, \"arguments\": ", Json::from(name_of(t)));
                    format!("{} {}", lit(&head), args(t))
                })
                .collect();
            g.push_str(&alts.join(" | "));
            g.push('\n');
            g
        }
        // Prompt: `<tool_call>\n<function=NAME>\n`.
        (ToolFormat::Xml, Some(_)) => {
            let (_, t) = candidates[0];
            let mut g = format!(
                "start: params0 {} {}\n",
                lit("</function>\n"),
                tok("</tool_call>")
            );
            g.push_str(&xml_params(0, t, first)?);
            g
        }
        // Prompt: `<tool_call>\n`.
        (ToolFormat::Xml, None) => {
            let mut g = format!("start: ({}) {} {}\n", (0..candidates.len()).map(|k| format!("call{k}")).collect::<Vec<_>>().join(" | "), lit("</function>\n"), tok("</tool_call>"));
            for (k, (i, t)) in candidates.iter().enumerate() {
                g.push_str(&format!(
                    "call{k}: {} params{k}\n",
                    lit(&format!("<function={}>\n", name_of(t)))
                ));
                g.push_str(&xml_params(k, t, *i)?);
            }
            g
        }
        // Prompt: `...functions.NAME:IDX<|tool_call_argument_begin|>`.
        (ToolFormat::Kimi, Some(_)) => format!(
            "start: {} {} {}\n",
            args(candidates[0].1),
            tok("<|tool_call_end|>"),
            tok("<|tool_calls_section_end|>")
        ),
        // Prompt: `...<|constrain|>json<|message|>`.
        (ToolFormat::Harmony, Some(_)) => {
            format!("start: {} {}\n", args(candidates[0].1), tok("<|call|>"))
        }
        (ToolFormat::Kimi | ToolFormat::Harmony, None) => {
            return refuse(
                "for `tool_choice` \"required\" with several tools in this template's tool-call format; name the function in `tool_choice`",
            )
        }
        (ToolFormat::Glm, _) => {
            return refuse("in this template's tool-call format (GLM's arg_key/arg_value)")
        }
    };
    Ok(Some(Grammar { lark, param }))
}

/// The XML spelling's parameters of tool `t` (rule `params{k}`): in the
/// schema's order, each `<parameter=NAME>\nVALUE\n</parameter>\n`, the
/// required ones always, the others optionally. A string parameter is raw
/// text (the parser keeps it a string); others are JSON (the parser reads
/// them as JSON), so every value the grammar admits types back to one the
/// schema admits. `i`: the tool's index, for errors.
fn xml_params(k: usize, t: &Json, i: usize) -> Result<String, ApiError> {
    let params = params_of(t);
    let props = params
        .get("properties")
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    let required: Vec<&str> = params
        .get("required")
        .and_then(Json::as_array)
        .map(|r| r.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    // A parameter's schema alone loses the root's definitions: carried along.
    let defs: Map<String, Json> = ["$defs", "definitions"]
        .iter()
        .filter_map(|d| Some((d.to_string(), params.get(*d)?.clone())))
        .collect();
    let mut rules = String::new();
    let mut seq = Vec::new();
    for (j, (name, schema)) in props.iter().enumerate() {
        let rule = format!("p{k}_{j}");
        let open = lit(&format!("<parameter={name}>\n"));
        let close = lit("\n</parameter>\n");
        let value = match string_param(schema) {
            StringParam::Raw(None) => format!("{open} raw{k}"),
            // Raw text of a bounded length up to the first closing tag,
            // which the lexeme includes (lazy: the shortest match).
            StringParam::Raw(Some((min, max))) => {
                let max = max.map_or(String::new(), |m| m.to_string());
                rules.push_str(&format!(
                    "v{k}_{j}[lazy]: /(?s:.{{{min},{max}}})\\n<\\/parameter>\\n/\n"
                ));
                format!("{open} v{k}_{j}")
            }
            StringParam::OneOf(values) if values.is_empty() => {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.parameters.properties.{name}"),
                    "a string parameter whose `enum` or `const` holds no string admits no value",
                ))
            }
            StringParam::OneOf(values) => {
                let alts: Vec<String> = values.iter().map(|v| lit(v)).collect();
                format!("{open} ({}) {close}", alts.join(" | "))
            }
            StringParam::Constrained => {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.parameters.properties.{name}"),
                    "a strict tool's string parameter with `pattern` or `format` (or a length bound that is not a count) cannot be enforced in this template's XML tool-call format",
                ))
            }
            StringParam::No => {
                let mut s = schema.clone();
                if let Json::Object(m) = &mut s {
                    for (d, v) in &defs {
                        m.entry(d.clone()).or_insert_with(|| v.clone());
                    }
                }
                format!("{open} {} {close}", json_rule(&s))
            }
        };
        rules.push_str(&format!("{rule}: {value}\n"));
        let opt = if required.contains(&name.as_str()) {
            ""
        } else {
            "?"
        };
        seq.push(format!("{rule}{opt}"));
    }
    // Raw text up to the first closing tag, which it includes (lazy: the
    // shortest match).
    rules.push_str(&format!("raw{k}[lazy]: /(?s:.*)\\n<\\/parameter>\\n/\n"));
    let body = if seq.is_empty() {
        "\"\"".to_string()
    } else {
        seq.join(" ")
    };
    Ok(format!("params{k}: {body}\n{rules}"))
}

enum StringParam {
    /// Not a string: JSON.
    No,
    /// Any string: raw text, of at least and at most this many
    /// characters when bounded.
    Raw(Option<(u64, Option<u64>)>),
    /// One of these strings (`enum` / `const`).
    OneOf(Vec<String>),
    /// A string with constraints raw text cannot be held to.
    Constrained,
}

/// How the parser types a parameter (`tools.rs`: a string when the schema's
/// `type` is "string", or a list of only "string"), and what constrains it.
fn string_param(schema: &Json) -> StringParam {
    let is_string = match schema.get("type") {
        Some(Json::String(t)) => t == "string",
        Some(Json::Array(ts)) => !ts.is_empty() && ts.iter().all(|t| t == "string"),
        _ => false,
    };
    if !is_string {
        return StringParam::No;
    }
    if let Some(c) = schema.get("const") {
        return StringParam::OneOf(c.as_str().map(str::to_string).into_iter().collect());
    }
    if let Some(Json::Array(values)) = schema.get("enum") {
        return StringParam::OneOf(
            values
                .iter()
                .filter_map(Json::as_str)
                .map(str::to_string)
                .collect(),
        );
    }
    if ["pattern", "format"]
        .iter()
        .any(|k| schema.get(*k).is_some())
    {
        return StringParam::Constrained;
    }
    let min = schema.get("minLength").map(Json::as_u64);
    let max = schema.get("maxLength").map(Json::as_u64);
    match (min, max) {
        (None, None) => StringParam::Raw(None),
        (Some(None), _) | (_, Some(None)) => StringParam::Constrained,
        (min, max) => StringParam::Raw(Some((min.flatten().unwrap_or(0), max.flatten()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::constrain::tests::{draw, engine};
    use crate::tools::ToolCallParser;

    fn weather(strict: bool) -> Json {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "strict": strict,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    "where": {"$ref": "#/$defs/Point"}
                },
                "required": ["city", "unit", "days", "where"],
                "additionalProperties": false,
                "$defs": {"Point": {"type": "object", "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}}, "required": ["lat"], "additionalProperties": false}}
            }
        }})
    }

    fn other() -> Json {
        json!({"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}})
    }

    fn call_grammar_for(
        format: ToolFormat,
        name: Option<&str>,
        tools: &[Json],
    ) -> Result<Option<Grammar>, ApiError> {
        grammar(
            &Request {
                schema: None,
                tools,
                forced: Some(ForcedCall { format, name }),
                harmony: false,
            },
            &|_| false,
        )
    }

    /// A forced call drawn from random logits, parsed back as the server
    /// parses the answer: its arguments.
    fn forced_args(
        format: ToolFormat,
        name: Option<&str>,
        tools: &[Json],
        prefix: &str,
        seed: u64,
    ) -> (String, Json) {
        let e = engine();
        let g = call_grammar_for(format, name, tools).unwrap().unwrap();
        // Raw strings end at their closing tag only: random text takes long.
        let (text, ended) = draw(&e, &g.lark, seed, 3000);
        assert!(ended, "{text:?}");
        let tools = Json::Array(tools.to_vec());
        let mut p = ToolCallParser::new(Some(&tools), Box::new(|| "call_1".into()));
        p.push(prefix);
        p.push(&text);
        p.finish();
        let calls = p.calls();
        assert_eq!(calls.len(), 1, "{prefix}{text}");
        (
            calls[0].name.clone(),
            serde_json::from_str(&calls[0].arguments).unwrap(),
        )
    }

    fn check_weather(args: &Json) {
        assert!(args["city"].is_string(), "{args}");
        assert!(
            ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()),
            "{args}"
        );
        assert!((1..=7).contains(&args["days"].as_i64().unwrap()), "{args}");
        assert!(
            (-90..=90).contains(&args["where"]["lat"].as_i64().unwrap()),
            "{args}"
        );
    }

    #[test]
    fn forced_strict_calls_follow_the_schema_in_each_spelling() {
        let tools = [weather(true), other()];
        for seed in 1..=3 {
            let prefix = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ";
            let (n, args) =
                forced_args(ToolFormat::Json, Some("get_weather"), &tools, prefix, seed);
            assert_eq!(n, "get_weather");
            check_weather(&args);
            let (n, args) = forced_args(ToolFormat::Json, None, &tools, "<tool_call>\n", seed);
            if n == "get_weather" {
                check_weather(&args);
            } else {
                assert_eq!((n.as_str(), args.is_object()), ("noop", true));
            }
            let prefix = "<tool_call>\n<function=get_weather>\n";
            let (n, args) = forced_args(ToolFormat::Xml, Some("get_weather"), &tools, prefix, seed);
            assert_eq!(n, "get_weather");
            check_weather(&args);
            let (n, _) = forced_args(ToolFormat::Xml, None, &tools, "<tool_call>\n", seed);
            assert!(n == "get_weather" || n == "noop");
        }
    }

    #[test]
    fn what_is_constrained_and_what_is_refused() {
        // Nothing strict among the candidates: no grammar.
        assert_eq!(
            call_grammar_for(ToolFormat::Xml, Some("get_weather"), &[weather(false)]).unwrap(),
            None
        );
        assert_eq!(
            call_grammar_for(ToolFormat::Xml, Some("noop"), &[weather(true), other()]).unwrap(),
            None
        );
        let e = engine();
        for (format, name) in [
            (ToolFormat::Kimi, Some("get_weather")),
            (ToolFormat::Harmony, Some("get_weather")),
        ] {
            let g = call_grammar_for(format, name, &[weather(true)])
                .unwrap()
                .unwrap();
            assert_eq!(g.param, "tools[0].function.parameters");
            e.constraint(&g.lark, false).unwrap();
        }
        for (format, name) in [
            (ToolFormat::Glm, Some("get_weather")),
            (ToolFormat::Kimi, None),
            (ToolFormat::Harmony, None),
        ] {
            let err = call_grammar_for(format, name, &[weather(true), other()]).unwrap_err();
            assert_eq!(err.param.as_deref(), Some("tools[0].function.strict"));
        }
        let mut bad = weather(true);
        bad["function"]["parameters"]["properties"]["city"]["pattern"] = "^[A-Z]".into();
        let err = call_grammar_for(ToolFormat::Xml, None, &[bad]).unwrap_err();
        assert_eq!(
            err.param.as_deref(),
            Some("tools[0].function.parameters.properties.city")
        );
        let mut bad = weather(true);
        bad["function"]["strict"] = "yes".into();
        let err = call_grammar_for(ToolFormat::Xml, None, &[bad]).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tools[0].function.strict"));
        // Harmony models answer in channels: a JSON answer is refused.
        let r = Request {
            schema: Some(&json!({})),
            tools: &[],
            forced: None,
            harmony: true,
        };
        assert_eq!(
            grammar(&r, &|_| false).unwrap_err().param.as_deref(),
            Some("response_format")
        );
    }

    #[test]
    fn response_format_forms() {
        let f = |v: Json| response_format(Some(&v));
        assert_eq!(f(json!({"type": "text"})).unwrap(), None);
        assert_eq!(response_format(None).unwrap(), None);
        assert_eq!(
            f(json!({"type": "json_object"})).unwrap(),
            Some(json!({"type": "object"}))
        );
        let s = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            f(json!({"type": "json_schema", "json_schema": {"name": "a_b-1", "schema": s, "strict": true}})).unwrap(),
            Some(s)
        );
        assert_eq!(
            f(json!({"type": "json_schema", "json_schema": {"name": "x"}})).unwrap(),
            Some(json!({}))
        );
        for (v, param) in [
            (json!({"type": "yaml"}), "response_format.type"),
            (json!({}), "response_format.type"),
            (
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"schema": {}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "a b"}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "strict": 1}}),
                "response_format.json_schema.strict",
            ),
        ] {
            assert_eq!(
                f(v.clone()).unwrap_err().param.as_deref(),
                Some(param),
                "{v}"
            );
        }
    }
}
