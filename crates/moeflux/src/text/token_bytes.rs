//! The bytes each token stands for, which decoding a token alone loses: a
//! byte-level BPE token may hold part of a UTF-8 character, and decoding it
//! gives U+FFFD. OpenAI's logprobs report these bytes.
//!
//! Hand-rolled because the `tokenizers` crate keeps its byte-to-character
//! table private and decodes only to `String`; the mapping is GPT-2's
//! `bytes_to_unicode`, fixed by the format, and SentencePiece's `<0xNN>`
//! byte tokens.

use tokenizers::{DecoderWrapper, Tokenizer};

/// How vocabulary entries spell bytes, from the tokenizer's decoder.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Spelling {
    /// GPT-2's byte-to-character table (`Ġ` is a space).
    ByteLevel,
    /// SentencePiece: `<0xNN>` is byte NN (byte fallback), `space`
    /// stands for a space.
    SentencePiece { space: char },
    /// The entry decodes to its text (no byte tokens).
    Text,
}

fn spelling(t: &Tokenizer) -> Spelling {
    /// What the decoder says: byte-level, or SentencePiece-like (byte
    /// fallback, a Metaspace or a `Replace` to a space) with its space.
    fn walk(d: &DecoderWrapper, byte_level: &mut bool, sp: &mut Option<char>) {
        match d {
            DecoderWrapper::ByteLevel(_) => *byte_level = true,
            DecoderWrapper::ByteFallback(_) => {
                sp.get_or_insert('▁');
            }
            DecoderWrapper::Metaspace(m) => *sp = Some(m.get_replacement()),
            DecoderWrapper::Replace(r) if r.content == " " => {
                // The pattern has no accessor; its serialized form names it.
                let v = serde_json::to_value(r).unwrap_or_default();
                let mut chars = v["pattern"]["String"].as_str().unwrap_or("").chars();
                if let (Some(c), None) = (chars.next(), chars.next()) {
                    *sp = Some(c);
                }
            }
            DecoderWrapper::Sequence(s) => {
                for d in s.get_decoders() {
                    walk(d, byte_level, sp);
                }
            }
            _ => {}
        }
    }
    let (mut byte_level, mut sp) = (false, None);
    if let Some(d) = t.get_decoder() {
        walk(d, &mut byte_level, &mut sp);
    }
    match (byte_level, sp) {
        (true, _) => Spelling::ByteLevel,
        (false, Some(space)) => Spelling::SentencePiece { space },
        (false, None) => Spelling::Text,
    }
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for
/// themselves, the other 68 for U+0100 onwards in order.
const fn printable(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// The bytes that U+0100, U+0101, ... stand for.
const SHIFTED: [u8; 68] = {
    let mut out = [0u8; 68];
    let (mut n, mut b) = (0, 0);
    while b < 256 {
        if !printable(b as u8) {
            out[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    out
};

/// The byte a byte-level BPE character stands for.
fn byte_of(c: char) -> Option<u8> {
    let u = c as u32;
    if u < 256 && printable(u as u8) {
        Some(u as u8)
    } else {
        let i = u.checked_sub(256)? as usize;
        SHIFTED.get(i).copied()
    }
}

/// What turns a token id into its bytes, made once per tokenizer.
#[derive(Debug, Clone)]
pub(crate) struct TokenSpelling {
    spelling: Spelling,
    /// Added tokens' ids, ascending: their bytes are their content.
    added: Vec<u32>,
}

impl TokenSpelling {
    pub(crate) fn of(t: &Tokenizer) -> Self {
        let mut added: Vec<u32> = t.get_added_tokens_decoder().into_keys().collect();
        added.sort_unstable();
        TokenSpelling {
            spelling: spelling(t),
            added,
        }
    }

    /// Token `id`'s bytes; `None` for an id the vocabulary lacks. A few
    /// lookups per call, so nothing vocabulary-sized is built.
    pub(crate) fn bytes(&self, t: &Tokenizer, id: u32) -> Option<Vec<u8>> {
        // An added token's "vocabulary form" is its content.
        let entry = t.id_to_token(id)?;
        if self.added.binary_search(&id).is_ok() {
            return Some(entry.into_bytes());
        }
        Some(match self.spelling {
            Spelling::ByteLevel => entry
                .chars()
                .map(byte_of)
                .collect::<Option<Vec<u8>>>()
                // An entry outside the table is its own text.
                .unwrap_or_else(|| entry.into_bytes()),
            Spelling::SentencePiece { space } => {
                let hex = entry
                    .strip_prefix("<0x")
                    .and_then(|r| r.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => vec![b],
                    None => entry.replace(space, " ").into_bytes(),
                }
            }
            Spelling::Text => t.decode(&[id], false).unwrap_or(entry).into_bytes(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s() {
        assert_eq!(byte_of('a'), Some(b'a'));
        assert_eq!(byte_of('Ġ'), Some(b' '));
        assert_eq!(byte_of('Ċ'), Some(b'\n'));
        assert_eq!(byte_of('\u{100}'), Some(0));
        assert_eq!(byte_of('\u{143}'), Some(0xAD));
        assert_eq!(byte_of('\u{144}'), None);
        assert_eq!(byte_of(' '), None);
        let all: std::collections::BTreeSet<u8> = (0..0x144u32)
            .filter_map(char::from_u32)
            .filter_map(byte_of)
            .collect();
        assert_eq!(all.len(), 256);
    }
}
