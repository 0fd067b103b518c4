//! Notices that a peer of a `--dist-init` group is gone, so no process
//! waits for it forever. NCCL between processes of one host (NVLink, PCIe)
//! never notices a dead peer: its kernels spin on memory the peer would
//! have written. The rendezvous's TCP connections ([`Link`]) stay open
//! instead, one thread reading each; the OS closes a process's sockets
//! however it ends, so a read that returns end-of-file or an error means
//! the peer exited (or failed and closed them, see [`Watchdog::fail`]).
//!
//! A peer that ends between steps makes the next step fail at once. One
//! that ends during a step may have finished its part of it (a clean exit
//! after the last step races with its peers' end of that step), so the
//! step is given `grace` to finish on its own; still running then, it
//! is aborted (the communicator's abort makes NCCL's kernels give up). NCCL's
//! abort can itself hang when a peer on the same host died (it frees memory
//! the peer mapped), and a kernel that missed the abort keeps the step
//! waiting: a step still running [`ABORT_WAIT`] after the abort ends the
//! process, the reason printed, as PyTorch's NCCL watchdog tears its
//! process down; nothing else can unblock it.
//! Rank 0 holds a connection to every rank and the others one to rank 0,
//! so a loss reaches every rank through rank 0's own exit.
//!
//! Why this and not NCCL's own error polling (`ncclCommGetAsyncError`):
//! that reports errors NCCL's transports see (a socket or InfiniBand
//! connection reset), not a peer that died on a shared-memory or P2P path,
//! and it cannot unblock `ncclCommInitRank`, which waits for every rank
//! with no timeout; [`Watchdog::gone`] lets the caller stop waiting.

use std::io::Read;
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::rendezvous::{DistInit, Link};

/// How long a step may go on after a peer left during it (a normal end
/// races with the end of the last step; the local work left after the last
/// all-reduce, the LM head, takes well under this).
pub const PEER_GRACE: Duration = Duration::from_secs(10);

/// How long an aborted step may take to end before the process is ended.
pub const ABORT_WAIT: Duration = Duration::from_secs(5);

type AbortFn = Arc<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct State {
    /// Why a peer is gone (the first one noticed).
    gone: Option<String>,
    /// Steps begun, and whether one is running.
    steps: u64,
    in_step: bool,
    /// The step running when a peer left was aborted.
    aborted: bool,
    /// This process closed the connections itself: reads ending now are
    /// no news.
    closing: bool,
    abort: Option<AbortFn>,
}

/// Watches one process's connections to its peers until dropped.
pub struct Watchdog {
    state: Arc<Mutex<State>>,
    socks: Vec<TcpStream>,
    who: String,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Watchdog {
    /// Starts a reading thread per connection of `link` (this process is
    /// rank `d.rank`).
    pub fn start(link: Link, d: &DistInit, grace: Duration) -> std::io::Result<Watchdog> {
        let state = Arc::new(Mutex::new(State::default()));
        let who = format!(
            "--dist-init tcp://{} (rank {} of {})",
            d.addr, d.rank, d.world
        );
        let mut socks = Vec::new();
        for (rank, s) in link.peers {
            socks.push(s.try_clone()?);
            let peer = s
                .peer_addr()
                .map_or_else(|_| "?".to_string(), |a| a.to_string());
            let why = format!("rank {rank} ({peer}) left the group: it exited or failed");
            let state = state.clone();
            let who = who.clone();
            std::thread::Builder::new()
                .name(format!("moeflux-watch-{rank}"))
                .spawn(move || watch(s, why, &who, &state, grace))?;
        }
        Ok(Watchdog { state, socks, who })
    }

    /// What to call to abort a running step (the communicator's abort), once
    /// it exists.
    pub fn on_abort(&self, f: impl Fn() + Send + Sync + 'static) {
        lock(&self.state).abort = Some(Arc::new(f));
    }

    /// Why a peer is gone, if one is (named with this process's rank).
    pub fn gone(&self) -> Option<String> {
        lock(&self.state)
            .gone
            .as_ref()
            .map(|g| format!("{}: {g}", self.who))
    }

    /// Before a step: refused, with the reason, once a peer is gone.
    pub fn begin_step(&self) -> Result<(), String> {
        let mut s = lock(&self.state);
        if let Some(g) = &s.gone {
            return Err(format!("{}: {g}", self.who));
        }
        s.steps += 1;
        s.in_step = true;
        Ok(())
    }

    /// After a step: why it was aborted, if it was (its outputs are void).
    pub fn end_step(&self) -> Option<String> {
        let mut s = lock(&self.state);
        s.in_step = false;
        match (&s.gone, s.aborted) {
            (Some(g), true) => Some(format!(
                "{}: {g}, and this step, still waiting for it, was aborted",
                self.who
            )),
            _ => None,
        }
    }

    /// This process failed: closes the connections now, so the peers learn
    /// it at once rather than when the process exits.
    pub fn fail(&self) {
        self.close();
    }

    fn close(&self) {
        lock(&self.state).closing = true;
        for s in &self.socks {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.close();
    }
}

/// One connection's thread: waits for its end, then records the loss and,
/// when a step is running, aborts it unless it ends within `grace`.
fn watch(mut s: TcpStream, why: String, who: &str, state: &Mutex<State>, grace: Duration) {
    let mut byte = [0u8; 64];
    // Peers send nothing after the rendezvous; any bytes are ignored.
    while let Ok(1..) = s.read(&mut byte) {}
    let step = {
        let mut st = lock(state);
        if st.closing {
            return;
        }
        st.gone.get_or_insert(why.clone());
        if !st.in_step {
            return;
        }
        st.steps
    };
    let deadline = Instant::now() + grace;
    loop {
        std::thread::sleep(Duration::from_millis(20).min(grace));
        let abort = {
            let mut st = lock(state);
            if !st.in_step || st.steps != step || st.closing {
                return;
            }
            if Instant::now() < deadline {
                continue;
            }
            st.aborted = true;
            st.abort.clone()
        };
        // On a thread of its own: NCCL's abort may hang (above).
        if let Some(f) = abort {
            let _ = std::thread::Builder::new()
                .name("moeflux-nccl-abort".into())
                .spawn(move || f());
        }
        break;
    }
    let end = Instant::now() + ABORT_WAIT;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(20));
        let st = lock(state);
        if !st.in_step || st.steps != step || st.closing {
            return;
        }
    }
    eprintln!("moeflux: {who}: {why}; this rank's step could not be aborted, so the process exits");
    // SAFETY: ends the process at once; atexit handlers are skipped, since
    // the driver's may wait on the hung step.
    unsafe { libc::_exit(1) }
}

