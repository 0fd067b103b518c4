//! Low-width copies of the routed experts (`convert::low_width`,
//! `SessionOptions::low_width_experts`): what the copies hold against the
//! experts they copy, a session that runs them, the snapshots they leave
//! loadable, and the refusals.

mod common;

use common::convert_fixture;
use moeflux::convert::low_width::write_low_width_copies;
use moeflux::format::{ExpertLayer, Manifest, MANIFEST_FILE};
use moeflux::model::moe::ExpertLayout;
use moeflux::model::Model;
use moeflux::quant::Weight;
use moeflux::{LogitsMode, Session, SessionOptions};

fn no_progress(_: usize, _: usize) {}

/// Every weight of every expert of `el` (original) and `low` (its copy),
/// dequantized: each copied weight is the point of its group's 2-bit grid
/// (the copy's scale and bias: `bias + k scale`, k = 0..3) nearest to the
/// original (up to the bf16 rounding of scale and bias, which MLX applies
/// after choosing the codes), and the grid spans most of the group's range.
fn copies_follow_the_experts(dir: &std::path::Path, el: &ExpertLayer, low: &ExpertLayer) {
    let (_, config) = Model::read_dir(dir).unwrap();
    let path = dir.join(MANIFEST_FILE);
    let full = ExpertLayout::from_manifest(el, &config, &path).unwrap();
    let lowl = ExpertLayout::from_manifest(low, &config, &path).unwrap();
    let a = std::fs::read(dir.join(&el.file)).unwrap();
    let b = std::fs::read(dir.join(&low.file)).unwrap();
    assert_eq!(b.len() as u64, low.num_experts as u64 * low.stride);
    let (mut err, mut range) = (0.0f64, 0.0f64);
    for e in 0..el.num_experts {
        // Copied into fresh (aligned) buffers: the views cast in place.
        let mut xa = vec![0u32; el.stride as usize / 4];
        let mut xb = vec![0u32; low.stride as usize / 4];
        bytemuck::cast_slice_mut(&mut xa)
            .copy_from_slice(&a[e * el.stride as usize..(e + 1) * el.stride as usize]);
        bytemuck::cast_slice_mut(&mut xb)
            .copy_from_slice(&b[e * low.stride as usize..(e + 1) * low.stride as usize]);
        let (xa, xb): (&[u8], &[u8]) = (bytemuck::cast_slice(&xa), bytemuck::cast_slice(&xb));
        for (c, lc) in [
            (&full.gate, &lowl.gate),
            (&full.up, &lowl.up),
            (&full.down, &lowl.down),
        ] {
            let (Weight::Quantized(q), Weight::Quantized(ql)) = (c.view(xa), lc.view(xb)) else {
                panic!("affine experts")
            };
            assert_eq!((ql.spec.bits, ql.spec.group_size), (2, q.spec.group_size));
            let (rows, cols, gs) = (q.rows, q.cols, q.spec.group_size);
            let groups = cols / gs;
            let mut w = vec![0.0f32; cols];
            let mut wl = vec![0.0f32; cols];
            for r in 0..rows {
                q.dequantize_row(r, &mut w);
                ql.dequantize_row(r, &mut wl);
                for g in 0..groups {
                    let (sc, bi) = (ql.scales.get(r * groups + g), ql.biases.get(r * groups + g));
                    let grp = g * gs..(g + 1) * gs;
                    let lo = w[grp.clone()].iter().cloned().fold(f32::INFINITY, f32::min);
                    let hi = w[grp.clone()]
                        .iter()
                        .cloned()
                        .fold(f32::NEG_INFINITY, f32::max);
                    let ends = [bi, bi + 3.0 * sc];
                    let span = (ends[0] - ends[1]).abs();
                    assert!(
                        span >= 0.6 * (hi - lo),
                        "expert {e} row {r} group {g}: grid spans {span}, the weights {}",
                        hi - lo
                    );
                    let tol = 0.02 * sc.abs() + 1e-7;
                    for j in grp {
                        let nearest = (0..4)
                            .map(|k| (bi + k as f32 * sc - w[j]).abs())
                            .fold(f32::INFINITY, f32::min);
                        let d = (wl[j] - w[j]).abs();
                        assert!(
                            d <= nearest + tol,
                            "expert {e} row {r} col {j}: {} copied as {}, nearest grid point \
                             {nearest} away",
                            w[j],
                            wl[j]
                        );
                        err += d as f64;
                    }
                    range += (hi - lo) as f64 * gs as f64;
                }
            }
        }
    }
    eprintln!(
        "layer {}: mean |w - copy| = {:.3} of the groups' ranges",
        el.layer,
        err / range
    );
}

