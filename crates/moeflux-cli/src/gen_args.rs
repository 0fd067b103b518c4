//! Options shared by `run` and `chat`: model, compute, sampling, display.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use moeflux::backend::cuda::CachePolicy;
use moeflux::generate::GenerateOptions;
use moeflux::sample::SamplerConfig;
use moeflux::session::{Activations, Backend, DistInit, Gds, GpuSelection, Prefetch, Repack};
use moeflux::text::chat::ChatTemplate;
use moeflux::text::tokenizer::Tokenizer;
use moeflux::{Session, SessionOptions};

use crate::model_ref::ModelRef;

#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model directory written by `moeflux convert`, or `hf:ORG/NAME[@REV][:QUANT]`
    /// to pull one from the Hugging Face Hub (see `moeflux pull`; default:
    /// the demo model in the source tree's `models/demo`).
    #[arg(long, value_parser = crate::model_ref::parse)]
    pub model: Option<ModelRef>,
    /// Compute threads, 1 to 4 times the cores (default: all cores).
    #[arg(long, value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// Routed experts per token, fewer than the model's default: faster,
    /// but quality drops (flash-moe's speed knob).
    #[arg(long)]
    pub experts_per_token: Option<usize>,
    /// Read experts with O_DIRECT, bypassing the page cache (for models
    /// far larger than RAM).
    #[arg(long)]
    pub direct_io: bool,
    /// Copy experts into buffers with pread instead of reading them from a
    /// memory mapping of the expert files.
    #[arg(long, conflicts_with = "direct_io")]
    pub no_mmap: bool,
    /// GPU with --direct-io: read missed experts from the files straight
    /// into VRAM with GPUDirect Storage (NVIDIA's cuFile, loaded at run
    /// time: the `nvidia-cufile` wheel or the CUDA toolkit's libcufile).
    /// `auto` uses it where the nvidia-fs kernel module is loaded (the
    /// startup line says which path reads), `on` always (cuFile's
    /// compatibility mode included; an error without cuFile), `off` never.
    #[arg(long, default_value = "auto", value_parser = parse_gds)]
    pub gds: Gds,
    /// Threads that read experts from the files (each holds one read in
    /// flight; a disk wants a few more than a layer's misses).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub io_threads: u16,
    /// Fetch the experts the next layer will likely use while the current
    /// layer computes: `on` (the same as a bare `--prefetch`), `off`, or
    /// `auto`: on for GPU uploads from the `--host-cache` tier when experts
    /// are 256 KiB or more, off on the CPU (where it helps experts read
    /// from disk). On the GPU without a host tier, `on` reads the guess
    /// from the files a layer ahead (slower on a bandwidth-bound disk).
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "on",
          value_parser = parse_prefetch)]
    pub prefetch: Prefetch,
    /// Longest context in tokens, at most the model's maximum
    /// (`max_position_embeddings`; the default).
    #[arg(long, visible_alias = "ctx-size", value_parser = parse_ctx)]
    pub ctx: Option<usize>,
    /// Where to compute: `auto` uses an NVIDIA GPU when the CUDA driver and
    /// a device are present, else the CPU.
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    pub backend: Backend,
    /// GPUs to run on: `all`, or CUDA numbers such as `0,1` (default: GPU
    /// 0). Several share the work: each holds the dense model and the
    /// sequence state, the routed experts are split between them by bytes
    /// (each caches and uploads only its own), and NCCL sums each MoE
    /// layer's output (NCCL is loaded at run time: NVIDIA's
    /// `nvidia-nccl-cu13` wheel or the CUDA toolkit's libnccl2). An error,
    /// not a CPU fallback, when a GPU or NCCL is missing.
    #[arg(long, value_parser = parse_gpus)]
    pub gpus: Option<GpuSelection>,
    /// Several GPUs: `auto` loads every routed expert on every GPU when
    /// each GPU's expert budget (`--gpu-memory`, or its free memory) holds
    /// them all; steps of up to 16 tokens (decode) then run on each GPU
    /// alone, at one GPU's speed with no all-reduce, and prefill still
    /// splits the experts. `off`: each GPU holds only its shard.
    #[arg(long, default_value = "auto", value_parser = parse_replicate, action = clap::ArgAction::Set)]
    pub replicate_experts: bool,
    /// Join a group of processes, one GPU each, on this or other hosts:
    /// `tcp://HOST:PORT` where rank 0 listens and hands NCCL's id to the
    /// others (NCCL then carries the traffic). Needs --rank and --world;
    /// every rank runs the same command (the same prompt and tokens).
    #[arg(
        long,
        value_name = "tcp://HOST:PORT",
        requires = "rank",
        requires = "world"
    )]
    pub dist_init: Option<String>,
    /// With --dist-init: this process's rank, 0 to --world less 1.
    #[arg(long, requires = "dist_init")]
    pub rank: Option<usize>,
    /// With --dist-init: the number of processes.
    #[arg(long, requires = "dist_init")]
    pub world: Option<usize>,
    /// GPU: memory for the routed-expert cache, e.g. `20G` or `512M`
    /// (default: all free memory after the dense weights, less 3 GiB, at most
    /// what all experts take; when they all fit, they are loaded at start).
    #[arg(long, value_parser = parse_size)]
    pub gpu_memory: Option<u64>,
    /// GPU: which cached expert to replace: `lfu` (frequency with aging) or
    /// `lru`.
    #[arg(long, default_value = "lfu", value_parser = parse_policy)]
    pub cache_policy: CachePolicy,
    /// GPU: host RAM to pin for the experts the GPU cache cannot hold, e.g.
    /// `64G` (whole layers of the expert files, in layer order): misses are
    /// then copied at full PCIe speed instead of being read into staging
    /// buffers first.
    #[arg(long, value_parser = parse_size)]
    pub host_cache: Option<u64>,
    /// GPU with `--host-cache`: at most this many of a layer's experts
    /// missing from VRAM (and not being prefetched) are computed by the CPU
    /// from host RAM instead of being copied over PCIe.
    #[arg(long, default_value_t = 0)]
    pub cpu_experts: usize,
    /// CPU: `f32` keeps the activations of the quantized products exact;
    /// `q8` rounds them to 8 bits per 32 inputs (as llama.cpp does) for
    /// 4/8-bit and MXFP4 weights: faster decode on the CPU, at a small
    /// cost in accuracy (docs/PERFORMANCE.md) and without the goldens'
    /// bounds.
    #[arg(long, default_value = "f32", value_parser = parse_activations)]
    pub cpu_activations: Activations,
    /// GPU: `q8` rounds the activations of the products of 4-bit affine
    /// matrices to 8 bits per 32 inputs, as `--cpu-activations q8` does,
    /// and multiplies them in integers (`dp4a` for decode steps, int8
    /// tensor cores for prefill): faster decode and prefill, at the same
    /// small accuracy cost (docs/PERFORMANCE.md). Routers stay as with
    /// `f32`.
    #[arg(long, default_value = "f32", value_parser = parse_activations)]
    pub gpu_activations: Activations,
    /// CPU: hold 4-bit experts (MXFP4, or MLX affine in groups of 64) in
    /// RAM with eight rows interleaved, made at load: faster `q8`
    /// products, same results.
    /// `auto` does it with `--cpu-activations q8`, without `--direct-io`,
    /// when the experts fit in available memory with 2 GiB to spare; `on`
    /// always; `off` never (experts stream from the files).
    #[arg(long, default_value = "auto", value_parser = parse_repack)]
    pub cpu_repack: Repack,
    /// Use the model's low-width copies of its routed experts (made by
    /// `moeflux convert --low-width-copies 2`) in place of the experts:
    /// fewer bytes per expert read, uploaded and cached, at a quality cost
    /// (`moeflux perplexity --kl` reports it against the experts).
    #[arg(long)]
    pub low_width_experts: bool,
    /// GPU: keep the expert cache at full width but upload each miss as
    /// the expert's low-width copy (`convert --low-width-copies 2`): about
    /// half the bytes over PCIe where the misses wait. Predicted experts
    /// the prefetch uploads from the host tier travel at full width and
    /// replace the copies they find. The quality cost lies between the
    /// experts' and `--low-width-experts`', by the share of uses that ran
    /// on a copy (`bench` reports it).
    #[arg(long, conflicts_with = "low_width_experts")]
    pub low_width_misses: bool,
    /// With --low-width-misses: the experts the router weighs below W (the
    /// largest weight a token of the step gives the expert; a token's K
    /// weights sum to 1 in most families) travel as copies, misses and
    /// the prefetch's predicted experts alike; the rest are uploaded at
    /// full width and replace a copy found in VRAM.
    #[arg(long, value_name = "W", requires = "low_width_misses")]
    pub low_width_below: Option<f32>,
    /// GPU: launch every kernel of a decode step one by one instead of
    /// replaying the step as a CUDA graph (for comparison and debugging).
    #[arg(long)]
    pub no_cuda_graphs: bool,
}

