//! The few Hub HTTP calls a pull makes, and what their failures mean.
//!
//! Why not the `hf-hub` crate: 1.0 pulls in reqwest 0.13, a second HTTP
//! stack and the Xet client (minutes of build on CI's two cores); 0.4's
//! blocking API knows neither `HF_HUB_CACHE` nor offline mode, downloads
//! one file at a time, names partial files differently from
//! `huggingface_hub` (so neither resumes the other's), and reports HTTP
//! failures as transport errors. What is needed is four requests (revision
//! listing, `HEAD` and ranged `GET`s of a file, relative redirects), so they
//! are written here on `ureq` (blocking, rustls), following
//! `huggingface_hub`'s `file_download.py` step for step.

use std::time::Duration;

use ureq::http::{Response, StatusCode};
use ureq::{Agent, Body};

use crate::error::{Error, Result};

use super::config::HubConfig;

/// The commit, blob id and size of one file, from the Hub's headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileMeta {
    /// `X-Linked-Etag` (an LFS file's sha256) or `ETag` (the git blob id),
    /// quotes and `W/` removed: the blob's name in the cache.
    pub etag: String,
    /// `X-Repo-Commit`.
    pub commit: Option<String>,
    /// `X-Linked-Size`, else `Content-Length`.
    pub size: u64,
    /// Where the bytes are (after the Hub's own relative redirects).
    pub url: String,
}

/// Why a file `GET` failed: the network (worth resuming) or the server's
/// answer (not).
pub enum GetFail {
    Network(Error),
    Refused(Error),
}

pub(crate) struct Client {
    /// Redirects off: the Hub's answer itself carries the file's headers.
    api: Agent,
    /// Follows redirects (to the CDN), without the token.
    files: Agent,
    endpoint: String,
    token: Option<String>,
}

fn agent(max_redirects: u32) -> Agent {
    Agent::config_builder()
        .http_status_as_error(false)
        .max_redirects(max_redirects)
        .user_agent(concat!("moeflux/", env!("CARGO_PKG_VERSION")))
        .timeout_connect(Some(Duration::from_secs(30)))
        .timeout_recv_response(Some(Duration::from_secs(60)))
        // A stalled transfer fails (and is resumed) instead of hanging.
        .timeout_per_read(Some(Duration::from_secs(60)))
        .build()
        .into()
}

