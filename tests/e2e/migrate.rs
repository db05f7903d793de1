//! `walbox migrate` applies the outbox schema once, and says what it did.

use std::process::{Command, Output};

use walbox_test_harness::pg::fresh_db;

use crate::support::succeeded;

fn walbox(args: &[&str]) -> Output {
    Command::new(walbox_e2e::walbox_bin())
        .args(args)
        .env_remove("WALBOX_PG_URL")
        .output()
        .expect("run walbox")
}

#[tokio::test]
async fn migrate_creates_the_outbox_schema_once() {
    let db = fresh_db().await;
    let url = db.conninfo();

    let first = walbox(&["migrate", "--pg-url", &url]);
    let stdout = succeeded(&first);
    assert!(
        stdout.contains("0001_outbox_events.sql: applied"),
        "{stdout}"
    );
    assert!(
        stdout.contains("0002_processed_events.sql: applied"),
        "{stdout}"
    );
    assert!(stdout.contains("0003_emit.sql: applied"), "{stdout}");
    assert!(stdout.contains("0004_outbox_seq.sql: applied"), "{stdout}");
    assert!(stdout.contains("0005_receipts.sql: applied"), "{stdout}");
    assert!(
        stdout.contains("0006_receipts_every_broker.sql: applied"),
        "{stdout}"
    );
    assert!(stdout.contains("0007_backlog.sql: applied"), "{stdout}");

    let second = walbox(&["migrate", "--pg-url", &url]);
    let stdout = String::from_utf8_lossy(&second.stdout);
    assert!(second.status.success());
    assert!(
        stdout.contains("0001_outbox_events.sql: already applied"),
        "{stdout}"
    );
    assert!(
        stdout.contains("0002_processed_events.sql: already applied"),
        "{stdout}"
    );

    let client = db.connect().await;
    let versions: Vec<i32> = client
        .query(
            "SELECT version FROM walbox_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, vec![1, 2, 3, 4, 5, 6, 7]);
    // The defaults of the mapping table: id, headers and created_at fill themselves.
    let row = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', 'o-1', 'OrderCreated', '{\"a\": 1}')
               RETURNING id::text, headers::text, created_at IS NOT NULL, seq",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0).len(), 36);
    assert_eq!(row.get::<_, String>(1), "{}");
    assert!(row.get::<_, bool>(2));
    assert!(row.get::<_, i64>(3) >= 1, "seq fills itself");
    // Headers must be an object: each key becomes a Kafka header.
    let err = client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
                  VALUES ('order', 'o-1', 'OrderCreated', '{}', '[1]')",
            &[],
        )
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("outbox_events_headers_is_object")
            || format!("{err:?}").contains("outbox_events_headers_is_object")
    );
}

#[test]
fn migrate_against_a_dead_server_fails_in_one_line_without_the_password() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://walbox:hunter2@127.0.0.1:{port}/app?connect_timeout=5");
    let out = walbox(&["migrate", "--pg-url", &url]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "walbox: connect to host=127.0.0.1 port={port} user=walbox dbname=app"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn unknown_subcommands_are_usage_errors() {
    let out = walbox(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn migrate_takes_the_same_tls_settings_as_the_other_commands() {
    // verify-full without a CA file is refused by walbox's own parser (as for
    // init-slot), not misread: tokio-postgres alone does not know verify-full.
    let out = walbox(&[
        "migrate",
        "--pg-url",
        "postgres://walbox:hunter2@127.0.0.1:1/app?sslmode=verify-full",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a configuration error: {stderr}"
    );
    assert!(
        stderr.contains("sslmode=verify-full needs sslrootcert"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

/// `walbox.backlog()` and `walbox.require_capacity()` as an application's
/// role calls them (no right beyond the defaults): a missing slot and a
/// slot no walbox streams from raise WB002; over budget (as walbox run
/// reports it in walbox.relay_state) raises WB001; within it, nothing.
#[tokio::test]
async fn backlog_and_require_capacity_answer_an_application_role() {
    let db = fresh_db().await;
    let su = db.connect().await;
    walbox_test_harness::migrations::apply_migrations(&su).await;
    su.batch_execute("CREATE ROLE app_writer LOGIN")
        .await
        .unwrap();
    su.batch_execute("SELECT pg_create_logical_replication_slot('walbox', 'pgoutput')")
        .await
        .unwrap();
    let (app, connection) = tokio_postgres::connect(
        &format!("{} user=app_writer", db.conninfo()),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let code = |e: tokio_postgres::Error| {
        let db = e.as_db_error().expect("a database error");
        (db.code().code().to_owned(), db.message().to_owned())
    };

    let missing = app
        .execute("SELECT walbox.require_capacity('no_such_slot')", &[])
        .await
        .map_err(code)
        .unwrap_err();
    assert_eq!(missing.0, "WB002", "{missing:?}");
    let idle = app
        .execute("SELECT walbox.require_capacity()", &[])
        .await
        .map_err(code)
        .unwrap_err();
    assert_eq!(idle.0, "WB002", "{idle:?}");
    assert!(idle.1.contains("no walbox streams"), "{idle:?}");

    let row = app
        .query_one(
            "SELECT streaming, unconfirmed_bytes >= 0, oldest_undelivered_age::text, over_budget FROM walbox.backlog()",
            &[],
        )
        .await
        .unwrap();
    assert!(!row.get::<_, bool>(0));
    assert!(row.get::<_, bool>(1));
    // No walbox ever reported: the age is unknown.
    assert!(row.get::<_, Option<String>>(2).is_none());
    assert!(!row.get::<_, bool>(3));

    // A walbox that reported 10 minutes ago, with a 1-minute budget, and
    // stopped: the age counts from its last report.
    su.batch_execute(
        "INSERT INTO walbox.relay_state (slot, reported_at, oldest_undelivered, max_bytes, max_age)
              VALUES ('walbox', now() - interval '10 minutes', NULL, NULL, interval '1 minute')",
    )
    .await
    .unwrap();
    let row = app
        .query_one(
            "SELECT oldest_undelivered_age >= interval '10 minutes', over_budget FROM walbox.backlog()",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    assert!(row.get::<_, bool>(1));
    let nothing = app
        .query_one("SELECT * FROM walbox.backlog('no_such_slot')", &[])
        .await
        .unwrap();
    assert!(nothing.get::<_, Option<bool>>("streaming").is_none());
}
