//! The private Postgres decodes outbox inserts through a pgoutput slot.

use tokio_postgres::Client;
use walbox_test_harness::migrations::{apply_migrations, apply_sql_file, migrations_dir};
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::slot::confirmed_flush_lsn;

/// The pgoutput messages waiting in a slot, without consuming them.
async fn peek(client: &Client, slot: &str, publication: &str) -> Vec<Vec<u8>> {
    client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL, \
               'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publication],
        )
        .await
        .expect("peek the slot")
        .iter()
        .map(|r| r.get::<_, Vec<u8>>(0))
        .collect()
}

/// Creates a pgoutput slot. Its own statement: a slot cannot be created in a
/// transaction that has written, and a multi-statement query is one transaction.
async fn create_slot(client: &Client, slot: &str) {
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .expect("create slot");
}

fn tags(messages: &[Vec<u8>]) -> String {
    messages.iter().map(|m| m[0] as char).collect()
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test]
async fn slot_sees_committed_outbox_inserts_only() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    // The SQL is idempotent too, for users who apply it by hand.
    apply_migrations(&client).await;

    client
        .batch_execute("CREATE PUBLICATION walbox_outbox FOR TABLE public.outbox_events WITH (publish = 'insert')")
        .await
        .unwrap();
    create_slot(&client, "walbox").await;
    let start = confirmed_flush_lsn(&client, "walbox")
        .await
        .expect("slot exists");

    client
        .batch_execute(
            "BEGIN;
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', 'order-17', 'OrderCreated', '{\"total\": 42}'),
                         ('order', 'order-17', 'OrderPaid', '{}'),
                         ('customer', 'cust-9', 'CustomerMoved', '{\"city\": \"Oslo\"}');
             COMMIT;
             BEGIN;
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', 'rolled-back', 'Nope', '{}');
             ROLLBACK;
             UPDATE outbox_events SET event_type = 'Changed' WHERE aggregate_id = 'cust-9';
             DELETE FROM outbox_events WHERE aggregate_id = 'cust-9';",
        )
        .await
        .unwrap();

    let messages = peek(&client, "walbox", "walbox_outbox").await;
    // Begin, Relation, three Inserts, Commit. The rolled-back insert never
    // reaches the slot; publish = 'insert' filters the UPDATE and DELETE out
    // (their transactions show up as empty Begin/Commit pairs).
    let t = tags(&messages);
    assert!(t.starts_with("BRIIIC"), "message tags {t}");
    assert!(
        t[6..].chars().all(|c| c == 'B' || c == 'C'),
        "message tags {t}"
    );
    let inserts: Vec<&Vec<u8>> = messages.iter().filter(|m| m[0] == b'I').collect();
    assert!(contains(inserts[0], "order-17") && contains(inserts[0], "OrderCreated"));
    assert!(contains(inserts[1], "order-17") && contains(inserts[1], "OrderPaid"));
    assert!(contains(inserts[2], "cust-9") && contains(inserts[2], "{\"city\": \"Oslo\"}"));
    assert!(!messages.iter().any(|m| contains(m, "rolled-back")));
    assert!(
        contains(&messages[1], "outbox_events"),
        "Relation names the table"
    );

    // Peeking consumes nothing: the slot has not moved.
    assert_eq!(confirmed_flush_lsn(&client, "walbox").await, Some(start));
}

#[tokio::test]
async fn partitioned_outbox_example_publishes_as_the_root_table() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_sql_file(
        &client,
        &migrations_dir().join("examples/partitioned_outbox.sql"),
    )
    .await;
    client
        .batch_execute(
            "CREATE PUBLICATION walbox_outbox FOR TABLE public.outbox_events_by_day
                 WITH (publish = 'insert', publish_via_partition_root = true)",
        )
        .await
        .unwrap();
    create_slot(&client, "walbox").await;
    client
        .batch_execute(
            "INSERT INTO outbox_events_by_day (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', 'order-1', 'OrderCreated', '{}');
             INSERT INTO outbox_events_by_day (aggregate_type, aggregate_id, event_type, payload, created_at)
                  VALUES ('order', 'order-2', 'OrderCreated', '{}', now() - interval '400 days');",
        )
        .await
        .unwrap();

    // Today's partition exists (created by the example), the old row went to the default one.
    let parts: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_inherits WHERE inhparent = 'public.outbox_events_by_day'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(parts, 5, "default + today + 3 days ahead");

    // What walbox relies on: every Insert references the root table's oid.
    // (Postgres 15 also sends a Relation for the leaf partition before it,
    // so a decoder must key its relation cache by oid, not assume one
    // Relation per table.)
    let root_oid: u32 = client
        .query_one("SELECT 'public.outbox_events_by_day'::regclass::oid", &[])
        .await
        .unwrap()
        .get(0);
    let messages = peek(&client, "walbox", "walbox_outbox").await;
    let t = tags(&messages);
    let inserts: Vec<&Vec<u8>> = messages.iter().filter(|m| m[0] == b'I').collect();
    assert_eq!(inserts.len(), 2, "message tags {t}");
    for insert in inserts {
        let relation_id = u32::from_be_bytes(insert[1..5].try_into().unwrap());
        assert_eq!(
            relation_id, root_oid,
            "insert published as the root table ({t})"
        );
    }
    let root_relation = messages
        .iter()
        .find(|m| m[0] == b'R' && m[1..5] == root_oid.to_be_bytes())
        .expect("a Relation message for the root");
    assert!(contains(root_relation, "outbox_events_by_day"));

    // Retention drops whole partitions; the default partition is kept.
    client
        .batch_execute("SELECT public.outbox_events_by_day_drop_partitions(-10)")
        .await
        .unwrap();
    let left: Vec<String> = client
        .query(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'public.outbox_events_by_day'::regclass",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, vec!["outbox_events_by_day_default".to_owned()]);
}
