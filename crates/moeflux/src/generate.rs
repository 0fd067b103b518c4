//! Text generation over a `Session`: prompt prefill that reuses whatever
//! prefix the session already holds, then sampling and streaming
//! detokenization until EOS, a stop string, the token limit or cancellation.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::{procfs, IoStats};
use crate::model::timing::PhaseTimes;
use crate::sample::{Sampler, SamplerConfig, StopStrings};
use crate::session::{LogitsMode, Session};
use crate::text::harmony::{Channels, HarmonyIds};
use crate::text::stream::StreamDecoder;
use crate::text::tokenizer::Tokenizer;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation ends when the text contains one of these (not emitted).
    pub stop: Vec<String>,
    /// Tokens per prefill eval: the batch size of prompt processing, and the
    /// granularity of progress reports and cancellation.
    pub prefill_chunk: usize,
    /// The prompt leaves the model inside a reasoning block (the template
    /// opened `<think>`), so the first tokens are reasoning.
    pub starts_in_reasoning: bool,
    /// Take a session checkpoint once the prompt is in (a turn boundary a
    /// later prompt can return to without re-evaluating this one).
    pub checkpoint_after_prefill: bool,
    /// Keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            prefill_chunk: 512,
            starts_in_reasoning: false,
            checkpoint_after_prefill: false,
            ignore_eos: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string appeared in the text.
    Stop,
    /// `max_tokens` were generated, or the context is full.
    Length,
    /// The cancel flag was raised.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What a generation did and what it cost.
#[derive(Debug, Clone)]
pub struct GenerationStats {
    /// Prompt tokens evaluated now (the reused prefix excluded).
    pub prompt_tokens: usize,
    /// Prompt tokens found already evaluated in the session.
    pub reused_tokens: usize,
    pub prefill_time: Duration,
    pub generated_tokens: usize,
    pub decode_time: Duration,
    pub finish: FinishReason,
    /// The last sampled token, not yet evaluated into the session (the
    /// next eval should start with it to continue the sequence).
    pub pending: Option<u32>,
    /// Expert reads during this generation.
    pub io: IoStats,
    /// Bytes the process read from storage meanwhile (Linux), for a
    /// page-cache hit estimate.
    pub disk_read_bytes: Option<u64>,
    pub times: PhaseTimes,
}

impl GenerationStats {
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_tokens, self.prefill_time)
    }
    pub fn decode_tok_s(&self) -> f64 {
        // The first token comes from the prefill's logits.
        rate(self.generated_tokens.saturating_sub(1), self.decode_time)
    }
    /// Share of expert bytes served by the page cache (estimate).
    pub fn cache_hit_rate(&self) -> Option<f64> {
        procfs::cache_hit_rate(self.io.bytes, self.disk_read_bytes?)
    }
}

fn rate(n: usize, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        n as f64 / t.as_secs_f64()
    }
}

/// Events streamed to the caller.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event<'a> {
    /// `done` of `total` prompt tokens evaluated.
    Prefill { done: usize, total: usize },
    /// Newly completed text; `reasoning` inside a `<think>` block or a
    /// harmony `analysis` message (see [`Decoder`]).
    Text { text: &'a str, reasoning: bool },
}

/// Brings the session to exactly `prompt` and returns the last token's
/// logits, evaluating only what the session does not already hold: the
/// longest common prefix is kept (via `truncate`, i.e. checkpoints, for
/// linear-attention layers), or everything is re-evaluated when no
/// checkpoint allows keeping it. Returns (logits, reused tokens).
pub fn prefill(
    session: &mut Session,
    prompt: &[u32],
    chunk: usize,
    cancel: Option<&AtomicBool>,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<(Vec<f32>, usize)> {
    if prompt.is_empty() {
        return Err(Error::EmptyTokens);
    }
    // Refused before any work: a prompt that cannot fit would otherwise be
    // evaluated chunk by chunk up to the limit, and the session changed.
    if prompt.len() > session.max_context() {
        return Err(Error::ContextFull {
            requested: prompt.len(),
            limit: session.max_context(),
        });
    }
    let have = session.tokens();
    let mut keep = have.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    // The last prompt token must be evaluated now to get its logits.
    keep = keep.min(prompt.len() - 1);
    if keep < session.position() && session.truncate(keep).is_err() {
        // Prefer the nearest checkpoint below; else start over.
        let below = session
            .checkpoints()
            .into_iter()
            .filter(|&p| p <= keep)
            .max();
        match below {
            Some(p) => {
                session.restore_to(p)?;
                keep = p;
            }
            None => {
                session.clear();
                keep = 0;
            }
        }
    }
    let todo = &prompt[keep..];
    let chunk = chunk.max(1);
    let mut logits = Vec::new();
    for (i, part) in todo.chunks(chunk).enumerate() {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(Error::Cancelled);
        }
        logits = session.eval(part, LogitsMode::Last)?;
        on_event(Event::Prefill {
            done: (i * chunk + part.len()).min(todo.len()),
            total: todo.len(),
        });
    }
    Ok((logits, keep))
}

