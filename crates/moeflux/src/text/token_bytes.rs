//! The bytes each token stands for, which decoding a token alone loses: a
//! byte-level BPE token may hold part of a UTF-8 character, and decoding it
//! gives U+FFFD. OpenAI's logprobs report these bytes.
//!
//! Hand-rolled because the `tokenizers` crate keeps its byte-to-character
//! table private and decodes only to `String`; the mapping is GPT-2's
//! `bytes_to_unicode`, fixed by the format, and SentencePiece's `<0xNN>`
//! byte tokens.

use std::collections::HashMap;

use tokenizers::{DecoderWrapper, Tokenizer};

/// How vocabulary entries spell bytes, from the tokenizer's decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Spelling {
    /// GPT-2's byte-to-character table (`Ġ` is a space).
    ByteLevel,
    /// SentencePiece: `<0xNN>` is byte NN, `space` stands for a space.
    ByteFallback { space: char },
    /// The entry decodes to its text (no byte tokens).
    Text,
}

fn spelling(t: &Tokenizer) -> Spelling {
    fn walk(d: &DecoderWrapper, byte_level: &mut bool, fallback: &mut bool, space: &mut char) {
        match d {
            DecoderWrapper::ByteLevel(_) => *byte_level = true,
            DecoderWrapper::ByteFallback(_) => *fallback = true,
            DecoderWrapper::Metaspace(m) => *space = m.get_replacement(),
            DecoderWrapper::Replace(r) if r.content == " " => {
                // The pattern has no accessor; its serialized form names it.
                let v = serde_json::to_value(r).unwrap_or_default();
                let mut chars = v["pattern"]["String"].as_str().unwrap_or("").chars();
                if let (Some(c), None) = (chars.next(), chars.next()) {
                    *space = c;
                }
            }
            DecoderWrapper::Sequence(s) => {
                for d in s.get_decoders() {
                    walk(d, byte_level, fallback, space);
                }
            }
            _ => {}
        }
    }
    let (mut byte_level, mut fallback, mut space) = (false, false, '▁');
    if let Some(d) = t.get_decoder() {
        walk(d, &mut byte_level, &mut fallback, &mut space);
    }
    if byte_level {
        Spelling::ByteLevel
    } else if fallback || space != '▁' {
        Spelling::ByteFallback { space }
    } else {
        Spelling::Text
    }
}

/// GPT-2's `bytes_to_unicode`, inverted: printable Latin-1 characters
/// stand for themselves, the other bytes for U+0100 onwards in order.
fn byte_level_table() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        let c = b as char;
        if matches!(c, '!'..='~' | '\u{A1}'..='\u{AC}' | '\u{AE}'..='\u{FF}') {
            map.insert(c, b);
        } else {
            map.insert(char::from_u32(next).expect("below U+0200"), b);
            next += 1;
        }
    }
    map
}

/// Every id's bytes, `0..vocab_size` (empty for an id the vocabulary
/// lacks). Added tokens are their content.
pub(crate) fn table(t: &Tokenizer, vocab_size: usize) -> Vec<Box<[u8]>> {
    let spelling = spelling(t);
    let bl = byte_level_table();
    let added = t.get_added_tokens_decoder();
    (0..vocab_size as u32)
        .map(|id| -> Box<[u8]> {
            if let Some(a) = added.get(&id) {
                return a.content.as_bytes().into();
            }
            let Some(entry) = t.id_to_token(id) else {
                return Box::default();
            };
            match spelling {
                Spelling::ByteLevel => entry
                    .chars()
                    .map(|c| bl.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    // An entry outside the table is its own text.
                    .unwrap_or_else(|| entry.clone().into_bytes())
                    .into(),
                Spelling::ByteFallback { space } => {
                    let hex = entry
                        .strip_prefix("<0x")
                        .and_then(|r| r.strip_suffix('>'))
                        .filter(|h| h.len() == 2)
                        .and_then(|h| u8::from_str_radix(h, 16).ok());
                    match hex {
                        Some(b) => Box::new([b]) as Box<[u8]>,
                        None => entry.replace(space, " ").into_bytes().into(),
                    }
                }
                Spelling::Text => t.decode(&[id], false).unwrap_or(entry).into_bytes().into(),
            }
        })
        .collect()
}
