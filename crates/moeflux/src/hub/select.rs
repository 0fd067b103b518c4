//! Which files of a repo a pull fetches, decided from the Hub's listing:
//! a safetensors checkpoint (mlx-lm quantized, or bf16/FP8 Hugging Face)
//! needs its config, tokenizer and chat-template files and the shards its
//! index names; a GGUF repo one quantization's file (or its split parts).

use std::collections::BTreeMap;
use std::path::Path;

use crate::convert::source::{read_index, INDEX_FILE, SINGLE_FILE};
use crate::convert::AUX_FILES;
use crate::error::{Error, Result};

/// The commit a revision is at, and its files.
#[derive(Debug, Clone)]
pub struct Listing {
    pub commit: String,
    /// Repo-relative paths; names that could leave the snapshot directory
    /// (absolute, `..`, empty parts) are left out.
    pub files: Vec<String>,
}

/// What kind of repo it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RepoKind {
    /// config.json and safetensors weights (converted by `convert`).
    Safetensors,
    /// GGUF files: the chosen quantization's file(s).
    Gguf { files: Vec<String> },
}

impl RepoKind {
    /// What tells this pull's model directory apart from others of the
    /// same commit: the GGUF file's name without `.gguf` and part suffix
    /// (`Model-Q8_0` for `Q8_0/Model-Q8_0-00001-of-00002.gguf`), so two
    /// quantizations of a repo convert side by side.
    pub fn variant(&self) -> Option<String> {
        let RepoKind::Gguf { files } = self else {
            return None;
        };
        let first = files.first()?;
        let name = first.rsplit('/').next().unwrap_or(first);
        let stem = &name[..name.len() - ".gguf".len()];
        Some(match split_part(stem) {
            Some((base, _, _)) => base.to_string(),
            None => stem.to_string(),
        })
    }
}

