//! OpenAI's `logprobs`: the request fields checked, and the engine's
//! per-token log-probabilities ([`TokenLogprobs`]) in the answer's shapes:
//! chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` and the
//! legacy completions' `{tokens, token_logprobs, top_logprobs,
//! text_offset}`.
//!
//! A token's text is its bytes decoded lossily (a token that holds part of
//! a UTF-8 character shows U+FFFD; `bytes` has the exact bytes). JSON has
//! no `-inf`: a token the logits rule out gets [`NEG_INF_LOGPROB`], as
//! OpenAI and vLLM report it.

use std::sync::Arc;

use moeflux::logprobs::{TokenLogprobs, MAX_TOP};
use moeflux::text::tokenizer::Tokenizer;
use serde_json::{json, Map, Value as Json};

use crate::error::ApiError;

/// Most `logprobs` alternatives of the legacy completions endpoint.
pub const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// What stands for a log-probability of `-inf` in JSON.
pub const NEG_INF_LOGPROB: f64 = -9999.0;

/// Chat's `logprobs` (bool) and `top_logprobs` (0..=20): how many
/// alternatives to report per token, `None` when logprobs are off.
pub fn chat_request(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    if let Some(n) = top {
        if !(0..=MAX_TOP as i64).contains(&n) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be in [0, {MAX_TOP}], got {n}"),
            ));
        }
    }
    match (logprobs, top) {
        (Some(true), n) => Ok(Some(n.unwrap_or(0) as usize)),
        (_, Some(n)) if n > 0 => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        )),
        _ => Ok(None),
    }
}

/// The legacy completions' `logprobs` (0..=5: the sampled token's plus
/// that many alternatives) and `echo`, which is refused (see README:
/// prompt logprobs would need the LM head over every prompt position).
pub fn completion_request(
    logprobs: Option<i64>,
    echo: Option<bool>,
) -> Result<Option<usize>, ApiError> {
    if let Some(n) = logprobs {
        if !(0..=MAX_COMPLETION_LOGPROBS).contains(&n) {
            return Err(ApiError::invalid(
                "logprobs",
                format!("`logprobs` must be in [0, {MAX_COMPLETION_LOGPROBS}], got {n}"),
            ));
        }
    }
    if echo == Some(true) {
        let why = if logprobs.is_some() {
            "echo is not supported: the prompt's logprobs would need the logits of every \
             prompt position, which the engine does not compute"
        } else {
            "echo is not supported"
        };
        return Err(ApiError::invalid("echo", why));
    }
    Ok(logprobs.map(|n| n as usize))
}

fn value(lp: f64) -> f64 {
    if lp.is_finite() {
        lp
    } else {
        NEG_INF_LOGPROB
    }
}

/// A job's token log-probabilities on their way into its answer: pushed
/// as the engine reports them, taken by the chunk (or answer) that
/// carries them.
pub struct LogprobsOut {
    tokenizer: Arc<Tokenizer>,
    chat: bool,
    pending: Vec<TokenLogprobs>,
    /// Completions: characters of the token texts taken so far (the next
    /// token's `text_offset`).
    offset: usize,
}

impl LogprobsOut {
    pub fn new(tokenizer: Arc<Tokenizer>, chat: bool) -> Self {
        LogprobsOut {
            tokenizer,
            chat,
            pending: Vec::new(),
            offset: 0,
        }
    }

    pub fn push(&mut self, lp: TokenLogprobs) {
        self.pending.push(lp);
    }

    /// The tokens pushed since the last take, as a choice's `logprobs`
    /// (empty lists when there are none).
    pub fn take(&mut self) -> Json {
        let pending = std::mem::take(&mut self.pending);
        if self.chat {
            let content: Vec<Json> = pending.iter().map(|t| self.chat_entry(t)).collect();
            json!({"content": content, "refusal": null})
        } else {
            self.completion_logprobs(&pending)
        }
    }

    /// [`take`](Self::take), or `None` when nothing is pending (a streamed
    /// chunk without tokens).
    pub fn take_some(&mut self) -> Option<Json> {
        (!self.pending.is_empty()).then(|| self.take())
    }

