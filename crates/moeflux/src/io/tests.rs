use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::*;
use crate::format::manifest::{SourceInfo, FORMAT_NAME, FORMAT_VERSION};
use crate::format::{expert_file_name, ExpertLayer};

/// Byte `off` of expert `e` of `layer` (inside `expert_bytes`; padding is 0).
fn pattern(layer: usize, e: usize, off: usize) -> u8 {
    (e.wrapping_mul(131) ^ off.wrapping_mul(7) ^ (off >> 9) ^ layer.wrapping_mul(17)) as u8
}

struct FakeLayer {
    layer: usize,
    num_experts: usize,
    expert_bytes: u64,
    stride: u64,
}

fn write_layer_file(dir: &Path, l: &FakeLayer) -> PathBuf {
    let path = dir.join(expert_file_name(l.layer));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let mut extent = vec![0u8; l.stride as usize];
    for e in 0..l.num_experts {
        for (off, b) in extent[..l.expert_bytes as usize].iter_mut().enumerate() {
            *b = pattern(l.layer, e, off);
        }
        f.write_all(&extent).unwrap();
    }
    f.flush().unwrap();
    path
}

fn manifest(layers: &[FakeLayer]) -> Manifest {
    Manifest {
        format: FORMAT_NAME.into(),
        format_version: FORMAT_VERSION,
        architecture: "qwen3_5_moe".into(),
        source: SourceInfo {
            path: "/nonexistent".into(),
            kind: "mlx".into(),
            expert_bits: Some(4),
            expert_requantization: None,
        },
        dense_file: crate::format::DENSE_FILE.into(),
        tensors: BTreeMap::new(),
        quantized: BTreeMap::new(),
        experts: layers
            .iter()
            .map(|l| ExpertLayer {
                layer: l.layer,
                file: expert_file_name(l.layer),
                num_experts: l.num_experts,
                expert_bytes: l.expert_bytes,
                stride: l.stride,
                components: Vec::new(),
            })
            .collect(),
        low_width_experts: Vec::new(),
    }
}

/// Two MoE layers (model layers 1 and 4) with different geometry; the
/// expert size is not a multiple of 4096 so padding is exercised.
pub(crate) fn fixture() -> (tempfile::TempDir, Manifest) {
    let dir = tempfile::tempdir().unwrap();
    let layers = [
        FakeLayer {
            layer: 1,
            num_experts: 6,
            expert_bytes: 10_000,
            stride: 12_288,
        },
        FakeLayer {
            layer: 4,
            num_experts: 3,
            expert_bytes: 8_192,
            stride: 16_384,
        },
    ];
    for l in &layers {
        write_layer_file(dir.path(), l);
    }
    (dir, manifest(&layers))
}

pub(crate) fn check_expert(m: &Manifest, layer: usize, e: usize, buf: &ExpertBuf) {
    let el = m.expert_layer(layer).unwrap();
    let bytes = buf.as_bytes();
    let n = el.expert_bytes as usize;
    for (off, &b) in bytes[..n].iter().enumerate() {
        assert_eq!(
            b,
            pattern(layer, e, off),
            "layer {layer} expert {e} byte {off}"
        );
    }
    let extent = n.next_multiple_of(4096);
    assert!(
        bytes[n..extent].iter().all(|&b| b == 0),
        "padding of layer {layer} expert {e}"
    );
}

