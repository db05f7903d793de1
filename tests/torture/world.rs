//! What a scenario runs in: a private Postgres, a broker, `walbox run` as a
//! child process, a load generator, and samplers of the slot and of
//! walbox's memory.

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgoutput_decoder::Lsn;
use tokio_postgres::{Client, Config};
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{self, PgServer};
use walbox_test_harness::proc_stat::peak_rss_kib;
use walbox_test_harness::proxy::Proxy;
use walbox_test_harness::slot::{
    confirmed_flush_lsn, current_wal_lsn, try_confirmed_flush_lsn, try_current_wal_lsn,
};
use walbox_test_harness::walbox_process::WalboxProcess;

/// The broker of a scenario.
pub(crate) enum Broker {
    /// librdkafka's mock cluster, in this process.
    Mock(TestKafka),
    /// Apache Kafka: one node, or three brokers beside a controller.
    Kafka {
        cluster: KafkaCluster,
        kafka: TestKafka,
    },
}

/// Which broker a scenario runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BrokerKind {
    Mock,
    /// Apache Kafka, one node.
    Kafka,
    /// Apache Kafka, three brokers (replication factor 3,
    /// `min.insync.replicas=2`) and a controller of their own.
    Kafka3,
}

impl Broker {
    pub(crate) fn kafka(&self) -> &TestKafka {
        match self {
            Broker::Mock(k) | Broker::Kafka { kafka: k, .. } => k,
        }
    }

    /// The Apache Kafka cluster, for its faults.
    pub(crate) fn cluster(&mut self) -> &mut KafkaCluster {
        match self {
            Broker::Kafka { cluster, .. } => cluster,
            Broker::Mock(_) => panic!("the scenario runs on the mock cluster"),
        }
    }
}

/// An event the load generator committed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Written {
    pub(crate) n: i64,
    /// `pg_current_wal_lsn()` right after the commit: at or past its end.
    pub(crate) upper: Lsn,
}

/// What the samplers saw.
#[derive(Default, Debug)]
pub(crate) struct Samples {
    /// The highest `confirmed_flush_lsn` seen (of the slowest shard's
    /// slot when sharded: see `max_confirmed_per_shard`).
    pub(crate) max_confirmed: Lsn,
    /// Sharded: the highest `confirmed_flush_lsn` seen per shard's slot.
    pub(crate) max_confirmed_per_shard: Vec<Lsn>,
    /// walbox's peak resident set, over all its processes (KiB).
    pub(crate) peak_rss_kib: u64,
}

pub(crate) struct World {
    pub(crate) pg: PgServer,
    /// Postgres as walbox reaches it: through a proxy that can black-hole it.
    pub(crate) pg_proxy: Proxy,
    pub(crate) broker: Broker,
    pub(crate) topic: String,
    pub(crate) dead_letters: String,
    /// The walbox processes: one, or one per shard.
    walbox: Vec<WalboxProcess>,
    walbox_args: Vec<String>,
    /// 1, or the number of shards (`--shards`), each its own process and slot.
    pub(crate) shards: u32,
    logs: tempfile::TempDir,
    pub(crate) samples: Arc<Mutex<Samples>>,
    walbox_pids: Arc<Mutex<Vec<u32>>>,
    walbox_bin: String,
}

pub(crate) const SLOT: &str = "walbox";

/// The slots of `shards` shards: [`SLOT`], or `walbox_0` … `walbox_{N-1}`.
pub(crate) fn slot_names(shards: u32) -> Vec<String> {
    if shards <= 1 {
        vec![SLOT.to_owned()]
    } else {
        (0..shards).map(|i| format!("{SLOT}_{i}")).collect()
    }
}
/// Aggregates the load spreads its events over.
pub(crate) const KEYS: i64 = 20;

