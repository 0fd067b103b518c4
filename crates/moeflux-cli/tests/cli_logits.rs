//! `moeflux logits` end to end: convert a fixture, write logits in both
//! modes, compare with mlx-lm's golden; bad input exits non-zero with one
//! `error:` line and writes nothing.

mod common;

use std::path::Path;

use common::*;

fn read_npy(p: &Path) -> (Vec<u64>, Vec<f32>) {
    let bytes = std::fs::read(p).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    let shape = npy.shape().to_vec();
    (shape, npy.into_vec().unwrap())
}

/// `logits` of `model` in both modes agree with fixture `name`'s golden.
fn check_logits_match_the_golden(model: &Path, name: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let tokens = id_list(&ids(&golden(name)["tokens"]));
    let (gshape, golden) = read_npy(&fixture(name).join("golden_logits.npy"));
    let tol = 1e-3 * golden.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    for mode in ["batch", "incremental"] {
        let out_path = tmp.path().join(format!("{mode}.npy"));
        let out = moeflux(&[
            "logits",
            "--model",
            s(model),
            "--tokens",
            &tokens,
            "--output",
            s(&out_path),
            "--mode",
            mode,
        ]);
        assert!(out.status.success(), "{mode}: {}", text(&out.stderr));
        let (shape, got) = read_npy(&out_path);
        assert_eq!(shape, gshape, "{mode}");
        let worst = got
            .iter()
            .zip(&golden)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(worst <= tol, "{name} {mode}: max diff {worst} > {tol}");
    }
}

#[test]
fn logits_batch_and_incremental_match_the_golden() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    check_logits_match_the_golden(&model, "qwen35moe-q4");
}

/// A GGUF through the binary: `convert` names its tensor types; `logits`
/// match the golden of the weights it was exported from; `run` continues
/// greedily as mlx-lm does, with the tokenizer and template its metadata
/// carried.
#[test]
fn gguf_convert_then_logits_and_run() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    let out = moeflux(&["convert", s(&fixture("gguf/qwen3moe.gguf")), s(&model)]);
    assert!(ok(&out).contains("converted qwen3_moe"));
    let err = text(&out.stderr);
    assert!(err.contains("GGUF tensor types: F32 "), "{err}");
    assert!(err.contains("Q4_1 "), "{err}");
    assert!(!err.contains("warning"), "{err}");
    check_logits_match_the_golden(&model, "qwen3moe-hf");

    let g = golden("qwen3moe-hf");
    let continuation = ids(&g["continuation"]);
    let out = moeflux(&[
        "run",
        "--model",
        s(&model),
        "--prompt-ids",
        &id_list(&ids(&g["prompt"])),
        "--temp",
        "0",
        "-n",
        &continuation.len().to_string(),
        "--ignore-eos",
    ]);
    let tok = moeflux::text::tokenizer::Tokenizer::from_model_dir(&model).unwrap();
    let want = tok.decode(&continuation, true).unwrap();
    assert_eq!(ok(&out), format!("{want}\n"));
    let out = moeflux(&["run", "--model", s(&model), "-p", "Hello", "-n", "3"]);
    assert!(!ok(&out).is_empty());
}

#[test]
fn inspect_describes_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let out = moeflux(&["inspect", model.to_str().unwrap()]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("qwen3_5_moe"), "{text}");
}

fn assert_clean_failure(out: &std::process::Output, needle: &str) {
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("error:") && err.contains(needle),
        "expected `{needle}` in: {err}"
    );
}

