//! Preflight, publication and slot lifecycle.

use slot_manager::{
    connect_control, drop_slot, ensure_publication, ensure_slot, preflight, slot_status,
    start_streaming, Ensured, Error, PgConfig, ReplicationClient, ReplicationOptions, TableName,
};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{self, fresh_db, PgServer};

use crate::pg_config;

const COLUMNS: &[&str] = &[
    "id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "payload",
];

#[tokio::test]
async fn preflight_names_what_to_change_and_the_server_decides_replication() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    let outbox = TableName::parse("public.outbox_events").unwrap();

    let e = preflight(&client, &outbox, COLUMNS).await.unwrap_err();
    assert!(
        e.to_string()
            .starts_with("table \"public\".\"outbox_events\" does not exist"),
        "{e}"
    );
    assert!(e.to_string().contains("walbox migrate"), "{e}");

    apply_migrations(&db.connect().await).await;
    preflight(&client, &outbox, COLUMNS).await.unwrap();
    let e = preflight(&client, &outbox, &["id", "aggregateid", "type"])
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("has no column aggregateid, type"),
        "{e}"
    );

    client
        .batch_execute("CREATE ROLE app LOGIN; GRANT ALL ON outbox_events TO app")
        .await
        .unwrap();
    let mut config = db.config().clone();
    config.user("app");
    let app = pg::connect(&config).await.unwrap();
    // Without REPLICATION the preflight lets the server decide (on RDS the
    // right comes from rds_replication, and rolreplication stays false)...
    preflight(&app, &outbox, COLUMNS).await.unwrap();
    // ...and the server's refusal says how to grant it, for the slot
    // functions and for the replication connection alike.
    let grant = |e: Error| {
        let text = e.to_string();
        assert!(matches!(e, Error::ReplicationRefused { .. }), "{text}");
        assert!(!e.is_transient());
        assert!(
            text.starts_with("role \"app\" may not use replication"),
            "{text}"
        );
        assert!(
            text.contains("ALTER ROLE \"app\" REPLICATION")
                && text.contains("GRANT rds_replication TO \"app\""),
            "{text}"
        );
    };
    grant(ensure_slot(&app, "app_slot", false).await.unwrap_err());
    let app_pg = PgConfig::parse(&format!("{} sslmode=disable", pg::conninfo(&config))).unwrap();
    let refused = start_streaming(
        &app_pg,
        &app,
        "app_slot",
        pgoutput_decoder::Lsn::ZERO,
        &ReplicationOptions::new("walbox_outbox"),
    )
    .await;
    match refused {
        Err(e) => grant(e),
        Ok(_) => panic!("a role without REPLICATION streamed"),
    }
    drop(app);
    client
        .batch_execute("DROP OWNED BY app; DROP ROLE app")
        .await
        .unwrap();
}

#[tokio::test]
async fn preflight_refuses_wal_level_replica() {
    let server = PgServer::builder()
        .setting("wal_level", "replica")
        .start()
        .unwrap();
    let client = pg::connect(&server.config("postgres")).await.unwrap();
    let outbox = TableName::parse("outbox_events").unwrap();
    let e = preflight(&client, &outbox, COLUMNS).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "wal_level is replica; walbox needs wal_level = logical (ALTER SYSTEM SET wal_level = logical; then restart Postgres)"
    );
    assert!(!e.is_transient());
}

#[tokio::test]
async fn init_is_idempotent_and_names_may_need_quotes() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    client
        .batch_execute(
            "CREATE SCHEMA \"My App\"; CREATE TABLE \"My App\".\"Outbox\" (id uuid, payload jsonb)",
        )
        .await
        .unwrap();
    let table = TableName::parse("\"My App\".\"Outbox\"").unwrap();
    let publication = "walbox's \"pub\"";
    assert_eq!(
        ensure_publication(&client, publication, &table, None)
            .await
            .unwrap(),
        Ensured::Created
    );
    assert_eq!(
        ensure_publication(&client, publication, &table, None)
            .await
            .unwrap(),
        Ensured::AlreadyPresent
    );
    assert_eq!(
        ensure_slot(&client, "walbox_q", false).await.unwrap(),
        Ensured::Created
    );
    assert_eq!(
        ensure_slot(&client, "walbox_q", false).await.unwrap(),
        Ensured::AlreadyPresent
    );

    let row = client
        .query_one(
            "SELECT pubinsert, pubupdate, pubdelete, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .unwrap();
    let flags: (bool, bool, bool, bool) = (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        flags,
        (true, false, false, true),
        "publish = 'insert', via partition root"
    );

    // The quoted names work in START_REPLICATION too.
    let stream = ReplicationClient::connect(&pg_config(&db))
        .await
        .unwrap()
        .start_logical_replication(
            "walbox_q",
            pgoutput_decoder::Lsn::ZERO,
            &ReplicationOptions::new(publication),
        )
        .await
        .unwrap();
    stream.close().await;
}