impl Listing {
    /// From `GET /api/models/{repo}/revision/{rev}`'s answer.
    pub fn from_json(repo: &str, v: &serde_json::Value) -> Result<Self> {
        let bad = |why: &str| Error::Hub {
            repo: repo.into(),
            reason: format!("the Hub's listing {why}"),
        };
        let commit = v
            .get("sha")
            .and_then(|s| s.as_str())
            .filter(|s| super::spec::is_commit(s))
            .ok_or_else(|| bad("has no commit id (`sha`)"))?
            .to_string();
        let siblings = v
            .get("siblings")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("has no file list (`siblings`)"))?;
        let files = siblings
            .iter()
            .filter_map(|s| s.get("rfilename")?.as_str())
            .filter(|f| is_safe_path(f))
            .map(str::to_string)
            .collect();
        Ok(Listing { commit, files })
    }

    /// The files of a snapshot already in the cache (offline mode), found
    /// by walking it; an absent snapshot has none.
    pub fn from_snapshot(commit: &str, snapshot: &Path) -> Result<Self> {
        let mut files = Vec::new();
        let mut stack = vec![snapshot.to_path_buf()];
        while let Some(dir) = stack.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io(&dir, e)),
            };
            for e in entries {
                let p = e.map_err(|e| Error::io(&dir, e))?.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.is_file() {
                    let rel = p.strip_prefix(snapshot).expect("under the snapshot");
                    if let Some(f) = rel.to_str().filter(|f| is_safe_path(f)) {
                        files.push(f.to_string());
                    }
                }
            }
        }
        files.sort();
        Ok(Listing {
            commit: commit.to_string(),
            files,
        })
    }

    fn has(&self, f: &str) -> bool {
        self.files.iter().any(|x| x == f)
    }

    /// Top-level `*.safetensors` files, sorted.
    fn top_safetensors(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .files
            .iter()
            .filter(|f| !f.contains('/') && f.ends_with(".safetensors"))
            .cloned()
            .collect();
        v.sort();
        v
    }

    /// Decides the repo's kind; `quant` (`:QUANT`) asks for a GGUF file.
    pub fn kind(&self, repo: &str, quant: Option<&str>) -> Result<RepoKind> {
        let ggufs = gguf_groups(&self.files);
        let has_st = self.has("config.json") && !self.top_safetensors().is_empty();
        if quant.is_none() && has_st {
            return Ok(RepoKind::Safetensors);
        }
        if ggufs.is_empty() {
            let reason = match quant {
                Some(q) => format!(
                    "has no GGUF files, so `:{q}` (a GGUF quantization) cannot be chosen; \
                     leave it out to pull the safetensors checkpoint"
                ),
                None => format!(
                    "has neither a config.json with *.safetensors weights nor GGUF files \
                     (files: {})",
                    preview(&self.files)
                ),
            };
            return Err(Error::Hub {
                repo: repo.into(),
                reason,
            });
        }
        let names = || ggufs.keys().cloned().collect::<Vec<_>>().join(", ");
        let chosen: Vec<(&String, &Vec<String>)> = match quant {
            Some(q) => ggufs.iter().filter(|(k, _)| has_token(k, q)).collect(),
            None => ggufs.iter().collect(),
        };
        let files = match (chosen.as_slice(), quant) {
            ([(_, files)], _) => (*files).clone(),
            ([], Some(q)) => {
                return Err(Error::Hub {
                    repo: repo.into(),
                    reason: format!("no GGUF file of quantization `{q}` (it has: {})", names()),
                })
            }
            (many, Some(q)) => {
                let list: Vec<&str> = many.iter().map(|(k, _)| k.as_str()).collect();
                return Err(Error::Hub {
                    repo: repo.into(),
                    reason: format!(
                        "`{q}` names more than one GGUF file ({}): give the full quant name",
                        list.join(", ")
                    ),
                });
            }
            (_, None) => {
                return Err(Error::Hub {
                    repo: repo.into(),
                    reason: format!(
                        "has several GGUF quantizations ({}): choose one with {repo}:QUANT",
                        names()
                    ),
                })
            }
        };
        check_split_complete(repo, &files)?;
        Ok(RepoKind::Gguf { files })
    }

    /// The small files fetched before the weights: config.json first, the
    /// tokenizer, chat template and generation files, and the shard index.
    pub fn small_files(&self) -> Vec<String> {
        ["config.json", INDEX_FILE]
            .into_iter()
            .chain(AUX_FILES)
            .filter(|f| self.has(f))
            .map(str::to_string)
            .collect()
    }

    /// The weight files `convert` will read (as `Source::open` finds them):
    /// the shards the index in `snapshot` names, else `model.safetensors`,
    /// else every top-level `*.safetensors`.
    pub fn weight_files(&self, repo: &str, snapshot: &Path) -> Result<Vec<String>> {
        if self.has(INDEX_FILE) {
            let (files, _) = read_index(&snapshot.join(INDEX_FILE))?;
            if let Some(missing) = files.iter().find(|f| !self.has(f)) {
                return Err(Error::Hub {
                    repo: repo.into(),
                    reason: format!(
                        "{INDEX_FILE} names shard `{missing}`, which the repo does not have"
                    ),
                });
            }
            return Ok(files);
        }
        if self.has(SINGLE_FILE) {
            return Ok(vec![SINGLE_FILE.to_string()]);
        }
        Ok(self.top_safetensors())
    }
}

/// A repo path that stays inside the snapshot directory.
fn is_safe_path(f: &str) -> bool {
    !f.is_empty()
        && !f.starts_with('/')
        && !f.contains('\\')
        && !f.contains('\0')
        && f.split('/').all(|p| !p.is_empty() && p != "." && p != "..")
}

fn preview(files: &[String]) -> String {
    let mut s = files.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
    if files.len() > 8 {
        s.push_str(&format!(", ... ({} in all)", files.len()));
    }
    if s.is_empty() {
        s = "none".into();
    }
    s
}

/// `-00001-of-00003` at the end of a GGUF file's stem: (part, count).
fn split_part(stem: &str) -> Option<(&str, u32, u32)> {
    let (head, count) = stem.rsplit_once("-of-")?;
    let (base, part) = head.rsplit_once('-')?;
    let num = |s: &str| {
        (s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u32>().ok())
            .flatten()
    };
    Some((base, num(part)?, num(count)?))
}