    /// A token's text (its bytes decoded lossily) and bytes.
    fn token(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    fn chat_entry(&self, t: &TokenLogprobs) -> Json {
        let entry = |id, lp| {
            let (text, bytes) = self.token(id);
            json!({"token": text, "logprob": value(lp), "bytes": bytes})
        };
        let mut e = entry(t.id, t.logprob);
        e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
        e
    }

    /// The legacy shape: per token its text, log-probability, the most
    /// likely tokens by text (the sampled one added when not among them,
    /// as OpenAI documents: up to `logprobs + 1` entries; of two tokens with
    /// one text, the likelier) and its character offset in the completion.
    fn completion_logprobs(&mut self, pending: &[TokenLogprobs]) -> Json {
        let (mut tokens, mut token_logprobs, mut top, mut offsets) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for t in pending {
            let text = self.token(t.id).0;
            let mut alts = Map::new();
            for &(id, lp) in t.top.iter().chain([(t.id, t.logprob)].iter()) {
                alts.entry(self.token(id).0).or_insert(value(lp).into());
            }
            offsets.push(self.offset);
            self.offset += text.chars().count();
            tokens.push(text);
            token_logprobs.push(value(t.logprob));
            top.push(Json::Object(alts));
        }
        json!({
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_fields() {
        assert_eq!(chat_request(None, None).unwrap(), None);
        assert_eq!(chat_request(Some(false), Some(0)).unwrap(), None);
        assert_eq!(chat_request(Some(true), None).unwrap(), Some(0));
        assert_eq!(chat_request(Some(true), Some(20)).unwrap(), Some(20));
        for (lp, top) in [
            (Some(true), 21),
            (Some(true), -1),
            (None, 3),
            (Some(false), 1),
        ] {
            let e = chat_request(lp, Some(top)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("top_logprobs"), "{lp:?} {top}");
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn completion_fields() {
        assert_eq!(completion_request(None, None).unwrap(), None);
        assert_eq!(completion_request(Some(0), Some(false)).unwrap(), Some(0));
        assert_eq!(completion_request(Some(5), None).unwrap(), Some(5));
        for n in [6, -1] {
            let e = completion_request(Some(n), None).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("logprobs"));
        }
        let e = completion_request(Some(1), Some(true)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
        assert!(
            e.message.contains("logits of every prompt position"),
            "{}",
            e.message
        );
        let e = completion_request(None, Some(true)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("echo"));
    }

    fn fixture_tokenizer() -> Arc<Tokenizer> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen35moe-q4/src");
        Arc::new(Tokenizer::from_model_dir(dir).unwrap())
    }

    #[test]
    fn shapes() {
        let tok = fixture_tokenizer();
        // A token that is part of a character: "🦙" is four byte tokens here.
        let ids = tok.encode("a🦙", false).unwrap();
        let (a, partial) = (ids[0], ids[1]);
        assert!(std::str::from_utf8(&tok.token_bytes(partial).unwrap()).is_err());
        let lp = |id, logprob, top: Vec<(u32, f64)>| TokenLogprobs { id, logprob, top };

        let mut chat = LogprobsOut::new(tok.clone(), true);
        assert_eq!(chat.take_some(), None);
        chat.push(lp(a, -0.5, vec![(a, -0.5), (2, f64::NEG_INFINITY)]));
        chat.push(lp(partial, -1.25, vec![]));
        let v = chat.take();
        let c = &v["content"];
        assert_eq!(c[0]["token"], "a");
        assert_eq!(c[0]["logprob"], -0.5);
        assert_eq!(c[0]["bytes"], json!([97]));
        assert_eq!(c[0]["top_logprobs"][1]["token"], "<|im_end|>");
        assert_eq!(c[0]["top_logprobs"][1]["logprob"], NEG_INF_LOGPROB);
        assert_eq!(c[1]["token"], "\u{FFFD}");
        assert_eq!(c[1]["bytes"], json!(tok.token_bytes(partial).unwrap()));
        assert_eq!(c[1]["top_logprobs"], json!([]));
        assert_eq!(chat.take()["content"], json!([]));

        let mut cmpl = LogprobsOut::new(tok.clone(), false);
        cmpl.push(lp(partial, -3.0, vec![(a, -0.5)]));
        let v = cmpl.take();
        assert_eq!(v["tokens"], json!(["\u{FFFD}"]));
        assert_eq!(v["token_logprobs"], json!([-3.0]));
        // The sampled token is added to the alternatives.
        assert_eq!(v["top_logprobs"], json!([{"a": -0.5, "\u{FFFD}": -3.0}]));
        assert_eq!(v["text_offset"], json!([0]));
        // Offsets go on across takes (a stream's chunks).
        cmpl.push(lp(a, -0.1, vec![(a, -0.1)]));
        cmpl.push(lp(a, -0.2, vec![(a, -0.2)]));
        let v = cmpl.take();
        assert_eq!(v["text_offset"], json!([1, 2]));
        assert_eq!(v["top_logprobs"], json!([{"a": -0.1}, {"a": -0.2}]));
    }
}
