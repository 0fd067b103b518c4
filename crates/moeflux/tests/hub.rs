//! `hub::pull` against a local Hub stand-in (tests/support/hub_server.rs)
//! serving the committed fixture checkpoints: download into the Hugging
//! Face cache layout, convert once, reuse; resume; token; errors; offline.

#[path = "support/hub_server.rs"]
mod hub_server;

use std::path::{Path, PathBuf};

use hub_server::{etag_of, HubServer};
use moeflux::hub::{pull, HubConfig, PullOptions, RepoSpec};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .join("src")
}

fn cfg(server: &HubServer, root: &Path) -> HubConfig {
    HubConfig {
        endpoint: server.endpoint(),
        cache_dir: root.join("hf"),
        token: None,
        offline: false,
        models_dir: root.join("models"),
        parallel: 4,
        retries: 2,
    }
}

fn spec(s: &str) -> RepoSpec {
    RepoSpec::parse(s).unwrap()
}

fn err(r: moeflux::Result<moeflux::hub::Pulled>) -> String {
    r.expect_err("the pull should fail").to_string()
}

/// The pulled model is what `convert` makes of the fixture directly
/// (every file but the manifest, which records the source path).
fn assert_same_model(pulled: &Path, src: &Path) {
    let direct = tempfile::tempdir().unwrap();
    let dst = direct.path().join("m");
    moeflux::convert::convert(src, &dst, &Default::default()).unwrap();
    let mut names = Vec::new();
    for sub in ["", "experts"] {
        for e in std::fs::read_dir(dst.join(sub)).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_file() && e.file_name() != "moeflux.json" {
                names.push(Path::new(sub).join(e.file_name()));
            }
        }
    }
    assert!(names.len() > 3, "{names:?}");
    for n in names {
        assert!(
            std::fs::read(dst.join(&n)).unwrap() == std::fs::read(pulled.join(&n)).unwrap(),
            "{} differs from a direct conversion",
            n.display()
        );
    }
}

