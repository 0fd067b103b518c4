//! Counters and gauges for `GET /metrics`, in the Prometheus text format.
//! Written by the HTTP handlers and the engine thread; plain atomics (and
//! one mutex for the per-endpoint table) so nothing waits on a scrape.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::prefix_cache::PrefixCacheStats;

#[derive(Default)]
pub struct Metrics {
    /// (endpoint, HTTP status) -> requests answered.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub cancelled: AtomicU64,
    pub engine_errors: AtomicU64,
    /// Prompts that reached the tokenizer (a refused request never does).
    pub prompts_tokenized: AtomicU64,
    /// Open connections, and those accepted beyond `--max-connections`
    /// (served `/health` only).
    pub connections_open: AtomicI64,
    pub connections_over_limit: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    prefill_ns: AtomicU64,
    decode_ns: AtomicU64,
    ttft_ns: AtomicU64,
    ttft_count: AtomicU64,
    /// f64 bits of the latest request's speeds.
    last_prefill_tok_s: AtomicU64,
    last_decode_tok_s: AtomicU64,
    pub queue_depth: AtomicI64,
    pub running: AtomicI64,
    pub expert_reads: AtomicU64,
    pub expert_hits: AtomicU64,
    expert_bytes: AtomicU64,
    expert_host_hits: AtomicU64,
    expert_file_bytes: AtomicU64,
    expert_low_width_uses: AtomicU64,
    steps: AtomicU64,
    step_sequences: AtomicU64,
    step_tokens: AtomicU64,
    step_ns: AtomicU64,
    /// The latest step's sequences and tokens.
    last_step_sequences: AtomicU64,
    last_step_tokens: AtomicU64,
    prefix: Mutex<PrefixCacheStats>,
}

/// What one finished generation adds.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerationSample {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub prefill: Duration,
    pub decode: Duration,
    pub ttft: Duration,
}

/// What one engine step (one forward pass over every running request)
/// adds.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepSample {
    /// Requests with tokens in the step.
    pub sequences: usize,
    pub tokens: usize,
    pub time: Duration,
    pub expert_reads: u64,
    pub expert_hits: u64,
    /// Expert bytes read from storage (CPU) or uploaded (GPU).
    pub expert_bytes: u64,
    /// GPU: of the VRAM misses, those copied from the pinned host tier.
    pub expert_host_hits: u64,
    /// GPU: bytes of the VRAM misses read from the expert files (page
    /// cache or disk).
    pub expert_file_bytes: u64,
    /// GPU, `--low-width-misses`: expert uses that ran on a low-width copy.
    pub expert_low_width_uses: u64,
}

