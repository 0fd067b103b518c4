//! `synth`: deterministic bytes, a directory `Session::open` accepts with
//! sane logits, the router skew's popularity curve, and bad options.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use moeflux::convert::{ConvertProgress, ConvertStage};
use moeflux::format::Manifest;
use moeflux::model::schema::{self, WeightKind};
use moeflux::model::weights::DenseStore;
use moeflux::synth::skew::zipf_frequencies;
use moeflux::synth::{find_preset, synth, RouterSkew, SynthOptions, SynthSpec};
use moeflux::{Error, LogitsMode, Session, SessionOptions};

fn spec() -> SynthSpec {
    common::small_moe_spec()
}

fn make(dst: &Path, f: impl FnOnce(&mut SynthOptions)) -> PathBuf {
    let mut o = SynthOptions::new("test", spec());
    f(&mut o);
    synth(dst, &o).unwrap();
    dst.to_path_buf()
}

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut names = vec![
        "config.json".to_string(),
        "moeflux.json".into(),
        "dense.safetensors".into(),
    ];
    let mut experts: Vec<String> = std::fs::read_dir(dir.join("experts"))
        .unwrap()
        .map(|e| format!("experts/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    experts.sort();
    names.extend(experts);
    names
        .into_iter()
        .map(|n| {
            let b = std::fs::read(dir.join(&n)).unwrap();
            (n, b)
        })
        .collect()
}

/// The bytes of dense tensor `name`.
fn tensor(dir: &Path, name: &str) -> Vec<u8> {
    let m = Manifest::read(&dir.join("moeflux.json")).unwrap();
    let t = &m.tensors[name];
    let d = std::fs::read(dir.join("dense.safetensors")).unwrap();
    d[t.offset as usize..(t.offset + t.bytes) as usize].to_vec()
}

#[test]
fn bytes_depend_on_the_seed_only() {
    let t = tempfile::tempdir().unwrap();
    let skew = Some(RouterSkew::Zipf(1.0));
    let a = make(&t.path().join("a"), |o| {
        o.seed = 1;
        o.router_skew = skew;
    });
    // One thread instead of all: the same bytes.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let b = pool.install(|| {
        make(&t.path().join("b"), |o| {
            o.seed = 1;
            o.router_skew = skew;
        })
    });
    assert!(files(&a) == files(&b), "same seed, different bytes");

    let c = make(&t.path().join("c"), |o| {
        o.seed = 2;
        o.router_skew = skew;
    });
    for ((n, x), (_, y)) in files(&a).iter().zip(files(&c)).skip(2) {
        assert!(*x != y, "{n}: the seed changed nothing");
    }

    // The first layers of the model, byte for byte.
    let d = make(&t.path().join("d"), |o| {
        o.seed = 1;
        o.router_skew = skew;
        o.layers = Some(2);
    });
    for f in ["experts/layer_000.bin", "experts/layer_001.bin"] {
        assert!(std::fs::read(a.join(f)).unwrap() == std::fs::read(d.join(f)).unwrap());
    }
    assert!(!d.join("experts/layer_002.bin").exists());
    for n in [
        "model.embed_tokens.weight",
        "lm_head.scales",
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.post_attention_layernorm.weight",
    ] {
        assert!(tensor(&a, n) == tensor(&d, n), "{n}");
    }
}

#[test]
fn opens_with_sane_logits_at_every_expert_width() {
    let t = tempfile::tempdir().unwrap();
    for bits in [2, 4, 8] {
        let dir = make(&t.path().join(format!("m{bits}")), |o| {
            o.expert_bits = bits;
            o.router_skew = Some(RouterSkew::Zipf(1.0));
        });
        let mut s = Session::open(&dir, SessionOptions::default()).unwrap();
        let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 512).collect();
        assert_sane_logits(
            &s.eval(&tokens, LogitsMode::All).unwrap(),
            &format!("{bits}-bit"),
        );
        let m = Manifest::read(&dir.join("moeflux.json")).unwrap();
        assert_eq!(m.source.kind, "synthetic");
        assert_eq!(m.experts[0].components[0].quant.bits, bits);
    }
}

