//! The test environment shared by every walbox integration test.
//!
//! * **Postgres** ([`pg`]): `WALBOX_TEST_PG_URL` when set; otherwise a private
//!   server started from the local binaries (`WALBOX_PG_BIN`, else
//!   `pg_config --bindir`, else `/usr/lib/postgresql/*/bin`) in a temporary
//!   directory on a free port, configured for logical replication. It belongs to
//!   the test process: it is stopped when the process ends, also after a panic
//!   or a `kill -9` (the server gets a parent-death signal). Each test takes a
//!   fresh database with [`pg::fresh_db`].
//! * **Kafka** ([`kafka`]): `WALBOX_TEST_KAFKA` (a bootstrap list) when set;
//!   otherwise an in-process rdkafka `MockCluster`. Each test takes a random topic.
//!   Tests of what only a real broker shows (transactions, replication,
//!   leader failover, the Java partitioner) start Apache Kafka itself
//!   ([`apache_kafka`], jars from `WALBOX_KAFKA_LIBS`).
//! * **Other brokers**: RabbitMQ ([`rabbitmq`], Debian's `rabbitmq-server`)
//!   and an SQS-API server ([`elasticmq`], jars from `WALBOX_ELASTICMQ_LIBS`),
//!   each a process of the test's own.
//! * **Docker**: with the `docker` feature and `WALBOX_TEST_DOCKER=1`, containers
//!   supply both instead (see [`pg::shared`]).
//! * Helpers: [`wait::wait_for`] (a condition with a deadline, never a bare
//!   sleep), [`kafka::consume_n`], [`slot::confirmed_flush_lsn`],
//!   [`migrations::apply_migrations`].
//!
//! A misconfigured environment (a URL that does not answer, `wal_level` other
//! than `logical`) fails the test with one line that says what to change.

// Starting and reaping server processes needs a few libc calls (geteuid,
// getpwnam, prctl, kill, atexit); each is commented where it is made.
#![allow(unsafe_code)]

pub mod apache_kafka;
pub mod debezium;
pub mod elasticmq;
pub mod generated_doc;
pub mod http;
pub mod kafka;
pub mod migrations;
pub mod nats;
pub mod pg;
pub mod port;
pub mod proc_stat;
pub mod proxy;
pub mod rabbitmq;
pub mod secret_file;
pub mod slot;
pub mod tansu;
pub mod tls;
pub mod wait;
pub mod walbox_process;

#[cfg(feature = "docker")]
mod docker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// A name no other test, process or earlier run has used: `prefix_<pid>_<time>_<n>`,
/// lower case, valid as an unquoted SQL identifier and as a Kafka topic.
pub fn unique_name(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() % 1_000_000_000_000)
        .unwrap_or(0);
    format!("{prefix}_{}_{nanos:x}_{n}", std::process::id())
}
