//! The relays the benchmark runs side by side, each a process of its own
//! on its own slot and topic: walbox, and Debezium's Postgres connector
//! with its outbox EventRouter in a Kafka Connect standalone worker. Both
//! read the same outbox table through the same publication and write the
//! same records (key = aggregate id, value = payload, headers `id` and
//! `event_type`) to the same broker.

use std::process::Command;

use walbox_test_harness::debezium::{Connector, Debezium};
use walbox_test_harness::walbox_process::WalboxProcess;

use crate::world::World;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Walbox,
    /// walbox with `delivery = "exactly-once"`, on its own slot.
    WalboxExactlyOnce,
    /// Debezium, as [`Dbz`] sets it up.
    Debezium(Dbz),
}

/// How a Debezium run differs from the benchmark's: its offset flush
/// interval, its JVM's heap and its poll interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dbz {
    pub(crate) flush_ms: u32,
    /// `-Xmx`, MiB.
    pub(crate) heap_mib: u32,
    pub(crate) poll_ms: u32,
}

/// Debezium as the benchmark runs it: offsets flushed every second, the
/// heap `connect-standalone.sh` gives it (2 GiB), a 10 ms poll interval.
pub(crate) const DEBEZIUM: Dbz = Dbz {
    flush_ms: DEBEZIUM_FLUSH_MS,
    heap_mib: DEBEZIUM_HEAP_MIB,
    poll_ms: DEBEZIUM_POLL_MS,
};

/// `-Xmx` as `connect-standalone.sh` sets it.
pub(crate) const DEBEZIUM_HEAP_MIB: u32 = 2048;
/// The connector's `poll.interval.ms` in the benchmark (its default is 500).
pub(crate) const DEBEZIUM_POLL_MS: u32 = 10;

/// Debezium's offset flush interval in the benchmark: walbox's
/// `status_interval_ms` (1 s), the closest Connect comes to confirming as
/// it goes.
pub(crate) const DEBEZIUM_FLUSH_MS: u32 = 1000;
/// Kafka Connect's default offset flush interval, which most deployments keep.
pub(crate) const CONNECT_DEFAULT_FLUSH_MS: u32 = 60_000;

/// The JVM as Kafka's `connect-standalone.sh` starts it (its
/// `KAFKA_HEAP_OPTS` and `KAFKA_JVM_PERFORMANCE_OPTS` defaults), less
/// `-Xmx` ([`Dbz::heap_mib`]).
pub(crate) const JVM: &[&str] = &[
    "-Xms256M",
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
];

/// The Connect worker's producer, set as walbox's librdkafka producer is:
/// acks=all, idempotence, lz4, linger.ms=1, batches of up to 1 MB
/// (librdkafka's `batch.size`; the Java client's default is 16 KiB). Its
/// partitioner is the Java default (murmur2), which walbox's
/// `murmur2_random` matches.
pub(crate) const WORKER: &[(&str, &str)] = &[
    ("producer.acks", "all"),
    ("producer.enable.idempotence", "true"),
    ("producer.compression.type", "lz4"),
    ("producer.linger.ms", "1"),
    ("producer.batch.size", "1000000"),
];

/// The connector, on walbox's outbox table and publication. Batches and
/// queue raised from Debezium's defaults (2,048 and 8,192) as its
/// performance guidance advises for throughput; `poll.interval.ms` is
/// [`Dbz::poll_ms`], lowered from its 500 ms default so an idle queue
/// costs little latency.
pub(crate) const CONNECTOR: &[(&str, &str)] = &[
    ("publication.autocreate.mode", "disabled"),
    ("max.batch.size", "8192"),
    ("max.queue.size", "32768"),
    ("transforms.outbox.table.field.event.key", "aggregate_id"),
    ("transforms.outbox.route.by.field", "aggregate_type"),
    (
        "transforms.outbox.table.fields.additional.placement",
        "event_type:header:event_type",
    ),
];

