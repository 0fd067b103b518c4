//! Constrained sampling: a grammar (llguidance's Lark dialect, JSON schemas
//! inside it as `%json {..}`; see [`crate::structured`]) decides, token by
//! token, which tokens may come next. The job's sampler then draws only
//! among those (temperature, top-p and the rest still apply to them).
//!
//! [`GrammarEngine`]: the tokenizer's vocabulary as llguidance's token trie,
//! built once per server (on the first structured request). [`Constraint`]:
//! one job's grammar state: [`Constraint::mask`] before each draw,
//! [`Constraint::commit`] after it. End-of-sequence is allowed only where
//! the grammar accepts; once the grammar admits nothing more, the job ends.
//!
//! Reasoning: a prompt that leaves the model inside `<think>` is answered
//! with free reasoning first (every token but end-of-sequence allowed); the
//! grammar starts after `</think>`.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{
    InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv,
};
use llguidance::{Matcher, ParserFactory};
use moeflux::text::tokenizer::{Tokenizer, MAX_TOKENIZER_BYTES, TOOL_CALL_MARKUP};

/// The vocabulary as llguidance sees it, shared by every constrained job.
pub struct GrammarEngine {
    factory: ParserFactory,
    tokenizer: Arc<Tokenizer>,
}

/// llguidance's view of the model's tokenizer: the byte strings of the
/// tokens (the trie) and the tokenizer itself for whole strings.
struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The model's own tokenization where the bytes are text (so forced
    /// strings come out as the model would write them), else the trie's
    /// greedy one.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        std::str::from_utf8(s)
            .ok()
            .and_then(|t| self.tokenizer.encode_as_text(t, false).ok())
            .unwrap_or_else(|| self.trie.greedy_tokenize(s))
    }
}

impl GrammarEngine {
    /// Builds the token trie from the tokenizer's `tokenizer.json` (read
    /// again: the byte form of each token, which llguidance derives from
    /// the file's vocabulary and decoder, is not kept by the loaded
    /// tokenizer).
    ///
    /// Special tokens, `<think>`/`</think>` and the tool-call markup tokens
    /// are marked special for the grammar: free text in a grammar (a JSON
    /// string, say) never produces them, and a grammar names them as
    /// `<|im_end|>`-style tokens.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<GrammarEngine, String> {
        let path = tokenizer.source();
        let text = moeflux::format::read_small_text(path, MAX_TOKENIZER_BYTES)
            .map_err(|e| e.to_string())?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("{}: not valid JSON: {e}", path.display()))?;
        // llguidance asserts on some malformed vocabularies; a panic here is
        // that file's error, not the server's.
        let bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| format!("{}: vocabulary not understood", path.display()))?
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut words = bytes;
        words.resize(words.len().max(tokenizer.vocab_size()), Vec::new());
        let marker = TokTrie::SPECIAL_TOKEN_MARKER;
        let mut special: Vec<u32> = tokenizer.special_ids().to_vec();
        special.extend(
            tokenizer
                .think_ids()
                .map(|(a, b)| [a, b])
                .into_iter()
                .flatten(),
        );
        special.extend(
            TOOL_CALL_MARKUP
                .iter()
                .filter_map(|t| tokenizer.token_to_id(t)),
        );
        for id in special {
            if let Some(w) = words.get_mut(id as usize) {
                if w.first() != Some(&marker) {
                    if let Some(name) = tokenizer.id_to_token(id) {
                        *w = std::iter::once(marker).chain(name.into_bytes()).collect();
                    }
                }
            }
        }
        let n = u32::try_from(words.len()).map_err(|_| "vocabulary too large".to_string())?;
        // The trie's EOS: the model's first; every EOS id is handled in
        // `Constraint::mask` (a model may have several).
        let eos = tokenizer.eos_ids().first().copied().unwrap_or(n);
        let eos = if eos < n { eos } else { n.saturating_sub(1) };
        let trie = TokTrie::from(&TokRxInfo::new(n, eos), &words);
        let env: TokEnv = Arc::new(Vocab {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new(
            &env,
            InferenceCapabilities::default(),
            &llguidance::earley::SlicedBiasComputer::general_slices(),
        )
        .map_err(|e| format!("grammar engine: {e}"))?;
        factory.quiet();
        Ok(GrammarEngine { factory, tokenizer })
    }

    /// Compiles `lark` (llguidance's Lark dialect) for one job. The error
    /// is llguidance's message (a schema it cannot take, a bad grammar).
    /// `in_reasoning`: the answer starts inside a `<think>` block.
    pub fn constraint(&self, lark: &str, in_reasoning: bool) -> Result<Constraint, String> {
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher_error(&matcher) {
            return Err(e);
        }
        let think_close = self.tokenizer.think_ids().map(|(_, close)| close);
        Ok(Constraint {
            matcher,
            eos: self.tokenizer.eos_ids().to_vec(),
            trie_eos: self.factory.tok_env().tok_trie().eos_token(),
            vocab: self.factory.tok_env().tok_trie().vocab_size(),
            reasoning: in_reasoning && think_close.is_some(),
            think_close,
        })
    }

    /// Whether `name` (`<|im_end|>`, `</tool_call>`) is one token marked
    /// special for grammars (a grammar then names it as `<name>`).
    pub fn has_special(&self, name: &str) -> bool {
        let mut bytes = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        bytes.extend_from_slice(name.as_bytes());
        self.factory
            .tok_env()
            .tok_trie()
            .token_id_at_bytes(&bytes)
            .is_some()
    }
}

