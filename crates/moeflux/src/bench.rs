//! Throughput measurement on a model directory, the way llama.cpp's
//! `llama-bench` measures: prompt processing (`pp`: `prompt_len` random
//! tokens in one batch from an empty context) and text generation (`tg`:
//! `gen` random tokens fed one at a time from an empty context), repeated,
//! with the time split by phase and the expert bytes each test read.
//!
//! The warm-up and every repetition draw their own tokens: a repetition
//! that replayed the warm-up's tokens would find exactly the experts it
//! needs already cached (in VRAM, or in the page cache), and its hit rates
//! would describe the replay, not the model serving new text. Cache
//! counters cover the timed repetitions only.

use std::time::{Duration, Instant};

use crate::backend::cuda::CacheStats;
use crate::backend::prefetch::PrefetchStats;
use crate::error::{Error, Result};
use crate::io::{procfs, IoStats};
use crate::model::timing::PhaseTimes;
use crate::session::{LogitsMode, Session};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Tokens of the prompt-processing test (0 skips it).
    pub prompt_len: usize,
    /// Tokens of the generation test (0 skips it).
    pub gen: usize,
    /// Timed repetitions of each test.
    pub reps: usize,
    /// Drop the expert files from the page cache before every repetition.
    pub cold: bool,
    /// Run each test once untimed first (fills the page cache and the
    /// mappings in warm runs).
    pub warmup: bool,
    /// Seed of the random token ids.
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            prompt_len: 512,
            gen: 128,
            reps: 3,
            cold: false,
            warmup: true,
            seed: 1,
        }
    }
}

/// One test (`pp` or `tg`) over its repetitions.
#[derive(Debug, Clone)]
pub struct TestResult {
    /// Tokens evaluated per repetition.
    pub tokens: usize,
    /// Tokens per second of each repetition.
    pub tok_s: Vec<f64>,
    /// Phase times summed over the repetitions.
    pub times: PhaseTimes,
    /// Expert reads summed over the repetitions.
    pub io: IoStats,
    /// Bytes the process read from storage over the repetitions (Linux).
    pub disk_bytes: Option<u64>,
    /// Wall time summed over the repetitions.
    pub wall: Duration,
    /// Experts were served from the mapping (see [`crate::io`]).
    pub mapped: bool,
    /// Speculative prefetch over the repetitions.
    pub prefetch: PrefetchStats,
    /// GPU expert cache over the repetitions (zero on the CPU).
    pub gpu_cache: CacheStats,
}

impl TestResult {
    pub fn mean_tok_s(&self) -> f64 {
        mean(&self.tok_s)
    }

    pub fn std_tok_s(&self) -> f64 {
        let m = self.mean_tok_s();
        let n = self.tok_s.len();
        if n < 2 {
            return 0.0;
        }
        (self.tok_s.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1) as f64).sqrt()
    }

    /// Milliseconds per evaluated token of a phase.
    pub fn ms_per_token(&self, d: Duration) -> f64 {
        let n = (self.tokens * self.tok_s.len()).max(1);
        d.as_secs_f64() * 1e3 / n as f64
    }

    /// Expert bytes read per evaluated token.
    pub fn expert_bytes_per_token(&self) -> f64 {
        self.io.bytes as f64 / (self.tokens * self.tok_s.len()).max(1) as f64
    }

    /// Expert bytes uploaded to the GPU per evaluated token (cache misses
    /// and prefetches).
    pub fn uploaded_bytes_per_token(&self) -> f64 {
        self.gpu_cache.uploaded_bytes as f64 / (self.tokens * self.tok_s.len()).max(1) as f64
    }

    /// Expert bytes the GPU's misses read from the expert files (the page
    /// cache or the disk: neither VRAM nor the host tier held them) per
    /// evaluated token.
    pub fn file_bytes_per_token(&self) -> f64 {
        self.gpu_cache.file_bytes as f64 / (self.tokens * self.tok_s.len()).max(1) as f64
    }

    /// Of those, the bytes of experts a layer then used: uploads a perfect
    /// predictor would also have made (the PCIe ceiling counts these; every
    /// upload is one slot's extent).
    pub fn needed_upload_bytes_per_token(&self) -> f64 {
        let c = &self.gpu_cache;
        let uploads = c.misses + c.prefetched;
        if uploads == 0 {
            return 0.0;
        }
        self.uploaded_bytes_per_token() * (c.misses + c.prefetch_hits) as f64 / uploads as f64
    }

    /// Experts the layers used per repetition, resident or not (GPU expert
    /// cache; 0 on the CPU).
    pub fn expert_uses_per_rep(&self) -> u64 {
        (self.gpu_cache.hits + self.gpu_cache.misses) / self.tok_s.len().max(1) as u64
    }

    /// Whether one repetition used more experts than a cache of `slots`
    /// holds: only then does its hit rate say what the cache does for a
    /// long run rather than how much of one short run fits.
    pub fn outgrows_cache(&self, slots: usize) -> bool {
        self.expert_uses_per_rep() > slots as u64
    }

    /// Expert bytes per second of wall time (the bandwidth the test
    /// achieved, I/O overlapped with compute or not).
    pub fn expert_gb_s(&self) -> f64 {
        if self.wall.is_zero() {
            0.0
        } else {
            self.io.bytes as f64 / self.wall.as_secs_f64() / 1e9
        }
    }

    /// Share of expert bytes the page cache served: counted exactly for
    /// mapped experts (resident when fetched), else estimated from the bytes
    /// the process read from storage.
    pub fn page_cache_hit_rate(&self) -> Option<f64> {
        if self.mapped {
            (self.io.reads > 0).then(|| self.io.cached as f64 / self.io.reads as f64)
        } else {
            procfs::cache_hit_rate(self.io.bytes, self.disk_bytes?)
        }
    }
}

