//! What a phase runs in: a private, durable Postgres (fsync and
//! full_page_writes on, commit timestamps tracked), one Apache Kafka node,
//! the walbox binary, and the topics' read-back.

use std::collections::HashMap;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use tokio_postgres::Client;
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::pg::{self, PgServer};

/// The Postgres server's version, once a world started.
static SERVER_VERSION: OnceLock<String> = OnceLock::new();

pub(crate) fn server_version() -> String {
    SERVER_VERSION.get().cloned().unwrap_or_else(|| "?".into())
}

/// Partitions of every events topic.
pub(crate) const PARTITIONS: i32 = 3;
const BROKER_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) struct World {
    pub(crate) pg: PgServer,
    pub(crate) client: Client,
    pub(crate) cluster: KafkaCluster,
    pub(crate) walbox_bin: String,
    /// The superuser's connection string, for walbox and the tools.
    pub(crate) url: String,
    watermarks: BaseConsumer,
}

/// What runs pgbench against the world's Postgres, from any thread.
#[derive(Clone)]
pub(crate) struct Writer {
    pub(crate) pgbench: std::path::PathBuf,
    pub(crate) url: String,
}

/// What pgbench printed, to read its figures from.
pub(crate) struct PgbenchRun {
    text: String,
}

impl Writer {
    /// pgbench with 8 clients and 2 threads for `seconds`, running
    /// `script`, in `dir` (where `-l` writes its logs), with `extra` flags.
    pub(crate) fn run(
        &self,
        script: &std::path::Path,
        seconds: u32,
        dir: &std::path::Path,
        extra: &[&str],
    ) -> PgbenchRun {
        let out = Command::new(&self.pgbench)
            .current_dir(dir)
            .args(["-n", "-c", "8", "-j", "2", "-T", &seconds.to_string()])
            .args(extra)
            .arg("-f")
            .arg(script)
            .arg(&self.url)
            .output()
            .expect("run pgbench");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "pgbench: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        PgbenchRun { text }
    }
}

impl PgbenchRun {
    /// The number after `prefix` on its line (`"tps = "`).
    pub(crate) fn figure(&self, prefix: &str) -> f64 {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| {
                v.split(|c: char| !(c.is_ascii_digit() || c == '.'))
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("pgbench's {prefix:?}: {}", self.text))
    }

    /// The transactions it committed.
    pub(crate) fn transactions(&self) -> f64 {
        self.figure("number of transactions actually processed: ")
    }
}

/// See [`World::table_stats`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct TableStats {
    pub(crate) scans: f64,
    pub(crate) rows_written: f64,
    pub(crate) dead_tuples: f64,
}

/// What [`World::tally`] counted.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tally {
    pub(crate) records: usize,
    pub(crate) distinct: usize,
}

impl Tally {
    /// Records beyond the first of each event.
    pub(crate) fn duplicates(self) -> usize {
        self.records - self.distinct
    }
}

/// One record read back: its event id (header `id`) and when the broker
/// appended it (ms since the epoch: topics use `LogAppendTime`).
pub(crate) struct ReadBack {
    pub(crate) id: String,
    pub(crate) appended_ms: i64,
}

/// A fresh broker loads its coordinators as it starts: an idempotent
/// producer's first request for its producer id is answered "coordinator
/// load in progress" and retried for up to a second. That is the fresh
/// broker's, not the relay's: one idempotent record (to a topic of its
/// own, created on use) waits it out before a relay is timed.
fn warm_up(bootstrap: &str) {
    use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("enable.idempotence", "true")
        .create()
        .expect("a producer to warm the broker up");
    producer
        .send(BaseRecord::<str, str>::to("bench.warm-up").payload("warm-up"))
        .expect("queue the warm-up record");
    producer
        .flush(Duration::from_secs(60))
        .expect("the broker acknowledges the warm-up record");
}

impl World {
    pub(crate) async fn start(walbox_bin: &str) -> World {
        let pg = PgServer::builder()
            .setting("fsync", "on")
            .setting("full_page_writes", "on")
            .setting("synchronous_commit", "on")
            .setting("shared_buffers", "256MB")
            .setting("max_wal_size", "4GB")
            .setting("max_connections", "50")
            .setting("track_commit_timestamp", "on")
            // A relay paused (SIGSTOP) while another drains a backlog
            // answers no keepalive; its walsender must wait for it.
            .setting("wal_sender_timeout", "0")
            .start()
            .unwrap_or_else(|e| panic!("start Postgres: {e}"));
        let config = pg.config("postgres");
        let url = pg::conninfo(&config);
        let client = pg::connect(&config)
            .await
            .unwrap_or_else(|e| panic!("connect to Postgres: {e}"));
        let cluster = tokio::task::block_in_place(|| KafkaCluster::start(1));
        tokio::task::block_in_place(|| warm_up(&cluster.bootstrap()));
        let watermarks = ClientConfig::new()
            .set("bootstrap.servers", cluster.bootstrap())
            .create()
            .expect("a consumer for watermarks");
        let world = World {
            pg,
            client,
            cluster,
            walbox_bin: walbox_bin.to_owned(),
            url,
            watermarks,
        };
        let version: String = world.one("SHOW server_version").await;
        let _ = SERVER_VERSION.set(version);
        world.walbox(&["migrate"]);
        world
    }

