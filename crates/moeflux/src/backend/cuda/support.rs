//! What the GPU backend can run, decided from the model alone (no GPU
//! needed): `--backend auto` asks before opening a device and falls back to
//! the CPU with the reason; `--backend cuda` fails with it.

use crate::error::{Error, Result};
use crate::model::layer::{Mixer, Mlp};
use crate::model::Model;

use super::{attention, deltanet, mla, moe};

/// A model (a shape or feature of it) this backend cannot run.
pub(super) fn unsupported(what: String) -> Error {
    Error::Unsupported {
        what,
        backend: "cuda",
    }
}

/// Every shape and feature of `model` the kernels take, or the first one
/// they do not (`Error::Unsupported`).
pub fn check(model: &Model) -> Result<()> {
    let c = &model.config;
    if model.embed.quant.is_none() {
        return Err(unsupported("an unquantized embedding".into()));
    }
    for layer in &model.layers {
        match &layer.mixer {
            Mixer::Full(_) => attention::check_shape(c)?,
            Mixer::Linear(_) => deltanet::check_shape(c)?,
            Mixer::Mla(a) => {
                mla::MlaParams::new(c, &model.rope)?;
                mla::check_layer(a)?;
            }
        }
        if let Mlp::Moe(b) = &layer.mlp {
            moe::check(c, b)?;
        }
    }
    Ok(())
}
