//! What a process, or a whole Postgres server, has cost so far, from
//! `/proc` (walbox_test_harness::proc_stat reads the fields).

use walbox_test_harness::proc_stat::{cpu_seconds, peak_rss_kib, stat_times, ticks_per_second};

/// CPU seconds and peak RSS of a live process.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Usage {
    pub(crate) cpu_s: f64,
    pub(crate) peak_rss_mib: f64,
}

/// `None` once the process is gone.
pub(crate) fn usage(pid: u32) -> Option<Usage> {
    Some(Usage {
        cpu_s: cpu_seconds(pid)?,
        peak_rss_mib: peak_rss_kib(pid)? as f64 / 1024.0,
    })
}

/// Resident set (`VmRSS`) of a live process now, MiB.
pub(crate) fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// CPU seconds of a Postgres server so far, from its postmaster's pid: the
/// postmaster's own, its reaped children's (`cutime` + `cstime`) and its
/// live children's. The difference of two readings is exactly what the
/// server's processes spent in between, whichever of them came and went.
pub(crate) fn server_cpu_seconds(postmaster: u32) -> f64 {
    let own = stat_times(postmaster).map_or(0, |t| t.iter().sum::<u64>());
    let children =
        std::fs::read_to_string(format!("/proc/{postmaster}/task/{postmaster}/children"))
            .unwrap_or_default();
    let alive: u64 = children
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter_map(stat_times)
        .map(|t| t[0] + t[1])
        .sum();
    (own + alive) as f64 / ticks_per_second()
}
