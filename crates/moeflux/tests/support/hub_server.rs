//! A Hugging Face Hub stand-in for tests: serves fixture repos at the Hub's
//! URL layout (`/api/models/{repo}/revision/{rev}`,
//! `/{repo}/resolve/{rev}/{file}`) with the Hub's headers (`ETag`,
//! `X-Linked-Etag`, `X-Linked-Size`, `X-Repo-Commit`, `X-Error-Code`),
//! `Range` requests, gated repos and a connection dropped midway through
//! a file; it logs every request. Plain `std::net`, one thread per
//! connection.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

struct Repo {
    commit: String,
    files: BTreeMap<String, Vec<u8>>,
    /// Requests must carry `Authorization: Bearer <token>`.
    token: Option<String>,
}

#[derive(Default)]
struct State {
    repos: HashMap<String, Repo>,
    log: Vec<Request>,
    /// `repo/file` whose next GET stops after half the bytes.
    drop_once: HashSet<String>,
}

pub struct HubServer {
    port: u16,
    state: Arc<Mutex<State>>,
}

/// Large files are LFS files on the Hub: their blob id is the sha256.
pub fn is_lfs(file: &str) -> bool {
    file.ends_with(".safetensors") || file.ends_with(".gguf") || file.ends_with(".bin")
}

pub fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// The blob id the server gives `bytes` of `file` (what the cache names
/// the blob): the sha256 for LFS files, else a 40-digit git-like id.
pub fn etag_of(file: &str, bytes: &[u8]) -> String {
    if is_lfs(file) {
        sha256_hex(bytes)
    } else {
        let mut h = Sha256::new();
        h.update(format!("blob {}\0", bytes.len()));
        h.update(bytes);
        sha256_hex(&h.finalize())[..40].to_string()
    }
}

impl HubServer {
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                let st = st.clone();
                std::thread::spawn(move || {
                    let _ = serve(conn, &st);
                });
            }
        });
        HubServer { port, state }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn add_repo(
        &self,
        repo: &str,
        commit: &str,
        files: Vec<(String, Vec<u8>)>,
        token: Option<&str>,
    ) {
        self.state.lock().unwrap().repos.insert(
            repo.to_string(),
            Repo {
                commit: commit.to_string(),
                files: files.into_iter().collect(),
                token: token.map(str::to_string),
            },
        );
    }

    /// Every file of `dir` (not recursive), plus `extra`.
    pub fn add_dir(&self, repo: &str, commit: &str, dir: &Path, extra: &[(&str, &[u8])]) {
        let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().into_string().unwrap(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        files.extend(extra.iter().map(|(n, b)| (n.to_string(), b.to_vec())));
        self.add_repo(repo, commit, files, None);
    }

    pub fn drop_midway(&self, repo: &str, file: &str) {
        self.state
            .lock()
            .unwrap()
            .drop_once
            .insert(format!("{repo}/{file}"));
    }

    pub fn requests(&self) -> Vec<Request> {
        self.state.lock().unwrap().log.clone()
    }

    pub fn clear_requests(&self) {
        self.state.lock().unwrap().log.clear();
    }

    /// GET and HEAD requests of files (`/resolve/`), as `METHOD file`.
    pub fn file_requests(&self) -> Vec<String> {
        self.requests()
            .iter()
            .filter_map(|r| {
                let (_, f) = r.path.split_once("/resolve/")?;
                let f = f.split_once('/')?.1;
                Some(format!("{} {f}", r.method))
            })
            .collect()
    }
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

fn respond(
    w: &mut TcpStream,
    status: &str,
    headers: &[(String, String)],
    body: &[u8],
    head: bool,
) -> std::io::Result<()> {
    let mut h = format!("HTTP/1.1 {status}\r\nConnection: close\r\n");
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    if !headers.iter().any(|(k, _)| k == "Content-Length") {
        h.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    h.push_str("\r\n");
    w.write_all(h.as_bytes())?;
    if !head {
        w.write_all(body)?;
    }
    w.flush()
}

fn error(w: &mut TcpStream, status: &str, code: &str, head: bool) -> std::io::Result<()> {
    let h = vec![("X-Error-Code".to_string(), code.to_string())];
    respond(w, status, &h, code.as_bytes(), head)
}

/// The repository a request names, if it exists, the request may see it
/// (token) and `rev` is one it has; else the Hub's status and error code.
fn visible<'a>(
    s: &'a State,
    repo_id: &str,
    rev: &str,
    auth: Option<&str>,
) -> Result<&'a Repo, (&'static str, &'static str)> {
    let repo = s
        .repos
        .get(repo_id)
        .ok_or(("404 Not Found", "RepositoryNotFound"))?;
    if let Some(t) = &repo.token {
        if auth != Some(&format!("Bearer {t}")) {
            return Err(("401 Unauthorized", "GatedRepo"));
        }
    }
    if rev != "main" && rev != repo.commit {
        return Err(("404 Not Found", "RevisionNotFound"));
    }
    Ok(repo)
}

