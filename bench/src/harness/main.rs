//! `walbox-bench`: the benchmark harness (docs/benchmarks.md). See
//! [`USAGE`].

mod alone;
mod peers;
mod procstat;
mod relay;
mod report;
mod results;
mod shapes;
mod world;

use std::path::PathBuf;
use std::process::ExitCode;

use results::Results;

const USAGE: &str = "\
walbox-bench: the benchmark harness (docs/benchmarks.md); scripts/bench builds and runs it.

Each phase runs on a fresh private Postgres (durable: fsync, full_page_writes and
synchronous_commit on, commit timestamps tracked) and a fresh Apache Kafka node
(KRaft), RUNS times; the report gives the median and the range of every figure.

Usage: walbox-bench [--runs N] [--only PHASE[,PHASE...]] [--quick] [--out DIR]
                    [--write-doc FILE] [--walbox-only]

Phases (all but retention by default):
  small      500,000 events of ~200 B, transactions of 100: pg_recvlogical (the
             slot's own limit), walbox, Debezium (also with 512 and 256 MiB
             heaps) and the polling relay (batch 50 and 500) drain them, each
             reader warm (paused while the backlog is written; its start-up
             timed on its own); time until every event is on the topic (read
             back: every event id once), CPU, peak RSS, what each cost the primary
  large      the same with 100,000 events of ~2 KB
  huge       one transaction of 1,000,000 rows (pg_recvlogical, walbox, Debezium)
  messages   the small backlog through walbox.emit() (no table): pg_recvlogical
             with messages on, walbox with source = messages
  curve      commit -> on the topic at 1k/5k/20k events/s and unthrottled, exact
             over every event, walbox and Debezium (also polling every 1 ms)
  kill       duplicates after kill -9s at random points of a backlog (10 per
             relay over the runs), walbox and Debezium; Debezium with Connect's
             60 s offset flush killed more than 60 s into a stream
  eos        exactly-once beside at-least-once on the small backlog, one
             transaction of 1,000,000 rows exactly-once, commit -> ack at 5k/s
  shards     the small backlog drained by 1, 2 and 4 shards
  writecost  what writing an event costs the application (pgbench, no relay)
  cleanup    what keeping the outbox small costs the primary, five ways
  audit      the small backlog drained plain, with the continuous audit and
             with receipts (throughput, the primary's CPU and WAL per event);
             then walbox audit over every event (default memory, and 8 MiB:
             spilling), its time, peak RSS and the primary's CPU
  brokers    100,000 events of ~200 B drained by walbox to Apache Kafka, RabbitMQ,
             an SQS FIFO and a standard queue (ElasticMQ), a NATS JetStream stream
             and a webhook endpoint, beside pg_recvlogical; and each broker alone:
             as many messages from walbox's client for it (needs
             WALBOX_ELASTICMQ_LIBS, WALBOX_NATS_SERVER, rabbitmq-server)
  conduit    shaped like Conduit's published Postgres -> Kafka CDC run: 2,000,000
             events of ~200 B in transactions of 200 written while the relay is
             stopped, then walbox and Debezium (each from its own slot) started:
             events/s, CPU %, mean and peak RSS over the drain, start included;
             RSS sampled every 0.5 s (the RSS over time figure)
  sequin     shaped like Sequin's published workload: transactions of 100
             INSERTs, 100 UPDATEs and 100 DELETEs on the outbox table, 20/s and
             as fast as pgbench writes, 60 s each: operations/s, events/s,
             mean, p50 and p99 from the row's timestamp to the broker's
             append time, walbox's CPU % (walbox only)
  retention  5,000 events/s for 10 minutes with retention off, on, and on a
             partitioned outbox (30 minutes a run)

  peers      small, large, huge, messages, curve and kill: the phases of the
             section beside Debezium

  --runs N        runs of each phase (default 3)
  --quick         one run at a tenth of the size: checks the harness
  --out DIR       where results.tsv and the sections' markdown go (target/bench)
  --write-doc F   replace the generated sections of F whose phases all ran (and
                  draw the figures of the section beside Debezium into the
                  figures/ directory beside F; always into DIR/figures)
  --walbox-only   leave Debezium out (to compare one walbox build with another,
                  run with each as WALBOX_BIN)
  --report FILE   write the report of an earlier run from its results.tsv (and
                  the run.txt beside it) again, running nothing; with --write-doc
                  into the document; with --quick for a quick run's

