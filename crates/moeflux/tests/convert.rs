//! `moeflux::convert` on the golden fixtures (tests/fixtures, see its README):
//! layout and consistency of the model directory, byte equality of experts
//! with the source, HF -> moeflux == mlx_lm.convert -> moeflux, the flash-moe
//! 2-bit re-quantization, and one test per bad input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use moeflux::config::ModelConfig;
use moeflux::convert::dropped::DroppedKind;
use moeflux::convert::{
    convert, ConvertOptions, ConvertProgress, ConvertReport, ConvertStage, SourceKind,
};
use moeflux::format::{Manifest, COMPONENT_ALIGN, DENSE_FILE, EXPERT_ALIGN, MANIFEST_FILE};
use moeflux::model::schema::{self, WeightKind};
use moeflux::quant::affine;
use moeflux::Error;
use safetensors::SafeTensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn fixture(name: &str) -> PathBuf {
    fixtures().join(name)
}

fn opts<'a>() -> ConvertOptions<'a> {
    ConvertOptions::default()
}

/// Converts into a fresh temp dir; returns (tempdir guard, dst).
fn convert_fixture(src: &Path, o: &ConvertOptions) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("model");
    convert(src, &dst, o).unwrap_or_else(|e| panic!("convert {}: {e}", src.display()));
    (t, dst)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// Every entry of a directory (names), sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Checks the whole directory against the schema and its own manifest.
fn check_model_dir(dst: &Path) -> Manifest {
    let m = Manifest::read(&dst.join(MANIFEST_FILE)).unwrap();
    let cfg = ModelConfig::from_dir(dst).unwrap();
    assert_eq!(m.architecture, cfg.arch.model_type());
    let dense = std::fs::read(dst.join(&m.dense_file)).unwrap();
    let st = SafeTensors::deserialize(&dense).unwrap();
    assert_eq!(
        st.len(),
        m.tensors.len(),
        "dense file and manifest disagree"
    );
    let base = dense.as_ptr() as usize;
    for (name, t) in &m.tensors {
        let v = st.tensor(name).unwrap();
        assert_eq!(format!("{:?}", v.dtype()), t.dtype, "{name}");
        assert!(matches!(t.dtype.as_str(), "U32" | "BF16" | "F32"), "{name}");
        assert_eq!(v.shape(), t.shape.as_slice(), "{name}");
        let off = v.data().as_ptr() as usize - base;
        assert_eq!(off as u64, t.offset, "{name}");
        assert_eq!(v.data().len() as u64, t.bytes, "{name}");
        assert!(t.offset + t.bytes <= dense.len() as u64);
        let es = if t.dtype == "BF16" { 2 } else { 4 };
        assert_eq!(t.offset % es, 0, "{name} not naturally aligned");
    }
    let (_, meta) = SafeTensors::read_metadata(&dense).unwrap();
    assert_eq!(meta.metadata().as_ref().unwrap()["format"], "moeflux");

    // Every schema tensor is there, with the right shape.
    for w in schema::dense_weights(&cfg) {
        match w.kind {
            WeightKind::Linear { rows, cols } => {
                let wt = &m.tensors[&format!("{}.weight", w.name)];
                match m.quantized.get(&w.name) {
                    Some(q) => {
                        assert_eq!(wt.dtype, "U32");
                        assert_eq!(wt.shape, [rows, affine::words_per_row(cols, q.bits)]);
                        for p in ["scales", "biases"] {
                            let s = &m.tensors[&format!("{}.{p}", w.name)];
                            assert_eq!(s.shape, [rows, cols / q.group_size], "{}", w.name);
                        }
                    }
                    None => assert_eq!(wt.shape, [rows, cols], "{}", w.name),
                }
            }
            WeightKind::Vector { len } => assert_eq!(m.tensors[&w.name].shape, [len]),
            WeightKind::Conv { channels, kernel } => {
                assert_eq!(m.tensors[&w.name].shape, [channels, kernel, 1])
            }
            WeightKind::Table { rows, cols } => {
                assert_eq!(m.tensors[&w.name].shape, [rows, cols])
            }
        }
    }

    // Expert files.
    let specs = schema::expert_weights(&cfg);
    assert_eq!(m.experts.len(), specs.len());
    for (el, s) in m.experts.iter().zip(&specs) {
        assert_eq!(el.layer, s.layer);
        assert_eq!(el.num_experts, cfg.moe.num_experts);
        assert_eq!(el.stride % EXPERT_ALIGN as u64, 0);
        assert!(el.expert_bytes > 0 && el.expert_bytes <= el.stride);
        assert!(el.stride - el.expert_bytes < EXPERT_ALIGN as u64);
        let len = std::fs::metadata(dst.join(&el.file)).unwrap().len();
        assert_eq!(len, el.num_experts as u64 * el.stride, "{}", el.file);
        let mut end = 0;
        for (c, (name, rows, cols)) in el.components.iter().zip(s.projections) {
            assert_eq!((c.name.as_str(), c.rows, c.cols), (name, rows, cols));
            let wb = (rows * affine::words_per_row(cols, c.quant.bits) * 4) as u64;
            let sb = (rows * cols / c.quant.group_size) as u64
                * match c.scales.dtype.as_str() {
                    "F32" => 4,
                    "BF16" => 2,
                    _ => 1,
                };
            let mut parts = vec![(&c.weight, wb), (&c.scales, sb)];
            parts.extend(c.biases.as_ref().map(|b| (b, sb)));
            for (r, bytes) in parts {
                assert_eq!(r.offset % COMPONENT_ALIGN as u64, 0);
                assert!(r.offset >= end, "pieces overlap");
                assert_eq!(r.bytes, bytes);
                end = r.offset + r.bytes;
            }
            assert_eq!(c.weight.dtype, "U32");
            match &c.biases {
                Some(b) => assert_eq!(c.scales.dtype, b.dtype),
                None => {
                    assert_eq!(c.quant, moeflux::config::QuantSpec::MXFP4);
                    assert_eq!(c.scales.dtype, "U8");
                }
            }
        }
        assert_eq!(end, el.expert_bytes);
        // Padding is zero.
        let data = std::fs::read(dst.join(&el.file)).unwrap();
        for e in 0..el.num_experts {
            let ext = &data[e * el.stride as usize..(e + 1) * el.stride as usize];
            assert!(ext[el.expert_bytes as usize..].iter().all(|&b| b == 0));
        }
    }
    // No leftovers of the atomic write beside the directory.
    let parent = dst.parent().unwrap();
    assert!(
        listing(parent).iter().all(|n| !n.starts_with('.')),
        "temporary files left in {}",
        parent.display()
    );
    m
}

struct SrcFile {
    bytes: Vec<u8>,
}

impl SrcFile {
    fn open(p: &Path) -> Self {
        SrcFile {
            bytes: std::fs::read(p).unwrap(),
        }
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).unwrap()
    }
}

/// Expert e's bytes in the layer file equal slice e of the stacked source tensors.
fn check_experts_equal_source(dst: &Path, m: &Manifest, src_file: &Path, prefix: &str) {
    let src = SrcFile::open(src_file);
    let st = src.st();
    for el in &m.experts {
        let data = std::fs::read(dst.join(&el.file)).unwrap();
        for c in &el.components {
            let mut parts = vec![("weight", &c.weight), ("scales", &c.scales)];
            parts.extend(c.biases.as_ref().map(|b| ("biases", b)));
            for (part, r) in parts {
                let name = format!(
                    "{prefix}model.layers.{}.mlp.switch_mlp.{}.{part}",
                    el.layer, c.name
                );
                // gpt-oss's mlx-lm name for the stacked experts.
                let name = match st.tensor(&name) {
                    Ok(_) => name,
                    Err(_) => name.replace(".mlp.switch_mlp.", ".mlp.experts."),
                };
                let v = st.tensor(&name).unwrap();
                assert_eq!(v.shape()[0], el.num_experts);
                let per = v.data().len() / el.num_experts;
                assert_eq!(per as u64, r.bytes, "{name}");
                for e in 0..el.num_experts {
                    let at = e * el.stride as usize + r.offset as usize;
                    assert_eq!(
                        &data[at..at + per],
                        &v.data()[e * per..(e + 1) * per],
                        "{name} expert {e}"
                    );
                }
            }
        }
    }
}

/// Every dense tensor of the manifest equals the source tensor (prefix added).
fn check_dense_equal_source(dst: &Path, m: &Manifest, src_file: &Path, prefix: &str) {
    let src = SrcFile::open(src_file);
    let st = src.st();
    let dense = std::fs::read(dst.join(DENSE_FILE)).unwrap();
    for (name, t) in &m.tensors {
        let v = st.tensor(&format!("{prefix}{name}")).unwrap();
        assert_eq!(format!("{:?}", v.dtype()), t.dtype);
        assert_eq!(
            &dense[t.offset as usize..(t.offset + t.bytes) as usize],
            v.data(),
            "{name}"
        );
    }
}

fn check_mlx_fixture(name: &str, prefix: &str, bits: u32) {
    let (_t, dst, m) = check_mlx_source(name, prefix, bits);
    // Routers stay 8-bit.
    assert_eq!(m.quantized["model.layers.0.mlp.gate"].bits, 8);
    // The engine accepts the directory.
    moeflux::Session::open(&dst, Default::default()).unwrap();
}

/// Converts the mlx-lm checkpoint `<name>/src`: the directory validates, its
/// dense tensors and experts are the source's bytes (names under
/// `prefix`), config and tokenizer are copied verbatim.
fn check_mlx_source(name: &str, prefix: &str, bits: u32) -> (tempfile::TempDir, PathBuf, Manifest) {
    let src = fixture(name).join("src");
    let (t, dst) = convert_fixture(&src, &opts());
    let m = check_model_dir(&dst);
    assert_eq!(m.source.kind, "mlx");
    assert_eq!(m.source.expert_bits, Some(bits));
    assert_eq!(m.source.expert_requantization, None);
    let st = src.join("model.safetensors");
    check_dense_equal_source(&dst, &m, &st, prefix);
    check_experts_equal_source(&dst, &m, &st, prefix);
    // config and tokenizer copied verbatim.
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(src.join(f)).unwrap(),
            std::fs::read(dst.join(f)).unwrap(),
            "{f}"
        );
    }
    (t, dst, m)
}