/// Prefills `prompt` (reusing the session's prefix) and generates.
pub fn generate(
    session: &mut Session,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    opts: &GenerateOptions,
    cancel: Option<&AtomicBool>,
    on_event: &mut dyn FnMut(Event<'_>),
) -> Result<GenerationStats> {
    opts.sampler.validate().map_err(Error::Invalid)?;
    let io0 = session.io_stats();
    let disk0 = procfs::disk_read_bytes();
    let times0 = session.times();

    let t0 = Instant::now();
    let (mut logits, reused) = prefill(session, prompt, opts.prefill_chunk, cancel, on_event)?;
    let prefill_time = t0.elapsed();
    if opts.checkpoint_after_prefill {
        session.checkpoint();
    }

    let mut dec = Decoder::new(tokenizer, opts);
    dec.prime(prompt)?;
    let greedy = dec.greedy();
    let mut generated = 0usize;
    let mut pending = None;
    // A greedy eval's token (the logits stay on the GPU).
    let mut picked = None;
    let t1 = Instant::now();
    let mut finish = FinishReason::Length;
    while generated < opts.max_tokens {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            finish = FinishReason::Cancelled;
            break;
        }
        if let Some(tok) = pending {
            if session.position() >= session.max_context() {
                break;
            }
            if greedy {
                picked = Some(session.eval_greedy(&[tok])?);
            } else {
                logits = session.eval(&[tok], LogitsMode::Last)?;
            }
        }
        let (tok, done) = match picked.take() {
            Some(t) => dec.accept(t, on_event)?,
            None => dec.next(&logits, session.tokens(), on_event)?,
        };
        generated += 1;
        pending = Some(tok);
        if let Some(f) = done {
            finish = f;
            break;
        }
    }
    dec.finish(finish, on_event)?;
    let decode_time = t1.elapsed();
    let disk_read_bytes = match (disk0, procfs::disk_read_bytes()) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    Ok(GenerationStats {
        prompt_tokens: prompt.len() - reused,
        reused_tokens: reused,
        prefill_time,
        generated_tokens: generated,
        decode_time,
        finish,
        pending,
        io: session.io_stats().since(&io0),
        disk_read_bytes,
        times: session.times().minus(&times0),
    })
}

/// The token-by-token half of generation, apart from evaluation: sampling,
/// end-of-sequence and stop strings, reasoning, streamed text. A caller
/// that evaluates many sequences together (the server's batch) keeps one
/// per sequence and feeds it each step's logits.
///
/// Reasoning is marked by the model's vocabulary: `<think>`/`</think>`
/// tokens, or OpenAI's harmony markers (gpt-oss, [`crate::text::harmony`]):
/// then the `analysis` channel is reasoning, headers are hidden, a tool
/// call is passed on in one spelling, and `<|return|>`/`<|call|>` end the
/// answer even where no config names them end-of-sequence tokens.
pub struct Decoder<'t> {
    tokenizer: &'t Tokenizer,
    sampler: Sampler,
    stream: StreamDecoder<'t>,
    stops: StopStrings,
    think: Option<(u32, u32)>,
    harmony: Option<(HarmonyIds, Channels)>,
    reasoning: bool,
    ignore_eos: bool,
}

impl<'t> Decoder<'t> {
    /// `opts`' sampler, stop strings, `starts_in_reasoning` and
    /// `ignore_eos` (the caller validates the sampler).
    pub fn new(tokenizer: &'t Tokenizer, opts: &GenerateOptions) -> Self {
        Decoder {
            tokenizer,
            sampler: Sampler::new(opts.sampler.clone()),
            stream: StreamDecoder::new(tokenizer, true),
            stops: StopStrings::new(opts.stop.clone()),
            think: tokenizer.think_ids(),
            harmony: HarmonyIds::from_tokenizer(tokenizer).map(|ids| (ids, Channels::new())),
            reasoning: opts.starts_in_reasoning,
            ignore_eos: opts.ignore_eos,
        }
    }