fn serve(mut conn: TcpStream, st: &Mutex<State>) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let mut headers: HashMap<String, String> = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = target.split('?').next().unwrap_or("").to_string();
    let range = headers.get("range").cloned();
    let auth = headers.get("authorization").cloned();
    let head = method == "HEAD";
    let mut s = st.lock().unwrap();
    s.log.push(Request {
        method: method.clone(),
        path: decode(&path),
        range: range.clone(),
        auth: auth.clone(),
    });

    // /api/models/{org}/{name}/revision/{rev}
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let seg: Vec<&str> = rest.splitn(4, '/').collect();
        if seg.len() != 4 || seg[2] != "revision" {
            return error(&mut conn, "404 Not Found", "RepositoryNotFound", head);
        }
        let repo_id = format!("{}/{}", seg[0], seg[1]);
        let repo = match visible(&s, &repo_id, &decode(seg[3]), auth.as_deref()) {
            Ok(r) => r,
            Err((status, code)) => return error(&mut conn, status, code, head),
        };
        let siblings: Vec<serde_json::Value> = repo
            .files
            .keys()
            .map(|f| serde_json::json!({ "rfilename": f }))
            .collect();
        let body = serde_json::json!({"id": repo_id, "sha": repo.commit, "siblings": siblings});
        let h = vec![("Content-Type".to_string(), "application/json".to_string())];
        return respond(&mut conn, "200 OK", &h, body.to_string().as_bytes(), head);
    }

    // /{org}/{name}/resolve/{rev}/{file}
    let seg: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if seg.len() != 5 || seg[2] != "resolve" {
        return error(&mut conn, "404 Not Found", "RepositoryNotFound", head);
    }
    let repo_id = format!("{}/{}", seg[0], seg[1]);
    let file = decode(seg[4]);
    let repo = match visible(&s, &repo_id, &decode(seg[3]), auth.as_deref()) {
        Ok(r) => r,
        Err((status, code)) => return error(&mut conn, status, code, head),
    };
    let Some(bytes) = repo.files.get(&file).cloned() else {
        return error(&mut conn, "404 Not Found", "EntryNotFound", head);
    };
    let commit = repo.commit.clone();
    let etag = etag_of(&file, &bytes);
    let mut h = vec![
        ("X-Repo-Commit".to_string(), commit),
        ("Accept-Ranges".to_string(), "bytes".to_string()),
    ];
    if is_lfs(&file) {
        h.push(("X-Linked-Etag".into(), format!("\"{etag}\"")));
        h.push(("X-Linked-Size".into(), bytes.len().to_string()));
        h.push(("ETag".into(), format!("\"{etag}\"")));
    } else {
        // The Hub sends small files' ETags weak.
        h.push(("ETag".into(), format!("W/\"{etag}\"")));
    }
    // `bytes=START-` or `bytes=START-END` (END inclusive).
    let (start, end) = match range
        .as_deref()
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
    {
        Some((a, b)) => (a.parse::<usize>().ok(), b.parse::<usize>().ok()),
        None => (None, None),
    };
    let cut = !head && s.drop_once.remove(&format!("{repo_id}/{file}"));
    drop(s);
    match start {
        Some(n) if n >= bytes.len() => {
            h.push(("Content-Range".into(), format!("bytes */{}", bytes.len())));
            respond(&mut conn, "416 Range Not Satisfiable", &h, b"", head)
        }
        Some(n) => {
            let last = end.map_or(bytes.len() - 1, |e| e.min(bytes.len() - 1));
            h.push((
                "Content-Range".into(),
                format!("bytes {n}-{last}/{}", bytes.len()),
            ));
            respond(
                &mut conn,
                "206 Partial Content",
                &h,
                &bytes[n..=last.max(n)],
                head,
            )
        }
        None if cut => {
            // Announce the whole file, send half, hang up.
            h.push(("Content-Length".into(), bytes.len().to_string()));
            let mut hdr = "HTTP/1.1 200 OK\r\nConnection: close\r\n".to_string();
            for (k, v) in &h {
                hdr.push_str(&format!("{k}: {v}\r\n"));
            }
            hdr.push_str("\r\n");
            conn.write_all(hdr.as_bytes())?;
            conn.write_all(&bytes[..bytes.len() / 2])?;
            conn.flush()?;
            conn.shutdown(std::net::Shutdown::Both)
        }
        None => respond(&mut conn, "200 OK", &h, &bytes, head),
    }
}