impl Dbz {
    /// Its settings that say how it is run: the flush interval always,
    /// the heap and the poll interval when not the benchmark's.
    pub(crate) fn differences(self) -> String {
        let mut s = format!(
            "offsets flushed every {} s",
            f64::from(self.flush_ms) / 1000.0
        );
        if self.heap_mib != DEBEZIUM_HEAP_MIB {
            s += &format!(", `-Xmx{}M`", self.heap_mib);
        }
        if self.poll_ms != DEBEZIUM_POLL_MS {
            s += &format!(", `poll.interval.ms={}`", self.poll_ms);
        }
        s
    }
}

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Walbox => "walbox",
            Kind::WalboxExactlyOnce => "walbox_eos",
            Kind::Debezium(_) => "debezium",
        }
    }

    /// How the report names it.
    pub(crate) fn label(self) -> String {
        match self {
            Kind::Walbox => "walbox".into(),
            Kind::WalboxExactlyOnce => "walbox, exactly-once".into(),
            Kind::Debezium(d) => format!("Debezium ({})", d.differences()),
        }
    }

    /// Its slot, its topics' prefix and its figures' prefix: made before
    /// the events it must read are written.
    pub(crate) fn slot(self) -> String {
        match self {
            Kind::Debezium(d) => {
                let mut slot = "debezium".to_owned();
                if d.flush_ms != DEBEZIUM_FLUSH_MS {
                    slot += &format!("_{}s", d.flush_ms / 1000);
                }
                if d.heap_mib != DEBEZIUM_HEAP_MIB {
                    slot += &format!("_xmx{}m", d.heap_mib);
                }
                if d.poll_ms != DEBEZIUM_POLL_MS {
                    slot += &format!("_poll{}ms", d.poll_ms);
                }
                slot
            }
            _ => self.name().to_owned(),
        }
    }

    /// The topic its events of aggregate type `order` go to.
    pub(crate) fn topic(self) -> String {
        format!("{}.order", self.slot())
    }

    /// Creates its slot (and, for walbox, the publication both read).
    pub(crate) async fn init(self, world: &World) {
        self.init_with(world, &[]).await;
    }

    /// [`Kind::init`], with more flags for walbox's `init-slot` (e.g.
    /// `--source messages`).
    pub(crate) async fn init_with(self, world: &World, flags: &[&str]) {
        match self {
            Kind::Walbox | Kind::WalboxExactlyOnce => {
                let mut args = vec!["init-slot", "--slot"];
                let slot = self.slot();
                args.push(&slot);
                args.extend_from_slice(flags);
                world.walbox(&args);
            }
            Kind::Debezium(_) => world.create_slot(&self.slot()).await,
        }
    }

    /// One of walbox's.
    pub(crate) fn is_walbox(self) -> bool {
        matches!(self, Kind::Walbox | Kind::WalboxExactlyOnce)
    }
}

pub(crate) enum Relay {
    Walbox {
        command: Box<dyn Fn() -> Command + Send>,
        process: WalboxProcess,
    },
    Debezium(Box<Debezium>),
}

impl Relay {
    pub(crate) fn start(kind: Kind, world: &World) -> Relay {
        Relay::start_with(kind, world, &[])
    }