/// Cuts the file at `path` to `len` bytes (a model directory changed under
/// an open store).
fn shrink(path: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

fn bufs_for(store: &ExpertStore, layer: usize, n: usize) -> Vec<ExpertBuf> {
    (0..n)
        .map(|_| {
            let mut b = ExpertBuf::new(store.extent_bytes(layer));
            b.as_bytes_mut().fill(0xEE); // stale contents must be overwritten
            b
        })
        .collect()
}

fn read_and_check(store: &ExpertStore, m: &Manifest) {
    for (layer, ids) in [
        (1usize, vec![4usize, 0, 4, 2, 5, 1, 3]),
        (4, vec![2, 2, 0, 1]),
    ] {
        let mut bufs = bufs_for(store, layer, ids.len());
        store.read_experts(layer, &ids, &mut bufs).unwrap();
        for (&e, b) in ids.iter().zip(&bufs) {
            check_expert(m, layer, e, b);
        }
    }
}

#[test]
fn reads_many_experts_into_the_right_buffers() {
    let (dir, m) = fixture();
    let store = ExpertStore::open(dir.path(), &m, &ExpertStoreOptions::default()).unwrap();
    assert_eq!(store.layers().collect::<Vec<_>>(), vec![1, 4]);
    assert_eq!(store.extent_bytes(1), 12_288);
    assert_eq!(store.extent_bytes(4), 8_192);
    assert_eq!(store.num_experts(1), Some(6));
    assert_eq!(store.num_experts(0), None);
    assert_eq!(store.is_direct(1), Some(false));
    read_and_check(&store, &m);
    // A buffer longer than the extent is fine; bytes past the extent are kept.
    let mut big = vec![ExpertBuf::new(20_000)];
    big[0].as_bytes_mut().fill(0xAB);
    store.read_experts(1, &[3], &mut big).unwrap();
    check_expert(&m, 1, 3, &big[0]);
    assert!(big[0].as_bytes()[12_288..].iter().all(|&b| b == 0xAB));
    // Empty request.
    store.read_experts(1, &[], &mut []).unwrap();
}

#[test]
fn direct_io_gives_the_same_bytes() {
    let (dir, m) = fixture();
    let opts = ExpertStoreOptions {
        direct_io: true,
        io_threads: 3,
        ..Default::default()
    };
    let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
    for layer in [1, 4] {
        let direct = store.is_direct(layer).unwrap();
        let path = dir.path().join(expert_file_name(layer));
        let fell_back = store.buffered_fallbacks().contains(&path);
        assert_ne!(direct, fell_back, "layer {layer}: direct xor fallback");
    }
    eprintln!(
        "direct I/O on {}: layer 1 direct = {:?}",
        dir.path().display(),
        store.is_direct(1)
    );
    read_and_check(&store, &m);
}

#[test]
fn refused_direct_io_falls_back_to_buffered() {
    let (dir, m) = fixture();
    let opts = ExpertStoreOptions {
        direct_io: true,
        ..Default::default()
    };
    sys::tests_hook::set_refuse_direct(true);
    let store = ExpertStore::open(dir.path(), &m, &opts);
    sys::tests_hook::set_refuse_direct(false);
    let store = store.unwrap();
    assert_eq!(store.is_direct(1), Some(false));
    assert_eq!(store.is_direct(4), Some(false));
    assert_eq!(
        store.buffered_fallbacks(),
        &[
            dir.path().join(expert_file_name(1)),
            dir.path().join(expert_file_name(4))
        ]
    );
    read_and_check(&store, &m);
}

#[test]
fn wrong_file_size_names_the_file_and_sizes() {
    let (dir, m) = fixture();
    let path = dir.path().join(expert_file_name(4));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(3 * 16_384 - 4096).unwrap();
    drop(f);
    for direct_io in [false, true] {
        let opts = ExpertStoreOptions {
            direct_io,
            ..Default::default()
        };
        let err = ExpertStore::open(dir.path(), &m, &opts).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::Format { .. }), "{msg}");
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert!(msg.contains("49152") && msg.contains("45056"), "{msg}");
    }
}

#[test]
fn missing_file_is_named() {
    let (dir, m) = fixture();
    let path = dir.path().join(expert_file_name(1));
    std::fs::remove_file(&path).unwrap();
    for direct_io in [false, true] {
        let opts = ExpertStoreOptions {
            direct_io,
            ..Default::default()
        };
        let err = ExpertStore::open(dir.path(), &m, &opts).unwrap_err();
        match &err {
            Error::Io { path: p, source } => {
                assert_eq!(p, &path);
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
            }
            other => panic!("unexpected error {other}"),
        }
        assert!(err.to_string().contains("layer_001.bin"));
    }
}

