//! `pull`: a model from the Hugging Face Hub, by name, ready to run.
//!
//! The repo's files go into the standard Hugging Face cache (shared with
//! Python tools, see [`cache`]), then are converted once into moeflux's own
//! models directory, `<models_dir>/<org>--<name>--<commit>`, which the next
//! pull of the same commit reuses without downloading anything. In the
//! library (behind the `hub` feature) rather than the command so that
//! embedders can open `hf:` models the way `moeflux` does.
//!
//! Order of work: the revision's listing (commit and files) -> the repo's
//! kind ([`select`]: safetensors, or one GGUF quantization) -> for
//! safetensors, config.json and the tokenizer files; for GGUF, the first
//! 64 KiB of the file -> the architecture check (a model moeflux cannot
//! run is refused before any weight is fetched) -> the weights, several at
//! once -> `convert` (a GGUF through its GGUF source, the tokenizer from
//! its metadata).

pub mod cache;
pub mod config;
pub mod download;
pub mod http;
pub mod select;
pub mod spec;

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

pub use config::HubConfig;
pub use download::Fetched;
pub use spec::RepoSpec;

use crate::convert::{convert, ConvertOptions, ConvertProgress, ConvertReport};
use crate::error::{Error, Result};
use crate::format::MANIFEST_FILE;

use cache::RepoCache;
use select::{Listing, RepoKind};

/// What a pull is doing, for a progress display.
#[derive(Debug, Clone)]
pub enum PullProgress<'a> {
    /// The revision resolved to this commit.
    Resolved { commit: &'a str },
    /// Downloading: bytes of this batch of files so far and in all
    /// (config and tokenizer files first, then the weights).
    Download { bytes_done: u64, bytes_total: u64 },
    /// Converting the downloaded checkpoint.
    Convert(&'a ConvertProgress),
}

/// Options of [`pull`].
#[derive(Default, Clone, Copy)]
pub struct PullOptions<'a> {
    /// Called from worker threads.
    pub progress: Option<&'a (dyn Fn(&PullProgress) + Sync)>,
    /// When set, downloads and the conversion stop with
    /// [`Error::Cancelled`]; partial downloads stay (and resume), a partial
    /// conversion is removed.
    pub cancel: Option<&'a AtomicBool>,
}

/// A pulled model.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The moeflux model directory.
    pub dir: PathBuf,
    pub commit: String,
    /// The Hub cache snapshot it was converted from.
    pub snapshot: PathBuf,
    /// What was downloaded this time.
    pub fetched: Fetched,
    /// The conversion, when this pull converted (`None`: reused).
    pub converted: Option<ConvertReport>,
}

/// Where `spec` at `commit` is converted to:
/// `<models_dir>/<org>--<name>--<commit>`, with `--<GGUF file stem>` for a
/// GGUF repo ([`RepoKind::variant`]).
pub fn model_dir(cfg: &HubConfig, spec: &RepoSpec, commit: &str, kind: &RepoKind) -> PathBuf {
    let mut name = format!("{}--{commit}", spec.repo.replace('/', "--"));
    if let Some(v) = kind.variant() {
        name = format!("{name}--{v}");
    }
    cfg.models_dir.join(name)
}

/// What `convert` reads in the snapshot: the directory, or the GGUF file
/// (its first part; the others are found beside it).
fn convert_source(snapshot: &Path, kind: &RepoKind) -> PathBuf {
    match kind {
        RepoKind::Safetensors => snapshot.to_path_buf(),
        RepoKind::Gguf { files } => snapshot.join(&files[0]),
    }
}

fn is_model(dir: &Path) -> bool {
    dir.join(MANIFEST_FILE).is_file()
}

/// Downloads (or finds in the caches) `spec` and returns its moeflux model
/// directory.
pub fn pull(spec: &RepoSpec, cfg: &HubConfig, opts: &PullOptions) -> Result<Pulled> {
    let cache = RepoCache::new(&cfg.cache_dir, spec);
    let report = |p: PullProgress| {
        if let Some(cb) = opts.progress {
            cb(&p);
        }
    };
    if cfg.offline {
        return pull_offline(spec, cfg, &cache, opts);
    }
    let client = http::Client::new(cfg);
    let info = client.revision_info(&spec.repo, &spec.revision)?;
    let listing = Listing::from_json(&spec.repo, &info)?;
    let commit = listing.commit.clone();
    report(PullProgress::Resolved { commit: &commit });
    let kind = listing.kind(&spec.repo, spec.quant.as_deref())?;
    cache.write_ref(&spec.revision, &commit)?;
    let dir = model_dir(cfg, spec, &commit, &kind);
    let snapshot = cache.snapshot(&commit);
    if is_model(&dir) {
        return Ok(Pulled {
            dir,
            commit,
            snapshot,
            fetched: Fetched::default(),
            converted: None,
        });
    }

    let on_bytes = |done: u64, total: u64| {
        report(PullProgress::Download {
            bytes_done: done,
            bytes_total: total,
        })
    };
    let fetcher = download::Fetcher {
        client: &client,
        cache: &cache,
        repo: &spec.repo,
        commit: &commit,
        parallel: cfg.parallel,
        retries: cfg.retries,
        cancel: opts.cancel,
        progress: &on_bytes,
    };
    let fetched = match &kind {
        RepoKind::Safetensors => {
            let small = fetcher.fetch(&listing.small_files())?;
            check_model(spec, &snapshot)?;
            let weights = fetcher.fetch(&listing.weight_files(&spec.repo, &snapshot)?)?;
            Fetched {
                files: small.files + weights.files,
                bytes: small.bytes + weights.bytes,
            }
        }
        RepoKind::Gguf { files } => {
            if !snapshot.join(&files[0]).is_file() {
                check_gguf_model(spec, &client, &commit, &files[0])?;
            }
            fetcher.fetch(files)?
        }
    };
    let converted = convert_once(spec, &convert_source(&snapshot, &kind), &dir, opts)?;
    Ok(Pulled {
        dir,
        commit,
        snapshot,
        fetched,
        converted,
    })
}

