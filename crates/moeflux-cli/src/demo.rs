//! The demo model that ships in the source tree (`models/demo`, see
//! docs/DEMO.md): what commands run when no `--model` is given.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// Where the source tree this binary was built from keeps the demo model.
fn built_in() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo")
}

/// The demo model's directory: beside the executable's build tree first
/// (`target/<profile>/moeflux` -> `models/demo`, so a moved checkout still
/// works), then the source tree it was built from.
pub fn model_dir() -> Result<PathBuf> {
    let beside_exe = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.parent()?.join("models/demo")));
    for dir in beside_exe.into_iter().chain([built_in()]) {
        if dir.join("moeflux.json").is_file() {
            return Ok(dir.canonicalize().unwrap_or(dir));
        }
    }
    bail!(
        "no --model given, and the demo model is not where this build expects it ({}); \
         pass --model DIR with a directory written by `moeflux convert`",
        built_in().display()
    )
}