#[test]
fn copies_are_written_checked_and_run_in_place_of_the_experts() {
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let before = std::fs::read(dir.join(MANIFEST_FILE)).unwrap();
    // A snapshot taken before the copies exist.
    let toks: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 200).collect();
    let mut full = Session::open(&dir, SessionOptions::default()).unwrap();
    full.eval(&toks[..16], LogitsMode::Last).unwrap();
    let snap = full.state_save().unwrap();
    let want = full.eval(&toks[16..], LogitsMode::All).unwrap();

    let m = write_low_width_copies(&dir, 2, &no_progress).unwrap();
    assert_eq!(m.low_width_experts.len(), m.experts.len());
    let read = Manifest::read(&dir.join(MANIFEST_FILE)).unwrap();
    assert_eq!(read, m, "the manifest on disk is the one returned");
    for (el, low) in m.experts.iter().zip(&m.low_width_experts) {
        assert_eq!(el.layer, low.layer);
        assert!(low.file.starts_with("experts/low2/"), "{}", low.file);
        assert!(low.expert_bytes < el.expert_bytes);
        copies_follow_the_experts(&dir, el, low);
    }
    // Writing them again replaces them (same bytes: the copies are of the
    // experts, not of earlier copies).
    let first = std::fs::read(dir.join(&m.low_width_experts[0].file)).unwrap();
    write_low_width_copies(&dir, 2, &no_progress).unwrap();
    assert_eq!(
        std::fs::read(dir.join(&m.low_width_experts[0].file)).unwrap(),
        first
    );

    // The full-width session is as before; the snapshot still loads.
    let mut full = Session::open(&dir, SessionOptions::default()).unwrap();
    full.state_load(&snap).unwrap();
    assert_eq!(full.eval(&toks[16..], LogitsMode::All).unwrap(), want);

    // The copies in place of the experts: other logits, close to them.
    let low_opts = || SessionOptions {
        low_width_experts: true,
        ..Default::default()
    };
    let mut low = Session::open(&dir, low_opts()).unwrap();
    let got = low.eval(&toks, LogitsMode::Last).unwrap();
    let mut again = Session::open(&dir, SessionOptions::default()).unwrap();
    let base = again.eval(&toks, LogitsMode::Last).unwrap();
    assert!(got.iter().all(|x| x.is_finite()));
    assert_ne!(got, base, "the copies changed nothing");
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    eprintln!(
        "last-token argmax full {} / low-width {}",
        argmax(&base),
        argmax(&got)
    );
    // A snapshot is bound to the width it was taken at.
    let err = low.state_load(&snap).unwrap_err().to_string();
    assert!(!err.is_empty());
    assert!(
        std::fs::read(dir.join(MANIFEST_FILE)).unwrap() != before,
        "the copies are listed"
    );
}

#[test]
fn refusals_name_what_is_missing_or_wrong() {
    let (_tmp, dir) = convert_fixture("qwen35moe-q4/src", None);
    let err = Session::open(
        &dir,
        SessionOptions {
            low_width_experts: true,
            ..Default::default()
        },
    )
    .err()
    .expect("no copies")
    .to_string();
    assert!(
        err.contains("no low-width copies") && err.contains("--low-width-copies"),
        "{err}"
    );
    let err = write_low_width_copies(&dir, 4, &no_progress)
        .unwrap_err()
        .to_string();
    assert!(err.contains("choose one of"), "{err}");
    let (_tmp2, two) = convert_fixture("qwen35moe-q4/src", Some(2));
    let err = write_low_width_copies(&two, 2, &no_progress)
        .unwrap_err()
        .to_string();
    assert!(err.contains("2-bit already"), "{err}");
    let (_tmp3, mx) = convert_fixture("gptoss-mxfp4/src", None);
    let err = write_low_width_copies(&mx, 2, &no_progress)
        .unwrap_err()
        .to_string();
    assert!(err.contains("MXFP4"), "{err}");
    // Nothing was written by the refusals.
    for d in [&dir, &two, &mx] {
        assert!(!d.join("experts/low2").exists());
        let m = Manifest::read(&d.join(MANIFEST_FILE)).unwrap();
        assert!(m.low_width_experts.is_empty());
    }
}