/// `HF_HUB_OFFLINE`: the revision from `refs/`, the files from the
/// snapshot, no request at all.
fn pull_offline(
    spec: &RepoSpec,
    cfg: &HubConfig,
    cache: &RepoCache,
    opts: &PullOptions,
) -> Result<Pulled> {
    let missing = |what: String| Error::Hub {
        repo: spec.repo.clone(),
        reason: format!(
            "offline (HF_HUB_OFFLINE is set) and {what} in the Hub cache {}: pull it once \
             with the network, or unset HF_HUB_OFFLINE",
            cfg.cache_dir.display()
        ),
    };
    let commit = cache
        .resolve_ref(&spec.revision)?
        .ok_or_else(|| missing(format!("revision `{}` is not", spec.revision)))?;
    if let Some(opts) = opts.progress {
        opts(&PullProgress::Resolved { commit: &commit });
    }
    let snapshot = cache.snapshot(&commit);
    // The kind from the files the snapshot holds (those a pull fetched).
    let listing = Listing::from_snapshot(&commit, &snapshot)?;
    let kind = match listing.kind(&spec.repo, spec.quant.as_deref()) {
        Ok(k) => k,
        // Converted earlier, its snapshot since removed from the cache.
        Err(_)
            if spec.quant.is_none()
                && is_model(&model_dir(cfg, spec, &commit, &RepoKind::Safetensors)) =>
        {
            RepoKind::Safetensors
        }
        Err(e) => {
            let why = match e {
                Error::Hub { reason, .. } => reason,
                e => e.to_string(),
            };
            return Err(Error::Hub {
                repo: spec.repo.clone(),
                reason: format!(
                    "offline (HF_HUB_OFFLINE is set) and the Hub cache's snapshot {} of {spec} \
                     cannot be used ({why}): pull it once with the network, or unset \
                     HF_HUB_OFFLINE",
                    snapshot.display()
                ),
            });
        }
    };
    let dir = model_dir(cfg, spec, &commit, &kind);
    let converted = if is_model(&dir) {
        None
    } else {
        if kind == RepoKind::Safetensors {
            check_model(spec, &snapshot)?;
        }
        convert_once(spec, &convert_source(&snapshot, &kind), &dir, opts)?
    };
    Ok(Pulled {
        dir,
        commit,
        snapshot,
        fetched: Fetched::default(),
        converted,
    })
}

/// Refuses a repo moeflux cannot run from its config.json alone (before
/// the weights are fetched): the architecture, and a quantization format
/// `convert` cannot read.
fn check_model(spec: &RepoSpec, snapshot: &Path) -> Result<()> {
    let path = snapshot.join("config.json");
    let check = || -> Result<()> {
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.clone(),
            source,
        })?;
        crate::convert::source::check_foreign_quantization(&v, &path)?;
        crate::config::ModelConfig::from_json(&v, &path)?;
        Ok(())
    };
    check().map_err(|e| Error::Hub {
        repo: spec.repo.clone(),
        reason: format!("not a model moeflux can run (no weights were downloaded): {e}"),
    })
}

/// How much of a GGUF file is fetched to read its architecture.
const GGUF_PREFIX: u64 = 64 << 10;

/// Refuses a GGUF repo moeflux cannot run from the first bytes of its
/// (first) file, before the weights are fetched. An architecture the prefix
/// does not reach is left to `convert`.
fn check_gguf_model(
    spec: &RepoSpec,
    client: &http::Client,
    commit: &str,
    file: &str,
) -> Result<()> {
    let meta = client.file_meta(&spec.repo, commit, file)?;
    let head = client.get_prefix(&spec.repo, file, &meta.url, GGUF_PREFIX)?;
    let path = Path::new(file);
    let check = || -> Result<()> {
        if let Some(arch) = crate::convert::gguf::file::architecture_in_prefix(&head, path)? {
            crate::convert::gguf::architecture(&arch, path)?;
        }
        Ok(())
    };
    check().map_err(|e| Error::Hub {
        repo: spec.repo.clone(),
        reason: format!("not a model moeflux can run (no weights were downloaded): {e}"),
    })
}

/// Converts into `dir` (a temporary directory renamed when complete);
/// `None` when another process finished it first.
fn convert_once(
    spec: &RepoSpec,
    snapshot: &Path,
    dir: &Path,
    opts: &PullOptions,
) -> Result<Option<ConvertReport>> {
    let on_convert = |p: &ConvertProgress| {
        if let Some(cb) = opts.progress {
            cb(&PullProgress::Convert(p));
        }
    };
    let copts = ConvertOptions {
        expert_bits: None,
        force: false,
        progress: Some(&on_convert),
        cancel: opts.cancel,
    };
    match convert(snapshot, dir, &copts) {
        Ok(r) => Ok(Some(r)),
        Err(Error::DestinationExists { .. }) if is_model(dir) => Ok(None),
        Err(e @ Error::Cancelled) => Err(e),
        Err(e) => Err(Error::Hub {
            repo: spec.repo.clone(),
            reason: format!(
                "converting {} into {}: {e}",
                snapshot.display(),
                dir.display()
            ),
        }),
    }
}