/// The dense tensors are exactly the schema's: every schema tensor (a
/// quantized linear as `.weight` + `.scales` + `.biases`, an unquantized one
/// as `.weight`, vectors by name) and nothing else; vectors are BF16 but
/// the router's correction bias (F32) and `A_log` (either); expert files
/// for exactly the MoE layers.
fn check_exact_schema(dst: &Path, m: &Manifest) {
    let cfg = ModelConfig::from_dir(dst).unwrap();
    let mut want = std::collections::BTreeSet::new();
    for w in schema::dense_weights(&cfg) {
        match w.kind {
            WeightKind::Linear { .. } if m.quantized.contains_key(&w.name) => {
                for p in ["weight", "scales", "biases"] {
                    want.insert(format!("{}.{p}", w.name));
                }
            }
            WeightKind::Linear { .. } => {
                want.insert(format!("{}.weight", w.name));
            }
            WeightKind::Vector { .. } => {
                let t = &m.tensors[&w.name];
                let dtype = if w.name.ends_with("e_score_correction_bias") {
                    "F32"
                } else {
                    "BF16"
                };
                // A_log: F32 in qwen3_5, BF16 in qwen3_next checkpoints.
                if !w.name.ends_with("A_log") {
                    assert_eq!(t.dtype, dtype, "{}", w.name);
                }
                want.insert(w.name);
            }
            WeightKind::Conv { .. } | WeightKind::Table { .. } => {
                want.insert(w.name);
            }
        }
    }
    let have: std::collections::BTreeSet<String> = m.tensors.keys().cloned().collect();
    assert_eq!(
        have.difference(&want).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "tensors the schema does not name"
    );
    assert_eq!(
        want.difference(&have).collect::<Vec<_>>(),
        Vec::<&String>::new(),
        "schema tensors missing"
    );
    let moe: Vec<usize> = (0..cfg.num_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    assert_eq!(
        m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(),
        moe,
        "expert files"
    );
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}.mlp.");
        assert_eq!(
            m.tensors.contains_key(&format!("{p}gate_proj.weight")),
            !cfg.is_moe_layer(l),
            "layer {l}: dense MLP"
        );
        let f = dst.join(format!("experts/layer_{l:03}.bin"));
        assert_eq!(f.exists(), cfg.is_moe_layer(l), "{}", f.display());
    }
}

/// The unquantized router of `noaux_tc` (GLM, Kimi): a BF16 `[E, H]`
/// weight, not in `quantized`, and its F32 `[E]` correction bias.
fn check_noaux_router(m: &Manifest, layer: usize, experts: usize, hidden: usize) {
    let g = format!("model.layers.{layer}.mlp.gate");
    assert!(!m.quantized.contains_key(&g), "{g} quantized");
    let w = &m.tensors[&format!("{g}.weight")];
    assert_eq!(
        (w.dtype.as_str(), w.shape.as_slice()),
        ("BF16", &[experts, hidden][..])
    );
    assert!(!m.tensors.contains_key(&format!("{g}.scales")));
    let b = &m.tensors[&format!("{g}.e_score_correction_bias")];
    assert_eq!(
        (b.dtype.as_str(), b.shape.as_slice()),
        ("F32", &[experts][..])
    );
}

/// GLM's attention biases: `{q,k,v}_proj.bias` BF16 `[rows]`, unquantized,
/// beside the quantized projection's `.weight`/`.scales`/`.biases`.
fn check_qkv_bias(m: &Manifest, layer: usize, q_rows: usize, kv_rows: usize) {
    for (p, rows) in [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)] {
        let module = format!("model.layers.{layer}.self_attn.{p}");
        let b = &m.tensors[&format!("{module}.bias")];
        assert_eq!(
            (b.dtype.as_str(), b.shape.as_slice()),
            ("BF16", &[rows][..]),
            "{module}"
        );
        assert_eq!(m.quantized[&module].bits, 4, "{module}");
        assert_eq!(m.tensors[&format!("{module}.biases")].shape[0], rows);
        assert!(!m.quantized.contains_key(&format!("{module}.bias")));
    }
    assert!(!m
        .tensors
        .contains_key(&format!("model.layers.{layer}.self_attn.o_proj.bias")));
}

