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
    set_len(&p, len / 2);
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
    set_len(&p, len - 4096);
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

// ---- Untrusted moeflux.json and config.json (issue 19, item 7) ----

/// Rewrites moeflux.json through `edit` on its JSON.
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join(MANIFEST_FILE);
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Rewrites config.json (its `text_config` where it has one) through `edit`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let m = if v.get("text_config").is_some() {
        v["text_config"].as_object_mut().unwrap()
    } else {
        v.as_object_mut().unwrap()
    };
    edit(m);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Opening fails with a message holding every one of `want`.
fn assert_open_err(dir: &Path, want: &[&str]) {
    let e = open_err(dir);
    for w in want {
        assert!(e.contains(w), "`{w}` not in: {e}");
    }
}

#[test]
fn manifest_expert_layer_beyond_any_allocation() {
    // 10^15 used to abort on an 8 PB allocation, 2^62 to panic (capacity overflow).
    for layer in [1_000_000_000_000_000u64, 1 << 62, 4] {
        let (_t, dir) = model();
        edit_manifest(&dir, |m| m["experts"][0]["layer"] = layer.into());
        assert_open_err(
            &dir,
            &["moeflux.json", "experts[0].layer", "num_hidden_layers 4"],
        );
    }
}

#[test]
fn expert_store_bounds_the_layer_index_without_a_config() {
    let (_t, dir) = model();
    edit_manifest(&dir, |m| m["experts"][0]["layer"] = (1u64 << 62).into());
    let m = Manifest::read(&dir.join(MANIFEST_FILE)).unwrap();
    let e = moeflux::io::ExpertStore::open(&dir, &m, &Default::default()).unwrap_err();
    assert!(e.to_string().contains("out of range"), "{e}");
}

#[test]
fn manifest_expert_layer_listed_twice() {
    let (_t, dir) = model();
    edit_manifest(&dir, |m| {
        m["experts"][1]["layer"] = m["experts"][0]["layer"].clone()
    });
    assert_open_err(&dir, &["experts[1].layer", "listed twice"]);
}

#[test]
fn manifest_expert_counts_and_strides() {
    let cases: [(&str, serde_json::Value, &str); 5] = [
        ("num_experts", (1u64 << 40).into(), "experts[2].num_experts"),
        ("num_experts", 0.into(), "experts[2].num_experts"),
        ("stride", (1u64 << 62).into(), "experts[2].stride"),
        ("stride", 4095.into(), "experts[2].stride"),
        ("expert_bytes", u64::MAX.into(), "experts[2].expert_bytes"),
    ];
    for (field, value, want) in cases {
        let (_t, dir) = model();
        edit_manifest(&dir, |m| m["experts"][2][field] = value.clone());
        assert_open_err(&dir, &[want]);
    }
}

#[test]
fn manifest_expert_component_extents() {
    // Overlapping parts, a part past expert_bytes, an offset that overflows.
    let (_t, dir) = model();
    edit_manifest(&dir, |m| {
        let c = &mut m["experts"][1]["components"];
        c[1]["weight"]["offset"] = c[0]["weight"]["offset"].clone();
    });
    assert_open_err(&dir, &["experts of layer 1", "overlaps"]);

    let (_t, dir) = model();
    edit_manifest(&dir, |m| {
        let end = m["experts"][1]["expert_bytes"].clone();
        m["experts"][1]["components"][2]["biases"]["offset"] = end;
    });
    assert_open_err(
        &dir,
        &["experts of layer 1", "down_proj.biases", "bad byte range"],
    );

    let (_t, dir) = model();
    edit_manifest(&dir, |m| {
        m["experts"][1]["components"][0]["scales"]["offset"] = (u64::MAX - 63).into();
    });
    assert_open_err(
        &dir,
        &["experts of layer 1", "gate_proj.scales", "bad byte range"],
    );
}

