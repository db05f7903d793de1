//! The publication's coverage of the outbox table, read from a real catalog:
//! each kind of drift is a gap or a changed fingerprint, and a change that
//! does not concern the table is neither.

use slot_manager::{
    connect_control, coverage, ChangeInFlight, Coverage, CoverageReader, TableName,
};
use tokio_postgres::Client;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::fresh_db;

use crate::pg_config;

/// One reader per test: its prepared statements serve every reading, across
/// the catalog changes the test makes (as the relay's do).
async fn read_with(reader: &mut CoverageReader, client: &Client) -> Coverage {
    let outbox = TableName::parse("public.outbox_events").unwrap();
    reader
        .read(client, "walbox_outbox", Some(&outbox), None)
        .await
        .unwrap()
}

async fn read(client: &Client) -> Coverage {
    let outbox = TableName::parse("public.outbox_events").unwrap();
    coverage(client, "walbox_outbox", &outbox, None)
        .await
        .unwrap()
}

async fn gap_after(reader: &mut CoverageReader, client: &Client, sql: &str) -> String {
    client.batch_execute(sql).await.unwrap();
    read_with(reader, client)
        .await
        .gap
        .unwrap_or_else(|| panic!("a gap after {sql}"))
}

#[tokio::test]
async fn each_drift_is_a_gap_or_a_new_fingerprint() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    let mut reader = CoverageReader::default();
    apply_migrations(&db.connect().await).await;
    client
        .batch_execute(
            "CREATE TABLE other (id int);
             CREATE PUBLICATION walbox_outbox FOR TABLE outbox_events
               WITH (publish = 'insert', publish_via_partition_root = true)",
        )
        .await
        .unwrap();
    let first = read_with(&mut reader, &client).await;
    assert_eq!(first.gap, None);
    assert!(first.table_oid.is_some());

    // Unrelated changes leave the fingerprint alone: no false stops.
    client
        .batch_execute(
            "ALTER PUBLICATION walbox_outbox ADD TABLE other;
             ALTER TABLE outbox_events ADD COLUMN note text;
             INSERT INTO other VALUES (1)",
        )
        .await
        .unwrap();
    client
        .batch_execute("VACUUM FULL outbox_events")
        .await
        .unwrap();
    client
        .batch_execute("VACUUM FREEZE pg_catalog.pg_publication")
        .await
        .unwrap();
    let again = read_with(&mut reader, &client).await;
    assert_eq!(again.fingerprint, first.fingerprint);
    assert!(again.wal_lsn > first.wal_lsn);

    // Removed and added back between two readings: a new fingerprint.
    client
        .batch_execute(
            "ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events;
             ALTER PUBLICATION walbox_outbox ADD TABLE outbox_events",
        )
        .await
        .unwrap();
    let readded = read_with(&mut reader, &client).await;
    assert_eq!(readded.gap, None);
    assert_ne!(readded.fingerprint, first.fingerprint);

    let g = gap_after(
        &mut reader,
        &client,
        "ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events",
    )
    .await;
    assert!(
        g.contains(r#"does not include table "public"."outbox_events""#),
        "{g}"
    );
    assert!(g.contains("ADD TABLE"), "{g}");
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox ADD TABLE outbox_events")
        .await
        .unwrap();

    let g = gap_after(
        &mut reader,
        &client,
        "ALTER PUBLICATION walbox_outbox SET (publish = 'update')",
    )
    .await;
    assert!(g.contains("no longer publishes INSERTs"), "{g}");
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox SET (publish = 'insert')")
        .await
        .unwrap();
    let restored = read_with(&mut reader, &client).await;
    assert_eq!(restored.gap, None);
    assert_ne!(
        restored.fingerprint, readded.fingerprint,
        "altered and restored is still a change"
    );

    if walbox_test_harness::pg::server_version_num(&client).await >= 150_000 {
        let g = gap_after(
            &mut reader,
            &client,
            "ALTER PUBLICATION walbox_outbox SET TABLE outbox_events WHERE (aggregate_type = 'order')",
        )
        .await;
        assert!(g.contains("publishes only the rows"), "{g}");
        client
            .batch_execute("ALTER PUBLICATION walbox_outbox SET TABLE outbox_events")
            .await
            .unwrap();
    }

    // Dropped and recreated: gone from a FOR TABLE publication.
    let before = read_with(&mut reader, &client).await;
    let g = gap_after(
        &mut reader,
        &client,
        "DROP TABLE outbox_events; CREATE TABLE outbox_events (id uuid, payload jsonb)",
    )
    .await;
    assert!(g.contains("does not include table"), "{g}");
    let after = read_with(&mut reader, &client).await;
    assert_ne!(after.table_oid, before.table_oid);
    let g = gap_after(&mut reader, &client, "DROP TABLE outbox_events").await;
    assert!(g.contains("no longer exists"), "{g}");
}