/// Finite, unit-order logits (vocabulary 512) at every position: nothing
/// exploded or vanished.
fn assert_sane_logits(logits: &[f32], what: &str) {
    assert!(logits.iter().all(|x| x.is_finite()), "{what}");
    for row in logits.chunks(512) {
        let rms = (row.iter().map(|x| x * x).sum::<f32>() / 512.0).sqrt();
        assert!((0.3..3.0).contains(&rms), "{what}: logit RMS {rms}");
    }
}

/// Share of all expert selections taken by the most popular 10% of experts.
fn top10_share(counts: &[u64]) -> f64 {
    let mut c = counts.to_vec();
    c.sort_unstable_by(|a, b| b.cmp(a));
    let n = c.len().div_ceil(10);
    c[..n].iter().sum::<u64>() as f64 / c.iter().sum::<u64>() as f64
}

/// Selections per expert of each MoE layer over `n` random tokens,
/// evaluated one at a time (so that a read is a selection).
fn popularity(dir: &Path, n: usize) -> Vec<Vec<u64>> {
    let mut s = Session::open(dir, SessionOptions::default()).unwrap();
    let mut x = 12345u64;
    for _ in 0..n {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.eval(&[((x >> 33) % 512) as u32], LogitsMode::Last)
            .unwrap();
    }
    (0..s.config().num_layers)
        .map(|l| s.expert_reads(l).unwrap())
        .collect()
}

#[test]
fn router_skew_gives_zipf_popularity() {
    let t = tempfile::tempdir().unwrap();
    let tokens = 300;
    let uniform = make(&t.path().join("u"), |o| o.layers = Some(2));
    for counts in popularity(&uniform, tokens) {
        assert_eq!(counts.iter().sum::<u64>(), 8 * tokens as u64);
        let share = top10_share(&counts);
        assert!(share < 0.2, "no skew, yet the top 10% take {share}");
    }

    let f = zipf_frequencies(128, 8, 1.0);
    let target = f[..13].iter().sum::<f64>() / 8.0;
    let skewed = make(&t.path().join("z"), |o| {
        o.layers = Some(2);
        o.router_skew = Some(RouterSkew::Zipf(1.0));
    });
    for counts in popularity(&skewed, tokens) {
        let share = top10_share(&counts);
        eprintln!("zipf:1 top-10% share {share:.3} (target {target:.3})");
        assert!(
            (share - target).abs() < 0.1,
            "top 10% take {share}, Zipf(1) says {target}"
        );
    }
}

#[test]
fn bad_options_are_errors() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("m");
    let run = |f: &dyn Fn(&mut SynthOptions)| {
        let mut o = SynthOptions::new("test", spec());
        f(&mut o);
        synth(&dst, &o).unwrap_err().to_string()
    };
    assert!(run(&|o| o.layers = Some(0)).contains("between 1 and 4"));
    assert!(run(&|o| o.layers = Some(5)).contains("between 1 and 4"));
    assert!(run(&|o| o.expert_bits = 3).contains("2, 4 or 8"));
    let e = run(&|o| o.tokenizer = Some("/nonexistent/tok.json".into()));
    assert!(
        e.contains("/nonexistent/tok.json: no such tokenizer"),
        "{e}"
    );
    let e = run(&|o| o.tokenizer = Some("/".into()));
    assert!(e.contains("/tokenizer.json: no such tokenizer"), "{e}");
    std::fs::create_dir(&dst).unwrap();
    assert!(matches!(
        synth(&dst, &SynthOptions::new("test", spec())),
        Err(Error::DestinationExists { .. })
    ));
    assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 1, "leftovers");

    for bad in ["zipf", "zipf:", "zipf:x", "zipf:-1", "zipf:inf", "pareto:1"] {
        let e = RouterSkew::parse(bad).unwrap_err().to_string();
        assert!(e.contains("zipf:ALPHA"), "{bad}: {e}");
    }
    assert_eq!(
        RouterSkew::parse("zipf:1.2").unwrap(),
        RouterSkew::Zipf(1.2)
    );
    let e = find_preset("qwen9").unwrap_err().to_string();
    assert!(e.contains("qwen3.6-35b-a3b"), "{e}");
}

