//! `--model DIR` or `--model hf:ORG/NAME[@REV][:QUANT]`: a model directory, or a
//! Hub model pulled (downloaded and converted once, see `moeflux pull`)
//! before the command runs. Resolved in one place, `main`, so a command
//! only ever sees a directory.

use std::path::{Path, PathBuf};

use anyhow::Result;
use moeflux::hub::RepoSpec;

#[derive(Debug, Clone)]
pub enum ModelRef {
    Dir(PathBuf),
    Hub(RepoSpec),
}

/// clap's parser for model arguments.
pub fn parse(s: &str) -> std::result::Result<ModelRef, String> {
    if s.starts_with("hf:") {
        return RepoSpec::parse(s)
            .map(ModelRef::Hub)
            .map_err(|e| e.to_string());
    }
    Ok(ModelRef::Dir(PathBuf::from(s)))
}

impl ModelRef {
    /// Pulls a Hub model (no-op for a directory); afterwards this is a
    /// [`ModelRef::Dir`].
    pub fn resolve(&mut self, models_dir: Option<&Path>) -> Result<()> {
        if let ModelRef::Hub(spec) = self {
            let pulled = crate::cmd_pull::pull_model(spec, models_dir, None)?;
            *self = ModelRef::Dir(pulled.dir);
        }
        Ok(())
    }

    /// The directory; a Hub model must have been resolved first.
    pub fn dir(&self) -> Result<&Path> {
        match self {
            ModelRef::Dir(d) => Ok(d),
            ModelRef::Hub(spec) => {
                anyhow::bail!("hf:{spec} was not pulled before the command ran")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_and_hub_names() {
        assert!(
            matches!(parse("models/demo"), Ok(ModelRef::Dir(p)) if p == Path::new("models/demo"))
        );
        // A directory may be called `org/name`: only `hf:` means the Hub.
        assert!(matches!(parse("org/name"), Ok(ModelRef::Dir(_))));
        match parse("hf:Qwen/Qwen3-30B-A3B@main") {
            Ok(ModelRef::Hub(s)) => assert_eq!(s.repo, "Qwen/Qwen3-30B-A3B"),
            other => panic!("{other:?}"),
        }
        let e = parse("hf:noslash").unwrap_err();
        assert!(e.contains("ORG/NAME"), "{e}");
        assert!(ModelRef::Hub(RepoSpec::parse("a/b").unwrap())
            .dir()
            .is_err());
    }
}
