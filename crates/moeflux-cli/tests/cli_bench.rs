//! `moeflux bench` on a converted fixture: the JSON contract the side-by-side
//! scripts rely on, expert-byte accounting, and one-line errors.

mod common;

use common::*;

#[test]
fn json_report_has_speeds_phases_and_exact_expert_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let out = moeflux(&[
        "bench",
        "--model",
        s(&model),
        "--prompt-len",
        "24",
        "--gen",
        "6",
        "--reps",
        "2",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    for key in [
        "prefill_tok_s",
        "decode_tok_s",
        "memory_gb_s",
        "decode_roofline_tok_s",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    assert_eq!(v["prefill"]["tokens"], 24);
    assert_eq!(v["decode"]["tokens"], 6);
    assert_eq!(v["decode"]["tok_s_reps"].as_array().unwrap().len(), 2);
    for phase in [
        "attention",
        "routing",
        "expert_io_wait",
        "expert_compute",
        "lm_head",
    ] {
        assert!(v["decode"]["ms_per_token"][phase].as_f64().unwrap() >= 0.0);
    }

    // A decoded token reads k experts of every MoE layer, one extent each.
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("moeflux.json")).unwrap())
            .unwrap();
    let k = v["experts_per_token"].as_u64().unwrap();
    let per_token: u64 = manifest["experts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| k * l["stride"].as_u64().unwrap())
        .sum();
    assert_eq!(
        v["decode"]["expert_bytes_per_token"].as_f64().unwrap(),
        per_token as f64
    );
    // A batch reads each chosen expert once: fewer bytes per token.
    let pp = v["prefill"]["expert_bytes_per_token"].as_f64().unwrap();
    assert!(pp > 0.0 && pp < per_token as f64, "{pp} vs {per_token}");
    assert!(v["sequential_direct_gb_s"].is_null());
}

#[test]
fn cold_text_report_measures_the_file_system() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let out = moeflux(&[
        "bench",
        "--model",
        s(&model),
        "--prompt-len",
        "8",
        "--gen",
        "2",
        "--reps",
        "1",
        "--cold",
    ]);
    let text = ok(&out);
    for needle in ["pp8", "tg2", "expert I/O wait", "decode roofline", "cold"] {
        assert!(text.contains(needle), "{needle} missing: {text}");
    }
}

#[test]
fn bad_requests_are_one_error_line() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let m = s(&model);
    let e = one_line_error(&moeflux(&["bench", "--model", m, "--reps", "0"]));
    assert!(e.contains("reps"), "{e}");
    let e = one_line_error(&moeflux(&[
        "bench",
        "--model",
        m,
        "--prompt-len",
        "0",
        "--gen",
        "0",
    ]));
    assert!(e.contains("nothing to do"), "{e}");
    let e = one_line_error(&moeflux(&["bench", "--model", m, "--prompt-len", "100000"]));
    assert!(e.contains("context"), "{e}");
}

/// Without an NVIDIA driver: `--backend cuda` is a one-line error that says
/// CUDA is unavailable, `auto` runs on the CPU, and GPU-only flags warn.
/// (On a machine with a GPU the first two would differ; the GPU tests cover
/// it there.)
#[test]
fn backend_choice_without_a_gpu() {
    if moeflux::backend::cuda::device::driver_present() {
        eprintln!("skipped: an NVIDIA driver is present");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let m = s(&model);
    let e = one_line_error(&moeflux(&["bench", "--model", m, "--backend", "cuda"]));
    assert!(e.contains("CUDA is not available"), "{e}");
    let out = moeflux(&[
        "bench",
        "--model",
        m,
        "--backend",
        "auto",
        "--prompt-len",
        "4",
        "--gen",
        "2",
        "--reps",
        "1",
        "--host-cache",
        "1G",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert!(v["backend"].as_str().unwrap().starts_with("cpu"), "{v}");
    let err = text(&out.stderr);
    assert!(
        err.contains("--host-cache has no effect on the CPU"),
        "{err}"
    );
    let out = moeflux(&["bench", "--model", m, "--backend", "tpu"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("auto, cpu, cuda"));
    // Named GPUs are never a silent CPU fallback.
    for backend in ["auto", "cuda"] {
        let out = moeflux(&["bench", "--model", m, "--gpus", "0,1", "--backend", backend]);
        let e = one_line_error(&out);
        assert!(e.contains("--gpus 0,1: CUDA is not available"), "{e}");
    }
    let e = one_line_error(&moeflux(&[
        "bench",
        "--model",
        m,
        "--gpus",
        "all",
        "--backend",
        "cpu",
    ]));
    assert!(e.contains("--gpus all needs the GPU backend"), "{e}");
    let out = moeflux(&["bench", "--model", m, "--gpus", "0,0"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("GPU 0 is listed twice"));
    // GPUDirect Storage reads into VRAM: asked for on the CPU, an error.
    let e = one_line_error(&moeflux(&[
        "bench",
        "--model",
        m,
        "--backend",
        "cpu",
        "--direct-io",
        "--gds",
        "on",
    ]));
    assert!(e.contains("--gds on") && e.contains("GPU backend"), "{e}");
    let out = moeflux(&["bench", "--model", m, "--gds", "maybe"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("auto, on, off"));
}

/// `--prefetch` takes auto|on|off and, bare, means on: on the CPU `auto`
/// leaves prefetch off (no prefetch counters), `on` counts its hits.
#[test]
fn prefetch_modes() {
    let tmp = tempfile::tempdir().unwrap();
    let model = convert("qwen35moe-q4", tmp.path());
    let m = s(&model);
    let hit_rate = |mode: &[&str]| {
        let mut args = vec![
            "bench",
            "--model",
            m,
            "--backend",
            "cpu",
            "--prompt-len",
            "0",
            "--gen",
            "4",
            "--reps",
            "1",
            "--json",
        ];
        args.extend(mode);
        let v: serde_json::Value = serde_json::from_str(&ok(&moeflux(&args))).unwrap();
        v["decode"]["prefetch_hit_rate"].clone()
    };
    assert!(hit_rate(&[]).is_null());
    assert!(hit_rate(&["--prefetch", "off"]).is_null());
    assert!(hit_rate(&["--prefetch"]).as_f64().is_some());
    assert!(hit_rate(&["--prefetch", "on"]).as_f64().is_some());
    let out = moeflux(&["bench", "--model", m, "--prefetch", "maybe"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("not one of auto, on, off"));
}