impl TestResult {
    /// Evaluated tokens over all repetitions.
    fn all_tokens(&self) -> f64 {
        (self.tokens * self.tok_s.len()).max(1) as f64
    }

    /// Milliseconds of wall time per evaluated token.
    pub fn wall_ms_per_token(&self) -> f64 {
        self.wall.as_secs_f64() * 1e3 / self.all_tokens()
    }

    /// Expert bytes the layers needed from the files per evaluated token:
    /// [`CacheStats::needed_file_bytes`] (read-ahead guesses that no layer
    /// used are not counted: they are the path's loss, not the disk's).
    pub fn needed_file_bytes_per_token(&self) -> f64 {
        self.gpu_cache.needed_file_bytes as f64 / self.all_tokens()
    }

    /// Expert bytes uploaded from the pinned host tier per evaluated token
    /// (every upload that was not read from the files).
    pub fn host_tier_bytes_per_token(&self) -> f64 {
        let c = &self.gpu_cache;
        c.uploaded_bytes.saturating_sub(c.file_bytes) as f64 / self.all_tokens()
    }

    /// Decode against the disk: see [`DiskCeiling`]. `None` without a
    /// measured sequential bandwidth.
    pub fn disk_ceiling(
        &self,
        seq_gb_s: Option<f64>,
        h2d_gb_s: Option<f64>,
    ) -> Option<DiskCeiling> {
        DiskCeiling::new(
            self.wall_ms_per_token(),
            self.ms_per_token(self.times.expert_io),
            self.needed_file_bytes_per_token(),
            seq_gb_s?,
            self.host_tier_bytes_per_token(),
            h2d_gb_s,
        )
    }
}

/// The disk-bound ceiling of a decode whose experts miss VRAM: a token's
/// expert bytes needed from the files crossing the disk at its sequential
/// `O_DIRECT` bandwidth (measured in the same run), those from the pinned
/// host tier crossing PCIe at the pinned copy bandwidth, plus the token's
/// *resident time*: its measured time outside the wait for expert bytes
/// (`expert_io_wait`: reads, host-tier copies, their upload). A decode
/// with every expert in VRAM cannot run when the experts do not fit, so
/// the resident time is the same run's own: everything the token did
/// besides waiting, with this path's per-layer host round trips and eager
/// launches. The ratio to the ceiling therefore says how close the reads
/// come to the disk, not how fast the kernels are; it can pass 100% when
/// reads overlap compute (read-ahead).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiskCeiling {
    /// Needed file bytes per token / sequential bandwidth.
    pub disk_ms: f64,
    /// Host-tier bytes per token / pinned host-to-GPU bandwidth (0 without
    /// a host tier or a measured bandwidth).
    pub host_ms: f64,
    /// Milliseconds per token outside the expert wait.
    pub resident_ms: f64,
    /// `1000 / (disk_ms + host_ms + resident_ms)`.
    pub tok_s: f64,
    /// The measured tok/s over `tok_s`.
    pub reached: f64,
}