#[test]
fn bad_layouts_are_rejected() {
    let (dir, m) = fixture();
    let mut bad = m.clone();
    bad.experts[0].stride = 12_000;
    let msg = ExpertStore::open(dir.path(), &bad, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("stride 12000") && msg.contains("layer 1"),
        "{msg}"
    );

    let mut bad = m.clone();
    bad.experts[0].expert_bytes = 12_289;
    assert!(ExpertStore::open(dir.path(), &bad, &Default::default()).is_err());

    let mut bad = m.clone();
    bad.experts[1].layer = 1;
    let msg = ExpertStore::open(dir.path(), &bad, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("twice"), "{msg}");

    let opts = ExpertStoreOptions {
        io_threads: 0,
        ..Default::default()
    };
    assert!(ExpertStore::open(dir.path(), &m, &opts).is_err());
}

#[test]
fn bad_requests_are_errors() {
    let (dir, m) = fixture();
    let store = ExpertStore::open(dir.path(), &m, &Default::default()).unwrap();
    let mut bufs = bufs_for(&store, 1, 2);
    let err = store.read_experts(1, &[0, 6], &mut bufs).unwrap_err();
    assert!(err.to_string().contains("expert 6 of layer 1"), "{err}");
    assert!(store.read_experts(2, &[0, 1], &mut bufs).is_err());
    assert!(store.read_experts(1, &[0], &mut bufs).is_err());
    let mut short = vec![ExpertBuf::new(12_287)];
    assert!(store.read_experts(1, &[0], &mut short).is_err());
    assert_eq!(store.stats(), IoStats::default());
}

#[test]
fn early_eof_names_file_expert_and_offset() {
    let (dir, m) = fixture();
    let store = ExpertStore::open(dir.path(), &m, &Default::default()).unwrap();
    // The file shrinks after the size check (e.g. rewritten underneath us).
    let path = dir.path().join(expert_file_name(1));
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(5 * 12_288 + 4096).unwrap();
    let mut bufs = bufs_for(&store, 1, 2);
    let err = store.read_experts(1, &[0, 5], &mut bufs).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains("expert 5"), "{msg}");
    assert!(
        msg.contains(&format!("offset {}", 5 * 12_288 + 4096)),
        "{msg}"
    );
    // The read that succeeded is counted, the failed one is not.
    assert_eq!(store.stats().reads, 1);
}

#[test]
fn stats_count_reads_and_bytes() {
    let (dir, m) = fixture();
    let store = ExpertStore::open(dir.path(), &m, &Default::default()).unwrap();
    read_and_check(&store, &m);
    let s = store.stats();
    assert_eq!(s.reads, 7 + 4);
    assert_eq!(s.bytes, 7 * 12_288 + 4 * 8_192);
    assert_eq!(s.calls, 2);
    assert!(s.busy_ns > 0);
    assert!(s.gb_per_s() > 0.0);
    assert_eq!(s.since(&s), IoStats::default());
    store.reset_stats();
    assert_eq!(store.stats(), IoStats::default());
    store.evict_page_cache().unwrap();
}

/// Fetches `ids` of `layer`, checking every expert's bytes as it lands;
/// returns the landing order.
fn fetch_and_check(store: &ExpertStore, m: &Manifest, layer: usize, ids: &[usize]) -> Vec<usize> {
    let mapped = store.is_mapped(layer).unwrap();
    let bufs = if mapped {
        Vec::new()
    } else {
        bufs_for(store, layer, ids.len())
    };
    let mut fetch = store.fetch(layer, ids, bufs).unwrap();
    assert_eq!(fetch.remaining(), ids.len());
    let mut order = Vec::new();
    while let Some(l) = fetch.next_landed() {
        l.result.unwrap();
        let e = ids[l.index];
        match l.buf {
            Some(b) => check_expert(m, layer, e, &b),
            None => {
                let mut b = ExpertBuf::new(store.extent_bytes(layer));
                b.as_bytes_mut()
                    .copy_from_slice(store.mapped(layer, e).unwrap());
                check_expert(m, layer, e, &b);
            }
        }
        order.push(l.index);
    }
    assert!(fetch.next_landed().is_none());
    order.sort();
    assert_eq!(order, (0..ids.len()).collect::<Vec<_>>());
    order
}