/// The checkpoint tensor names of an HF fixture (its index's weight map).
fn source_names(name: &str) -> Vec<String> {
    let p = fixture(name).join("src/model.safetensors.index.json");
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    v["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect()
}

#[test]
fn mlx_qwen35moe_q4() {
    check_mlx_fixture("qwen35moe-q4", "language_model.", 4);
}

#[test]
fn mlx_qwen35moe_q8() {
    check_mlx_fixture("qwen35moe-q8", "language_model.", 8);
}

#[test]
fn mlx_qwen35moe_q2() {
    check_mlx_fixture("qwen35moe-q2", "language_model.", 2);
}

#[test]
fn mlx_qwen3next_q4() {
    check_mlx_fixture("qwen3next-q4", "", 4);
    // Tied embeddings: no lm_head; layer 2 is a dense MLP without expert file.
    let (_t, dst) = convert_fixture(&fixture("qwen3next-q4/src"), &opts());
    let m = Manifest::read(&dst.join(MANIFEST_FILE)).unwrap();
    assert!(!m.tensors.keys().any(|k| k.starts_with("lm_head")));
    assert!(m.expert_layer(2).is_none());
    assert!(m
        .tensors
        .contains_key("model.layers.2.mlp.gate_proj.weight"));
    assert!(!dst.join("experts/layer_002.bin").exists());
}

/// HF -> moeflux equals mlx_lm.convert(HF) -> moeflux, byte for byte.
fn check_hf_equals_mlx(name: &str) {
    let (_t, from_hf, _) = hf_equals_mlx(name);
    moeflux::Session::open(&from_hf, Default::default()).unwrap();
}

/// HF -> moeflux equals mlx_lm.convert(HF) -> moeflux, byte for byte (dense
/// file, expert files, manifest, config.json); returns the conversion of
/// the HF source and its report. Needs no forward pass.
fn hf_equals_mlx(name: &str) -> (tempfile::TempDir, PathBuf, ConvertReport) {
    let t1 = tempfile::tempdir().unwrap();
    let from_hf = t1.path().join("model");
    let report = convert(&fixture(name).join("src"), &from_hf, &opts())
        .unwrap_or_else(|e| panic!("convert {name}/src: {e}"));
    let (_t2, from_mlx) = convert_fixture(&fixture(name).join("expected_mlx"), &opts());
    let a = check_model_dir(&from_hf);
    let b = check_model_dir(&from_mlx);
    assert_eq!(a.source.kind, "unquantized");
    assert_eq!(b.source.kind, "mlx");
    assert_eq!(
        a.tensors.keys().collect::<Vec<_>>(),
        b.tensors.keys().collect::<Vec<_>>()
    );
    let da = std::fs::read(from_hf.join(DENSE_FILE)).unwrap();
    let db = std::fs::read(from_mlx.join(DENSE_FILE)).unwrap();
    for (n, ta) in &a.tensors {
        let tb = &b.tensors[n];
        assert_eq!((&ta.dtype, &ta.shape), (&tb.dtype, &tb.shape), "{n}");
        assert!(
            da[ta.offset as usize..(ta.offset + ta.bytes) as usize]
                == db[tb.offset as usize..(tb.offset + tb.bytes) as usize],
            "{name}: dense tensor {n} differs"
        );
    }
    assert!(da == db, "{name}: dense.safetensors differs");
    assert_eq!(a.quantized, b.quantized);
    assert_eq!(a.experts, b.experts);
    for el in &a.experts {
        assert!(
            std::fs::read(from_hf.join(&el.file)).unwrap()
                == std::fs::read(from_mlx.join(&el.file)).unwrap(),
            "{name}: {} differs",
            el.file
        );
    }
    // The written config declares what mlx-lm's does.
    let qa = ModelConfig::from_dir(&from_hf)
        .unwrap()
        .quantization
        .unwrap();
    let qb = ModelConfig::from_dir(&from_mlx)
        .unwrap()
        .quantization
        .unwrap();
    assert_eq!(qa, qb);
    // Whole config.json as mlx-lm writes it (eos from generation_config.json,
    // no vision_config), but for mlx-lm renaming rope_type to type in place.
    let read = |p: &Path| -> serde_json::Value {
        let t = std::fs::read_to_string(p.join("config.json")).unwrap();
        serde_json::from_str(&t.replace("\"rope_type\"", "\"type\"")).unwrap()
    };
    assert_eq!(read(&from_hf), read(&fixture(name).join("expected_mlx")));
    // The same model either way: the mlx_lm.convert output's own manifest
    // matches the schema exactly too.
    check_exact_schema(&from_mlx, &b);
    check_exact_schema(&from_hf, &a);
    (t1, from_hf, report)
}

#[test]
fn hf_qwen35moe_equals_mlx_convert() {
    check_hf_equals_mlx("qwen35moe-hf");
}

#[test]
fn hf_gpt_oss_mxfp4_equals_mlx_convert() {
    check_hf_equals_mlx("gptoss-hf");
}

#[test]
fn mxfp4_experts_are_never_requantized() {
    for src in ["gptoss-mxfp4/src", "gptoss-hf/src"] {
        for bits in [2, 4, 8] {
            let o = ConvertOptions {
                expert_bits: Some(bits),
                ..opts()
            };
            let e = convert_err(&fixture(src), &o).to_string();
            assert!(
                e.contains("MXFP4 experts are kept as released")
                    && e.contains(&format!("--expert-bits {bits}")),
                "{src}: {e}"
            );
        }
    }
}

/// Affine experts (with biases) that config.json calls MXFP4: a clear error
/// naming the biases, not a conversion that cannot hold them.
#[test]
fn experts_with_biases_declared_mxfp4_are_refused() {
    let t = tempfile::tempdir().unwrap();
    copy_dir(&fixture("gptoss-q4/src"), t.path());
    let cfg = t.path().join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let mx = serde_json::json!({"group_size": 32, "bits": 4, "mode": "mxfp4"});
    for key in ["quantization", "quantization_config"] {
        if let Some(q) = v.get_mut(key) {
            q["model.layers.0.mlp.experts.gate_proj"] = mx.clone();
        }
    }
    std::fs::write(&cfg, v.to_string()).unwrap();
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(
        e.contains("model.layers.0.mlp.experts.gate_proj.biases") && e.contains("MXFP4"),
        "{e}"
    );
}

#[test]
fn mxfp4_experts_copied_bit_for_bit() {
    let src = fixture("gptoss-mxfp4/src");
    let (_t, dst) = convert_fixture(&src, &opts());
    let m = check_model_dir(&dst);
    assert!(m
        .experts
        .iter()
        .flat_map(|l| &l.components)
        .all(|c| c.biases.is_none()));
    check_experts_equal_source(&dst, &m, &src.join("model.safetensors"), "");
}

#[test]
fn hf_qwen3next_equals_mlx_convert() {
    check_hf_equals_mlx("qwen3next-hf");
}

#[test]
fn hf_drops_known_extras() {
    let t = tempfile::tempdir().unwrap();
    let r = convert(&fixture("qwen35moe-hf/src"), &t.path().join("m"), &opts()).unwrap();
    assert_eq!(r.source_kind, SourceKind::Unquantized);
    assert!(
        r.dropped.iter().any(|d| d.starts_with("mtp.")),
        "{:?}",
        r.dropped
    );
    assert!(r.dropped.iter().any(|d| d.starts_with("model.visual")));
    assert_eq!(
        r.dropped_summary().unwrap(),
        "skipped 2 tensors: multi-token-prediction module (1), vision tower (1)"
    );

    // DeepSeek-V3's MTP layer is numbered past the model's layers.
    let r = convert(
        &fixture("deepseekv3-fp8/src"),
        &t.path().join("ds"),
        &opts(),
    )
    .unwrap();
    let groups = r.dropped_groups();
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(groups[0].kind, DroppedKind::MtpLayer(61));
    assert!(groups[0]
        .tensors
        .contains(&"model.layers.61.eh_proj.weight".to_string()));
}

#[test]
fn expert_bits_2_reproduces_flash_moe() {
    let o = ConvertOptions {
        expert_bits: Some(2),
        ..opts()
    };
    let (_t, dst) = convert_fixture(&fixture("qwen35moe-q4/src"), &o);
    let m = check_model_dir(&dst);
    assert_eq!(m.source.expert_bits, Some(4));
    assert!(m
        .source
        .expert_requantization
        .as_deref()
        .unwrap()
        .contains("2-bit"));
    let want = SrcFile::open(&fixture("qwen35moe-q4-e2/layer0_experts_2bit.safetensors"));
    let st = want.st();
    let el = m.expert_layer(0).unwrap();
    let data = std::fs::read(dst.join(&el.file)).unwrap();
    for c in &el.components {
        assert_eq!(c.quant.bits, 2);
        let biases = c.biases.as_ref().unwrap();
        for (part, r) in [
            ("weight", &c.weight),
            ("scales", &c.scales),
            ("biases", biases),
        ] {
            let v = st.tensor(&format!("{}.{part}", c.name)).unwrap();
            let per = v.data().len() / el.num_experts;
            assert_eq!(per as u64, r.bytes);
            for e in 0..el.num_experts {
                let at = e * el.stride as usize + r.offset as usize;
                assert!(
                    data[at..at + per] == v.data()[e * per..(e + 1) * per],
                    "{}.{part} expert {e} differs",
                    c.name
                );
            }
        }
    }
    // Dense tensors untouched; config.json names the 2-bit experts.
    check_dense_equal_source(
        &dst,
        &m,
        &fixture("qwen35moe-q4/src/model.safetensors"),
        "language_model.",
    );
    let q = ModelConfig::from_dir(&dst).unwrap().quantization.unwrap();
    assert_eq!(
        q.for_module("model.layers.3.mlp.switch_mlp.down_proj")
            .unwrap()
            .bits,
        2
    );
    assert_eq!(q.for_module("model.layers.3.mlp.gate").unwrap().bits, 8);
    moeflux::Session::open(&dst, Default::default()).unwrap();
}

/// 4 -> 8 bits re-quantizes with MLX's algorithm: the 8-bit experts
/// reproduce the 4-bit values to within half an 8-bit step plus the bf16
/// rounding of the new scales and biases.
#[test]
fn expert_bits_8_from_4() {
    let o = ConvertOptions {
        expert_bits: Some(8),
        ..opts()
    };
    let (_t, dst) = convert_fixture(&fixture("qwen35moe-q4/src"), &o);
    let m = check_model_dir(&dst);
    assert!(m.source.expert_requantization.is_some());
    let src = SrcFile::open(&fixture("qwen35moe-q4/src/model.safetensors"));
    let st = src.st();
    let el = m.expert_layer(0).unwrap();
    let data = std::fs::read(dst.join(&el.file)).unwrap();
    let c = el.component("down_proj").unwrap();
    assert_eq!(c.quant.bits, 8);
    let p = "language_model.model.layers.0.mlp.switch_mlp.down_proj";
    let get = |n: &str| st.tensor(&format!("{p}.{n}")).unwrap();
    let (w4, s4, b4) = (get("weight"), get("scales"), get("biases"));
    let bf = |b: &[u8], i: usize| affine::bf16_to_f32(u16::from_le_bytes([b[2 * i], b[2 * i + 1]]));
    let e = 3;
    let ext = &data[e * el.stride as usize..];
    let words = |b: &[u8]| -> Vec<u32> {
        b.chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let (rows, cols) = (c.rows, c.cols);
    let g = cols / 64;
    let w4e = words(&w4.data()[e * w4.data().len() / 16..(e + 1) * w4.data().len() / 16]);
    let w8e = words(&ext[c.weight.offset as usize..(c.weight.offset + c.weight.bytes) as usize]);
    let s4e = &s4.data()[e * rows * g * 2..];
    let b4e = &b4.data()[e * rows * g * 2..];
    let s8e = &ext[c.scales.offset as usize..];
    let b8e = &ext[c.biases.as_ref().unwrap().offset as usize..];
    for r in 0..rows {
        for j in 0..cols {
            let gi = r * g + j / 64;
            let x4 =
                affine::unpack_code(&w4e[r * cols / 8..], j, 4) as f32 * bf(s4e, gi) + bf(b4e, gi);
            let s8 = bf(s8e, gi);
            let b8 = bf(b8e, gi);
            let x8 = affine::unpack_code(&w8e[r * cols / 4..], j, 8) as f32 * s8 + b8;
            // Half a step, plus the bf16 rounding of scale (x255) and bias.
            let tol = s8.abs() * (0.5 + 255.0 / 256.0) + b8.abs() / 256.0 + 1e-6;
            assert!((x4 - x8).abs() <= tol, "r{r} j{j}: {x4} vs {x8}");
        }
    }
}

#[test]
fn progress_reports_all_bytes() {
    let seen: Mutex<Vec<ConvertProgress>> = Mutex::new(Vec::new());
    let cb = |p: &ConvertProgress| seen.lock().unwrap().push(p.clone());
    let o = ConvertOptions {
        progress: Some(&cb),
        ..opts()
    };
    let (_t, dst) = convert_fixture(&fixture("qwen35moe-q4/src"), &o);
    let m = Manifest::read(&dst.join(MANIFEST_FILE)).unwrap();
    let seen = seen.into_inner().unwrap();
    let last = seen.last().unwrap();
    let dense_len = std::fs::metadata(dst.join(DENSE_FILE)).unwrap().len();
    assert_eq!(last.bytes_total, dense_len + m.expert_bytes());
    assert_eq!(last.bytes_done, last.bytes_total);
    assert_eq!(last.moe_layers_total, 4);
    assert!(seen
        .iter()
        .any(|p| p.stage == ConvertStage::Experts && p.layer == Some(3)));
    assert_eq!(last.stage, ConvertStage::Finishing);
}

// ---------------------------------------------------------------- bad input

/// Runs a conversion expected to fail; checks nothing was left behind.
fn convert_err(src: &Path, o: &ConvertOptions) -> Error {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("out");
    let e = convert(src, &dst, o).expect_err("conversion should fail");
    assert!(!dst.exists(), "destination created by a failed conversion");
    assert!(
        listing(t.path()).is_empty(),
        "left behind: {:?}",
        listing(t.path())
    );
    e
}

/// A copy of the qwen35moe-q4 source whose single shard is rewritten by `edit`
/// (name -> (dtype, shape, bytes)); the index is removed.
fn edited_q4(
    edit: impl FnOnce(&mut BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) -> tempfile::TempDir {
    let t = tempfile::tempdir().unwrap();
    copy_dir(&fixture("qwen35moe-q4/src"), t.path());
    std::fs::remove_file(t.path().join("model.safetensors.index.json")).unwrap();
    let f = SrcFile::open(&t.path().join("model.safetensors"));
    let mut map: BTreeMap<_, _> = f
        .st()
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut map);
    let views: Vec<(String, safetensors::tensor::TensorView)> = map
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &t.path().join("model.safetensors")).unwrap();
    t
}

#[test]
fn edited_source_without_changes_converts() {
    let t = edited_q4(|_| {});
    let (_o, dst) = convert_fixture(t.path(), &opts());
    check_model_dir(&dst);
}

/// Several `*.safetensors` without an index are read together.
#[test]
fn several_shards_without_index() {
    let t = tempfile::tempdir().unwrap();
    let fx = fixture("qwen35moe-q4/src");
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fx.join(f), t.path().join(f)).unwrap();
    }
    let f = SrcFile::open(&fx.join("model.safetensors"));
    let st = f.st();
    let mut parts: [Vec<(String, safetensors::tensor::TensorView)>; 2] = Default::default();
    for (i, (n, v)) in st.tensors().into_iter().enumerate() {
        parts[i % 2].push((n, v));
    }
    for (i, p) in parts.into_iter().enumerate() {
        let path = t.path().join(format!("part{i}.safetensors"));
        safetensors::serialize_to_file(p, None, &path).unwrap();
    }
    let (_o, dst) = convert_fixture(t.path(), &opts());
    let m = check_model_dir(&dst);
    check_dense_equal_source(&dst, &m, &fx.join("model.safetensors"), "language_model.");
    check_experts_equal_source(&dst, &m, &fx.join("model.safetensors"), "language_model.");
    // tokenizer_config.json was absent: not invented.
    assert!(!dst.join("tokenizer_config.json").exists());
}

#[test]
fn error_tensor_in_two_shards() {
    let t = tempfile::tempdir().unwrap();
    let fx = fixture("qwen35moe-q4/src");
    std::fs::copy(fx.join("config.json"), t.path().join("config.json")).unwrap();
    std::fs::copy(fx.join("model.safetensors"), t.path().join("a.safetensors")).unwrap();
    std::fs::copy(fx.join("model.safetensors"), t.path().join("b.safetensors")).unwrap();
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(
        e.contains("b.safetensors") && e.contains("also present in"),
        "{e}"
    );
}