#[test]
fn pull_converts_once_and_reuses_with_the_hub_cache_layout() {
    let server = HubServer::start();
    let src = fixture("qwen35moe-q4");
    server.add_dir(
        "org/qwen-mlx",
        COMMIT,
        &src,
        &[
            ("README.md", b"# card"),
            ("pytorch_model.bin", b"not needed"),
        ],
    );
    let root = tempfile::tempdir().unwrap();
    let c = cfg(&server, root.path());
    let p = pull(&spec("org/qwen-mlx"), &c, &PullOptions::default()).unwrap();
    assert_eq!(p.commit, COMMIT);
    assert_eq!(
        p.dir,
        root.path()
            .join("models/org--qwen-mlx--".to_string() + COMMIT)
    );
    assert!(p.converted.is_some());
    assert_same_model(&p.dir, &src);
    let files = server.file_requests();
    assert!(
        !files
            .iter()
            .any(|f| f.contains("README") || f.contains(".bin")),
        "fetched a file convert does not read: {files:?}"
    );
    assert_eq!(p.fetched.files, 5, "{files:?}");

    // huggingface_hub's layout: refs/main holds the commit; every snapshot
    // file is a relative link to blobs/<etag>, the etag the Hub sent
    // (X-Linked-Etag = sha256 for LFS files, the ETag without W/ and quotes
    // for the others).
    let repo = root.path().join("hf/models--org--qwen-mlx");
    assert_eq!(
        std::fs::read_to_string(repo.join("refs/main")).unwrap(),
        COMMIT
    );
    let snap = repo.join("snapshots").join(COMMIT);
    let mut linked: Vec<String> = Vec::new();
    for e in std::fs::read_dir(&snap).unwrap() {
        let e = e.unwrap();
        let name = e.file_name().into_string().unwrap();
        let want = std::fs::read(src.join(&name)).unwrap();
        let target = std::fs::read_link(e.path()).unwrap();
        assert_eq!(
            target,
            PathBuf::from(format!("../../blobs/{}", etag_of(&name, &want))),
            "{name}"
        );
        assert!(std::fs::read(e.path()).unwrap() == want, "{name}");
        linked.push(name);
    }
    linked.sort();
    assert_eq!(
        linked,
        [
            "config.json",
            "model.safetensors",
            "model.safetensors.index.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    assert!(root.path().join("hf/.locks/models--org--qwen-mlx").is_dir());
    let blobs: Vec<_> = std::fs::read_dir(repo.join("blobs")).unwrap().collect();
    assert_eq!(blobs.len(), 5, "no .incomplete file left");

    // Second pull: the listing only, nothing downloaded, same directory.
    server.clear_requests();
    let again = pull(&spec("org/qwen-mlx"), &c, &PullOptions::default()).unwrap();
    assert_eq!(again.dir, p.dir);
    assert!(again.converted.is_none());
    assert_eq!(again.fetched.files, 0);
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert!(reqs[0]
        .path
        .starts_with("/api/models/org/qwen-mlx/revision/main"));

    // Offline: a fresh models directory converts from the cached snapshot
    // without a single request; a repo never pulled is a clear error.
    server.clear_requests();
    let mut off = c.clone();
    off.offline = true;
    off.endpoint = "http://127.0.0.1:9".into();
    off.models_dir = root.path().join("models-offline");
    let o = pull(&spec("org/qwen-mlx"), &off, &PullOptions::default()).unwrap();
    assert_eq!(o.commit, COMMIT);
    assert!(o.converted.is_some());
    assert_same_model(&o.dir, &src);
    let e = err(pull(&spec("org/other"), &off, &PullOptions::default()));
    assert!(e.contains("offline (HF_HUB_OFFLINE is set)"), "{e}");
    assert!(e.contains("revision `main`"), "{e}");
    assert!(server.requests().is_empty());
}

#[test]
fn hf_checkpoint_with_shards_pulls_and_converts() {
    let server = HubServer::start();
    let src = fixture("qwen3moe-hf");
    server.add_dir("org/qwen3-hf", COMMIT, &src, &[]);
    let root = tempfile::tempdir().unwrap();
    let p = pull(
        &spec(&format!("org/qwen3-hf@{COMMIT}")),
        &cfg(&server, root.path()),
        &PullOptions::default(),
    )
    .unwrap();
    assert_same_model(&p.dir, &src);
    // A commit id as the revision writes no ref.
    assert!(!root.path().join("hf/models--org--qwen3-hf/refs").exists());
}

#[test]
fn dropped_connection_resumes_with_a_range_request() {
    let server = HubServer::start();
    let src = fixture("qwen35moe-q4");
    server.add_dir("org/m", COMMIT, &src, &[]);
    server.drop_midway("org/m", "model.safetensors");
    let root = tempfile::tempdir().unwrap();
    let p = pull(
        &spec("org/m"),
        &cfg(&server, root.path()),
        &PullOptions::default(),
    )
    .unwrap();
    let gets: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.ends_with("/model.safetensors"))
        .collect();
    assert_eq!(gets.len(), 2, "{gets:?}");
    assert_eq!(gets[0].range, None);
    let want = std::fs::read(src.join("model.safetensors")).unwrap();
    assert_eq!(gets[1].range, Some(format!("bytes={}-", want.len() / 2)));
    assert!(std::fs::read(p.snapshot.join("model.safetensors")).unwrap() == want);
}

#[test]
fn interrupted_pull_resumes_in_the_next_run() {
    let server = HubServer::start();
    let src = fixture("qwen35moe-q4");
    server.add_dir("org/m", COMMIT, &src, &[]);
    server.drop_midway("org/m", "model.safetensors");
    let root = tempfile::tempdir().unwrap();
    let mut c = cfg(&server, root.path());
    c.retries = 0;
    let e = err(pull(&spec("org/m"), &c, &PullOptions::default()));
    assert!(e.contains("model.safetensors"), "{e}");
    let want = std::fs::read(src.join("model.safetensors")).unwrap();
    let etag = etag_of("model.safetensors", &want);
    let part = root
        .path()
        .join(format!("hf/models--org--m/blobs/{etag}.incomplete"));
    assert_eq!(
        std::fs::metadata(&part).unwrap().len(),
        want.len() as u64 / 2
    );
    assert!(!root
        .path()
        .join("models")
        .join(format!("org--m--{COMMIT}"))
        .exists());

    server.clear_requests();
    let p = pull(&spec("org/m"), &c, &PullOptions::default()).unwrap();
    let gets: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.contains("/resolve/"))
        .collect();
    assert_eq!(gets.len(), 1, "only the unfinished file: {gets:?}");
    assert_eq!(gets[0].range, Some(format!("bytes={}-", want.len() / 2)));
    assert!(!part.exists());
    assert!(std::fs::read(p.snapshot.join("model.safetensors")).unwrap() == want);
    assert_same_model(&p.dir, &src);
}

fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn gated_repo_needs_the_token_and_gets_it_on_every_request() {
    let server = HubServer::start();
    server.add_repo(
        "org/gated",
        COMMIT,
        files_of(&fixture("qwen35moe-q4")),
        Some("hf_secret"),
    );
    let root = tempfile::tempdir().unwrap();
    let mut c = cfg(&server, root.path());
    let e = err(pull(&spec("org/gated"), &c, &PullOptions::default()));
    assert!(
        e.contains("repo org/gated is gated or private (HTTP 401)"),
        "{e}"
    );
    assert!(e.contains("set HF_TOKEN"), "{e}");
    assert!(server.file_requests().is_empty());

    c.token = Some("hf_wrong".into());
    let e = err(pull(&spec("org/gated"), &c, &PullOptions::default()));
    assert!(
        e.contains("the token (HF_TOKEN or the saved login) was refused"),
        "{e}"
    );

    server.clear_requests();
    c.token = Some("hf_secret".into());
    pull(&spec("org/gated"), &c, &PullOptions::default()).unwrap();
    let reqs = server.requests();
    assert!(reqs.len() > 5);
    for r in reqs {
        assert_eq!(
            r.auth.as_deref(),
            Some("Bearer hf_secret"),
            "{} {}",
            r.method,
            r.path
        );
    }
}

#[test]
fn missing_repo_and_revision_are_named() {
    let server = HubServer::start();
    server.add_dir("org/m", COMMIT, &fixture("qwen35moe-q4"), &[]);
    let root = tempfile::tempdir().unwrap();
    let c = cfg(&server, root.path());
    let e = err(pull(&spec("org/nothing"), &c, &PullOptions::default()));
    assert!(
        e.contains("org/nothing: repo org/nothing not found on http://127.0.0.1:"),
        "{e}"
    );
    assert!(e.contains("HTTP 404"), "{e}");
    let e = err(pull(&spec("org/m@nope"), &c, &PullOptions::default()));
    assert!(e.contains("revision `nope` of org/m not found"), "{e}");
    let e = err(pull(
        &spec("org/m"),
        &HubConfig {
            endpoint: "http://127.0.0.1:9".into(),
            ..c.clone()
        },
        &PullOptions::default(),
    ));
    assert!(e.contains("HF_HUB_OFFLINE=1 uses the cache only"), "{e}");
}