/// The most `--threads` accepted, per core: more only adds contention.
const THREADS_PER_CORE: usize = 4;

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn parse_threads(s: &str) -> std::result::Result<usize, String> {
    let n: usize = s
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a number of threads"))?;
    let cores = cores();
    let max = THREADS_PER_CORE * cores;
    match n {
        0 => Err(format!(
            "at least 1 (leave --threads out to use all {cores} cores)"
        )),
        n if n > max => Err(format!(
            "{n} is more than {THREADS_PER_CORE} per core of this machine's {cores} (at most {max})"
        )),
        n => Ok(n),
    }
}

fn parse_repack(s: &str) -> std::result::Result<Repack, String> {
    Repack::parse(s).ok_or_else(|| format!("`{s}`: expected auto, on or off"))
}

fn parse_replicate(s: &str) -> std::result::Result<bool, String> {
    match s.trim() {
        "auto" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("`{s}`: expected auto or off")),
    }
}

fn parse_activations(s: &str) -> std::result::Result<Activations, String> {
    Activations::parse(s).ok_or_else(|| format!("`{s}`: expected f32 or q8"))
}

fn parse_ctx(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("the context must hold at least 1 token".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a number of tokens")),
    }
}

/// Errors unless `tokens` (what `what` holds) fit the session's context;
/// the message says by how much and what to change.
pub fn check_fits(session: &Session, tokens: usize, what: &str) -> Result<()> {
    let limit = session.max_context();
    if tokens <= limit {
        return Ok(());
    }
    let model_max = session.config().max_position_embeddings;
    let hint = if limit < model_max {
        format!("shorten it or raise --ctx (the model's maximum is {model_max})")
    } else {
        "shorten it (this is the model's maximum)".to_string()
    };
    anyhow::bail!("{what} is {tokens} tokens, more than the context of {limit}: {hint}")
}