    /// Runs a short walbox command (`migrate`, `init-slot`) to its end.
    pub(crate) fn walbox(&self, args: &[&str]) {
        let out = Command::new(&self.walbox_bin)
            .args(args)
            .arg("--pg-url")
            .arg(&self.url)
            .output()
            .expect("run walbox");
        assert!(
            out.status.success(),
            "walbox {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub(crate) fn bootstrap(&self) -> String {
        self.cluster.bootstrap()
    }

    pub(crate) fn writer(&self) -> Writer {
        Writer {
            pgbench: self.pg.bin_dir().join("pgbench"),
            url: self.url.clone(),
        }
    }

    /// The Postgres binary `name` of the running server.
    pub(crate) fn pg_tool(&self, name: &str) -> Command {
        Command::new(self.pg.bin_dir().join(name))
    }

    pub(crate) async fn one<T>(&self, sql: &str) -> T
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        self.client
            .query_one(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .get(0)
    }

    pub(crate) async fn execute(&self, sql: &str) {
        self.client
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    pub(crate) async fn create_slot(&self, name: &str) {
        self.execute(&format!(
            "SELECT pg_create_logical_replication_slot('{name}', 'pgoutput')"
        ))
        .await;
    }

    pub(crate) async fn drop_slot(&self, name: &str) {
        self.execute(&format!("SELECT pg_drop_replication_slot('{name}')"))
            .await;
    }

    /// The server's current WAL position, as text.
    /// CPU seconds the (single) Kafka broker spent so far.
    pub(crate) fn broker_cpu(&self) -> f64 {
        let pid = self.cluster.pid(0).expect("the broker runs");
        crate::procstat::usage(pid).map_or(0.0, |u| u.cpu_s)
    }

    pub(crate) async fn wal_lsn(&self) -> String {
        self.one::<String>("SELECT pg_current_wal_lsn()::text")
            .await
    }

    /// CPU seconds the server's processes spent so far, less this
    /// harness's own session's.
    pub(crate) async fn server_cpu(&self) -> f64 {
        let postmaster = self.pg.pid().expect("Postgres runs") as u32;
        let own: i32 = self.one("SELECT pg_backend_pid()").await;
        let own = crate::procstat::usage(own as u32).map_or(0.0, |u| u.cpu_s);
        crate::procstat::server_cpu_seconds(postmaster) - own
    }

    /// Reads and writes on `table` since the server started: statements
    /// that scanned it, rows updated or deleted, dead tuples. Statistics
    /// reach the shared counters within a second: wait that long after a
    /// reader ends.
    pub(crate) async fn table_stats(&self, table: &str) -> TableStats {
        let row = self
            .client
            .query_one(
                "SELECT (coalesce(seq_scan, 0) + coalesce(idx_scan, 0))::float8,
                        (n_tup_upd + n_tup_del)::float8, n_dead_tup::float8
                   FROM pg_stat_user_tables WHERE relname = $1",
                &[&table],
            )
            .await
            .expect("the table's statistics");
        TableStats {
            scans: row.get(0),
            rows_written: row.get(1),
            dead_tuples: row.get(2),
        }
    }

    /// Dead tuples in the tables named like `pattern` (SQL `LIKE`: a
    /// partitioned table's partitions too).
    pub(crate) async fn dead_tuples_like(&self, pattern: &str) -> f64 {
        self.client
            .query_one(
                "SELECT coalesce(sum(n_dead_tup), 0)::float8 FROM pg_stat_user_tables WHERE relname LIKE $1",
                &[&pattern],
            )
            .await
            .expect("dead tuples")
            .get(0)
    }

    /// Bytes of WAL between two positions.
    pub(crate) async fn wal_between(&self, from: &str, to: &str) -> f64 {
        self.client
            .query_one(
                "SELECT ($2::text::pg_lsn - $1::text::pg_lsn)::float8",
                &[&from, &to],
            )
            .await
            .expect("WAL between two positions")
            .get(0)
    }

    /// Whether `slot` confirmed `lsn`.
    pub(crate) async fn confirmed(&self, slot: &str, lsn: &str) -> bool {
        self.client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots
                  WHERE slot_name = $1 AND confirmed_flush_lsn >= $2::text::pg_lsn",
                &[&slot, &lsn],
            )
            .await
            .expect("read the slot")
            .is_some()
    }

    /// Whether every slot named like `pattern` (SQL `LIKE`; at least one)
    /// confirmed `lsn`.
    pub(crate) async fn all_confirmed(&self, pattern: &str, lsn: &str) -> bool {
        self.client
            .query_one(
                "SELECT count(*) > 0 AND bool_and(coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false))
                   FROM pg_replication_slots WHERE slot_name LIKE $1",
                &[&pattern, &lsn],
            )
            .await
            .expect("read the slots")
            .get(0)
    }

    /// The walsender streaming from `slot`, if one is.
    pub(crate) async fn walsender(&self, slot: &str) -> Option<u32> {
        self.client
            .query_opt(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active",
                &[&slot],
            )
            .await
            .expect("read the slot")
            .and_then(|r| r.get::<_, Option<i32>>(0))
            .map(|p| p as u32)
    }

    /// How far `slot`'s walsender had decoded between `from` and `to`, as
    /// a fraction of that WAL (`pg_stat_replication.sent_lsn`: a logical
    /// walsender's decoding position); 0 when it is not streaming.
    pub(crate) async fn decoded_ahead(&self, slot: &str, from: &str, to: &str) -> f64 {
        self.client
            .query_opt(
                "SELECT greatest(0, least(1, pg_wal_lsn_diff(r.sent_lsn, $2::text::pg_lsn)
                                         / nullif(pg_wal_lsn_diff($3::text::pg_lsn, $2::text::pg_lsn), 0)))::float8
                   FROM pg_stat_replication r JOIN pg_replication_slots s ON s.active_pid = r.pid
                  WHERE s.slot_name = $1",
                &[&slot, &from, &to],
            )
            .await
            .expect("read the walsender's position")
            .and_then(|r| r.get::<_, Option<f64>>(0))
            .unwrap_or(0.0)
    }

    /// Creates `topic` with [`PARTITIONS`] partitions whose records carry
    /// the broker's append time.
    pub(crate) async fn create_topic(&self, topic: &str) {
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .create()
            .expect("an admin client");
        let new = NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1))
            .set("message.timestamp.type", "LogAppendTime");
        let opts = AdminOptions::new().operation_timeout(Some(BROKER_TIMEOUT));
        for r in admin
            .create_topics([&new], &opts)
            .await
            .unwrap_or_else(|e| panic!("create {topic}: {e}"))
        {
            if let Err((name, code)) = r {
                panic!("create {name}: {code}");
            }
        }
        // A fresh node may take a while to elect the new partitions' leader
        // while it also loads its coordinators.
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.try_ends(topic).is_none() {
            assert!(
                Instant::now() < deadline,
                "{topic}: not served within 2 minutes of its creation"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    fn try_ends(&self, topic: &str) -> Option<Vec<i64>> {
        (0..PARTITIONS)
            .map(|p| {
                self.watermarks
                    .fetch_watermarks(topic, p, BROKER_TIMEOUT)
                    .ok()
                    .map(|w| w.1)
            })
            .collect()
    }

    /// The end offset of each partition of `topic`.
    pub(crate) fn ends(&self, topic: &str) -> Vec<i64> {
        (0..PARTITIONS)
            .map(|p| {
                self.watermarks
                    .fetch_watermarks(topic, p, BROKER_TIMEOUT)
                    .unwrap_or_else(|e| panic!("watermarks of {topic} [{p}]: {e}"))
                    .1
            })
            .collect()
    }

    /// Records on `topic` past `from` (offsets per partition).
    pub(crate) fn count_since(&self, topic: &str, from: &[i64]) -> i64 {
        self.ends(topic)
            .iter()
            .zip(from)
            .map(|(end, from)| end - from)
            .sum()
    }

    /// `topic` from `from` to the current ends, read back: how many records,
    /// and how many distinct event ids among them.
    pub(crate) fn tally(&self, topic: &str, from: &[i64]) -> Tally {
        let records = self.read_back(topic, from);
        let distinct = records
            .iter()
            .map(|r| r.id.as_str())
            .collect::<std::collections::HashSet<_>>()
            .len();
        Tally {
            records: records.len(),
            distinct,
        }
    }

    /// Every record of `topic` from `from` to the current ends.
    pub(crate) fn read_back(&self, topic: &str, from: &[i64]) -> Vec<ReadBack> {
        let ends = self.ends(topic);
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", self.bootstrap())
            .set("group.id", "walbox-bench-read-back")
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer");
        let mut tpl = TopicPartitionList::new();
        let mut left: HashMap<i32, i64> = HashMap::new();
        for (p, (&start, &end)) in from.iter().zip(&ends).enumerate() {
            let p = p as i32;
            if end > start {
                tpl.add_partition_offset(topic, p, Offset::Offset(start))
                    .expect("a partition");
                left.insert(p, end);
            }
        }
        consumer.assign(&tpl).expect("assign the partitions");
        let mut out =
            Vec::with_capacity(ends.iter().zip(from).map(|(e, f)| (e - f) as usize).sum());
        let deadline = Instant::now() + Duration::from_secs(300);
        while !left.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{topic}: read-back took over 5 minutes"
            );
            let Some(m) = consumer.poll(Duration::from_millis(500)) else {
                continue;
            };
            // librdkafka reconnects after a transient error (a broker
            // connection lost): the deadline bounds the wait.
            let Ok(m) = m else {
                continue;
            };
            let id = m
                .headers()
                .and_then(|h| h.iter().find(|h| h.key == "id").and_then(|h| h.value))
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            out.push(ReadBack {
                id,
                appended_ms: m.timestamp().to_millis().unwrap_or(0),
            });
            if left
                .get(&m.partition())
                .is_some_and(|&end| m.offset() + 1 >= end)
            {
                left.remove(&m.partition());
            }
        }
        out
    }
}
