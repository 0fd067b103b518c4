//! Bytes this process actually pulled from storage (`read_bytes` of
//! `/proc/self/io`): compared with the bytes the expert store requested, it
//! estimates how many expert reads the page cache served.

/// Cumulative bytes read from storage by this process, where the kernel
/// reports it (Linux); `None` elsewhere.
pub fn disk_read_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
}

/// `MemAvailable` of `/proc/meminfo` in bytes (what can be allocated
/// without swapping, reclaimable page cache included), where the kernel
/// reports it (Linux); `None` elsewhere.
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kb.checked_mul(1024)
}

/// Share of `requested` bytes served from the page cache, given the storage
/// bytes read meanwhile (other reads of the process count too, so this is
/// an estimate; clamped to [0, 1]).
pub fn cache_hit_rate(requested: u64, from_disk: u64) -> Option<f64> {
    (requested > 0).then(|| 1.0 - (from_disk as f64 / requested as f64).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_rate_is_clamped() {
        assert_eq!(cache_hit_rate(0, 5), None);
        assert_eq!(cache_hit_rate(100, 0), Some(1.0));
        assert_eq!(cache_hit_rate(100, 500), Some(0.0));
        assert_eq!(cache_hit_rate(100, 25), Some(0.75));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_proc_self_io() {
        assert!(disk_read_bytes().is_some());
        assert!(mem_available_bytes().is_some_and(|b| b > 0));
    }
}