impl World {
    /// `partitions` for the events' topic (the mock cluster keeps about
    /// 100,000 records or 5 MB per partition); `shards` > 1 runs one walbox
    /// per shard (`--shards`, `--shard i`), each on its own slot.
    pub(crate) async fn new(
        walbox_bin: &str,
        broker: BrokerKind,
        partitions: i32,
        extra: &[&str],
        shards: u32,
    ) -> World {
        let pg = PgServer::start_default().expect("start a private Postgres");
        let pg_proxy = Proxy::start(format!("127.0.0.1:{}", pg.port())).await;
        let (broker, replication) = match broker {
            BrokerKind::Mock => (Broker::Mock(TestKafka::mock(1)), 1),
            BrokerKind::Kafka | BrokerKind::Kafka3 => {
                let cluster = tokio::task::block_in_place(|| {
                    if broker == BrokerKind::Kafka3 {
                        KafkaCluster::start_brokers(3, &[])
                    } else {
                        KafkaCluster::start(1)
                    }
                });
                let kafka = cluster.kafka();
                let replication = if broker == BrokerKind::Kafka3 { 3 } else { 1 };
                (Broker::Kafka { cluster, kafka }, replication)
            }
        };
        let topic = create_topic(broker.kafka(), partitions, replication).await;
        let dead_letters = create_topic(broker.kafka(), 1, replication).await;
        let world = World {
            pg,
            pg_proxy,
            broker,
            topic,
            dead_letters,
            walbox: Vec::new(),
            walbox_args: extra.iter().map(|s| s.to_string()).collect(),
            shards,
            logs: tempfile::tempdir().expect("a temp dir"),
            samples: Arc::new(Mutex::new(Samples::default())),
            walbox_pids: Arc::new(Mutex::new(Vec::new())),
            walbox_bin: walbox_bin.to_owned(),
        };
        let client = world.client().await;
        apply_migrations(&client).await;
        // The load leaves event_type out, so a scenario may drop the column.
        client
            .batch_execute("ALTER TABLE outbox_events ALTER COLUMN event_type SET DEFAULT 'E'")
            .await
            .expect("set a default event type");
        if shards > 1 {
            // Sharded scenarios write events without an aggregate id.
            client
                .batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL")
                .await
                .expect("make aggregate_id nullable");
        }
        let out = world
            .walbox_command()
            .arg("init-slot")
            .args(world.shard_args(None))
            .output()
            .expect("run walbox init-slot");
        assert!(
            out.status.success(),
            "walbox init-slot: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        world.start_samplers();
        world
    }

    pub(crate) fn admin(&self) -> Config {
        self.pg.config("postgres")
    }

    /// A new admin connection (retried while Postgres restarts).
    pub(crate) async fn client(&self) -> Client {
        let config = self.admin();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match pg::connect(&config).await {
                Ok(c) => return c,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => panic!("connect to Postgres: {e}"),
            }
        }
    }

    /// Runs walbox in exactly-once mode, its progress in a compacted topic
    /// of this world's broker.
    pub(crate) async fn exactly_once(&mut self) {
        let replication = match &self.broker {
            Broker::Kafka { cluster, .. } if cluster.len() > 1 => 3,
            _ => 1,
        };
        let progress = self
            .broker
            .kafka()
            .create_topic_configured(1, replication, &[("cleanup.policy", "compact")])
            .await;
        self.walbox_args.extend([
            "--delivery".to_owned(),
            "exactly-once".to_owned(),
            "--transactions-progress-topic".to_owned(),
            progress,
        ]);
    }

    /// The index of the broker leading partition 0 of the events' topic.
    pub(crate) fn leader_of_partition_0(&mut self) -> usize {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = self
            .broker
            .kafka()
            .client_config()
            .create()
            .expect("a client");
        let md = c
            .fetch_metadata(Some(&self.topic), Duration::from_secs(10))
            .expect("the topic's metadata");
        let leader = md.topics()[0].partitions()[0].leader();
        self.broker.cluster().index_of(leader)
    }

    /// The slots walbox streams: [`SLOT`], or one per shard.
    pub(crate) fn slots(&self) -> Vec<String> {
        slot_names(self.shards)
    }

    /// `--shards N` (and `--shard i` for a process) when sharded.
    fn shard_args(&self, shard: Option<u32>) -> Vec<String> {
        if self.shards <= 1 {
            return Vec::new();
        }
        let mut args = vec!["--shards".to_owned(), self.shards.to_string()];
        if let Some(i) = shard {
            args.extend(["--shard".to_owned(), i.to_string()]);
        }
        args
    }