#[test]
fn manifest_paths_stay_inside_the_model_directory() {
    for (field, value, want) in [
        ("file", "../x.bin", "leaves the model directory"),
        ("file", "/etc/passwd", "absolute"),
        ("file", "experts/../../x.bin", "leaves the model directory"),
        ("file", "", "empty"),
    ] {
        let (_t, dir) = model();
        edit_manifest(&dir, |m| m["experts"][0][field] = value.into());
        assert_open_err(&dir, &["moeflux.json", "experts[0].file", want]);
    }
    for value in ["/etc/passwd", "../dense.safetensors"] {
        let (_t, dir) = model();
        edit_manifest(&dir, |m| m["dense_file"] = value.into());
        assert_open_err(&dir, &["moeflux.json", "dense_file"]);
    }
    // Two layers may not share (overlap in) one file.
    let (_t, dir) = model();
    edit_manifest(&dir, |m| {
        m["experts"][1]["file"] = m["experts"][0]["file"].clone()
    });
    assert_open_err(&dir, &["experts[1].file", "another layer"]);
}

#[test]
fn manifest_file_symlinked_outside_the_model_directory() {
    let (t, dir) = model();
    let inside = dir.join("experts/layer_001.bin");
    let outside = t.path().join("elsewhere.bin");
    std::fs::rename(&inside, &outside).unwrap();
    std::os::unix::fs::symlink(&outside, &inside).unwrap();
    assert_open_err(&dir, &["experts of layer 1", "outside the model directory"]);

    // A symlink that stays inside is fine.
    let (_t, dir) = model();
    let inside = dir.join("experts/layer_001.bin");
    std::fs::rename(&inside, dir.join("experts/real.bin")).unwrap();
    std::os::unix::fs::symlink("real.bin", &inside).unwrap();
    Session::open(&dir, SessionOptions::default()).unwrap();
}

#[test]
fn config_counts_are_validated() {
    let cases: [(&str, serde_json::Value, &str); 7] = [
        // mlx-lm reads 0 experts as a model of dense MLPs only; this
        // directory's experts then have no layer to go to.
        ("num_experts", 0.into(), "config.json: num_experts is 0"),
        (
            "num_experts_per_tok",
            17.into(),
            "`num_experts_per_tok`: 17 exceeds",
        ),
        ("num_hidden_layers", 0.into(), "`num_hidden_layers`"),
        // Used to size per-layer tables at parse: an abort.
        (
            "num_hidden_layers",
            1_000_000_000_000_000u64.into(),
            "`num_hidden_layers`: 1000000000000000 is more than",
        ),
        ("hidden_size", (1u64 << 40).into(), "`hidden_size`"),
        // Each fits, their product overflows the shape arithmetic.
        (
            "head_dim",
            (1u64 << 23).into(),
            "`num_attention_heads * head_dim * 2`",
        ),
        ("vocab_size", (1u64 << 62).into(), "`vocab_size`"),
    ];
    for (field, value, want) in cases {
        let (_t, dir) = model();
        edit_config(&dir, |c| {
            c.insert(field.into(), value.clone());
        });
        assert_open_err(&dir, &["config.json", want]);
    }
}

// ---- Files changed under a running process (issue 19, item 8) ----