#[test]
fn unsupported_model_is_refused_before_any_weight_is_fetched() {
    let server = HubServer::start();
    let mut files = files_of(&fixture("qwen35moe-q4"));
    for (name, bytes) in &mut files {
        if name == "config.json" {
            let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
            v["model_type"] = "llama".into();
            *bytes = serde_json::to_vec(&v).unwrap();
        }
    }
    server.add_repo("org/llama", COMMIT, files, None);
    let root = tempfile::tempdir().unwrap();
    let e = err(pull(
        &spec("org/llama"),
        &cfg(&server, root.path()),
        &PullOptions::default(),
    ));
    assert!(e.contains("not a model moeflux can run"), "{e}");
    assert!(e.contains("unsupported model_type `llama`"), "{e}");
    let fetched = server.file_requests();
    assert!(
        fetched.contains(&"GET config.json".to_string()),
        "{fetched:?}"
    );
    assert!(
        !fetched
            .iter()
            .any(|f| f.contains("safetensors\"") || f.ends_with(".safetensors")),
        "{fetched:?}"
    );
}

fn gguf_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/gguf")
        .join(name)
}

/// A GGUF repo as quantizers publish them: one quant as a single file, one
/// split in a folder, a vision projector and a card beside them.
fn add_gguf_repo(server: &HubServer, repo: &str) {
    let read = |n: &str| std::fs::read(gguf_fixture(n)).unwrap();
    server.add_repo(
        repo,
        COMMIT,
        vec![
            ("README.md".into(), b"# card".to_vec()),
            ("Qwen3-Q4_1.gguf".into(), read("qwen3moe.gguf")),
            (
                "Q8_0/Qwen3-Q8_0-00001-of-00002.gguf".into(),
                read("qwen3moe-mixed-00001-of-00002.gguf"),
            ),
            (
                "Q8_0/Qwen3-Q8_0-00002-of-00002.gguf".into(),
                read("qwen3moe-mixed-00002-of-00002.gguf"),
            ),
            ("mmproj-F16.gguf".into(), b"GGUF not a model".to_vec()),
        ],
        None,
    );
}

#[test]
fn gguf_repo_pulls_the_chosen_quant_and_converts_it_once() {
    let server = HubServer::start();
    add_gguf_repo(&server, "org/qwen3-GGUF");
    let root = tempfile::tempdir().unwrap();
    let c = cfg(&server, root.path());
    let models = root.path().join("models");

    // The split Q8_0: its first 64 KiB (the architecture), then both parts.
    let p = pull(&spec("org/qwen3-GGUF:q8_0"), &c, &PullOptions::default()).unwrap();
    assert_eq!(
        p.dir,
        models.join(format!("org--qwen3-GGUF--{COMMIT}--Qwen3-Q8_0"))
    );
    let r = p.converted.as_ref().expect("converted");
    assert_eq!(r.architecture, "qwen3_moe");
    assert!(r.gguf_types.iter().any(|(t, _)| t == "MXFP4"), "{r:?}");
    assert_same_model(&p.dir, &gguf_fixture("qwen3moe-mixed-00001-of-00002.gguf"));
    let gets: Vec<_> = server
        .requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.contains("/resolve/"))
        .map(|r| (r.path.rsplit('/').next().unwrap().to_string(), r.range))
        .collect();
    let part = |i| format!("Qwen3-Q8_0-0000{i}-of-00002.gguf");
    assert_eq!(
        gets.iter()
            .filter(|g| g.1.is_some())
            .cloned()
            .collect::<Vec<_>>(),
        [(part(1), Some("bytes=0-65535".into()))]
    );
    let mut whole: Vec<String> = gets
        .into_iter()
        .filter(|g| g.1.is_none())
        .map(|g| g.0)
        .collect();
    whole.sort();
    assert_eq!(whole, [part(1), part(2)], "only the chosen quant's parts");
    let snap = root
        .path()
        .join("hf/models--org--qwen3-GGUF/snapshots")
        .join(COMMIT);
    assert!(snap.join("Q8_0").join(part(2)).is_file());
    assert!(!snap.join("Qwen3-Q4_1.gguf").exists());

    // The other quant converts beside it; again: reused, the listing only.
    let q4 = pull(&spec("org/qwen3-GGUF:Q4_1"), &c, &PullOptions::default()).unwrap();
    assert_eq!(
        q4.dir,
        models.join(format!("org--qwen3-GGUF--{COMMIT}--Qwen3-Q4_1"))
    );
    assert_same_model(&q4.dir, &gguf_fixture("qwen3moe.gguf"));
    assert!(p.dir.join("moeflux.json").is_file());
    server.clear_requests();
    let again = pull(&spec("org/qwen3-GGUF:Q8_0"), &c, &PullOptions::default()).unwrap();
    assert_eq!(again.dir, p.dir);
    assert!(again.converted.is_none());
    assert_eq!(server.requests().len(), 1, "{:?}", server.requests());

    // Without a quant, the choice is the user's.
    let e = err(pull(&spec("org/qwen3-GGUF"), &c, &PullOptions::default()));
    assert!(e.contains("choose one with org/qwen3-GGUF:QUANT"), "{e}");
    assert!(
        e.contains("Qwen3-Q4_1.gguf") && !e.contains("mmproj"),
        "{e}"
    );

    // Offline: from the snapshot alone, no request; a quant never pulled
    // is named with what the cache has.
    server.clear_requests();
    let off = HubConfig {
        offline: true,
        endpoint: "http://127.0.0.1:9".into(),
        models_dir: root.path().join("models-offline"),
        ..c.clone()
    };
    let o = pull(&spec("org/qwen3-GGUF:Q8_0"), &off, &PullOptions::default()).unwrap();
    assert!(o.converted.is_some());
    assert_same_model(&o.dir, &gguf_fixture("qwen3moe-mixed-00001-of-00002.gguf"));
    let e = err(pull(
        &spec("org/qwen3-GGUF:Q4_K_M"),
        &off,
        &PullOptions::default(),
    ));
    assert!(e.contains("offline (HF_HUB_OFFLINE is set)"), "{e}");
    assert!(
        e.contains("no GGUF file of quantization `Q4_K_M`") && e.contains("Qwen3-Q4_1.gguf"),
        "{e}"
    );
    assert!(server.requests().is_empty());
}

