//! The engine: one thread owns the model's `Session` (it need not be `Send`:
//! it is opened on that thread) and runs requests one at a time, in arrival
//! order, from a bounded queue. An HTTP handler first takes an
//! [`Admission`] (a place among the `max_queue + 1` requests the engine
//! holds: preparing, waiting or running), refused at once (429) when there
//! is none, and only then renders and tokenizes its prompt, so a flood of
//! requests costs no tokenizer work; it then submits its [`Job`] and reads
//! the [`EngineEvent`]s from a channel.
//!
//! Per job: bring the session to the longest prefix of the prompt it can
//! get cheaply — what the live session holds (returning to a checkpoint,
//! never truncating recurrent state), or a snapshot from the
//! [`PrefixCache`], whichever is longer — evaluate the rest, snapshotting at
//! the message boundaries the job names, then generate. The job's cancel
//! flag (raised when its client goes away) is checked per token.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moeflux::generate::{generate, Event, FinishReason, GenerateOptions};
use moeflux::text::tokenizer::Tokenizer;
use moeflux::{LogitsMode, Session};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::GenParams;
use crate::error::ApiError;
use crate::metrics::{GenerationSample, Metrics};
use crate::prefix_cache::{PrefixCache, PrefixCacheOptions};

/// One generation request, ready to run.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Prompt positions worth a snapshot (message boundaries), ascending,
    /// each shorter than the prompt.
    pub boundaries: Vec<usize>,
    pub params: GenParams,
    pub starts_in_reasoning: bool,
    pub cancel: Arc<AtomicBool>,
    pub events: UnboundedSender<EngineEvent>,
}

/// A place in the engine's queue, held from before the prompt is
/// tokenized until the job has run (or is dropped).
pub struct Admission {
    _permit: OwnedSemaphorePermit,
}

#[derive(Debug)]
pub enum EngineEvent {
    Text { text: String, reasoning: bool },
    Done(Result<Outcome, ApiError>),
}

/// How a job ended and what it cost.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub prompt_tokens: usize,
    /// Prompt tokens not evaluated again (session or prefix cache).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub finish: FinishReason,
    /// From the start of the job to the first generated token.
    pub ttft: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    /// Time the job waited in the queue.
    pub queued: Duration,
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub max_queue: usize,
    pub prefix_cache: PrefixCacheOptions,
    /// Start every request from an empty session (for measurements).
    pub no_prefix_reuse: bool,
    /// Tokens per prefill batch (also the cancellation granularity).
    pub prefill_chunk: usize,
    /// Pause after each streamed text event. Zero in use; tests set it so a
    /// job is still running when they need it to be, on any machine speed.
    #[doc(hidden)]
    pub event_delay: Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_queue: 64,
            prefix_cache: PrefixCacheOptions {
                ram_bytes: 1 << 30,
                ..Default::default()
            },
            no_prefix_reuse: false,
            prefill_chunk: 512,
            event_delay: Duration::ZERO,
        }
    }
}

/// What the engine thread learned when it opened the session.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub max_context: usize,
    pub vocab_size: usize,
    pub backend: String,
}

/// The handlers' side of the engine (cheap to share).
pub struct EngineHandle {
    tx: SyncSender<(Job, Admission, Instant)>,
    /// `max_queue + 1` places: the running job and the waiting ones.
    places: Arc<Semaphore>,
    metrics: Arc<Metrics>,
    alive: Arc<AtomicBool>,
    /// Moving average of a job's run time, for `Retry-After`.
    avg_job_ms: Arc<AtomicU64>,
}

