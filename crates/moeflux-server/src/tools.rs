//! Tool calls: parsing the model's `<tool_call>` output back into OpenAI
//! `tool_calls`, incrementally, and forcing a call for `tool_choice`.
//!
//! Two spellings are in use inside `<tool_call>...</tool_call>`:
//!
//! - **XML** (Qwen3.5 / Qwen3-Coder templates):
//!   `<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>`;
//!   values are raw text, typed through the tool's JSON schema.
//! - **JSON** (Qwen3 / Hermes templates): `{"name": .., "arguments": {..}}`.
//!
//! The parser decides per call from the first character after the opening
//! tag, so either spelling is understood whatever the template is. Text
//! before a call streams as content; a tail that may still grow into
//! `<tool_call>` is held back so partial tags never leak; whitespace
//! between content and a call is dropped. Calls stream as OpenAI deltas:
//! the name as soon as it is complete, then the arguments — XML one
//! fragment per finished parameter, JSON as the argument object's text
//! arrives (a JSON call whose name comes after its arguments, or whose
//! arguments are a string, is sent whole at the end). A JSON call that
//! cannot be parsed is returned as content, so no text is lost.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const END_FUNCTION: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const END_PARAMETER: &str = "</parameter>";

/// How a chat template asks the model to write tool calls (decides what a
/// forced call starts with; parsing accepts both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Xml,
    Json,
}

impl ToolFormat {
    /// The format a template's source teaches, or `None` when the template
    /// does not render tools at all.
    pub fn detect(template_source: &str) -> Option<ToolFormat> {
        if !template_source.contains("tools") || !template_source.contains(OPEN) {
            return None;
        }
        if template_source.contains(FUNCTION) {
            Some(ToolFormat::Xml)
        } else {
            Some(ToolFormat::Json)
        }
    }

    /// Text appended to the prompt so that the model's next tokens are the
    /// inside of a tool call (`tool_choice: "required"`), of a call to
    /// `name` when given.
    pub fn forced_prefix(self, name: Option<&str>) -> String {
        match (self, name) {
            (_, None) => format!("{OPEN}\n"),
            (ToolFormat::Xml, Some(n)) => format!("{OPEN}\n{FUNCTION}{n}>\n"),
            (ToolFormat::Json, Some(n)) => {
                format!("{OPEN}\n{{\"name\": {}, \"arguments\": ", Json::from(n))
            }
        }
    }
}

/// One finished call, as OpenAI returns it (`arguments` is a JSON string).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// What the parser hands back for streaming.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Content(String),
    /// A call begins: its index among this answer's calls, id and name.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// The next fragment of call `index`'s JSON arguments.
    CallArgs {
        index: usize,
        fragment: String,
    },
}

/// Parameter types by function name, from the request's `tools`.
type Schemas = HashMap<String, HashMap<String, Json>>;

/// A JSON call being streamed.
#[derive(Debug, Clone, Copy)]
struct JsonStream {
    index: usize,
    args: ArgsScan,
}

/// Where the streaming of a JSON call's `arguments` object is.
#[derive(Debug, Clone, Copy)]
enum ArgsScan {
    /// `"arguments": {` not seen yet.
    Seeking,
    /// Sent up to byte `scanned` of the buffer; JSON nesting state there
    /// (`arrays` bit `i`: level `i` is an array; deeper levels are not
    /// tracked for closing).
    Object {
        scanned: usize,
        depth: u32,
        arrays: u64,
        in_str: bool,
        esc: bool,
    },
    /// The object closed.
    Done,
    /// Arguments that are not an object (a string): sent at the end.
    Other,
}

#[derive(Debug)]
enum State {
    Text,
    /// After `<tool_call>`, before deciding the spelling.
    CallStart,
    /// JSON spelling; `Some` once the call's name was sent.
    Json(Option<JsonStream>),
    /// XML spelling inside `<function=..>`: parameters.
    XmlParams {
        index: usize,
        any: bool,
    },
    /// XML spelling after `</function>`: wait for the closing tag.
    XmlEnd,
}

