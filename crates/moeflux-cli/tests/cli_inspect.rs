//! `moeflux inspect` checks the files it describes: a directory that cannot
//! load is one `error:` line naming the file and field, exit status 1.

mod common;

use std::path::Path;

use common::*;

/// Rewrites moeflux.json through `edit` on its JSON.
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("moeflux.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

fn truncate(p: &Path, by: u64) {
    let len = std::fs::metadata(p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len - by)
        .unwrap();
}

/// `inspect` fails naming every one of `want`.
fn inspect_fails(dir: &Path, want: &[&str]) {
    let line = one_line_error(&moeflux(&["inspect", s(dir)]));
    assert!(line.contains("cannot be loaded"), "{line}");
    for w in want {
        assert!(line.contains(w), "`{w}` not in: {line}");
    }
    // --json too: nothing on stdout for a directory that cannot load.
    let out = moeflux(&["inspect", "--json", s(dir)]);
    one_line_error(&out);
    assert!(out.stdout.is_empty());
}

#[test]
fn inspect_refuses_what_cannot_load() {
    let t = tempfile::tempdir().unwrap();
    let fresh = |name: &str| {
        let d = t.path().join(name);
        std::fs::create_dir(&d).unwrap();
        convert("qwen35moe-q4", &d)
    };

    let dir = fresh("huge_layer");
    ok(&moeflux(&["inspect", s(&dir)]));
    edit_manifest(&dir, |m| {
        m["experts"][0]["layer"] = 1_000_000_000_000_000u64.into()
    });
    inspect_fails(&dir, &["moeflux.json", "experts[0].layer"]);

    let dir = fresh("outside");
    edit_manifest(&dir, |m| m["experts"][2]["file"] = "/etc/passwd".into());
    inspect_fails(&dir, &["experts[2].file", "absolute"]);

    let dir = fresh("overlap");
    edit_manifest(&dir, |m| {
        let c = &mut m["experts"][0]["components"];
        c[2]["scales"]["offset"] = c[2]["weight"]["offset"].clone();
    });
    inspect_fails(&dir, &["experts of layer 0", "overlaps"]);

    let dir = fresh("short_expert_file");
    truncate(&dir.join("experts/layer_003.bin"), 4096);
    inspect_fails(&dir, &["layer_003.bin", "expected"]);

    let dir = fresh("short_dense_file");
    truncate(&dir.join("dense.safetensors"), 1);
    inspect_fails(&dir, &["dense.safetensors"]);

    let dir = fresh("dtype");
    edit_manifest(&dir, |m| {
        m["tensors"]["model.norm.weight"]["dtype"] = "F32".into()
    });
    inspect_fails(&dir, &["model.norm.weight", "dtype"]);
}