    /// [`Relay::start`], with more flags for `walbox run` (e.g. `--source
    /// messages`); walbox's log at `info` for its own run module, whose
    /// exact latency line [`Relay::stop_walbox`] reads.
    pub(crate) fn start_with(kind: Kind, world: &World, flags: &[&str]) -> Relay {
        match kind {
            Kind::Walbox | Kind::WalboxExactlyOnce => {
                let (bin, url, brokers) = (
                    world.walbox_bin.clone(),
                    world.url.clone(),
                    world.bootstrap(),
                );
                let mut args: Vec<String> = flags.iter().map(|f| (*f).to_owned()).collect();
                if kind == Kind::WalboxExactlyOnce {
                    args.extend(["--delivery".into(), "exactly-once".into()]);
                }
                let command = move || {
                    let mut c = Command::new(&bin);
                    c.env("WALBOX_LOG", "warn,walbox::commands::run=info")
                        .args(["run", "--slot", &kind.slot()])
                        .arg("--mapping-topic-template")
                        .arg(format!("{}.{{aggregate_type}}", kind.slot()))
                        .arg("--pg-url")
                        .arg(&url)
                        .arg("--kafka-brokers")
                        .arg(&brokers)
                        .args(&args);
                    if let Ok(extra) = std::env::var("WALBOX_BENCH_ARGS") {
                        c.args(extra.split_whitespace());
                    }
                    c
                };
                let process = WalboxProcess::spawn(command());
                Relay::Walbox {
                    command: Box::new(command),
                    process,
                }
            }
            Kind::Debezium(d) => {
                let config = world.pg.config("postgres");
                let connector = Connector {
                    bootstrap: world.bootstrap(),
                    host: "127.0.0.1".into(),
                    port: world.pg.port(),
                    user: config.get_user().unwrap_or("postgres").to_owned(),
                    dbname: "postgres".into(),
                    table: "public.outbox_events".into(),
                    slot: kind.slot(),
                    publication: "walbox_outbox".into(),
                    worker: owned(WORKER)
                        .into_iter()
                        .chain([(
                            "offset.flush.interval.ms".to_owned(),
                            d.flush_ms.to_string(),
                        )])
                        .collect(),
                    connector: owned(CONNECTOR)
                        .into_iter()
                        .chain([
                            (
                                "transforms.outbox.route.topic.replacement".to_owned(),
                                format!("{}.${{routedByValue}}", kind.slot()),
                            ),
                            ("poll.interval.ms".to_owned(), d.poll_ms.to_string()),
                        ])
                        .collect(),
                    jvm: JVM
                        .iter()
                        .map(|s| (*s).to_owned())
                        .chain([format!("-Xmx{}M", d.heap_mib)])
                        .collect(),
                };
                Relay::Debezium(Box::new(Debezium::start(connector)))
            }
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        match self {
            Relay::Walbox { process, .. } => process.id(),
            Relay::Debezium(d) => d.pid().expect("Debezium runs"),
        }
    }

    /// Its log's end, when it exited; `None` while it runs.
    pub(crate) fn exited(&mut self) -> Option<String> {
        match self {
            Relay::Walbox { process, .. } => (!process.running()).then(|| tail(&process.log(), 30)),
            Relay::Debezium(d) => d.exited().then(|| d.log_tail(30)),
        }
    }

    /// SIGSTOP: it holds its connections and does nothing (its walsender
    /// stops sending once the socket is full) until [`Relay::resume`].
    pub(crate) fn pause(&self) {
        signal(self.pid(), "STOP");
    }

    /// SIGCONT after [`Relay::pause`].
    pub(crate) fn resume(&self) {
        signal(self.pid(), "CONT");
    }

    pub(crate) fn kill9(&mut self) {
        match self {
            Relay::Walbox { process, .. } => process.kill9(),
            Relay::Debezium(d) => d.kill9(),
        }
    }

    /// Starts it again after [`Relay::kill9`], on the same slot (and, for
    /// Debezium, the same offsets file).
    pub(crate) fn restart(&mut self) {
        match self {
            Relay::Walbox { command, process } => *process = WalboxProcess::spawn(command()),
            Relay::Debezium(d) => d.restart(),
        }
    }

    /// SIGTERM, and waits for it to end.
    pub(crate) fn stop(&mut self) {
        match self {
            Relay::Walbox { .. } => {
                self.stop_walbox();
            }
            Relay::Debezium(d) => d.stop(),
        }
    }

    /// Stops walbox (SIGTERM) and returns its exact commit → ack
    /// percentiles since it started, from the line it logs as it stops:
    /// `(events, p50, p99, p99.9, max)`, ms.
    pub(crate) fn stop_walbox(&mut self) -> Option<ExactLatency> {
        ExactLatency::parse(&self.stop_walbox_log()?)
    }

    /// Stops walbox (SIGTERM) and returns the exact latencies it logs as
    /// it stops.
    pub(crate) fn stop_walbox_split(&mut self) -> Option<Split> {
        let log = self.stop_walbox_log()?;
        split(&log)
    }

    /// Stops walbox (SIGTERM), checks it exited cleanly, and returns its log.
    pub(crate) fn stop_walbox_log(&mut self) -> Option<String> {
        let Relay::Walbox { process, .. } = self else {
            return None;
        };
        process.signal("TERM");
        let status = process.wait();
        let log = process.log();
        assert!(
            status.success(),
            "walbox exited with {status} on SIGTERM:\n{}",
            tail(&log, 30)
        );
        Some(log)
    }
}

/// walbox's exact commit → ack percentiles, from its log (see
/// `log_exact` in crates/walbox/src/commands/run.rs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExactLatency {
    pub(crate) events: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) p999_ms: f64,
    pub(crate) max_ms: f64,
}