    /// The world's Kafka, mapping and dead-letter settings, and the
    /// scenario's own flags: what every walbox command of it is given.
    fn settings_args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "--kafka-brokers",
            &self.broker.kafka().bootstrap(),
            "--mapping-topic-template",
            "{aggregate_type}",
            "--dead-letter-topic",
            &self.dead_letters,
            "--kafka-property",
            "reconnect.backoff.max.ms=500",
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend(self.walbox_args.iter().cloned());
        args
    }

    fn walbox_command(&self) -> Command {
        // A new config: `Config::port` appends, it would keep the direct port first.
        let admin = self.admin();
        let mut via_proxy = Config::new();
        via_proxy
            .host("127.0.0.1")
            .port(self.pg_proxy.port())
            .user(admin.get_user().unwrap_or("postgres"))
            .dbname(admin.get_dbname().unwrap_or("postgres"));
        if let Some(password) = admin.get_password() {
            via_proxy.password(password);
        }
        let mut c = Command::new(&self.walbox_bin);
        c.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env(
                "WALBOX_PG_URL",
                format!("{} sslmode=disable", pg::conninfo(&via_proxy)),
            )
            .env(
                "WALBOX_LOG",
                std::env::var("WALBOX_TORTURE_LOG").unwrap_or_else(|_| "info".into()),
            );
        c
    }

    /// Starts `walbox run` (its log appended to this world's log file).
    pub(crate) fn start_walbox(&mut self) {
        self.start_walbox_as("run", &[], &[]);
    }

    /// Starts `walbox SUBCOMMAND` (`run`, `resync`) with the world's Kafka
    /// settings, `args` and the environment `env` (its log appended to
    /// this world's log file); it is the process `kill9`, `signal` and
    /// `wait_exit` act on.
    pub(crate) fn start_walbox_as(
        &mut self,
        subcommand: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) {
        assert!(self.walbox.is_empty(), "walbox is already running");
        for shard in 0..self.shards {
            let mut command = self.walbox_command();
            command
                .arg(subcommand)
                .args(self.shard_args(Some(shard)))
                .args(self.settings_args())
                .args(args)
                .envs(env.iter().copied());
            let process = WalboxProcess::spawn_appending(command, &self.log_path());
            self.walbox_pids.lock().unwrap().push(process.id());
            self.walbox.push(process);
        }
    }

    /// Waits up to `timeout` for walbox's log to contain `needle`.
    pub(crate) async fn wait_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.log().contains(needle) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    pub(crate) fn log_path(&self) -> std::path::PathBuf {
        self.logs.path().join("walbox.log")
    }

    pub(crate) fn log(&self) -> String {
        if let Ok(dir) = std::env::var("WALBOX_TORTURE_KEEP_LOGS") {
            let _ = std::fs::copy(self.log_path(), format!("{dir}/walbox.log"));
        }
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Sends `signal` (`TERM`, `INT`, …) to walbox (every shard's process).
    pub(crate) fn signal(&self, signal: &str) {
        for c in &self.walbox {
            c.signal(signal);
        }
    }

    /// `kill -9` walbox (every shard's process) and reap it.
    pub(crate) fn kill9(&mut self) {
        for mut c in self.walbox.drain(..) {
            c.kill9();
        }
        self.walbox_pids.lock().unwrap().clear();
    }

    /// Waits up to `timeout` for walbox (every shard's process) to exit;
    /// the exit code (the first non-zero one when sharded), or `None` if
    /// one is still running.
    pub(crate) async fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        if self.walbox.is_empty() {
            return None;
        }
        let deadline = Instant::now() + timeout;
        let mut codes = Vec::new();
        loop {
            let mut i = 0;
            while i < self.walbox.len() {
                if let Some(status) = self.walbox[i].try_exit() {
                    let c = self.walbox.remove(i);
                    self.walbox_pids.lock().unwrap().retain(|p| *p != c.id());
                    codes.push(status.code().unwrap_or(-1));
                } else {
                    i += 1;
                }
            }
            if self.walbox.is_empty() {
                return codes.iter().copied().find(|c| *c != 0).or(Some(0));
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether walbox runs (every shard's process, when sharded).
    pub(crate) fn running(&mut self) -> bool {
        !self.walbox.is_empty() && self.walbox.iter_mut().all(|c| c.running())
    }

    /// `walbox audit` of the last hour with the world's settings (the
    /// MockCluster has no time index: it reads the topics from their
    /// start), as JSON; walbox should be running, so the slot moves past
    /// the audit's snapshot.
    pub(crate) async fn audit(&self) -> Result<serde_json::Value, String> {
        let mut command = self.walbox_command();
        command
            .arg("audit")
            .args(self.shard_args(None))
            .args(self.settings_args())
            .args(["--last", "1h", "--json", "--wait", "30s"]);
        if matches!(self.broker, Broker::Mock(_)) {
            command.arg("--from-beginning");
        }
        let out = tokio::task::spawn_blocking(move || command.output())
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("run walbox audit: {e}"))?;
        serde_json::from_slice(&out.stdout).map_err(|e| {
            format!(
                "walbox audit ({}): {e}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })
    }

    /// Waits until the slot confirmed everything written so far (or
    /// `timeout`); returns whether it did.
    pub(crate) async fn wait_caught_up(&self, timeout: Duration) -> bool {
        let client = self.client().await;
        let head = current_wal_lsn(&client).await;
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            let mut all = true;
            for slot in self.slots() {
                all &= confirmed_flush_lsn(&client, &slot)
                    .await
                    .is_some_and(|c| c >= head);
            }
            if all {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }

    /// Samples the slot's confirmed position and walbox's peak RSS every
    /// 100 ms while the world lives (a Postgres that is down meanwhile is
    /// sampled again once it is back).
    fn start_samplers(&self) {
        let samples = Arc::clone(&self.samples);
        let pids = Arc::clone(&self.walbox_pids);
        let slots = self.slots();
        let config = self.admin();
        tokio::spawn(async move {
            let mut client: Option<Client> = None;
            // The world holds the other reference.
            while Arc::strong_count(&samples) > 1 {
                if client.as_ref().is_none_or(Client::is_closed) {
                    client = pg::connect(&config).await.ok();
                }
                if let Some(c) = &client {
                    let mut seen = Vec::new();
                    for slot in &slots {
                        match try_confirmed_flush_lsn(c, slot).await {
                            Ok(Some(lsn)) => seen.push(lsn),
                            _ => break,
                        }
                    }
                    if seen.len() == slots.len() {
                        let mut s = samples.lock().unwrap();
                        let per_shard = &mut s.max_confirmed_per_shard;
                        per_shard.resize(seen.len(), Lsn::new(0));
                        for (max, lsn) in per_shard.iter_mut().zip(&seen) {
                            *max = (*max).max(*lsn);
                        }
                        let slowest = per_shard.iter().copied().min().unwrap_or(Lsn::new(0));
                        s.max_confirmed = s.max_confirmed.max(slowest);
                    }
                }
                let current = pids.lock().unwrap().clone();
                for kib in current.into_iter().filter_map(peak_rss_kib) {
                    let mut s = samples.lock().unwrap();
                    s.peak_rss_kib = s.peak_rss_kib.max(kib);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.kill9();
    }
}

async fn create_topic(kafka: &TestKafka, partitions: i32, replication: i32) -> String {
    let create = kafka.create_topic_with(partitions, replication);
    tokio::time::timeout(Duration::from_secs(60), create)
        .await
        .expect("create a topic within 60 s")
}

/// The load: transactions of `tx_size` events inserted one after another
/// on one connection (so commit order is `n` order), at most `rate` events
/// per second, with payloads of `payload_bytes`.
pub(crate) struct Load {
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<Vec<Written>>,
}

#[derive(Clone, Copy)]
pub(crate) struct LoadShape {
    pub(crate) rate: u32,
    pub(crate) tx_size: usize,
    pub(crate) payload_bytes: usize,
    /// Some events get a NULL or an empty aggregate id ([`no_aggregate_id`]).
    pub(crate) null_ids: bool,
}

/// With [`LoadShape::null_ids`]: event `n`'s aggregate id is NULL (`Some(true)`),
/// empty (`Some(false)`), or `agg-<n mod KEYS>` (`None`).
pub(crate) fn no_aggregate_id(n: i64) -> Option<bool> {
    match n % 10 {
        3 => Some(true),
        7 => Some(false),
        _ => None,
    }
}

impl Load {
    /// Events go to the topic named `aggregate_type` (walbox runs with the
    /// template `{aggregate_type}`).
    pub(crate) fn start(
        config: Config,
        aggregate_type: String,
        first: i64,
        shape: LoadShape,
    ) -> Load {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut written = Vec::new();
            let mut n = first;
            let started = Instant::now();
            let filler = "x".repeat(shape.payload_bytes.saturating_sub(20));
            let mut client: Option<Client> = None;
            while !*stopped.borrow() {
                let due = started + Duration::from_secs_f64((n - first) as f64 / shape.rate as f64);
                tokio::time::sleep_until(due.into()).await;
                if client.as_ref().is_none_or(Client::is_closed) {
                    match pg::connect(&config).await {
                        Ok(c) => client = Some(c),
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    }
                }
                let c = client.as_ref().expect("connected");
                let values: Vec<String> = (n..n + shape.tx_size as i64)
                    .map(|i| {
                        let id = match no_aggregate_id(i).filter(|_| shape.null_ids) {
                            Some(true) => "NULL".to_owned(),
                            Some(false) => "''".to_owned(),
                            None => format!("'agg-{}'", i % KEYS),
                        };
                        format!("('{aggregate_type}', {id}, '{{\"n\": {i}, \"f\": \"{filler}\"}}')")
                    })
                    .collect();
                let sql = format!(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, payload) VALUES {}",
                    values.join(",")
                );
                match c.batch_execute(&sql).await {
                    Ok(()) => {
                        // Committed. Postgres may go down before the
                        // position is read: the rows are then found in
                        // the table at the end, with no position known.
                        match try_current_wal_lsn(c).await {
                            Ok(upper) => written.extend(
                                (n..n + shape.tx_size as i64).map(|n| Written { n, upper }),
                            ),
                            Err(_) => client = None,
                        }
                        n += shape.tx_size as i64;
                    }
                    // Postgres restarting, the table gone: try again later.
                    // An insert whose commit outcome is unknown is found
                    // in the table at the end (the table is the truth).
                    Err(_) => {
                        client = None;
                        n += shape.tx_size as i64;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            written
        });
        Load { stop, task }
    }

    pub(crate) async fn stop(self) -> Vec<Written> {
        let _ = self.stop.send(true);
        self.task.await.expect("the load task")
    }
}
