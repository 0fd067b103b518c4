//! Text ⇄ token ids with a model directory's Hugging Face `tokenizer.json`
//! (byte-level BPE for the Qwen models), plus the ids a generator needs:
//! end-of-sequence, beginning-of-sequence, the special tokens and the
//! `<think>`/`</think>` pair.
//!
//! Tool-call markup stays text when special tokens are skipped, even where
//! a vocabulary marks it special (Kimi's `<|tool_call_begin|>` and kin,
//! GLM's `<arg_key>`): the server's tool-call parser reads it from the
//! decoded text.
//!
//! Special tokens written inside message text stay text: a chat prompt is
//! rendered into a [`Prompt`] that knows which special-token spellings
//! the template emitted and which came from the messages, and
//! [`Tokenizer::encode_prompt`] turns only the former into special ids
//! (`<|im_end|>` typed by a user cannot close their turn).
//!
//! Only the small JSON files of a model directory are read, never the
//! weights, so a directory holding just `tokenizer.json` is enough.

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use serde_json::Value;

use crate::error::{Error, Result};
use crate::text::chat::Prompt;
use crate::text::stream::StreamDecoder;

/// The tokenizer file of a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Where Hugging Face keeps the generation defaults (`eos_token_id`).
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The model configuration (`eos_token_id`, also inside `text_config`).
pub const CONFIG_FILE: &str = "config.json";
/// transformers' tokenizer settings (`eos_token`, `bos_token`).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Largest `tokenizer.json` read (real ones are under 50 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;
/// Largest of the small JSON files beside it (`tokenizer_config.json`,
/// `generation_config.json`, `special_tokens_map.json`, chat templates):
/// real ones are at most a few hundred KB.
pub const MAX_TEXT_CONFIG_BYTES: u64 = 16 << 20;
/// Most added tokens in a `tokenizer.json` (real ones have a few thousand
/// at most); each is matched in every text encoded.
pub const MAX_ADDED_TOKENS: usize = 1 << 16;
/// Longest token (vocabulary entry, merge side or added token), in bytes;
/// real ones are under 300.
pub const MAX_TOKEN_BYTES: usize = 4096;

/// Tokens that spell tool calls: decoded as text even when special tokens
/// are skipped (see the module docs).
pub const TOOL_CALL_MARKUP: [&str; 11] = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
];

