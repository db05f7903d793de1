//! `walbox-bench`: the benchmark harness (docs/benchmarks.md). Each phase
//! runs on a fresh private Postgres (durable: fsync and full_page_writes
//! on) and a fresh Apache Kafka node, RUNS times; the report gives the
//! median and the range of every figure. `scripts/bench` builds and runs
//! it.
//!
//! ```text
//! walbox-bench [--runs N] [--only PHASE[,PHASE…]] [--quick] [--out DIR] [--write-doc FILE]
//! ```
//! Phases, walbox and Debezium side by side (`peers`):
//! `small` (500,000 events of ~200 B), `large` (100,000 of ~2 KB),
//! `curve` (commit → on the topic at 1k/5k/20k events/s and unthrottled),
//! `kill` (duplicates after one kill -9).
//!
//! `--walbox-only` leaves Debezium out: for measuring a change to walbox
//! (run it with each build as `WALBOX_BIN`).
//!
//! Needs `WALBOX_BIN` (a release build of walbox), `WALBOX_KAFKA_LIBS`
//! (scripts/install-kafka) and `WALBOX_DEBEZIUM_LIBS`
//! (scripts/install-debezium); the Postgres binaries are found as by the
//! tests (`WALBOX_PG_BIN`, else Debian's).

mod peers;
mod procstat;
mod relay;
mod report;
mod results;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;

use results::Results;

pub(crate) const PHASES: [&str; 4] = ["small", "large", "curve", "kill"];

/// How big a run is: `--quick` is a tenth, one run, to check the harness.
#[derive(Clone, Copy)]
pub(crate) struct Scale {
    pub(crate) divisor: i64,
    pub(crate) runs: u32,
}

impl Scale {
    pub(crate) fn small_events(self) -> i64 {
        500_000 / self.divisor
    }
    pub(crate) fn large_events(self) -> i64 {
        100_000 / self.divisor
    }
    /// The backlogs of the `small` and `large` phases, in that order.
    pub(crate) fn backlogs(self) -> [peers::Backlog; 2] {
        [
            peers::Backlog {
                phase: "small",
                events: self.small_events(),
                large: false,
            },
            peers::Backlog {
                phase: "large",
                events: self.large_events(),
                large: true,
            },
        ]
    }
    pub(crate) fn kill_events(self) -> i64 {
        200_000 / self.divisor
    }
    pub(crate) fn curve_seconds(self) -> u32 {
        (20 / self.divisor).max(2) as u32
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let mut scale = Scale {
        divisor: 1,
        runs: 3,
    };
    let mut only: Vec<String> = PHASES.iter().map(|s| (*s).to_owned()).collect();
    let mut doc: Option<String> = None;
    let mut out: Option<PathBuf> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => {
                scale = Scale {
                    divisor: 10,
                    runs: 1,
                }
            }
            "--runs" => match args.next().and_then(|v| v.parse().ok()).filter(|&n| n > 0) {
                Some(n) => scale.runs = n,
                None => return usage("--runs takes a positive integer"),
            },
            "--only" => {
                only = args
                    .next()
                    .map(|v| v.split(',').map(str::to_owned).collect())
                    .unwrap_or_default();
                if let Some(bad) = only.iter().find(|p| !PHASES.contains(&p.as_str())) {
                    return usage(&format!("unknown phase {bad:?}"));
                }
            }
            "--out" => out = args.next().map(PathBuf::from),
            "--walbox-only" => peers::set_walbox_only(),
            "--write-doc" => doc = args.next(),
            "-h" | "--help" => {
                println!(
                    "walbox-bench [--runs N] [--only {}] [--quick] [--out DIR] [--write-doc FILE]",
                    PHASES.join(",")
                );
                return ExitCode::SUCCESS;
            }
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    let Some(walbox) = std::env::var("WALBOX_BIN").ok().filter(|b| !b.is_empty()) else {
        return usage("set WALBOX_BIN to a release build of walbox (scripts/bench does)");
    };
    if walbox_test_harness::apache_kafka::libs_from_env().is_none() {
        return usage("set WALBOX_KAFKA_LIBS to Apache Kafka's jars (scripts/install-kafka)");
    }
    if walbox_test_harness::debezium::libs_from_env().is_none() {
        return usage(
            "set WALBOX_DEBEZIUM_LIBS to Connect's and Debezium's jars (scripts/install-debezium)",
        );
    }
    let out = out.unwrap_or_else(|| PathBuf::from("target/bench"));
    if let Err(e) = std::fs::create_dir_all(&out) {
        eprintln!("walbox-bench: create {}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    let mut results = match Results::create(&out.join("peers.tsv")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("walbox-bench: {}: {e}", out.display());
            return ExitCode::FAILURE;
        }
    };
    let wants = |p: &str| only.iter().any(|o| o == p);
    for run in 1..=scale.runs {
        results.set_run(run);
        for b in scale.backlogs() {
            if wants(b.phase) {
                peers::backlog(&mut results, &walbox, b).await;
            }
        }
        if wants("curve") {
            peers::curve(&mut results, &walbox, scale.curve_seconds()).await;
        }
        if wants("kill") {
            peers::kill(&mut results, &walbox, scale.kill_events()).await;
        }
    }
    let text = report::peers(&results, scale).await;
    println!("{text}");
    if let Err(e) = std::fs::write(out.join("peers.md"), &text) {
        eprintln!("walbox-bench: write the report: {e}");
    }
    if let Some(path) = doc {
        if let Err(e) = report::write_doc(&path, &text) {
            eprintln!("walbox-bench: {e}");
            return ExitCode::FAILURE;
        }
        eprintln!("walbox-bench: updated {path}");
    }
    ExitCode::SUCCESS
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("walbox-bench: {problem} (see --help)");
    ExitCode::from(2)
}
