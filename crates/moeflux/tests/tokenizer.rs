//! `moeflux::text::tokenizer::Tokenizer` on the fixtures' 1024-token
//! byte-level BPE (ChatML specials `<|endoftext|>`=0, `<|im_start|>`=1,
//! `<|im_end|>`=2): loading, special ids, encode/decode, errors.

use std::path::{Path, PathBuf};

use moeflux::text::tokenizer::Tokenizer;
use moeflux::Error;

fn fixture_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .join("src")
}

/// A directory with the fixture's tokenizer.json and the given extra files.
fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture_src("qwen35moe-q4").join("tokenizer.json"),
        tmp.path().join("tokenizer.json"),
    )
    .unwrap();
    for (name, text) in files {
        std::fs::write(tmp.path().join(name), text).unwrap();
    }
    tmp
}

#[test]
fn loads_fixture_with_specials_and_eos() {
    for fx in [
        "qwen35moe-q4",
        "qwen3next-q4",
        "qwen35moe-hf",
        "qwen3next-hf",
    ] {
        let t = Tokenizer::from_model_dir(fixture_src(fx)).unwrap();
        assert_eq!(t.vocab_size(), 1024, "{fx}");
        assert_eq!(t.special_ids(), &[0, 1, 2], "{fx}");
        assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
        assert_eq!(t.id_to_token(2).as_deref(), Some("<|im_end|>"));
        assert!(t.is_special(0) && !t.is_special(3));
        assert_eq!(t.think_ids(), None, "the fixture vocab has no <think>");
        // config.json eos 2; tokenizer_config eos_token <|im_end|> = 2; the
        // HF fixtures' generation_config adds [2, 0].
        let want: &[u32] = if fx.ends_with("-hf") { &[2, 0] } else { &[2] };
        assert_eq!(t.eos_ids(), want, "{fx}");
        assert!(t.is_eos(2));
        assert_eq!(t.is_eos(0), fx.ends_with("-hf"));
    }
    let hf = Tokenizer::from_model_dir(fixture_src("qwen35moe-hf")).unwrap();
    assert_eq!(hf.bos_id(), Some(0), "generation_config bos_token_id");
    let mlx = Tokenizer::from_model_dir(fixture_src("qwen35moe-q4")).unwrap();
    assert_eq!(mlx.bos_id(), None, "bos_token null, no bos_token_id");
}

#[test]
fn eos_is_the_union_of_all_sources() {
    let tmp = dir_with(&[
        (
            "generation_config.json",
            r#"{"eos_token_id": 7, "bos_token_id": 5}"#,
        ),
        (
            "config.json",
            r#"{"eos_token_id": [9, 7], "text_config": {"eos_token_id": [11, 9]}}"#,
        ),
        (
            "tokenizer_config.json",
            r#"{"eos_token": {"content": "<|endoftext|>", "special": true}, "bos_token": "<|im_start|>"}"#,
        ),
    ]);
    let t = Tokenizer::from_model_dir(tmp.path()).unwrap();
    assert_eq!(t.eos_ids(), &[7, 9, 11, 0]);
    assert!(t.is_eos(11) && !t.is_eos(2));
    assert_eq!(t.bos_id(), Some(1), "tokenizer_config's bos_token wins");

    // Only a nested text_config, unknown eos_token name, non-integers ignored.
    let tmp = dir_with(&[
        (
            "config.json",
            r#"{"text_config": {"eos_token_id": 2, "bos_token_id": 3}}"#,
        ),
        (
            "tokenizer_config.json",
            r#"{"eos_token": "<nope>", "bos_token": null}"#,
        ),
        (
            "generation_config.json",
            r#"{"eos_token_id": [-1, "x", 0]}"#,
        ),
    ]);
    let t = Tokenizer::from_model_dir(tmp.path()).unwrap();
    assert_eq!(t.eos_ids(), &[0, 2]);
    assert_eq!(t.bos_id(), Some(3));

    // tokenizer.json alone: no EOS.
    let tmp = dir_with(&[]);
    let t = Tokenizer::from_model_dir(tmp.path()).unwrap();
    assert!(t.eos_ids().is_empty() && t.bos_id().is_none());
    let t = Tokenizer::from_file(tmp.path().join("tokenizer.json")).unwrap();
    assert!(t.eos_ids().is_empty());
}