fn parse_backend(s: &str) -> std::result::Result<Backend, String> {
    Backend::parse(s).ok_or_else(|| format!("`{s}` is not one of auto, cpu, cuda"))
}

fn parse_gpus(s: &str) -> std::result::Result<GpuSelection, String> {
    GpuSelection::parse(s)
}

fn parse_gds(s: &str) -> std::result::Result<Gds, String> {
    Gds::parse(s).ok_or_else(|| format!("`{s}` is not one of auto, on, off"))
}

fn parse_prefetch(s: &str) -> std::result::Result<Prefetch, String> {
    Prefetch::parse(s).ok_or_else(|| format!("`{s}` is not one of auto, on, off"))
}

fn parse_policy(s: &str) -> std::result::Result<CachePolicy, String> {
    CachePolicy::parse(s).ok_or_else(|| format!("`{s}` is not one of lfu, lru"))
}

/// `123`, `512K`, `20M`, `40G`, `1T` (powers of 1024; an optional `i`/`B`
/// suffix, `GiB` or `GB`, reads the same).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix(['B', 'b']).unwrap_or(t);
    let t = t.strip_suffix('i').unwrap_or(t);
    let (num, shift) = match t.chars().last() {
        Some('K' | 'k') => (&t[..t.len() - 1], 10),
        Some('M' | 'm') => (&t[..t.len() - 1], 20),
        Some('G' | 'g') => (&t[..t.len() - 1], 30),
        Some('T' | 't') => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("`{s}` is not a size (e.g. 512M, 20G)"))?;
    if !(v.is_finite() && v >= 0.0) {
        return Err(format!("`{s}` is not a size (e.g. 512M, 20G)"));
    }
    Ok((v * (1u64 << shift) as f64) as u64)
}

impl ModelArgs {
    /// The model directory: `--model`, else the demo model.
    pub fn dir(&self) -> Result<PathBuf> {
        match &self.model {
            Some(m) => {
                let dir = m.dir()?;
                // A file given as the model: say so, not that some file
                // inside it cannot be read.
                if dir.metadata().is_ok_and(|m| !m.is_dir()) {
                    anyhow::bail!(
                        "--model {}: not a directory (give the model directory `moeflux convert` \
                         wrote)",
                        dir.display()
                    );
                }
                Ok(dir.to_path_buf())
            }
            None => crate::demo::model_dir(),
        }
    }

    /// `--dist-init`, `--rank` and `--world`, checked.
    pub fn dist(&self) -> Result<Option<DistInit>> {
        match (&self.dist_init, self.rank, self.world) {
            (Some(url), Some(rank), Some(world)) => DistInit::new(url, rank, world)
                .map(Some)
                .map_err(|e| anyhow::anyhow!("--dist-init: {e}")),
            _ => Ok(None),
        }
    }