#[test]
fn bad_logits_input_fails_cleanly_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let m = model.to_str().unwrap();
    let out_path = tmp.path().join("never.npy");
    let o = out_path.to_str().unwrap();
    assert_clean_failure(
        &moeflux(&[
            "logits", "--model", m, "--tokens", "1,2,1024", "--output", o,
        ]),
        "1024",
    );
    assert_clean_failure(
        &moeflux(&["logits", "--model", m, "--tokens", "1,x,3", "--output", o]),
        "`x`",
    );
    assert_clean_failure(
        &moeflux(&["logits", "--model", m, "--tokens", ",", "--output", o]),
        "no token ids",
    );
    let missing = tmp.path().join("nope");
    assert_clean_failure(
        &moeflux(&[
            "logits",
            "--model",
            missing.to_str().unwrap(),
            "--tokens",
            "1",
            "--output",
            o,
        ]),
        "moeflux.json",
    );
    assert!(!out_path.exists());
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "only the model directory should exist"
    );
}

#[test]
fn trace_writes_every_block_as_npy() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen3moe-q4", tmp.path());
    let tokens = id_list(&ids(&golden("qwen3moe-q4")["prompt"])[..5]);
    let out_path = tmp.path().join("logits.npy");
    for mode in ["batch", "incremental"] {
        let trace = tmp.path().join(format!("trace-{mode}"));
        let out = moeflux(&[
            "logits",
            "--model",
            s(&model),
            "--tokens",
            &tokens,
            "--output",
            s(&out_path),
            "--mode",
            mode,
            "--trace",
            s(&trace),
        ]);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{mode}: {err}");
        assert!(err.contains("every block's output"), "{err}");
        // Batch: one trace of 5 tokens; incremental: one per token.
        let (dir, rows) = match mode {
            "batch" => (trace.clone(), 5),
            _ => (trace.join("t0004"), 1),
        };
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("trace.json")).unwrap())
                .unwrap();
        let blocks = index["blocks"].as_array().unwrap();
        // qwen3moe-q4: 4 layers, layer 1 dense.
        assert_eq!(blocks.len(), 2 + 4 * 4, "{mode}");
        assert_eq!(blocks[6]["file"], "006-L001.full_attention.npy");
        assert_eq!(blocks[8]["file"], "008-L001.dense_mlp.npy");
        let last = blocks.last().unwrap()["file"].as_str().unwrap();
        let (shape, traced) = read_npy(&dir.join(last));
        assert_eq!(shape, [rows, 1024]);
        // The traced logits are the ones written to --output.
        let (_, logits) = read_npy(&out_path);
        assert_eq!(traced[..], logits[logits.len() - traced.len()..]);
    }
}

/// A model the GPU kernels cannot take (GatedDeltaNet heads of 48): `--backend
/// cuda` fails with the reason, `--backend auto` runs on the CPU and says why.
#[test]
fn unsupported_on_the_gpu_fails_with_cuda_and_falls_back_with_auto() {
    use moeflux::synth::{synth, QwenShape, SynthOptions, SynthSpec};
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("narrow");
    let shape = QwenShape {
        hidden_size: 256,
        num_layers: 2,
        num_attention_heads: 2,
        num_kv_heads: 1,
        head_dim: 64,
        vocab_size: 512,
        num_experts: 8,
        experts_per_token: 2,
        moe_intermediate: 64,
        shared_intermediate: 64,
        linear_v_heads: 4,
        linear_k_heads: 1,
        linear_head_dim: 48,
        full_attention_interval: 2,
        eos_token_ids: &[2],
    };
    synth(
        &model,
        &SynthOptions::new("narrow", SynthSpec::Qwen3_5Moe(shape)),
    )
    .unwrap();
    let out_path = tmp.path().join("l.npy");
    let run = |backend: &str| {
        moeflux(&[
            "logits",
            "--model",
            s(&model),
            "--tokens",
            "1,2,3",
            "--output",
            s(&out_path),
            "--backend",
            backend,
        ])
    };
    let line = one_line_error(&run("cuda"));
    assert!(
        line.contains("cuda backend cannot run this model")
            && line.contains("GatedDeltaNet value head dim 48"),
        "{line}"
    );
    assert!(!out_path.exists(), "nothing written on failure");
    let out = run("auto");
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: running on the CPU: the cuda backend cannot run this model")
            && err.contains("48"),
        "{err}"
    );
    assert!(out_path.exists());
}