impl ExactLatency {
    fn parse(log: &str) -> Option<ExactLatency> {
        Self::parse_named(log, "commit to ack")
    }

    /// The last `<what> since start (exact)` line of `log`.
    fn parse_named(log: &str, what: &str) -> Option<ExactLatency> {
        let marker = format!("{what} since start (exact)");
        let field = |name: &str| log_field(log, &marker, name);
        Some(ExactLatency {
            events: field("events")?,
            p50_ms: field("p50_ms")?,
            p99_ms: field("p99_ms")?,
            p999_ms: field("p999_ms")?,
            max_ms: field("max_ms")?,
        })
    }
}

/// The exact latencies of a walbox log.
pub(crate) struct Split {
    /// Commit → walbox read the transaction's end from the slot.
    pub(crate) read: ExactLatency,
    /// Commit → the broker's acknowledgement (exactly once: the commit).
    pub(crate) ack: ExactLatency,
    /// At least once: of the time from reading an event to handling its
    /// acknowledgement, walbox's own part, and librdkafka's (produce() to
    /// the delivery report: its queue, the linger, the broker).
    pub(crate) own: Option<ExactLatency>,
    pub(crate) client: Option<ExactLatency>,
}

/// The exact latencies of a walbox log: commit → read and commit → ack
/// always, walbox's own part and the client's when logged.
pub(crate) fn split(log: &str) -> Option<Split> {
    Some(Split {
        read: ExactLatency::parse_named(log, "commit to read")?,
        ack: ExactLatency::parse(log)?,
        own: ExactLatency::parse_named(log, "walbox's own part"),
        client: ExactLatency::parse_named(log, "the broker client's part"),
    })
}

/// The number `name=` holds on the last line of `log` that contains
/// `marker`.
pub(crate) fn log_field(log: &str, marker: &str, name: &str) -> Option<f64> {
    let line = log.lines().rev().find(|l| l.contains(marker))?;
    let at = line.find(&format!("{name}="))? + name.len() + 1;
    let v: String = line[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    v.parse().ok()
}

/// `kill -<name> <pid>`; the phase fails if it cannot be sent.
pub(crate) fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{name} {pid}");
}

fn owned(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::ExactLatency;

    #[test]
    fn reads_walbox_s_exact_latency_line() {
        let plain = "2026-11-25T09:00:00Z  INFO walbox::commands::run: commit to ack since start (exact) events=100 p50_ms=4.2 p99_ms=9 p999_ms=12.5 max_ms=30.25";
        let l = ExactLatency::parse(plain).expect("parsed");
        assert_eq!(
            (l.events, l.p50_ms, l.p99_ms, l.p999_ms, l.max_ms),
            (100.0, 4.2, 9.0, 12.5, 30.25)
        );
        assert!(ExactLatency::parse("commit to read since start (exact) events=1").is_none());
        let both = format!("{plain}\n2026-11-25T09:00:00Z  INFO walbox::commands::run: commit to read since start (exact) events=100 p50_ms=1.5 p99_ms=3 p999_ms=4 max_ms=7");
        let read = ExactLatency::parse_named(&both, "commit to read").expect("parsed");
        assert_eq!((read.p50_ms, read.p99_ms), (1.5, 3.0));
        assert_eq!(ExactLatency::parse(&both).expect("parsed").p99_ms, 9.0);
        // walbox's own part and the client's, when it logs them.
        assert!(super::split(&both).expect("parsed").own.is_none());
        let all = format!("{both}\n2026-11-25T09:00:00Z  INFO walbox::commands::run: the broker client's part since start (exact) events=100 p50_ms=1.2 p99_ms=2.5 p999_ms=3 max_ms=4\n2026-11-25T09:00:00Z  INFO walbox::commands::run: walbox's own part since start (exact) events=100 p50_ms=0.3 p99_ms=1.1 p999_ms=2 max_ms=3");
        let split = super::split(&all).expect("parsed");
        assert_eq!(split.own.expect("own").p99_ms, 1.1);
        assert_eq!(split.client.expect("client").p50_ms, 1.2);
        assert_eq!(split.read.p50_ms, 1.5);
    }
}
