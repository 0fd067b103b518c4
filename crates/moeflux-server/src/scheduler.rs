//! The engine thread's loop: continuous batching over the slots of one
//! `Batch`. Each step takes the next token of every decoding job and
//! chunks of the prefilling jobs' prompts (oldest first) up to the step's
//! token budget, evaluates them in one `Batch::step`, then samples, streams
//! and finishes per job. Jobs join a free slot between steps and leave it
//! when they end; a slot keeps its sequence's tokens for the next job's
//! prefix reuse.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;

use moeflux::generate::{Decoder, Event, FinishReason, GenerateOptions};
use moeflux::logprobs::TokenLogprobs;
use moeflux::text::tokenizer::Tokenizer;
use moeflux::{Batch, LogitsMode, Output, SeqId, Work};

use crate::engine::{engine_error, EngineEvent, EngineOptions, Job, Outcome, Queued, CANCELLED};
use crate::error::ApiError;
use crate::metrics::{GenerationSample, Metrics, StepSample};
use crate::prefix_cache::PrefixCache;
use crate::step_log::{StepLog, StepRecord};

/// A sequence of the batch, and whether a job holds it.
struct Slot {
    seq: SeqId,
    busy: bool,
    /// When a job last took it (the job count): among slots that hold
    /// nothing of a prompt, the least recently used is taken, so recent
    /// conversations stay live.
    used: u64,
}

/// A job that holds a slot.
struct Running<'t> {
    job: Job,
    /// Held until the job ends (its place in the engine).
    admission: Option<crate::engine::Admission>,
    queued: Duration,
    t0: Instant,
    slot: usize,
    /// The prompt prefix restored from the prefix cache, if any (dropped
    /// from the cache when the job fails: a bad entry must not fail its
    /// conversation again and again).
    restored: Option<usize>,
    /// Prompt tokens not evaluated for this job.
    cached: usize,
    /// Prompt positions where prefill pauses, ascending: message
    /// boundaries (checkpoint + snapshot), the last prompt token
    /// (checkpoint), the prompt's end (the first token is sampled).
    stops: Vec<usize>,
    decoder: Decoder<'t>,
    /// The sampled token to evaluate next (decoding).
    pending: Option<u32>,
    /// The log-probabilities of the token just sampled (the job asked).
    logprob: Option<TokenLogprobs>,
    generated: usize,
    max_tokens: usize,
    /// When the first token was sampled.
    first_token: Option<Instant>,
}

impl Running<'_> {
    /// The next token from `logits` (`history`: for penalties), masked by
    /// the job's grammar first if it has one; and its log-probabilities
    /// when the job asked: of the logits as the model gave them, before the
    /// mask, penalties and temperature. An error is the grammar engine's.
    fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> Result<u32, String> {
        let top = self.job.params.logprobs;
        // The mask changes the logits; the raw ones are kept only when
        // both a grammar and logprobs need them.
        let raw = match self.job.constraint.as_mut() {
            Some(c) => {
                let raw = top.map(|_| logits.to_vec());
                c.mask(logits)?;
                raw
            }
            None => None,
        };
        let tok = self.decoder.sample(logits, history);
        let seen = raw.as_deref().unwrap_or(logits);
        self.logprob = top.map(|top| moeflux::logprobs::token_logprobs(seen, tok, top));
        Ok(tok)
    }
}

/// How a running job ends.
enum End {
    Done(FinishReason),
    Failed(ApiError),
}

pub(crate) struct Scheduler<'t> {
    batch: Batch,
    slots: Vec<Slot>,
    running: Vec<Running<'t>>,
    tokenizer: &'t Tokenizer,
    cache: PrefixCache,
    metrics: Arc<Metrics>,
    opts: EngineOptions,
    avg_job_ms: Arc<AtomicU64>,
    /// Jobs started.
    jobs: u64,
    step_log: Option<StepLog>,
    /// When the previous step's work ended.
    last_step_end: Option<Instant>,
}

impl<'t> Scheduler<'t> {
    /// `first`: the batch's one sequence; `opts.parallel - 1` more are added.
    pub fn new(
        mut batch: Batch,
        first: SeqId,
        tokenizer: &'t Tokenizer,
        cache: PrefixCache,
        metrics: Arc<Metrics>,
        opts: EngineOptions,
        avg_job_ms: Arc<AtomicU64>,
    ) -> moeflux::Result<Self> {
        let mut slots = vec![Slot {
            seq: first,
            busy: false,
            used: 0,
        }];
        for _ in 1..opts.parallel {
            slots.push(Slot {
                seq: batch.add_sequence()?,
                busy: false,
                used: 0,
            });
        }
        Ok(Scheduler {
            batch,
            slots,
            running: Vec::new(),
            tokenizer,
            cache,
            metrics,
            opts,
            avg_job_ms,
            jobs: 0,
            step_log: None,
            last_step_end: None,
        })
    }

