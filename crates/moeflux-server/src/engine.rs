//! The engine: one thread owns the model (a `Batch` of `parallel`
//! sequences; it need not be `Send`: it is opened on that thread) and runs
//! up to `parallel` requests at once, the rest waiting in arrival order in
//! a bounded queue. An HTTP handler first takes an [`Admission`] (a place
//! among the `max_queue + parallel` requests the engine holds: preparing,
//! waiting or running), refused at once (429) when there is none, and only
//! then renders and tokenizes its prompt, so a flood of requests costs no
//! tokenizer work; it then submits its [`Job`] and reads the
//! [`EngineEvent`]s from a channel.
//!
//! A job takes a free slot (a sequence of the batch): the one whose live
//! tokens give the longest prefix of its prompt (returning to a checkpoint,
//! never truncating recurrent state), or a snapshot from the
//! [`PrefixCache`] if that is longer. Then the scheduler (`scheduler.rs`)
//! runs steps: every decoding job's next token and chunks of the prefilling
//! jobs' prompts, up to `step_tokens` tokens per step, in one forward pass,
//! so a long prompt never stalls the others and each expert a step needs is
//! fetched once for all of them. Prefill pauses at the message boundaries
//! the job names (a checkpoint and a snapshot there) and before the last
//! prompt token (a checkpoint). A job's cancel flag (raised when its client
//! goes away) is checked every step.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use moeflux::generate::FinishReason;
use moeflux::text::tokenizer::Tokenizer;
use moeflux::Session;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api::GenParams;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::prefix_cache::{PrefixCache, PrefixCacheOptions};
use crate::scheduler::Scheduler;

/// One generation request, ready to run.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Prompt positions worth a snapshot (message boundaries), ascending,
    /// each shorter than the prompt.
    pub boundaries: Vec<usize>,
    pub params: GenParams,
    pub starts_in_reasoning: bool,
    /// The grammar the answer follows (structured output), if any.
    pub constraint: Option<crate::constrain::Constraint>,
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
    Text {
        text: String,
        reasoning: bool,
    },
    /// A generated token's log-probabilities (jobs that ask for them),
    /// sent before the text the token completes.
    Logprob(moeflux::logprobs::TokenLogprobs),
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
    /// The stop string that ended it (`finish` is `Stop`).
    pub stop_sequence: Option<String>,
    /// From the start of the job to the first generated token.
    pub ttft: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    /// Time the job waited in the queue.
    pub queued: Duration,
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Requests waiting beyond the running ones; more get 429.
    pub max_queue: usize,
    /// Requests generating at once (sequences of the batch).
    pub parallel: usize,
    pub prefix_cache: PrefixCacheOptions,
    /// Start every request from an empty session (for measurements).
    pub no_prefix_reuse: bool,
    /// Tokens per step: every decoding request's next token, then chunks
    /// of prompts (also the cancellation granularity of a prompt).
    pub step_tokens: usize,
    /// Write one JSON line per step here (see `step_log`).
    pub step_log: Option<std::path::PathBuf>,
    /// Pause after each streamed text event. Zero in use; tests set it so a
    /// job is still running when they need it to be, on any machine speed.
    #[doc(hidden)]
    pub event_delay: Duration,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            max_queue: 64,
            parallel: 4,
            prefix_cache: PrefixCacheOptions {
                ram_bytes: 1 << 30,
                ..Default::default()
            },
            no_prefix_reuse: false,
            step_tokens: 512,
            step_log: None,
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
    tx: SyncSender<Queued>,
    /// `max_queue + parallel` places: the running jobs and the waiting ones.
    places: Arc<Semaphore>,
    parallel: u64,
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
        if opts.parallel == 0 {
            return Err("parallel sequences must be at least 1".into());
        }
        let step_log = opts
            .step_log
            .as_deref()
            .map(crate::step_log::StepLog::create)
            .transpose()?;
        // Admissions bound what is in the channel, so a send never blocks.
        let places = opts
            .max_queue
            .saturating_add(opts.parallel)
            .min(Semaphore::MAX_PERMITS);
        let parallel = opts.parallel as u64;
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
                let opened = open().and_then(|session| {
                    let info = ModelInfo {
                        max_context: session.max_context(),
                        vocab_size: session.vocab_size(),
                        backend: session.backend().to_string(),
                    };
                    let (batch, first) = session.into_batch();
                    Scheduler::new(batch, first, &tokenizer, cache, metrics2, opts, avg2)
                        .map(|s| (s.with_step_log(step_log), info))
                        .map_err(|e| format!("cannot hold {parallel} sequences: {e}"))
                });
                match opened {
                    Ok((scheduler, info)) => {
                        let _ = ready_tx.send(Ok(info));
                        scheduler.run(rx);
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
                parallel,
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
                let ms = self.avg_job_ms.load(Ordering::Relaxed) * (waiting + 1) / self.parallel;
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

/// What goes through the engine's queue.
pub(crate) type Queued = (Job, Admission, Instant);

/// The message of the error a cancelled job ends with (never sent to a
/// client: it has gone).
pub const CANCELLED: &str = "cancelled: the client went away";

pub(crate) fn engine_error(e: moeflux::Error) -> ApiError {
    ApiError::internal(format!("engine error: {e}"))
}
