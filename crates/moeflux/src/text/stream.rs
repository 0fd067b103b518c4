//! Incremental detokenization: text out as soon as it is complete.
//!
//! A byte-level BPE token is a run of bytes, not of characters: a CJK
//! character or an emoji is often split over two to four tokens, and
//! decoding each token alone would print U+FFFD. [`StreamDecoder`] holds
//! tokens back until their bytes complete, with the prefix-offset scheme of
//! Hugging Face's `TextStreamer` and text-generation-inference: it decodes a
//! small window `ids[prefix..]` and emits what extends the already emitted
//! `decode(ids[prefix..read])`, once that no longer ends in U+FFFD. Decoding
//! with a little context before the new tokens also keeps decoders that
//! drop a leading space at the start of a text (SentencePiece's `▁`) right.

use crate::error::Result;
use crate::text::tokenizer::Tokenizer;

/// Tokens held back at most before they are emitted anyway (lossily). A
/// UTF-8 character has at most 4 bytes, so only a model that writes
/// invalid UTF-8 (or long runs of tokens that decode to nothing) gets here.
const MAX_PENDING: usize = 16;

const REPLACEMENT: char = '\u{FFFD}';

/// Turns token ids, fed one at a time, into text pieces whose concatenation
/// is `tokenizer.decode(all ids)` whenever the ids spell valid UTF-8. Every
/// piece is whole characters: it never ends inside a multi-byte character.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    /// The window: context tokens `[..read]`, pending tokens `[read..]`.
    ids: Vec<u32>,
    /// `ids[prefix..read]` is the context already emitted.
    prefix: usize,
    read: usize,
    /// `decode(ids[prefix..read])`.
    prefix_text: String,
    /// Tokens pushed so far (for error messages).
    pushed: usize,
}

impl<'a> StreamDecoder<'a> {
    /// With `skip_special`, special tokens produce no text.
    pub fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tokenizer,
            skip_special,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            prefix_text: String::new(),
            pushed: 0,
        }
    }

    /// Feeds one token; returns the text it completes (often empty while a
    /// character is incomplete). An id outside the vocabulary is an error
    /// and leaves the decoder as it was.
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.check_id(id, self.pushed)?;
        self.pushed += 1;
        self.ids.push(id);
        let text = self.decode_window()?;
        if text.len() > self.prefix_text.len()
            && text.starts_with(&self.prefix_text)
            && !text.ends_with(REPLACEMENT)
        {
            let new = text[self.prefix_text.len()..].to_string();
            self.advance()?;
            return Ok(new);
        }
        if self.ids.len() - self.read > MAX_PENDING {
            return self.flush();
        }
        Ok(String::new())
    }

    /// Emits whatever is held back (lossily if its bytes are incomplete) and
    /// keeps the context, so streaming can go on: for a point where the
    /// text must be cut, such as before a `<think>` tag.
    pub fn finish_pending(&mut self) -> Result<String> {
        self.flush()
    }

    /// Emits whatever is held back (U+FFFD for bytes that never completed
    /// into a character: only a model that wrote invalid UTF-8 sees one) and
    /// resets the decoder for a new sequence.
    pub fn finish(&mut self) -> Result<String> {
        let out = self.flush()?;
        self.ids.clear();
        self.prefix = 0;
        self.read = 0;
        self.prefix_text.clear();
        Ok(out)
    }

    /// Whether tokens are held back.
    pub fn has_pending(&self) -> bool {
        self.read < self.ids.len()
    }

    fn decode_window(&self) -> Result<String> {
        self.tokenizer
            .decode(&self.ids[self.prefix..], self.skip_special)
    }

    fn flush(&mut self) -> Result<String> {
        if !self.has_pending() {
            return Ok(String::new());
        }
        let text = self.decode_window()?;
        let new = match text.strip_prefix(self.prefix_text.as_str()) {
            Some(rest) => rest.to_string(),
            // The context itself changed meaning (it ended in bytes that a
            // forced flush emitted as U+FFFD): decode the new tokens alone.
            None => self
                .tokenizer
                .decode(&self.ids[self.read..], self.skip_special)?,
        };
        self.advance()?;
        Ok(new)
    }

    /// The pending tokens become the context; older ones are dropped.
    fn advance(&mut self) -> Result<()> {
        self.ids.drain(..self.read);
        self.prefix = 0;
        self.read = self.ids.len();
        self.prefix_text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        Ok(())
    }
}