impl EngineHandle {
    /// Opens the session on a new engine thread (`open` runs there) and
    /// waits until it is ready.
    pub fn start(
        open: Box<dyn FnOnce() -> Result<Session, String> + Send>,
        tokenizer: Arc<Tokenizer>,
        opts: EngineOptions,
        metrics: Arc<Metrics>,
    ) -> Result<(EngineHandle, ModelInfo), String> {
        let cache = PrefixCache::new(opts.prefix_cache.clone())
            .map_err(|e| format!("prefix cache directory: {e}"))?;
        // Admissions bound what is in the channel, so a send never blocks.
        let places = opts.max_queue.saturating_add(1).min(Semaphore::MAX_PERMITS);
        let (tx, rx) = sync_channel(places);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let avg_job_ms = Arc::new(AtomicU64::new(1000));
        let alive2 = alive.clone();
        let avg2 = avg_job_ms.clone();
        let metrics2 = metrics.clone();
        std::thread::Builder::new()
            .name("moeflux-engine".into())
            .spawn(move || {
                // The session is opened, used and dropped on this thread.
                match open() {
                    Ok(session) => {
                        let info = ModelInfo {
                            max_context: session.max_context(),
                            vocab_size: session.vocab_size(),
                            backend: session.backend().to_string(),
                        };
                        let _ = ready_tx.send(Ok(info));
                        Worker {
                            session,
                            tokenizer,
                            cache,
                            restored: None,
                            metrics: metrics2,
                            opts,
                            avg_job_ms: avg2,
                        }
                        .run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
                alive2.store(false, Ordering::SeqCst);
            })
            .map_err(|e| format!("cannot start the engine thread: {e}"))?;
        let info = ready_rx
            .recv()
            .map_err(|_| "the engine thread stopped while opening the model".to_string())??;
        Ok((
            EngineHandle {
                tx,
                places: Arc::new(Semaphore::new(places)),
                metrics,
                alive,
                avg_job_ms,
            },
            info,
        ))
    }

    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// A place in the queue, or a refusal at once: 429 (with a
    /// Retry-After estimate) when the queue is full, 503 when the engine
    /// is gone. Cheap: taken before any work on the prompt.
    pub fn admit(&self) -> Result<Admission, ApiError> {
        if !self.alive() {
            return Err(ApiError::unavailable("the engine has stopped"));
        }
        match self.places.clone().try_acquire_owned() {
            Ok(permit) => Ok(Admission { _permit: permit }),
            Err(_) => {
                let waiting = self.metrics.queue_depth.load(Ordering::SeqCst).max(0) as u64;
                let ms = self.avg_job_ms.load(Ordering::Relaxed) * (waiting + 1);
                Err(ApiError::queue_full(ms.div_ceil(1000)))
            }
        }
    }

    /// Queues an admitted job (503 when the engine is gone).
    pub fn submit(&self, admission: Admission, job: Job) -> Result<(), ApiError> {
        self.metrics.queue_depth.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send((job, admission, Instant::now())) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
                Err(match e {
                    // Cannot happen while admissions bound the channel.
                    TrySendError::Full(_) => ApiError::queue_full(1),
                    TrySendError::Disconnected(_) => {
                        ApiError::unavailable("the engine has stopped")
                    }
                })
            }
        }
    }
}

struct Worker {
    session: Session,
    tokenizer: Arc<Tokenizer>,
    cache: PrefixCache,
    /// The length of the cached prefix the current job started from.
    restored: Option<usize>,
    metrics: Arc<Metrics>,
    opts: EngineOptions,
    avg_job_ms: Arc<AtomicU64>,
}