/// A loaded tokenizer. Cheap to share by reference; `Send + Sync`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    source: PathBuf,
    vocab_size: usize,
    eos: Vec<u32>,
    bos: Option<u32>,
    special: Vec<u32>,
    /// Special ids of [`TOOL_CALL_MARKUP`] tokens, ascending.
    markup: Vec<u32>,
    think: Option<(u32, u32)>,
    /// The spellings of the special tokens, longest first (so the first
    /// match at a position is the longest, as the tokenizer matches).
    special_text: Vec<String>,
    /// The first bytes of `special_text`, for a quick scan.
    special_first: [bool; 256],
    /// `inner` with special tokens encoded as plain text, made on first use.
    literal: OnceLock<tokenizers::Tokenizer>,
    /// How a token id turns into its bytes ([`Tokenizer::token_bytes`]).
    spelling: crate::text::token_bytes::TokenSpelling,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .field("special", &self.special.len())
            .field("think", &self.think)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` and gathers the special ids from the
    /// directory's JSON files (each optional):
    ///
    /// * EOS ids: the union, in this order and without repeats, of
    ///   `generation_config.json` `eos_token_id`, `config.json`
    ///   `eos_token_id` and `text_config.eos_token_id` (each an integer or a
    ///   list), and the token named by `tokenizer_config.json` `eos_token`
    ///   (a string or `{"content": ...}`).
    /// * BOS id: `tokenizer_config.json` `bos_token`, else
    ///   `generation_config.json` `bos_token_id`, else `config.json`
    ///   `bos_token_id` (top level, then `text_config`).
    ///
    /// A missing or unparsable `tokenizer.json` is an error naming it; so is
    /// one of the other files when present but not valid JSON.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let mut t = Self::from_file(dir.join(TOKENIZER_FILE))?;
        let generation = read_json_opt(&dir.join(GENERATION_CONFIG_FILE))?;
        let config = read_json_opt(&dir.join(CONFIG_FILE))?;
        let tok_config = read_json_opt(&dir.join(TOKENIZER_CONFIG_FILE))?;
        let text_config = config.as_ref().and_then(|c| c.get("text_config"));

        let mut eos = Vec::new();
        let mut add = |ids: Vec<u32>| {
            for id in ids {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        };
        add(int_ids(generation.as_ref(), "eos_token_id"));
        add(int_ids(config.as_ref(), "eos_token_id"));
        add(int_ids(text_config, "eos_token_id"));
        let eos_name = t.named_id(tok_config.as_ref(), "eos_token");
        add(eos_name.into_iter().collect());
        t.eos = eos;

        let first = |v: Option<&Value>, key: &str| int_ids(v, key).first().copied();
        t.bos = t
            .named_id(tok_config.as_ref(), "bos_token")
            .or_else(|| first(generation.as_ref(), "bos_token_id"))
            .or_else(|| first(config.as_ref(), "bos_token_id"))
            .or_else(|| first(text_config, "bos_token_id"));
        Ok(t)
    }

    /// Loads a `tokenizer.json` file alone: no EOS or BOS ids (nothing names
    /// them), but specials and `<think>` are found.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = crate::format::read_small_text(path, MAX_TOKENIZER_BYTES)?;
        Self::parse(text.as_bytes(), path)
    }

    /// Loads the contents of a `tokenizer.json` (like [`Tokenizer::from_file`]).
    pub fn from_bytes(json: &[u8]) -> Result<Self> {
        Self::parse(json, Path::new("<tokenizer.json bytes>"))
    }

    fn parse(json: &[u8], source: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Tokenizer {
            path: source.to_path_buf(),
            reason,
        };
        // serde_json refuses nesting deeper than 128 levels, so a deeply
        // nested pre-tokenizer is an error here, not a stack overflow.
        let value: Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
        check_sizes(&value).map_err(bad)?;
        let inner: tokenizers::Tokenizer =
            serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        let special: BTreeSet<u32> = inner
            .get_added_tokens_decoder()
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(&id, _)| id)
            .collect();
        let think = inner
            .token_to_id("<think>")
            .zip(inner.token_to_id("</think>"));
        let markup: BTreeSet<u32> = TOOL_CALL_MARKUP
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .filter(|id| special.contains(id))
            .collect();
        let decoder = inner.get_added_tokens_decoder();
        let mut special_text: Vec<String> = special
            .iter()
            .filter_map(|id| decoder.get(id))
            .map(|t| t.content.clone())
            .filter(|c| !c.is_empty())
            .collect();
        special_text.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        special_text.dedup();
        let mut special_first = [false; 256];
        for t in &special_text {
            special_first[t.as_bytes()[0] as usize] = true;
        }
        let spelling = crate::text::token_bytes::TokenSpelling::of(&inner);
        Ok(Tokenizer {
            spelling,
            inner,
            source: source.to_path_buf(),
            vocab_size,
            eos: Vec::new(),
            bos: None,
            special: special.into_iter().collect(),
            markup: markup.into_iter().collect(),
            think,
            special_text,
            special_first,
            literal: OnceLock::new(),
        })
    }

    /// The file this tokenizer was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Token ids of `text`. Special tokens written in the text (such as
    /// `<|im_start|>`) become their ids. `add_special_tokens` applies the
    /// tokenizer's post-processor (a BOS token, for tokenizers that add one;
    /// the Qwen tokenizers add nothing).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Tokenize(format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` with special-token spellings encoded as plain
    /// text (`<|im_end|>` becomes `<`, `|`, `im`, ... rather than the
    /// special id); added tokens that are not special still match.
    pub fn encode_as_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let literal = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = literal
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::Tokenize(format!("encoding failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of a rendered chat prompt: special-token spellings the
    /// template wrote become special ids, those that came from message text
    /// stay text. The stretch between two template specials that holds
    /// message-text specials is encoded as a whole with specials as text;
    /// everything else exactly as [`Tokenizer::encode`] (without the
    /// post-processor) encodes it.
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let text = prompt.text();
        let literal = prompt.literal_spans();
        if literal.is_empty() {
            return self.encode(text, false);
        }
        let overlaps =
            |r: &Range<usize>| literal.iter().any(|l| l.start < r.end && r.start < l.end);
        // Template specials: the split points around literal stretches.
        let hard: Vec<Range<usize>> = self
            .special_spans(text)
            .into_iter()
            .filter(|r| !overlaps(r))
            .collect();
        let mut ids = Vec::new();
        let mut normal_from = 0;
        let mut run_start = 0;
        let ends = hard
            .iter()
            .map(|h| (h.start, h.end))
            .chain([(text.len(), text.len())]);
        for (end, next) in ends {
            let run = run_start..end;
            if overlaps(&run) {
                ids.extend(self.encode(&text[normal_from..run.start], false)?);
                ids.extend(self.encode_as_text(&text[run.clone()], false)?);
                normal_from = run.end;
            }
            run_start = next;
        }
        if normal_from < text.len() {
            ids.extend(self.encode(&text[normal_from..], false)?);
        }
        Ok(ids)
    }

    /// Byte ranges of the special-token spellings in `text`, leftmost and
    /// longest first, not overlapping (as the tokenizer splits them out).
    pub fn special_spans(&self, text: &str) -> Vec<Range<usize>> {
        let bytes = text.as_bytes();
        let mut spans = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            if self.special_first[bytes[i] as usize] {
                if let Some(t) = self
                    .special_text
                    .iter()
                    .find(|t| bytes[i..].starts_with(t.as_bytes()))
                {
                    spans.push(i..i + t.len());
                    i += t.len();
                    continue;
                }
            }
            i += 1;
        }
        spans
    }

    /// The text of `ids`. With `skip_special`, special tokens are left out,
    /// but for tool-call markup ([`TOOL_CALL_MARKUP`]).
    /// An id the vocabulary does not have is an error. Bytes that are not
    /// valid UTF-8 (a multi-byte character cut off, say) decode as U+FFFD:
    /// use [`StreamDecoder`] to decode a growing sequence.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        for (index, &id) in ids.iter().enumerate() {
            self.check_id(id, index)?;
        }
        let decoded = if skip_special && !self.markup.is_empty() {
            let kept: Vec<u32> = ids
                .iter()
                .copied()
                .filter(|&id| !self.is_special(id) || self.markup.binary_search(&id).is_ok())
                .collect();
            self.inner.decode(&kept, false)
        } else {
            self.inner.decode(ids, skip_special)
        };
        decoded.map_err(|e| Error::Tokenize(format!("decoding failed: {e}")))
    }

    /// Errors unless `id` is a token of the vocabulary (`index` is its
    /// position, for the message).
    pub fn check_id(&self, id: u32, index: usize) -> Result<()> {
        if id as usize >= self.vocab_size {
            return Err(Error::TokenOutOfRange {
                token: id,
                index,
                vocab: self.vocab_size,
            });
        }
        if self.inner.id_to_token(id).is_none() {
            return Err(Error::UnknownToken { token: id, index });
        }
        Ok(())
    }

    /// The id of a token given in its vocabulary form (for byte-level BPE,
    /// `Ġ` stands for a space), or of an added token such as `<|im_end|>`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The vocabulary form of a token.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes token `id` stands for (an added token: its content), even
    /// where they are not whole UTF-8 (part of a character); `None` outside
    /// the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.spelling.bytes(&self.inner, id)
    }

    /// One more than the largest id, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// End-of-sequence ids (see [`Tokenizer::from_model_dir`]); empty when
    /// nothing names one.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// The beginning-of-sequence id, if the model directory names one. This
    /// is informational: [`Tokenizer::encode`] with `add_special_tokens`
    /// adds it when the tokenizer's post-processor says so.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids of the added tokens marked special, ascending.
    pub fn special_ids(&self) -> &[u32] {
        &self.special
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.binary_search(&id).is_ok()
    }

    /// The ids of `<think>` and `</think>`, when the vocabulary has both.
    pub fn think_ids(&self) -> Option<(u32, u32)> {
        self.think
    }

    /// A [`StreamDecoder`] over this tokenizer.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special)
    }

    /// The id of the token named by `key` in `tokenizer_config.json`: a
    /// string or `{"content": ...}`; `None` when absent, null or unknown.
    fn named_id(&self, tok_config: Option<&Value>, key: &str) -> Option<u32> {
        let name = match tok_config?.get(key)? {
            Value::String(s) => s.as_str(),
            Value::Object(o) => o.get("content")?.as_str()?,
            _ => return None,
        };
        self.inner.token_to_id(name)
    }
}

