//! Opening a damaged model directory: a clear error naming the file,
//! tensor or field, never a panic.

mod common;

use std::path::Path;

use common::convert_fixture;
use moeflux::format::{Manifest, MANIFEST_FILE};
use moeflux::session::Prefetch;
use moeflux::{Session, SessionOptions};

fn open_err(dir: &Path) -> String {
    match Session::open(dir, SessionOptions::default()) {
        Ok(_) => panic!("opening {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn model() -> (tempfile::TempDir, std::path::PathBuf) {
    convert_fixture("qwen35moe-q4/src", None)
}

/// Rewrites dense.safetensors through `edit` and fixes the manifest's table.
fn rewrite_dense(
    dir: &Path,
    edit: impl Fn(
        &str,
        safetensors::Dtype,
        Vec<usize>,
        Vec<u8>,
    ) -> Option<(safetensors::Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = dir.join("dense.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept = Vec::new();
    for (name, view) in st.tensors() {
        if let Some(t) = edit(
            &name,
            view.dtype(),
            view.shape().to_vec(),
            view.data().to_vec(),
        ) {
            kept.push((name, t));
        }
    }
    // Largest element size first keeps every tensor aligned.
    kept.sort_by_key(|(n, (d, _, _))| (std::cmp::Reverse(d.bitsize()), n.clone()));
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(&path, &out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&out).unwrap();
    let base = out.as_ptr() as usize;
    let mpath = dir.join(MANIFEST_FILE);
    let mut m = Manifest::read(&mpath).unwrap();
    m.tensors.clear();
    for (name, view) in st.tensors() {
        m.tensors.insert(
            name.clone(),
            moeflux::format::TensorEntry {
                dtype: format!("{:?}", view.dtype()),
                shape: view.shape().to_vec(),
                offset: (view.data().as_ptr() as usize - base) as u64,
                bytes: view.data().len() as u64,
            },
        );
    }
    std::fs::write(&mpath, m.to_json()).unwrap();
}

#[test]
fn missing_manifest() {
    let (_t, dir) = model();
    std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    assert!(open_err(&dir).contains("moeflux.json"));
}

#[test]
fn missing_config() {
    let (_t, dir) = model();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(open_err(&dir).contains("config.json"));
}

#[test]
fn unsupported_model_type() {
    let (_t, dir) = model();
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"qwen3_5_moe\"", "\"llama\"");
    std::fs::write(&p, text).unwrap();
    let e = open_err(&dir);
    assert!(e.contains("llama") && e.contains("model_type"), "{e}");
}

#[test]
fn missing_dense_file() {
    let (_t, dir) = model();
    std::fs::remove_file(dir.join("dense.safetensors")).unwrap();
    assert!(open_err(&dir).contains("dense.safetensors"));
}

#[test]
fn truncated_dense_file() {
    let (_t, dir) = model();
    let p = dir.join("dense.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    assert!(open_err(&dir).contains("dense.safetensors"));
}

#[test]
fn missing_expert_file() {
    let (_t, dir) = model();
    std::fs::remove_file(dir.join("experts/layer_002.bin")).unwrap();
    assert!(open_err(&dir).contains("layer_002.bin"));
}

#[test]
fn truncated_expert_file() {
    let (_t, dir) = model();
    let p = dir.join("experts/layer_001.bin");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    assert!(open_err(&dir).contains("layer_001.bin"));
}

#[test]
fn tensor_missing() {
    let (_t, dir) = model();
    rewrite_dense(&dir, |n, d, s, b| {
        (n != "model.layers.1.post_attention_layernorm.weight").then_some((d, s, b))
    });
    let e = open_err(&dir);
    assert!(
        e.contains("model.layers.1.post_attention_layernorm.weight") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn tensor_with_wrong_dtype() {
    let (_t, dir) = model();
    rewrite_dense(&dir, |n, d, s, b| {
        Some(if n == "model.norm.weight" {
            // Same bytes reinterpreted as 64 U32 words: the wrong type for a norm.
            (safetensors::Dtype::U32, vec![s[0] / 2], b)
        } else {
            (d, s, b)
        })
    });
    let e = open_err(&dir);
    assert!(e.contains("model.norm.weight"), "{e}");
}

#[test]
fn tensor_with_wrong_shape() {
    let (_t, dir) = model();
    rewrite_dense(&dir, |n, d, s, b| {
        Some(if n == "model.layers.0.input_layernorm.weight" {
            (d, vec![s[0] / 2], b[..b.len() / 2].to_vec())
        } else {
            (d, s, b)
        })
    });
    let e = open_err(&dir);
    assert!(
        e.contains("model.layers.0.input_layernorm.weight") && e.contains("shape"),
        "{e}"
    );
}

#[test]
fn quantized_tensor_with_wrong_shape() {
    let (_t, dir) = model();
    rewrite_dense(&dir, |n, d, s, b| {
        Some(if n == "model.layers.3.self_attn.o_proj.scales" {
            (d, vec![s[0] / 2, s[1]], b[..b.len() / 2].to_vec())
        } else {
            (d, s, b)
        })
    });
    let e = open_err(&dir);
    assert!(e.contains("model.layers.3.self_attn.o_proj.scales"), "{e}");
}

#[test]
fn corrupt_manifest() {
    let (_t, dir) = model();
    std::fs::write(dir.join(MANIFEST_FILE), "{ not json").unwrap();
    let e = open_err(&dir);
    assert!(e.contains("moeflux.json") && e.contains("JSON"), "{e}");
}

#[test]
fn every_expert_access_mode_gives_the_same_logits() {
    let (_t, dir) = model();
    let g = common::Golden::load(&common::fixtures().join("qwen35moe-q4"));
    let mapped = common::open(&dir)
        .eval(&g.tokens, moeflux::LogitsMode::All)
        .unwrap();
    for (direct_io, mmap, prefetch) in [
        (false, false, false),
        (true, false, false),
        (false, true, true),
        (false, false, true),
        (true, false, true),
    ] {
        let mut s = Session::open(
            &dir,
            SessionOptions {
                direct_io,
                mmap,
                prefetch: if prefetch {
                    Prefetch::On
                } else {
                    Prefetch::Off
                },
                threads: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        let what = format!("direct_io {direct_io}, mmap {mmap}, prefetch {prefetch}");
        assert_eq!(
            s.eval(&g.tokens, moeflux::LogitsMode::All).unwrap(),
            mapped,
            "batch, {what}"
        );
        // One token at a time: prefetches of a single token's experts.
        s.clear();
        for (i, &t) in g.tokens.iter().enumerate() {
            let row = s.eval(&[t], moeflux::LogitsMode::Last).unwrap();
            assert_eq!(
                row,
                mapped[i * g.vocab..(i + 1) * g.vocab],
                "token {i}, {what}"
            );
        }
        let p = s.prefetch_stats();
        if prefetch {
            // 3 of the fixture's 4 MoE layers have a next MoE layer.
            assert!(p.predicted > 0 && p.used > 0, "{what}: {p:?}");
            assert!(p.hits <= p.used.min(p.predicted));
        } else {
            assert_eq!(p, Default::default());
        }
    }
}
