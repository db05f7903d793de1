//! The standard `process_*` metrics (as the Prometheus client libraries of
//! other languages export them), read from `/proc/self` at each scrape.
//! Where `/proc` cannot be read (not Linux), they are left out.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Collects `process_*` at scrape time.
#[derive(Debug, Default)]
pub(super) struct ProcessCollector;

/// What `/proc/self` says.
#[derive(Debug, Default, PartialEq)]
struct Sample {
    cpu_seconds: f64,
    resident_bytes: i64,
    virtual_bytes: i64,
    threads: i64,
    start_time_seconds: f64,
    open_fds: Option<i64>,
    max_fds: Option<i64>,
}

/// The kernel's `USER_HZ`, the unit of `/proc`'s CPU times: 100 on every
/// architecture Linux exports to user space (sysconf(_SC_CLK_TCK) would
/// need `unsafe`, which this workspace denies).
const USER_HZ: f64 = 100.0;

/// Parses `/proc/self/stat` (fields after the command, which may hold
/// spaces and parentheses), with the boot time.
fn parse_stat(stat: &str, boot_time: f64) -> Option<Sample> {
    let ticks = USER_HZ;
    let after = stat.get(stat.rfind(')')? + 2..)?;
    let f: Vec<&str> = after.split_whitespace().collect();
    // Field numbers of proc(5) minus 3: state is field 3.
    let num = |i: usize| f.get(i - 3)?.parse::<f64>().ok();
    Some(Sample {
        cpu_seconds: (num(14)? + num(15)?) / ticks,
        threads: num(20)? as i64,
        start_time_seconds: boot_time + num(22)? / ticks,
        virtual_bytes: num(23)? as i64,
        resident_bytes: 0,
        open_fds: None,
        max_fds: None,
    })
}

/// A `kB` line of `/proc/self/status`.
fn kib_of(status: &str, key: &str) -> Option<i64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// `btime` of `/proc/stat`.
fn boot_time(proc_stat: &str) -> Option<f64> {
    proc_stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()
}

/// The soft limit of `Max open files` in `/proc/self/limits`.
fn max_fds(limits: &str) -> Option<i64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn sample() -> Option<Sample> {
    let boot = boot_time(&std::fs::read_to_string("/proc/stat").ok()?)?;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let mut s = parse_stat(&stat, boot)?;
    // In kB, whatever the page size.
    s.resident_bytes = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|st| kib_of(&st, "VmRSS:"))?
        * 1024;
    s.open_fds = std::fs::read_dir("/proc/self/fd")
        .ok()
        .map(|d| d.count() as i64);
    s.max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| max_fds(&l));
    Some(s)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(s) = sample() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(s.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges: [(&str, &str, Option<f64>); 6] = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                Some(s.resident_bytes as f64),
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                Some(s.virtual_bytes as f64),
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                Some(s.start_time_seconds),
            ),
            (
                "process_threads",
                "Number of OS threads in the process",
                Some(s.threads as f64),
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                s.open_fds.map(|v| v as f64),
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                s.max_fds.map(|v| v as f64),
            ),
        ];
        for (name, help, value) in gauges {
            let Some(value) = value else { continue };
            let g = ConstGauge::new(value);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_proc_stat_even_with_a_command_holding_parentheses_and_spaces() {
        let stat = "4242 (tokio (rt) 1) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    250 50 0 0 20 0 7 0 1000 123456789 3000 18446744073709551615";
        let s = parse_stat(stat, 1_700_000_000.0).unwrap();
        assert_eq!(s.cpu_seconds, 3.0);
        assert_eq!(s.threads, 7);
        assert_eq!(s.start_time_seconds, 1_700_000_010.0);
        assert_eq!(s.virtual_bytes, 123_456_789);
        assert_eq!(kib_of("Name: x\nVmRSS:\t  1500 kB\n", "VmRSS:"), Some(1500));
    }

    #[test]
    fn malformed_proc_files_give_nothing_rather_than_a_panic() {
        for bad in [
            "",
            "(",
            "1 (x)",
            "1 (x) S 1 2",
            "1 (x) S a b c d e f g h i j k l m n o p q r s t u",
        ] {
            assert_eq!(parse_stat(bad, 0.0), None, "{bad:?}");
        }
        assert_eq!(boot_time("cpu 1 2\nbtime x\n"), None);
        assert_eq!(boot_time("btime 1700000000\n"), Some(1_700_000_000.0));
        assert_eq!(
            max_fds("Limit  Soft Limit  Hard Limit  Units\nMax open files            1024                 524288               files\n"),
            Some(1024)
        );
        assert_eq!(max_fds("Max open files"), None);
    }

    #[test]
    fn this_process_is_sampled_on_linux() {
        let s = sample().expect("/proc is readable here");
        assert!(s.resident_bytes > 0 && s.threads >= 1 && s.open_fds.unwrap() > 0);
    }
}