#[test]
fn fetch_hands_back_every_expert_in_each_mode() {
    let (dir, m) = fixture();
    for (mmap, direct_io) in [(true, false), (false, false), (false, true), (true, true)] {
        let opts = ExpertStoreOptions {
            mmap,
            direct_io,
            ..Default::default()
        };
        let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
        // Direct files are never mapped (a refused O_DIRECT falls back to
        // buffered, which is mapped when asked).
        let mapped = store.is_mapped(1).unwrap();
        assert_eq!(mapped, mmap && !store.is_direct(1).unwrap());
        assert_eq!(store.mapped(1, 0).is_some(), mapped);
        fetch_and_check(&store, &m, 1, &[5, 1, 5, 0]);
        fetch_and_check(&store, &m, 4, &[2]);
        fetch_and_check(&store, &m, 4, &[]);
        let s = store.stats();
        assert_eq!((s.reads, s.bytes), (5, 4 * 12_288 + 8_192), "{opts:?}");
        assert_eq!(s.calls, 2);
        store.evict_page_cache().unwrap();
        // Still readable after eviction (refaulted or re-read).
        fetch_and_check(&store, &m, 1, &[3]);
        assert!(store.mapped(1, 6).is_none());
    }
}

#[test]
fn bad_fetches_are_errors() {
    let (dir, m) = fixture();
    let mapped = ExpertStore::open(dir.path(), &m, &Default::default()).unwrap();
    assert!(mapped.fetch(9, &[0], Vec::new()).is_err());
    assert!(mapped.fetch(1, &[6], Vec::new()).is_err());
    let e = mapped.fetch(1, &[0], bufs_for(&mapped, 1, 1)).unwrap_err();
    assert!(e.to_string().contains("takes no buffers"), "{e}");
    let opts = ExpertStoreOptions {
        mmap: false,
        ..Default::default()
    };
    let read = ExpertStore::open(dir.path(), &m, &opts).unwrap();
    assert_eq!(read.is_mapped(1), Some(false));
    assert!(read.fetch(1, &[0, 1], bufs_for(&read, 1, 1)).is_err());
    assert!(read.fetch(1, &[0], Vec::new()).is_err());
}

/// A file truncated under an open store: the next fetch fails naming the
/// file, layer and experts, in every mode; mapped, even where the kernel
/// has no `MADV_POPULATE_READ` (whose page-by-page touch would otherwise
/// die of SIGBUS past the new end of file).
#[test]
fn expert_file_truncated_after_open_fails_the_fetch() {
    for (mmap, direct_io, no_populate) in [
        (true, false, false),
        (true, false, true),
        (false, false, false),
        (false, true, false),
    ] {
        let (dir, m) = fixture();
        let opts = ExpertStoreOptions {
            mmap,
            direct_io,
            ..Default::default()
        };
        let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
        fetch_and_check(&store, &m, 1, &[5, 0]);
        let path = dir.path().join(expert_file_name(1));
        shrink(&path, 12_288);
        let what = format!("mmap {mmap}, direct {direct_io}, no populate {no_populate}");
        sys::tests_hook::set_refuse_populate(no_populate);
        let bufs = if store.is_mapped(1).unwrap() {
            Vec::new()
        } else {
            bufs_for(&store, 1, 2)
        };
        let e = match store.fetch(1, &[5, 0], bufs) {
            Err(e) => e,
            Ok(mut f) => {
                let mut first = None;
                while let Some(l) = f.next_landed() {
                    if let Err(e) = l.result {
                        first.get_or_insert(e);
                    }
                }
                first.unwrap_or_else(|| panic!("{what}: expert 5 read past the end"))
            }
        };
        sys::tests_hook::set_refuse_populate(false);
        let e = e.to_string();
        assert!(
            e.contains("layer_001.bin") && e.contains("layer 1") && e.contains('5'),
            "{what}: {e}"
        );
    }
}

/// Reads into host memory by address, at most 4096 bytes per call (so
/// `fetch_to` must continue after short reads), as a device reader would.
struct ByAddress;

impl ExtentReader for ByAddress {
    fn read(&self, file: &File, dst: u64, len: usize, offset: u64) -> std::io::Result<usize> {
        // SAFETY: the test's destinations are live, aligned `ExpertBuf`s of
        // at least an extent each, one per read in flight.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len.min(4096)) };
        file.read_at(dst, offset)
    }
}