    /// Opens the session these flags describe (saying so when it is the
    /// demo model because no `--model` was given).
    pub fn open_session(&self) -> Result<Session> {
        let dir = self.dir()?;
        let dist = self.dist()?;
        if self.model.is_none() {
            eprintln!(
                "no --model given: using the demo model {} (docs/DEMO.md)",
                dir.display()
            );
        }
        if let Some(ctx) = self.ctx {
            // Before loading any weights; a config.json that cannot be
            // read is reported by Session::open below.
            if let Ok(c) = moeflux::config::ModelConfig::from_dir(&dir) {
                if ctx > c.max_position_embeddings {
                    anyhow::bail!(
                        "--ctx {ctx} is more than the model's maximum context of {} tokens \
                         (max_position_embeddings in {})",
                        c.max_position_embeddings,
                        dir.join("config.json").display()
                    );
                }
            }
        }
        Session::open(
            &dir,
            SessionOptions {
                threads: self.threads,
                experts_per_token: self.experts_per_token,
                direct_io: self.direct_io,
                mmap: !self.no_mmap,
                prefetch: self.prefetch,
                io_threads: self.io_threads.into(),
                max_context: self.ctx,
                backend: self.backend,
                gpus: self.gpus.clone().unwrap_or_default(),
                dist,
                gpu_memory: self.gpu_memory,
                cache_policy: self.cache_policy,
                cuda_graphs: !self.no_cuda_graphs,
                host_cache: self.host_cache,
                cpu_experts: self.cpu_experts,
                replicate_experts: self.replicate_experts,
                gds: self.gds,
                cpu_activations: self.cpu_activations,
                gpu_activations: self.gpu_activations,
                cpu_repack: self.cpu_repack,
                low_width_experts: self.low_width_experts,
                low_width_misses: self.low_width_misses,
                low_width_below: self.low_width_below,
                ..Default::default()
            },
        )
        .with_context(|| format!("opening model {}", dir.display()))
    }

    /// On stderr: which GPU the session uses (or why `auto` could not use
    /// one: the GPU backend cannot run the model, or a GPU seems to be there
    /// but failed; a machine without a CUDA driver is the normal CPU case and
    /// says nothing), and a warning when fewer experts than the model's
    /// default are used.
    pub fn report(&self, session: &Session) {
        if session.on_gpu() {
            eprintln!("using {}", session.backend());
        } else if let Some(why) = session.gpu_unsupported() {
            eprintln!("warning: running on the CPU: {why}");
        } else if self.backend == Backend::Auto && moeflux::backend::cuda::device::driver_present()
        {
            eprintln!("warning: {}", session.backend());
        }
        if !session.on_gpu() {
            let gpu_only = [
                ("--gpu-memory", self.gpu_memory.is_some()),
                ("--host-cache", self.host_cache.is_some()),
                ("--no-cuda-graphs", self.no_cuda_graphs),
                (
                    "--gpu-activations",
                    self.gpu_activations != Activations::F32,
                ),
            ];
            for (flag, _) in gpu_only.iter().filter(|(_, given)| *given) {
                eprintln!("warning: {flag} has no effect on the CPU");
            }
        }
        if session.on_gpu() && self.cpu_activations != Activations::F32 && self.cpu_experts == 0 {
            eprintln!(
                "warning: --cpu-activations has no effect on the GPU (only on --cpu-experts)"
            );
        }
        let full = session.config().moe.num_experts_per_tok;
        if let Some(k) = self.experts_per_token.filter(|&k| k < full) {
            eprintln!(
                "warning: {k} of the model's {full} experts per token: faster, but output quality drops"
            );
        }
    }
}

#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// Temperature; 0 is greedy. Default: generation_config.json, else 0.8.
    #[arg(long)]
    pub temp: Option<f32>,
    /// Keep only the K most likely tokens (0 = off). Default: generation_config.json, else 40.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Nucleus sampling mass (1 = off). Default: generation_config.json, else 0.95.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for recently seen tokens (1 = off).
    #[arg(long)]
    pub repeat_penalty: Option<f32>,
    /// Subtracted from the logits of tokens already present (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Random seed (default: from the clock; printed with --timing).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text is generated (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating after end-of-sequence tokens (for benchmarks).
    #[arg(long)]
    pub ignore_eos: bool,
}