impl Worker {
    fn run(&mut self, rx: Receiver<(Job, Admission, Instant)>) {
        while let Ok((job, admission, enqueued)) = rx.recv() {
            self.metrics.queue_depth.fetch_sub(1, Ordering::SeqCst);
            if job.cancel.load(Ordering::SeqCst) || job.events.is_closed() {
                // The client left while the job waited.
                drop(admission);
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.metrics.running.store(1, Ordering::SeqCst);
            let t0 = Instant::now();
            let queued = t0 - enqueued;
            let result = catch_unwind(AssertUnwindSafe(|| self.run_job(&job, queued)));
            let result = match result {
                Ok(r) => r,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    Err(ApiError::internal(format!("engine panicked: {what}")))
                }
            };
            if let Err(e) = &result {
                // Whatever state the failure left, the next job starts
                // clean, and not from the snapshot it started from: a bad
                // entry must not fail its conversation again and again.
                self.session.clear();
                if let (Some(len), false) = (self.restored, e.message == CANCELLED) {
                    self.cache.discard(&job.prompt[..len]);
                }
            }
            match &result {
                Ok(o) if o.finish == FinishReason::Cancelled => {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if e.message == CANCELLED => {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                }
                Err(_) => {
                    self.metrics.engine_errors.fetch_add(1, Ordering::Relaxed);
                }
                Ok(_) => {}
            }
            let ms = t0.elapsed().as_millis() as u64;
            let avg = self.avg_job_ms.load(Ordering::Relaxed);
            self.avg_job_ms.store((avg * 7 + ms) / 8, Ordering::Relaxed);
            self.metrics.set_prefix_cache(self.cache.stats());
            // The place frees before the job is seen to end, so a client
            // that saw it end finds room.
            drop(admission);
            self.metrics.running.store(0, Ordering::SeqCst);
            let _ = job.events.send(EngineEvent::Done(result));
        }
    }

    fn run_job(&mut self, job: &Job, queued: Duration) -> Result<Outcome, ApiError> {
        let session = &mut self.session;
        let prompt = &job.prompt;
        let n = prompt.len();
        if n == 0 {
            return Err(ApiError::invalid("", "the prompt is empty"));
        }
        let t0 = Instant::now();
        let io0 = session.io_stats();
        let gpu0 = session.gpu_cache_stats();

        // 1. The cheapest starting point: `start` tokens of the prompt held
        //    without evaluating anything.
        if self.opts.no_prefix_reuse {
            session.clear();
        }
        let common = session
            .tokens()
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(n - 1);
        let mut live = if common == session.position() {
            common
        } else {
            // Recurrent state only goes back to a checkpoint.
            session
                .checkpoints()
                .into_iter()
                .filter(|&p| p <= common)
                .max()
                .unwrap_or(0)
        };
        let mut start = live;
        let cached = if self.opts.no_prefix_reuse {
            0
        } else {
            self.cache.longest(prompt, n - 1)
        };
        let mut restored = false;
        self.restored = None;
        if cached > live {
            if let Some((len, snap)) = self.cache.get(prompt, n - 1) {
                // A snapshot that fails to load, or holds other tokens than
                // its key, is dropped and costs only the reuse.
                let loaded = session.state_load(&snap).is_ok()
                    && session.position() == len
                    && session.tokens() == &prompt[..len];
                if loaded {
                    start = len;
                    restored = true;
                    self.restored = Some(len);
                } else {
                    self.cache.discard(&prompt[..len]);
                    session.clear();
                    live = 0;
                }
            }
        } else if self.cache.enabled() && !self.opts.no_prefix_reuse {
            self.cache.note_miss();
        }
        if !restored {
            if live < session.position() {
                session.restore_to(live).map_err(engine_error)?;
            }
            start = live;
        }

        // 2. Prefill up to each boundary, snapshotting there.
        let chunk = self.opts.prefill_chunk.max(1);
        for &b in job.boundaries.iter().filter(|&&b| b > start && b < n) {
            let from = session.position();
            for part in prompt[from..b].chunks(chunk) {
                if job.cancel.load(Ordering::Relaxed) {
                    return Err(ApiError::internal(CANCELLED));
                }
                session.eval(part, LogitsMode::Last).map_err(engine_error)?;
            }
            session.checkpoint();
            if self.cache.enabled()
                && !self.opts.no_prefix_reuse
                && !self.cache.contains(&prompt[..b])
            {
                if let Ok(snap) = session.state_save() {
                    self.cache.insert(prompt[..b].to_vec(), snap);
                }
            }
        }
        // A checkpoint before the last prompt token too: the same prompt
        // again (a retry, another sample) then evaluates one token.
        if n - 1 > session.position() {
            let from = session.position();
            for part in prompt[from..n - 1].chunks(chunk) {
                if job.cancel.load(Ordering::Relaxed) {
                    return Err(ApiError::internal(CANCELLED));
                }
                session.eval(part, LogitsMode::Last).map_err(engine_error)?;
            }
            session.checkpoint();
        }
        let own_prefill = t0.elapsed();

        // 3. The rest of the prompt and the answer.
        let opts = GenerateOptions {
            max_tokens: job.params.max_tokens.unwrap_or(usize::MAX),
            sampler: job.params.sampler.clone(),
            stop: job.params.stop.clone(),
            prefill_chunk: chunk,
            starts_in_reasoning: job.starts_in_reasoning,
            checkpoint_after_prefill: true,
            ignore_eos: job.params.ignore_eos,
        };
        let cancel = &job.cancel;
        let events = &job.events;
        let event_delay = self.opts.event_delay;
        let stats = generate(
            session,
            &self.tokenizer,
            prompt,
            &opts,
            Some(cancel),
            &mut |e| {
                if let Event::Text { text, reasoning } = e {
                    let ev = EngineEvent::Text {
                        text: text.to_string(),
                        reasoning,
                    };
                    if events.send(ev).is_err() {
                        cancel.store(true, Ordering::SeqCst);
                    }
                    if !event_delay.is_zero() {
                        std::thread::sleep(event_delay);
                    }
                }
            },
        );
        let stats = match stats {
            Ok(s) => s,
            Err(moeflux::Error::Cancelled) => return Err(ApiError::internal(CANCELLED)),
            Err(e) => return Err(engine_error(e)),
        };
        let prefill = own_prefill + stats.prefill_time;
        let (reads, hits) = if session.on_gpu() {
            let g = session.gpu_cache_stats().since(&gpu0);
            (g.hits + g.misses, g.hits)
        } else {
            let io = session.io_stats().since(&io0);
            (io.reads, io.cached)
        };
        let outcome = Outcome {
            prompt_tokens: n,
            cached_tokens: start,
            completion_tokens: stats.generated_tokens,
            finish: stats.finish,
            ttft: prefill,
            prefill,
            decode: stats.decode_time,
            queued,
        };
        self.metrics.generation(&GenerationSample {
            prompt_tokens: n - start,
            cached_tokens: start,
            generated_tokens: stats.generated_tokens,
            prefill,
            decode: stats.decode_time,
            ttft: prefill,
            expert_reads: reads,
            expert_hits: hits,
        });
        Ok(outcome)
    }
}

/// The message of the error a cancelled job ends with (never sent to a
/// client: it has gone).
pub const CANCELLED: &str = "cancelled: the client went away";

fn engine_error(e: moeflux::Error) -> ApiError {
    ApiError::internal(format!("engine error: {e}"))
}
