//! Debezium's Postgres connector with its outbox `EventRouter`, in a Kafka
//! Connect standalone worker run as a plain `java` process: the relay
//! walbox's users would leave, as a peer in tests and benchmarks. The jars
//! are those of `WALBOX_DEBEZIUM_LIBS` (scripts/install-debezium resolves
//! them once from Maven Central; scripts/test exports the variable).
//!
//! The worker keeps its offsets in a file and flushes them every
//! `offset.flush.interval.ms`; Debezium confirms the slot when it commits
//! them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::apache_kafka::{java_bin, log4j2_to_file, signal, supervise, Process};

/// The directory of the Connect and Debezium jars named by
/// `WALBOX_DEBEZIUM_LIBS`, if set.
pub fn libs_from_env() -> Option<String> {
    std::env::var("WALBOX_DEBEZIUM_LIBS")
        .ok()
        .filter(|d| has_jars(d))
}

fn has_jars(dir: &str) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("debezium-connector-postgres")
        })
    })
}

/// How a connector is set up: where Postgres and Kafka are, and the
/// connector's and worker's own properties on top of the defaults below.
#[derive(Clone, Debug)]
pub struct Connector {
    /// Kafka's bootstrap servers.
    pub bootstrap: String,
    /// Postgres: host, port, user, database (the test server trusts local
    /// connections: no password).
    pub host: String,
    /// Its port.
    pub port: u16,
    /// The user.
    pub user: String,
    /// The database.
    pub dbname: String,
    /// The outbox table, `schema.table`.
    pub table: String,
    /// The replication slot Debezium creates and streams from.
    pub slot: String,
    /// The publication it creates (`filtered`: the outbox table only).
    pub publication: String,
    /// Worker properties over the defaults (converters, flush interval).
    pub worker: Vec<(String, String)>,
    /// Connector properties over the defaults (the EventRouter's).
    pub connector: Vec<(String, String)>,
    /// The JVM's options (heap, collector); empty: a 512 MiB heap
    /// (`WALBOX_DEBEZIUM_HEAP` overrides its size), enough for the tests.
    pub jvm: Vec<String>,
}

impl Connector {
    fn worker_properties(&self, dir: &Path) -> String {
        let mut p = vec![
            ("bootstrap.servers".to_owned(), self.bootstrap.clone()),
            (
                "key.converter".to_owned(),
                "org.apache.kafka.connect.storage.StringConverter".to_owned(),
            ),
            (
                "value.converter".to_owned(),
                "org.apache.kafka.connect.storage.StringConverter".to_owned(),
            ),
            (
                "offset.storage.file.filename".to_owned(),
                dir.join("offsets").display().to_string(),
            ),
            ("offset.flush.interval.ms".to_owned(), "60000".to_owned()),
            ("listeners".to_owned(), "http://127.0.0.1:0".to_owned()),
            // Connect's producer: the Java client's defaults, and acks=all
            // like walbox's.
            ("producer.acks".to_owned(), "all".to_owned()),
        ];
        merge(&mut p, &self.worker);
        render(&p)
    }

