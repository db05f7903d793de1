//! What a process has cost so far, read from `/proc`: for the torture
//! suite's and the benchmarks' reports.

use std::sync::OnceLock;

/// Peak resident set (`VmHWM`) of a live process, in KiB.
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    vm_hwm_kib(&status)
}

/// CPU seconds of a live process so far: `utime + stime` of all its
/// threads.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let fields = stat_times(pid)?;
    Some((fields[0] + fields[1]) as f64 / ticks_per_second())
}

/// `utime`, `stime`, `cutime`, `cstime` of a live process, in clock ticks.
pub fn stat_times(pid: u32) -> Option<[u64; 4]> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    times_of(&stat)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 on every
/// Linux this runs on, the fallback).
pub fn ticks_per_second() -> f64 {
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

/// Fields 14–17 of a `/proc/PID/stat` line. The command name (field 2)
/// may hold spaces and parentheses: fields are counted after its last `)`.
fn times_of(stat: &str) -> Option<[u64; 4]> {
    let rest = stat.rsplit_once(')')?.1;
    // `rest` starts at field 3.
    let mut f = rest
        .split_whitespace()
        .skip(11)
        .map(|v| v.parse::<u64>().ok());
    Some([f.next()??, f.next()??, f.next()??, f.next()??])
}

fn vm_hwm_kib(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_process_with_spaces_in_its_name() {
        let stat = "4242 (java (main) x) S 1 2 3 4 5 6 7 8 9 10 250 50 7 3 20 0 30 0";
        assert_eq!(times_of(stat), Some([250, 50, 7, 3]));
        assert_eq!(times_of("4242 (short) S 1 2"), None);
        assert_eq!(vm_hwm_kib("Name:\tx\nVmHWM:\t  20480 kB\n"), Some(20480));
        let me = std::process::id();
        assert!(peak_rss_kib(me).is_some_and(|k| k > 0));
        assert!(cpu_seconds(me).is_some());
    }
}