    /// Logs every step to `log` (`--step-log`).
    pub fn with_step_log(mut self, log: Option<StepLog>) -> Self {
        self.step_log = log;
        self
    }

    pub fn run(mut self, rx: Receiver<Queued>) {
        loop {
            // Jobs join free slots; an idle engine waits for one.
            while self.running.len() < self.slots.len() {
                let next = if self.running.is_empty() {
                    rx.recv().map_err(|_| TryRecvError::Disconnected)
                } else {
                    rx.try_recv()
                };
                match next {
                    Ok(q) => self.admit(q),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        if self.running.is_empty() {
                            return;
                        }
                        break;
                    }
                }
            }
            self.metrics
                .running
                .store(self.running.len() as i64, Ordering::SeqCst);
            if self.running.is_empty() {
                continue;
            }
            let result = catch_unwind(AssertUnwindSafe(|| self.step()));
            if let Err(panic) = result {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let e = ApiError::internal(format!("engine panicked: {what}"));
                for i in (0..self.running.len()).rev() {
                    self.end(i, End::Failed(e.clone()));
                }
            }
        }
    }

    /// Starts a job in the free slot that holds most of its prompt, from
    /// the longest prefix there or in the prefix cache.
    fn admit(&mut self, (job, admission, enqueued): Queued) {
        self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
        if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
            // The client left while the job waited.
            drop(admission);
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let t0 = Instant::now();
        let prompt = &job.prompt;
        let n = prompt.len();
        let fail = |job: Job, admission, e: ApiError| {
            drop(admission);
            self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(EngineEvent::Done(Err(e)));
        };
        if n == 0 {
            return fail(job, admission, ApiError::invalid("", "the prompt is empty"));
        }
        if let Err(e) = job.params.sampler.validate() {
            return fail(job, admission, ApiError::invalid("", e));
        }
        let gen = GenerateOptions {
            max_tokens: job.params.max_tokens.unwrap_or(usize::MAX),
            sampler: job.params.sampler.clone(),
            stop: job.params.stop.clone(),
            starts_in_reasoning: job.starts_in_reasoning,
            ignore_eos: job.params.ignore_eos,
            ..Default::default()
        };
        let mut decoder = Decoder::new(self.tokenizer, &gen);
        if let Err(e) = decoder.prime(prompt) {
            return fail(job, admission, engine_error(e));
        }
        let reuse = !self.opts.no_prefix_reuse;
        // 1. The free slot with the longest live prefix (recurrent state
        //    only goes back to a checkpoint).
        let (slot, mut live) = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.busy)
            .map(|(i, s)| {
                (
                    i,
                    if reuse {
                        self.live_prefix(s.seq, prompt)
                    } else {
                        0
                    },
                )
            })
            .max_by_key(|&(i, live)| (live, std::cmp::Reverse((self.slots[i].used, i))))
            .expect("a free slot: fewer jobs run than there are slots");
        self.jobs += 1;
        self.slots[slot].used = self.jobs;
        let seq = self.slots[slot].seq;
        if !reuse {
            let _ = self.batch.clear(seq);
        }
        // 2. Or a cached snapshot, if longer.
        let mut start = live;
        let mut restored = None;
        let cached = if reuse {
            self.cache.longest(prompt, n - 1)
        } else {
            0
        };
        if cached > live {
            if let Some((len, snap)) = self.cache.get(prompt, n - 1) {
                // A snapshot that fails to load, or holds other tokens than
                // its key, is dropped and costs only the reuse.
                let loaded = self.batch.state_load(seq, &snap).is_ok()
                    && self.batch.tokens(seq).is_ok_and(|t| t == &prompt[..len]);
                if loaded {
                    start = len;
                    restored = Some(len);
                } else {
                    self.cache.discard(&prompt[..len]);
                    let _ = self.batch.clear(seq);
                    live = 0;
                    start = 0;
                }
            }
        } else if self.cache.enabled() && reuse {
            self.cache.note_miss();
        }
        if restored.is_none() && live < self.batch.position(seq).unwrap_or(0) {
            if let Err(e) = self.batch.restore_to(seq, live) {
                let _ = self.batch.clear(seq);
                return fail(job, admission, engine_error(e));
            }
        }
        let mut stops: Vec<usize> = job
            .boundaries
            .iter()
            .copied()
            .filter(|&b| b > start && b < n)
            .collect();
        stops.push(n - 1);
        stops.push(n);
        stops.retain(|&p| p > start);
        stops.sort_unstable();
        stops.dedup();
        self.slots[slot].busy = true;
        self.running.push(Running {
            queued: t0 - enqueued,
            t0,
            slot,
            restored,
            cached: start,
            stops,
            decoder,
            pending: None,
            logprob: None,
            generated: 0,
            max_tokens: gen.max_tokens,
            first_token: None,
            job,
            admission: Some(admission),
        });
    }

    /// Prompt tokens slot sequence `seq` holds that a job can keep: the
    /// common prefix (at most all but the last prompt token), or the
    /// nearest checkpoint below it when the sequence went further.
    fn live_prefix(&self, seq: SeqId, prompt: &[u32]) -> usize {
        let Ok(have) = self.batch.tokens(seq) else {
            return 0;
        };
        let common = have
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        if common == have.len() {
            return common;
        }
        self.batch
            .checkpoints(seq)
            .unwrap_or_default()
            .into_iter()
            .filter(|&p| p <= common)
            .max()
            .unwrap_or(0)
    }

    /// One step: cancelled jobs leave, the rest advance by one forward pass.
    fn step(&mut self) {
        for i in (0..self.running.len()).rev() {
            let r = &self.running[i];
            if r.job.cancel.load(Ordering::SeqCst) || r.job.events.is_closed() {
                let end = if r.first_token.is_some() {
                    End::Done(FinishReason::Cancelled)
                } else {
                    End::Failed(ApiError::internal(CANCELLED))
                };
                self.end(i, end);
            }
        }
        if self.running.is_empty() {
            return;
        }

        // Decodes first (one token each), then prompt chunks, oldest first,
        // each up to its next stop, within the step's token budget.
        let budget = self.opts.step_tokens.max(1);
        let mut plan: Vec<(usize, Vec<u32>, Option<LogitsMode>)> = Vec::new();
        let mut used = 0;
        // Greedy jobs' tokens are picked where the logits are (on a GPU,
        // only the token comes back), unless they need the logits for
        // their logprobs or a grammar's mask.
        let mode = |r: &Running| {
            if r.decoder.greedy() && r.job.params.logprobs.is_none() && r.job.constraint.is_none() {
                LogitsMode::Greedy
            } else {
                LogitsMode::Last
            }
        };
        for (i, r) in self.running.iter().enumerate() {
            if let Some(tok) = r.pending {
                plan.push((i, vec![tok], Some(mode(r))));
                used += 1;
            }
        }
        for (i, r) in self.running.iter().enumerate() {
            if r.pending.is_some() || used >= budget {
                continue;
            }
            let seq = self.slots[r.slot].seq;
            let pos = self.batch.position(seq).unwrap_or(0);
            let stop = r.stops.iter().copied().find(|&s| s > pos).unwrap_or(pos);
            let take = (stop - pos).min(budget - used);
            if take == 0 {
                continue;
            }
            let end = pos + take;
            let logits = (end == r.job.prompt.len()).then_some(mode(r));
            plan.push((i, r.job.prompt[pos..end].to_vec(), logits));
            used += take;
        }
        if plan.is_empty() {
            return;
        }
        let work: Vec<Work> = plan
            .iter()
            .map(|(i, tokens, logits)| Work {
                seq: self.slots[self.running[*i].slot].seq,
                tokens,
                logits: *logits,
            })
            .collect();
        let io0 = self.batch.io_stats();
        let gpu0 = self.batch.gpu_cache_stats();
        let t = Instant::now();
        let results = self.batch.step(&work);
        let forward = t.elapsed();
        let (reads, hits, bytes, host_hits, file_bytes, low_uses) = if self.batch.on_gpu() {
            let g = self.batch.gpu_cache_stats().since(&gpu0);
            (
                g.hits + g.misses,
                g.hits,
                g.uploaded_bytes,
                g.host_hits,
                g.file_bytes,
                g.low_hits + g.low_misses,
            )
        } else {
            let io = self.batch.io_stats().since(&io0);
            (io.reads, io.cached, io.bytes, 0, 0, 0)
        };
        self.metrics.step(&StepSample {
            sequences: plan.len(),
            tokens: used,
            time: forward,
            expert_reads: reads,
            expert_hits: hits,
            expert_bytes: bytes,
            expert_host_hits: host_hits,
            expert_file_bytes: file_bytes,
            expert_low_width_uses: low_uses,
        });

        let mut ends: Vec<(usize, End)> = Vec::new();
        match results {
            Err(e) => {
                // Refused or failed as a whole: every job of the step ends.
                let e = engine_error(e);
                for (i, _, _) in &plan {
                    ends.push((*i, End::Failed(e.clone())));
                }
            }
            Ok(mut results) => {
                self.sample_in_parallel(&plan, &mut results);
                for ((i, _, _), result) in plan.iter().zip(results) {
                    let end = match result {
                        Ok(out) => self.advance(*i, out),
                        Err(e) => Some(End::Failed(engine_error(e))),
                    };
                    if let Some(end) = end {
                        ends.push((*i, end));
                    }
                }
            }
        }
        // Highest index first, so the others keep theirs.
        ends.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, end) in ends {
            self.end(i, end);
        }
        let done = Instant::now();
        if let Some(log) = self.step_log.as_mut() {
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            let before = self
                .last_step_end
                .map_or(Duration::ZERO, |e| t.saturating_duration_since(e));
            log.write(&StepRecord {
                t: t.duration_since(log.start()).as_secs_f64(),
                sequences: plan.len(),
                decoding: plan
                    .iter()
                    .filter(|(_, tokens, _)| tokens.len() == 1)
                    .count(),
                tokens: used,
                before_ms: ms(before),
                forward_ms: ms(forward),
                after_ms: ms(done - t - forward),
            });
        }
        self.last_step_end = Some(done);
    }

    /// Replaces every logits output of the step by its job's sampled token,
    /// the jobs sampled on the rayon pool at once (each draws from its own
    /// sampler, so the order does not matter; ~1 ms each at a 248k
    /// vocabulary with top-p). Logits come back only for a job's next token.
    fn sample_in_parallel(
        &mut self,
        plan: &[(usize, Vec<u32>, Option<LogitsMode>)],
        results: &mut [moeflux::Result<Output>],
    ) {
        // Per running job: its result's index, logits and history (for
        // penalties), borrowed from the batch.
        let mut todo = vec![None; self.running.len()];
        for (k, ((i, _, _), result)) in plan.iter().zip(results.iter_mut()).enumerate() {
            if let Ok(Output::Logits(l)) = result {
                if !l.is_empty() {
                    let seq = self.slots[self.running[*i].slot].seq;
                    let history = self.batch.tokens(seq).unwrap_or_default();
                    todo[*i] = Some((k, std::mem::take(l), history));
                }
            }
        }
        let picked: Vec<(usize, Result<u32, String>)> = self
            .running
            .par_iter_mut()
            .zip(todo.par_iter_mut())
            .filter_map(|(r, t)| t.as_mut().map(|(k, l, history)| (*k, r.sample(l, history))))
            .collect();
        for (k, tok) in picked {
            results[k] = tok
                .map(Output::Token)
                .map_err(|e| moeflux::Error::Invalid(format!("structured output: {e}")));
        }
    }

    /// After job `i`'s tokens of a step: checkpoints and snapshots at the
    /// prompt's stops, then (at the prompt's end, or decoding) the next
    /// token (from `out`: the logits, or the greedy token). Returns how the
    /// job ends, if it does.
    fn advance(&mut self, i: usize, out: Output) -> Option<End> {
        let seq = self.slots[self.running[i].slot].seq;
        let pos = self.batch.position(seq).unwrap_or(0);
        let r = &mut self.running[i];
        let n = r.job.prompt.len();
        // Checkpoints serve only prefix reuse (a GPU sequence's linear
        // states are copied to the host for each).
        let reuse = !self.opts.no_prefix_reuse;
        if r.pending.is_none() && pos < n {
            if r.stops.contains(&pos) && reuse {
                self.batch.checkpoint(seq).ok();
                let boundary = r.job.boundaries.contains(&pos);
                if boundary && self.cache.enabled() && !self.cache.contains(&r.job.prompt[..pos]) {
                    if let Ok(snap) = self.batch.state_save(seq) {
                        self.cache.insert(r.job.prompt[..pos].to_vec(), snap);
                    }
                }
            }
            return None;
        }
        if r.pending.is_none() && reuse {
            // The prompt is in: a turn boundary a later prompt can return to.
            self.batch.checkpoint(seq).ok();
        }
        // The token's text is sent after its log-probabilities, which are
        // known to be wanted only once the token is accepted.
        let mut texts = Vec::new();
        let mut on_event = |e: Event<'_>| {
            if let Event::Text { text, reasoning } = e {
                texts.push(EngineEvent::Text {
                    text: text.to_string(),
                    reasoning,
                });
            }
        };
        let next = match out {
            Output::Token(tok) => r.decoder.accept(tok, &mut on_event),
            Output::Logits(mut logits) => {
                let history = self.batch.tokens(seq).unwrap_or_default();
                match r.sample(&mut logits, history) {
                    Ok(tok) => r.decoder.accept(tok, &mut on_event),
                    Err(e) => return Some(End::Failed(ApiError::internal(e))),
                }
            }
        };
        let (tok, done) = match next {
            Ok(x) => x,
            Err(e) => return Some(End::Failed(engine_error(e))),
        };
        // The end-of-sequence token that ends the answer is not part of it
        // and gets no logprobs.
        let logprob = r.logprob.take().filter(|_| done != Some(FinishReason::Eos));
        let delay = self.opts.event_delay;
        for ev in logprob.map(EngineEvent::Logprob).into_iter().chain(texts) {
            let text = matches!(ev, EngineEvent::Text { .. });
            if r.job.events.send(ev).is_err() {
                r.job.cancel.store(true, Ordering::SeqCst);
            }
            if text && !delay.is_zero() {
                std::thread::sleep(delay);
            }
        }
        r.first_token.get_or_insert_with(Instant::now);
        r.generated += 1;
        r.pending = Some(tok);
        if let Some(f) = done {
            return Some(End::Done(f));
        }
        if let Some(c) = r.job.constraint.as_mut() {
            if let Err(e) = c.commit(tok) {
                return Some(End::Failed(ApiError::internal(format!(
                    "structured output: {e}"
                ))));
            }
            // The grammar is complete: nothing may follow.
            if c.done() {
                return Some(End::Done(FinishReason::Eos));
            }
        }
        if r.generated >= r.max_tokens || pos >= self.batch.max_context() {
            return Some(End::Done(FinishReason::Length));
        }
        None
    }

    /// Ends running job `i`: the rest of its text, its outcome (or error)
    /// to its client, the metrics; its slot is free again.
    fn end(&mut self, i: usize, end: End) {
        let mut r = self.running.remove(i);
        let seq = self.slots[r.slot].seq;
        self.slots[r.slot].busy = false;
        let result = match end {
            End::Done(finish) => {
                let events = &r.job.events;
                let _ = r.decoder.finish(finish, &mut |e| {
                    if let Event::Text { text, reasoning } = e {
                        let _ = events.send(EngineEvent::Text {
                            text: text.to_string(),
                            reasoning,
                        });
                    }
                });
                let now = Instant::now();
                let first = r.first_token.unwrap_or(now);
                let prefill = first - r.t0;
                let n = r.job.prompt.len();
                let outcome = Outcome {
                    prompt_tokens: n,
                    cached_tokens: r.cached,
                    completion_tokens: r.generated,
                    finish,
                    stop_sequence: r.decoder.stop_string().map(str::to_string),
                    ttft: prefill,
                    prefill,
                    decode: now - first,
                    queued: r.queued,
                };
                self.metrics.generation(&GenerationSample {
                    prompt_tokens: n - r.cached,
                    cached_tokens: r.cached,
                    generated_tokens: r.generated,
                    prefill,
                    decode: outcome.decode,
                    ttft: prefill,
                });
                if finish == FinishReason::Cancelled {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                Ok(outcome)
            }
            End::Failed(e) => {
                // Whatever state the failure left, the slot's next job
                // starts clean.
                let _ = self.batch.clear(seq);
                if e.message == CANCELLED {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
                    if let Some(len) = r.restored {
                        self.cache.discard(&r.job.prompt[..len]);
                    }
                }
                Err(e)
            }
        };
        let ms = r.t0.elapsed().as_millis() as u64;
        let avg = self.avg_job_ms.load(Ordering::Relaxed);
        self.avg_job_ms.store((avg * 7 + ms) / 8, Ordering::Relaxed);
        self.metrics.set_prefix_cache(self.cache.stats());
        // The place frees before the job is seen to end, so a client that
        // saw it end finds room.
        drop(r.admission.take());
        self.metrics
            .running
            .store(self.running.len() as i64, Ordering::SeqCst);
        let _ = r.job.events.send(EngineEvent::Done(result));
    }
}
