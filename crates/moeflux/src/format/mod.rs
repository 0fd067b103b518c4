//! The moeflux model directory (format v1):
//!
//! ```text
//! DIR/config.json, tokenizer files     copied from the source checkpoint
//! DIR/moeflux.json                     manifest (this module)
//! DIR/dense.safetensors                every non-expert tensor
//! DIR/experts/layer_NNN.bin            one file per MoE layer: num_experts
//!                                      extents of `stride` bytes each
//! ```

pub mod manifest;

use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

pub use manifest::{ExpertComponent, ExpertLayer, ExpertTensorRef, Manifest, TensorEntry};

pub const MANIFEST_FILE: &str = "moeflux.json";
pub const DENSE_FILE: &str = "dense.safetensors";
pub const EXPERTS_DIR: &str = "experts";
/// Alignment of expert extents (and of the expert stride): one expert is one
/// O_DIRECT-able read.
pub const EXPERT_ALIGN: usize = 4096;
/// Alignment of components inside an expert extent.
pub const COMPONENT_ALIGN: usize = 64;

/// Relative path of the expert file of `layer`.
pub fn expert_file_name(layer: usize) -> String {
    format!("{EXPERTS_DIR}/layer_{layer:03}.bin")
}

/// Whether `rel` (a path from a manifest) is syntactically inside the model
/// directory: non-empty, relative, no `..` (nor root or prefix) components.
pub fn check_relative(rel: &str) -> std::result::Result<(), String> {
    let p = Path::new(rel);
    if rel.is_empty() {
        return Err("is empty".into());
    }
    for c in p.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => {
                return Err(format!("`{rel}` leaves the model directory (`..`)"))
            }
            Component::RootDir | Component::Prefix(_) => {
                return Err(format!(
                    "`{rel}` is absolute; paths must be relative to the model directory"
                ))
            }
        }
    }
    Ok(())
}

/// The file `rel` names, which manifest `field` gives, checked to lie inside
/// `dir`: relative without `..`, and still inside once symlinks are resolved
/// (a manifest is untrusted input: it must not make the loader open
/// `/etc/...`). Returns `dir.join(rel)`; a file that does not exist is an I/O
/// error naming it.
pub fn resolve_in_dir(dir: &Path, rel: &str, field: &str) -> Result<PathBuf> {
    let manifest_path = dir.join(MANIFEST_FILE);
    check_relative(rel).map_err(|r| Error::format(&manifest_path, format!("{field}: {r}")))?;
    let path = dir.join(rel);
    let real = path.canonicalize().map_err(|e| Error::io(&path, e))?;
    let real_dir = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    if !real.starts_with(&real_dir) {
        return Err(Error::format(
            &manifest_path,
            format!(
                "{field}: `{rel}` resolves to {}, outside the model directory {}",
                real.display(),
                real_dir.display()
            ),
        ));
    }
    Ok(path)
}

/// The text of `path`, refused with an error naming it when longer than
/// `max` bytes (manifests and configs are untrusted input; a huge one must
/// not be read into memory whole).
pub fn read_small_text(path: &Path, max: u64) -> Result<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let too_big = || Error::format(path, format!("larger than the {max} bytes accepted"));
    if f.metadata().map_err(|e| Error::io(path, e))?.len() > max {
        return Err(too_big());
    }
    let mut text = String::new();
    f.take(max + 1)
        .read_to_string(&mut text)
        .map_err(|e| Error::io(path, e))?;
    // Not a regular file (a pipe): its length shows only once read.
    if text.len() as u64 > max {
        return Err(too_big());
    }
    Ok(text)
}
