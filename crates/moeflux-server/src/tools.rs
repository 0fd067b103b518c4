//! Tool calls: parsing the model's tool-call output back into OpenAI
//! `tool_calls`, incrementally, and forcing a call for `tool_choice`.
//!
//! Five spellings are understood, whatever the template is:
//!
//! - **XML** (Qwen3.5 / Qwen3-Coder templates), inside
//!   `<tool_call>...</tool_call>`:
//!   `<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>`;
//!   values are raw text, typed through the tool's JSON schema.
//! - **JSON** (Qwen3 / Hermes templates): `<tool_call>{"name": ..,
//!   "arguments": {..}}</tool_call>`.
//! - **GLM** (GLM-4.5 / 4.6 templates): `<tool_call>NAME\n<arg_key>ARG</arg_key>\n
//!   <arg_value>VALUE</arg_value>\n...</tool_call>`; values are raw text (JSON
//!   for non-strings), typed through the schema like the XML ones.
//! - **Kimi** (Kimi K2 templates): `<|tool_calls_section_begin|>` then, per
//!   call, `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
//!   {JSON}<|tool_call_end|>`, then `<|tool_calls_section_end|>`; the call's
//!   id is the model's `functions.NAME:IDX`.
//! - **Harmony** (gpt-oss): `<|channel|>commentary to=functions.NAME
//!   <|constrain|>json<|message|>{JSON}<|call|>` (the header words in any
//!   order). The generation's decoder hides harmony's other markup and
//!   passes a call on in this spelling (`moeflux::text::harmony`).
//!
//! Inside `<tool_call>` the parser decides per call from what follows the
//! tag: `{` is JSON, `<function=` XML, a function name GLM. Text before a
//! call streams as content; a tail that may still grow into an opening tag
//! is held back so partial tags never leak; whitespace between content and
//! a call is dropped. Calls stream as OpenAI deltas: the name as soon as it
//! is complete, then the arguments — XML and GLM one fragment per finished
//! parameter, JSON, Kimi and Harmony as the argument object's text arrives (a JSON
//! call whose name comes after its arguments, or whose arguments are a
//! string, is sent whole at the end). A JSON or Kimi call that cannot be
//! parsed, or a harmony header without a recipient, is returned as
//! content, so no text is lost.

use std::collections::HashMap;

use moeflux::text::harmony::{
    self, CALL as HARMONY_CALL, CHANNEL as HARMONY, MESSAGE as HARMONY_MESSAGE,
};
use serde_json::{Map, Value as Json};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const END_FUNCTION: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const END_PARAMETER: &str = "</parameter>";
const ARG_KEY: &str = "<arg_key>";
const END_ARG_KEY: &str = "</arg_key>";
const ARG_VALUE: &str = "<arg_value>";
const END_ARG_VALUE: &str = "</arg_value>";
const KIMI_SECTION: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_CALL: &str = "<|tool_call_begin|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
/// What opens tool calls in text.
const OPENERS: [&str; 3] = [OPEN, KIMI_SECTION, HARMONY];
/// A harmony header longer than this without `<|message|>` is not one.
const MAX_HARMONY_HEADER: usize = 256;

/// How a chat template asks the model to write tool calls (decides what a
/// forced call starts with; parsing accepts every spelling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n<function=NAME>\n<parameter=..>` (Qwen3.5, Qwen3-Coder).
    Xml,
    /// `<tool_call>\n{"name": .., "arguments": ..}` (Qwen3, Hermes).
    Json,
    /// `<tool_call>NAME\n<arg_key>..</arg_key>\n<arg_value>..` (GLM-4.5/4.6).
    Glm,
    /// `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    /// <|tool_call_argument_begin|>{..}` (Kimi K2).
    Kimi,
    /// `<|channel|>commentary to=functions.NAME <|constrain|>json
    /// <|message|>{..}<|call|>` (gpt-oss's harmony).
    Harmony,
}

impl ToolFormat {
    /// The format a template's source teaches, or `None` when the template
    /// does not render tools at all.
    pub fn detect(template_source: &str) -> Option<ToolFormat> {
        if !template_source.contains("tools") {
            return None;
        }
        if template_source.contains(KIMI_SECTION) {
            return Some(ToolFormat::Kimi);
        }
        if template_source.contains(HARMONY)
            && template_source.contains(HARMONY_CALL)
            && template_source.contains("to=")
        {
            return Some(ToolFormat::Harmony);
        }
        if !template_source.contains(OPEN) {
            return None;
        }
        if template_source.contains(ARG_KEY) {
            Some(ToolFormat::Glm)
        } else if template_source.contains(FUNCTION) {
            Some(ToolFormat::Xml)
        } else {
            Some(ToolFormat::Json)
        }
    }

