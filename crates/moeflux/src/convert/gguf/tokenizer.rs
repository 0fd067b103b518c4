//! `tokenizer.json` + `tokenizer_config.json` from a GGUF's `tokenizer.ggml.*`
//! metadata (byte-level BPE, `tokenizer.ggml.model` = `gpt2`), for sources
//! without a tokenizer.json beside them.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value as Json};

use crate::error::{Error, Result};

use super::file::Value;

/// The split regex of llama.cpp's pre-tokenizer names, as the original
/// tokenizer.json spells it (llama.cpp's `llama-vocab.cpp` quotes them).
fn pre_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "qwen2" => {
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        }
        "qwen35" => {
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        }
        "gpt-4o" => {
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
        }
        _ => return None,
    })
}

/// llama.cpp token types.
const CONTROL: u64 = 3;
const USER_DEFINED: u64 = 4;

pub fn files(kv: &BTreeMap<String, Value>, src: &Path) -> Result<Vec<(&'static str, Vec<u8>)>> {
    let err = |field: &str, why: String| Error::Config {
        path: src.to_path_buf(),
        field: field.into(),
        reason: why,
    };
    let s = |k: &str| kv.get(k).and_then(Value::as_str);
    match s("tokenizer.ggml.model") {
        Some("gpt2") => {}
        Some(m) => {
            return Err(err(
                "tokenizer.ggml.model",
                format!("`{m}`: only byte-level BPE (`gpt2`) vocabularies are converted; put a tokenizer.json beside the file"),
            ))
        }
        None => {
            return Err(err(
                "tokenizer.ggml.model",
                "missing: the GGUF has no vocabulary; put a tokenizer.json beside the file".into(),
            ))
        }
    }
    let pre = s("tokenizer.ggml.pre").unwrap_or("default");
    let regex = pre_regex(pre).ok_or_else(|| {
        err(
            "tokenizer.ggml.pre",
            format!("pre-tokenizer `{pre}` is not known here (qwen2, qwen35, gpt-4o); put a tokenizer.json beside the file"),
        )
    })?;
    let tokens = kv
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_arr)
        .ok_or_else(|| err("tokenizer.ggml.tokens", "missing or not an array".into()))?;
    let types = kv.get("tokenizer.ggml.token_type").and_then(Value::as_arr);
    let merges = kv
        .get("tokenizer.ggml.merges")
        .and_then(Value::as_arr)
        .ok_or_else(|| {
            err(
                "tokenizer.ggml.merges",
                "missing (a BPE vocabulary needs merges)".into(),
            )
        })?;
    let mut vocab = Map::new();
    let mut added = Vec::new();
    let mut strs = Vec::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        let t = t.as_str().ok_or_else(|| {
            err(
                "tokenizer.ggml.tokens",
                format!("entry {id} is not a string"),
            )
        })?;
        strs.push(t);
        let ty = types.and_then(|v| v.get(id)).and_then(Value::as_u64);
        if matches!(ty, Some(CONTROL | USER_DEFINED)) {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": ty != Some(CONTROL), "special": ty == Some(CONTROL),
            }));
        }
        vocab.entry(t.to_string()).or_insert(json!(id));
    }
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m
            .as_str()
            .and_then(|m| m.split_once(' '))
            .ok_or_else(|| err("tokenizer.ggml.merges", format!("entry {i} is not `A B`")))?;
        pairs.push(json!([a, b]));
    }
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": if pre == "gpt-4o" { Json::Null } else { json!({"type": "NFC"}) },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": pairs},
    });
    let tok = |k: &str| -> Json {
        kv.get(k)
            .and_then(Value::as_u64)
            .and_then(|i| strs.get(i as usize))
            .map_or(Json::Null, |s| json!(s))
    };
    let mut tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok("tokenizer.ggml.bos_token_id"),
        "eos_token": tok("tokenizer.ggml.eos_token_id"),
        "pad_token": tok("tokenizer.ggml.padding_token_id"),
        "add_bos_token": kv.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false),
    });
    if let Some(t) = s("tokenizer.chat_template") {
        tc["chat_template"] = json!(t);
    }
    Ok(vec![
        ("tokenizer.json", super::super::json_4_spaces(&tj)),
        ("tokenizer_config.json", super::super::json_4_spaces(&tc)),
    ])
}