#[test]
fn cancelled_while_writing_leaves_nothing() {
    let t = tempfile::tempdir().unwrap();
    for stage in [ConvertStage::Dense, ConvertStage::Experts] {
        let flag = AtomicBool::new(false);
        let cb = |p: &ConvertProgress| {
            if p.stage == stage && (p.layer == Some(2) || stage == ConvertStage::Dense) {
                flag.store(true, Ordering::Relaxed);
            }
        };
        let mut o = SynthOptions::new("test", spec());
        o.cancel = Some(&flag);
        o.progress = Some(&cb);
        let e = synth(&t.path().join("m"), &o).unwrap_err();
        assert!(matches!(e, Error::Cancelled), "{e:?}");
        assert!(
            std::fs::read_dir(t.path()).unwrap().next().is_none(),
            "leftovers"
        );
    }
}

/// A DeepSeek-V3-shaped synthetic model (MLA, dense first layer, noaux_tc
/// MoE) opens, runs with finite unit-order logits, and its 2-layer cut of
/// the cogito-v2-671b preset has the real model's config.
#[test]
fn deepseek_v3_synth_opens_and_runs() {
    let p = find_preset("cogito-v2-671b").unwrap();
    let SynthSpec::DeepseekV3(real) = p.spec else {
        panic!("cogito-v2-671b is a DeepSeek-V3 shape");
    };
    assert_eq!(
        (
            real.num_layers,
            real.hidden_size,
            real.num_experts,
            real.first_k_dense
        ),
        (61, 7168, 256, 3)
    );
    let small = moeflux::synth::DeepseekShape {
        hidden_size: 128,
        num_layers: 3,
        num_attention_heads: 2,
        vocab_size: 512,
        num_experts: 16,
        experts_per_token: 4,
        moe_intermediate: 64,
        n_shared_experts: 1,
        intermediate_size: 128,
        first_k_dense: 1,
        q_lora_rank: 64,
        kv_lora_rank: 64,
        qk_nope_head_dim: 64,
        qk_rope_head_dim: 64,
        v_head_dim: 64,
        n_group: 4,
        topk_group: 2,
        ..real
    };
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("ds");
    synth(&dir, &SynthOptions::new("ds", SynthSpec::DeepseekV3(small))).unwrap();
    let mut s = Session::open(&dir, SessionOptions::default()).unwrap();
    assert_eq!(s.config().arch, moeflux::Architecture::DeepseekV3);
    let tokens: Vec<u32> = (0..16).map(|i| (i * 37 + 5) % 512).collect();
    let logits = s.eval(&tokens, LogitsMode::All).unwrap();
    for row in logits.chunks(512) {
        let rms = (row.iter().map(|x| x * x).sum::<f32>() / 512.0).sqrt();
        assert!(
            rms.is_finite() && (0.1..10.0).contains(&rms),
            "logit RMS {rms}"
        );
    }
    let m = Manifest::read(&dir.join("moeflux.json")).unwrap();
    assert_eq!(
        m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(),
        vec![1, 2]
    );
}

// ------------------------------------------- qwen3_moe and glm4_moe
//
// Their forward pass is not in this build yet: these check what synth
// writes (config, schema, values of the new tensors, bytes) without running
// the model.

/// A preset at small widths, keeping its family's features (q/k norm,
/// biases, dense first layers, router kind, rotary fraction, eos ids).
fn small_of(name: &str) -> SynthSpec {
    match find_preset(name).unwrap().spec {
        SynthSpec::Qwen3Moe(real) => SynthSpec::Qwen3Moe(moeflux::synth::Qwen3MoeShape {
            hidden_size: 256,
            num_layers: 4,
            num_attention_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            vocab_size: 512,
            num_experts: 32,
            experts_per_token: 4,
            moe_intermediate: 64,
            intermediate_size: 128,
            ..real
        }),
        SynthSpec::Glm4Moe(real) => SynthSpec::Glm4Moe(moeflux::synth::GlmShape {
            hidden_size: 256,
            num_layers: real.first_k_dense + 2,
            num_attention_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            vocab_size: 512,
            num_experts: 32,
            experts_per_token: 4,
            moe_intermediate: 64,
            intermediate_size: 128,
            ..real
        }),
        other => panic!("{name}: {other:?}"),
    }
}

