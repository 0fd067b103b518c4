//! The TCP rendezvous of `--dist-init tcp://HOST:PORT --rank R --world N`:
//! rank 0 listens on HOST:PORT, makes NCCL's unique id and a seed, and
//! hands both to every other rank as it connects; the ranks then join one
//! NCCL group with that id (NCCL carries the traffic itself, over sockets or
//! InfiniBand). The seed lets every process sample the same tokens.
//!
//! The exchange, little-endian: a rank sends `MOEFLUX1`, its rank and the
//! world size (u32 each); rank 0 answers `MOEFLUX1`, the 128-byte id and
//! the seed (u64), or closes the connection when the rank or world size is
//! wrong (and fails itself, naming it). The connections stay open for the
//! group's life ([`Link`]): `watchdog.rs` learns from them that a peer
//! process is gone.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"MOEFLUX1";

/// How a process joins a group of several processes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistInit {
    /// `HOST:PORT` of rank 0's rendezvous.
    pub addr: String,
    pub rank: usize,
    pub world: usize,
}

impl DistInit {
    /// From `tcp://HOST:PORT`, this process's rank and the number of ranks.
    pub fn new(url: &str, rank: usize, world: usize) -> std::result::Result<DistInit, String> {
        let addr = url
            .strip_prefix("tcp://")
            .ok_or_else(|| format!("`{url}` is not tcp://HOST:PORT"))?;
        let port_ok = addr
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if !port_ok {
            return Err(format!("`{url}` is not tcp://HOST:PORT"));
        }
        if world < 2 {
            return Err(format!(
                "a group of {world} processes: --world must be at least 2"
            ));
        }
        if rank >= world {
            return Err(format!("--rank {rank} is not below --world {world}"));
        }
        Ok(DistInit {
            addr: addr.to_string(),
            rank,
            world,
        })
    }
}

/// What every rank receives from rank 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Joined {
    pub id: [u8; 128],
    pub seed: u64,
}

fn net_err(d: &DistInit, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Gpu(format!(
        "--dist-init tcp://{} (rank {} of {}): {what}: {e}",
        d.addr, d.rank, d.world
    ))
}

/// The rendezvous's connections, left open: rank 0's to every other rank,
/// another rank's to rank 0, each with the peer's rank.
#[derive(Debug)]
pub struct Link {
    pub peers: Vec<(usize, TcpStream)>,
}

/// Runs the rendezvous within `timeout`: rank 0 serves `id` and `seed` to
/// the other `world - 1` ranks; the others fetch them (retrying the
/// connection until rank 0 listens).
pub fn join(d: &DistInit, id: [u8; 128], seed: u64, timeout: Duration) -> Result<(Joined, Link)> {
    let deadline = Instant::now() + timeout;
    if d.rank == 0 {
        serve(d, Joined { id, seed }, deadline)
    } else {
        fetch(d, deadline)
    }
}

fn serve(d: &DistInit, j: Joined, deadline: Instant) -> Result<(Joined, Link)> {
    let listener = TcpListener::bind(&d.addr).map_err(|e| net_err(d, "cannot listen", e))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| net_err(d, "socket", e))?;
    let mut joined = vec![false; d.world];
    joined[0] = true;
    let mut peers = Vec::with_capacity(d.world - 1);
    while joined.iter().any(|j| !j) {
        let (mut s, peer) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = (0..d.world)
                        .filter(|&r| !joined[r])
                        .map(|r| r.to_string())
                        .collect();
                    return Err(net_err(
                        d,
                        "timed out waiting for ranks",
                        missing.join(", "),
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(net_err(d, "accept", e)),
        };
        let io = |e| net_err(d, &format!("talking to {peer}"), e);
        s.set_nonblocking(false).map_err(io)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(io)?;
        let mut hello = [0u8; 16];
        s.read_exact(&mut hello).map_err(io)?;
        if &hello[..8] != MAGIC {
            // Not a moeflux rank (a port scan, another program): ignore it.
            continue;
        }
        let rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes")) as usize;
        let world = u32::from_le_bytes(hello[12..16].try_into().expect("4 bytes")) as usize;
        if world != d.world || rank == 0 || rank >= d.world || joined[rank] {
            return Err(net_err(
                d,
                "a process joined with the wrong rank or world",
                format!("{peer} says rank {rank} of {world}"),
            ));
        }
        let mut reply = Vec::with_capacity(8 + 128 + 8);
        reply.extend_from_slice(MAGIC);
        reply.extend_from_slice(&j.id);
        reply.extend_from_slice(&j.seed.to_le_bytes());
        s.write_all(&reply).map_err(io)?;
        s.set_read_timeout(None).map_err(io)?;
        joined[rank] = true;
        peers.push((rank, s));
    }
    Ok((j, Link { peers }))
}

