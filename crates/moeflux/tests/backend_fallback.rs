//! A model the GPU backend cannot run is `Error::Unsupported`, decided from
//! the model before any GPU is opened: `--backend cuda` fails with it (GPU
//! or not), `--backend auto` runs on the CPU and says why.

mod common;

use moeflux::synth::{synth, SynthOptions, SynthSpec};
use moeflux::{Backend, Error, LogitsMode, Session, SessionOptions};

/// A small Qwen3.5 model whose GatedDeltaNet heads are 48 wide (the GPU
/// kernels take multiples of 32).
fn narrow_deltanet_model(dst: &std::path::Path) {
    let SynthSpec::Qwen3_5Moe(mut shape) = common::small_moe_spec() else {
        unreachable!("small_moe_spec is a Qwen3.5 shape")
    };
    shape.linear_head_dim = 48;
    shape.linear_v_heads = 4; // the value width (4 x 48) a multiple of the group size
    synth(
        dst,
        &SynthOptions::new("narrow", SynthSpec::Qwen3_5Moe(shape)),
    )
    .unwrap();
}

fn open(dir: &std::path::Path, backend: Backend) -> moeflux::Result<Session> {
    Session::open(
        dir,
        SessionOptions {
            backend,
            threads: Some(2),
            ..Default::default()
        },
    )
}

#[test]
fn cuda_refuses_an_unsupported_model_and_auto_falls_back_to_the_cpu() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("narrow");
    narrow_deltanet_model(&dir);

    let err = open(&dir, Backend::Cuda).err().expect("cuda must refuse");
    match &err {
        Error::Unsupported { what, backend } => {
            assert_eq!(*backend, "cuda");
            assert!(what.contains("value head dim 48"), "{what}");
        }
        other => panic!("expected Error::Unsupported, got {other:?}"),
    }
    assert!(err
        .to_string()
        .contains("cuda backend cannot run this model"));

    let mut s = open(&dir, Backend::Auto).unwrap();
    assert!(!s.on_gpu());
    let why = s
        .gpu_unsupported()
        .expect("auto says why it runs on the CPU");
    assert!(why.contains("value head dim 48"), "{why}");
    assert!(s.backend().starts_with("cpu ("), "{}", s.backend());
    let logits = s.eval(&[1, 2, 3], LogitsMode::Last).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));

    // A model the GPU can run: auto has nothing to explain (no GPU here,
    // or a GPU that runs it).
    let ok = tmp.path().join("ok");
    synth(&ok, &SynthOptions::new("ok", common::small_moe_spec())).unwrap();
    assert!(open(&ok, Backend::Auto)
        .unwrap()
        .gpu_unsupported()
        .is_none());
}

/// `--gds on` asks for reads into GPU memory: on the CPU it is an error
/// naming the option, not silently ignored.
#[test]
fn gds_on_needs_the_gpu_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    synth(&dir, &SynthOptions::new("m", common::small_moe_spec())).unwrap();
    let open = |gds| {
        Session::open(
            &dir,
            SessionOptions {
                backend: Backend::Cpu,
                direct_io: true,
                gds,
                threads: Some(2),
                ..Default::default()
            },
        )
    };
    let err = open(moeflux::session::Gds::On).err().expect("refused");
    assert!(err.to_string().contains("--gds on"), "{err}");
    assert!(open(moeflux::session::Gds::Auto).is_ok());
}
