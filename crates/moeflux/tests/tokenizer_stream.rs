//! `StreamDecoder` on the fixtures' 1024-token byte-level BPE, whose vocab
//! has no multi-byte characters: CJK, emoji and combining marks are split
//! into single-byte tokens, the hardest case for streaming.

use std::path::Path;

use moeflux::text::stream::StreamDecoder;
use moeflux::text::tokenizer::Tokenizer;

fn tokenizer() -> Tokenizer {
    Tokenizer::from_model_dir(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35moe-q4/src"),
    )
    .unwrap()
}

/// The byte-level BPE token of one byte (GPT-2's bytes_to_unicode).
fn byte_token(t: &Tokenizer, b: u8) -> u32 {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let c = if printable(b) {
        char::from(b)
    } else {
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap()
    };
    t.token_to_id(&c.to_string()).unwrap()
}

/// Streams `ids` one at a time; returns the pieces (finish's last).
fn stream(t: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut d = StreamDecoder::new(t, skip_special);
    let mut pieces: Vec<String> = ids.iter().map(|&id| d.push(id).unwrap()).collect();
    pieces.push(d.finish().unwrap());
    pieces
}

const TEXTS: &[&str] = &[
    // CJK, Japanese kana, Korean
    "我想在apple工作1314151天～ 日本語のテキスト、한국어 텍스트",
    // emoji: plain, ZWJ families, skin tone, flags, keycap, variation selector
    "🚀 😶\u{200d}🌫️ 👩\u{200d}👩\u{200d}👧\u{200d}👦 👍🏽 🇯🇵🇫🇷 1\u{fe0f}\u{20e3} ❤️",
    // combining marks that NFC cannot compose, Khmer, Devanagari, Hebrew
    "q\u{307}\u{323} x\u{300}\u{301}\u{302} កាន់តែពិសេសអាច नमस्ते שָׁלוֹם",
    // mixed with ASCII code and a 4-byte character at the very end
    "fn main() { println!(\"Ünïcödé ✅\"); } // 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦙",
];

#[test]
fn streamed_pieces_concatenate_to_decode_and_are_whole_characters() {
    let t = tokenizer();
    for text in TEXTS {
        let ids = t.encode(text, false).unwrap();
        let all = t.decode(&ids, false).unwrap();
        assert!(!all.contains('\u{FFFD}'), "{text}");
        let pieces = stream(&t, &ids, false);
        assert_eq!(pieces.concat(), all, "{text}");
        for p in &pieces {
            // A &str is valid UTF-8 by construction; what matters is that no
            // piece carries a replacement character from a cut sequence.
            assert!(!p.contains('\u{FFFD}'), "piece {p:?} of {text}");
        }
        // The test is meaningful: characters really were split over tokens,
        // so some pushes had to hold back (return nothing).
        let naive_lossy = ids
            .iter()
            .any(|&id| t.decode(&[id], false).unwrap().contains('\u{FFFD}'));
        assert!(naive_lossy, "{text}: no character split over tokens");
        assert!(pieces[..ids.len()].iter().any(|p| p.is_empty()), "{text}");
    }
}

#[test]
fn every_prefix_is_emitted_as_soon_as_it_is_complete() {
    // After each push, the text emitted so far is the longest prefix of
    // decode(ids[..=i]) that ends on a complete character.
    let t = tokenizer();
    let text = TEXTS.concat();
    let ids = t.encode(&text, false).unwrap();
    let mut d = StreamDecoder::new(&t, false);
    let mut out = String::new();
    for i in 0..ids.len() {
        out.push_str(&d.push(ids[i]).unwrap());
        let so_far = t.decode(&ids[..=i], false).unwrap();
        let complete = so_far.trim_end_matches('\u{FFFD}');
        assert_eq!(out, complete, "after {} tokens", i + 1);
    }
    assert_eq!(d.finish().unwrap(), "");
    assert_eq!(out, t.decode(&ids, false).unwrap());
}

