//! Postgres and Kafka from containers, for machines with a Docker engine
//! (`--features docker` and `WALBOX_TEST_DOCKER=1`).

use std::time::Duration;

use testcontainers::core::{IntoContainerPort, WaitFor};
use testcontainers::runners::SyncRunner;
use testcontainers::{Container, GenericImage, ImageExt};
use tokio_postgres::Config;

/// The running containers; dropping them removes them.
pub(crate) struct Containers {
    _postgres: Container<GenericImage>,
    _kafka: Container<GenericImage>,
    pub(crate) kafka_bootstrap: String,
}

/// Starts Postgres 17 (wal_level=logical) and Kafka 3.9 in KRaft mode.
pub(crate) fn start() -> Result<(Containers, Config), String> {
    let postgres = GenericImage::new("postgres", "17")
        .with_exposed_port(5432.tcp())
        .with_wait_for(WaitFor::message_on_stderr(
            "database system is ready to accept connections",
        ))
        .with_env_var("POSTGRES_HOST_AUTH_METHOD", "trust")
        .with_cmd([
            "postgres",
            "-c",
            "wal_level=logical",
            "-c",
            "max_replication_slots=20",
            "-c",
            "max_wal_senders=20",
            "-c",
            "wal_sender_timeout=10s",
        ])
        .start()
        .map_err(|e| format!("WALBOX_TEST_DOCKER=1: start the postgres:17 container: {e}"))?;
    let pg_port = postgres
        .get_host_port_ipv4(5432.tcp())
        .map_err(|e| format!("postgres container port: {e}"))?;

    // Kafka advertises the port clients use, so pick the host port first.
    let kafka_port = crate::port::free_port();
    let kafka = GenericImage::new("apache/kafka", "3.9.0")
        .with_wait_for(WaitFor::message_on_stdout("Kafka Server started"))
        .with_mapped_port(kafka_port, 9092.tcp())
        .with_env_var("KAFKA_NODE_ID", "1")
        .with_env_var("KAFKA_PROCESS_ROLES", "broker,controller")
        .with_env_var("KAFKA_LISTENERS", "PLAINTEXT://:9092,CONTROLLER://:9093")
        .with_env_var(
            "KAFKA_ADVERTISED_LISTENERS",
            format!("PLAINTEXT://127.0.0.1:{kafka_port}"),
        )
        .with_env_var("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
        .with_env_var(
            "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
            "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        )
        .with_env_var("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9093")
        .with_env_var("KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR", "1")
        .with_env_var("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        .with_env_var("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        .with_env_var("KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS", "0")
        .with_startup_timeout(Duration::from_secs(120))
        .start()
        .map_err(|e| format!("WALBOX_TEST_DOCKER=1: start the apache/kafka container: {e}"))?;

    let mut admin = Config::new();
    admin
        .host("127.0.0.1")
        .port(pg_port)
        .user("postgres")
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(10));
    Ok((
        Containers {
            _postgres: postgres,
            _kafka: kafka,
            kafka_bootstrap: format!("127.0.0.1:{kafka_port}"),
        },
        admin,
    ))
}
