//! `moeflux bench`: prompt-processing and generation throughput on a model
//! directory, with the time per phase, the expert bytes read and where they
//! came from, and the decode roofline.

use anyhow::Result;
use clap::Args;
use moeflux::backend::cpu::simd::simd_level;
use moeflux::bench::{self, BenchOptions, BenchResult, TestResult};
use moeflux::Session;
use serde_json::{json, Value};
use std::time::Duration;

use crate::gen_args::ModelArgs;
use crate::progress::human_bytes;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens evaluated in one batch (the `pp` test; 0 skips it).
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Tokens generated one at a time (the `tg` test; 0 skips it).
    #[arg(long, default_value_t = 128)]
    pub gen: usize,
    /// Timed repetitions of each test.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Drop the expert files from the page cache before each repetition.
    /// With `--cold` or `--direct-io` the file system's sequential O_DIRECT
    /// bandwidth is measured too, and the decode reported against the
    /// disk-bound ceiling it gives.
    #[arg(long)]
    pub cold: bool,
    /// Skip the untimed warm-up run of each test.
    #[arg(long)]
    pub no_warmup: bool,
    /// Seed of the random token ids.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// Bytes read with O_DIRECT to measure the sequential bandwidth.
const SEQ_PROBE_BYTES: u64 = 1 << 30;

pub fn run(args: BenchArgs) -> Result<()> {
    let mut session = args.model.open_session()?;
    args.model.report(&session);
    let threads = session.threads();
    let opts = BenchOptions {
        prompt_len: args.prompt_len,
        gen: args.gen,
        reps: args.reps,
        cold: args.cold,
        warmup: !args.no_warmup,
        seed: args.seed,
    };
    let seq_gb_s = if args.cold || args.model.direct_io {
        session.evict_expert_cache()?;
        session
            .expert_store()
            .sequential_direct_gb_s(SEQ_PROBE_BYTES)?
    } else {
        None
    };
    // On the GPU the roofline's memory is device memory, and expert misses
    // cross PCIe.
    let gpu_bw = session.gpu_bandwidths()?;
    let mem_gb_s = match gpu_bw {
        Some((hbm, _)) => hbm,
        None => bench::memory_read_gb_s(threads)?,
    };
    let h2d_gb_s = gpu_bw.map(|(_, h2d)| h2d);
    let quiet = args.json;
    let result = bench::run(&mut session, &opts, &mut |line| {
        if !quiet {
            eprintln!("{line}");
        }
    })?;
    let report = Report {
        session: &session,
        args: &args,
        result: &result,
        threads,
        mem_gb_s,
        h2d_gb_s,
        seq_gb_s,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        print!("{}", report.text());
    }
    Ok(())
}

struct Report<'a> {
    session: &'a Session,
    args: &'a BenchArgs,
    result: &'a BenchResult,
    threads: usize,
    mem_gb_s: f64,
    h2d_gb_s: Option<f64>,
    seq_gb_s: Option<f64>,
}