/// `fetch_to` reads every expert of a direct layer to the addresses given,
/// continuing after short reads; a file cut short fails with the file,
/// layer and expert named; only direct layers are accepted.
#[test]
fn fetch_to_reads_direct_layers_to_the_given_addresses() {
    let (dir, m) = fixture();
    let opts = ExpertStoreOptions {
        direct_io: true,
        ..Default::default()
    };
    let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
    if store.is_direct(1) != Some(true) {
        eprintln!("skipped: the temporary directory's file system refuses O_DIRECT");
        return;
    }
    let ids = [5usize, 1, 5, 0];
    let mut bufs = bufs_for(&store, 1, ids.len());
    let dsts: Vec<u64> = bufs
        .iter_mut()
        .map(|b| b.as_bytes_mut().as_mut_ptr() as u64)
        .collect();
    let mut f = store.fetch_to(1, &ids, &dsts, Arc::new(ByAddress)).unwrap();
    while let Some(l) = f.next_landed() {
        l.result.unwrap();
        assert!(l.buf.is_none());
    }
    for (&e, b) in ids.iter().zip(&bufs) {
        check_expert(&m, 1, e, b);
    }
    assert_eq!(store.stats().reads, 4);
    assert!(store.direct_file(1).is_some());
    let e = store
        .fetch_to(1, &[0], &[], Arc::new(ByAddress))
        .unwrap_err();
    assert!(e.to_string().contains("destinations"), "{e}");
    let mapped = ExpertStore::open(dir.path(), &m, &Default::default()).unwrap();
    assert!(mapped.direct_file(1).is_none());
    let e = mapped
        .fetch_to(1, &[0], &dsts[..1], Arc::new(ByAddress))
        .unwrap_err();
    assert!(e.to_string().contains("not read with O_DIRECT"), "{e}");

    let path = dir.path().join(expert_file_name(1));
    shrink(&path, 12_288);
    let mut f = store
        .fetch_to(1, &[5], &dsts[..1], Arc::new(ByAddress))
        .unwrap();
    let e = f.next_landed().unwrap().result.unwrap_err().to_string();
    assert!(
        e.contains("layer_001.bin") && e.contains("expert 5 of layer 1"),
        "{e}"
    );
}

#[test]
fn io_pool_threads_are_named() {
    let (dir, m) = fixture();
    let opts = ExpertStoreOptions {
        io_threads: 2,
        ..Default::default()
    };
    let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
    assert_eq!(store.pool.current_num_threads(), 2);
    let name = store
        .pool
        .install(|| std::thread::current().name().map(str::to_owned));
    assert!(name.unwrap().starts_with("moeflux-io-"));
}

#[test]
fn expert_buf_is_aligned_zeroed_and_views_are_checked() {
    for len in [0, 1, 100, 4096, 4097, 1_769_472] {
        let b = ExpertBuf::new(len);
        assert_eq!(b.len(), len);
        assert_eq!(b.as_bytes().as_ptr() as usize % 4096, 0, "len {len}");
        assert!(b.as_bytes().iter().all(|&x| x == 0));
    }
    let mut b = ExpertBuf::new(64);
    for (i, x) in b.as_bytes_mut().iter_mut().enumerate() {
        *x = i as u8;
    }
    assert_eq!(b.u32s(4, 1).unwrap(), &[u32::from_le_bytes([4, 5, 6, 7])]);
    assert_eq!(b.u16s(2, 2).unwrap(), &[0x0302, 0x0504]);
    assert_eq!(b.f32s(60, 1).unwrap().len(), 1);
    assert_eq!(b.u32s(0, 16).unwrap().len(), 16);
    assert!(b.u32s(2, 1).is_none());
    assert!(b.u32s(1, 0).is_none());
    assert!(b.u16s(3, 1).is_none());
    assert!(b.f32s(6, 1).is_none());
    assert!(b.u32s(0, 17).is_none());
    assert!(b.u32s(64, 1).is_none());
    assert!(b.u16s(0, usize::MAX).is_none());
    assert_eq!(b.u32s(64, 0).unwrap().len(), 0);
    let c = b.clone();
    assert_eq!(c.as_bytes(), b.as_bytes());
    assert_eq!(c.as_bytes().as_ptr() as usize % 4096, 0);
}

#[test]
fn store_and_buffers_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ExpertStore>();
    assert_send_sync::<ExpertBuf>();
    fn assert_send<T: Send>() {}
    assert_send::<Fetch>();
}