fn make_spec(dst: &Path, spec: SynthSpec, f: impl FnOnce(&mut SynthOptions)) -> PathBuf {
    let mut o = SynthOptions::new("test", spec);
    f(&mut o);
    synth(dst, &o).unwrap();
    dst.to_path_buf()
}

/// The directory is what the loader checks: the manifest against the dense
/// file, every schema tensor with its shape, exactly the schema's tensors,
/// expert files for exactly the MoE layers; returns config and manifest.
fn check_synth_dir(dir: &Path) -> (moeflux::ModelConfig, Manifest) {
    let cfg = moeflux::ModelConfig::from_dir(dir).unwrap();
    let m = Manifest::read(&dir.join("moeflux.json")).unwrap();
    assert_eq!(m.architecture, cfg.arch.model_type());
    assert_eq!(m.source.kind, "synthetic");
    let store = DenseStore::open(dir, &m).unwrap();
    store.validate_schema(&cfg).unwrap();
    let mut want = std::collections::BTreeSet::new();
    for w in schema::dense_weights(&cfg) {
        match w.kind {
            WeightKind::Linear { .. } => {
                // synth quantizes every linear layer.
                assert!(m.quantized.contains_key(&w.name), "{}", w.name);
                for p in ["weight", "scales", "biases"] {
                    want.insert(format!("{}.{p}", w.name));
                }
            }
            _ => {
                want.insert(w.name);
            }
        }
    }
    let have: std::collections::BTreeSet<String> = m.tensors.keys().cloned().collect();
    assert_eq!(have, want);
    let moe: Vec<usize> = (0..cfg.num_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    assert_eq!(m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(), moe);
    let specs = schema::expert_weights(&cfg);
    for (el, s) in m.experts.iter().zip(&specs) {
        let shapes: Vec<(usize, usize)> = el.components.iter().map(|c| (c.rows, c.cols)).collect();
        let want: Vec<(usize, usize)> = s.projections.iter().map(|p| (p.1, p.2)).collect();
        assert_eq!(shapes, want, "layer {}", el.layer);
        let len = std::fs::metadata(dir.join(&el.file)).unwrap().len();
        assert_eq!(len, el.num_experts as u64 * el.stride);
    }
    // Every MoE layer's router 8-bit, as config.json says.
    let q = cfg.quantization.as_ref().unwrap();
    for &l in &moe {
        let g = format!("model.layers.{l}.mlp.gate");
        assert_eq!(m.quantized[&g].bits, 8, "{g}");
        assert_eq!(q.for_module(&g).unwrap().bits, 8, "{g}");
    }
    (cfg, m)
}

/// A dense float vector's values.
fn floats(dir: &Path, name: &str) -> Vec<f32> {
    let m = Manifest::read(&dir.join("moeflux.json")).unwrap();
    let t = &m.tensors[name];
    DenseStore::open(dir, &m)
        .unwrap()
        .floats(name, &t.shape)
        .unwrap()
}

/// Same seed: the same bytes with one thread as with all; another seed:
/// other bytes; the first layers of a truncated model are the full one's.
fn check_deterministic(spec: SynthSpec, shared_layers: &[&str]) {
    let t = tempfile::tempdir().unwrap();
    let skew = Some(RouterSkew::Zipf(1.0));
    let a = make_spec(&t.path().join("a"), spec.clone(), |o| {
        o.seed = 5;
        o.router_skew = skew;
    });
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let b = pool.install(|| {
        make_spec(&t.path().join("b"), spec.clone(), |o| {
            o.seed = 5;
            o.router_skew = skew;
        })
    });
    assert!(files(&a) == files(&b), "same seed, different bytes");
    let c = make_spec(&t.path().join("c"), spec.clone(), |o| {
        o.seed = 6;
        o.router_skew = skew;
    });
    assert!(files(&a)[2].1 != files(&c)[2].1, "the seed changed nothing");

    let layers = spec.num_layers() - 1;
    let d = make_spec(&t.path().join("d"), spec, |o| {
        o.seed = 5;
        o.router_skew = skew;
        o.layers = Some(layers);
    });
    let (cd, md) = check_synth_dir(&d);
    assert_eq!(cd.num_layers, layers);
    for el in &md.experts {
        assert!(
            std::fs::read(a.join(&el.file)).unwrap() == std::fs::read(d.join(&el.file)).unwrap(),
            "{}",
            el.file
        );
    }
    for n in md.tensors.keys() {
        assert!(tensor(&a, n) == tensor(&d, n), "{n}");
    }
    for n in shared_layers {
        assert!(md.tensors.contains_key(*n), "{n}");
    }
}

/// qwen3-30b-a3b and qwen3-235b-a22b at small widths: a qwen3_moe directory
/// (q/k norms of ones, no biases, every layer MoE with an 8-bit softmax
/// router, no shared expert, Qwen3's eos ids) that validates against the
/// schema; deterministic bytes, truncation a prefix.
#[test]
fn qwen3_moe_synth_validates() {
    for name in ["qwen3-30b-a3b", "qwen3-235b-a22b"] {
        let t = tempfile::tempdir().unwrap();
        let dir = make_spec(&t.path().join("m"), small_of(name), |o| {
            o.router_skew = Some(RouterSkew::Zipf(1.0));
        });
        let (cfg, m) = check_synth_dir(&dir);
        assert_eq!(cfg.arch, moeflux::Architecture::Qwen3Moe);
        assert_eq!((cfg.num_layers, cfg.hidden_size), (4, 256));
        assert!(cfg.attention.qk_norm && !cfg.attention.qkv_bias && !cfg.attention.output_gate);
        assert_eq!(cfg.rope.rotary_dim, 64);
        assert_eq!(cfg.eos_token_ids, [151_645, 151_643]);
        assert_eq!(m.experts.len(), 4);
        assert!(!m.tensors.keys().any(|k| k.ends_with(".bias")));
        assert!(!m.tensors.keys().any(|k| k.contains("shared_expert")));
        for n in ["q_norm", "k_norm"] {
            let v = floats(&dir, &format!("model.layers.2.self_attn.{n}.weight"));
            assert_eq!(v, vec![1.0; 64], "{n}");
        }
        let cfg_text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&cfg_text).unwrap();
        assert_eq!(v["model_type"], "qwen3_moe");
        assert_eq!(v["architectures"][0], "Qwen3MoeForCausalLM");
        assert_eq!(v["decoder_sparse_step"], 1);
        assert_eq!(v["moeflux_synth"]["preset"], "test");
    }
    check_deterministic(
        small_of("qwen3-30b-a3b"),
        &["model.layers.2.self_attn.q_norm.weight"],
    );
}