impl DiskCeiling {
    /// From a decode's measured milliseconds per token and of those the
    /// expert wait, its needed file bytes and host-tier bytes per token,
    /// and the bandwidths in GB/s. `None` when the sequential bandwidth is
    /// not positive, or the decode read nothing from the files.
    pub fn new(
        ms_per_token: f64,
        wait_ms_per_token: f64,
        file_bytes_per_token: f64,
        seq_gb_s: f64,
        host_bytes_per_token: f64,
        h2d_gb_s: Option<f64>,
    ) -> Option<DiskCeiling> {
        // Written so NaN counts as not positive.
        let positive = |x: f64| x > 0.0;
        if !positive(seq_gb_s) || !positive(file_bytes_per_token) || !positive(ms_per_token) {
            return None;
        }
        let disk_ms = file_bytes_per_token / (seq_gb_s * 1e6);
        let host_ms = match h2d_gb_s.filter(|&b| b > 0.0) {
            Some(b) => host_bytes_per_token / (b * 1e6),
            None => 0.0,
        };
        let resident_ms = (ms_per_token - wait_ms_per_token).max(0.0);
        let tok_s = 1e3 / (disk_ms + host_ms + resident_ms);
        Some(DiskCeiling {
            disk_ms,
            host_ms,
            resident_ms,
            tok_s,
            reached: (1e3 / ms_per_token) / tok_s,
        })
    }
}

fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        0.0
    } else {
        x.iter().sum::<f64>() / x.len() as f64
    }
}

#[derive(Debug, Clone)]
pub struct BenchResult {
    pub prefill: Option<TestResult>,
    pub decode: Option<TestResult>,
}

/// Deterministic token ids in `0..vocab` (splitmix64).
pub fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z % vocab as u64) as u32
        })
        .collect()
}

/// Runs the prompt-processing and generation tests on `session` (which is
/// cleared before each repetition). `on_progress` gets a line per finished
/// repetition.
pub fn run(
    session: &mut Session,
    opts: &BenchOptions,
    on_progress: &mut dyn FnMut(&str),
) -> Result<BenchResult> {
    if opts.reps == 0 {
        return Err(Error::Invalid("bench: reps must be at least 1".into()));
    }
    if opts.prompt_len + opts.gen == 0 {
        return Err(Error::Invalid(
            "bench: nothing to do (prompt length and generated tokens are both 0)".into(),
        ));
    }
    let need = opts.prompt_len.max(opts.gen);
    if need > session.max_context() {
        return Err(Error::ContextFull {
            requested: need,
            limit: session.max_context(),
        });
    }
    let prefill = (opts.prompt_len > 0)
        .then(|| {
            test(session, opts, "pp", on_progress, |s, tokens| {
                s.eval(tokens, LogitsMode::Last).map(|_| ())
            })
        })
        .transpose()?;
    let decode = (opts.gen > 0)
        .then(|| {
            test(session, opts, "tg", on_progress, |s, tokens| {
                for &t in tokens {
                    s.eval(&[t], LogitsMode::Last)?;
                }
                Ok(())
            })
        })
        .transpose()?;
    Ok(BenchResult { prefill, decode })
}

/// The tokens of one run of test `name`: run 0 is the warm-up, run `i`
/// repetition `i`; each run's are its own draw.
pub fn run_tokens(name: &str, run: u64, n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let stream = crate::hash::fnv1a(name.as_bytes());
    random_tokens(
        n,
        vocab,
        seed ^ stream ^ run.wrapping_mul(0xD1B5_4A32_D192_ED03),
    )
}