#[test]
fn error_missing_config() {
    let t = tempfile::tempdir().unwrap();
    copy_dir(&fixture("qwen35moe-q4/src"), t.path());
    std::fs::remove_file(t.path().join("config.json")).unwrap();
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn error_missing_source_dir() {
    let e = convert_err(Path::new("/nonexistent/moeflux-src"), &opts()).to_string();
    assert!(e.contains("/nonexistent/moeflux-src"), "{e}");
}

#[test]
fn error_missing_shard() {
    let t = tempfile::tempdir().unwrap();
    copy_dir(&fixture("qwen35moe-hf/src"), t.path());
    std::fs::remove_file(t.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}

#[test]
fn error_truncated_shard() {
    let t = tempfile::tempdir().unwrap();
    copy_dir(&fixture("qwen35moe-q4/src"), t.path());
    let p = t.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn error_tensor_missing() {
    let t = edited_q4(|m| {
        m.remove("language_model.model.layers.2.linear_attn.dt_bias");
    });
    let e = convert_err(t.path(), &opts());
    assert!(matches!(e, Error::Tensor { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("model.layers.2.linear_attn.dt_bias") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn error_expert_tensor_missing() {
    let t = edited_q4(|m| {
        m.remove("language_model.model.layers.1.mlp.switch_mlp.up_proj.biases");
    });
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(
        e.contains("model.layers.1.mlp.switch_mlp.up_proj.biases") && e.contains("missing"),
        "{e}"
    );
}

#[test]
fn error_tensor_wrong_dtype() {
    let t = edited_q4(|m| {
        let v = m.get_mut("language_model.model.norm.weight").unwrap();
        v.0 = safetensors::Dtype::I16;
    });
    let e = convert_err(t.path(), &opts());
    assert!(matches!(e, Error::Tensor { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("language_model.model.norm.weight")
            && e.contains("I16")
            && e.contains("model.safetensors"),
        "{e}"
    );
}

#[test]
fn error_quantized_weight_wrong_dtype() {
    let t = edited_q4(|m| {
        let v = m
            .get_mut("language_model.model.layers.0.mlp.switch_mlp.gate_proj.weight")
            .unwrap();
        v.0 = safetensors::Dtype::F32;
    });
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(
        e.contains("switch_mlp.gate_proj.weight") && e.contains("U32"),
        "{e}"
    );
}

#[test]
fn error_tensor_wrong_shape() {
    let t = edited_q4(|m| {
        let v = m
            .get_mut("language_model.model.layers.3.self_attn.k_proj.scales")
            .unwrap();
        v.1 = vec![v.1[1], v.1[0]];
    });
    let e = convert_err(t.path(), &opts());
    assert!(matches!(e, Error::Tensor { .. }), "{e:?}");
    let e = e.to_string();
    assert!(
        e.contains("self_attn.k_proj.scales") && e.contains("shape"),
        "{e}"
    );
}

#[test]
fn error_unknown_tensor() {
    let t = edited_q4(|m| {
        m.insert(
            "language_model.model.layers.0.mystery.weight".into(),
            (safetensors::Dtype::BF16, vec![2], vec![0; 4]),
        );
    });
    let e = convert_err(t.path(), &opts()).to_string();
    assert!(e.contains("mystery"), "{e}");
}

#[test]
fn error_unsupported_model_type() {
    let t = tempfile::tempdir().unwrap();
    copy_dir(&fixture("qwen35moe-q4/src"), t.path());
    let p = t.path().join("config.json");
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("\"qwen3_5_moe\"", "\"llama\"");
    std::fs::write(&p, text).unwrap();
    let e = convert_err(t.path(), &opts());
    assert!(matches!(e, Error::UnsupportedModel { .. }), "{e:?}");
    assert!(e.to_string().contains("llama"));
}

#[test]
fn error_bad_expert_bits() {
    let o = ConvertOptions {
        expert_bits: Some(3),
        ..opts()
    };
    let e = convert_err(&fixture("qwen35moe-q4/src"), &o).to_string();
    assert!(e.contains("2, 4 or 8"), "{e}");
}

#[test]
fn destination_exists_and_force() {
    let t = tempfile::tempdir().unwrap();
    let dst = t.path().join("m");
    std::fs::create_dir(&dst).unwrap();
    std::fs::write(dst.join("marker"), b"old").unwrap();
    let src = fixture("qwen3next-q4/src");
    let e = convert(&src, &dst, &opts()).unwrap_err();
    assert!(matches!(e, Error::DestinationExists { .. }), "{e:?}");
    assert!(e.to_string().contains("--force"));
    assert_eq!(std::fs::read(dst.join("marker")).unwrap(), b"old");

    // A failing forced conversion leaves the old directory as it was.
    let bad = tempfile::tempdir().unwrap();
    copy_dir(&src, bad.path());
    std::fs::remove_file(bad.path().join("model.safetensors")).unwrap();
    let force = ConvertOptions {
        force: true,
        ..opts()
    };
    convert(bad.path(), &dst, &force).unwrap_err();
    assert_eq!(std::fs::read(dst.join("marker")).unwrap(), b"old");

    convert(&src, &dst, &force).unwrap();
    assert!(!dst.join("marker").exists());
    check_model_dir(&dst);
    assert_eq!(listing(t.path()), ["m"]);
}

#[test]
fn destination_containing_source_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    copy_dir(&fixture("qwen3next-q4/src"), &src);
    let force = ConvertOptions {
        force: true,
        ..opts()
    };
    let e = convert(&src, t.path(), &force).unwrap_err().to_string();
    assert!(e.contains("contains the source"), "{e}");
    let e = convert(&src, &src, &force).unwrap_err().to_string();
    assert!(e.contains("contains the source"), "{e}");
    assert!(src.join("model.safetensors").exists());
}

#[test]
fn cancelled_before_start_leaves_nothing() {
    let flag = AtomicBool::new(true);
    let o = ConvertOptions {
        cancel: Some(&flag),
        ..opts()
    };
    let e = convert_err(&fixture("qwen35moe-q4/src"), &o);
    assert!(matches!(e, Error::Cancelled), "{e:?}");
}

#[test]
fn cancelled_while_writing_leaves_nothing() {
    for stage in [ConvertStage::Dense, ConvertStage::Experts] {
        let flag = AtomicBool::new(false);
        let cb = |p: &ConvertProgress| {
            let trigger = match stage {
                ConvertStage::Experts => p.layer == Some(2),
                _ => p.bytes_done > 0,
            };
            if p.stage == stage && trigger {
                flag.store(true, Ordering::Relaxed);
            }
        };
        let o = ConvertOptions {
            cancel: Some(&flag),
            progress: Some(&cb),
            ..opts()
        };
        let e = convert_err(&fixture("qwen35moe-q4/src"), &o);
        assert!(matches!(e, Error::Cancelled), "{e:?}");
        assert!(flag.load(Ordering::Relaxed));
    }
}

// ------------------------------------------------------------ at scale

/// Deterministic filler (xorshift64*).
fn fill_random(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// Random bf16 values in [1, 2) (finite, so converted tensors stay sane).
fn bf16_random(n: usize, seed: u64) -> Vec<u8> {
    let mut b = vec![0u8; n * 2];
    fill_random(&mut b, seed);
    for c in b.chunks_exact_mut(2) {
        let m = u16::from_le_bytes([c[0], c[1]]) & 0x7f;
        c.copy_from_slice(&(0x3f80 | m).to_le_bytes());
    }
    b
}

/// A multi-shard mlx-lm style 4-bit checkpoint at real widths, random data,
/// built from the schema; converted and timed. Size grows with
/// MOEFLUX_LARGE_LAYERS (default 8 layers of 128 experts, about 2.7 GB);
/// MOEFLUX_LARGE_DIR picks where, MOEFLUX_LARGE_KEEP keeps it.
#[test]
#[ignore = "writes gigabytes; cargo test --release --test convert -- --ignored --nocapture"]
fn large_synthetic_mlx_checkpoint() {
    let layers: usize = std::env::var("MOEFLUX_LARGE_LAYERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let root = std::env::var("MOEFLUX_LARGE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let t = tempfile::tempdir_in(root).unwrap();
    let src = t.path().join("src");
    std::fs::create_dir(&src).unwrap();
    let config = serde_json::json!({
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": false,
        "quantization": {"group_size": 64, "bits": 4, "mode": "affine"},
        "text_config": {
            "hidden_size": 2048, "num_hidden_layers": layers, "full_attention_interval": 4,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
            "linear_num_value_heads": 32, "linear_num_key_heads": 16,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "shared_expert_intermediate_size": 768, "vocab_size": 65536,
            "rope_parameters": {"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        }
    });
    std::fs::write(src.join("config.json"), config.to_string()).unwrap();
    let cfg = ModelConfig::from_dir(&src).unwrap();

    type T = (safetensors::Dtype, Vec<usize>, Vec<u8>);
    let mut shards: Vec<BTreeMap<String, T>> = vec![BTreeMap::new(); layers + 1];
    let shard_of = |name: &str| -> usize {
        name.strip_prefix("model.layers.")
            .and_then(|s| s.split('.').next())
            .and_then(|l| l.parse::<usize>().ok())
            .map_or(layers, |l| l)
    };
    let mut seed = 1u64;
    let mut put = |name: String, dtype: safetensors::Dtype, shape: Vec<usize>| {
        seed += 1;
        let n: usize = shape.iter().product();
        let data = match dtype {
            safetensors::Dtype::BF16 => bf16_random(n, seed),
            _ => {
                let mut b = vec![0u8; n * 4];
                fill_random(&mut b, seed);
                if dtype == safetensors::Dtype::F32 {
                    for c in b.chunks_exact_mut(4) {
                        c.copy_from_slice(&(-1.5f32).to_le_bytes());
                    }
                }
                b
            }
        };
        let s = shard_of(&name);
        shards[s].insert(format!("language_model.{name}"), (dtype, shape, data));
    };
    use safetensors::Dtype::{BF16, F32, U32};
    for w in schema::dense_weights(&cfg) {
        match w.kind {
            WeightKind::Linear { rows, cols } => {
                put(format!("{}.weight", w.name), U32, vec![rows, cols / 8]);
                put(format!("{}.scales", w.name), BF16, vec![rows, cols / 64]);
                put(format!("{}.biases", w.name), BF16, vec![rows, cols / 64]);
            }
            WeightKind::Vector { len } if w.name.ends_with("A_log") => put(w.name, F32, vec![len]),
            WeightKind::Vector { len } => put(w.name, BF16, vec![len]),
            WeightKind::Conv { channels, kernel } => put(w.name, BF16, vec![channels, kernel, 1]),
            WeightKind::Table { rows, cols } => put(w.name, BF16, vec![rows, cols]),
        }
    }
    for s in schema::expert_weights(&cfg) {
        for (c, rows, cols) in s.projections {
            let m = s.module(c);
            put(
                format!("{m}.weight"),
                U32,
                vec![s.num_experts, rows, cols / 8],
            );
            put(
                format!("{m}.scales"),
                BF16,
                vec![s.num_experts, rows, cols / 64],
            );
            put(
                format!("{m}.biases"),
                BF16,
                vec![s.num_experts, rows, cols / 64],
            );
        }
    }
    let mut weight_map = serde_json::Map::new();
    let n = shards.len();
    for (i, sh) in shards.into_iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = sh
            .iter()
            .map(|(k, (d, s, b))| {
                weight_map.insert(k.clone(), file.clone().into());
                (
                    k.clone(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, &src.join(&file)).unwrap();
    }
    std::fs::write(
        src.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();

    let dst = t.path().join("model");
    let t0 = std::time::Instant::now();
    let r = convert(&src, &dst, &opts()).unwrap();
    let secs = t0.elapsed().as_secs_f64();
    let gb = (r.dense_bytes + r.expert_bytes) as f64 / 1e9;
    eprintln!(
        "converted {} layers: dense {:.2} GB, experts {:.2} GB in {secs:.2} s ({:.2} GB/s)",
        layers,
        r.dense_bytes as f64 / 1e9,
        r.expert_bytes as f64 / 1e9,
        gb / secs
    );
    let m = check_model_dir(&dst);
    // Spot-check experts of layer 0 against the source shard.
    check_experts_equal_source(
        &dst,
        &Manifest {
            experts: vec![m.experts[0].clone()],
            ..m.clone()
        },
        &src.join(format!("model-00001-of-{n:05}.safetensors")),
        "language_model.",
    );
    moeflux::Session::open(&dst, Default::default()).unwrap();

    // 2-bit re-quantization throughput.
    let dst2 = t.path().join("model2");
    let t0 = std::time::Instant::now();
    let o = ConvertOptions {
        expert_bits: Some(2),
        ..opts()
    };
    let r = convert(&src, &dst2, &o).unwrap();
    eprintln!(
        "--expert-bits 2: experts {:.2} GB in {:.2} s",
        r.expert_bytes as f64 / 1e9,
        t0.elapsed().as_secs_f64()
    );
    if std::env::var_os("MOEFLUX_LARGE_KEEP").is_some() {
        std::fs::remove_dir_all(&dst2).unwrap();
        eprintln!("kept {}", t.keep().display());
    }
}

/// HF FP8 e4m3 with 128x128 block scales (`weight_scale_inv`), unsplit
/// `kv_b_proj`, per-expert tensors and an MTP layer: bit-identical to what
/// the real `mlx_lm.convert` made of the same files (its sanitize decodes
/// the blocks to bf16 and splits kv_b_proj; then both quantize to 4 bits).
#[test]
fn hf_deepseek_v3_fp8_equals_mlx_convert() {
    check_hf_equals_mlx("deepseekv3-fp8");
}

/// The FP8 decoder against mlx's `mx.from_fp8` for all 256 e4m3 codes
/// (`deepseekv3-fp8/e4m3_table.npy`, written by make_deepseek_fixtures.py).
#[test]
fn e4m3_decode_matches_mlx_for_every_code() {
    let bytes = std::fs::read(fixture("deepseekv3-fp8").join("e4m3_table.npy")).unwrap();
    let table: Vec<f32> = npyz::NpyFile::new(&bytes[..]).unwrap().into_vec().unwrap();
    assert_eq!(table.len(), 256);
    for (code, &want) in table.iter().enumerate() {
        let got = moeflux::convert::fp8::e4m3_to_f32(code as u8);
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "code {code:#04x}: {got} vs mlx {want}"
        );
    }
}

/// An older mlx-lm checkpoint with `kv_b_proj` quantized unsplit: convert
/// dequantizes it in bf16, splits it and re-quantizes both halves exactly as
/// current mlx-lm's sanitize (`expected_split.safetensors`, [heads, rows, cols]).
#[test]
fn mlx_unsplit_quantized_kv_b_proj_matches_mlx_sanitize() {
    let fx = fixture("deepseekv3-legacy-q4");
    let (_t, dst) = convert_fixture(&fx.join("src"), &opts());
    let m = check_model_dir(&dst);
    let dense = std::fs::read(dst.join(DENSE_FILE)).unwrap();
    let exp_bytes = std::fs::read(fx.join("expected_split.safetensors")).unwrap();
    let exp = safetensors::SafeTensors::deserialize(&exp_bytes).unwrap();
    let mut n = 0;
    for (name, view) in exp.tensors() {
        let t = &m.tensors[&name];
        let s = view.shape();
        assert_eq!(t.shape, vec![s[0] * s[1], s[2]], "{name}");
        assert!(
            dense[t.offset as usize..(t.offset + t.bytes) as usize] == *view.data(),
            "{name} differs from mlx-lm's split"
        );
        n += 1;
    }
    assert_eq!(n, 12);
}

// ------------------------------------- qwen3_moe, glm4_moe, kimi_k25
//
// Their forward pass is not in this build yet, so these check the converted
// directories against the schema and mlx-lm's output, without running them.

/// Every quantized module is 4-bit g64 but `eight_bit` (8-bit g64).
fn check_quant_widths(m: &Manifest, eight_bit: &[String]) {
    for (module, q) in &m.quantized {
        let bits = if eight_bit.contains(module) { 8 } else { 4 };
        assert_eq!((q.bits, q.group_size), (bits, 64), "{module}");
    }
    for module in eight_bit {
        assert!(m.quantized.contains_key(module), "{module} not quantized");
    }
}

/// qwen3_moe, mlx-lm 4-bit: q/k norms, no biases, the softmax router as an
/// 8-bit quantized Linear in every MoE layer, layer 1 dense through
/// `mlp_only_layers` (no expert file), untied lm_head.
#[test]
fn mlx_qwen3moe_q4() {
    let (_t, dst, m) = check_mlx_source("qwen3moe-q4", "", 4);
    check_exact_schema(&dst, &m);
    let cfg = ModelConfig::from_dir(&dst).unwrap();
    assert_eq!(cfg.arch, moeflux::Architecture::Qwen3Moe);
    assert_eq!(m.architecture, "qwen3_moe");
    let moe = [0, 2, 3];
    assert_eq!(m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(), moe);
    assert!(m
        .tensors
        .contains_key("model.layers.1.mlp.down_proj.weight"));
    let routers: Vec<String> = moe
        .iter()
        .map(|l| format!("model.layers.{l}.mlp.gate"))
        .collect();
    check_quant_widths(&m, &routers);
    assert!(m.tensors.contains_key("model.layers.0.mlp.gate.biases"));
    for l in 0..4 {
        for n in ["q_norm", "k_norm"] {
            let t = &m.tensors[&format!("model.layers.{l}.self_attn.{n}.weight")];
            assert_eq!((t.dtype.as_str(), t.shape.as_slice()), ("BF16", &[32][..]));
        }
    }
    assert!(!m.tensors.keys().any(|k| k.ends_with(".bias")));
    assert!(!m.tensors.keys().any(|k| k.contains("shared_expert")));
    assert!(m.tensors.contains_key("lm_head.weight"));
    assert_eq!(m.experts[0].num_experts, 16);
}

/// glm4_moe, mlx-lm 4-bit with `use_qk_norm`: q/k/v `.bias` vectors next to
/// the quantization `.biases`, q/k norms, the BF16 `noaux_tc` router with its
/// F32 correction bias, ungated shared experts, layer 0 dense through
/// `first_k_dense_replace`.
#[test]
fn mlx_glm4moe_q4() {
    let (t, dst, m) = check_mlx_source("glm4moe-q4", "", 4);
    check_exact_schema(&dst, &m);
    let cfg = ModelConfig::from_dir(&dst).unwrap();
    assert_eq!(cfg.arch, moeflux::Architecture::Glm4Moe);
    assert!(cfg.attention.qkv_bias && cfg.attention.qk_norm);
    assert_eq!(
        m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    check_quant_widths(&m, &[]);
    for l in 0..4 {
        check_qkv_bias(&m, l, 4 * 32, 2 * 32);
        for n in ["q_norm", "k_norm"] {
            assert_eq!(
                m.tensors[&format!("model.layers.{l}.self_attn.{n}.weight")].shape,
                [32]
            );
        }
    }
    for l in 1..4 {
        check_noaux_router(&m, l, 16, 128);
        for p in ["gate_proj", "up_proj", "down_proj"] {
            let module = format!("model.layers.{l}.mlp.shared_experts.{p}");
            assert_eq!(m.quantized[&module].bits, 4, "{module}");
        }
        assert!(!m
            .tensors
            .contains_key(&format!("model.layers.{l}.mlp.shared_expert_gate.weight")));
    }
    assert!(m
        .tensors
        .contains_key("model.layers.0.mlp.gate_proj.weight"));
    assert!(!m.tensors.contains_key("model.layers.0.mlp.gate.weight"));
    // `num_nextn_predict_layers: 1` with no MTP tensors: nothing dropped.
    let r = convert(&fixture("glm4moe-q4/src"), &t.path().join("again"), &opts()).unwrap();
    assert!(r.dropped.is_empty(), "{:?}", r.dropped);
}

/// kimi_k25, mlx-lm 4-bit: the text model under `language_model.` (dropped
/// from the canonical names), MLA with split `embed_q`/`unembed_out`, the
/// BF16 router with its F32 bias, layer 0 dense.
#[test]
fn mlx_kimik25_q4() {
    let (_t, dst, m) = check_mlx_source("kimik25-q4", "language_model.", 4);
    check_exact_schema(&dst, &m);
    let cfg = ModelConfig::from_dir(&dst).unwrap();
    assert_eq!(cfg.arch, moeflux::Architecture::KimiK25);
    assert_eq!(m.architecture, "kimi_k25");
    assert!(m.tensors.keys().all(|k| !k.starts_with("language_model.")));
    assert_eq!(
        m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(),
        [1, 2]
    );
    check_quant_widths(&m, &[]);
    for l in 1..3 {
        check_noaux_router(&m, l, 16, 128);
    }
    // [heads * kv_lora, nope] and [heads * v, kv_lora], 4-bit.
    assert_eq!(
        m.tensors["model.layers.0.self_attn.embed_q.weight"].shape,
        [4 * 64, 64 / 8]
    );
    assert_eq!(
        m.tensors["model.layers.2.self_attn.unembed_out.weight"].shape,
        [4 * 64, 64 / 8]
    );
    assert!(m.tensors.contains_key("lm_head.weight"));
}

/// qwen3_moe from Hugging Face == mlx_lm.convert: per-expert tensors stacked,
/// the router made 8-bit (`quant_predicate`, declared per module in
/// config.json), `decoder_sparse_step: 2` (layers 0 and 2 dense), tied
/// embeddings (no lm_head: the 4-bit embedding serves).
#[test]
fn hf_qwen3moe_equals_mlx_convert() {
    let (_t, dst, r) = hf_equals_mlx("qwen3moe-hf");
    let m = Manifest::read(&dst.join(MANIFEST_FILE)).unwrap();
    let cfg = ModelConfig::from_dir(&dst).unwrap();
    assert_eq!(cfg.arch, moeflux::Architecture::Qwen3Moe);
    assert!(cfg.tie_word_embeddings);
    assert_eq!(m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(), [1]);
    assert_eq!(m.experts[0].num_experts, 8);
    check_quant_widths(&m, &["model.layers.1.mlp.gate".to_string()]);
    let q = cfg.quantization.unwrap();
    assert_eq!(q.for_module("model.layers.1.mlp.gate").unwrap().bits, 8);
    assert!(!m.tensors.keys().any(|k| k.starts_with("lm_head")));
    assert_eq!(m.quantized["model.embed_tokens"].bits, 4);
    for l in [0, 2] {
        assert!(m
            .tensors
            .contains_key(&format!("model.layers.{l}.mlp.up_proj.weight")));
    }
    // The source has no lm_head.weight to drop, and nothing else extra.
    assert_eq!(r.source_kind, SourceKind::Unquantized);
    assert!(r.dropped.is_empty(), "{:?}", r.dropped);
    assert_eq!(r.dropped_summary(), None);
}

/// glm4_moe from Hugging Face (GLM-4.5-Air style) == mlx_lm.convert: q/k/v
/// biases kept BF16 beside the 4-bit projections, no q/k norms
/// (`use_qk_norm: false`), the router kept BF16 and its correction bias F32
/// (never quantized, unlike every other Linear), experts stacked, and the
/// multi-token-prediction layer (`model.layers.3.*`, 11 tensors including
/// an expert, a router and a q bias) dropped and reported as such.
#[test]
fn hf_glm4moe_equals_mlx_convert() {
    let (_t, dst, r) = hf_equals_mlx("glm4moe-hf");
    let m = Manifest::read(&dst.join(MANIFEST_FILE)).unwrap();
    let cfg = ModelConfig::from_dir(&dst).unwrap();
    assert_eq!(cfg.arch, moeflux::Architecture::Glm4Moe);
    assert!(cfg.attention.qkv_bias && !cfg.attention.qk_norm);
    assert_eq!(cfg.num_layers, 3);
    assert_eq!(
        m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(),
        [1, 2]
    );
    check_quant_widths(&m, &[]);
    for l in 0..3 {
        check_qkv_bias(&m, l, 4 * 32, 2 * 32);
        assert!(!m.tensors.keys().any(|k| k.contains("_norm.weight")
            && k.starts_with(&format!("model.layers.{l}.self_attn."))));
    }
    for l in 1..3 {
        check_noaux_router(&m, l, 8, 64);
    }
    assert!(!m.tensors.keys().any(|k| k.starts_with("model.layers.3.")));
    assert!(!dst.join("experts/layer_003.bin").exists());

    // Exactly the MTP layer's tensors were left out, reported as one group.
    let mtp: Vec<String> = source_names("glm4moe-hf")
        .into_iter()
        .filter(|n| n.starts_with("model.layers.3."))
        .collect();
    assert_eq!(mtp.len(), 11);
    assert!(mtp.contains(&"model.layers.3.eh_proj.weight".to_string()));
    assert!(mtp.contains(&"model.layers.3.mlp.experts.0.gate_proj.weight".to_string()));
    assert_eq!(r.dropped, mtp);
    let groups = r.dropped_groups();
    assert_eq!(groups.len(), 1);
    assert_eq!(groups[0].kind, DroppedKind::MtpLayer(3));
    assert_eq!(groups[0].tensors, mtp);
    assert_eq!(
        r.dropped_summary().unwrap(),
        "skipped 11 tensors: multi-token-prediction layer 3 (11)"
    );
}

/// Kimi-K2.5 from Hugging Face == mlx_lm.convert: the `language_model.`
/// prefix, `kv_b_proj` split per head, experts stacked, the BF16 router and
/// F32 correction bias, the MoonViT tower and projector dropped and reported.
#[test]
fn hf_kimik25_equals_mlx_convert() {
    let (_t, dst, r) = hf_equals_mlx("kimik25-hf");
    let m = Manifest::read(&dst.join(MANIFEST_FILE)).unwrap();
    let cfg = ModelConfig::from_dir(&dst).unwrap();
    assert_eq!(cfg.arch, moeflux::Architecture::KimiK25);
    assert!(m
        .tensors
        .keys()
        .all(|k| k.starts_with("model.") || k.starts_with("lm_head")));
    assert_eq!(m.experts.iter().map(|e| e.layer).collect::<Vec<_>>(), [1]);
    check_quant_widths(&m, &[]);
    check_noaux_router(&m, 1, 8, 64);
    for l in 0..2 {
        let a = format!("model.layers.{l}.self_attn.");
        assert!(m.tensors.contains_key(&format!("{a}embed_q.weight")));
        assert!(m.tensors.contains_key(&format!("{a}unembed_out.weight")));
        assert!(!m
            .tensors
            .keys()
            .any(|k| k.starts_with(&format!("{a}kv_b_proj"))));
    }
    assert!(!m
        .tensors
        .keys()
        .any(|k| k.contains("vision") || k.contains("mm_projector")));

    let src = source_names("kimik25-hf");
    let tower: Vec<String> = src
        .iter()
        .filter(|n| n.starts_with("vision_tower."))
        .cloned()
        .collect();
    let projector: Vec<String> = src
        .iter()
        .filter(|n| n.starts_with("mm_projector."))
        .cloned()
        .collect();
    assert_eq!((tower.len(), projector.len()), (17, 6));
    let mut all = [tower.clone(), projector.clone()].concat();
    all.sort();
    assert_eq!(r.dropped, all);
    let groups = r.dropped_groups();
    assert_eq!(
        groups
            .iter()
            .map(|g| (g.kind, g.tensors.clone()))
            .collect::<Vec<_>>(),
        [
            (DroppedKind::VisionTower, tower),
            (DroppedKind::VisionProjector, projector)
        ]
    );
    assert_eq!(
        r.dropped_summary().unwrap(),
        "skipped 23 tensors: vision tower (17), vision projector (6)"
    );
}

// ---------------------------------------------------------------------------
// GGUF sources: tests/fixtures/gguf, written by llama.cpp's gguf-py
// (make_gguf_fixtures.py there); goldens are gguf-py's dequantization.

mod common;

mod gguf_source {
    use super::*;
    use moeflux::convert::dtype::{self, FloatTy};
    use moeflux::convert::gguf::arch::{self, GgufArch};
    use moeflux::convert::gguf::ggml::{self, Mapping};
    use moeflux::convert::gguf::{self, file, Part, View};
    use moeflux::convert::source::Source;
    use moeflux::quant::mxfp4;

    fn dir() -> PathBuf {
        fixtures().join("gguf")
    }

    /// FNV-1a 64 of the values as f32 little-endian bytes, -0 read as +0
    /// (an affine `code * scale + bias` that is zero is +0 where gguf-py's
    /// `d * 0` may be -0; the two are equal in every product and sum).
    fn fnv(v: &[f32]) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in v.iter().flat_map(|x| (x + 0.0).to_le_bytes()) {
            h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
        format!("{h:016x}")
    }

    fn goldens() -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir().join("goldens.json")).unwrap()).unwrap()
    }

    /// Every value a presented (mlx-named) tensor stands for, row-major f32.
    fn dequant_presented(src: &Source, weight: &str) -> Vec<f32> {
        let t = &src.tensors[weight];
        if t.view.is_none() {
            let ty = FloatTy::from_dtype(t.dtype).expect("float");
            return dtype::decode(&src.bytes(t), ty);
        }
        let module = weight.strip_suffix(".weight").unwrap();
        let spec = src
            .config
            .quantization
            .as_ref()
            .and_then(|q| q.for_module(module))
            .unwrap_or_else(|| panic!("{module}: no quantization entry"));
        let words = dtype::decode_u32(&src.bytes(t));
        let wpr = *t.shape.last().unwrap();
        let cols = wpr * 32 / spec.bits as usize;
        let rows = words.len() / wpr;
        let mut out = vec![0f32; rows * cols];
        let sc = &src.tensors[&format!("{module}.scales")];
        let g = cols / spec.group_size;
        if spec.is_mxfp4() {
            let s = src.bytes(sc);
            for (r, o) in out.chunks_exact_mut(cols).enumerate() {
                mxfp4::dequantize_row(&words[r * wpr..(r + 1) * wpr], &s[r * g..(r + 1) * g], o);
            }
        } else {
            let s = dtype::decode(&src.bytes(sc), FloatTy::F32);
            let b = dtype::decode(
                &src.bytes(&src.tensors[&format!("{module}.biases")]),
                FloatTy::F32,
            );
            for (r, o) in out.chunks_exact_mut(cols).enumerate() {
                affine::dequantize_row(
                    &words[r * wpr..(r + 1) * wpr],
                    &s[r * g..(r + 1) * g],
                    &b[r * g..(r + 1) * g],
                    spec,
                    o,
                );
            }
        }
        out
    }

    /// Every tensor of `file`, as the converter presents it, dequantizes to
    /// gguf-py's values bit for bit (exact types) — checked by hash.
    fn check_tensors(file: &str) -> Source {
        let src = gguf::open(&dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        let info = src.gguf.as_ref().unwrap();
        let a = GgufArch::from_name(info.kv["general.architecture"].as_str().unwrap()).unwrap();
        assert!(
            info.requantized.is_empty(),
            "{file}: {:?}",
            info.requantized
        );
        let g = goldens();
        let mut parts: Vec<String> = vec![file.to_string()];
        if file.contains("-00001-of-") {
            parts.push(file.replace("-00001-of-", "-00002-of-"));
        }
        let mut n = 0;
        for part in parts {
            for (name, want) in g[&part].as_object().unwrap() {
                let mlx = arch::mlx_name(a, name).unwrap_or_else(|| panic!("{name}"));
                let got = fnv(&dequant_presented(&src, &mlx));
                assert_eq!(
                    got,
                    want["fnv1a64"].as_str().unwrap(),
                    "{part}: {name} ({})",
                    want["type"]
                );
                n += 1;
            }
        }
        assert!(n > 20, "{file}: only {n} tensors checked");
        src
    }

    /// The converted directory holds exactly the presented tensors: every
    /// dense tensor and every expert's pieces, byte for byte (F16 widened).
    fn check_dir_equals_views(src: &Source, dst: &Path, m: &Manifest) {
        // Canonical -> presented name (gpt-oss's experts are `mlp.experts` in mlx-lm).
        let mlx = |canon: &str| -> String {
            if src.tensors.contains_key(canon) {
                canon.to_string()
            } else {
                canon.replacen(".mlp.switch_mlp.", ".mlp.experts.", 1)
            }
        };
        let dense = std::fs::read(dst.join(&m.dense_file)).unwrap();
        let st = SafeTensors::deserialize(&dense).unwrap();
        for name in m.tensors.keys() {
            let t = &src.tensors[&mlx(name)];
            let got = st.tensor(name).unwrap();
            let want = src.bytes(t);
            if t.dtype == safetensors::Dtype::F16 {
                let w = dtype::decode(&want, FloatTy::F16);
                assert_eq!(dtype::decode(got.data(), FloatTy::F32), w, "{name}");
            } else {
                assert_eq!(got.data(), &want[..], "{name}");
            }
        }
        for l in &m.experts {
            let bytes = std::fs::read(dst.join(&l.file)).unwrap();
            for c in &l.components {
                let module = format!("model.layers.{}.mlp.switch_mlp.{}", l.layer, c.name);
                let mut pieces = vec![("weight", &c.weight), ("scales", &c.scales)];
                if let Some(b) = &c.biases {
                    pieces.push(("biases", b));
                }
                for (part, r) in pieces {
                    let t = &src.tensors[&mlx(&format!("{module}.{part}"))];
                    let per = t.bytes_per_leading();
                    for e in 0..l.num_experts {
                        let at = e * l.stride as usize + r.offset as usize;
                        assert_eq!(
                            &bytes[at..at + r.bytes as usize],
                            &src.byte_range(t, e * per..(e + 1) * per)[..],
                            "{module}.{part} expert {e}"
                        );
                    }
                }
            }
        }
    }

    fn golden_logits(gguf_file: &str, fixture: &str) {
        let src = dir().join(gguf_file);
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("m");
        let r = convert(&src, &dst, &ConvertOptions::default()).unwrap();
        assert!(r.warnings.is_empty(), "{:?}", r.warnings);
        let m = check_model_dir(&dst);
        assert_eq!(m.source.kind, "gguf");
        check_dir_equals_views(&gguf::open(&src).unwrap(), &dst, &m);
        let golden = common::Golden::load(&fixtures().join(fixture));
        let rows = common::eval_three_ways(&golden, || common::open(&dst));
        for (mode, got) in common::EVAL_MODES.iter().zip(&rows) {
            common::check_against_golden(&format!("{gguf_file} {mode}"), &golden, got);
        }
        // The vocabulary came from the GGUF metadata: it encodes like the fixture's.
        let ours =
            moeflux::text::tokenizer::Tokenizer::from_file(dst.join("tokenizer.json")).unwrap();
        let theirs = moeflux::text::tokenizer::Tokenizer::from_file(
            fixtures().join(fixture).join("expected_mlx/tokenizer.json"),
        )
        .unwrap();
        let text = "Hello world, it's 2024!\n  <|im_end|> ok";
        assert_eq!(
            ours.encode(text, false).unwrap(),
            theirs.encode(text, false).unwrap()
        );
    }

    /// The IQ codebook types (iq_types.gguf, make_iq_fixtures.py there):
    /// random blocks dequantize to gguf-py's values bit for bit, and are
    /// presented as MLX's 4-bit group-32 quantization of exactly those values.
    #[test]
    fn iq_codebook_types_dequantize_as_gguf_py() {
        let path = dir().join("iq_types.gguf");
        let bytes = std::fs::read(&path).unwrap();
        let p = file::parse(&bytes, &path).unwrap();
        let npy = std::fs::read(dir().join("iq_dequant.npy")).unwrap();
        let want: Vec<f32> = npyz::NpyFile::new(&npy[..]).unwrap().into_vec().unwrap();
        let per = 2 * 512;
        let order = [
            "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M",
        ];
        assert_eq!(p.tensors.len(), order.len());
        assert_eq!(want.len(), order.len() * per);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (i, ty) in order.iter().enumerate() {
            let t = &p.tensors[i];
            assert_eq!(
                (t.name.as_str(), t.ty.name),
                (format!("t.{ty}").as_str(), *ty)
            );
            let want = &want[i * per..(i + 1) * per];
            let mut got = vec![0f32; per];
            ggml::dequant_rows(&t.ty, &bytes[t.start..t.start + t.len], &mut got);
            assert_eq!(
                bits(&got),
                bits(want),
                "{ty}: dequantization differs from gguf-py"
            );
            assert_eq!(t.ty.mapping, Some(Mapping::Requant { bits: 4 }), "{ty}");
            let view = |part| {
                View {
                    ty: t.ty,
                    part,
                    cols: 512,
                    src_start: t.start,
                    src_len: t.len,
                }
                .rows(&bytes, 0, 2)
            };
            let q = affine::quantize(want, 2, 512, moeflux::config::QuantSpec::affine(4, 32));
            assert_eq!(dtype::decode_u32(&view(Part::Codes)), q.packed, "{ty}");
            let f32s = |part| dtype::decode(&view(part), FloatTy::F32);
            assert_eq!(f32s(Part::Scales), q.scales, "{ty}");
            assert_eq!(f32s(Part::Biases), q.biases, "{ty}");
        }
    }

    #[test]
    fn every_ggml_type_dequantizes_as_gguf_py() {
        let path = dir().join("types.gguf");
        let bytes = std::fs::read(&path).unwrap();
        let p = file::parse(&bytes, &path).unwrap();
        let npy = std::fs::read(dir().join("types_dequant.npy")).unwrap();
        let want: Vec<f32> = npyz::NpyFile::new(&npy[..]).unwrap().into_vec().unwrap();
        let per = 2 * 512;
        assert_eq!(want.len(), p.tensors.len() * per);
        let order = [
            "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16", "F32",
        ];
        let mut exact = Vec::new();
        for (i, ty) in order.iter().enumerate() {
            let t = p
                .tensors
                .iter()
                .find(|t| t.name == format!("t.{ty}"))
                .unwrap();
            assert_eq!(t.ty.name, *ty);
            let want = &want[i * per..(i + 1) * per];
            let mut got = vec![0f32; per];
            ggml::dequant_rows(&t.ty, &bytes[t.start..t.start + t.len], &mut got);
            let exact_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                exact_bits(&got),
                exact_bits(want),
                "{ty}: dequantization differs from gguf-py"
            );
            // The stored forms: bit for bit, -0 read as +0 (see `fnv`).
            let bits = |v: &[f32]| v.iter().map(|x| (x + 0.0).to_bits()).collect::<Vec<_>>();
            let view = |part| View {
                ty: t.ty,
                part,
                cols: 512,
                src_start: t.start,
                src_len: t.len,
            };
            let f32s = |part| dtype::decode(&view(part).rows(&bytes, 0, 2), FloatTy::F32);
            match t.ty.mapping.unwrap() {
                Mapping::Float => {}
                Mapping::Mxfp4 => {
                    let codes = dtype::decode_u32(&view(Part::Codes).rows(&bytes, 0, 2));
                    let scales = view(Part::Scales).rows(&bytes, 0, 2);
                    let mut v = vec![0f32; per];
                    for r in 0..2 {
                        mxfp4::dequantize_row(
                            &codes[r * 64..(r + 1) * 64],
                            &scales[r * 16..(r + 1) * 16],
                            &mut v[r * 512..(r + 1) * 512],
                        );
                    }
                    assert_eq!(bits(&v), bits(want), "{ty} as moeflux MXFP4");
                    exact.push(*ty);
                }
                m @ (Mapping::Affine { bits: b, .. } | Mapping::Requant { bits: b }) => {
                    let group = match m {
                        Mapping::Affine { group, .. } => group,
                        _ => 32,
                    };
                    let spec = moeflux::config::QuantSpec::affine(b, group);
                    let codes = dtype::decode_u32(&view(Part::Codes).rows(&bytes, 0, 2));
                    let (s, bi) = (f32s(Part::Scales), f32s(Part::Biases));
                    let (wpr, gpr) = (affine::words_per_row(512, b), 512 / group);
                    let mut v = vec![0f32; per];
                    for r in 0..2 {
                        affine::dequantize_row(
                            &codes[r * wpr..(r + 1) * wpr],
                            &s[r * gpr..(r + 1) * gpr],
                            &bi[r * gpr..(r + 1) * gpr],
                            spec,
                            &mut v[r * 512..(r + 1) * 512],
                        );
                    }
                    if t.ty.exact() {
                        assert_eq!(bits(&v), bits(want), "{ty} as {b}-bit affine g{group}");
                        exact.push(*ty);
                    } else {
                        // Re-quantized: MLX's quantization of gguf-py's values.
                        let q = affine::quantize(want, 2, 512, spec);
                        assert_eq!(codes, q.packed, "{ty}: re-quantized codes");
                        assert_eq!((s, bi), (q.scales, q.biases), "{ty}: scales, biases");
                    }
                }
            }
        }
        assert_eq!(
            exact,
            [
                "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "MXFP4"
            ]
        );
    }

    #[test]
    fn qwen3moe_gguf_tensors_exact_and_logits_match_golden() {
        check_tensors("qwen3moe.gguf");
        golden_logits("qwen3moe.gguf", "qwen3moe-hf");
    }

    #[test]
    fn gpt_oss_gguf_mxfp4_tensors_exact_and_logits_match_golden() {
        check_tensors("gptoss.gguf");
        golden_logits("gptoss.gguf", "gptoss-hf");
    }

    #[test]
    fn glm4moe_gguf_tensors_exact_and_logits_match_golden() {
        check_tensors("glm4moe.gguf");
        golden_logits("glm4moe.gguf", "glm4moe-hf");
    }

    #[test]
    fn mixed_type_split_gguf_converts_exactly() {
        let first = "qwen3moe-mixed-00001-of-00002.gguf";
        let src = check_tensors(first);
        let types = &src.gguf.as_ref().unwrap().types;
        for t in [
            "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "F16", "BF16", "F32",
        ] {
            assert!(types.contains_key(t), "{t} missing from {types:?}");
        }
        // Either part names the whole file; the converted model runs.
        let tmp = tempfile::tempdir().unwrap();
        let dst = tmp.path().join("m");
        let second = dir().join(first.replace("-00001-", "-00002-"));
        convert(&second, &dst, &ConvertOptions::default()).unwrap();
        let m = check_model_dir(&dst);
        check_dir_equals_views(&src, &dst, &m);
        let q = |k: &str| m.quantized[k];
        assert_eq!(
            q("model.layers.0.self_attn.q_proj"),
            moeflux::config::QuantSpec::affine(8, 32)
        );
        assert_eq!(
            q("model.layers.0.self_attn.k_proj"),
            moeflux::config::QuantSpec::affine(4, 32)
        );
        let l1 = m.experts.iter().find(|e| e.layer == 1).unwrap();
        assert!(l1.components[0].quant.is_mxfp4());
        assert_eq!(
            l1.components[1].quant,
            moeflux::config::QuantSpec::affine(8, 32)
        );
        assert_eq!(
            l1.components[2].quant,
            moeflux::config::QuantSpec::affine(4, 32)
        );
        let golden = common::Golden::load(&fixtures().join("qwen3moe-hf"));
        let logits = common::open(&dst)
            .eval(&golden.tokens, moeflux::LogitsMode::All)
            .unwrap();
        assert!(logits.iter().all(|x| x.is_finite()));
    }

    // llama-quantize's own files (tests/fixtures/gguf/quants, make_gguf_quants.py
    // there): one 256-wide qwen3moe, `--pure` to each type moeflux reads.

    fn quants() -> PathBuf {
        dir().join("quants")
    }

    /// Every tensor of the quantized file `file` as the converter presents it,
    /// against gguf-py's dequantization `want` of the source tensor (its hash
    /// in goldens.json): exact types bit for bit; the others are MLX's
    /// affine re-quantization of exactly gguf-py's values (codes, scales and
    /// biases equal). Returns whether every tensor's type is exact, and the
    /// worst re-quantization error in steps of its group's scale.
    fn check_quantized_file(file: &str, tensors: &serde_json::Value) -> (bool, f32) {
        let path = quants().join(file);
        let bytes = std::fs::read(&path).unwrap();
        let parsed = file::parse(&bytes, &path).unwrap();
        let src = gguf::open(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        let a = GgufArch::Qwen3Moe;
        let tensors = tensors.as_object().unwrap();
        assert_eq!(tensors.len(), parsed.tensors.len(), "{file}: tensor count");
        let mut worst_steps = 0f32;
        let mut exact = true;
        for t in &parsed.tensors {
            let want = &tensors[&t.name];
            assert_eq!(want["type"], t.ty.name, "{file}: {}", t.name);
            let shape = t.shape();
            let cols = *shape.last().unwrap();
            let mut vals = vec![0f32; shape.iter().product()];
            ggml::dequant_rows(&t.ty, &bytes[t.start..t.start + t.len], &mut vals);
            // moeflux's dequantization of the source is gguf-py's.
            assert_eq!(
                fnv(&vals),
                want["fnv1a64"].as_str().unwrap(),
                "{file}: {}",
                t.name
            );
            let mlx = arch::mlx_name(a, &t.name).unwrap_or_else(|| panic!("{}", t.name));
            let got = dequant_presented(&src, &mlx);
            if t.ty.exact() {
                assert_eq!(fnv(&got), fnv(&vals), "{file}: {} ({})", t.name, t.ty.name);
                continue;
            }
            exact = false;
            let Some(Mapping::Requant { bits }) = t.ty.mapping else {
                panic!(
                    "{file}: {}: {} neither exact nor re-quantized",
                    t.name, t.ty.name
                )
            };
            let module = mlx.strip_suffix(".weight").unwrap();
            let spec = moeflux::config::QuantSpec::affine(bits, 32);
            let q = affine::quantize(&vals, vals.len() / cols, cols, spec);
            let part = |p: &str| src.bytes(&src.tensors[&format!("{module}.{p}")]);
            assert_eq!(
                dtype::decode_u32(&part("weight")),
                q.packed,
                "{file}: {mlx} codes"
            );
            assert_eq!(
                dtype::decode(&part("scales"), FloatTy::F32),
                q.scales,
                "{file}: {mlx}"
            );
            assert_eq!(
                dtype::decode(&part("biases"), FloatTy::F32),
                q.biases,
                "{file}: {mlx}"
            );
            for ((g, w), s) in got.chunks(32).zip(vals.chunks(32)).zip(&q.scales) {
                for (x, y) in g.iter().zip(w) {
                    worst_steps = worst_steps.max((x - y).abs() / s.abs());
                }
            }
        }
        (exact, worst_steps)
    }

    #[test]
    fn llama_quantize_files_convert_as_gguf_py_dequantizes() {
        let g: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(quants().join("goldens.json")).unwrap())
                .unwrap();
        let files = g.as_object().unwrap();
        let (mut types, mut inexact) = (Vec::new(), Vec::new());
        for (file, tensors) in files {
            let (exact, worst) = check_quantized_file(file, tensors);
            let ty = file
                .strip_prefix("qwen3moe-")
                .and_then(|f| f.strip_suffix(".gguf"))
                .unwrap();
            types.push(ty);
            if !exact {
                inexact.push(ty);
            }
            // Informational: MLX's rounding of the zero point can shrink the
            // step, so the clamped far end of a group errs by more than half.
            eprintln!("{file}: exact {exact}, worst re-quantization error {worst:.4} steps");
            // The whole file converts; the directory holds what was checked above.
            let tmp = tempfile::tempdir().unwrap();
            let dst = tmp.path().join("m");
            let r = convert(&quants().join(file), &dst, &ConvertOptions::default()).unwrap();
            assert_eq!(r.warnings.is_empty(), exact, "{file}: {:?}", r.warnings);
            let m = check_model_dir(&dst);
            check_dir_equals_views(&gguf::open(&quants().join(file)).unwrap(), &dst, &m);
        }
        types.sort_unstable();
        inexact.sort_unstable();
        assert_eq!(inexact, ["IQ4_XS"]);
        assert_eq!(
            types,
            [
                "IQ4_NL",
                "IQ4_XS",
                "MXFP4_MOE",
                "Q2_K",
                "Q3_K",
                "Q4_0",
                "Q4_1",
                "Q4_K",
                "Q4_K_M",
                "Q5_0",
                "Q5_1",
                "Q5_K",
                "Q6_K",
                "Q8_0"
            ]
        );
    }

    /// llama.cpp's logits on an F32 GGUF of gguf-py's dequantization of
    /// llama-quantize's files of exact types (golden-TYPE/): each converted
    /// file agrees within the goldens' bounds, batch and one token at a time.
    #[test]
    fn llama_quantize_logits_match_llama_cpp() {
        for ty in [
            "Q4_K",
            "Q5_K",
            "Q6_K",
            "Q3_K",
            "Q2_K",
            "MXFP4_MOE",
            "Q4_K_M",
        ] {
            let golden_dir = quants().join(format!("golden-{ty}"));
            let meta: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(golden_dir.join("golden.json")).unwrap(),
            )
            .unwrap();
            let file = meta["source"].as_str().unwrap();
            assert_eq!(file, format!("qwen3moe-{ty}.gguf"));
            let tmp = tempfile::tempdir().unwrap();
            let dst = tmp.path().join("m");
            let r = convert(&quants().join(file), &dst, &ConvertOptions::default()).unwrap();
            assert!(r.warnings.is_empty(), "{:?}", r.warnings);
            let golden = common::Golden::load(&golden_dir);
            let rows = common::eval_three_ways(&golden, || common::open(&dst));
            for (mode, got) in common::EVAL_MODES.iter().zip(&rows) {
                common::check_against_golden(&format!("{file} {mode}"), &golden, got);
            }
        }
    }

    /// A dense tensor of a GGUF stored as MXFP4 (gpt-oss's files keep only
    /// the routed experts so) is refused, naming the tensor.
    #[test]
    fn mxfp4_dense_tensor_is_refused_by_name() {
        let mut bytes = std::fs::read(quants().join("qwen3moe-MXFP4_MOE.gguf")).unwrap();
        // The tensor info: name, u32 dimension count, u64 dimensions, u32 type.
        let name = b"blk.0.attn_q.weight";
        let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
        let dims = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let ty = at + 4 + 8 * dims;
        assert_eq!(bytes[ty..ty + 4], 8u32.to_le_bytes(), "Q8_0 in the fixture");
        bytes[ty..ty + 4].copy_from_slice(&39u32.to_le_bytes());
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("dense-mxfp4.gguf");
        std::fs::write(&p, &bytes).unwrap();
        let e = gguf_err(&p);
        assert!(
            e.contains("self_attn.q_proj")
                && e.contains("MXFP4")
                && e.contains("routed experts only"),
            "{e}"
        );
    }

    fn gguf_err(path: &Path) -> String {
        let tmp = tempfile::tempdir().unwrap();
        let e = convert(path, &tmp.path().join("m"), &ConvertOptions::default()).unwrap_err();
        assert!(!tmp.path().join("m").exists());
        e.to_string()
    }

    #[test]
    fn bad_gguf_files_are_clear_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let bytes = std::fs::read(dir().join("qwen3moe.gguf")).unwrap();
        // Truncated in the tensor data, and in the header.
        for (cut, what) in [(bytes.len() - 100, "run past"), (200, "cannot fit")] {
            let p = tmp.path().join(format!("cut{cut}.gguf"));
            std::fs::write(&p, &bytes[..cut]).unwrap();
            let e = gguf_err(&p);
            assert!(
                e.contains(&p.display().to_string()) && e.contains(what),
                "{e}"
            );
        }
        // Another architecture.
        let at = bytes.windows(8).position(|w| w == b"qwen3moe").unwrap();
        let mut other = bytes.clone();
        other[at..at + 8].copy_from_slice(b"qwen3xyz");
        let p = tmp.path().join("other.gguf");
        std::fs::write(&p, &other).unwrap();
        let e = gguf_err(&p);
        assert!(e.contains("qwen3xyz"), "{e}");
        // A missing part of a split file.
        let p = tmp.path().join("x-00001-of-00002.gguf");
        std::fs::copy(dir().join("qwen3moe-mixed-00001-of-00002.gguf"), &p).unwrap();
        let e = gguf_err(&p);
        assert!(
            e.contains("x-00002-of-00002.gguf") && e.contains("missing"),
            "{e}"
        );
    }
}