/// glm-4.6 and glm-4.5-air at small widths: a glm4_moe directory with the
/// preset's dense first layers, q/k/v biases (small, not constant, BF16),
/// q/k norms of ones only where `use_qk_norm`, the noaux_tc router 8-bit
/// with an F32 correction bias of zeros, ungated shared experts, GLM's
/// routed scaling and half rotary; validates against the schema;
/// deterministic bytes, truncation a prefix.
#[test]
fn glm4_moe_synth_validates() {
    for (name, dense, qk_norm, scaling) in
        [("glm-4.6", 3, true, 2.5), ("glm-4.5-air", 1, false, 1.0)]
    {
        let t = tempfile::tempdir().unwrap();
        let dir = make_spec(&t.path().join("m"), small_of(name), |o| {
            o.router_skew = Some(RouterSkew::Zipf(1.0));
        });
        let (cfg, m) = check_synth_dir(&dir);
        assert_eq!(cfg.arch, moeflux::Architecture::Glm4Moe);
        assert_eq!(cfg.num_layers, dense + 2);
        assert_eq!(
            (
                cfg.attention.qk_norm,
                cfg.attention.qkv_bias,
                cfg.attention.output_gate
            ),
            (qk_norm, true, false),
            "{name}"
        );
        assert_eq!(cfg.rope.rotary_dim, 32);
        assert_eq!(
            cfg.moe.router,
            moeflux::config::RouterKind::NoauxTc {
                n_group: 1,
                topk_group: 1,
                routed_scaling_factor: scaling
            }
        );
        assert_eq!(cfg.eos_token_ids, [151_329, 151_336, 151_338]);
        assert_eq!(
            m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(),
            [dense, dense + 1]
        );
        for l in 0..dense {
            assert!(m
                .tensors
                .contains_key(&format!("model.layers.{l}.mlp.down_proj.weight")));
        }
        for l in 0..cfg.num_layers {
            let a = format!("model.layers.{l}.self_attn.");
            for (p, rows) in [("q_proj", 256), ("k_proj", 128), ("v_proj", 128)] {
                let n = format!("{a}{p}.bias");
                assert_eq!(m.tensors[&n].dtype, "BF16");
                let v = floats(&dir, &n);
                assert_eq!(v.len(), rows);
                assert!(v.iter().all(|x| x.abs() <= 0.25), "{n}");
                let mean_sq = v.iter().map(|x| x * x).sum::<f32>() / rows as f32;
                assert!((0.01..0.04).contains(&mean_sq), "{n}: {mean_sq}");
            }
            assert_eq!(
                m.tensors.contains_key(&format!("{a}q_norm.weight")),
                qk_norm
            );
            if qk_norm {
                assert_eq!(floats(&dir, &format!("{a}k_norm.weight")), vec![1.0; 64]);
            }
        }
        for l in dense..dense + 2 {
            let b = format!("model.layers.{l}.mlp.gate.e_score_correction_bias");
            assert_eq!(m.tensors[&b].dtype, "F32");
            assert_eq!(floats(&dir, &b), vec![0.0; 32]);
            assert_eq!(
                m.quantized[&format!("model.layers.{l}.mlp.shared_experts.down_proj")].bits,
                4
            );
        }
        // Two layers' biases differ (seeded by name).
        assert!(
            floats(&dir, "model.layers.0.self_attn.q_proj.bias")
                != floats(&dir, "model.layers.1.self_attn.q_proj.bias")
        );
    }
    check_deterministic(
        small_of("glm-4.6"),
        &[
            "model.layers.3.self_attn.v_proj.bias",
            "model.layers.3.mlp.gate.e_score_correction_bias",
        ],
    );
}