/// `obj[key]` as token ids: an integer or a list of integers (anything
/// else is ignored, as in [`crate::config`]).
fn int_ids(obj: Option<&Value>, key: &str) -> Vec<u32> {
    let as_id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match obj.and_then(|o| o.get(key)) {
        Some(Value::Array(a)) => a.iter().filter_map(as_id).collect(),
        Some(v) => as_id(v).into_iter().collect(),
        None => Vec::new(),
    }
}

/// Refuses a `tokenizer.json` whose added tokens or token lengths are
/// beyond any real tokenizer's, before the tokenizers crate builds its
/// tables from them.
fn check_sizes(json: &Value) -> std::result::Result<(), String> {
    let long = |what: &str, s: &str| {
        (s.len() > MAX_TOKEN_BYTES).then(|| {
            format!(
                "{what} of {} bytes, more than the {MAX_TOKEN_BYTES} accepted",
                s.len()
            )
        })
    };
    let added = json
        .get("added_tokens")
        .and_then(Value::as_array)
        .map_or(&[][..], Vec::as_slice);
    if added.len() > MAX_ADDED_TOKENS {
        return Err(format!(
            "{} added tokens, more than the {MAX_ADDED_TOKENS} accepted",
            added.len()
        ));
    }
    for t in added {
        if let Some(e) = t
            .get("content")
            .and_then(Value::as_str)
            .and_then(|c| long("an added token", c))
        {
            return Err(e);
        }
    }
    let model = json.get("model");
    // BPE and WordPiece: {token: id}; Unigram: [[piece, score], ...].
    match model.and_then(|m| m.get("vocab")) {
        Some(Value::Object(v)) => v
            .keys()
            .try_for_each(|k| long("a token", k).map_or(Ok(()), Err))?,
        Some(Value::Array(v)) => v
            .iter()
            .filter_map(|e| e.get(0).and_then(Value::as_str))
            .try_for_each(|k| long("a token", k).map_or(Ok(()), Err))?,
        _ => {}
    }
    // Merges: "a b" strings or [a, b] pairs.
    if let Some(merges) = model
        .and_then(|m| m.get("merges"))
        .and_then(Value::as_array)
    {
        for m in merges {
            let sides: Vec<&str> = match m {
                Value::String(s) => vec![s.as_str()],
                Value::Array(p) => p.iter().filter_map(Value::as_str).collect(),
                _ => Vec::new(),
            };
            if let Some(e) = sides.into_iter().find_map(|s| long("a merge", s)) {
                return Err(e);
            }
        }
    }
    Ok(())
}