pub struct ToolCallParser {
    schemas: Schemas,
    state: State,
    buf: String,
    /// Whitespace at the end of the content so far: emitted only when more
    /// content follows (dropped before a call).
    pending_ws: String,
    calls: Vec<ToolCall>,
    next_id: Box<dyn FnMut() -> String + Send>,
}

impl ToolCallParser {
    /// `tools` is the request's tool list (for parameter types); `next_id`
    /// names each call.
    pub fn new(tools: Option<&Json>, next_id: Box<dyn FnMut() -> String + Send>) -> Self {
        ToolCallParser {
            schemas: schemas(tools),
            state: State::Text,
            buf: String::new(),
            pending_ws: String::new(),
            calls: Vec::new(),
            next_id,
        }
    }

    /// The finished calls (the last may still lack arguments while
    /// streaming).
    pub fn calls(&self) -> &[ToolCall] {
        &self.calls
    }

    /// Feeds generated text; returns what can be said about it now.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// The generation ended: flush what is held back. An unfinished XML
    /// call is closed with what it has; an unfinished JSON call is content.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        while self.step(&mut out) {}
        let rest = std::mem::take(&mut self.buf);
        match std::mem::replace(&mut self.state, State::Text) {
            State::Text => {
                let mut s = std::mem::take(&mut self.pending_ws);
                s.push_str(&rest);
                if !self.calls.is_empty() {
                    s = s.trim().to_string();
                }
                push_content(&mut out, s);
            }
            State::CallStart => self.end_json_call(None, &rest, false, &mut out),
            State::Json(js) => self.end_json_call(js, &rest, false, &mut out),
            State::XmlParams { index, any } => {
                // Parameters finished so far are in; close the object.
                self.args(index, if any { "}" } else { "{}" }, &mut out);
            }
            State::XmlEnd => {}
        }
        out
    }

    /// One parsing step; false when more text is needed.
    fn step(&mut self, out: &mut Vec<Delta>) -> bool {
        match self.state {
            State::Text => self.step_text(out),
            State::CallStart => {
                let t = self.buf.trim_start();
                if t.starts_with('{') {
                    self.state = State::Json(None);
                    true
                } else if t.starts_with(FUNCTION) {
                    let Some(end) = t.find('>') else {
                        return false;
                    };
                    let name = t[FUNCTION.len()..end].trim().to_string();
                    self.buf = t[end + 1..].to_string();
                    let index = self.start_call(name, out);
                    self.state = State::XmlParams { index, any: false };
                    true
                } else if t.is_empty() || FUNCTION.starts_with(t) {
                    false
                } else {
                    // Neither spelling: treat as JSON (parsed or returned
                    // as text at the closing tag).
                    self.state = State::Json(None);
                    true
                }
            }
            State::Json(js) => {
                let close = self.buf.find(CLOSE);
                let js = self.json_progress(js, close.unwrap_or(self.buf.len()), out);
                let Some(end) = close else {
                    self.state = State::Json(js);
                    return false;
                };
                let body = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.end_json_call(js, &body, true, out);
                self.state = State::Text;
                true
            }
            State::XmlParams { index, any } => self.step_xml_params(index, any, out),
            State::XmlEnd => {
                let Some(end) = self.buf.find(CLOSE) else {
                    // Anything else before the closing tag is ignored.
                    let keep = held_prefix(&self.buf, CLOSE);
                    self.buf.drain(..self.buf.len() - keep);
                    return false;
                };
                self.buf.drain(..end + CLOSE.len());
                self.state = State::Text;
                true
            }
        }
    }

    fn step_text(&mut self, out: &mut Vec<Delta>) -> bool {
        if let Some(i) = self.buf.find(OPEN) {
            let before = self.buf[..i].to_string();
            self.buf.drain(..i + OPEN.len());
            // Content directly before a call loses its trailing whitespace.
            let mut s = std::mem::take(&mut self.pending_ws);
            s.push_str(&before);
            push_content(out, s.trim_end().to_string());
            self.state = State::CallStart;
            return true;
        }
        let keep = held_prefix(&self.buf, OPEN);
        let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
        let mut s = std::mem::take(&mut self.pending_ws);
        s.push_str(&ready);
        let body = s.trim_end().len();
        self.pending_ws = s[body..].to_string();
        s.truncate(body);
        push_content(out, s);
        false
    }

    fn step_xml_params(&mut self, index: usize, any: bool, out: &mut Vec<Delta>) -> bool {
        let t = self.buf.trim_start();
        if let Some(after) = t.strip_prefix(PARAMETER) {
            let Some(gt) = after.find('>') else {
                return false;
            };
            let Some(end) = after[gt + 1..].find(END_PARAMETER) else {
                return false;
            };
            let pname = after[..gt].trim().to_string();
            let raw = &after[gt + 1..gt + 1 + end];
            let value = self.typed_value(index, &pname, raw);
            let frag = format!(
                "{}{}:{}",
                if any { "," } else { "{" },
                Json::from(pname),
                value
            );
            self.buf = after[gt + 1 + end + END_PARAMETER.len()..].to_string();
            self.args(index, &frag, out);
            self.state = State::XmlParams { index, any: true };
            return true;
        }
        let closing = [END_FUNCTION, CLOSE]
            .into_iter()
            .find(|tag| t.starts_with(tag));
        if let Some(tag) = closing {
            self.buf = t[tag.len()..].to_string();
            self.args(index, if any { "}" } else { "{}" }, out);
            // Without `</function>` the call is complete at `</tool_call>`.
            self.state = if tag == CLOSE {
                State::Text
            } else {
                State::XmlEnd
            };
            return true;
        }
        if t.is_empty()
            || [PARAMETER, END_FUNCTION, CLOSE]
                .iter()
                .any(|tag| tag.starts_with(t))
        {
            return false;
        }
        // Stray text between parameters: skip to the next tag.
        let first = t.chars().next().map_or(1, char::len_utf8);
        let skip = self.buf.len() - t.len() + t[first..].find('<').map_or(t.len(), |i| i + first);
        self.buf.drain(..skip);
        true
    }

    fn start_call(&mut self, name: String, out: &mut Vec<Delta>) -> usize {
        let index = self.calls.len();
        let id = (self.next_id)();
        out.push(Delta::CallStart {
            index,
            id: id.clone(),
            name: name.clone(),
        });
        self.calls.push(ToolCall {
            id,
            name,
            arguments: String::new(),
        });
        index
    }

    fn args(&mut self, index: usize, fragment: &str, out: &mut Vec<Delta>) {
        self.calls[index].arguments.push_str(fragment);
        out.push(Delta::CallArgs {
            index,
            fragment: fragment.to_string(),
        });
    }

    /// Streams what the JSON call in `buf[..limit]` allows: its name once
    /// complete, then the text of its `arguments` object as it arrives.
    fn json_progress(
        &mut self,
        js: Option<JsonStream>,
        limit: usize,
        out: &mut Vec<Delta>,
    ) -> Option<JsonStream> {
        let mut js = match js {
            Some(j) => j,
            None => {
                let name = json_name(&self.buf[..limit])?;
                let index = self.start_call(name, out);
                JsonStream {
                    index,
                    args: ArgsScan::Seeking,
                }
            }
        };
        if let ArgsScan::Seeking = js.args {
            match json_args_start(&self.buf[..limit]) {
                Some(Some(pos)) => {
                    js.args = ArgsScan::Object {
                        scanned: pos,
                        depth: 0,
                        arrays: 0,
                        in_str: false,
                        esc: false,
                    }
                }
                Some(None) => js.args = ArgsScan::Other,
                None => {}
            }
        }
        if let ArgsScan::Object {
            mut scanned,
            mut depth,
            mut arrays,
            mut in_str,
            mut esc,
        } = js.args
        {
            let start = scanned;
            let bytes = self.buf.as_bytes();
            let mut done = false;
            while scanned < limit {
                let b = bytes[scanned];
                scanned += 1;
                if in_str {
                    if esc {
                        esc = false;
                    } else if b == b'\\' {
                        esc = true;
                    } else if b == b'"' {
                        in_str = false;
                    }
                } else {
                    match b {
                        b'"' => in_str = true,
                        b'{' | b'[' => {
                            if depth < 64 {
                                arrays = (arrays & !(1 << depth)) | (u64::from(b == b'[') << depth);
                            }
                            depth += 1;
                        }
                        b'}' | b']' => {
                            depth = depth.saturating_sub(1);
                            if depth == 0 {
                                done = true;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
            }
            // Cuts fall after an ASCII brace or at the end of pushed text:
            // character boundaries.
            if scanned > start {
                let fragment = self.buf[start..scanned].to_string();
                self.args(js.index, &fragment, out);
            }
            js.args = if done {
                ArgsScan::Done
            } else {
                ArgsScan::Object {
                    scanned,
                    depth,
                    arrays,
                    in_str,
                    esc,
                }
            };
        }
        Some(js)
    }

    /// The JSON call `body` is over (`closed`: by its tag): finish what was
    /// streamed, or parse it whole; unparseable, it is content.
    fn end_json_call(
        &mut self,
        js: Option<JsonStream>,
        body: &str,
        closed: bool,
        out: &mut Vec<Delta>,
    ) {
        let Some(j) = js else {
            match json_call(body) {
                Some((name, args)) => {
                    let index = self.start_call(name, out);
                    self.args(index, &args, out);
                }
                None => {
                    let close = if closed { CLOSE } else { "" };
                    push_content(out, format!("{OPEN}{body}{close}"));
                }
            }
            return;
        };
        match j.args {
            ArgsScan::Done => {}
            ArgsScan::Seeking | ArgsScan::Other => {
                let args = json_call(body).map_or_else(|| "{}".to_string(), |(_, a)| a);
                self.args(j.index, &args, out);
            }
            ArgsScan::Object {
                depth,
                arrays,
                in_str,
                ..
            } => {
                // Cut short: close the open string, arrays and objects.
                let mut tail = String::new();
                if in_str {
                    tail.push('"');
                }
                for level in (0..depth).rev() {
                    let array = level < 64 && arrays & (1 << level) != 0;
                    tail.push(if array { ']' } else { '}' });
                }
                self.args(j.index, &tail, out);
            }
        }
    }

    /// An XML parameter value as JSON: a string where the schema says so,
    /// else the value parsed as JSON when it is valid JSON, else a string.
    fn typed_value(&self, index: usize, param: &str, raw: &str) -> String {
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let ty = self
            .schemas
            .get(&self.calls[index].name)
            .and_then(|p| p.get(param));
        let is_string = match ty {
            Some(Json::String(t)) => t == "string",
            Some(Json::Array(ts)) => ts.iter().all(|t| t == "string"),
            _ => false,
        };
        if !is_string {
            if let Ok(v) = serde_json::from_str::<Json>(raw.trim()) {
                return v.to_string();
            }
        }
        Json::from(raw).to_string()
    }
}

/// `{"name": .., "arguments": {..}}` (or `parameters`; arguments given as a
/// JSON string are accepted too) as (name, compact arguments).
fn json_call(body: &str) -> Option<(String, String)> {
    let Ok(Json::Object(obj)) = serde_json::from_str::<Json>(body.trim()) else {
        return None;
    };
    let name = obj.get("name").and_then(Json::as_str)?;
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Json::Null) => Json::Object(Map::new()),
        Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
            Ok(v @ Json::Object(_)) => v,
            _ => return None,
        },
        Some(v @ Json::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some((name.to_string(), args.to_string()))
}

/// The call's name once `"name": "..."` is complete in a body that starts
/// as an object, and comes before `"arguments"` (else a `"name"` inside
/// the arguments could be taken for it).
fn json_name(body: &str) -> Option<String> {
    let t = body.trim_start();
    if !t.starts_with('{') {
        return None;
    }
    let k = t.find("\"name\"")?;
    if t.find("\"arguments\"").is_some_and(|a| a < k) {
        return None;
    }
    let rest = t[k + 6..].trim_start().strip_prefix(':')?.trim_start();
    if !rest.starts_with('"') {
        return None;
    }
    let mut esc = false;
    for (i, b) in rest.bytes().enumerate().skip(1) {
        if esc {
            esc = false;
        } else if b == b'\\' {
            esc = true;
        } else if b == b'"' {
            return serde_json::from_str(&rest[..=i]).ok();
        }
    }
    None
}

/// Where the `arguments` object starts: `Some(Some(pos))`; `Some(None)`
/// when the arguments are not an object; `None` when not known yet.
fn json_args_start(body: &str) -> Option<Option<usize>> {
    let (k, key) = ["\"arguments\"", "\"parameters\""]
        .iter()
        .filter_map(|key| body.find(key).map(|k| (k, key.len())))
        .min()?;
    let t = body[k + key..].trim_start();
    if t.is_empty() {
        return None;
    }
    let Some(t) = t.strip_prefix(':') else {
        return Some(None);
    };
    let t = t.trim_start();
    match t.chars().next() {
        None => None,
        Some('{') => Some(Some(body.len() - t.len())),
        Some(_) => Some(None),
    }
}

fn push_content(out: &mut Vec<Delta>, s: String) {
    if s.is_empty() {
        return;
    }
    // Merge with a directly preceding content delta.
    if let Some(Delta::Content(prev)) = out.last_mut() {
        prev.push_str(&s);
    } else {
        out.push(Delta::Content(s));
    }
}

/// Length of the longest suffix of `buf` that is a proper prefix of `tag`
/// (text that may still become the tag). Tags are ASCII, so the cut is on
/// a character boundary.
fn held_prefix(buf: &str, tag: &str) -> usize {
    (1..tag.len().min(buf.len() + 1))
        .rev()
        .find(|&k| buf.ends_with(&tag[..k]))
        .unwrap_or(0)
}

/// `{function name: {parameter: JSON-schema type}}` from OpenAI `tools`.
fn schemas(tools: Option<&Json>) -> Schemas {
    let mut out = Schemas::new();
    for tool in tools.and_then(Json::as_array).into_iter().flatten() {
        let f = tool.get("function").unwrap_or(tool);
        let Some(name) = f.get("name").and_then(Json::as_str) else {
            continue;
        };
        let props = f
            .get("parameters")
            .and_then(|p| p.get("properties"))
            .and_then(Json::as_object);
        let types = props
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.clone(), v.get("type")?.clone())))
            .collect();
        out.insert(name.to_string(), types);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parser(tools: Option<&Json>) -> ToolCallParser {
        let mut n = 0;
        ToolCallParser::new(
            tools,
            Box::new(move || {
                n += 1;
                format!("call_{n}")
            }),
        )
    }

    /// Content and calls assembled from the deltas, as a client would.
    fn assemble(deltas: &[Delta]) -> (String, Vec<(String, String, String)>) {
        let mut content = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for d in deltas {
            match d {
                Delta::Content(s) => content.push_str(s),
                Delta::CallStart { index, id, name } => {
                    assert_eq!(*index, calls.len());
                    calls.push((id.clone(), name.clone(), String::new()));
                }
                Delta::CallArgs { index, fragment } => calls[*index].2.push_str(fragment),
            }
        }
        (content, calls)
    }

    /// Feeds `text` in pieces of `size` bytes (on char boundaries).
    fn run_split(tools: Option<&Json>, text: &str, size: usize) -> Vec<Delta> {
        let mut p = parser(tools);
        let mut out = Vec::new();
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(size) {
            let s: String = piece.iter().collect();
            // A leaked partial tag would show in the assembled content.
            out.extend(p.push(&s));
        }
        out.extend(p.finish());
        // The parser's own record agrees with the stream.
        let (_, calls) = assemble(&out);
        let own: Vec<_> = p
            .calls()
            .iter()
            .map(|c| (c.id.clone(), c.name.clone(), c.arguments.clone()))
            .collect();
        assert_eq!(calls, own);
        out
    }

    /// Every split size gives the same content and calls.
    fn check_all_splits(tools: Option<&Json>, text: &str) -> (String, Vec<(String, String)>) {
        let whole = assemble(&run_split(tools, text, usize::MAX));
        for size in 1..=text.chars().count().min(40) {
            let split = assemble(&run_split(tools, text, size));
            assert_eq!(split, whole, "split size {size}");
        }
        let calls = whole.1.into_iter().map(|(_, n, a)| (n, a)).collect();
        (whole.0, calls)
    }

    fn weather_tools() -> Json {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                           "zip": {"type": "string"}, "opts": {"type": "object"}}}}}])
    }

    #[test]
    fn plain_text_passes_through() {
        let (content, calls) = check_all_splits(None, "Hello <b>world</b> < tool \n");
        assert_eq!(content, "Hello <b>world</b> < tool \n");
        assert!(calls.is_empty());
    }

    #[test]
    fn xml_call_with_typed_parameters() {
        let tools = weather_tools();
        let text = "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=zip>\n75001\n</parameter>\n<parameter=opts>\n{\"metric\": true}\n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = check_all_splits(Some(&tools), text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].0, "get_weather");
        let args: Json = serde_json::from_str(&calls[0].1).unwrap();
        // `zip` is a string in the schema: not turned into a number.
        assert_eq!(
            args,
            json!({"city": "Paris", "days": 3, "zip": "75001", "opts": {"metric": true}})
        );
    }

    #[test]
    fn xml_streams_name_before_parameters() {
        let mut p = parser(None);
        let d = p.push("<tool_call>\n<function=f>\n<parameter=a>\n1");
        assert_eq!(
            d,
            vec![Delta::CallStart {
                index: 0,
                id: "call_1".into(),
                name: "f".into()
            }]
        );
        let d = p.push("\n</parameter>\n");
        assert_eq!(
            d,
            vec![Delta::CallArgs {
                index: 0,
                fragment: "{\"a\":1".into()
            }]
        );
        let d = p.push("</function>\n</tool_call>");
        assert_eq!(
            d,
            vec![Delta::CallArgs {
                index: 0,
                fragment: "}".into()
            }]
        );
        assert!(p.finish().is_empty());
    }

    #[test]
    fn json_calls_several() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"y\\\": [2]}\"}\n</tool_call>\n";
        let (content, calls) = check_all_splits(None, text);
        assert_eq!(content, "");
        // Object arguments stream as written; string arguments are parsed.
        assert_eq!(
            calls,
            vec![
                ("a".to_string(), "{\"x\": 1}".to_string()),
                ("b".to_string(), "{\"y\":[2]}".to_string())
            ]
        );
    }

    #[test]
    fn stray_text_inside_a_call_is_skipped() {
        let text = "<tool_call>\n<function=f>\nétoile ☃ junk <parameter=a>\n1\n</parameter>\n☃</function>\n</tool_call>";
        let (content, calls) = check_all_splits(None, text);
        assert_eq!(content, "");
        assert_eq!(calls, vec![("f".to_string(), "{\"a\":1}".to_string())]);
    }

    #[test]
    fn xml_without_arguments_and_without_end_function() {
        let (_, calls) = check_all_splits(None, "<tool_call>\n<function=now>\n</tool_call>");
        assert_eq!(calls, vec![("now".to_string(), "{}".to_string())]);
    }

    #[test]
    fn malformed_json_call_is_returned_as_content() {
        let text = "x <tool_call>{not json}</tool_call> y";
        let (content, calls) = check_all_splits(None, text);
        assert!(calls.is_empty());
        assert_eq!(content, "x<tool_call>{not json}</tool_call> y");
    }

    #[test]
    fn unfinished_calls_at_the_end() {
        // Truncated JSON calls: the name was out, so a call, with what
        // its arguments had (closed); before the name, content.
        let (content, calls) = check_all_splits(None, "<tool_call>\n{\"name\": \"a\", \"argu");
        assert_eq!(content, "");
        assert_eq!(calls, vec![("a".to_string(), "{}".to_string())]);
        let (_, calls) = check_all_splits(
            None,
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": \"}",
        );
        assert_eq!(calls[0].1, "{\"x\": [1, {\"y\": \"}\"}]}");
        serde_json::from_str::<Json>(&calls[0].1).unwrap();
        let (content, calls) = check_all_splits(None, "<tool_call>\n{\"na");
        assert!(calls.is_empty());
        assert_eq!(content, "<tool_call>\n{\"na");
        // Truncated XML call: closed with the finished parameters.
        let (_, calls) = check_all_splits(
            None,
            "<tool_call>\n<function=f>\n<parameter=a>\nv\n</parameter>\n<parameter=b>\nw",
        );
        assert_eq!(calls, vec![("f".to_string(), "{\"a\":\"v\"}".to_string())]);
        // A held partial tag at the end is content after all.
        let (content, _) = check_all_splits(None, "see <tool_ca");
        assert_eq!(content, "see <tool_ca");
    }

    #[test]
    fn forced_prefixes_parse_as_calls() {
        for format in [ToolFormat::Xml, ToolFormat::Json] {
            let mut p = parser(None);
            let mut d = p.push(&format.forced_prefix(Some("f")));
            let rest = match format {
                ToolFormat::Xml => "<parameter=q>\nhi\n</parameter>\n</function>\n</tool_call>",
                ToolFormat::Json => "{\"q\": \"hi\"}}\n</tool_call>",
            };
            d.extend(p.push(rest));
            d.extend(p.finish());
            let (content, calls) = assemble(&d);
            assert_eq!(content, "");
            assert_eq!(calls.len(), 1, "{format:?}");
            assert_eq!(calls[0].1, "f");
            let args: Json = serde_json::from_str(&calls[0].2).unwrap();
            assert_eq!(args, serde_json::json!({"q": "hi"}));
        }
    }

    #[test]
    fn json_call_streams_name_then_arguments() {
        let mut p = parser(None);
        let d = p.push("<tool_call>\n{\"name\": \"get_w");
        assert!(d.is_empty());
        let d = p.push("eather\", \"arguments\": {\"city\": \"Pa");
        assert_eq!(
            d,
            vec![
                Delta::CallStart {
                    index: 0,
                    id: "call_1".into(),
                    name: "get_weather".into()
                },
                Delta::CallArgs {
                    index: 0,
                    fragment: "{\"city\": \"Pa".into()
                }
            ]
        );
        // Braces inside strings do not end the object.
        let d = p.push("ris }\"}}\n</tool_call>");
        assert_eq!(
            d,
            vec![Delta::CallArgs {
                index: 0,
                fragment: "ris }\"}".into()
            }]
        );
        assert_eq!(p.calls()[0].arguments, "{\"city\": \"Paris }\"}");
        // Arguments before the name: sent whole at the end.
        let (_, calls) = check_all_splits(
            None,
            "<tool_call>{\"arguments\": {\"name\": 1}, \"name\": \"f\"}</tool_call>",
        );
        assert_eq!(calls, vec![("f".to_string(), "{\"name\":1}".to_string())]);
    }

    #[test]
    fn detects_template_formats() {
        assert_eq!(ToolFormat::detect("{{ messages }}"), None);
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tool_call>\n<function=x>{% endif %}"),
            Some(ToolFormat::Xml)
        );
        assert_eq!(
            ToolFormat::detect("{% if tools %}<tool_call>{\"name\": ...}{% endif %}"),
            Some(ToolFormat::Json)
        );
    }
}
