//! `moeflux::convert` on the golden fixtures (tests/fixtures, see its README):
//! layout and consistency of the model directory, byte equality of experts
//! with the source, HF -> moeflux == mlx_lm.convert -> moeflux, the flash-moe
//! 2-bit re-quantization, and one test per bad input.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use moeflux::config::ModelConfig;
use moeflux::convert::{convert, ConvertOptions, ConvertProgress, ConvertStage, SourceKind};
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
                * if c.scales.dtype == "F32" { 4 } else { 2 };
            for (r, bytes) in [(&c.weight, wb), (&c.scales, sb), (&c.biases, sb)] {
                assert_eq!(r.offset % COMPONENT_ALIGN as u64, 0);
                assert!(r.offset >= end, "pieces overlap");
                assert_eq!(r.bytes, bytes);
                end = r.offset + r.bytes;
            }
            assert_eq!(c.weight.dtype, "U32");
            assert_eq!(c.scales.dtype, c.biases.dtype);
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
            for (part, r) in [
                ("weight", &c.weight),
                ("scales", &c.scales),
                ("biases", &c.biases),
            ] {
                let name = format!(
                    "{prefix}model.layers.{}.mlp.switch_mlp.{}.{part}",
                    el.layer, c.name
                );
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
    let src = fixture(name).join("src");
    let (_t, dst) = convert_fixture(&src, &opts());
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
    // Routers stay 8-bit.
    assert_eq!(m.quantized["model.layers.0.mlp.gate"].bits, 8);
    // The engine accepts the directory.
    moeflux::Session::open(&dst, Default::default()).unwrap();
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
    let (_t1, from_hf) = convert_fixture(&fixture(name).join("src"), &opts());
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
    moeflux::Session::open(&from_hf, Default::default()).unwrap();
}

#[test]
fn hf_qwen35moe_equals_mlx_convert() {
    check_hf_equals_mlx("qwen35moe-hf");
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
        for (part, r) in [
            ("weight", &c.weight),
            ("scales", &c.scales),
            ("biases", &c.biases),
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
    let b8e = &ext[c.biases.offset as usize..];
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
