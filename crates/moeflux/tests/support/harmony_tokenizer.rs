//! A tiny tokenizer with OpenAI's harmony markers: the fixture model's
//! (`tests/fixtures/qwen35moe-q4/src/tokenizer.json`, 1024 ids) with its
//! last seven tokens turned into the special tokens `<|start|>`,
//! `<|channel|>`, `<|message|>`, `<|end|>`, `<|constrain|>`, `<|return|>`
//! and `<|call|>` (ids 1017..=1023, inside the fixture model's vocabulary,
//! so its random weights can read and write them). Shared by the moeflux
//! and moeflux-server tests (`#[path]`).

use std::path::Path;

use serde_json::{json, Value};

pub const HARMONY_MARKERS: [&str; 7] = [
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
];

/// The first id of [`HARMONY_MARKERS`] (in that order).
pub const FIRST_MARKER_ID: u64 = 1017;

/// The tokenizer.json text.
pub fn harmony_tokenizer_json() -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen35moe-q4/src/tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    let vocab = t["model"]["vocab"].as_object_mut().unwrap();
    let mut replaced = Vec::new();
    for (i, marker) in HARMONY_MARKERS.iter().enumerate() {
        let id = FIRST_MARKER_ID + i as u64;
        let old = vocab
            .iter()
            .find(|(_, v)| v.as_u64() == Some(id))
            .map(|(k, _)| k.clone())
            .unwrap();
        vocab.remove(&old);
        vocab.insert(marker.to_string(), json!(id));
        replaced.push(old);
    }
    // Merges that made or use the replaced tokens go too.
    let merges = t["model"]["merges"].as_array_mut().unwrap();
    merges.retain(|m| {
        let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
        let made = format!("{a}{b}");
        !replaced
            .iter()
            .any(|r| *r == made || r.as_str() == a || r.as_str() == b)
    });
    let added = t["added_tokens"].as_array_mut().unwrap();
    for (i, marker) in HARMONY_MARKERS.iter().enumerate() {
        added.push(json!({"id": FIRST_MARKER_ID + i as u64, "content": marker,
            "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true}));
    }
    t.to_string()
}