fn test(
    session: &mut Session,
    opts: &BenchOptions,
    name: &str,
    on_progress: &mut dyn FnMut(&str),
    body: impl Fn(&mut Session, &[u32]) -> Result<()>,
) -> Result<TestResult> {
    let tokens = if name == "pp" {
        opts.prompt_len
    } else {
        opts.gen
    };
    let vocab = session.vocab_size();
    let draw = |run: u64| run_tokens(name, run, tokens, vocab, opts.seed);
    if opts.warmup {
        session.clear();
        body(session, &draw(0))?;
    }
    let mut r = TestResult {
        tokens,
        tok_s: Vec::with_capacity(opts.reps),
        times: PhaseTimes::default(),
        io: IoStats::default(),
        disk_bytes: Some(0),
        wall: Duration::ZERO,
        mapped: session.experts_mapped(),
        prefetch: PrefetchStats::default(),
        gpu_cache: CacheStats::default(),
    };
    for rep in 0..opts.reps {
        let input = draw(rep as u64 + 1);
        session.clear();
        if opts.cold {
            session.evict_expert_cache()?;
        }
        let (io0, times0, disk0) = (
            session.io_stats(),
            session.times(),
            procfs::disk_read_bytes(),
        );
        let pf0 = session.prefetch_stats();
        let gc0 = session.gpu_cache_stats();
        let t0 = Instant::now();
        body(session, &input)?;
        let wall = t0.elapsed();
        let disk = procfs::disk_read_bytes()
            .zip(disk0)
            .map(|(b, a)| b.saturating_sub(a));
        r.disk_bytes = r.disk_bytes.zip(disk).map(|(a, b)| a + b);
        let io = session.io_stats().since(&io0);
        r.io = r.io.plus(&io);
        r.prefetch = r.prefetch.plus(&session.prefetch_stats().since(&pf0));
        r.gpu_cache = r.gpu_cache.plus(&session.gpu_cache_stats().since(&gc0));
        r.times = r.times.plus(&session.times().minus(&times0));
        r.wall += wall;
        let tok_s = tokens as f64 / wall.as_secs_f64();
        r.tok_s.push(tok_s);
        on_progress(&format!(
            "{name}{tokens} rep {}/{}: {tok_s:.2} tok/s",
            rep + 1,
            opts.reps
        ));
    }
    Ok(r)
}

