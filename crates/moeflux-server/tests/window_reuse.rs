//! Prefix reuse on gpt-oss, whose sliding-window layers keep only their
//! window (8 positions in the fixture) in the KV cache: a follow-up turn
//! returns to a checkpoint taken long before the rows its window needs were
//! dropped (a live slot), or restores a snapshot (the prefix cache), and
//! answers exactly as from scratch.

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use moeflux_server::{EngineOptions, PrefixCacheOptions, Server, ServerOptions};
use serde_json::{json, Value};
use tower::ServiceExt;

mod common;
use common::fixtures;

/// The gpt-oss fixture converted (its tokenizer config carries a ChatML
/// template).
fn gpt_oss_dir() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("tiny-gpt-oss");
    moeflux::convert::convert(&fixtures().join("gptoss-q4/src"), &dst, &Default::default())
        .unwrap();
    (tmp, dst)
}

fn server(dir: &Path, engine: EngineOptions) -> Server {
    common::open_dir(
        dir,
        ServerOptions {
            engine,
            ..Default::default()
        },
    )
    .unwrap()
}

async fn chat(s: &Server, messages: &Value, max_tokens: u32) -> Value {
    let body = json!({"model": "x", "messages": messages, "temperature": 0,
                      "max_tokens": max_tokens, "ignore_eos": true});
    let req = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = s.router().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v: Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpt_oss_follow_ups_reuse_past_the_window_and_answer_as_fresh() {
    let (_tmp, dir) = gpt_oss_dir();
    let fresh = server(
        &dir,
        EngineOptions {
            no_prefix_reuse: true,
            ..Default::default()
        },
    );
    let ways = [
        // Two slots, no prefix cache: the conversation stays live in its
        // slot and returns to the checkpoint at its prompt's end.
        (
            "live slot",
            EngineOptions {
                parallel: 2,
                prefix_cache: PrefixCacheOptions::default(),
                ..Default::default()
            },
        ),
        // One slot: the other conversation takes it; the snapshot at the
        // message boundary comes back.
        (
            "snapshot",
            EngineOptions {
                parallel: 1,
                ..Default::default()
            },
        ),
    ];
    for (way, engine) in ways {
        let s = server(&dir, engine);
        let mut a = vec![
            json!({"role": "system", "content": "You are a terse assistant. Answer in one line."}),
            json!({"role": "user", "content": "What is the capital of France? Explain why."}),
        ];
        // Far more tokens than the window after the checkpoint.
        let r1 = chat(&s, &json!(a), 24).await;
        let reply = r1["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        chat(
            &s,
            &json!([{"role": "user", "content": "Unrelated: boats?"}]),
            4,
        )
        .await;
        a.push(json!({"role": "assistant", "content": reply}));
        a.push(json!({"role": "user", "content": "And of Italy?"}));
        let r2 = chat(&s, &json!(a), 12).await;
        let f2 = chat(&fresh, &json!(a), 12).await;
        assert_eq!(
            r2["choices"][0]["message"], f2["choices"][0]["message"],
            "{way}: reused and fresh answers differ"
        );
        let cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let prompt = r2["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached >= 16 && cached < prompt,
            "{way}: cached {cached} of {prompt}"
        );
    }
}