fn matcher_error(m: &Matcher) -> Option<String> {
    m.is_error().then(|| m.get_error().unwrap_or_default())
}

/// One job's grammar state.
pub struct Constraint {
    matcher: Matcher,
    /// The model's end-of-sequence ids.
    eos: Vec<u32>,
    /// The id llguidance's mask uses for "the grammar may end here".
    trie_eos: TokenId,
    /// Tokens the grammar knows; logits beyond (a padded LM head) are never
    /// allowed.
    vocab: usize,
    /// Still inside the reasoning block (the grammar has not started).
    reasoning: bool,
    think_close: Option<u32>,
}

impl Constraint {
    /// Sets the logits of the tokens the grammar does not allow now to
    /// `-inf`. An error is the grammar engine's (it should not happen: the
    /// grammar always allows some token until it has ended).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        if self.reasoning {
            // Free reasoning, but the answer must come: no end before it.
            for &e in &self.eos {
                if let Some(l) = logits.get_mut(e as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
            return Ok(());
        }
        // Once the grammar has ended, only end-of-sequence.
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        // The mask's EOS bit says whether the grammar may end here; every
        // EOS id of the model then keeps its logit, else only one the
        // grammar names (harmony's `<|call|>` closing a strict call).
        let accepting = allowed.is_allowed(self.trie_eos);
        let eos: Vec<(usize, f32)> = self
            .eos
            .iter()
            .filter_map(|&e| Some((e as usize, *logits.get(e as usize)?)))
            .collect();
        apply(&allowed, self.vocab, logits);
        if accepting {
            for (e, l) in eos {
                logits[e] = l;
            }
            if self.eos.is_empty() {
                // No EOS known: the trie's stand-in is a real token, not
                // an end (the job ends when the grammar does).
                if let Some(l) = logits.get_mut(self.trie_eos as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        Ok(())
    }

    /// Advances the grammar past `tok`, the token just drawn (an
    /// end-of-sequence token ends the job and is not passed on).
    pub fn commit(&mut self, tok: u32) -> Result<(), String> {
        if self.reasoning {
            if Some(tok) == self.think_close {
                self.reasoning = false;
            }
            return Ok(());
        }
        if self.eos.contains(&tok) {
            return Ok(());
        }
        self.matcher.consume_token(tok).map_err(|e| e.to_string())
    }

    /// True once the grammar has ended: nothing more may follow.
    pub fn done(&self) -> bool {
        !self.reasoning && self.matcher.is_stopped()
    }
}

/// `-inf` for every logit `allowed` does not set (and beyond `vocab`).
fn apply(allowed: &SimpleVob, vocab: usize, logits: &mut [f32]) {
    let words = allowed.as_slice();
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = if w * 32 < vocab {
            words.get(w).copied().unwrap_or(0)
        } else {
            0
        };
        if bits == u32::MAX {
            continue;
        }
        for (b, l) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use moeflux::sample::{Sampler, SamplerConfig};
    use serde_json::{json, Value as Json};

    /// The engine over the fixture model's tokenizer (1,024 byte-level BPE
    /// tokens, `<|im_end|>` its EOS).
    pub(crate) fn engine() -> GrammarEngine {
        GrammarEngine::new(Arc::new(fixture_tokenizer())).unwrap()
    }

    fn fixture_tokenizer() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen35moe-q4/src");
        Tokenizer::from_model_dir(dir).unwrap()
    }

    /// Text drawn from seeded random logits (a model that knows nothing)
    /// through `lark`, until the grammar ends or `limit` tokens; whether it
    /// ended.
    pub(crate) fn draw(e: &GrammarEngine, lark: &str, seed: u64, limit: usize) -> (String, bool) {
        let mut c = e.constraint(lark, false).unwrap();
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 1.0,
            seed,
            ..Default::default()
        });
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut ids = Vec::new();
        for _ in 0..limit {
            let mut logits: Vec<f32> = (0..e.tokenizer.vocab_size())
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0
                })
                .collect();
            c.mask(&mut logits).unwrap();
            let tok = sampler.sample(&logits, &ids);
            if e.tokenizer.is_eos(tok) {
                return (e.tokenizer.decode(&ids, true).unwrap(), true);
            }
            c.commit(tok).unwrap();
            ids.push(tok);
            if c.done() {
                return (e.tokenizer.decode(&ids, true).unwrap(), true);
            }
        }
        (e.tokenizer.decode(&ids, true).unwrap(), false)
    }

    fn json_grammar(schema: Json) -> String {
        crate::structured::grammar(
            &crate::structured::Request {
                schema: Some(&schema),
                tools: &[],
                forced: None,
                harmony: false,
            },
            &|_| false,
        )
        .unwrap()
        .unwrap()
        .lark
    }

    #[test]
    fn random_logits_give_json_that_follows_the_schema() {
        let e = engine();
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 6},
                "color": {"enum": ["red", "green", "blue"]},
                "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
                "owner": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"}},
                    "required": ["id", "ok"],
                    "additionalProperties": false
                }
            },
            "required": ["name", "color", "sizes", "owner"],
            "additionalProperties": false
        });
        let g = json_grammar(schema);
        for seed in 1..=8 {
            let (text, ended) = draw(&e, &g, seed, 400);
            assert!(ended, "seed {seed}: {text:?}");
            let v: Json =
                serde_json::from_str(&text).unwrap_or_else(|err| panic!("{text:?}: {err}"));
            let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
            assert_eq!(keys, ["name", "color", "sizes", "owner"], "{text}");
            assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{text}");
            assert!(
                ["red", "green", "blue"].contains(&v["color"].as_str().unwrap()),
                "{text}"
            );
            let sizes = v["sizes"].as_array().unwrap();
            assert!(
                sizes.len() <= 3 && sizes.iter().all(|n| n.as_u64().is_some_and(|n| n <= 99)),
                "{text}"
            );
            assert!(
                (1..=9).contains(&v["owner"]["id"].as_u64().unwrap()),
                "{text}"
            );
            assert!(v["owner"]["ok"].is_boolean(), "{text}");
            // Python's separators, no other whitespace.
            assert_eq!(text, python_dumps(&v), "{text}");
        }
    }

    /// `json.dumps(v)`: `", "` and `": "` between items, nothing else.
    fn python_dumps(v: &Json) -> String {
        match v {
            Json::Array(a) => format!(
                "[{}]",
                a.iter().map(python_dumps).collect::<Vec<_>>().join(", ")
            ),
            Json::Object(o) => format!(
                "{{{}}}",
                o.iter()
                    .map(|(k, v)| format!("{}: {}", Json::from(k.as_str()), python_dumps(v)))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            scalar => scalar.to_string(),
        }
    }

    #[test]
    fn end_of_sequence_only_where_the_grammar_accepts() {
        let e = engine();
        let eos = e.tokenizer.eos_ids()[0] as usize;
        let mut c = e
            .constraint(
                &json_grammar(json!({"type": "array", "items": {"type": "integer"}})),
                false,
            )
            .unwrap();
        let mut logits = vec![0.0; e.tokenizer.vocab_size()];
        c.mask(&mut logits).unwrap();
        assert_eq!(logits[eos], f32::NEG_INFINITY);
        let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 0.0).collect();
        let open = e.tokenizer.token_to_id("[").unwrap() as usize;
        assert!(allowed.contains(&open), "{allowed:?}");
        for tok in e.tokenizer.encode("[1, 2", false).unwrap() {
            c.commit(tok).unwrap();
        }
        let mut logits = vec![0.0; e.tokenizer.vocab_size() + 7];
        c.mask(&mut logits).unwrap();
        assert_eq!(logits[eos], f32::NEG_INFINITY);
        // The padded LM head's extra rows are never allowed.
        assert!(logits[e.tokenizer.vocab_size()..]
            .iter()
            .all(|&l| l == f32::NEG_INFINITY));
        for tok in e.tokenizer.encode("]", false).unwrap() {
            c.commit(tok).unwrap();
        }
        let mut logits = vec![0.0; e.tokenizer.vocab_size()];
        c.mask(&mut logits).unwrap();
        assert!(c.done() || logits[eos] == 0.0);
        // A token the grammar does not allow is an error, not a panic.
        let mut c = e
            .constraint(&json_grammar(json!({"type": "integer"})), false)
            .unwrap();
        assert!(c.commit(e.tokenizer.token_to_id("a").unwrap()).is_err());
    }

    /// The constraint's cost per token, against sampling alone, on a
    /// tokenizer of your choice (docs/PERFORMANCE.md; on demand):
    /// `MOEFLUX_MASK_TOKENIZER=target/tokenizer-data/qwen2.tokenizer.json
    /// cargo test -p moeflux-server --lib mask_cost -- --ignored --nocapture` (the
    /// test profile is optimised)
    #[test]
    #[ignore]
    fn mask_cost() {
        use std::time::{Duration, Instant};
        let tok = match std::env::var_os("MOEFLUX_MASK_TOKENIZER") {
            Some(p) => Tokenizer::from_file(p).unwrap(),
            None => fixture_tokenizer(),
        };
        let t0 = Instant::now();
        let e = GrammarEngine::new(Arc::new(tok)).unwrap();
        let built = t0.elapsed();
        let lark = json_grammar(json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 16},
                "kind": {"enum": ["book", "tool", "food"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
                "price": {"type": "object", "properties": {"amount": {"type": "number"}, "currency": {"type": "string", "maxLength": 3}},
                          "required": ["amount", "currency"], "additionalProperties": false}
            },
            "required": ["name", "kind", "tags", "price"],
            "additionalProperties": false
        }));
        let n = e.tokenizer.vocab_size();
        let mut state = 7u64;
        let mut random = || {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0
                })
                .collect::<Vec<f32>>()
        };
        let (mut masked, mut sampled, mut tokens, mut compiled) =
            (Duration::ZERO, Duration::ZERO, 0, Duration::ZERO);
        for seed in 0..20 {
            let t = Instant::now();
            let mut c = e.constraint(&lark, false).unwrap();
            compiled += t.elapsed();
            let mut sampler = Sampler::new(SamplerConfig {
                temperature: 1.0,
                seed,
                ..Default::default()
            });
            let mut ids = Vec::new();
            while !c.done() && ids.len() < 300 {
                let mut logits = random();
                let t = Instant::now();
                c.mask(&mut logits).unwrap();
                let m = t.elapsed();
                let t = Instant::now();
                let tok = sampler.sample(&logits, &ids);
                sampled += t.elapsed();
                if e.tokenizer.is_eos(tok) {
                    break;
                }
                let t = Instant::now();
                c.commit(tok).unwrap();
                masked += m + t.elapsed();
                ids.push(tok);
                tokens += 1;
            }
        }
        // Sampling the unmasked logits: the cost without a constraint.
        let mut sampler = Sampler::new(SamplerConfig {
            temperature: 1.0,
            ..Default::default()
        });
        let mut free = Duration::ZERO;
        for _ in 0..tokens {
            let logits = random();
            let t = Instant::now();
            sampler.sample(&logits, &[]);
            free += t.elapsed();
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3 / tokens as f64;
        println!(
            "vocabulary {n}: engine built in {:.0} ms, grammar compiled in {:.2} ms; {tokens} tokens: mask + commit {:.3} ms/token, sampling {:.3} ms/token masked, {:.3} ms/token unmasked",
            built.as_secs_f64() * 1e3,
            compiled.as_secs_f64() * 1e3 / 20.0,
            ms(masked),
            ms(sampled),
            ms(free),
        );
    }

    #[test]
    fn a_schema_llguidance_refuses_is_an_error() {
        let e = engine();
        let bad = json_grammar(
            json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}),
        );
        assert!(e.constraint(&bad, false).is_err());
        assert!(e.constraint("start: (", false).is_err());
    }
}