/// Percent-encodes everything but unreserved characters (and `/` when
/// `keep_slash`), as `urllib.parse.quote` does.
pub fn quote(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'.' | b'_' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// An ETag without `W/` and quotes.
pub fn normalize_etag(v: &str) -> String {
    v.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

impl Client {
    pub fn new(cfg: &HubConfig) -> Self {
        Client {
            api: agent(0),
            files: agent(10),
            endpoint: cfg.endpoint.clone(),
            token: cfg.token.clone(),
        }
    }

    fn auth<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(t) => req.header("Authorization", format!("Bearer {t}")),
            None => req,
        }
    }

    /// `GET /api/models/{repo}/revision/{rev}`: the commit and the file list.
    pub fn revision_info(&self, repo: &str, rev: &str) -> Result<serde_json::Value> {
        let url = format!(
            "{}/api/models/{repo}/revision/{}",
            self.endpoint,
            quote(rev, false)
        );
        let mut resp = self
            .auth(self.api.get(&url))
            .call()
            .map_err(|e| self.transport(repo, &url, e))?;
        if !resp.status().is_success() {
            return Err(self.status_error(repo, rev, None, &resp));
        }
        let text = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| self.transport(repo, &url, e))?;
        serde_json::from_str(&text).map_err(|e| Error::Hub {
            repo: repo.into(),
            reason: format!("{url}: the listing is not JSON: {e}"),
        })
    }

    /// `HEAD` of a file at `commit`, following the Hub's relative redirects
    /// (a renamed repo) but not the CDN's absolute one, whose headers are
    /// not the Hub's.
    pub fn file_meta(&self, repo: &str, commit: &str, file: &str) -> Result<FileMeta> {
        let mut url = format!(
            "{}/{repo}/resolve/{commit}/{}",
            self.endpoint,
            quote(file, true)
        );
        for _ in 0..10 {
            let resp = self
                .auth(self.api.head(&url))
                .call()
                .map_err(|e| self.transport(repo, &url, e))?;
            let header = |k: &str| {
                resp.headers()
                    .get(k)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            if resp.status().is_redirection() {
                if let Some(loc) = header("location").filter(|l| l.starts_with('/')) {
                    url = format!("{}{loc}", self.endpoint);
                    continue;
                }
            } else if !resp.status().is_success() {
                return Err(self.status_error(repo, commit, Some(file), &resp));
            }
            let etag = header("x-linked-etag")
                .or_else(|| header("etag"))
                .map(|e| normalize_etag(&e))
                .filter(|e| !e.is_empty())
                .ok_or_else(|| Error::Hub {
                    repo: repo.into(),
                    reason: format!("{url}: no ETag header (is HF_ENDPOINT a Hub?)"),
                })?;
            // The blob's name in the cache: refuse anything that is not one
            // plain file name.
            if !etag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(Error::Hub {
                    repo: repo.into(),
                    reason: format!("{url}: ETag `{etag}` is not a blob id"),
                });
            }
            let size = header("x-linked-size")
                .or_else(|| header("content-length"))
                .and_then(|s| s.trim().parse::<u64>().ok())
                .ok_or_else(|| Error::Hub {
                    repo: repo.into(),
                    reason: format!("{url}: no size (X-Linked-Size or Content-Length)"),
                })?;
            return Ok(FileMeta {
                etag,
                commit: header("x-repo-commit"),
                size,
                url,
            });
        }
        Err(Error::Hub {
            repo: repo.into(),
            reason: format!("{url}: too many redirects"),
        })
    }

    /// `GET` of a file from byte `start` on (a `Range` request when
    /// `start > 0`). A 200 answer to a ranged request means the server sent
    /// the whole file again.
    pub fn get_from(
        &self,
        repo: &str,
        file: &str,
        url: &str,
        start: u64,
    ) -> std::result::Result<Response<Body>, GetFail> {
        let mut req = self.auth(self.files.get(url));
        if start > 0 {
            req = req.header("Range", format!("bytes={start}-"));
        }
        let resp = req
            .call()
            .map_err(|e| GetFail::Network(self.transport(repo, url, e)))?;
        let s = resp.status();
        if s.is_success() || s == StatusCode::RANGE_NOT_SATISFIABLE {
            Ok(resp)
        } else {
            Err(GetFail::Refused(self.status_error(
                repo,
                "",
                Some(file),
                &resp,
            )))
        }
    }

    /// The first `n` bytes of a file (fewer when it is shorter): a
    /// `bytes=0-{n-1}` request, cut at `n` should the server send it all.
    pub fn get_prefix(&self, repo: &str, file: &str, url: &str, n: u64) -> Result<Vec<u8>> {
        use std::io::Read;
        let mut resp = self
            .auth(self.files.get(url))
            .header("Range", format!("bytes=0-{}", n.saturating_sub(1)))
            .call()
            .map_err(|e| self.transport(repo, url, e))?;
        if !resp.status().is_success() {
            return Err(self.status_error(repo, "", Some(file), &resp));
        }
        let mut out = Vec::new();
        resp.body_mut()
            .with_config()
            .reader()
            .take(n)
            .read_to_end(&mut out)
            .map_err(|e| Error::Hub {
                repo: repo.into(),
                reason: format!("{url}: reading the first {n} bytes: {e}"),
            })?;
        Ok(out)
    }

    fn transport(&self, repo: &str, url: &str, e: ureq::Error) -> Error {
        Error::Hub {
            repo: repo.into(),
            reason: format!(
                "{url}: {e} (check the network or HF_ENDPOINT; HF_HUB_OFFLINE=1 uses the cache only)"
            ),
        }
    }

    /// What an HTTP error status means, the way the Hub spells it
    /// (`X-Error-Code`, as `huggingface_hub`'s `hf_raise_for_status` reads).
    fn status_error<B>(
        &self,
        repo: &str,
        rev: &str,
        file: Option<&str>,
        resp: &Response<B>,
    ) -> Error {
        let code = resp.status().as_u16();
        let hub_code = resp
            .headers()
            .get("x-error-code")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let login = match self.token {
            Some(_) => {
                "the token (HF_TOKEN or the saved login) was refused: request access on \
                        the model's page, or use a token that has it"
            }
            None => "set HF_TOKEN to a token that has access (or log in with `hf auth login`)",
        };
        let reason = match (code, hub_code) {
            (_, "GatedRepo") | (403, _) => {
                format!("repo {repo} is gated or private (HTTP {code}): {login}")
            }
            (_, "RevisionNotFound") => {
                format!(
                    "revision `{rev}` of {repo} not found on {} (HTTP {code})",
                    self.endpoint
                )
            }
            (_, "EntryNotFound") => format!(
                "file `{}` not found in {repo} (HTTP {code})",
                file.unwrap_or("?")
            ),
            (401, _) | (_, "RepositoryNotFound") => format!(
                "repo {repo} not found on {}, or it is gated or private (HTTP {code}): \
                 check the name; {login}",
                self.endpoint
            ),
            (404, _) => match file {
                Some(f) => format!("file `{f}` not found in {repo} (HTTP 404)"),
                None => format!(
                    "repo {repo} or its revision `{rev}` not found on {} (HTTP 404)",
                    self.endpoint
                ),
            },
            _ => format!(
                "HTTP {code} from {}{}",
                self.endpoint,
                file.map(|f| format!(" for `{f}`")).unwrap_or_default()
            ),
        };
        Error::Hub {
            repo: repo.into(),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_and_etags() {
        assert_eq!(quote("a b/c.gguf", true), "a%20b/c.gguf");
        assert_eq!(quote("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
        assert_eq!(normalize_etag("\"0123\""), "0123");
    }
}