Needs WALBOX_BIN (a release build of walbox), WALBOX_KAFKA_LIBS
(scripts/install-kafka) and WALBOX_DEBEZIUM_LIBS (scripts/install-debezium);
the Postgres binaries are found as by the tests (WALBOX_PG_BIN, else Debian's).
WALBOX_BENCH_ARGS adds flags to every walbox run (e.g. \"--kafka-property linger.ms=5\").
";

/// Every phase, in the order a run takes them.
pub(crate) const PHASES: [&str; 15] = [
    "small",
    "large",
    "huge",
    "messages",
    "curve",
    "kill",
    "eos",
    "shards",
    "writecost",
    "cleanup",
    "audit",
    "brokers",
    "conduit",
    "sequin",
    "retention",
];

/// The phase left out when `--only` does not say: three times ten minutes
/// of writes.
const NOT_BY_DEFAULT: &str = "retention";

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
    /// The backlog phases, in the order they run.
    pub(crate) fn backlogs(self) -> [peers::Backlog; 4] {
        use peers::{Backlog, Rows};
        [
            Backlog {
                phase: "small",
                events: self.small_events(),
                tx: 100,
                rows: Rows::Small,
                debezium: true,
                pollers: true,
                heaps: true,
            },
            Backlog {
                phase: "large",
                events: self.large_events(),
                tx: 100,
                rows: Rows::Large,
                debezium: true,
                pollers: true,
                heaps: false,
            },
            // One transaction of a million rows: what a bulk import does.
            Backlog {
                phase: "huge",
                events: 1_000_000 / self.divisor,
                tx: 1_000_000 / self.divisor,
                rows: Rows::Small,
                debezium: true,
                pollers: false,
                heaps: false,
            },
            Backlog {
                phase: "messages",
                events: self.small_events(),
                tx: 100,
                rows: Rows::Messages,
                debezium: false,
                pollers: false,
                heaps: false,
            },
        ]
    }
    pub(crate) fn kill_events(self) -> i64 {
        200_000 / self.divisor
    }
    pub(crate) fn curve_seconds(self) -> u32 {
        (20 / self.divisor).max(2) as u32
    }
    /// The `conduit` phase's backlog.
    pub(crate) fn conduit_events(self) -> i64 {
        2_000_000 / self.divisor
    }
    /// Each point of the `sequin` phase (its generator's default duration).
    pub(crate) fn sequin_seconds(self) -> u32 {
        (60 / self.divisor).max(2) as u32
    }
    pub(crate) fn retention_seconds(self) -> u32 {
        (600 / self.divisor) as u32
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let mut scale = Scale {
        divisor: 1,
        runs: 3,
    };
    let mut only: Vec<String> = PHASES
        .iter()
        .filter(|p| **p != NOT_BY_DEFAULT)
        .map(|s| (*s).to_owned())
        .collect();
    let mut doc: Option<String> = None;
    let mut out: Option<PathBuf> = None;
    let mut report_of: Option<PathBuf> = None;
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
                // `peers`: the phases of the section beside Debezium.
                only = args
                    .next()
                    .map(|v| {
                        v.split(',')
                            .flat_map(|p| match p {
                                "peers" => report::PEERS_PHASES.to_vec(),
                                p => vec![p],
                            })
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default();
                if let Some(bad) = only.iter().find(|p| !PHASES.contains(&p.as_str())) {
                    return usage(&format!("unknown phase {bad:?}"));
                }
            }
            "--out" => out = args.next().map(PathBuf::from),
            "--report" => match args.next() {
                Some(file) => report_of = Some(PathBuf::from(file)),
                None => return usage("--report takes an earlier run's results.tsv"),
            },
            "--walbox-only" => peers::set_walbox_only(),
            "--write-doc" => doc = args.next(),
            "-h" | "--help" => {
                print!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            other => return usage(&format!("unknown argument {other:?}")),
        }
    }
    if let Some(file) = report_of {
        // The report of an earlier run, written again (after a change to
        // the report, or to write its sections into the document).
        let results = match Results::load(&file) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("walbox-bench: {e}");
                return ExitCode::FAILURE;
            }
        };
        let (runs, ran) = results.runs_and_phases();
        scale.runs = runs;
        let dir = file
            .parent()
            .map_or_else(|| PathBuf::from("."), PathBuf::from);
        if let Err(e) = report::load_stamp(&dir) {
            eprintln!("walbox-bench: {e}");
            return ExitCode::FAILURE;
        }
        return write_report(&results, scale, &ran, &dir, doc.as_deref());
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
    if let Err(e) = report::stamp_run(&out) {
        eprintln!("walbox-bench: {}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    let mut results = match Results::create(&out.join("results.tsv")) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("walbox-bench: {}: {e}", out.display());
            return ExitCode::FAILURE;
        }
    };
    let wants = |p: &str| only.iter().any(|o| o == p);
    for run in 1..=scale.runs {
        results.set_run(run);
        peers::set_run(run);
        for b in scale.backlogs() {
            if wants(b.phase) {
                peers::backlog(&mut results, &walbox, b).await;
            }
        }
        if wants("curve") {
            peers::curve(&mut results, &walbox, scale.curve_seconds()).await;
        }
        if wants("kill") {
            peers::kill(&mut results, &walbox, scale.kill_events(), scale.runs).await;
        }
        if wants("eos") {
            alone::eos(&mut results, &walbox, scale).await;
        }
        if wants("shards") {
            alone::shards(&mut results, &walbox, scale.small_events()).await;
        }
        if wants("writecost") {
            alone::write_cost(&mut results, &walbox, scale.curve_seconds()).await;
        }
        if wants("cleanup") {
            alone::cleanup(&mut results, &walbox, scale.large_events()).await;
        }
        if wants("audit") {
            alone::audit(&mut results, &walbox, scale.small_events()).await;
        }
        if wants("brokers") {
            alone::brokers(&mut results, &walbox, scale.large_events()).await;
        }
        if wants("conduit") {
            shapes::conduit(&mut results, &walbox, scale.conduit_events()).await;
        }
        if wants("sequin") {
            shapes::sequin(&mut results, &walbox, scale.sequin_seconds()).await;
        }
        if wants("retention") {
            alone::retention(&mut results, &walbox, scale.retention_seconds()).await;
        }
    }
    if let Err(e) = report::stamp_machine(&out) {
        eprintln!("walbox-bench: {}: {e}", out.display());
    }
    write_report(&results, scale, &only, &out, doc.as_deref())
}

/// Prints the report's sections, writes each to `out` and, with `doc`,
/// replaces those whose phases all ran in that document.
fn write_report(
    results: &Results,
    scale: Scale,
    ran: &[String],
    out: &std::path::Path,
    doc: Option<&str>,
) -> ExitCode {
    let mut failed = false;
    // The figures, beside the report and (when its section is written)
    // beside the document.
    let drawn_from = |phases: &[&str]| ran.iter().any(|p| phases.contains(&p.as_str()));
    if drawn_from(&report::PEERS_PHASES) || drawn_from(&report::SHAPES_PHASES) {
        let mut dirs = vec![out.join("figures")];
        let all_of = |phases: &[&str]| phases.iter().all(|p| ran.iter().any(|r| r == p));
        let whole = all_of(&report::PEERS_PHASES) || all_of(&report::SHAPES_PHASES);
        if let (Some(doc), true) = (doc, whole) {
            dirs.push(
                std::path::Path::new(doc)
                    .parent()
                    .unwrap_or(std::path::Path::new("."))
                    .join("figures"),
            );
        }
        for dir in dirs {
            match report::figures::draw(results, scale, &dir) {
                Ok(drawn) => eprintln!(
                    "walbox-bench: drew {} in {}",
                    drawn.join(", "),
                    dir.display()
                ),
                Err(e) => {
                    eprintln!("walbox-bench: {e}");
                    failed = true;
                }
            }
        }
    }
    for (name, whole, text) in report::sections(results, scale, ran) {
        println!("{text}");
        if let Err(e) = std::fs::write(out.join(format!("{name}.md")), &text) {
            eprintln!("walbox-bench: write the report: {e}");
        }
        match doc {
            Some(path) if whole => match report::write_doc(path, name, &text) {
                Ok(()) => eprintln!("walbox-bench: updated the {name} section of {path}"),
                Err(e) => {
                    eprintln!("walbox-bench: {e}");
                    failed = true;
                }
            },
            Some(path) => eprintln!(
                "walbox-bench: the {name} section of {path} left as it was: not all of its phases ran"
            ),
            None => {}
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn usage(problem: &str) -> ExitCode {
    eprintln!("walbox-bench: {problem} (see --help)");
    ExitCode::from(2)
}