    /// Reads the end of the prompt where the output format needs it
    /// (harmony: the answer continues the prompt's last message, e.g. a
    /// header after `<|start|>assistant`, or a forced tool call's body).
    /// Call once, before the first token.
    pub fn prime(&mut self, prompt: &[u32]) -> Result<()> {
        if let Some((ids, channels)) = &mut self.harmony {
            channels.prime(ids, self.tokenizer, prompt)?;
        }
        Ok(())
    }

    /// Samples the next token from `logits` (`history`: the sequence so
    /// far, for penalties), streams the text it completes, and says whether
    /// generation ends with it (EOS or a stop string). The token is the
    /// sequence's next, to be evaluated if it goes on.
    pub fn next(
        &mut self,
        logits: &[f32],
        history: &[u32],
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<(u32, Option<FinishReason>)> {
        let tok = self.sample(logits, history);
        self.accept(tok, on_event)
    }

    /// The next token from `logits` (`history`: for penalties), not yet
    /// accepted: [`Decoder::next`] is this, then [`Decoder::accept`].
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.sampler.sample(logits, history)
    }

    /// Whether [`Decoder::next`] would pick the argmax of its logits (greedy
    /// sampling): the caller may then evaluate with `LogitsMode::Greedy`
    /// and pass the token to [`Decoder::accept`].
    pub fn greedy(&self) -> bool {
        self.sampler.is_greedy()
    }

    /// [`Decoder::next`] for a token picked already (a greedy eval's).
    pub fn accept(
        &mut self,
        tok: u32,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<(u32, Option<FinishReason>)> {
        if let Some(done) = self.harmony_marker(tok, on_event)? {
            return Ok((tok, done));
        }
        if !self.ignore_eos && self.tokenizer.is_eos(tok) {
            return Ok((tok, Some(FinishReason::Eos)));
        }
        if let Some((open, close)) = self.think {
            if tok == open || tok == close {
                // Flush text decided before the switch so it keeps its kind.
                let (text, _) = self.stops.push(&self.stream.finish_pending()?);
                emit(&text, self.reasoning, on_event);
                self.reasoning = tok == open;
                return Ok((tok, None));
            }
        }
        let piece = self.stream.push(tok)?;
        let hit = self.show(&piece, on_event);
        Ok((tok, hit.then_some(FinishReason::Stop)))
    }

    /// Shows decoded text as its kind (harmony: headers held back); true
    /// when a stop string appeared.
    fn show(&mut self, piece: &str, on_event: &mut dyn FnMut(Event<'_>)) -> bool {
        let (piece, reasoning) = match &mut self.harmony {
            Some((_, channels)) => {
                let shown = channels.text(piece);
                (shown.text, shown.reasoning)
            }
            None => (piece.to_string(), self.reasoning),
        };
        let (text, hit) = self.stops.push(&piece);
        emit(&text, reasoning, on_event);
        hit
    }

    /// A harmony marker token: the text before it is shown as its kind,
    /// then the marker moves the channels on. `Some(finish)` when `tok` was
    /// a marker (`Some(None)`: generation goes on).
    fn harmony_marker(
        &mut self,
        tok: u32,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<Option<Option<FinishReason>>> {
        let Some(marker) = self.harmony.as_ref().and_then(|(ids, _)| ids.marker(tok)) else {
            return Ok(None);
        };
        let pending = self.stream.finish_pending()?;
        let mut hit = self.show(&pending, on_event);
        let t = match &mut self.harmony {
            Some((_, channels)) => channels.marker(marker),
            None => return Ok(None),
        };
        if !hit {
            let (text, h) = self.stops.push(&t.text);
            emit(&text, false, on_event);
            hit = h;
        }
        Ok(Some(if hit {
            Some(FinishReason::Stop)
        } else if t.ends && !self.ignore_eos {
            Some(FinishReason::Eos)
        } else {
            None
        }))
    }

    /// The stop string that ended generation ([`FinishReason::Stop`]).
    pub fn stop_string(&self) -> Option<&str> {
        self.stops.matched()
    }

    /// Flushes the text held back, unless generation ended on a stop string.
    pub fn finish(
        &mut self,
        finish: FinishReason,
        on_event: &mut dyn FnMut(Event<'_>),
    ) -> Result<()> {
        if finish != FinishReason::Stop {
            let text = self.stream.finish()?;
            self.show(&text, on_event);
            let reasoning = match &self.harmony {
                Some((_, channels)) => channels.in_reasoning(),
                None => self.reasoning,
            };
            let rest = self.stops.finish();
            emit(&rest, reasoning, on_event);
        }
        Ok(())
    }
}

fn emit(text: &str, reasoning: bool, on_event: &mut dyn FnMut(Event<'_>)) {
    if !text.is_empty() {
        on_event(Event::Text { text, reasoning });
    }
}