#[test]
fn special_tokens_are_kept_or_skipped() {
    let t = tokenizer();
    let text = "<|im_start|>assistant\n你好 🦙<|im_end|><|endoftext|>";
    let ids = t.encode(text, false).unwrap();
    assert_eq!(stream(&t, &ids, false).concat(), text);
    let skipped = stream(&t, &ids, true).concat();
    assert_eq!(skipped, "assistant\n你好 🦙");
    assert_eq!(skipped, t.decode(&ids, true).unwrap());
}

#[test]
fn finish_flushes_incomplete_bytes_lossily_and_resets() {
    let t = tokenizer();
    let mut d = StreamDecoder::new(&t, false);
    // "é" is C3 A9; the model stops after C3.
    assert_eq!(d.push(byte_token(&t, b'a')).unwrap(), "a");
    assert_eq!(d.push(byte_token(&t, 0xC3)).unwrap(), "");
    assert!(d.has_pending());
    assert_eq!(d.finish().unwrap(), "\u{FFFD}");
    assert!(!d.has_pending());
    // Reusable after finish.
    assert_eq!(d.push(byte_token(&t, 0xC3)).unwrap(), "");
    assert_eq!(d.push(byte_token(&t, 0xA9)).unwrap(), "é");
    assert_eq!(d.finish().unwrap(), "");
}

#[test]
fn invalid_bytes_from_the_model_come_out_lossy_without_stalling() {
    let t = tokenizer();
    let mut d = StreamDecoder::new(&t, false);
    // A lone continuation byte, then text: the FFFD is the model's doing.
    let mut out = d.push(byte_token(&t, 0x80)).unwrap();
    out += &d.push(byte_token(&t, b'x')).unwrap();
    assert_eq!(out, "\u{FFFD}x");
    // An endless run of lead bytes never completes: emitted after a bound,
    // and everything fed is eventually accounted for.
    let lead = byte_token(&t, 0xE4);
    let mut got = String::new();
    for _ in 0..100 {
        got += &d.push(lead).unwrap();
    }
    assert!(got.chars().count() >= 80, "held back too much: {got:?}");
    got += &d.finish().unwrap();
    assert!(got.chars().all(|c| c == '\u{FFFD}'));
    assert_eq!(got.chars().count(), 100);
}

#[test]
fn finish_pending_keeps_streaming() {
    let t = tokenizer();
    let think_like = t.encode("你好", false).unwrap();
    let mut d = StreamDecoder::new(&t, false);
    let mut out = String::new();
    for &id in &think_like {
        out += &d.push(id).unwrap();
        out += &d.finish_pending().unwrap();
    }
    // Forcing a flush after every byte token of a character breaks it: that
    // is what finish_pending is for (a cut the caller wants), so its output
    // is lossy here...
    assert!(out.contains('\u{FFFD}'));
    // ...while with nothing pending it emits nothing and changes nothing.
    let mut d = StreamDecoder::new(&t, false);
    let mut out = String::new();
    for &id in &t.encode("ab 你好 cd", false).unwrap() {
        out += &d.push(id).unwrap();
        if !d.has_pending() {
            assert_eq!(d.finish_pending().unwrap(), "");
        }
    }
    out += &d.finish().unwrap();
    assert_eq!(out, "ab 你好 cd");
}

#[test]
fn bad_id_is_an_error_and_leaves_the_decoder_usable() {
    let t = tokenizer();
    let mut d = t.stream_decoder(false);
    assert_eq!(d.push(byte_token(&t, 0xE4)).unwrap(), "");
    let e = d.push(5000).unwrap_err().to_string();
    assert!(e.contains("5000") && e.contains("index 1"), "{e}");
    assert_eq!(d.push(byte_token(&t, 0xBD)).unwrap(), "");
    assert_eq!(d.push(byte_token(&t, 0xA0)).unwrap(), "你");
}
