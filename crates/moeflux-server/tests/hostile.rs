//! Hostile clients and files, through real sockets (`Server::serve` on
//! 127.0.0.1:0, raw HTTP/1.1): floods refused before any tokenizer work,
//! slow and idle connections closed, `/health` answering with the
//! connection cap reached, the `Authorization` header, and prefix-cache
//! spill directories shared between servers or tampered with. The model is
//! the converted `qwen35moe-q4` fixture (random weights).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use moeflux_server::{EngineOptions, PrefixCacheOptions, ServerOptions};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

mod common;
use common::open;

/// A server on a free port; it stops when the returned sender is dropped.
async fn serve(opts: ServerOptions) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let server = open(opts).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.serve(listener, async {
        let _ = rx.await;
    }));
    (addr, tx)
}

struct Reply {
    status: u16,
    head: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::String(self.body.clone()))
    }
}

fn parse(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw).into_owned();
    let split = text
        .find("\r\n\r\n")
        .unwrap_or_else(|| panic!("no head in {text:?}"));
    let (head, rest) = (text[..split].to_string(), &text[split + 4..]);
    let status = head[9..12].parse().unwrap();
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut r = rest;
        while let Some(i) = r.find("\r\n") {
            let n = usize::from_str_radix(r[..i].trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            out.push_str(&r[i + 2..i + 2 + n]);
            r = &r[i + 2 + n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    Reply { status, head, body }
}

/// One request on a fresh connection, read to its end.
async fn send(addr: SocketAddr, method: &str, path: &str, extra: &str, body: &str) -> Reply {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{extra}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    parse(&out)
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    send(addr, "GET", path, "", "").await
}

async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let m = get(addr, "/metrics").await.body;
    m.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in {m}"))
        .parse()
        .unwrap()
}

fn greedy(messages: Value, max_tokens: u32) -> Value {
    json!({"messages": messages, "temperature": 0, "max_tokens": max_tokens,
           "chat_template_kwargs": {"enable_thinking": false}})
}

async fn chat(addr: SocketAddr, body: &Value) -> Value {
    let r = send(addr, "POST", "/v1/chat/completions", "", &body.to_string()).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()
}

/// Waits until `closed` reads end-of-stream (or an error) on `s`, at most
/// `limit`; the time it took.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout_at((t0 + limit).into(), s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(t0.elapsed()),
            Ok(Ok(_)) => {}
        }
    }
}

// ---- 1. Work before admission -------------------------------------------

