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
//! kind ([`select`]: safetensors, or GGUF, which is refused until GGUF
//! import lands) -> config.json and the tokenizer files -> the
//! architecture check (a model moeflux cannot run is refused before any
//! weight is fetched) -> the weights, several at once -> `convert`.

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

/// Where `spec` at `commit` is converted to.
pub fn model_dir(cfg: &HubConfig, spec: &RepoSpec, commit: &str) -> PathBuf {
    cfg.models_dir
        .join(format!("{}--{commit}", spec.repo.replace('/', "--")))
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
    if let RepoKind::Gguf { files } = listing.kind(&spec.repo, spec.quant.as_deref())? {
        return Err(gguf_unsupported(spec, &files));
    }
    cache.write_ref(&spec.revision, &commit)?;
    let dir = model_dir(cfg, spec, &commit);
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
    let small = fetcher.fetch(&listing.small_files())?;
    check_model(spec, &snapshot)?;
    let weights = fetcher.fetch(&listing.weight_files(&spec.repo, &snapshot)?)?;
    let fetched = Fetched {
        files: small.files + weights.files,
        bytes: small.bytes + weights.bytes,
    };
    let converted = convert_once(spec, &snapshot, &dir, opts)?;
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
    if spec.quant.is_some() {
        return Err(gguf_unsupported(spec, &[]));
    }
    let dir = model_dir(cfg, spec, &commit);
    let snapshot = cache.snapshot(&commit);
    let converted = if is_model(&dir) {
        None
    } else {
        if !snapshot.join("config.json").is_file() {
            return Err(missing(format!(
                "{} is not (no config.json in {})",
                spec,
                snapshot.display()
            )));
        }
        check_model(spec, &snapshot)?;
        convert_once(spec, &snapshot, &dir, opts)?
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

fn gguf_unsupported(spec: &RepoSpec, files: &[String]) -> Error {
    let chosen = if files.is_empty() {
        String::new()
    } else {
        format!(" (the pull would fetch {})", files.join(", "))
    };
    Error::Hub {
        repo: spec.repo.clone(),
        reason: format!(
            "GGUF import is not supported yet{chosen}: pull a safetensors repo of this model \
             (mlx-lm or Hugging Face) instead"
        ),
    }
}