fn add_ns(a: &AtomicU64, d: Duration) {
    a.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

fn secs(a: &AtomicU64) -> f64 {
    a.load(Ordering::Relaxed) as f64 / 1e9
}

fn get_f64(a: &AtomicU64) -> f64 {
    f64::from_bits(a.load(Ordering::Relaxed))
}

impl Metrics {
    pub fn request(&self, endpoint: &'static str, status: u16) {
        let mut m = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        *m.entry((endpoint, status)).or_default() += 1;
    }

    pub fn generation(&self, s: &GenerationSample) {
        self.prompt_tokens
            .fetch_add(s.prompt_tokens as u64, Ordering::Relaxed);
        self.cached_tokens
            .fetch_add(s.cached_tokens as u64, Ordering::Relaxed);
        self.generated_tokens
            .fetch_add(s.generated_tokens as u64, Ordering::Relaxed);
        add_ns(&self.prefill_ns, s.prefill);
        add_ns(&self.decode_ns, s.decode);
        add_ns(&self.ttft_ns, s.ttft);
        self.ttft_count.fetch_add(1, Ordering::Relaxed);
        let rate = |n: usize, t: Duration| {
            if t.is_zero() {
                0.0
            } else {
                n as f64 / t.as_secs_f64()
            }
        };
        if s.prompt_tokens > 0 {
            self.last_prefill_tok_s.store(
                rate(s.prompt_tokens, s.prefill).to_bits(),
                Ordering::Relaxed,
            );
        }
        if s.generated_tokens > 1 {
            self.last_decode_tok_s.store(
                rate(s.generated_tokens - 1, s.decode).to_bits(),
                Ordering::Relaxed,
            );
        }
    }

    pub fn step(&self, s: &StepSample) {
        let r = Ordering::Relaxed;
        self.steps.fetch_add(1, r);
        self.step_sequences.fetch_add(s.sequences as u64, r);
        self.step_tokens.fetch_add(s.tokens as u64, r);
        add_ns(&self.step_ns, s.time);
        self.last_step_sequences.store(s.sequences as u64, r);
        self.last_step_tokens.store(s.tokens as u64, r);
        self.expert_reads.fetch_add(s.expert_reads, r);
        self.expert_hits.fetch_add(s.expert_hits, r);
        self.expert_bytes.fetch_add(s.expert_bytes, r);
        self.expert_host_hits.fetch_add(s.expert_host_hits, r);
        self.expert_file_bytes.fetch_add(s.expert_file_bytes, r);
        self.expert_low_width_uses
            .fetch_add(s.expert_low_width_uses, r);
    }

    pub fn set_prefix_cache(&self, s: PrefixCacheStats) {
        *self.prefix.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, lines: &[(String, f64)]| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in lines {
                let _ = writeln!(o, "{name}{labels} {v}");
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let requests: Vec<(String, f64)> = self
            .requests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|((e, s), c)| (format!("{{endpoint=\"{e}\",status=\"{s}\"}}"), *c as f64))
            .collect();
        metric(
            "moeflux_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status (429 = queue full).",
            &requests,
        );
        metric(
            "moeflux_requests_cancelled_total",
            "counter",
            "Generations stopped because the client went away.",
            &one(n(&self.cancelled)),
        );
        metric(
            "moeflux_engine_errors_total",
            "counter",
            "Requests failed by an engine error.",
            &one(n(&self.engine_errors)),
        );
        metric(
            "moeflux_prompts_tokenized_total",
            "counter",
            "Prompts rendered and tokenized (requests refused before that are not).",
            &one(n(&self.prompts_tokenized)),
        );
        metric(
            "moeflux_connections_open",
            "gauge",
            "Open HTTP connections within --max-connections.",
            &one(self.connections_open.load(Ordering::Relaxed) as f64),
        );
        metric(
            "moeflux_connections_over_limit_total",
            "counter",
            "Connections beyond --max-connections: /health answered, other endpoints 503.",
            &one(n(&self.connections_over_limit)),
        );
        metric(
            "moeflux_prompt_tokens_total",
            "counter",
            "Prompt tokens evaluated (prefilled).",
            &one(n(&self.prompt_tokens)),
        );
        metric(
            "moeflux_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens reused from the session or the prefix cache (not prefilled).",
            &one(n(&self.cached_tokens)),
        );
        metric(
            "moeflux_generated_tokens_total",
            "counter",
            "Tokens generated.",
            &one(n(&self.generated_tokens)),
        );
        metric(
            "moeflux_prefill_seconds_total",
            "counter",
            "Time spent prefilling prompts.",
            &one(secs(&self.prefill_ns)),
        );
        metric(
            "moeflux_decode_seconds_total",
            "counter",
            "Time spent generating.",
            &one(secs(&self.decode_ns)),
        );
        metric(
            "moeflux_time_to_first_token_seconds",
            "summary",
            "From the start of a request's prefill to its first generated token.",
            &[
                ("_sum".to_string(), secs(&self.ttft_ns)),
                ("_count".to_string(), n(&self.ttft_count)),
            ],
        );
        metric(
            "moeflux_prefill_tokens_per_second",
            "gauge",
            "Prefill speed of the latest request.",
            &one(get_f64(&self.last_prefill_tok_s)),
        );
        metric(
            "moeflux_decode_tokens_per_second",
            "gauge",
            "Decode speed of the latest request.",
            &one(get_f64(&self.last_decode_tok_s)),
        );
        metric(
            "moeflux_queue_depth",
            "gauge",
            "Requests waiting for the engine.",
            &one(self.queue_depth.load(Ordering::Relaxed) as f64),
        );
        metric(
            "moeflux_requests_running",
            "gauge",
            "Requests the engine is working on (at most --parallel).",
            &one(self.running.load(Ordering::Relaxed) as f64),
        );
        metric(
            "moeflux_steps_total",
            "counter",
            "Engine steps (one forward pass over the tokens of every running request).",
            &one(n(&self.steps)),
        );
        metric(
            "moeflux_step_sequences_total",
            "counter",
            "Requests with tokens in a step, summed over steps (/ steps = mean batch size).",
            &one(n(&self.step_sequences)),
        );
        metric(
            "moeflux_step_tokens_total",
            "counter",
            "Tokens evaluated per step, summed over steps.",
            &one(n(&self.step_tokens)),
        );
        metric(
            "moeflux_step_seconds_total",
            "counter",
            "Time spent in steps.",
            &one(secs(&self.step_ns)),
        );
        metric(
            "moeflux_batch_size",
            "gauge",
            "Requests with tokens in the latest step.",
            &one(n(&self.last_step_sequences)),
        );
        metric(
            "moeflux_step_tokens",
            "gauge",
            "Tokens evaluated in the latest step.",
            &one(n(&self.last_step_tokens)),
        );
        metric(
            "moeflux_expert_bytes_total",
            "counter",
            "Routed-expert bytes read from storage (CPU) or uploaded to the GPU.",
            &one(n(&self.expert_bytes)),
        );
        let reads = n(&self.expert_reads);
        let hits = n(&self.expert_hits);
        metric(
            "moeflux_expert_fetches_total",
            "counter",
            "Routed experts needed (GPU: cache lookups; CPU: extents read).",
            &one(reads),
        );
        metric(
            "moeflux_expert_cache_hits_total",
            "counter",
            "Of those, found resident (GPU: VRAM cache; CPU: page cache).",
            &one(hits),
        );
        metric(
            "moeflux_expert_cache_hit_ratio",
            "gauge",
            "Expert cache hits / fetches since start.",
            &one(if reads > 0.0 { hits / reads } else { 0.0 }),
        );
        metric(
            "moeflux_expert_host_tier_hits_total",
            "counter",
            "GPU: experts missing from VRAM copied from the pinned host tier.",
            &one(n(&self.expert_host_hits)),
        );
        metric(
            "moeflux_expert_file_bytes_total",
            "counter",
            "GPU: expert bytes missing from VRAM and the host tier, read from the expert files.",
            &one(n(&self.expert_file_bytes)),
        );
        metric(
            "moeflux_expert_low_width_uses_total",
            "counter",
            "GPU, --low-width-misses: expert uses that ran on a low-width copy.",
            &one(n(&self.expert_low_width_uses)),
        );
        let p = *self.prefix.lock().unwrap_or_else(|p| p.into_inner());
        metric(
            "moeflux_prefix_cache_hits_total",
            "counter",
            "Requests that restored a cached snapshot.",
            &one(p.hits as f64),
        );
        metric(
            "moeflux_prefix_cache_misses_total",
            "counter",
            "Requests that found no cached snapshot.",
            &one(p.misses as f64),
        );
        metric(
            "moeflux_prefix_cache_entries",
            "gauge",
            "Snapshots held.",
            &one(p.entries as f64),
        );
        metric(
            "moeflux_prefix_cache_bytes",
            "gauge",
            "Bytes of snapshots held, by tier.",
            &[
                ("{tier=\"ram\"}".to_string(), p.ram_bytes as f64),
                ("{tier=\"disk\"}".to_string(), p.disk_bytes as f64),
            ],
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.request("chat", 200);
        m.request("chat", 200);
        m.request("chat", 429);
        m.generation(&GenerationSample {
            prompt_tokens: 100,
            generated_tokens: 11,
            prefill: Duration::from_secs(2),
            decode: Duration::from_secs(1),
            ..Default::default()
        });
        m.step(&StepSample {
            sequences: 3,
            tokens: 40,
            expert_reads: 4,
            expert_hits: 3,
            expert_host_hits: 1,
            expert_file_bytes: 4096,
            expert_low_width_uses: 2,
            ..Default::default()
        });
        let t = m.render();
        assert!(t.contains("moeflux_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
        assert!(t.contains("moeflux_requests_total{endpoint=\"chat\",status=\"429\"} 1\n"));
        assert!(t.contains("moeflux_prefill_tokens_per_second 50\n"));
        assert!(t.contains("moeflux_decode_tokens_per_second 10\n"));
        assert!(t.contains("moeflux_expert_cache_hit_ratio 0.75\n"));
        assert!(t.contains("moeflux_expert_host_tier_hits_total 1\n"));
        assert!(t.contains("moeflux_expert_file_bytes_total 4096\n"));
        assert!(t.contains("moeflux_expert_low_width_uses_total 2\n"));
        assert!(t.contains("moeflux_batch_size 3\n"));
        assert!(t.contains("moeflux_step_tokens 40\n"));
        assert!(t.contains("# TYPE moeflux_queue_depth gauge\nmoeflux_queue_depth 0\n"));
        // Every sample line is `name{labels} number`.
        for line in t.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = line.rsplit_once(' ').unwrap();
            v.parse::<f64>().unwrap();
        }
    }
}