/// A GGUF header: version 3, no tensors, `general.architecture` = `arch`,
/// then `pad` bytes (the weights a pull must not fetch).
fn gguf_header(arch: &str, pad: usize) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let key = "general.architecture";
    b.extend((key.len() as u64).to_le_bytes());
    b.extend(key.as_bytes());
    b.extend(8u32.to_le_bytes());
    b.extend((arch.len() as u64).to_le_bytes());
    b.extend(arch.as_bytes());
    b.resize(b.len() + pad, 0);
    b
}

#[test]
fn gguf_of_an_unsupported_architecture_is_refused_before_its_weights() {
    let server = HubServer::start();
    server.add_repo(
        "org/llama-GGUF",
        COMMIT,
        vec![
            ("L-Q4_0.gguf".into(), gguf_header("llama", 200_000)),
            ("N-Q4_0.gguf".into(), gguf_header("qwen35moe", 200_000)),
            ("X-Q4_0.gguf".into(), vec![b'x'; 200_000]),
        ],
        None,
    );
    let root = tempfile::tempdir().unwrap();
    let c = cfg(&server, root.path());
    let e = err(pull(&spec("org/llama-GGUF:L"), &c, &PullOptions::default()));
    assert!(e.contains("not a model moeflux can run"), "{e}");
    assert!(e.contains("GGUF architecture `llama`"), "{e}");
    assert!(e.contains("qwen3moe, gpt-oss, glm4moe"), "{e}");
    let e = err(pull(&spec("org/llama-GGUF:N"), &c, &PullOptions::default()));
    assert!(
        e.contains("`qwen35moe`") && e.contains("Hugging Face or mlx-lm"),
        "{e}"
    );
    let e = err(pull(&spec("org/llama-GGUF:X"), &c, &PullOptions::default()));
    assert!(
        e.contains("X-Q4_0.gguf") && e.contains("not a GGUF file"),
        "{e}"
    );
    // Only first ranges were fetched; nothing was cached or converted.
    for r in server.requests() {
        if r.method == "GET" && r.path.contains("/resolve/") {
            assert_eq!(r.range.as_deref(), Some("bytes=0-65535"), "{}", r.path);
        }
    }
    assert!(!root
        .path()
        .join("hf/models--org--llama-GGUF/blobs")
        .exists());
    assert!(!root.path().join("models").exists());
}