/// With the engine busy and no room in the queue, a flood of large prompts
/// gets 429 at once, and none of them reaches the tokenizer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flood_with_a_full_queue_is_refused_before_tokenizing() {
    let (addr, _stop) = serve(ServerOptions {
        engine: EngineOptions {
            max_queue: 0,
            parallel: 1,
            prefix_cache: PrefixCacheOptions::default(),
            event_delay: Duration::from_millis(5),
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    // A long stream keeps the engine's one place.
    let mut long = greedy(
        json!([{"role": "user", "content": "Tell a long story"}]),
        2000,
    );
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let body = long.to_string();
    let mut busy = TcpStream::connect(addr).await.unwrap();
    busy.write_all(
        format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let mut first = [0u8; 64];
    let n = busy.read(&mut first).await.unwrap();
    assert!(first[..n].starts_with(b"HTTP/1.1 200"));
    assert_eq!(metric(addr, "moeflux_prompts_tokenized_total").await, 1.0);

    let big = "lorem ipsum dolor sit amet ".repeat(120_000); // 3.2 MB
    let flood = greedy(json!([{"role": "user", "content": big}]), 4).to_string();
    let t0 = Instant::now();
    let replies = futures_join(
        (0..8)
            .map(|_| {
                let f = flood.clone();
                tokio::spawn(
                    async move { send(addr, "POST", "/v1/chat/completions", "", &f).await },
                )
            })
            .collect(),
    )
    .await;
    for r in &replies {
        assert_eq!(r.status, 429, "{}", r.body);
        assert!(r.head.to_ascii_lowercase().contains("retry-after"));
    }
    assert_eq!(
        metric(addr, "moeflux_prompts_tokenized_total").await,
        1.0,
        "a refused prompt was tokenized"
    );
    eprintln!("8 refusals in {:?}", t0.elapsed());
}

async fn futures_join(handles: Vec<tokio::task::JoinHandle<Reply>>) -> Vec<Reply> {
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

/// A prompt whose byte count alone cannot fit the context is refused
/// without tokenizing it (chat and completions); one that fits is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompt_too_long_from_its_bytes_is_not_tokenized() {
    let (addr, _stop) = serve(ServerOptions::default()).await;
    let big = "lorem ipsum dolor sit amet ".repeat(100_000); // 2.7 MB, context 2048
    let r = send(
        addr,
        "POST",
        "/v1/chat/completions",
        "",
        &greedy(json!([{"role": "user", "content": big}]), 4).to_string(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    let r = send(
        addr,
        "POST",
        "/v1/completions",
        "",
        &json!({"prompt": big, "max_tokens": 4}).to_string(),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
    assert_eq!(metric(addr, "moeflux_prompts_tokenized_total").await, 0.0);
    chat(addr, &greedy(json!([{"role": "user", "content": "hi"}]), 2)).await;
    assert_eq!(metric(addr, "moeflux_prompts_tokenized_total").await, 1.0);
}

// ---- 2. Slow clients ----------------------------------------------------

/// Headers trickled a byte at a time are cut off after the header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_headers_are_closed_after_the_header_timeout() {
    let (addr, _stop) = serve(ServerOptions {
        header_timeout: Duration::from_secs(1),
        idle_timeout: Duration::from_secs(30),
        ..Default::default()
    })
    .await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    let t0 = Instant::now();
    let trickle =
        b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    let mut closed = false;
    for b in trickle {
        if s.write_all(&[*b]).await.is_err() {
            closed = true;
            break;
        }
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(_)) | Err(_) => {}
        }
    }
    let took = t0.elapsed();
    assert!(closed, "still open after {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // The server still answers others.
    assert_eq!(get(addr, "/health").await.status, 200);
}

/// A connection that sends nothing is closed after the idle timeout, and
/// so is a kept-alive one after its response; a body that does not come
/// gets 408 after the body timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_and_slow_bodies_time_out() {
    let (addr, _stop) = serve(ServerOptions {
        header_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(1),
        body_timeout: Duration::from_secs(1),
        ..Default::default()
    })
    .await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let took = closed_within(&mut silent, Duration::from_secs(8)).await;
    assert!(
        took.is_some_and(|t| t >= Duration::from_millis(900)),
        "{took:?}"
    );

    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let took = closed_within(&mut kept, Duration::from_secs(8)).await;
    assert!(took.is_some(), "a kept-alive connection was never closed");

    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    )
    .await
    .unwrap();
    let mut out = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(8), slow.read_to_end(&mut out)).await;
    assert!(read.is_ok(), "the slow body was never answered");
    let r = parse(&out);
    assert_eq!(r.status, 408, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "request_timeout");
}

/// With every connection place taken by idle clients, a new connection
/// still gets `/health` (and 503 elsewhere); once a place frees, the API
/// answers again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_with_the_connection_cap_reached() {
    let (addr, _stop) = serve(ServerOptions {
        max_connections: 2,
        header_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .await;
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    // Until both are accepted, /metrics may itself take a place.
    let t0 = Instant::now();
    loop {
        let r = get(addr, "/metrics").await;
        if r.status == 200 && r.body.contains("moeflux_connections_open 2\n") {
            break;
        }
        if r.status == 503 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", r.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = get(addr, "/health").await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["status"], "ok");
    let r = get(addr, "/v1/models").await;
    assert_eq!(r.status, 503, "{}", r.body);
    assert!(r.head.to_ascii_lowercase().contains("retry-after"));
    drop(held.pop());
    let t0 = Instant::now();
    while get(addr, "/v1/models").await.status != 200 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no place freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Graceful shutdown still works with the hand-written accept loop: serve
/// returns once the signal comes and the connections are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_stops_on_its_shutdown_signal() {
    let server = open(ServerOptions::default()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.serve(listener, async {
        let _ = rx.await;
    }));
    assert_eq!(get(addr, "/health").await.status, 200);
    // An idle kept-alive connection does not hold the shutdown up.
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let _ = idle.read(&mut buf).await.unwrap();
    tx.send(()).unwrap();
    let done = tokio::time::timeout(Duration::from_secs(10), task).await;
    assert!(matches!(done, Ok(Ok(Ok(())))), "{done:?}");
}

// ---- 3. Authentication ---------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_scheme_any_case_and_empty_keys_refused() {
    for bad in ["", "   ", "\t"] {
        let e = open(ServerOptions {
            api_key: Some(bad.into()),
            ..Default::default()
        })
        .err()
        .expect("an empty API key was accepted");
        assert!(e.contains("empty"), "{e}");
    }
    let (addr, _stop) = serve(ServerOptions {
        api_key: Some("sekrit".into()),
        ..Default::default()
    })
    .await;
    for (auth, want) in [
        ("", 401),
        ("Authorization: Bearer wrong\r\n", 401),
        ("Authorization: Bearer sekri\r\n", 401),
        ("Authorization: Basic sekrit\r\n", 401),
        ("Authorization: sekrit\r\n", 401),
        ("Authorization: Bearer sekrit\r\n", 200),
        ("Authorization: bearer sekrit\r\n", 200),
        ("Authorization: BEARER   sekrit \r\n", 200),
    ] {
        let r = send(addr, "GET", "/v1/models", auth, "").await;
        assert_eq!(r.status, want, "{auth:?}: {}", r.body);
    }
    assert_eq!(get(addr, "/health").await.status, 200);
}

// ---- 4. Shared prefix-cache directories ---------------------------------

fn spill_only(dir: &Path) -> ServerOptions {
    ServerOptions {
        engine: EngineOptions {
            // Nothing in RAM: every snapshot goes to the directory.
            prefix_cache: PrefixCacheOptions {
                ram_bytes: 0,
                disk_dir: Some(dir.to_path_buf()),
                disk_bytes: 1 << 30,
            },
            ..Default::default()
        },
        ..Default::default()
    }
}

fn fresh_options() -> ServerOptions {
    ServerOptions {
        engine: EngineOptions {
            no_prefix_reuse: true,
            ..Default::default()
        },
        ..Default::default()
    }
}

fn snap_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "snap") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

fn conversation(topic: &str) -> Vec<Value> {
    vec![
        json!({"role": "system", "content": format!("You answer questions about {topic} tersely.")}),
        json!({"role": "user", "content": format!("Tell me one fact about {topic}.")}),
    ]
}

/// The follow-up of `first`, after `answer`.
fn follow_up(mut first: Vec<Value>, answer: &Value) -> Value {
    first.push(json!({"role": "assistant", "content": answer["choices"][0]["message"]["content"]}));
    first.push(json!({"role": "user", "content": "And another?"}));
    greedy(json!(first), 6)
}

/// Two servers on one spill directory: neither removes nor overwrites the
/// other's snapshots; each follow-up starts from its own and answers as a
/// fresh server does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_sharing_a_prefix_cache_dir_keep_apart() {
    let dir = tempfile::tempdir().unwrap();
    let (fresh, _f) = serve(fresh_options()).await;
    let (a, _sa) = serve(spill_only(dir.path())).await;
    let x = conversation("boats");
    let ax = chat(a, &greedy(json!(x), 6)).await;
    let (b, _sb) = serve(spill_only(dir.path())).await;
    let y = conversation("the history of mathematics in ancient Greece and Egypt");
    let by = chat(b, &greedy(json!(y), 6)).await;
    assert!(snap_files(dir.path()).len() >= 2);
    for (server, conv, answer) in [(a, x, ax), (b, y, by)] {
        let next = follow_up(conv, &answer);
        let got = chat(server, &next).await;
        let want = chat(fresh, &next).await;
        assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
        let cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached > 0, "no reuse: {got}");
    }
}

/// A spill file replaced by another prefix's snapshot is dropped, not
/// restored: the follow-up answers (200, as a fresh server does), and so
/// does the one after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_spill_is_dropped_and_the_conversation_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (fresh, _f) = serve(fresh_options()).await;
    let (s, _stop) = serve(spill_only(dir.path())).await;
    let x = conversation("boats");
    let ax = chat(s, &greedy(json!(x), 6)).await;
    let xs = snap_files(dir.path());
    assert!(!xs.is_empty());
    let y = conversation("the history of mathematics in ancient Greece and Egypt");
    chat(s, &greedy(json!(y), 6)).await;
    let ys: Vec<PathBuf> = snap_files(dir.path())
        .into_iter()
        .filter(|p| !xs.contains(p))
        .collect();
    assert!(!ys.is_empty());
    // Every snapshot of conversation x now holds conversation y's state.
    let other = std::fs::read(&ys[0]).unwrap();
    for p in &xs {
        std::fs::write(p, &other).unwrap();
    }
    let next = follow_up(x, &ax);
    let want = chat(fresh, &next).await;
    for _ in 0..2 {
        let got = chat(s, &next).await;
        assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
    }
    assert_eq!(metric(s, "moeflux_engine_errors_total").await, 0.0);
}