#[test]
fn expert_file_truncated_after_open_fails_the_eval() {
    // Mapped (default; used to die of SIGBUS), pread, and O_DIRECT reads.
    for (mmap, direct_io) in [(true, false), (false, false), (false, true)] {
        let (_t, dir) = model();
        let mut s = Session::open(
            &dir,
            SessionOptions {
                mmap,
                direct_io,
                threads: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
        s.eval(&[1, 2, 3], moeflux::LogitsMode::Last).unwrap();
        let p = dir.join("experts/layer_001.bin");
        let len = std::fs::metadata(&p).unwrap().len();
        set_len(&p, len / 4);
        let e = s
            .eval(&[4, 5, 6, 7], moeflux::LogitsMode::Last)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layer_001.bin") && e.contains("layer 1"),
            "mmap {mmap}, direct {direct_io}: {e}"
        );
    }
}

#[test]
fn dense_file_truncated_after_open_fails_the_eval() {
    let (_t, dir) = model();
    let mut s = common::open(&dir);
    s.eval(&[1, 2], moeflux::LogitsMode::Last).unwrap();
    let p = dir.join("dense.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    set_len(&p, len / 8);
    let e = s
        .eval(&[3], moeflux::LogitsMode::Last)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dense.safetensors") && e.contains("modified while loaded"),
        "{e}"
    );
}

#[test]
fn oversized_manifest_and_config_are_refused_unread() {
    for (file, limit) in [
        (MANIFEST_FILE, moeflux::format::manifest::MAX_MANIFEST_BYTES),
        ("config.json", moeflux::config::MAX_CONFIG_BYTES),
    ] {
        let (_t, dir) = model();
        // Sparse: nothing is written, and nothing may be read.
        set_len(&dir.join(file), limit + 1);
        assert_open_err(&dir, &[file, "larger than"]);
    }
}

// ---- Weights that compute NaN (issue 19, item 7) ----

/// The fixture with every float of `tensor` replaced by NaN.
fn nan_model(tensor: &'static str) -> (tempfile::TempDir, std::path::PathBuf) {
    let (t, dir) = model();
    rewrite_dense(&dir, move |n, d, s, b| {
        Some(if n == tensor {
            let nan: Vec<u8> = match d {
                safetensors::Dtype::BF16 => [0xc0u8, 0x7f].repeat(b.len() / 2),
                safetensors::Dtype::F32 => f32::NAN.to_le_bytes().repeat(b.len() / 4),
                other => panic!("{tensor} is {other:?}"),
            };
            (d, s, nan)
        } else {
            (d, s, b)
        })
    });
    (t, dir)
}

#[test]
fn nan_weights_name_the_first_bad_layer() {
    let (_t, dir) = nan_model("model.layers.2.post_attention_layernorm.weight");
    let mut s = common::open(&dir);
    let e = s.eval(&[1, 2, 3], moeflux::LogitsMode::Last).unwrap_err();
    assert!(matches!(e, moeflux::Error::NonFinite(_)), "{e:?}");
    let e = e.to_string();
    assert!(e.contains("layer 2 (mlp_norm)"), "{e}");
    // The session says it must be reset rather than computing on.
    assert!(s.eval(&[4], moeflux::LogitsMode::Last).is_err());
    s.clear();
    assert!(s.eval(&[4], moeflux::LogitsMode::Last).is_err());
    // A greedy eval checks its logits as well: the same error, no token.
    let mut s = common::open(&dir);
    let e = s.eval_greedy(&[1, 2, 3]).unwrap_err();
    assert!(e.to_string().contains("layer 2 (mlp_norm)"), "{e}");
}

#[test]
fn nan_weights_stop_generation() {
    use moeflux::generate::{generate, GenerateOptions};
    let (_t, dir) = nan_model("model.layers.1.input_layernorm.weight");
    let mut s = common::open(&dir);
    let tok = moeflux::text::tokenizer::Tokenizer::from_model_dir(&dir).unwrap();
    let mut text = String::new();
    let r = generate(
        &mut s,
        &tok,
        &[1, 2, 3],
        &GenerateOptions {
            max_tokens: 4,
            ..Default::default()
        },
        None,
        &mut |e| {
            if let moeflux::generate::Event::Text { text: t, .. } = e {
                text.push_str(t);
            }
        },
    );
    let e = r.map(|st| format!("{st:?}")).unwrap_err().to_string();
    assert!(e.contains("layer 1 (attn_norm)"), "{e}");
    assert!(text.is_empty());
}

#[test]
fn nan_lm_head_names_the_logits() {
    let (_t, dir) = nan_model("model.norm.weight");
    let e = common::open(&dir)
        .eval(&[1, 2], moeflux::LogitsMode::All)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("logits") && e.contains("every layer's output was finite"),
        "{e}"
    );
}

/// Cuts or extends a file in place, as another process could.
fn set_len(p: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}