#[derive(Debug, Clone, Args)]
pub struct DisplayArgs {
    /// Ask the model to think first (Qwen3.5 `enable_thinking=true`).
    #[arg(long, conflicts_with = "no_think")]
    pub think: bool,
    /// Ask the model to answer without thinking (`enable_thinking=false`).
    #[arg(long)]
    pub no_think: bool,
    /// How much the model reasons: the template variable
    /// `reasoning_effort` (gpt-oss; other templates ignore it).
    #[arg(long, value_parser = ["low", "medium", "high"])]
    pub reasoning_effort: Option<String>,
    /// Do not print the model's reasoning.
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Print a per-phase time breakdown after each answer.
    #[arg(long)]
    pub timing: bool,
}

impl DisplayArgs {
    /// Template variables besides `enable_thinking`.
    pub fn template_extra(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut extra = serde_json::Map::new();
        if let Some(e) = &self.reasoning_effort {
            extra.insert("reasoning_effort".into(), e.clone().into());
        }
        extra
    }

    pub fn enable_thinking(&self) -> Option<bool> {
        match (self.think, self.no_think) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        }
    }
}

impl SamplingArgs {
    /// `cfg` with the seed a group of processes shares (rank 0's, from
    /// `--dist-init`) unless --seed was given, so every rank samples alike.
    pub fn shared_seed(&self, mut cfg: SamplerConfig, session: &Session) -> SamplerConfig {
        if let (None, Some(seed)) = (self.seed, session.shared_seed()) {
            cfg.seed = seed;
        }
        cfg
    }

    /// Flags first, then the model's generation_config.json, then defaults.
    pub fn sampler(&self, model_dir: &Path) -> Result<SamplerConfig> {
        let gc_path = model_dir.join("generation_config.json");
        let text = moeflux::format::read_small_text(
            &gc_path,
            moeflux::text::tokenizer::MAX_TEXT_CONFIG_BYTES,
        );
        let gc: serde_json::Value = match text {
            Ok(t) => serde_json::from_str(&t)
                .with_context(|| format!("{}: invalid JSON", gc_path.display()))?,
            Err(moeflux::Error::Io { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                serde_json::Value::Null
            }
            Err(e) => return Err(e.into()),
        };
        let num = |k: &str| gc.get(k).and_then(|v| v.as_f64());
        let sample = gc.get("do_sample").and_then(|v| v.as_bool()) != Some(false);
        let default_temp = if sample {
            num("temperature").unwrap_or(0.8) as f32
        } else {
            0.0
        };
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let cfg = SamplerConfig {
            temperature: self.temp.unwrap_or(default_temp),
            top_k: self
                .top_k
                .unwrap_or(num("top_k").map(|v| v as usize).unwrap_or(40)),
            top_p: self.top_p.unwrap_or(num("top_p").unwrap_or(0.95) as f32),
            min_p: self.min_p,
            repetition_penalty: self
                .repeat_penalty
                .unwrap_or(num("repetition_penalty").unwrap_or(1.0) as f32),
            presence_penalty: self.presence_penalty,
            seed,
            ..SamplerConfig::default()
        };
        cfg.validate().map_err(anyhow::Error::msg)?;
        Ok(cfg)
    }

    /// Generation options from these flags and a sampler made by [`Self::sampler`].
    pub fn generate_options(&self, sampler: SamplerConfig) -> GenerateOptions {
        GenerateOptions {
            max_tokens: self.max_tokens,
            sampler,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            ..Default::default()
        }
    }
}

/// Everything `run`/`chat` open, with the load time.
pub struct Loaded {
    pub session: Session,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    pub load_time: Duration,
}

pub fn load(m: &ModelArgs) -> Result<Loaded> {
    let t0 = Instant::now();
    let spinner = crate::progress::spinner("loading model");
    // The small files first: a broken template or tokenizer is reported
    // before any weights are read.
    let dir = m.dir()?;
    let tokenizer = Tokenizer::from_model_dir(&dir)?;
    let template = ChatTemplate::from_model_dir(&dir)?;
    let session = m.open_session()?;
    let template = template.with_context_window(session.max_context());
    spinner.finish_and_clear();
    m.report(&session);
    Ok(Loaded {
        session,
        tokenizer,
        template,
        load_time: t0.elapsed(),
    })
}

/// A flag raised by Ctrl-C, which the generation loop polls. Ctrl-C while
/// the flag is still raised (nobody has acted on it yet) exits at once.
/// Installing the handler is process-wide.
pub fn interrupt_flag() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    })
    .context("installing the Ctrl-C handler")?;
    Ok(flag)
}