#[test]
fn full_disk_during_download_is_a_clear_error() {
    let server = HubServer::start();
    let src = fixture("qwen35moe-q4");
    server.add_dir("org/m", COMMIT, &src, &[]);
    let root = tempfile::tempdir().unwrap();
    // The partial file is /dev/full: every write fails with ENOSPC.
    let want = std::fs::read(src.join("model.safetensors")).unwrap();
    let blobs = root.path().join("hf/models--org--m/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let part = blobs.join(format!(
        "{}.incomplete",
        etag_of("model.safetensors", &want)
    ));
    std::os::unix::fs::symlink("/dev/full", &part).unwrap();
    let e = err(pull(
        &spec("org/m"),
        &cfg(&server, root.path()),
        &PullOptions::default(),
    ));
    assert!(
        e.contains("disk full while downloading `model.safetensors`"),
        "{e}"
    );
    assert!(!root
        .path()
        .join("models")
        .join(format!("org--m--{COMMIT}"))
        .exists());
}

/// Every entry of a cache folder (not `.locks`): path -> link target, or
/// the file's bytes.
fn tree(dir: &Path) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.file_type().is_symlink() {
                out.insert(
                    rel,
                    format!("-> {}", std::fs::read_link(&p).unwrap().display()),
                );
            } else if m.is_dir() {
                stack.push(p);
            } else {
                out.insert(rel, hub_server::sha256_hex(&std::fs::read(&p).unwrap()));
            }
        }
    }
    out
}

/// Python's `huggingface_hub` downloading the same files from the same
/// server writes the same cache, entry for entry. Run by hand:
/// `MOEFLUX_HF_PYTHON=/path/to/python cargo test -p moeflux --features hub
/// --test hub -- --ignored` (a Python with `huggingface_hub` installed).
#[test]
#[ignore = "needs MOEFLUX_HF_PYTHON, a Python with huggingface_hub"]
fn huggingface_hub_writes_the_same_cache() {
    let python = std::env::var("MOEFLUX_HF_PYTHON").expect("MOEFLUX_HF_PYTHON");
    let server = HubServer::start();
    server.add_dir(
        "org/m",
        COMMIT,
        &fixture("qwen35moe-q4"),
        &[("README.md", b"# card")],
    );
    let root = tempfile::tempdir().unwrap();
    let p = pull(
        &spec("org/m"),
        &cfg(&server, root.path()),
        &PullOptions::default(),
    )
    .unwrap();
    let files: Vec<String> = std::fs::read_dir(&p.snapshot)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    let py_cache = root.path().join("py");
    let script = format!(
        "from huggingface_hub import hf_hub_download\n\
         for f in {:?}: hf_hub_download('org/m', f, cache_dir={:?})\n",
        files,
        py_cache.to_str().unwrap(),
    );
    let out = std::process::Command::new(python)
        .args(["-c", &script])
        .env("HF_ENDPOINT", server.endpoint())
        .env("HF_HUB_DISABLE_XET", "1")
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_OFFLINE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours = tree(&root.path().join("hf/models--org--m"));
    let theirs = tree(&py_cache.join("models--org--m"));
    // 5 blobs, 5 snapshot links, refs/main.
    assert_eq!(ours.len(), 11, "{ours:?}");
    assert_eq!(ours, theirs);
}
