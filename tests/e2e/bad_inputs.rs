//! Bad inputs: each a non-zero exit whose last line says what to change.

use std::process::Command;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{self, fresh_db, PgServer};

/// Runs walbox with `url` and returns (exit code, last stderr line).
fn walbox(url: &str, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(walbox_e2e::walbox_bin())
        .args(args)
        .env("WALBOX_PG_URL", url)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (
        out.status.code(),
        stderr.lines().last().unwrap_or_default().to_owned(),
    )
}

#[tokio::test]
async fn wal_level_replica() {
    let server = PgServer::builder()
        .setting("wal_level", "replica")
        .start()
        .unwrap();
    let url = format!(
        "{} sslmode=disable",
        pg::conninfo(&server.config("postgres"))
    );
    let (code, line) = walbox(&url, &["init-slot"]);
    assert_eq!(code, Some(1));
    assert_eq!(
        line,
        "walbox: wal_level is replica; walbox needs wal_level = logical (ALTER SYSTEM SET wal_level = logical; then restart Postgres)"
    );
}

#[tokio::test]
async fn a_missing_outbox_table() {
    let db = fresh_db().await;
    let url = format!("{} sslmode=disable", db.conninfo());
    let (code, line) = walbox(&url, &["init-slot"]);
    assert_eq!(code, Some(1));
    assert!(
        line.starts_with("walbox: table \"public\".\"outbox_events\" does not exist"),
        "{line}"
    );
    let (code, line) = walbox(&url, &["init-slot", "--table", "app.events"]);
    assert_eq!(code, Some(1));
    assert!(
        line.starts_with("walbox: table \"app\".\"events\" does not exist"),
        "{line}"
    );
}

#[tokio::test]
async fn a_wrong_password() {
    let server = PgServer::builder()
        .hba("local all all trust\nhost all postgres 127.0.0.1/32 trust\nhost all walbox 127.0.0.1/32 scram-sha-256\n")
        .start()
        .unwrap();
    let client = pg::connect(&server.config("postgres")).await.unwrap();
    client
        .batch_execute("CREATE ROLE walbox LOGIN REPLICATION PASSWORD 'right-secret'")
        .await
        .unwrap();
    let url = format!(
        "postgres://walbox:wrong-secret@127.0.0.1:{}/postgres?sslmode=disable",
        server.port()
    );
    for command in ["init-slot", "status"] {
        let (code, line) = walbox(&url, &[command]);
        assert_eq!(code, Some(1), "{command}");
        assert!(
            line.contains("password authentication failed for user \"walbox\""),
            "{line}"
        );
        assert!(!line.contains("wrong-secret"), "{line}");
    }
}

#[tokio::test]
async fn a_missing_slot() {
    let db = fresh_db().await;
    apply_migrations(&db.connect().await).await;
    let url = format!("{} sslmode=disable", db.conninfo());
    let kafka = TestKafka::from_env();

    // No init-slot yet.
    let (code, line) = walbox(&url, &["run", "--kafka-brokers", &kafka.bootstrap()]);
    assert_eq!(code, Some(1));
    assert_eq!(
        line,
        "walbox: replication slot \"walbox\" does not exist: create it with `walbox init-slot`"
    );
    let (code, line) = walbox(&url, &["status"]);
    assert_eq!(code, Some(1));
    assert_eq!(
        line,
        "walbox: replication slot \"walbox\" does not exist; create it with `walbox init-slot`"
    );

    // A broker that is not there at start is waited for, like Postgres:
    // run::kafka_down_at_start_is_waited_for_then_streamed_to.
}