/// The repo's GGUF models: a split model's parts under one key (its path
/// without the part suffix), each single file under its own path. Vision
/// projectors (`mmproj*`) are not models.
fn gguf_groups(files: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for f in files {
        let lower = f.to_ascii_lowercase();
        let name = lower.rsplit('/').next().unwrap_or(&lower);
        if !lower.ends_with(".gguf") || name.starts_with("mmproj") {
            continue;
        }
        let stem = &f[..f.len() - ".gguf".len()];
        let key = match split_part(stem) {
            Some((base, _, _)) => format!("{base}.gguf"),
            None => f.clone(),
        };
        groups.entry(key).or_default().push(f.clone());
    }
    for v in groups.values_mut() {
        v.sort();
    }
    groups
}

/// `quant` occurs in `path` as a whole token (case-insensitive): not
/// preceded or followed by a letter, digit or `_`, so `Q4_K` does not pick
/// `Q4_K_M`.
fn has_token(path: &str, quant: &str) -> bool {
    let p = path.to_ascii_lowercase();
    let q = quant.to_ascii_lowercase();
    let word = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    p.match_indices(&q)
        .any(|(i, _)| !word(p[..i].chars().next_back()) && !word(p[i + q.len()..].chars().next()))
}

/// Every part `1..=N` of a split GGUF is listed.
fn check_split_complete(repo: &str, files: &[String]) -> Result<()> {
    let parts: Vec<(u32, u32)> = files
        .iter()
        .filter_map(|f| {
            let (_, p, n) = split_part(&f[..f.len() - ".gguf".len()])?;
            Some((p, n))
        })
        .collect();
    let Some(&(_, n)) = parts.first() else {
        return Ok(());
    };
    let mut have: Vec<u32> = parts.iter().map(|&(p, _)| p).collect();
    have.sort_unstable();
    if parts.iter().any(|&(_, m)| m != n) || have != (1..=n).collect::<Vec<_>>() {
        return Err(Error::Hub {
            repo: repo.into(),
            reason: format!(
                "the split GGUF {} is incomplete: expected parts 1 to {n}",
                files.join(", ")
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn listing(files: &[&str]) -> Listing {
        Listing {
            commit: "0".repeat(40),
            files: files.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn listing_from_the_hub_json_drops_unsafe_names() {
        let v = json!({"sha": "a".repeat(40), "siblings": [
            {"rfilename": "config.json"}, {"rfilename": "../evil"}, {"rfilename": "/abs"},
            {"rfilename": "a//b"}, {"rfilename": "sub/ok.json"}]});
        let l = Listing::from_json("o/n", &v).unwrap();
        assert_eq!(l.files, ["config.json", "sub/ok.json"]);
        let e = Listing::from_json("o/n", &json!({"sha": "main"})).unwrap_err();
        assert!(e.to_string().contains("commit id"), "{e}");
    }

    #[test]
    fn safetensors_repo_fetches_only_what_convert_reads() {
        let l = listing(&[
            ".gitattributes",
            "README.md",
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "chat_template.jinja",
            "model.safetensors",
            "pytorch_model.bin",
            "original/consolidated.safetensors",
        ]);
        assert_eq!(l.kind("o/n", None).unwrap(), RepoKind::Safetensors);
        assert_eq!(
            l.small_files(),
            [
                "config.json",
                "tokenizer.json",
                "tokenizer_config.json",
                "generation_config.json",
                "chat_template.jinja"
            ]
        );
        let d = tempfile::tempdir().unwrap();
        assert_eq!(
            l.weight_files("o/n", d.path()).unwrap(),
            ["model.safetensors"]
        );
        let l = listing(&[
            "config.json",
            "b.safetensors",
            "a.safetensors",
            "x/c.safetensors",
        ]);
        assert_eq!(
            l.weight_files("o/n", d.path()).unwrap(),
            ["a.safetensors", "b.safetensors"]
        );
    }

    #[test]
    fn snapshot_listing_walks_the_folders() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("Q8_0")).unwrap();
        std::fs::write(d.path().join("Q8_0/m-Q8_0.gguf"), "x").unwrap();
        std::fs::write(d.path().join("config.json"), "{}").unwrap();
        let l = Listing::from_snapshot("c", d.path()).unwrap();
        assert_eq!(l.files, ["Q8_0/m-Q8_0.gguf", "config.json"]);
        let none = Listing::from_snapshot("c", &d.path().join("absent")).unwrap();
        assert!(none.files.is_empty());
    }

    #[test]
    fn index_names_the_shards() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(
            d.path().join(INDEX_FILE),
            r#"{"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}}"#,
        )
        .unwrap();
        let l = listing(&[
            "config.json",
            INDEX_FILE,
            "model-1.safetensors",
            "model-2.safetensors",
            "consolidated.safetensors",
        ]);
        assert_eq!(
            l.weight_files("o/n", d.path()).unwrap(),
            ["model-1.safetensors", "model-2.safetensors"]
        );
        let l = listing(&["config.json", INDEX_FILE, "model-1.safetensors"]);
        let e = l.weight_files("o/n", d.path()).unwrap_err().to_string();
        assert!(e.contains("model-2.safetensors"), "{e}");
    }

    #[test]
    fn gguf_quant_selection() {
        let l = listing(&[
            "README.md",
            "Model-Q4_K_M.gguf",
            "Model-Q4_K_S.gguf",
            "Model-UD-Q4_K_XL.gguf",
            "mmproj-F16.gguf",
            "Q8_0/Model-Q8_0-00002-of-00002.gguf",
            "Q8_0/Model-Q8_0-00001-of-00002.gguf",
            "BF16/Model-BF16-00001-of-00002.gguf",
        ]);
        let files = |q: &str| match l.kind("o/n", Some(q)) {
            Ok(RepoKind::Gguf { files }) => Ok(files),
            Ok(k) => panic!("{k:?}"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(files("Q4_K_M").unwrap(), ["Model-Q4_K_M.gguf"]);
        let variant = |q: &str| l.kind("o/n", Some(q)).unwrap().variant();
        assert_eq!(variant("Q4_K_M").as_deref(), Some("Model-Q4_K_M"));
        assert_eq!(variant("Q8_0").as_deref(), Some("Model-Q8_0"));
        assert_eq!(RepoKind::Safetensors.variant(), None);
        assert_eq!(files("q4_k_s").unwrap(), ["Model-Q4_K_S.gguf"]);
        assert_eq!(files("UD-Q4_K_XL").unwrap(), ["Model-UD-Q4_K_XL.gguf"]);
        assert_eq!(
            files("Q8_0").unwrap(),
            [
                "Q8_0/Model-Q8_0-00001-of-00002.gguf",
                "Q8_0/Model-Q8_0-00002-of-00002.gguf"
            ]
        );
        let e = files("Q4_K").unwrap_err();
        assert!(e.contains("no GGUF file of quantization `Q4_K`"), "{e}");
        assert!(e.contains("Model-Q4_K_M.gguf"), "{e}");
        let e = files("BF16").unwrap_err();
        assert!(e.contains("incomplete"), "{e}");
        let e = l.kind("o/n", None).unwrap_err().to_string();
        assert!(e.contains("choose one with o/n:QUANT"), "{e}");
        let single = listing(&["m-Q4_0.gguf", "mmproj-m.gguf"]);
        assert_eq!(
            single.kind("o/n", None).unwrap(),
            RepoKind::Gguf {
                files: vec!["m-Q4_0.gguf".into()]
            }
        );
        let st = listing(&["config.json", "model.safetensors"]);
        let e = st.kind("o/n", Some("Q4_K_M")).unwrap_err().to_string();
        assert!(e.contains("has no GGUF files"), "{e}");
        let e = listing(&["README.md"])
            .kind("o/n", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("README.md"), "{e}");
    }
}