#[test]
fn encode_recognises_specials_written_in_text_and_round_trips() {
    let t = Tokenizer::from_model_dir(fixture_src("qwen35moe-q4")).unwrap();
    let text = "<|im_start|>user\nWhat is 2+2? 我想 🦙<|im_end|>\n<|im_start|>assistant\n";
    let ids = t.encode(text, false).unwrap();
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 2);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1);
    assert!(ids.iter().all(|&i| (i as usize) < t.vocab_size()));
    assert_eq!(t.decode(&ids, false).unwrap(), text);
    assert_eq!(
        t.decode(&ids, true).unwrap(),
        "user\nWhat is 2+2? 我想 🦙\nassistant\n"
    );
    // The Qwen post-processor adds nothing.
    assert_eq!(t.encode(text, true).unwrap(), ids);
    assert_eq!(t.encode("", false).unwrap(), Vec::<u32>::new());
    assert_eq!(t.decode(&[], false).unwrap(), "");
    // Code is what the fixture vocab was trained on: real merges happen.
    let code = "def hello(world):\n    return 42\n";
    let ids = t.encode(code, false).unwrap();
    assert!(ids.len() * 2 <= code.len(), "{ids:?}");
    assert_eq!(t.decode(&ids, false).unwrap(), code);
}

/// Every token's bytes: the text's bytes are the concatenation of its
/// tokens', characters split across tokens included; a token whose bytes are
/// whole UTF-8 decodes to them; a special token is its spelling.
#[test]
fn token_bytes_of_byte_level_bpe() {
    let t = Tokenizer::from_model_dir(fixture_src("qwen35moe-q4")).unwrap();
    let text = "<|im_start|>héllo wörld 我想 🦙\n\tend<|im_end|>";
    let ids = t.encode(text, false).unwrap();
    let joined: Vec<u8> = ids
        .iter()
        .flat_map(|&i| t.token_bytes(i).unwrap())
        .collect();
    assert_eq!(joined, text.as_bytes());
    // Some token holds part of a character (the emoji's 4 bytes are
    // single-byte tokens in this small vocabulary).
    assert!(ids
        .iter()
        .any(|&i| std::str::from_utf8(&t.token_bytes(i).unwrap()).is_err()));
    for id in 0..t.vocab_size() as u32 {
        let b = t.token_bytes(id).unwrap();
        assert!(!b.is_empty(), "token {id}");
        if let Ok(s) = std::str::from_utf8(&b) {
            assert_eq!(t.decode(&[id], false).unwrap(), s, "token {id}");
        }
    }
    assert_eq!(t.token_bytes(2).unwrap(), b"<|im_end|>");
    assert_eq!(t.token_bytes(t.vocab_size() as u32), None);
}

/// SentencePiece: `<0xNN>` is one byte (byte fallback), `▁` a space.
#[test]
fn token_bytes_of_sentencepiece_byte_fallback() {
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
            "split": false},
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": {"<s>": 0, "<0xE6>": 1, "▁hi": 2, "x": 3}, "merges": []}
    });
    let t = Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
    assert_eq!(t.token_bytes(0).unwrap(), b"<s>");
    assert_eq!(t.token_bytes(1).unwrap(), [0xE6]);
    assert_eq!(t.token_bytes(2).unwrap(), b" hi");
    assert_eq!(t.token_bytes(3).unwrap(), b"x");
    // A Metaspace decoder alone (no byte tokens): `▁` is still a space,
    // though decoding the token alone would drop it.
    let mut json = json;
    json["decoder"] = serde_json::json!({"type": "Metaspace", "replacement": "▁",
        "prepend_scheme": "first", "split": false});
    let t = Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
    assert_eq!(t.decode(&[2], false).unwrap(), "hi");
    assert_eq!(t.token_bytes(2).unwrap(), b" hi");
}

#[test]
fn decode_rejects_unknown_ids() {
    let t = Tokenizer::from_model_dir(fixture_src("qwen35moe-q4")).unwrap();
    match t.decode(&[3, 4, 1024], false) {
        Err(Error::TokenOutOfRange {
            token: 1024,
            index: 2,
            vocab: 1024,
        }) => {}
        other => panic!("{other:?}"),
    }
    let e = t.decode(&[u32::MAX], false).unwrap_err().to_string();
    assert!(e.contains("4294967295") && e.contains("1024"), "{e}");
    // Byte-level BPE: byte 0x80 is the token `Ģ`. Alone it is invalid
    // UTF-8, which decode writes as U+FFFD.
    let cont = t.token_to_id("\u{122}").unwrap();
    assert_eq!(t.decode(&[cont], false).unwrap(), "\u{FFFD}");
}

