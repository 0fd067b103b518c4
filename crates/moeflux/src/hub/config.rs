//! Where the Hub is, where its files go, and who we are: the environment
//! variables `huggingface_hub` reads, with its defaults, so both share one
//! cache and one login.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// The Hub's public endpoint.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Settings of [`crate::hub::pull`]. Build with [`HubConfig::from_env`];
/// tests and embedders may set the fields directly.
#[derive(Debug, Clone)]
pub struct HubConfig {
    /// `HF_ENDPOINT`, no trailing `/`.
    pub endpoint: String,
    /// The Hub cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `$XDG_CACHE_HOME/huggingface/hub` or `~/.cache/huggingface/hub`).
    pub cache_dir: PathBuf,
    /// `HF_TOKEN`, else the file `HF_TOKEN_PATH` (default `$HF_HOME/token`,
    /// where `hf auth login` writes it).
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE`: use the cache only, never the network.
    pub offline: bool,
    /// Where converted models go: `$MOEFLUX_HOME/models`, else
    /// `$XDG_CACHE_HOME/moeflux/models` or `~/.cache/moeflux/models`.
    pub models_dir: PathBuf,
    /// Files downloaded at once.
    pub parallel: usize,
    /// Times one file's download is resumed after the connection fails.
    pub retries: u32,
}

impl HubConfig {
    /// Settings from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// Settings from `var` (a variable's value, `None` when unset; an empty
    /// value counts as unset, as in `huggingface_hub`).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let var = |k: &str| var(k).filter(|v| !v.is_empty());
        let home = || -> Result<PathBuf> {
            var("HOME").map(PathBuf::from).ok_or_else(|| {
                Error::Invalid(
                    "HOME is not set: set HF_HUB_CACHE and MOEFLUX_HOME to say where models go"
                        .into(),
                )
            })
        };
        let xdg_cache = || -> Result<PathBuf> {
            match var("XDG_CACHE_HOME") {
                Some(d) => Ok(PathBuf::from(d)),
                None => Ok(home()?.join(".cache")),
            }
        };
        let hf_home = || -> Result<PathBuf> {
            match var("HF_HOME") {
                Some(d) => Ok(PathBuf::from(d)),
                None => Ok(xdg_cache()?.join("huggingface")),
            }
        };
        let cache_dir = match var("HF_HUB_CACHE") {
            Some(d) => PathBuf::from(d),
            None => hf_home()?.join("hub"),
        };
        let token = match var("HF_TOKEN") {
            Some(t) => Some(t.trim().to_string()),
            None => {
                let path = match var("HF_TOKEN_PATH") {
                    Some(p) => PathBuf::from(p),
                    None => hf_home()?.join("token"),
                };
                match std::fs::read_to_string(&path) {
                    Ok(t) => Some(t.trim().to_string()),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => return Err(Error::io(&path, e)),
                }
            }
        }
        .filter(|t| !t.is_empty());
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE")
        });
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        if !(endpoint.starts_with("https://") || endpoint.starts_with("http://")) {
            return Err(Error::Invalid(format!(
                "HF_ENDPOINT `{endpoint}` is not an http:// or https:// URL"
            )));
        }
        let models_dir = match var("MOEFLUX_HOME") {
            Some(d) => PathBuf::from(d).join("models"),
            None => xdg_cache()?.join("moeflux").join("models"),
        };
        Ok(HubConfig {
            endpoint,
            cache_dir,
            token,
            offline,
            models_dir,
            parallel: 8,
            retries: 5,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(vars: &[(&str, &str)]) -> Result<HubConfig> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        HubConfig::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_follow_huggingface_hub() {
        let c = cfg(&[("HOME", "/h")]).unwrap();
        assert_eq!(c.endpoint, "https://huggingface.co");
        assert_eq!(c.cache_dir, PathBuf::from("/h/.cache/huggingface/hub"));
        assert_eq!(c.models_dir, PathBuf::from("/h/.cache/moeflux/models"));
        assert_eq!(c.token, None);
        assert!(!c.offline);
        let c = cfg(&[("HOME", "/h"), ("XDG_CACHE_HOME", "/x")]).unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/x/huggingface/hub"));
        assert_eq!(c.models_dir, PathBuf::from("/x/moeflux/models"));
    }

    #[test]
    fn variables_override_in_huggingface_hub_order() {
        let c = cfg(&[("HOME", "/h"), ("HF_HOME", "/hf")]).unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/hf/hub"));
        let c = cfg(&[
            ("HF_HOME", "/hf"),
            ("HF_HUB_CACHE", "/cache"),
            ("MOEFLUX_HOME", "/m"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_HUB_OFFLINE", "true"),
            ("HF_TOKEN", " hf_abc\n"),
        ])
        .unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/cache"));
        assert_eq!(c.models_dir, PathBuf::from("/m/models"));
        assert_eq!(c.endpoint, "http://127.0.0.1:9");
        assert!(c.offline);
        assert_eq!(c.token.as_deref(), Some("hf_abc"));
        assert!(
            !cfg(&[("HOME", "/h"), ("HF_HUB_OFFLINE", "0")])
                .unwrap()
                .offline
        );
        let e = cfg(&[("HOME", "/h"), ("HF_ENDPOINT", "ftp://x")]).unwrap_err();
        assert!(e.to_string().contains("HF_ENDPOINT"), "{e}");
    }

    #[test]
    fn token_file_from_hf_home_or_token_path() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("token"), "hf_file\n").unwrap();
        let home = d.path().to_str().unwrap();
        let c = cfg(&[("HF_HOME", home), ("MOEFLUX_HOME", "/m")]).unwrap();
        assert_eq!(c.token.as_deref(), Some("hf_file"));
        let other = d.path().join("other");
        std::fs::write(&other, "hf_other").unwrap();
        let c = cfg(&[
            ("HF_HOME", home),
            ("MOEFLUX_HOME", "/m"),
            ("HF_TOKEN_PATH", other.to_str().unwrap()),
        ])
        .unwrap();
        assert_eq!(c.token.as_deref(), Some("hf_other"));
        // HF_TOKEN wins over any file.
        let c = cfg(&[
            ("HF_HOME", home),
            ("MOEFLUX_HOME", "/m"),
            ("HF_TOKEN", "hf_env"),
        ])
        .unwrap();
        assert_eq!(c.token.as_deref(), Some("hf_env"));
    }
}