/// gpt-oss at small widths: MXFP4 experts by default (the release's
/// format), affine when asked; either opens and gives unit-order logits.
#[test]
fn gpt_oss_synth_mxfp4_experts_open_with_sane_logits() {
    let SynthSpec::GptOss(real) = find_preset("gpt-oss-20b").unwrap().spec else {
        panic!("gpt-oss-20b is a gpt_oss preset")
    };
    let spec = SynthSpec::GptOss(moeflux::synth::GptOssShape {
        hidden_size: 256,
        num_layers: 4,
        num_attention_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        vocab_size: 512,
        num_experts: 16,
        experts_per_token: 4,
        intermediate_size: 128,
        sliding_window: 8,
        ..real
    });
    let t = tempfile::tempdir().unwrap();
    for mxfp4 in [true, false] {
        let dir = make_spec(&t.path().join(format!("m{mxfp4}")), spec.clone(), |o| {
            assert!(o.expert_mxfp4, "gpt-oss defaults to MXFP4 experts");
            o.expert_mxfp4 = mxfp4;
            o.router_skew = Some(RouterSkew::Zipf(1.0));
        });
        let m = Manifest::read(&dir.join("moeflux.json")).unwrap();
        for c in m.experts.iter().flat_map(|l| &l.components) {
            assert_eq!(c.quant.is_mxfp4(), mxfp4);
            assert_eq!(c.biases.is_none(), mxfp4);
        }
        let cfg = moeflux::ModelConfig::from_dir(&dir).unwrap();
        let q = cfg.quantization.as_ref().unwrap();
        let gate = q
            .for_module("model.layers.0.mlp.experts.gate_proj")
            .unwrap();
        assert_eq!(gate.is_mxfp4(), mxfp4);
        let mut s = Session::open(&dir, SessionOptions::default()).unwrap();
        let tokens: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 512).collect();
        assert_sane_logits(
            &s.eval(&tokens, LogitsMode::All).unwrap(),
            &format!("mxfp4 {mxfp4}"),
        );
    }
}