    /// Text appended to the prompt so that the model's next tokens are the
    /// inside of a tool call (`tool_choice: "required"`), of a call to
    /// `name` when given. The parser is fed it as the start of the answer
    /// (but see [`parser_prefix`](Self::parser_prefix)).
    /// `calls_before`: the tool calls of the conversation so far (Kimi
    /// numbers calls across the conversation: `functions.NAME:IDX`).
    pub fn forced_prefix(self, name: Option<&str>, calls_before: usize) -> String {
        match (self, name) {
            (ToolFormat::Kimi, None) => format!("{KIMI_SECTION}{KIMI_CALL}"),
            (ToolFormat::Kimi, Some(n)) => {
                format!("{KIMI_SECTION}{KIMI_CALL}functions.{n}:{calls_before}{KIMI_ARGS}")
            }
            // The prompt ends `<|start|>assistant`: the call's header
            // (skipping the analysis message the model may write first).
            (ToolFormat::Harmony, None) => format!("{HARMONY}commentary to=functions."),
            (ToolFormat::Harmony, Some(n)) => {
                format!("{HARMONY}commentary to=functions.{n} <|constrain|>json{HARMONY_MESSAGE}")
            }
            (ToolFormat::Glm, None) => OPEN.to_string(),
            (ToolFormat::Glm, Some(n)) => format!("{OPEN}{n}\n"),
            (_, None) => format!("{OPEN}\n"),
            (ToolFormat::Xml, Some(n)) => format!("{OPEN}\n{FUNCTION}{n}>\n"),
            (ToolFormat::Json, Some(n)) => {
                format!("{OPEN}\n{{\"name\": {}, \"arguments\": ", Json::from(n))
            }
        }
    }

    /// What the parser must be fed first for a forced call whose prompt
    /// ends with `forced` ([`forced_prefix`](Self::forced_prefix)): the
    /// same text, but for a harmony call whose name the model is still to
    /// write (the decoder passes on the whole header once it has it).
    pub fn parser_prefix(self, forced: &str, name: Option<&str>) -> Option<String> {
        match (self, name) {
            (ToolFormat::Harmony, None) => None,
            _ => Some(forced.to_string()),
        }
    }

    /// What a prompt (rendered by `template_source`) needs before a forced
    /// call so that the call stands where the model writes one: an open
    /// reasoning block closed, or the empty one these templates write
    /// before an answer that does not think.
    pub fn before_forced_call(self, prompt: &str, template_source: &str) -> &'static str {
        let p = prompt.trim_end();
        let open_think = p.ends_with("<think>");
        match self {
            ToolFormat::Xml | ToolFormat::Json if open_think => "\n</think>\n\n",
            ToolFormat::Xml | ToolFormat::Json => "",
            // GLM-4.5/4.6 answers start `\n<think>...</think>\n`; a prompt
            // with thinking off ends in the empty block already.
            ToolFormat::Glm if open_think => "</think>\n",
            ToolFormat::Glm if p.ends_with("</think>") => "\n",
            ToolFormat::Glm => "\n<think></think>\n",
            // Kimi K2.5 opens `<think>` in the prompt; K2-Thinking writes
            // `<think></think>` before an answer without reasoning.
            ToolFormat::Kimi if open_think => "</think>",
            ToolFormat::Kimi if template_source.contains("<think></think>") => "<think></think>",
            ToolFormat::Kimi => "",
            // The prompt ends `<|start|>assistant`, where a header goes.
            ToolFormat::Harmony => "",
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
    /// GLM spelling after the name: `<arg_key>`/`<arg_value>` pairs.
    GlmArgs {
        index: usize,
        any: bool,
    },
    /// Kimi spelling: inside the tool-calls section, between calls.
    KimiSection,
    /// Kimi spelling: after `<|tool_call_begin|>`, before the arguments.
    KimiCall,
    /// Kimi spelling: a call's JSON arguments streaming.
    KimiArgs(JsonStream),
    /// Harmony spelling: after `<|channel|>`, before `<|message|>`.
    HarmonyHeader,
    /// Harmony spelling: a call's JSON arguments streaming, up to `<|call|>`.
    HarmonyArgs(JsonStream),
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

    /// The generation ended: flush what is held back. An unfinished XML or
    /// GLM call is closed with the parameters it has, a JSON or Kimi call
    /// whose name was out with the arguments it has (open strings, arrays
    /// and objects closed); anything less is content.
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
            State::XmlParams { index, any } | State::GlmArgs { index, any } => {
                // Parameters finished so far are in; close the object.
                self.args(index, if any { "}" } else { "{}" }, &mut out);
            }
            State::XmlEnd | State::KimiSection => {}
            State::KimiCall => push_content(&mut out, format!("{KIMI_CALL}{rest}")),
            State::KimiArgs(JsonStream {
                index,
                args: ArgsScan::Seeking | ArgsScan::Other,
            })
            | State::HarmonyArgs(JsonStream {
                index,
                args: ArgsScan::Seeking | ArgsScan::Other,
            }) => self.args(index, &kimi_args(&rest), &mut out),
            State::KimiArgs(js) | State::HarmonyArgs(js) => self.close_args(js, &mut out),
            State::HarmonyHeader => push_content(&mut out, format!("{HARMONY}{rest}")),
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
                } else if let Some(end) = t.find(['\n', '<']) {
                    let name = t[..end].trim_end();
                    if !is_name(name) {
                        // No spelling: treat as JSON (parsed, or returned
                        // as text at the closing tag).
                        self.state = State::Json(None);
                        return true;
                    }
                    // GLM: the name, then its arguments.
                    let name = name.to_string();
                    self.buf = t[end..].to_string();
                    let index = self.start_call(name, out);
                    self.state = State::GlmArgs { index, any: false };
                    true
                } else if is_name(t.trim_end()) {
                    // A GLM name may be on its way.
                    false
                } else {
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
            State::GlmArgs { index, any } => self.step_glm_args(index, any, out),
            State::KimiSection => self.step_kimi_section(),
            State::KimiCall => self.step_kimi_call(out),
            State::KimiArgs(js) => self.step_json_args(js, KIMI_CALL_END, out),
            State::HarmonyHeader => self.step_harmony_header(out),
            State::HarmonyArgs(js) => self.step_json_args(js, HARMONY_CALL, out),
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
        let opener = OPENERS
            .iter()
            .filter_map(|tag| self.buf.find(tag).map(|i| (i, *tag)))
            .min();
        if let Some((i, tag)) = opener {
            let before = self.buf[..i].to_string();
            self.buf.drain(..i + tag.len());
            // Content directly before a call loses its trailing whitespace.
            let mut s = std::mem::take(&mut self.pending_ws);
            s.push_str(&before);
            push_content(out, s.trim_end().to_string());
            self.state = match tag {
                OPEN => State::CallStart,
                KIMI_SECTION => State::KimiSection,
                _ => State::HarmonyHeader,
            };
            return true;
        }
        let keep = OPENERS
            .iter()
            .map(|tag| held_prefix(&self.buf, tag))
            .max()
            .unwrap_or(0);
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
            let value = self.typed_value(index, &pname, raw, true);
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
        let id = (self.next_id)();
        self.start_call_with_id(id, name, out)
    }

