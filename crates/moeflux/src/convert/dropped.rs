//! What the checkpoint tensors `convert` left out are, grouped for the
//! report (`moeflux convert` prints the groups on stderr).
//!
//! Only the names are looked at: sanitize drops a tensor for one of a few
//! reasons (see [`super::sanitize`]), and each leaves a recognisable name.

use std::collections::BTreeMap;
use std::fmt;

/// Why a group of checkpoint tensors was left out. Ordered as reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DroppedKind {
    /// A numbered multi-token-prediction layer (DeepSeek-V3, Kimi, GLM-4.5:
    /// `model.layers.N.*` with `N >= num_hidden_layers`).
    MtpLayer(usize),
    /// Qwen3.5's / Qwen3-Next's multi-token-prediction module (`mtp.*`).
    MtpModule,
    /// A vision encoder (`vision_tower.*`, `vision_model.*`, `model.visual.*`).
    VisionTower,
    /// The projector from vision to text features (`mm_projector.*`,
    /// `multi_modal_projector.*`).
    VisionProjector,
    /// `lm_head` of a model with tied embeddings (the embedding is used).
    TiedLmHead,
    /// Precomputed rotary frequency tables (`rotary_emb.inv_freq`).
    RotaryTables,
    /// Anything else sanitize left out.
    Other,
}

impl fmt::Display for DroppedKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DroppedKind::MtpLayer(l) => write!(f, "multi-token-prediction layer {l}"),
            DroppedKind::MtpModule => f.write_str("multi-token-prediction module"),
            DroppedKind::VisionTower => f.write_str("vision tower"),
            DroppedKind::VisionProjector => f.write_str("vision projector"),
            DroppedKind::TiedLmHead => f.write_str("tied lm_head"),
            DroppedKind::RotaryTables => f.write_str("rotary tables"),
            DroppedKind::Other => f.write_str("other"),
        }
    }
}

/// The tensors of one [`DroppedKind`], sorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DroppedGroup {
    pub kind: DroppedKind,
    pub tensors: Vec<String>,
}

/// `name` without the prefixes that nest a text model
/// (`language_model.`, `model.language_model.` -> `model.`).
fn text_name(name: &str) -> &str {
    let n = name.strip_prefix("language_model.").unwrap_or(name);
    match n.strip_prefix("model.language_model.") {
        // Keep a leading segment for the checks below ("model.layers.N").
        Some(_) => &n["model.language_".len()..],
        None => n,
    }
}

/// What the dropped checkpoint tensor `name` is.
pub fn classify(name: &str) -> DroppedKind {
    let n = text_name(name);
    if n.contains("rotary_emb.inv_freq") {
        return DroppedKind::RotaryTables;
    }
    if ["vision_tower.", "vision_model.", "model.visual."]
        .iter()
        .any(|p| name.starts_with(p))
    {
        return DroppedKind::VisionTower;
    }
    if ["mm_projector.", "multi_modal_projector."]
        .iter()
        .any(|p| name.starts_with(p))
    {
        return DroppedKind::VisionProjector;
    }
    if n.starts_with("mtp.") || n.starts_with("model.mtp.") {
        return DroppedKind::MtpModule;
    }
    // Layers are dropped only past num_hidden_layers: the MTP layers.
    if let Some(l) = n
        .strip_prefix("model.layers.")
        .and_then(|s| s.split('.').next())
        .and_then(|s| s.parse().ok())
    {
        return DroppedKind::MtpLayer(l);
    }
    if n.strip_prefix("lm_head.")
        .is_some_and(|s| matches!(s, "weight" | "scales" | "biases"))
    {
        return DroppedKind::TiedLmHead;
    }
    DroppedKind::Other
}

/// The dropped tensors grouped by [`DroppedKind`], in that order.
pub fn group(dropped: &[String]) -> Vec<DroppedGroup> {
    let mut groups: BTreeMap<DroppedKind, Vec<String>> = BTreeMap::new();
    for name in dropped {
        groups.entry(classify(name)).or_default().push(name.clone());
    }
    groups
        .into_iter()
        .map(|(kind, mut tensors)| {
            tensors.sort();
            DroppedGroup { kind, tensors }
        })
        .collect()
}

/// One line: `skipped 14 tensors: multi-token-prediction layer 3 (12),
/// vision tower (2)`; `None` when nothing was dropped.
pub fn summary(dropped: &[String]) -> Option<String> {
    if dropped.is_empty() {
        return None;
    }
    let n = dropped.len();
    let parts: Vec<String> = group(dropped)
        .iter()
        .map(|g| format!("{} ({})", g.kind, g.tensors.len()))
        .collect();
    Some(format!(
        "skipped {n} tensor{}: {}",
        if n == 1 { "" } else { "s" },
        parts.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds() {
        for (name, kind) in [
            ("model.layers.3.eh_proj.weight", DroppedKind::MtpLayer(3)),
            (
                "language_model.model.layers.61.enorm.weight",
                DroppedKind::MtpLayer(61),
            ),
            (
                "model.language_model.layers.40.mlp.gate.weight",
                DroppedKind::MtpLayer(40),
            ),
            ("mtp.fc.weight", DroppedKind::MtpModule),
            (
                "vision_tower.patch_embed.proj.weight",
                DroppedKind::VisionTower,
            ),
            (
                "model.visual.patch_embed.proj.weight",
                DroppedKind::VisionTower,
            ),
            ("mm_projector.proj.0.bias", DroppedKind::VisionProjector),
            (
                "multi_modal_projector.linear_1.weight",
                DroppedKind::VisionProjector,
            ),
            ("lm_head.weight", DroppedKind::TiedLmHead),
            ("language_model.lm_head.scales", DroppedKind::TiedLmHead),
            (
                "model.layers.0.self_attn.rotary_emb.inv_freq",
                DroppedKind::RotaryTables,
            ),
            ("something.else", DroppedKind::Other),
        ] {
            assert_eq!(classify(name), kind, "{name}");
        }
    }

    #[test]
    fn summary_groups_in_order() {
        let names: Vec<String> = [
            "vision_tower.a",
            "model.layers.4.x",
            "model.layers.3.y",
            "model.layers.3.x",
            "mm_projector.b",
            "lm_head.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(
            summary(&names).unwrap(),
            "skipped 6 tensors: multi-token-prediction layer 3 (2), \
             multi-token-prediction layer 4 (1), vision tower (1), vision projector (1), \
             tied lm_head (1)"
        );
        let g = group(&names);
        assert_eq!(g[0].tensors, ["model.layers.3.x", "model.layers.3.y"]);
        assert_eq!(
            summary(&["mtp.fc.weight".to_string()]).unwrap(),
            "skipped 1 tensor: multi-token-prediction module (1)"
        );
        assert_eq!(summary(&[]), None);
    }
}
