//! The accept loop: HTTP/1.1 connections over hyper, with a cap on the
//! connections served and timeouts, so that slow or idle clients cannot
//! hold the server.
//!
//! * A connection has `header_timeout` from the first byte of a request to
//!   the end of its headers (one byte every few seconds does not keep it
//!   open), and `idle_timeout` between requests (from its opening, or from
//!   the end of the previous response, to the first byte of the next
//!   request). The body has its own `body_timeout` (in the handlers).
//! * At most `max_connections` are served. Beyond them a reserve of a few
//!   more (a sixteenth of the cap, at least 8) is still accepted and
//!   served `/health` (503 elsewhere), one request each, with short
//!   timeouts: a monitor can tell a server under a flood from a dead one.
//!   Past the reserve, connections are accepted and closed at once, so the
//!   listen backlog never fills.
//! * Graceful shutdown: stop accepting, let each connection finish the
//!   request it is on, then return.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::Router;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify, Semaphore};
use tokio::time::Instant;
use tower_service::Service;

use crate::metrics::Metrics;

#[derive(Debug, Clone)]
pub struct ConnOptions {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
}

/// Timeouts of a connection beyond the cap: enough for a health check.
const OVER_LIMIT_TIMEOUT: Duration = Duration::from_secs(2);

fn reserve(max_connections: usize) -> usize {
    (max_connections / 16).max(8)
}

pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    over_limit: Router,
    opts: ConnOptions,
    metrics: Arc<Metrics>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let served = Arc::new(Semaphore::new(opts.max_connections));
    let reserved = Arc::new(Semaphore::new(reserve(opts.max_connections)));
    // Connections watch `stop`; all of them have ended when every receiver
    // is dropped.
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    if !is_connection_error(&e) {
                        // Out of file descriptors and the like: wait for
                        // connections to close rather than spin.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let stop = stop_rx.clone();
        if let Ok(permit) = served.clone().try_acquire_owned() {
            let (svc, m) = (router.clone(), metrics.clone());
            let (header, idle) = (opts.header_timeout, opts.idle_timeout);
            tokio::spawn(async move {
                m.connections_open.fetch_add(1, Ordering::Relaxed);
                connection(stream, svc, header, idle, true, stop).await;
                m.connections_open.fetch_sub(1, Ordering::Relaxed);
                drop(permit);
            });
        } else if let Ok(permit) = reserved.clone().try_acquire_owned() {
            metrics
                .connections_over_limit
                .fetch_add(1, Ordering::Relaxed);
            let svc = over_limit.clone();
            let t = OVER_LIMIT_TIMEOUT.min(opts.header_timeout);
            tokio::spawn(async move {
                connection(stream, svc, t, t, false, stop).await;
                drop(permit);
            });
        } else {
            metrics
                .connections_over_limit
                .fetch_add(1, Ordering::Relaxed);
            drop(stream);
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(stop_rx);
    stop_tx.closed().await;
    Ok(())
}

fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Serves one connection until it closes, times out, or (after `stop`)
/// finishes its current request.
async fn connection(
    stream: TcpStream,
    router: Router,
    header_timeout: Duration,
    idle_timeout: Duration,
    keep_alive: bool,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity::new());
    let io = TokioIo::new(Watched {
        inner: stream,
        activity: activity.clone(),
    });
    let act = activity.clone();
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let busy = Busy::start(act.clone());
        let call = router.clone().call(req);
        async move {
            let resp = call.await?;
            Ok::<_, std::convert::Infallible>(resp.map(|body| Tracked { body, _busy: busy }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(keep_alive)
        .serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            r = stop.changed(), if !stopping => {
                stopping = true;
                if r.is_ok() {
                    conn.as_mut().graceful_shutdown();
                }
            }
            // Dropping the connection closes the socket.
            _ = activity.expired(header_timeout, idle_timeout) => return,
        }
    }
}

/// Where a connection is in its request cycle, for the timeouts.
struct Activity {
    start: Instant,
    /// Requests being answered (from their headers to the end of the
    /// response body).
    busy: AtomicUsize,
    /// Milliseconds since `start`: when the connection became idle, and
    /// when the first byte of the next request came (`NONE`: not yet).
    idle_since: AtomicU64,
    head_since: AtomicU64,
    changed: Notify,
}

const NONE: u64 = u64::MAX;

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            busy: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            head_since: AtomicU64::new(NONE),
            changed: Notify::new(),
        }
    }

    fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn read_some(&self) {
        if self.busy.load(Ordering::SeqCst) == 0 && self.head_since.load(Ordering::SeqCst) == NONE {
            self.head_since.store(self.now_ms(), Ordering::SeqCst);
            self.changed.notify_one();
        }
    }

    /// Resolves when the connection has been idle, or sending a request's
    /// headers, for too long; never while a request is being answered.
    async fn expired(&self, header_timeout: Duration, idle_timeout: Duration) {
        loop {
            let notified = self.changed.notified();
            let deadline = if self.busy.load(Ordering::SeqCst) > 0 {
                None
            } else {
                let head = self.head_since.load(Ordering::SeqCst);
                Some(if head != NONE {
                    ms(head) + header_timeout
                } else {
                    ms(self.idle_since.load(Ordering::SeqCst)) + idle_timeout
                })
            };
            match deadline {
                Some(d) if self.start + d <= Instant::now() => return,
                Some(d) => {
                    tokio::select! {
                        _ = notified => {}
                        _ = tokio::time::sleep_until(self.start + d) => {}
                    }
                }
                None => notified.await,
            }
        }
    }
}

fn ms(v: u64) -> Duration {
    Duration::from_millis(v)
}

/// A request being answered; dropped with its response body (or with the
/// handler, if the connection goes first).
struct Busy(Arc<Activity>);

impl Busy {
    fn start(a: Arc<Activity>) -> Busy {
        a.busy.fetch_add(1, Ordering::SeqCst);
        a.head_since.store(NONE, Ordering::SeqCst);
        a.changed.notify_one();
        Busy(a)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        let a = &self.0;
        a.idle_since.store(a.now_ms(), Ordering::SeqCst);
        a.busy.fetch_sub(1, Ordering::SeqCst);
        a.changed.notify_one();
    }
}

/// A response body that keeps its request [`Busy`] until it is done.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket, noting when a request's first bytes arrive.
struct Watched {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for Watched {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut this.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            this.activity.read_some();
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}