/// Memory read bandwidth in GB/s with `threads` threads: the best of a few
/// passes summing a 512 MiB buffer (far larger than any cache). The
/// denominator of the decode roofline.
pub fn memory_read_gb_s(threads: usize) -> Result<f64> {
    use rayon::prelude::*;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .build()
        .map_err(|e| Error::Invalid(format!("cannot start {threads} threads: {e}")))?;
    let buf: Vec<u64> = (0..64u64 << 20).collect();
    let mut best = f64::INFINITY;
    for _ in 0..4 {
        let t0 = Instant::now();
        let x = pool.install(|| {
            buf.par_chunks(1 << 16)
                .map(|c| c.iter().fold(0u64, |a, &v| a ^ v))
                .reduce(|| 0, |a, b| a ^ b)
        });
        std::hint::black_box(x);
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok((buf.len() * 8) as f64 / best / 1e9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_tokens_are_deterministic_and_in_range() {
        let a = random_tokens(1000, 37, 5);
        assert_eq!(a, random_tokens(1000, 37, 5));
        assert_ne!(a, random_tokens(1000, 37, 6));
        assert!(a.iter().all(|&t| t < 37));
        // Every id shows up: not stuck on a few values.
        let mut seen = [false; 37];
        a.iter().for_each(|&t| seen[t as usize] = true);
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn every_run_draws_its_own_tokens() {
        let runs: Vec<Vec<u32>> = (0..4).map(|r| run_tokens("tg", r, 64, 1000, 1)).collect();
        for i in 0..runs.len() {
            for j in 0..i {
                let same = runs[i].iter().zip(&runs[j]).filter(|(a, b)| a == b).count();
                assert!(same < 8, "runs {j} and {i} share {same} of 64 tokens");
            }
        }
        assert_eq!(runs[2], run_tokens("tg", 2, 64, 1000, 1));
        assert_ne!(run_tokens("pp", 1, 64, 1000, 1), runs[1]);
        assert_ne!(run_tokens("tg", 1, 64, 1000, 2), runs[1]);
    }

    #[test]
    fn disk_ceiling_adds_disk_host_and_resident_time() {
        // 60 ms per token, 40 of them waiting; 50 MB from the disk at 2.5
        // GB/s (20 ms) and 10 MB from the host tier at 50 GB/s (0.2 ms).
        let c = DiskCeiling::new(60.0, 40.0, 50e6, 2.5, 10e6, Some(50.0)).unwrap();
        assert!((c.disk_ms - 20.0).abs() < 1e-9, "{c:?}");
        assert!((c.host_ms - 0.2).abs() < 1e-9, "{c:?}");
        assert!((c.resident_ms - 20.0).abs() < 1e-9, "{c:?}");
        assert!((c.tok_s - 1e3 / 40.2).abs() < 1e-9, "{c:?}");
        assert!((c.reached - 40.2 / 60.0).abs() < 1e-9, "{c:?}");
        // No host-to-GPU bandwidth: the host term is left out.
        let c = DiskCeiling::new(60.0, 40.0, 50e6, 2.5, 10e6, None).unwrap();
        assert_eq!(c.host_ms, 0.0);
        assert!((c.tok_s - 25.0).abs() < 1e-9, "{c:?}");
        // Reads overlapping compute: the wait is shorter than the disk
        // time and the decode passes its ceiling.
        let c = DiskCeiling::new(30.0, 5.0, 50e6, 2.5, 0.0, None).unwrap();
        assert!((c.reached - 45.0 / 30.0).abs() < 1e-9, "{c:?}");
        // Nothing to measure against.
        assert_eq!(DiskCeiling::new(60.0, 40.0, 50e6, 0.0, 0.0, None), None);
        assert_eq!(
            DiskCeiling::new(60.0, 40.0, 50e6, f64::NAN, 0.0, None),
            None
        );
        assert_eq!(DiskCeiling::new(60.0, 40.0, 0.0, 2.5, 0.0, None), None);
        assert_eq!(DiskCeiling::new(0.0, 0.0, 50e6, 2.5, 0.0, None), None);
        // A wait longer than the token (clock granularity) is no negative
        // resident time.
        let c = DiskCeiling::new(10.0, 10.5, 25e6, 2.5, 0.0, None).unwrap();
        assert_eq!(c.resident_ms, 0.0);
    }

    #[test]
    fn statistics() {
        let r = TestResult {
            tokens: 10,
            tok_s: vec![1.0, 3.0],
            times: PhaseTimes {
                attention: Duration::from_millis(40),
                ..Default::default()
            },
            io: IoStats {
                bytes: 2000,
                ..Default::default()
            },
            disk_bytes: Some(500),
            wall: Duration::from_secs(2),
            mapped: false,
            prefetch: PrefetchStats::default(),
            gpu_cache: CacheStats {
                hits: 30,
                misses: 6,
                uploaded_bytes: 4000,
                prefetched: 4,
                prefetch_hits: 3,
                cpu_computed: 0,
                host_hits: 2,
                file_reads: 4,
                file_bytes: 1600,
                needed_file_bytes: 1200,
                ..Default::default()
            },
        };
        assert_eq!(r.mean_tok_s(), 2.0);
        assert!((r.std_tok_s() - 2f64.sqrt()).abs() < 1e-12);
        assert_eq!(r.ms_per_token(r.times.attention), 2.0);
        assert_eq!(r.expert_bytes_per_token(), 100.0);
        assert_eq!(r.uploaded_bytes_per_token(), 200.0);
        assert_eq!(r.file_bytes_per_token(), 80.0);
        // 10 uploads of 400 bytes, one of them a prefetch nobody used.
        assert_eq!(r.needed_upload_bytes_per_token(), 180.0);
        assert_eq!(r.page_cache_hit_rate(), Some(0.75));
        assert_eq!(r.wall_ms_per_token(), 100.0);
        assert_eq!(r.needed_file_bytes_per_token(), 60.0);
        // 4000 uploaded, 1600 of them from the files.
        assert_eq!(r.host_tier_bytes_per_token(), 120.0);
        assert_eq!(r.disk_ceiling(None, Some(1.0)), None);
        assert!((r.expert_gb_s() - 1e-6).abs() < 1e-15);
        let mapped = TestResult {
            mapped: true,
            io: IoStats {
                reads: 8,
                cached: 6,
                ..Default::default()
            },
            ..r
        };
        assert_eq!(mapped.page_cache_hit_rate(), Some(0.75));
    }
}