/// What a reading finds in flight, from the catalog rows' stamps: nothing
/// while the application only inserts; a change not yet committed while an
/// ALTER, DROP or RENAME of the publication or table is open; nothing again
/// once it rolled back (its stamp stays, its transaction aborted).
#[tokio::test]
async fn a_reading_sees_a_change_of_the_coverage_in_flight() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    apply_migrations(&db.connect().await).await;
    client
        .batch_execute(
            "CREATE TABLE other (id int);
             CREATE PUBLICATION walbox_outbox FOR TABLE outbox_events
               WITH (publish = 'insert', publish_via_partition_root = true)",
        )
        .await
        .unwrap();
    assert_eq!(read(&client).await.in_flight, ChangeInFlight::Nothing);
    let mut app = db.connect().await;
    let tx = app.transaction().await.unwrap();
    tx.batch_execute(
        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
              VALUES ('order', 'o-1', 'E', '{}')",
    )
    .await
    .unwrap();
    assert_eq!(
        read(&client).await.in_flight,
        ChangeInFlight::Nothing,
        "an open INSERT is no change"
    );
    tx.rollback().await.unwrap();
    let version = walbox_test_harness::pg::server_version_num(&client).await;
    for change in [
        "ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events",
        "ALTER PUBLICATION walbox_outbox SET (publish = 'update')",
        "DROP PUBLICATION walbox_outbox",
        "ALTER TABLE outbox_events RENAME TO outbox_old",
        "DROP TABLE outbox_events",
    ] {
        // From Postgres 16, pg_publication_tables locks the table it
        // lists: a reading waits for an open RENAME or DROP of it (and
        // confirms nothing meanwhile) instead of seeing it in flight.
        if version >= 160_000 && (change.contains("RENAME") || change.starts_with("DROP TABLE")) {
            continue;
        }
        let tx = app.transaction().await.unwrap();
        tx.batch_execute(change).await.unwrap();
        let reading = read(&client).await;
        assert_eq!(reading.gap, None, "{change}: not visible yet");
        assert_eq!(
            reading.in_flight,
            ChangeInFlight::Pending,
            "{change}: in flight"
        );
        tx.rollback().await.unwrap();
        assert_eq!(
            read(&client).await.in_flight,
            ChangeInFlight::Nothing,
            "{change}: rolled back"
        );
    }
    // Unrelated: another table added to the publication.
    let tx = app.transaction().await.unwrap();
    tx.batch_execute("ALTER PUBLICATION walbox_outbox ADD TABLE other")
        .await
        .unwrap();
    assert_eq!(read(&client).await.in_flight, ChangeInFlight::Nothing);
    tx.rollback().await.unwrap();
}

#[tokio::test]
async fn a_partitioned_outbox_needs_publish_via_partition_root() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE outbox_events (id uuid, created_at date, payload jsonb) PARTITION BY RANGE (created_at);
             CREATE TABLE outbox_2026 PARTITION OF outbox_events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
             CREATE PUBLICATION walbox_outbox FOR TABLE outbox_events WITH (publish = 'insert')",
        )
        .await
        .unwrap();
    let g = read(&client).await.gap.expect("a gap");
    assert!(g.contains("publish_via_partition_root = true"), "{g}");
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox SET (publish_via_partition_root = true)")
        .await
        .unwrap();
    assert_eq!(read(&client).await.gap, None);
}

#[tokio::test]
async fn a_missing_publication_is_a_gap() {
    let db = fresh_db().await;
    let client = connect_control(&pg_config(&db)).await.unwrap();
    apply_migrations(&db.connect().await).await;
    let g = read(&client).await.gap.expect("a gap");
    assert!(
        g.contains("publication walbox_outbox no longer exists"),
        "{g}"
    );
}