fn fetch(d: &DistInit, deadline: Instant) -> Result<(Joined, Link)> {
    let addrs: Vec<_> = d
        .addr
        .to_socket_addrs()
        .map_err(|e| net_err(d, "cannot resolve the address", e))?
        .collect();
    let mut s = loop {
        let last = addrs
            .iter()
            .map(|a| TcpStream::connect_timeout(a, Duration::from_secs(1)))
            .find_map(|c| c.ok());
        if let Some(s) = last {
            break s;
        }
        if Instant::now() >= deadline {
            return Err(net_err(d, "timed out", "rank 0 never answered"));
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let io = |e| net_err(d, "talking to rank 0", e);
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_secs(1))))
        .map_err(io)?;
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&(d.rank as u32).to_le_bytes());
    hello.extend_from_slice(&(d.world as u32).to_le_bytes());
    s.write_all(&hello).map_err(io)?;
    let mut reply = [0u8; 8 + 128 + 8];
    s.read_exact(&mut reply).map_err(|e| {
        net_err(
            d,
            "rank 0 refused this process (another with this rank, or another --world?)",
            e,
        )
    })?;
    if &reply[..8] != MAGIC {
        return Err(net_err(d, "talking to rank 0", "not a moeflux rendezvous"));
    }
    let mut id = [0u8; 128];
    id.copy_from_slice(&reply[8..136]);
    let seed = u64::from_le_bytes(reply[136..144].try_into().expect("8 bytes"));
    s.set_read_timeout(None).map_err(io)?;
    Ok((
        Joined { id, seed },
        Link {
            peers: vec![(0, s)],
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_ranks_and_worlds_are_checked() {
        let d = DistInit::new("tcp://127.0.0.1:29500", 1, 2).unwrap();
        assert_eq!(d.addr, "127.0.0.1:29500");
        assert!(DistInit::new("tcp://[::1]:5", 0, 2).is_ok());
        for (url, rank, world) in [
            ("127.0.0.1:29500", 0, 2),
            ("tcp://host", 0, 2),
            ("tcp://:80", 0, 2),
            ("tcp://h:99999", 0, 2),
            ("tcp://h:1", 2, 2),
            ("tcp://h:1", 0, 1),
        ] {
            assert!(
                DistInit::new(url, rank, world).is_err(),
                "{url} {rank} {world}"
            );
        }
    }

    #[test]
    fn every_rank_gets_rank_zeros_id_and_seed() {
        // A free port: bind, read it, release.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let url = format!("tcp://127.0.0.1:{port}");
        let id = [7u8; 128];
        let t = Duration::from_secs(20);
        let others: Vec<_> = (1..3)
            .map(|r| {
                let d = DistInit::new(&url, r, 3).unwrap();
                std::thread::spawn(move || join(&d, [0; 128], 0, t))
            })
            .collect();
        let (lead, link) = join(&DistInit::new(&url, 0, 3).unwrap(), id, 42, t).unwrap();
        assert_eq!(lead, Joined { id, seed: 42 });
        let mut ranks: Vec<usize> = link.peers.iter().map(|p| p.0).collect();
        ranks.sort();
        assert_eq!(ranks, [1, 2]);
        for o in others {
            let (got, link) = o.join().unwrap().unwrap();
            assert_eq!(got, Joined { id, seed: 42 });
            assert_eq!(link.peers.len(), 1);
            assert_eq!(link.peers[0].0, 0);
        }
    }

    #[test]
    fn a_rank_without_a_server_times_out_naming_the_address() {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let d = DistInit::new(&format!("tcp://127.0.0.1:{port}"), 1, 2).unwrap();
        let e = join(&d, [0; 128], 0, Duration::from_millis(300)).unwrap_err();
        assert!(e.to_string().contains("timed out"), "{e}");
        assert!(e.to_string().contains(&format!("127.0.0.1:{port}")), "{e}");
    }
}
