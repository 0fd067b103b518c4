//! `ORG/NAME[@REVISION][:QUANT]`: which Hub repo, at which revision, and
//! (for a GGUF repo) which quantization.

use crate::error::{Error, Result};

/// A model on the Hub as the user names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoSpec {
    /// `ORG/NAME`.
    pub repo: String,
    /// A branch, tag or commit (`main` when not given).
    pub revision: String,
    /// A GGUF quantization such as `Q4_K_M` (`:QUANT`).
    pub quant: Option<String>,
}

impl RepoSpec {
    /// Parses `ORG/NAME[@REVISION][:QUANT]`, with or without an `hf:` prefix.
    pub fn parse(s: &str) -> Result<Self> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "`{s}` is not a Hub model (ORG/NAME[@REVISION][:QUANT]): {why}"
            ))
        };
        let t = s.strip_prefix("hf:").unwrap_or(s);
        // Git ref names cannot hold ':', so the first one starts the quant.
        let (t, quant) = match t.split_once(':') {
            Some((a, q)) => (a, Some(q)),
            None => (t, None),
        };
        let (repo, revision) = match t.split_once('@') {
            Some((r, rev)) => (r, Some(rev)),
            None => (t, None),
        };
        check_repo_id(repo).map_err(|w| bad(&w))?;
        if let Some(rev) = revision {
            check_revision(rev).map_err(|w| bad(&w))?;
        }
        if let Some(q) = quant {
            let ok = q
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
            if q.is_empty() || !ok || q.starts_with('-') {
                return Err(bad(&format!(
                    "quant `{q}` must be letters, digits, `_` and `-` (e.g. Q4_K_M, UD-Q4_K_XL)"
                )));
            }
        }
        Ok(RepoSpec {
            repo: repo.to_string(),
            revision: revision.unwrap_or("main").to_string(),
            quant: quant.map(str::to_string),
        })
    }

    /// The Hub's folder name in its cache: `models--ORG--NAME`.
    pub fn cache_folder(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

impl std::fmt::Display for RepoSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.repo)?;
        if self.revision != "main" {
            write!(f, "@{}", self.revision)?;
        }
        if let Some(q) = &self.quant {
            write!(f, ":{q}")?;
        }
        Ok(())
    }
}

/// The Hub's rule for repo ids: `ORG/NAME`, each part letters, digits,
/// `-`, `_`, `.`, not starting or ending with `-` or `.`, no `--` or `..`
/// (which would make the cache folder name ambiguous or escape it).
fn check_repo_id(repo: &str) -> std::result::Result<(), String> {
    let Some((org, name)) = repo.split_once('/') else {
        return Err("the repo must be ORG/NAME".into());
    };
    for part in [org, name] {
        let ok_chars = part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if part.is_empty()
            || part.len() > 96
            || !ok_chars
            || part.contains("--")
            || part.contains("..")
            || part.starts_with(['-', '.'])
            || part.ends_with(['-', '.'])
        {
            return Err(format!(
                "`{part}` must be letters, digits, `-`, `_` or `.` (no leading, trailing \
                 or doubled `-`/`.`)"
            ));
        }
    }
    Ok(())
}

/// A revision becomes a path under `refs/` and a URL segment: refuse what
/// git refuses and what could leave the cache folder.
fn check_revision(rev: &str) -> std::result::Result<(), String> {
    let ok = !rev.is_empty()
        && rev.len() <= 255
        && !rev.starts_with('/')
        && !rev.ends_with('/')
        && !rev.contains("..")
        && !rev.contains("//")
        && rev.split('/').all(|p| !p.starts_with('.'))
        && rev
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "revision `{rev}` is not a branch, tag or commit name"
        ))
    }
}

/// A full commit id (40 lowercase hex digits).
pub fn is_commit(rev: &str) -> bool {
    rev.len() == 40 && rev.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_repo_revision_and_quant() {
        let s = RepoSpec::parse("Qwen/Qwen3-30B-A3B").unwrap();
        assert_eq!(
            (s.repo.as_str(), s.revision.as_str(), s.quant),
            ("Qwen/Qwen3-30B-A3B", "main", None)
        );
        let s = RepoSpec::parse("hf:org/name@v1.0:Q4_K_M").unwrap();
        assert_eq!(s.repo, "org/name");
        assert_eq!(s.revision, "v1.0");
        assert_eq!(s.quant.as_deref(), Some("Q4_K_M"));
        assert_eq!(s.to_string(), "org/name@v1.0:Q4_K_M");
        assert_eq!(s.cache_folder(), "models--org--name");
        let s = RepoSpec::parse("unsloth/X-GGUF:UD-Q4_K_XL").unwrap();
        assert_eq!(s.quant.as_deref(), Some("UD-Q4_K_XL"));
        assert_eq!(
            RepoSpec::parse("a/b@refs/pr/1").unwrap().revision,
            "refs/pr/1"
        );
    }

    #[test]
    fn refuses_malformed_names() {
        for bad in [
            "noslash",
            "a/b/c",
            "/b",
            "a/",
            "a/b@",
            "a/b@../x",
            "a/b@.hidden",
            "a/b@x y",
            "a/b:",
            "a/b:Q4 K",
            "a--b/c",
            "../x",
            "a/..",
            "a/b.",
        ] {
            let e = RepoSpec::parse(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("`{bad}`")), "{bad}: {e}");
        }
    }

    #[test]
    fn commit_ids() {
        assert!(is_commit("0123456789abcdef0123456789abcdef01234567"));
        assert!(!is_commit("main"));
        assert!(!is_commit("0123456789ABCDEF0123456789abcdef01234567"));
    }
}