#[test]
fn missing_or_bad_tokenizer_json_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_model_dir(tmp.path()).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains(&tmp.path().join("tokenizer.json").display().to_string()),
        "{msg}"
    );

    std::fs::write(tmp.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let e = Tokenizer::from_model_dir(tmp.path()).unwrap_err();
    assert!(matches!(e, Error::Tokenizer { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("tokenizer.json: cannot load tokenizer"),
        "{msg}"
    );

    // A present but broken side file is an error too.
    let tmp = dir_with(&[("generation_config.json", "{")]);
    let e = Tokenizer::from_model_dir(tmp.path()).unwrap_err();
    assert!(matches!(e, Error::Json { .. }), "{e:?}");
    assert!(e.to_string().contains("generation_config.json"), "{e}");
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}

// ---- Hostile files: refused with the file named, before anything large is
// built (issue 27) ----

/// The fixture's tokenizer.json as JSON, changed by `edit`, in a directory.
fn tokenizer_with(edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let tmp = dir_with(&[]);
    let p = tmp.path().join("tokenizer.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    tmp
}

/// Loading fails quickly with an error naming `file` and holding `want`.
fn refused(dir: &Path, file: &str, want: &str) {
    let start = std::time::Instant::now();
    let e = Tokenizer::from_model_dir(dir).unwrap_err().to_string();
    assert!(e.contains(file) && e.contains(want), "{e}");
    assert!(start.elapsed().as_secs_f64() < 2.0, "{:?}", start.elapsed());
}

#[test]
fn oversized_tokenizer_json_is_refused_unread() {
    let tmp = dir_with(&[]);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(tmp.path().join("tokenizer.json"))
        .unwrap();
    // Sparse: nothing is written, and nothing may be read.
    f.set_len(moeflux::text::tokenizer::MAX_TOKENIZER_BYTES + 1)
        .unwrap();
    refused(tmp.path(), "tokenizer.json", "larger than");
}

#[test]
fn too_many_added_tokens_are_refused() {
    let n = moeflux::text::tokenizer::MAX_ADDED_TOKENS + 1;
    let tmp = tokenizer_with(|v| {
        v["added_tokens"] = (0..n)
            .map(|i| {
                serde_json::json!({"id": 1024 + i, "content": format!("<x{i}>"),
                    "single_word": false, "lstrip": false, "rstrip": false,
                    "normalized": false, "special": true})
            })
            .collect();
    });
    refused(tmp.path(), "tokenizer.json", &format!("{n} added tokens"));
}

#[test]
fn megabyte_long_tokens_are_refused() {
    let long = "a".repeat(1 << 20);
    let added = tokenizer_with(|v| {
        v["added_tokens"][0]["content"] = long.clone().into();
    });
    refused(
        added.path(),
        "tokenizer.json",
        "an added token of 1048576 bytes",
    );
    let vocab = tokenizer_with(|v| {
        v["model"]["vocab"][long.as_str()] = 5000.into();
    });
    refused(vocab.path(), "tokenizer.json", "a token of 1048576 bytes");
}

#[test]
fn deeply_nested_pre_tokenizer_is_refused() {
    let depth = 100_000;
    let tmp = dir_with(&[]);
    let p = tmp.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&p).unwrap();
    let nested = format!(
        "{}{{\"type\": \"Whitespace\"}}{}",
        "{\"type\": \"Sequence\", \"pretokenizers\": [".repeat(depth),
        "]}".repeat(depth)
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let with = serde_json::to_string(&v).unwrap().replacen(
        "\"pre_tokenizer\":",
        &format!("\"pre_tokenizer\":{nested},\"_old\":"),
        1,
    );
    std::fs::write(&p, with).unwrap();
    refused(tmp.path(), "tokenizer.json", "recursion limit");
}

#[test]
fn huge_generation_config_is_refused() {
    let ids = vec!["1"; 9 << 20].join(",");
    let tmp = dir_with(&[(
        "generation_config.json",
        &format!("{{\"eos_token_id\": [{ids}]}}"),
    )]);
    refused(tmp.path(), "generation_config.json", "larger than");
    let tmp = dir_with(&[("generation_config.json", "{\"eos_token_id\": 1e999}")]);
    refused(tmp.path(), "generation_config.json", "number out of range");
}
