//! The chat page (`GET /` and its assets under `/ui/`): static files
//! compiled into the binary, no build step, nothing fetched from elsewhere.
//! The page talks to this server's own `/v1/chat/completions`. Every asset
//! is served with a strict Content-Security-Policy: only this origin's
//! scripts, styles, images and requests, and trusted types, so the page's
//! script cannot put model output into an HTML sink.

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// The page's Content-Security-Policy.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'; require-trusted-types-for 'script'; trusted-types 'none'";

/// One embedded file: its path, content type and bytes.
pub struct Asset {
    pub path: &'static str,
    pub content_type: &'static str,
    pub body: &'static str,
}

/// The page's files; `/` is `index.html`.
pub const ASSETS: &[Asset] = &[
    Asset {
        path: "/",
        content_type: "text/html; charset=utf-8",
        body: include_str!("../ui/index.html"),
    },
    Asset {
        path: "/ui/app.js",
        content_type: "text/javascript; charset=utf-8",
        body: include_str!("../ui/app.js"),
    },
    Asset {
        path: "/ui/style.css",
        content_type: "text/css; charset=utf-8",
        body: include_str!("../ui/style.css"),
    },
    Asset {
        path: "/ui/icon.svg",
        content_type: "image/svg+xml",
        body: include_str!("../ui/icon.svg"),
    },
];

/// Whether `path` is one of the page's files (public: the key guards the
/// API, not the page, which holds nothing secret).
pub fn is_page(path: &str) -> bool {
    ASSETS.iter().any(|a| a.path == path)
}

/// The routes of the page's files.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    ASSETS.iter().fold(Router::new(), |r, a| {
        r.route(a.path, get(move || async move { serve(a) }))
    })
}

fn serve(a: &'static Asset) -> Response {
    (
        [
            (header::CONTENT_TYPE, a.content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_FRAME_OPTIONS, "DENY"),
            // Revalidated on each load, so a new binary's page is never mixed
            // with an old one's script.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        a.body,
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page loads only its own files, and each is served.
    #[test]
    fn the_page_refers_only_to_its_own_files() {
        let html = ASSETS[0].body;
        for attr in ["src=\"", "href=\""] {
            for (i, _) in html.match_indices(attr) {
                let rest = &html[i + attr.len()..];
                let url = &rest[..rest.find('"').unwrap()];
                assert!(
                    is_page(url),
                    "index.html refers to {url}, which is not served"
                );
            }
        }
        for a in ASSETS {
            // The SVG namespace is a name, not a fetch.
            let text = a.body.replace("http://www.w3.org/2000/svg", "");
            assert!(
                !text.contains("http://") && !text.contains("https://") && !text.contains("//cdn"),
                "{} names an external URL",
                a.path
            );
        }
    }

    /// Model output goes in as text only; the CSP's trusted types enforce
    /// it in the browser, this keeps the source honest too.
    #[test]
    fn the_script_uses_no_html_sinks() {
        let js = ASSETS.iter().find(|a| a.path == "/ui/app.js").unwrap().body;
        for sink in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
        ] {
            assert!(!js.contains(sink), "app.js uses {sink}");
        }
        // Neither inline scripts nor inline styles, which the CSP refuses.
        let html = ASSETS[0].body;
        assert!(!html.contains("style=") && !html.contains("<style"));
        assert!(!html.contains("<script>"));
        let inline_handler = html.match_indices(" on").any(|(i, _)| {
            let name = html[i + 3..].trim_start_matches(|c: char| c.is_ascii_lowercase());
            name.starts_with('=')
        });
        assert!(!inline_handler, "index.html has an inline event handler");
    }
}