    fn start_call_with_id(&mut self, id: String, name: String, out: &mut Vec<Delta>) -> usize {
        let index = self.calls.len();
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
            ArgsScan::Seeking | ArgsScan::Other => {
                let args = json_call(body).map_or_else(|| "{}".to_string(), |(_, a)| a);
                self.args(j.index, &args, out);
            }
            _ => self.close_args(j, out),
        }
    }

    /// A streamed arguments object is over: complete it if it was cut
    /// short (the open string, arrays and objects closed); `{}` if it never
    /// started.
    fn close_args(&mut self, j: JsonStream, out: &mut Vec<Delta>) {
        match j.args {
            ArgsScan::Done => {}
            ArgsScan::Seeking | ArgsScan::Other => self.args(j.index, "{}", out),
            ArgsScan::Object { depth: 0, .. } => self.args(j.index, "{}", out),
            ArgsScan::Object {
                depth,
                arrays,
                in_str,
                ..
            } => {
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

    /// GLM spelling after the name: the next `<arg_key>K</arg_key>
    /// <arg_value>V</arg_value>` pair, or the closing tag.
    fn step_glm_args(&mut self, index: usize, any: bool, out: &mut Vec<Delta>) -> bool {
        let t = self.buf.trim_start();
        if let Some(after) = t.strip_prefix(ARG_KEY) {
            let Some(kend) = after.find(END_ARG_KEY) else {
                return false;
            };
            let key = after[..kend].trim().to_string();
            let rest = &after[kend + END_ARG_KEY.len()..];
            let r = rest.trim_start();
            let Some(vstart) = r.strip_prefix(ARG_VALUE) else {
                if r.is_empty() || ARG_VALUE.starts_with(r) {
                    return false;
                }
                // A key without a value: skip it.
                self.buf = rest.to_string();
                return true;
            };
            let Some(vend) = vstart.find(END_ARG_VALUE) else {
                return false;
            };
            let value = self.typed_value(index, &key, &vstart[..vend], false);
            let frag = format!(
                "{}{}:{}",
                if any { "," } else { "{" },
                Json::from(key),
                value
            );
            self.buf = vstart[vend + END_ARG_VALUE.len()..].to_string();
            self.args(index, &frag, out);
            self.state = State::GlmArgs { index, any: true };
            return true;
        }
        if let Some(rest) = t.strip_prefix(CLOSE) {
            self.buf = rest.to_string();
            self.args(index, if any { "}" } else { "{}" }, out);
            self.state = State::Text;
            return true;
        }
        if t.is_empty() || [ARG_KEY, CLOSE].iter().any(|tag| tag.starts_with(t)) {
            return false;
        }
        // Stray text between parameters: skip to the next tag.
        let first = t.chars().next().map_or(1, char::len_utf8);
        let skip = self.buf.len() - t.len() + t[first..].find('<').map_or(t.len(), |i| i + first);
        self.buf.drain(..skip);
        true
    }

    /// Kimi spelling between calls: the next call, or the section's end.
    fn step_kimi_section(&mut self) -> bool {
        let t = self.buf.trim_start();
        for (tag, next) in [
            (KIMI_CALL, State::KimiCall),
            (KIMI_SECTION_END, State::Text),
        ] {
            if let Some(rest) = t.strip_prefix(tag) {
                self.buf = rest.to_string();
                self.state = next;
                return true;
            }
        }
        if t.is_empty()
            || [KIMI_CALL, KIMI_SECTION_END]
                .iter()
                .any(|tag| tag.starts_with(t))
        {
            return false;
        }
        // Stray text inside the section: skip to the next tag.
        let first = t.chars().next().map_or(1, char::len_utf8);
        let skip = self.buf.len() - t.len() + t[first..].find('<').map_or(t.len(), |i| i + first);
        self.buf.drain(..skip);
        true
    }

    /// Kimi spelling after `<|tool_call_begin|>`: the call's id up to
    /// `<|tool_call_argument_begin|>`. A call whose id names no function,
    /// or that has no arguments tag, is content.
    fn step_kimi_call(&mut self, out: &mut Vec<Delta>) -> bool {
        let end = self.buf.find(KIMI_CALL_END);
        let a = self
            .buf
            .find(KIMI_ARGS)
            .filter(|&a| end.is_none_or(|e| a < e));
        let name = a.and_then(|a| kimi_name(self.buf[..a].trim()).map(str::to_string));
        let (Some(a), Some(name)) = (a, name) else {
            // Not a call: content once it is over.
            let Some(end) = end else {
                return false;
            };
            let raw: String = self.buf.drain(..end + KIMI_CALL_END.len()).collect();
            push_content(out, format!("{KIMI_CALL}{raw}"));
            self.state = State::KimiSection;
            return true;
        };
        let id = self.buf[..a].trim().to_string();
        self.buf.drain(..a + KIMI_ARGS.len());
        let index = self.start_call_with_id(id, name, out);
        self.state = State::KimiArgs(JsonStream {
            index,
            args: ArgsScan::Seeking,
        });
        true
    }

    /// Harmony spelling after `<|channel|>`: the header up to `<|message|>`;
    /// with a recipient (`to=functions.NAME`) it starts a call, else it is
    /// content.
    fn step_harmony_header(&mut self, out: &mut Vec<Delta>) -> bool {
        let Some(end) = self.buf.find(HARMONY_MESSAGE) else {
            if self.buf.len() > MAX_HARMONY_HEADER {
                push_content(out, HARMONY.to_string());
                self.state = State::Text;
                return true;
            }
            return false;
        };
        let header = format!("{HARMONY}{}", &self.buf[..end]);
        let name = harmony::parse_header(&header)
            .1
            .map(|r| r.strip_prefix("functions.").unwrap_or(r).to_string())
            .filter(|n| !n.is_empty());
        self.buf.drain(..end + HARMONY_MESSAGE.len());
        let Some(name) = name else {
            push_content(out, format!("{header}{HARMONY_MESSAGE}"));
            self.state = State::Text;
            return true;
        };
        let index = self.start_call(name, out);
        self.state = State::HarmonyArgs(JsonStream {
            index,
            args: ArgsScan::Seeking,
        });
        true
    }

    /// Kimi and Harmony spellings: a call's arguments up to `end_tag`
    /// (`<|tool_call_end|>`, `<|call|>`), streamed as the object's text
    /// arrives. Arguments that are not an object are parsed whole at the
    /// end (a JSON string holding an object is accepted), else `{}`.
    fn step_json_args(&mut self, mut js: JsonStream, end_tag: &str, out: &mut Vec<Delta>) -> bool {
        let kimi = end_tag == KIMI_CALL_END;
        let waiting = |js| {
            if kimi {
                State::KimiArgs(js)
            } else {
                State::HarmonyArgs(js)
            }
        };
        let next = || {
            if kimi {
                State::KimiSection
            } else {
                State::Text
            }
        };
        let close = self.buf.find(end_tag);
        if let ArgsScan::Seeking = js.args {
            let t = self.buf.trim_start();
            match t.chars().next() {
                None if close.is_none() => return false,
                Some('{') => {
                    js.args = ArgsScan::Object {
                        scanned: self.buf.len() - t.len(),
                        depth: 0,
                        arrays: 0,
                        in_str: false,
                        esc: false,
                    }
                }
                _ => js.args = ArgsScan::Other,
            }
        }
        if let ArgsScan::Other = js.args {
            let Some(end) = close else {
                self.state = waiting(js);
                return false;
            };
            let args = kimi_args(&self.buf[..end]);
            self.args(js.index, &args, out);
            self.buf.drain(..end + end_tag.len());
            self.state = next();
            return true;
        }
        let limit = close.unwrap_or_else(|| self.buf.len() - held_prefix(&self.buf, end_tag));
        let js = self
            .json_progress(Some(js), limit, out)
            .expect("a started call");
        let Some(end) = close else {
            self.state = waiting(js);
            return false;
        };
        self.close_args(js, out);
        self.buf.drain(..end + end_tag.len());
        self.state = next();
        true
    }

    /// An XML or GLM parameter value as JSON: a string where the schema
    /// says so, else the value parsed as JSON when it is valid JSON, else a
    /// string. `strip`: the XML spelling's newline after the opening tag and
    /// before the closing one are not part of the value.
    fn typed_value(&self, index: usize, param: &str, raw: &str, strip: bool) -> String {
        let mut raw = raw;
        if strip {
            raw = raw.strip_prefix('\n').unwrap_or(raw);
            raw = raw.strip_suffix('\n').unwrap_or(raw);
        }
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

/// A function name as the GLM spelling writes it after `<tool_call>`: no
/// spaces or markup (letters, digits, `_`, `-`, `.`, `:`, `/`).
fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':' | '/'))
}

/// The function name in a Kimi call id, `functions.NAME:IDX` (or `NAME:IDX`,
/// or `NAME`).
fn kimi_name(id: &str) -> Option<&str> {
    let name = id.strip_prefix("functions.").unwrap_or(id);
    let name = match name.rsplit_once(':') {
        Some((n, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => name,
    };
    is_name(name).then_some(name)
}

/// Kimi arguments that did not stream as an object: a JSON object, or a
/// JSON string holding one, compact; else `{}`.
fn kimi_args(body: &str) -> String {
    let v = match serde_json::from_str::<Json>(body.trim()) {
        Ok(Json::String(s)) => serde_json::from_str::<Json>(&s).ok(),
        other => other.ok(),
    };
    match v {
        Some(v @ Json::Object(_)) => v.to_string(),
        _ => "{}".to_string(),
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
        for format in [
            ToolFormat::Xml,
            ToolFormat::Json,
            ToolFormat::Glm,
            ToolFormat::Kimi,
            ToolFormat::Harmony,
        ] {
            let mut p = parser(None);
            let mut d = p.push(&format.forced_prefix(Some("f"), 3));
            let rest = match format {
                ToolFormat::Xml => "<parameter=q>\nhi\n</parameter>\n</function>\n</tool_call>",
                ToolFormat::Json => "{\"q\": \"hi\"}}\n</tool_call>",
                ToolFormat::Glm => "<arg_key>q</arg_key>\n<arg_value>hi</arg_value>\n</tool_call>",
                ToolFormat::Kimi => "{\"q\": \"hi\"}<|tool_call_end|><|tool_calls_section_end|>",
                ToolFormat::Harmony => "{\"q\": \"hi\"}<|call|>",
            };
            d.extend(p.push(rest));
            d.extend(p.finish());
            let (content, calls) = assemble(&d);
            assert_eq!(content, "");
            assert_eq!(calls.len(), 1, "{format:?}");
            assert_eq!(calls[0].1, "f");
            let args: Json = serde_json::from_str(&calls[0].2).unwrap();
            assert_eq!(args, serde_json::json!({"q": "hi"}));
            if format == ToolFormat::Kimi {
                assert_eq!(calls[0].0, "functions.f:3");
            }
            // The call is out before the model writes anything (XML, GLM,
            // Kimi: arguments `{}` if it writes nothing useful).
            if format != ToolFormat::Json {
                let mut p = parser(None);
                let mut d = p.push(&format.forced_prefix(Some("f"), 0));
                d.extend(p.push("ünparseable"));
                d.extend(p.finish());
                let (content, calls) = assemble(&d);
                assert_eq!(content, "", "{format:?}");
                assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), ("f", "{}"));
            }
            // Without a name: the model writes it.
            let mut p = parser(None);
            let open = format.forced_prefix(None, 0);
            let mut d = match format.parser_prefix(&open, None) {
                Some(f) => p.push(&f),
                None => Vec::new(),
            };
            let rest = match format {
                ToolFormat::Xml => "<function=g>\n</function>\n</tool_call>",
                ToolFormat::Json => "{\"name\": \"g\"}\n</tool_call>",
                ToolFormat::Glm => "g\n</tool_call>",
                ToolFormat::Kimi => "functions.g:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
                // The decoder passes on the header it completed.
                ToolFormat::Harmony => "<|channel|>commentary to=functions.g<|message|>{}<|call|>",
            };
            d.extend(p.push(rest));
            d.extend(p.finish());
            let (content, calls) = assemble(&d);
            assert_eq!(content, "", "{format:?}");
            assert_eq!(calls.len(), 1, "{format:?}");
            assert_eq!((calls[0].1.as_str(), calls[0].2.as_str()), ("g", "{}"));
        }
    }

    #[test]
    fn glm_calls_with_typed_arguments() {
        let tools = weather_tools();
        // As the GLM-4.5 template writes calls (tests/fixtures/templates).
        let text = "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"langs\": [\"de\", \"fr\"], \"metric\": true}</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>";
        let (content, calls) = check_all_splits(Some(&tools), text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].0, "get_weather");
        let args: Json = serde_json::from_str(&calls[0].1).unwrap();
        assert_eq!(
            args,
            json!({"city": "Zürich", "days": 2, "zip": "75001",
                   "opts": {"langs": ["de", "fr"], "metric": true}})
        );
        assert_eq!(calls[1], ("now".to_string(), "{}".to_string()));
        // String values are raw text: newlines and markup-free `<` kept.
        let (_, calls) = check_all_splits(
            Some(&tools),
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>\nNew\nYork < 3 \n</arg_value>\n</tool_call>",
        );
        assert_eq!(calls[0].1, "{\"city\":\"\\nNew\\nYork < 3 \\n\"}");
        // The compact spelling (GLM-4.7), text after the calls.
        let (content, calls) = check_all_splits(
            None,
            "<tool_call>f<arg_key>a</arg_key><arg_value>[1, 2]</arg_value><arg_key>b</arg_key><arg_value>x y</arg_value></tool_call> done",
        );
        assert_eq!(content, " done");
        assert_eq!(
            calls,
            vec![("f".to_string(), "{\"a\":[1,2],\"b\":\"x y\"}".to_string())]
        );
    }

    #[test]
    fn glm_streams_name_then_each_argument() {
        let mut p = parser(None);
        assert!(p.push("<tool_call>get_wea").is_empty());
        let d = p.push("ther\n<arg_key>city</arg_key>\n<arg_value>Pa");
        assert_eq!(
            d,
            vec![Delta::CallStart {
                index: 0,
                id: "call_1".into(),
                name: "get_weather".into()
            }]
        );
        let d = p.push("ris</arg_value>\n");
        assert_eq!(
            d,
            vec![Delta::CallArgs {
                index: 0,
                fragment: "{\"city\":\"Paris\"".into()
            }]
        );
        let d = p.push("</tool_call>");
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
    fn glm_malformed_and_unfinished_calls() {
        // Not a function name: the text is content.
        let (content, calls) = check_all_splits(None, "a <tool_call>not a name</tool_call> b");
        assert!(calls.is_empty());
        assert_eq!(content, "a<tool_call>not a name</tool_call> b");
        // Cut off inside the name: content.
        let (content, calls) = check_all_splits(None, "<tool_call>get_wea");
        assert!(calls.is_empty());
        assert_eq!(content, "<tool_call>get_wea");
        // Cut off inside an argument: the finished ones.
        let (_, calls) = check_all_splits(
            None,
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n<arg_value>unfin",
        );
        assert_eq!(calls, vec![("f".to_string(), "{\"a\":1}".to_string())]);
        // Stray text and a key without a value are skipped.
        let (_, calls) = check_all_splits(
            None,
            "<tool_call>f\njunk ☃ <arg_key>k</arg_key> oops <arg_key>a</arg_key><arg_value>1</arg_value>☃</tool_call>",
        );
        assert_eq!(calls, vec![("f".to_string(), "{\"a\":1}".to_string())]);
    }

    const KIMI: &str = "I'll check. <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Zürich\", \"opts\": {\"t\": \"}<|\"}}<|tool_call_end|><|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";

    #[test]
    fn kimi_calls() {
        let (content, calls) = check_all_splits(None, KIMI);
        assert_eq!(content, "I'll check.");
        assert_eq!(
            calls,
            vec![
                (
                    "get_weather".to_string(),
                    "{\"city\": \"Zürich\", \"opts\": {\"t\": \"}<|\"}}".to_string()
                ),
                ("now".to_string(), "{}".to_string())
            ]
        );
        // The model's ids are the calls' ids.
        let d = run_split(None, KIMI, usize::MAX);
        let ids: Vec<_> = d
            .iter()
            .filter_map(|d| match d {
                Delta::CallStart { id, .. } => Some(id.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(ids, ["functions.get_weather:0", "functions.now:1"]);
        // Text after the section is content; arguments given as a JSON
        // string holding an object are accepted.
        let (content, calls) = check_all_splits(
            None,
            "<|tool_calls_section_begin|>\n<|tool_call_begin|> f:2 <|tool_call_argument_begin|> \"{\\\"a\\\": 1}\" <|tool_call_end|>\n<|tool_calls_section_end|> ok",
        );
        assert_eq!(content, " ok");
        assert_eq!(calls, vec![("f".to_string(), "{\"a\":1}".to_string())]);
    }

    #[test]
    fn kimi_streams_name_then_arguments() {
        let mut p = parser(None);
        assert!(p
            .push("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_arg")
            .is_empty());
        let d = p.push("ument_begin|>{\"city\": \"Pa");
        assert_eq!(
            d,
            vec![
                Delta::CallStart {
                    index: 0,
                    id: "functions.get_weather:0".into(),
                    name: "get_weather".into()
                },
                Delta::CallArgs {
                    index: 0,
                    fragment: "{\"city\": \"Pa".into()
                }
            ]
        );
        // A partial closing tag is held back.
        let d = p.push("ris\"}<|tool_ca");
        assert_eq!(
            d,
            vec![Delta::CallArgs {
                index: 0,
                fragment: "ris\"}".into()
            }]
        );
        assert!(p.push("ll_end|><|tool_calls_section_end|>").is_empty());
        assert!(p.finish().is_empty());
        assert_eq!(p.calls()[0].arguments, "{\"city\": \"Paris\"}");
    }

    #[test]
    fn kimi_malformed_and_unfinished_calls() {
        // No arguments tag: content. Arguments that are not a JSON object
        // after a function's name (as with the JSON spelling): `{}`.
        let bad = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>oops<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_end|><|tool_calls_section_end|>";
        let (content, calls) = check_all_splits(None, bad);
        assert_eq!(calls, vec![("f".to_string(), "{}".to_string())]);
        assert_eq!(content, "<|tool_call_begin|>functions.g:1<|tool_call_end|>");
        // An id that names no function: content.
        let (content, calls) = check_all_splits(
            None,
            "<|tool_calls_section_begin|><|tool_call_begin|>not a name<|tool_call_argument_begin|>{}<|tool_call_end|>",
        );
        assert!(calls.is_empty());
        assert_eq!(
            content,
            "<|tool_call_begin|>not a name<|tool_call_argument_begin|>{}<|tool_call_end|>"
        );
        // Cut off in the arguments: a call, closed.
        let (_, calls) = check_all_splits(
            None,
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": [1, \"x",
        );
        assert_eq!(
            calls,
            vec![("f".to_string(), "{\"a\": [1, \"x\"]}".to_string())]
        );
        serde_json::from_str::<Json>(&calls[0].1).unwrap();
        // Cut off before the arguments' first character: a call; before
        // the arguments tag: content.
        let (_, calls) = check_all_splits(
            None,
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>",
        );
        assert_eq!(calls, vec![("f".to_string(), "{}".to_string())]);
        let (content, calls) = check_all_splits(
            None,
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f",
        );
        assert!(calls.is_empty());
        assert_eq!(content, "<|tool_call_begin|>functions.f");
        // A held partial section tag at the end is content after all.
        let (content, _) = check_all_splits(None, "see <|tool_calls_sec");
        assert_eq!(content, "see <|tool_calls_sec");
    }

    /// The templates of tests/fixtures/templates.
    fn fixture_template(dir: &str) -> String {
        let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/templates")
            .join(dir);
        match std::fs::read_to_string(d.join("chat_template.jinja")) {
            Ok(s) => s,
            Err(_) => {
                let cfg: Json = serde_json::from_str(
                    &std::fs::read_to_string(d.join("tokenizer_config.json")).unwrap(),
                )
                .unwrap();
                cfg["chat_template"].as_str().unwrap().to_string()
            }
        }
    }

    #[test]
    fn detects_the_real_templates() {
        let cases = [
            ("qwen3", Some(ToolFormat::Json)),
            ("qwen3-2507-instruct", Some(ToolFormat::Json)),
            ("qwen3-2507-thinking", Some(ToolFormat::Json)),
            ("qwen3.5", Some(ToolFormat::Xml)),
            ("qwen3-coder", Some(ToolFormat::Xml)),
            ("glm4.5", Some(ToolFormat::Glm)),
            ("kimi-k2", Some(ToolFormat::Kimi)),
            ("kimi-k2-thinking", Some(ToolFormat::Kimi)),
            ("gpt-oss", Some(ToolFormat::Harmony)),
            // Llama 3.1 renders tools, but with its own JSON convention.
            ("llama3.1", None),
        ];
        for (dir, want) in cases {
            assert_eq!(ToolFormat::detect(&fixture_template(dir)), want, "{dir}");
        }
    }

    #[test]
    fn what_goes_before_a_forced_call() {
        let glm = fixture_template("glm4.5");
        let kimi = fixture_template("kimi-k2");
        let kimi_thinking = fixture_template("kimi-k2-thinking");
        let f =
            |format: ToolFormat, prompt: &str, src: &str| format.before_forced_call(prompt, src);
        assert_eq!(
            f(ToolFormat::Xml, "<|im_start|>assistant\n<think>\n", ""),
            "\n</think>\n\n"
        );
        assert_eq!(f(ToolFormat::Json, "<|im_start|>assistant\n", ""), "");
        // GLM-4.5: thinking on by default (bare `<|assistant|>`), or off.
        assert_eq!(
            f(ToolFormat::Glm, "<|user|>\nhi<|assistant|>", &glm),
            "\n<think></think>\n"
        );
        assert_eq!(
            f(ToolFormat::Glm, "<|assistant|>\n<think></think>", &glm),
            "\n"
        );
        assert_eq!(
            f(ToolFormat::Glm, "<|assistant|><think>", &glm),
            "</think>\n"
        );
        // Kimi: K2 answers at once, K2-Thinking after an empty block.
        let p = "<|im_assistant|>assistant<|im_middle|>";
        assert_eq!(f(ToolFormat::Kimi, p, &kimi), "");
        assert_eq!(f(ToolFormat::Kimi, p, &kimi_thinking), "<think></think>");
        assert_eq!(
            f(ToolFormat::Kimi, &format!("{p}<think>"), &kimi),
            "</think>"
        );
        let oss = fixture_template("gpt-oss");
        assert_eq!(f(ToolFormat::Harmony, "<|start|>assistant", &oss), "");
    }

    /// A harmony call as the decoder passes it on, with content before it
    /// (a `final` message the decoder stripped of its markup).
    const HARMONY_CALL_TEXT: &str = "Checking.\n<|channel|>commentary to=functions.get_weather<|message|>{\"city\": \"Zürich\", \"opts\": {\"t\": \"}<|\"}}<|call|>";

    #[test]
    fn harmony_calls() {
        let (content, calls) = check_all_splits(None, HARMONY_CALL_TEXT);
        assert_eq!(content, "Checking.");
        assert_eq!(
            calls,
            vec![(
                "get_weather".to_string(),
                "{\"city\": \"Zürich\", \"opts\": {\"t\": \"}<|\"}}".to_string()
            )]
        );
        // The model's own header spellings: recipient before the channel,
        // `<|constrain|>`, a recipient outside `functions`; string arguments.
        let (content, calls) = check_all_splits(
            None,
            "<|channel|>commentary to=functions.a <|constrain|>json<|message|> {\"x\": [1, {\"y\": 2}]} <|call|>",
        );
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![("a".to_string(), "{\"x\": [1, {\"y\": 2}]}".to_string())]
        );
        let (_, calls) = check_all_splits(
            None,
            "<|channel|>analysis to=python code<|message|>\"{\\\"q\\\": 1}\"<|call|>",
        );
        assert_eq!(calls, vec![("python".to_string(), "{\"q\":1}".to_string())]);
    }

    #[test]
    fn harmony_unfinished_and_not_calls() {
        // Cut off inside the arguments: closed with what came.
        let (_, calls) = check_all_splits(
            None,
            "<|channel|>commentary to=functions.f<|message|>{\"a\": [\"b",
        );
        assert_eq!(
            calls,
            vec![("f".to_string(), "{\"a\": [\"b\"]}".to_string())]
        );
        // Arguments that are not JSON: `{}`.
        let (_, calls) = check_all_splits(
            None,
            "<|channel|>commentary to=functions.f<|message|>oops<|call|>",
        );
        assert_eq!(calls, vec![("f".to_string(), "{}".to_string())]);
        // No recipient, or no `<|message|>`: content, nothing lost.
        for text in [
            "<|channel|>commentary<|message|>hi",
            "<|channel|>commentary to=functions.<|message|>{}",
        ] {
            assert_eq!(check_all_splits(None, text), (text.to_string(), vec![]));
        }
        // (The space before a would-be call goes, as before `<tool_call>`.)
        let text = "a <|channel|>final";
        assert_eq!(
            check_all_splits(None, text),
            ("a<|channel|>final".to_string(), vec![])
        );
        let long = format!("<|channel|>{}", "x".repeat(MAX_HARMONY_HEADER + 1));
        assert_eq!(check_all_splits(None, &long).0, long);
    }

    #[test]
    fn harmony_forced_calls() {
        let f = ToolFormat::Harmony;
        let named = f.forced_prefix(Some("get_weather"), 3);
        assert_eq!(
            named,
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        );
        // Named: the parser reads the prompt's opening, then the body.
        assert_eq!(
            f.parser_prefix(&named, Some("get_weather")).as_deref(),
            Some(named.as_str())
        );
        let text = format!("{named}{{\"city\": \"Rome\"}}<|call|>");
        let (content, calls) = check_all_splits(None, &text);
        assert_eq!(content, "");
        assert_eq!(
            calls,
            vec![(
                "get_weather".to_string(),
                "{\"city\": \"Rome\"}".to_string()
            )]
        );
        // Unnamed: the model writes the name; the decoder passes on the
        // whole header, so the parser is fed nothing first.
        let open = f.forced_prefix(None, 0);
        assert_eq!(open, "<|channel|>commentary to=functions.");
        assert_eq!(f.parser_prefix(&open, None), None);
        assert_eq!(
            ToolFormat::Kimi.parser_prefix("x", None).as_deref(),
            Some("x")
        );
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
