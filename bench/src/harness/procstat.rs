//! What a process has cost so far, from `/proc`: CPU seconds (all its
//! threads, user and system) and its peak resident set.

use std::sync::OnceLock;

/// CPU seconds and peak RSS of a live process.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Usage {
    pub(crate) cpu_s: f64,
    pub(crate) peak_rss_mib: f64,
}

/// `None` once the process is gone.
pub(crate) fn usage(pid: u32) -> Option<Usage> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    Some(Usage {
        cpu_s: cpu_seconds(&stat)?,
        peak_rss_mib: peak_rss_kib(&status)? as f64 / 1024.0,
    })
}

/// CPU seconds of a Postgres server so far, from its postmaster's pid: the
/// postmaster's own, its reaped children's (`cutime` + `cstime`) and its
/// live children's. The difference of two readings is exactly what the
/// server's processes spent in between, whichever of them came and went.
pub(crate) fn server_cpu_seconds(postmaster: u32) -> f64 {
    let fields = |pid: u32| -> Option<Vec<u64>> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let rest = stat.rsplit_once(')')?.1;
        rest.split_whitespace()
            .skip(11)
            .take(4)
            .map(|f| f.parse().ok())
            .collect()
    };
    let own = fields(postmaster).map_or(0, |f| f.iter().sum::<u64>());
    let children =
        std::fs::read_to_string(format!("/proc/{postmaster}/task/{postmaster}/children"))
            .unwrap_or_default();
    let alive: u64 = children
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter_map(fields)
        .map(|f| f[0] + f[1])
        .sum();
    (own + alive) as f64 / ticks_per_second()
}

/// utime + stime of a `/proc/PID/stat` line, in seconds. The command name
/// (field 2) may hold spaces: fields are counted after its closing `)`.
fn cpu_seconds(stat: &str) -> Option<f64> {
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Fields 14 and 15 of the line; `rest` starts at field 3.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / ticks_per_second())
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 on every
/// Linux this runs on, the fallback).
fn ticks_per_second() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .filter(|&t: &f64| t > 0.0)
            .unwrap_or(100.0)
    })
}

fn peak_rss_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_process_with_spaces_in_its_name() {
        let stat = "4242 (java main) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 30 0";
        assert_eq!(cpu_seconds(stat), Some(300.0 / ticks_per_second()));
        assert_eq!(peak_rss_kib("Name:\tx\nVmHWM:\t  20480 kB\n"), Some(20480));
        let me = usage(std::process::id()).expect("this process");
        assert!(me.peak_rss_mib > 0.0);
    }
}