impl Report<'_> {
    fn mode(&self) -> &'static str {
        if self.args.cold {
            "cold"
        } else {
            "warm"
        }
    }

    fn io(&self) -> &'static str {
        if self.args.model.direct_io {
            "O_DIRECT"
        } else if self.args.model.no_mmap {
            "pread"
        } else {
            "mmap"
        }
    }

    /// Decode tokens per second if every weight byte a token reads streamed
    /// at the measured memory bandwidth.
    fn roofline_tok_s(&self) -> f64 {
        self.mem_gb_s * 1e9 / self.session.decode_bytes_per_token() as f64
    }

    /// Decode tokens per second if the weights streamed at the memory
    /// bandwidth and the expert bytes missing from the GPU cache crossed
    /// PCIe at the pinned copy bandwidth, one after the other.
    fn pcie_ceiling_tok_s(&self, t: &TestResult) -> Option<f64> {
        let h2d = self.h2d_gb_s?;
        let dense = self.session.decode_bytes_per_token() as f64 / (self.mem_gb_s * 1e9);
        Some(1.0 / (dense + t.needed_upload_bytes_per_token() / (h2d * 1e9)))
    }

    fn test_json(t: &TestResult) -> Value {
        let phases: serde_json::Map<String, Value> = t
            .times
            .keyed()
            .iter()
            .map(|(name, d)| (name.to_string(), json!(t.ms_per_token(*d))))
            .collect();
        json!({
            "tokens": t.tokens,
            "tok_s": t.mean_tok_s(),
            "tok_s_std": t.std_tok_s(),
            "tok_s_reps": t.tok_s,
            "ms_per_token": phases,
            "expert_bytes_per_token": t.expert_bytes_per_token(),
            "expert_reads": t.io.reads,
            "expert_gb_s": t.expert_gb_s(),
            "disk_bytes": t.disk_bytes,
            "page_cache_hit_rate": t.page_cache_hit_rate(),
            "prefetch_hit_rate": t.prefetch.hit_rate(),
            "prefetch_precision": t.prefetch.precision(),
            "gpu_cache_hit_rate": t.gpu_cache.hit_rate(),
            "uploaded_bytes_per_token": t.uploaded_bytes_per_token(),
            "needed_upload_bytes_per_token": t.needed_upload_bytes_per_token(),
            "gpu_prefetched": t.gpu_cache.prefetched,
            "gpu_prefetch_used": t.gpu_cache.prefetch_hits,
            "gpu_cpu_computed": t.gpu_cache.cpu_computed,
            // `--low-width-misses`: the share of expert uses that ran on a
            // low-width copy, misses uploaded as copies, and copies a
            // prefetch replaced at full width.
            "gpu_low_width_share": t.gpu_cache.low_width_share(),
            "gpu_low_width_misses": t.gpu_cache.low_misses,
            "gpu_promoted": t.gpu_cache.promoted,
            // Per level, of the timed part: expert uses found in VRAM,
            // VRAM misses copied from the pinned host tier, and those read
            // from the expert files (page cache or disk).
            "gpu_vram_hits": t.gpu_cache.hits,
            "gpu_host_tier_hits": t.gpu_cache.host_hits,
            "gpu_file_reads": t.gpu_cache.file_reads,
            "gpu_file_bytes_per_token": t.file_bytes_per_token(),
            "gpu_expert_uses_per_rep": t.expert_uses_per_rep(),
            // The disk path (see CacheStats): experts read a layer ahead on
            // a predicted choice and those used; the file bytes the layers
            // needed; the layers' own read batches (one per layer that
            // missed) and their time from issue to the last landing; the
            // wait for a layer's read-ahead.
            "gpu_ahead_reads": t.gpu_cache.ahead_reads,
            "gpu_ahead_used": t.gpu_cache.ahead_used,
            "gpu_needed_file_bytes_per_token": t.needed_file_bytes_per_token(),
            "gpu_host_tier_bytes_per_token": t.host_tier_bytes_per_token(),
            "gpu_read_batches": t.gpu_cache.read_batches,
            "gpu_read_ms_per_token": t.ms_per_token(Duration::from_nanos(t.gpu_cache.read_ns)),
            "gpu_read_ahead_wait_ms_per_token":
                t.ms_per_token(Duration::from_nanos(t.gpu_cache.ahead_wait_ns)),
            "wall_ms_per_token": t.wall_ms_per_token(),
        })
    }

    fn ceiling_json(&self, t: &TestResult) -> Value {
        match t.disk_ceiling(self.seq_gb_s, self.h2d_gb_s) {
            None => Value::Null,
            Some(c) => json!({
                "tok_s": c.tok_s,
                "reached": c.reached,
                "disk_ms_per_token": c.disk_ms,
                "host_tier_ms_per_token": c.host_ms,
                "resident_ms_per_token": c.resident_ms,
                "expert_wait_ms_per_token": t.ms_per_token(t.times.expert_io),
            }),
        }
    }

    /// Whether the VRAM cache is partial and a repetition of `t` did not
    /// use more experts than it holds (its hit rate then flatters).
    fn cache_outlasts(&self, t: &TestResult) -> bool {
        let slots = self.session.gpu_cache_slots();
        let store = self.session.expert_store();
        let experts: usize = store.layers().filter_map(|l| store.num_experts(l)).sum();
        slots > 0 && slots < experts && !t.outgrows_cache(slots)
    }

    fn json(&self) -> Value {
        let c = self.session.config();
        let r = self.result;
        let h = self.session.gpu_host_tier();
        json!({
            "model": self.session.model_dir().display().to_string(),
            "model_type": c.arch.model_type(),
            "layers": c.num_layers,
            "hidden": c.hidden_size,
            "experts": c.moe.num_experts,
            "experts_per_token": self.session.experts_per_token(),
            "threads": self.threads,
            "backend": self.session.backend(),
            // The timed decode's (the warm-up's uses are not counted).
            "gpu_cache_hit_rate": r.decode.as_ref().and_then(|t| t.gpu_cache.hit_rate()),
            "gpu_cache_outlasts_decode": r.decode.as_ref().map(|t| self.cache_outlasts(t)),
            "simd": simd_level().to_string(),
            "io": self.io(),
            "mode": self.mode(),
            "reps": self.args.reps,
            "prefill_tok_s": r.prefill.as_ref().map(TestResult::mean_tok_s),
            "decode_tok_s": r.decode.as_ref().map(TestResult::mean_tok_s),
            "prefill": r.prefill.as_ref().map(Self::test_json),
            "decode": r.decode.as_ref().map(Self::test_json),
            "decode_bytes_per_token": self.session.decode_bytes_per_token(),
            "memory_gb_s": self.mem_gb_s,
            "decode_roofline_tok_s": self.roofline_tok_s(),
            "sequential_direct_gb_s": self.seq_gb_s,
            "h2d_pinned_gb_s": self.h2d_gb_s,
            "gpu_cache_slots": self.session.gpu_cache_slots(),
            "host_tier": json!({ "layers": h.layers, "slots": h.slots, "bytes": h.bytes }),
            "expert_bytes_total": self.session.expert_store().total_bytes(),
            "decode_pcie_ceiling_tok_s": r.decode.as_ref().and_then(|t| self.pcie_ceiling_tok_s(t)),
            // Needed file bytes / sequential_direct_gb_s + host-tier bytes /
            // h2d_pinned_gb_s + resident time (bench::DiskCeiling).
            "decode_disk_ceiling_tok_s": r.decode.as_ref()
                .and_then(|t| t.disk_ceiling(self.seq_gb_s, self.h2d_gb_s))
                .map(|c| c.tok_s),
            "decode_disk_ceiling": r.decode.as_ref().map_or(Value::Null, |t| self.ceiling_json(t)),
            "io_threads": self.session.expert_store().options().io_threads,
        })
    }

    fn text(&self) -> String {
        let c = self.session.config();
        let r = self.result;
        let mut out = format!(
            "model {} ({}, {} layers, hidden {}, {} experts, {} per token)\n\
             {} threads, {}, experts via {}, {}, {} reps, backend {}\n\n",
            self.session.model_dir().display(),
            c.arch.model_type(),
            c.num_layers,
            c.hidden_size,
            c.moe.num_experts,
            self.session.experts_per_token(),
            self.threads,
            simd_level(),
            self.io(),
            self.mode(),
            self.args.reps,
            self.session.backend(),
        );
        let tests: Vec<(String, &TestResult)> = [
            r.prefill.as_ref().map(|t| (format!("pp{}", t.tokens), t)),
            r.decode.as_ref().map(|t| (format!("tg{}", t.tokens), t)),
        ]
        .into_iter()
        .flatten()
        .collect();
        let pct = |x: Option<f64>| x.map_or("-".to_string(), |h| format!("{:.0}%", h * 100.0));
        out.push_str(&format!(
            "{:<8} {:>10} {:>8} {:>14} {:>11} {:>10} {:>9}\n",
            "test", "tok/s", "±", "experts/token", "expert GB/s", "page cache", "prefetch"
        ));
        for (name, t) in &tests {
            out.push_str(&format!(
                "{:<8} {:>10.2} {:>8.2} {:>14} {:>11.2} {:>10} {:>9}\n",
                name,
                t.mean_tok_s(),
                t.std_tok_s(),
                human_bytes(t.expert_bytes_per_token() as u64),
                t.expert_gb_s(),
                pct(t.page_cache_hit_rate()),
                pct(t.prefetch.hit_rate()),
            ));
        }
        out.push_str("\nms per token");
        for (name, _) in &tests {
            out.push_str(&format!(" {name:>10}"));
        }
        out.push('\n');
        let phase_names = tests
            .first()
            .map(|(_, t)| t.times.phases())
            .unwrap_or_default();
        for (i, (phase, _)) in phase_names.iter().enumerate() {
            out.push_str(&format!("  {phase:<18}"));
            for (_, t) in &tests {
                out.push_str(&format!(" {:>8.3}", t.ms_per_token(t.times.phases()[i].1)));
            }
            out.push('\n');
        }
        let bpt = self.session.decode_bytes_per_token();
        out.push_str(&format!(
            "\ndecode roofline: {} of weights per token / {:.1} GB/s memory read = {:.1} tok/s",
            human_bytes(bpt),
            self.mem_gb_s,
            self.roofline_tok_s()
        ));
        if let Some(t) = &r.decode {
            out.push_str(&format!(
                " ({:.0}% reached)",
                100.0 * t.mean_tok_s() / self.roofline_tok_s()
            ));
        }
        out.push('\n');
        if let Some(h2d) = self.h2d_gb_s {
            let store = self.session.expert_store();
            let total = store.total_bytes();
            let extent = store.layers().next().map_or(0, |l| store.extent_bytes(l));
            let cached = (self.session.gpu_cache_slots() * extent) as u64;
            out.push_str(&format!(
                "GPU expert cache: {} slots, {} ({:.0}% of the {} of experts); \
                 pinned host-to-GPU {:.1} GB/s\n",
                self.session.gpu_cache_slots(),
                human_bytes(cached),
                100.0 * cached.min(total) as f64 / total.max(1) as f64,
                human_bytes(total),
                h2d
            ));
            for (name, t) in &tests {
                out.push_str(&format!(
                    "  {name}: cache hit rate {}, {} uploaded per token",
                    pct(t.gpu_cache.hit_rate()),
                    human_bytes(t.uploaded_bytes_per_token() as u64)
                ));
                if t.gpu_cache.low_hits + t.gpu_cache.low_misses > 0 {
                    out.push_str(&format!(
                        ", {} of expert uses on low-width copies ({} replaced by prefetches)",
                        pct(t.gpu_cache.low_width_share()),
                        t.gpu_cache.promoted
                    ));
                }
                if self.cache_outlasts(t) {
                    let per_token = t.expert_uses_per_rep() / t.tokens.max(1) as u64;
                    let enough =
                        (self.session.gpu_cache_slots() as u64 * 2).div_ceil(per_token.max(1));
                    out.push_str(&format!(
                        " (a repetition used {} experts, fewer than the {} slots: the rate \
                         flatters; run at least {enough} tokens)",
                        t.expert_uses_per_rep(),
                        self.session.gpu_cache_slots()
                    ));
                }
                if name.starts_with("tg") {
                    if let Some(c) = self.pcie_ceiling_tok_s(t) {
                        out.push_str(&format!(
                            "; PCIe ceiling {c:.1} tok/s ({:.0}% reached)",
                            100.0 * t.mean_tok_s() / c
                        ));
                    }
                }
                out.push('\n');
            }
        }
        if let Some(seq) = self.seq_gb_s {
            out.push_str(&format!("sequential O_DIRECT read: {seq:.2} GB/s"));
            if let Some(t) = &r.decode {
                out.push_str(&format!(
                    "; decode read experts at {:.2} GB/s ({:.0}%)",
                    t.expert_gb_s(),
                    100.0 * t.expert_gb_s() / seq
                ));
            }
            out.push('\n');
        }
        if let Some((t, c)) = r
            .decode
            .as_ref()
            .and_then(|t| Some((t, t.disk_ceiling(self.seq_gb_s, self.h2d_gb_s)?)))
        {
            out.push_str(&format!(
                "disk ceiling: {} needed from the files per token / {:.2} GB/s = {:.2} ms",
                human_bytes(t.needed_file_bytes_per_token() as u64),
                self.seq_gb_s.unwrap_or_default(),
                c.disk_ms
            ));
            if c.host_ms > 0.0 {
                out.push_str(&format!(" + {:.2} ms from the host tier", c.host_ms));
            }
            out.push_str(&format!(
                " + {:.2} ms resident (the token's time outside the expert wait) = {:.1} tok/s \
                 ({:.0}% reached)\n",
                c.resident_ms,
                c.tok_s,
                100.0 * c.reached
            ));
        }
        out
    }
}