/// The JSON in `path`, `None` when the file does not exist.
fn read_json_opt(path: &Path) -> Result<Option<Value>> {
    let text = match crate::format::read_small_text(path, MAX_TEXT_CONFIG_BYTES) {
        Ok(t) => t,
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|source| Error::Json {
            path: path.to_path_buf(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test fixture's tokenizer with tool-call markup added as special
    /// tokens (as Kimi's vocabulary has them).
    fn with_special_markup() -> Tokenizer {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen35moe-q4/src/tokenizer.json");
        let mut json: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let first = Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap())
            .unwrap()
            .vocab_size();
        let added = json["added_tokens"].as_array_mut().unwrap();
        for (i, t) in [
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "<arg_key>",
        ]
        .iter()
        .enumerate()
        {
            added.push(
                serde_json::json!({"id": first + i, "content": t, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
            );
        }
        Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap()).unwrap()
    }

    fn fixture() -> Tokenizer {
        Tokenizer::from_file(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/fixtures/qwen35moe-q4/src/tokenizer.json"),
        )
        .unwrap()
    }

    #[test]
    fn encode_prompt_keeps_message_specials_as_text() {
        let t = fixture();
        let end = t.token_to_id("<|im_end|>").unwrap();
        let text = "<|im_start|>user\nsay <|im_end|> now<|im_end|>\n<|im_start|>assistant\n";
        let at = text.find("<|im_end|> now").unwrap();
        assert_eq!(t.special_spans(text).len(), 4);
        // No literal spans: exactly `encode`.
        let plain = Prompt::from(text.to_string());
        assert_eq!(
            t.encode_prompt(&plain).unwrap(),
            t.encode(text, false).unwrap()
        );
        let span = at..at + "<|im_end|>".len();
        let p = Prompt::with_literal_spans(text.to_string(), vec![span]);
        let ids = t.encode_prompt(&p).unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == end).count(), 1, "{ids:?}");
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        // The stretch between the template's specials is one piece of text.
        let head = t.encode("<|im_start|>", false).unwrap();
        let body = t.encode_as_text("user\nsay <|im_end|> now", false).unwrap();
        let tail = t
            .encode("<|im_end|>\n<|im_start|>assistant\n", false)
            .unwrap();
        assert_eq!(ids, [head, body, tail].concat());
    }

    #[test]
    fn tool_call_markup_stays_text_when_specials_are_skipped() {
        let t = with_special_markup();
        let text =
            "<|im_start|>a<|tool_calls_section_begin|><|tool_call_begin|>f<arg_key>k<|im_end|>";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(t.markup.len(), 3);
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        assert_eq!(
            t.decode(&ids, true).unwrap(),
            "a<|tool_calls_section_begin|><|tool_call_begin|>f<arg_key>k"
        );
        // Streamed the same.
        let mut d = t.stream_decoder(true);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&d.push(id).unwrap());
        }
        out.push_str(&d.finish().unwrap());
        assert_eq!(out, t.decode(&ids, true).unwrap());
    }
}