#[cfg(test)]
mod tests {
    use super::super::rendezvous::{join, DistInit};
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Ranks 0 and 1 joined on a free local port.
    fn pair() -> ((DistInit, Link), (DistInit, Link)) {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("tcp://127.0.0.1:{port}");
        let t = Duration::from_secs(20);
        let d1 = DistInit::new(&url, 1, 2).unwrap();
        let other = std::thread::spawn(move || {
            let (_, l) = join(&d1, [0; 128], 0, t).unwrap();
            (d1, l)
        });
        let d0 = DistInit::new(&url, 0, 2).unwrap();
        let (_, l0) = join(&d0, [1; 128], 1, t).unwrap();
        ((d0, l0), other.join().unwrap())
    }

    fn wait_for(mut f: impl FnMut() -> bool) {
        let end = Instant::now() + Duration::from_secs(10);
        while !f() {
            assert!(Instant::now() < end, "not within 10 s");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_peer_that_exits_between_steps_fails_the_next_step() {
        let ((d0, l0), (_, l1)) = pair();
        let w = Watchdog::start(l0, &d0, Duration::from_secs(60)).unwrap();
        assert!(w.gone().is_none());
        w.begin_step().unwrap();
        assert_eq!(w.end_step(), None);
        drop(l1); // the peer process ends: the OS closes its socket
        wait_for(|| w.gone().is_some());
        let e = w.begin_step().unwrap_err();
        assert!(e.contains("rank 0 of 2") && e.contains("rank 1 ("), "{e}");
        assert!(e.contains("exited or failed"), "{e}");
    }

    #[test]
    fn a_step_the_peer_left_is_aborted_after_the_grace() {
        let ((d0, l0), (d1, l1)) = pair();
        let aborts = Arc::new(AtomicUsize::new(0));
        let w = Watchdog::start(l0, &d0, Duration::from_millis(200)).unwrap();
        let a = aborts.clone();
        w.on_abort(move || {
            a.fetch_add(1, Ordering::SeqCst);
        });
        w.begin_step().unwrap();
        // The peer fails and says so by closing (its own watchdog's `fail`).
        let w1 = Watchdog::start(l1, &d1, Duration::from_secs(60)).unwrap();
        let t = Instant::now();
        w1.fail();
        wait_for(|| aborts.load(Ordering::SeqCst) == 1);
        assert!(t.elapsed() >= Duration::from_millis(200));
        let e = w.end_step().expect("the step was aborted");
        assert!(e.contains("aborted") && e.contains("rank 1 ("), "{e}");
        // The peer's own closing is no news to it.
        assert!(w1.gone().is_none());
    }

    #[test]
    fn a_step_that_ends_within_the_grace_is_not_aborted() {
        let ((d0, l0), (_, l1)) = pair();
        let aborts = Arc::new(AtomicUsize::new(0));
        let w = Watchdog::start(l0, &d0, Duration::from_millis(300)).unwrap();
        let a = aborts.clone();
        w.on_abort(move || {
            a.fetch_add(1, Ordering::SeqCst);
        });
        w.begin_step().unwrap();
        drop(l1);
        wait_for(|| w.gone().is_some());
        assert_eq!(w.end_step(), None, "the step finished in time");
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(aborts.load(Ordering::SeqCst), 0);
        assert!(w.begin_step().is_err(), "but no step begins after");
    }

    #[test]
    fn rank_zero_going_away_is_noticed_by_the_others() {
        let ((_, l0), (d1, l1)) = pair();
        let w = Watchdog::start(l1, &d1, PEER_GRACE).unwrap();
        drop(l0);
        wait_for(|| w.gone().is_some());
        let g = w.gone().unwrap();
        assert!(g.contains("rank 1 of 2") && g.contains("rank 0 ("), "{g}");
    }
}