/// Throughput of random 8-expert reads of a 1.77 MB expert (Qwen3.6-35B-A3B
/// at 4 bits) from a ~1 GB layer file. Run with
/// `cargo test --release -p moeflux io::tests::bench -- --ignored --nocapture`;
/// `MOEFLUX_IO_BENCH_DIR` picks the file system (default: the temp dir).
#[test]
#[ignore]
fn bench_expert_reads() {
    const EXPERT: u64 = 1_769_472; // 432 pages
    const N: usize = 606; // 1.07 GB
    const K: usize = 8;
    let root = std::env::var_os("MOEFLUX_IO_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(&root).unwrap();
    let layer = FakeLayer {
        layer: 0,
        num_experts: N,
        expert_bytes: EXPERT,
        stride: EXPERT,
    };
    let t = Instant::now();
    let path = write_layer_file(dir.path(), &layer);
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    eprintln!(
        "wrote {} ({:.2} GB) in {:.1} s",
        path.display(),
        (N as u64 * EXPERT) as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let m = manifest(&[layer]);

    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next_ids = move |k: usize| -> Vec<usize> {
        (0..k)
            .map(|_| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                (rng % N as u64) as usize
            })
            .collect()
    };

    let run = |name: &str,
               opts: ExpertStoreOptions,
               k: usize,
               calls: usize,
               cold: bool,
               ids: &mut dyn FnMut(usize) -> Vec<usize>| {
        let store = ExpertStore::open(dir.path(), &m, &opts).unwrap();
        let mut bufs: Vec<ExpertBuf> = (0..k).map(|_| ExpertBuf::new(EXPERT as usize)).collect();
        if cold {
            store.evict_page_cache().unwrap();
        } else {
            // Warm the page cache with every expert.
            let mut one = vec![ExpertBuf::new(EXPERT as usize)];
            for e in 0..N {
                store.read_experts(0, &[e], &mut one).unwrap();
            }
        }
        store.reset_stats();
        for _ in 0..calls {
            let ids = ids(k);
            if cold {
                store.evict_page_cache().unwrap();
            }
            store.read_experts(0, &ids, &mut bufs).unwrap();
        }
        let s = store.stats();
        println!(
            "{name:<44} direct={:<5} threads={} k={k}: {:>6.2} GB/s, {:>7.3} ms per call \
             ({} reads, {:.2} GB)",
            store.is_direct(0).unwrap(),
            opts.io_threads,
            s.gb_per_s(),
            s.busy_ns as f64 / 1e6 / s.calls as f64,
            s.reads,
            s.bytes as f64 / 1e9
        );
    };

    let buffered = ExpertStoreOptions::default();
    let no_advice = ExpertStoreOptions {
        fadvise_random: false,
        ..Default::default()
    };
    let direct = ExpertStoreOptions {
        direct_io: true,
        ..Default::default()
    };
    let one_thread = |o: &ExpertStoreOptions| ExpertStoreOptions {
        io_threads: 1,
        ..o.clone()
    };
    run(
        "warm, buffered",
        buffered.clone(),
        K,
        400,
        false,
        &mut next_ids,
    );
    run(
        "warm, buffered",
        one_thread(&buffered),
        K,
        400,
        false,
        &mut next_ids,
    );
    run(
        "cold, buffered + FADV_RANDOM",
        buffered.clone(),
        K,
        80,
        true,
        &mut next_ids,
    );
    run(
        "cold, buffered, default readahead",
        no_advice,
        K,
        80,
        true,
        &mut next_ids,
    );
    run("cold, O_DIRECT", direct.clone(), K, 80, true, &mut next_ids);
    run(
        "cold, buffered + FADV_RANDOM",
        one_thread(&buffered),
        K,
        40,
        true,
        &mut next_ids,
    );
    run(
        "cold, O_DIRECT",
        one_thread(&direct),
        K,
        40,
        true,
        &mut next_ids,
    );
    run(
        "cold, buffered + FADV_RANDOM",
        buffered,
        1,
        200,
        true,
        &mut next_ids,
    );
    run("cold, O_DIRECT", direct, 1, 200, true, &mut next_ids);
}