    fn connector_properties(&self) -> String {
        let mut p: Vec<(String, String)> = [
            ("name", "outbox"),
            (
                "connector.class",
                "io.debezium.connector.postgresql.PostgresConnector",
            ),
            ("tasks.max", "1"),
            ("plugin.name", "pgoutput"),
            ("snapshot.mode", "no_data"),
            ("publication.autocreate.mode", "filtered"),
            ("topic.prefix", "dbz"),
            ("tombstones.on.delete", "false"),
            ("transforms", "outbox"),
            (
                "transforms.outbox.type",
                "io.debezium.transforms.outbox.EventRouter",
            ),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        let own = [
            ("database.hostname", self.host.clone()),
            ("database.port", self.port.to_string()),
            ("database.user", self.user.clone()),
            ("database.password", String::new()),
            ("database.dbname", self.dbname.clone()),
            ("slot.name", self.slot.clone()),
            ("publication.name", self.publication.clone()),
            ("table.include.list", self.table.clone()),
        ];
        p.extend(own.into_iter().map(|(k, v)| (k.to_owned(), v)));
        merge(&mut p, &self.connector);
        render(&p)
    }
}

fn merge(p: &mut Vec<(String, String)>, over: &[(String, String)]) {
    for (k, v) in over {
        p.retain(|(key, _)| key != k);
        p.push((k.clone(), v.clone()));
    }
}

fn render(p: &[(String, String)]) -> String {
    p.iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

/// A running Kafka Connect standalone worker with one Debezium connector.
pub struct Debezium {
    dir: tempfile::TempDir,
    libs: String,
    connector: Connector,
    process: Option<Process>,
}

impl Debezium {
    /// Starts the worker and its connector with the jars of
    /// `WALBOX_DEBEZIUM_LIBS`. It creates its slot and publication when
    /// they are missing; wait for the slot to be active before writing
    /// events it must see.
    pub fn start(connector: Connector) -> Debezium {
        let libs = libs_from_env().unwrap_or_else(|| {
            panic!("WALBOX_DEBEZIUM_LIBS is not set to Connect's and Debezium's jars: run scripts/install-debezium (scripts/test does)")
        });
        let mut d = Debezium {
            dir: tempfile::tempdir().expect("a temporary directory"),
            libs,
            connector,
            process: None,
        };
        d.spawn();
        d
    }

    /// Where its log is.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("connect.log")
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Whether the worker has exited.
    pub fn exited(&self) -> bool {
        self.process
            .as_ref()
            .is_none_or(|p| p.exited.try_recv().is_ok())
    }

    /// The worker's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.pid)
    }

    /// SIGKILL, as a crash: offsets not flushed since the last interval are
    /// lost, so a restart resends from the slot's confirmed position.
    pub fn kill9(&mut self) {
        if let Some(p) = self.process.take() {
            signal(p.pid, libc::SIGKILL);
            let _ = p.exited.recv();
        }
    }

    /// SIGTERM: Connect stops the connector and flushes its offsets.
    pub fn stop(&mut self) {
        if let Some(p) = self.process.take() {
            signal(p.pid, libc::SIGTERM);
            if p.exited.recv_timeout(Duration::from_secs(60)).is_err() {
                signal(p.pid, libc::SIGKILL);
                let _ = p.exited.recv();
            }
        }
    }

    /// Starts it again, with the same offsets file.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    fn spawn(&mut self) {
        let dir = self.dir.path();
        std::fs::write(
            dir.join("worker.properties"),
            self.connector.worker_properties(dir),
        )
        .expect("write worker.properties");
        std::fs::write(
            dir.join("connector.properties"),
            self.connector.connector_properties(),
        )
        .expect("write connector.properties");
        std::fs::write(
            dir.join("log4j2.properties"),
            log4j2_to_file(&self.log_path(), ""),
        )
        .expect("write log4j2.properties");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("stdout.log"))
            .expect("open the stdout log");
        let jvm = if self.connector.jvm.is_empty() {
            let heap = std::env::var("WALBOX_DEBEZIUM_HEAP").unwrap_or_else(|_| "512m".into());
            vec![format!("-Xmx{heap}"), "-Xms128m".to_owned()]
        } else {
            self.connector.jvm.clone()
        };
        let mut cmd = Command::new(java_bin());
        cmd.args(jvm)
            .arg("-Djava.awt.headless=true")
            .arg(format!(
                "-Dlog4j2.configurationFile={}",
                dir.join("log4j2.properties").display()
            ))
            .arg("-cp")
            .arg(format!("{}/*", self.libs))
            .arg("org.apache.kafka.connect.cli.ConnectStandalone")
            .arg(dir.join("worker.properties"))
            .arg(dir.join("connector.properties"))
            .current_dir(dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("clone the log handle"))
            .stderr(log);
        self.process = Some(supervise(cmd));
    }
}

impl Drop for Debezium {
    fn drop(&mut self) {
        self.kill9();
    }
}