#[tokio::test]
async fn an_existing_publication_that_does_not_fit_is_reported() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    apply_migrations(&db.connect().await).await;
    client
        .batch_execute(
            "CREATE TABLE other (id int);
             CREATE PUBLICATION elsewhere FOR TABLE other;
             CREATE PUBLICATION no_inserts FOR TABLE outbox_events WITH (publish = 'update');",
        )
        .await
        .unwrap();
    let outbox = TableName::parse("outbox_events").unwrap();
    let e = ensure_publication(&client, "elsewhere", &outbox, None)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("does not publish \"public\".\"outbox_events\""),
        "{e}"
    );
    let e = ensure_publication(&client, "no_inserts", &outbox, None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("does not publish inserts"), "{e}");
}

#[tokio::test]
async fn dropping_an_active_slot_is_refused_unless_forced() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    apply_migrations(&db.connect().await).await;
    let outbox = TableName::parse("outbox_events").unwrap();
    ensure_publication(&client, "walbox_outbox", &outbox, None)
        .await
        .unwrap();
    ensure_slot(&client, "walbox", false).await.unwrap();

    let stream = ReplicationClient::connect(&pg_config(&db))
        .await
        .unwrap()
        .start_logical_replication(
            "walbox",
            pgoutput_decoder::Lsn::ZERO,
            &ReplicationOptions::new("walbox_outbox"),
        )
        .await
        .unwrap();
    let pid = stream.backend_pid().unwrap();

    // A second consumer is told who holds the slot; that is worth retrying.
    let e = ReplicationClient::connect(&pg_config(&db))
        .await
        .unwrap()
        .start_logical_replication(
            "walbox",
            pgoutput_decoder::Lsn::ZERO,
            &ReplicationOptions::new("walbox_outbox"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::SlotActive { pid: p, .. } if p == pid),
        "{e}"
    );
    assert!(e.is_transient());

    let e = drop_slot(&client, "walbox", false, None).await.unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("replication slot \"walbox\" is in use by process {pid}")
    );
    assert!(
        slot_status(&client, "walbox")
            .await
            .unwrap()
            .unwrap()
            .active
    );

    let dropped = drop_slot(&client, "walbox", true, Some("walbox_outbox"))
        .await
        .unwrap();
    assert_eq!(
        (dropped.slot, dropped.terminated_pid, dropped.publication),
        (true, Some(pid), true)
    );
    assert!(slot_status(&client, "walbox").await.unwrap().is_none());
    let again = drop_slot(&client, "walbox", false, Some("walbox_outbox"))
        .await
        .unwrap();
    assert_eq!((again.slot, again.publication), (false, false));
    drop(stream);
}

#[tokio::test]
async fn a_missing_slot_says_to_run_init_slot() {
    let db = fresh_db().await;
    let e = ReplicationClient::connect(&pg_config(&db))
        .await
        .unwrap()
        .start_logical_replication(
            "nope",
            pgoutput_decoder::Lsn::ZERO,
            &ReplicationOptions::new("p"),
        )
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "replication slot \"nope\" does not exist: create it with `walbox init-slot`"
    );
    assert!(!e.is_transient());
}

#[tokio::test]
async fn an_invalidated_slot_is_a_definite_error() {
    // A slot may keep at most 32 MB of WAL; then 80 MB are written and
    // checkpointed, so the server invalidates it (wal_status = lost).
    let server = walbox_test_harness::slot::server_that_loses_slots();
    let admin = server.config("postgres");
    let client = pg::connect(&admin).await.unwrap();
    apply_migrations(&client).await;
    let config =
        slot_manager::PgConfig::parse(&format!("{} sslmode=disable", pg::conninfo(&admin)))
            .unwrap();
    let outbox = TableName::parse("outbox_events").unwrap();
    ensure_publication(&client, "walbox_outbox", &outbox, None)
        .await
        .unwrap();
    ensure_slot(&client, "walbox", false).await.unwrap();
    walbox_test_harness::slot::write_wal_past_the_slot(&client, "walbox").await;
    let status = slot_status(&client, "walbox").await.unwrap().unwrap();
    assert_eq!(status.wal_status.as_deref(), Some("lost"), "{status:?}");

    let e = slot_manager::start_streaming(
        &config,
        &client,
        "walbox",
        pgoutput_decoder::Lsn::ZERO,
        &ReplicationOptions::new("walbox_outbox"),
    )
    .await
    .unwrap_err();
    assert!(matches!(e, Error::SlotInvalidated { .. }), "{e}");
    assert!(!e.is_transient());
    assert!(e.to_string().contains("on_slot_invalidated"), "{e}");
}
