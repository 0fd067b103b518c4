//! Per-block traces (`Session::eval_traced`): every block in evaluation
//! order with its shape, the logits equal to the eval's, a token's rows
//! bit-identical whether it was evaluated in a batch or alone (the CPU's
//! batch independence, now per block), and the `.npy` files they are
//! written as.

mod common;

use common::{convert_fixture, fixtures, open, Golden};
use moeflux::LogitsMode;

#[test]
fn a_trace_names_every_block_and_its_rows_do_not_depend_on_the_batch() {
    let golden = Golden::load(&fixtures().join("qwen3next-q4"));
    let (_tmp, dir) = convert_fixture("qwen3next-q4/src", None);
    let toks = &golden.tokens[..10];
    let mut s = open(&dir);
    let (c, vocab) = (s.config().clone(), s.vocab_size());
    let (logits, trace) = s.eval_traced(toks, LogitsMode::All).unwrap();
    assert_eq!(
        logits,
        open(&dir).eval(toks, LogitsMode::All).unwrap(),
        "tracing changes nothing"
    );

    // embed, 4 blocks per layer, logits; the mixer and MLP names by kind.
    assert_eq!(trace.entries.len(), 2 + 4 * c.num_layers);
    let names: Vec<String> = trace.entries.iter().map(|e| e.name()).collect();
    assert_eq!(names[0], "embed");
    assert_eq!(
        names[1..5],
        [
            "L000.attn_norm",
            "L000.gated_deltanet",
            "L000.mlp_norm",
            "L000.moe"
        ]
    );
    // qwen3next-q4: layers linear, full, linear, full; layer 2 a dense MLP.
    assert!(names.contains(&"L001.full_attention".to_string()));
    assert!(names.contains(&"L002.dense_mlp".to_string()));
    assert_eq!(names.last().unwrap(), "logits");
    for e in &trace.entries {
        let cols = if e.block == "logits" {
            vocab
        } else {
            c.hidden_size
        };
        assert_eq!((e.rows, e.cols), (toks.len(), cols), "{}", e.name());
        assert_eq!(e.data.len(), e.rows * e.cols);
        assert!(e.data.iter().all(|v| v.is_finite()), "{}", e.name());
        assert!(e.data.iter().any(|&v| v != 0.0), "{} is all zero", e.name());
    }
    assert_eq!(trace.get(None, "logits").unwrap().data, logits);

    // The same tokens one at a time: each step's trace is that token's
    // row of every block of the batch's, bit for bit.
    let mut inc = open(&dir);
    for (t, &tok) in toks.iter().enumerate() {
        let (_, step) = inc.eval_traced(&[tok], LogitsMode::Last).unwrap();
        assert_eq!(step.entries.len(), trace.entries.len());
        for (a, b) in step.entries.iter().zip(&trace.entries) {
            assert_eq!(a.name(), b.name());
            assert_eq!(a.rows, 1);
            let row = &b.data[t * b.cols..(t + 1) * b.cols];
            assert!(a.data == row, "token {t}: block {} differs", a.name());
        }
    }
}

#[test]
fn a_trace_is_written_as_npy_files_with_an_index() {
    let golden = Golden::load(&fixtures().join("glm4moe-q4"));
    let (tmp, dir) = convert_fixture("glm4moe-q4/src", None);
    let toks = &golden.tokens[..6];
    let (_, trace) = open(&dir).eval_traced(toks, LogitsMode::Last).unwrap();
    let out = tmp.path().join("trace");
    trace.write_dir(&out).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let blocks = index["blocks"].as_array().unwrap();
    assert_eq!(blocks.len(), trace.entries.len());
    assert_eq!(index["tokens"], 6);
    for (b, e) in blocks.iter().zip(&trace.entries) {
        let file = b["file"].as_str().unwrap();
        assert!(file.ends_with(&format!("{}.npy", e.name())), "{file}");
        let bytes = std::fs::read(out.join(file)).unwrap();
        let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
        assert_eq!(npy.shape(), [e.rows as u64, e.cols as u64]);
        let data: Vec<f32> = npy.into_vec().unwrap();
        assert!(data == e.data, "{file}");
    }
    // GLM: attention layers only; the logits of the last token.
    assert_eq!(trace.get(Some(0), "full_attention").unwrap().rows, 6);
    assert_eq!(trace.get(None, "logits").unwrap().rows, 1);
}
