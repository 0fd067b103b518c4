//! Model families, written against the CPU backend ops.

pub mod attention;
pub mod deepseek_v3;
pub mod deltanet;
pub mod experts;
pub mod mla;
pub mod moe;
pub mod qwen3_hybrid;
pub mod router;
pub mod schema;
pub(crate) mod stack;
pub mod state;
pub mod timing;
pub mod weights;
pub mod yarn;

use std::path::Path;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::format::Manifest;
use deepseek_v3::DeepseekV3;
use experts::ExpertRun;
use qwen3_hybrid::{LogitsMode, QwenHybrid};
use state::ModelState;
use timing::PhaseTimes;

/// A loaded model of any supported family (the CPU forward pass).
pub enum Model {
    /// Qwen3.5-MoE / Qwen3-Next (GatedDeltaNet + gated attention).
    Qwen(QwenHybrid),
    /// The DeepSeek-V3 family (MLA + `noaux_tc` MoE).
    DeepseekV3(DeepseekV3),
}

impl Model {
    /// Loads the family `config.arch` names.
    pub fn load(dir: &Path, manifest: &Manifest, config: ModelConfig) -> Result<Self> {
        if config.arch.is_deepseek() {
            Ok(Model::DeepseekV3(DeepseekV3::load(dir, manifest, config)?))
        } else {
            Ok(Model::Qwen(QwenHybrid::load(dir, manifest, config)?))
        }
    }

    pub fn config(&self) -> &ModelConfig {
        match self {
            Model::Qwen(m) => &m.config,
            Model::DeepseekV3(m) => &m.config,
        }
    }

    pub fn new_state(&self) -> ModelState {
        match self {
            Model::Qwen(m) => m.new_state(),
            Model::DeepseekV3(m) => m.new_state(),
        }
    }

    pub fn forward(
        &self,
        run: &mut ExpertRun<'_>,
        state: &mut ModelState,
        tokens: &[u32],
        start: usize,
        mode: LogitsMode,
        times: &mut PhaseTimes,
    ) -> Result<Vec<f32>> {
        match self {
            Model::Qwen(m) => m.forward(run, state, tokens, start, mode, times),
            Model::DeepseekV3(m) => m.forward(run, state, tokens, start, mode, times),
        }
    }
}
