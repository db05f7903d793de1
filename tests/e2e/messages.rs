//! Events without an outbox table: `walbox.emit()` writes a transactional
//! logical decoding message, and `source = "messages"` (or `"both"`)
//! publishes it like a row.

use std::time::Duration;

use tokio_postgres::Client;
use walbox_test_harness::kafka::{consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{fresh_db, TestDb};

use crate::support::{
    expect_all, kill_9_at_random_moments, spawn_run, stop, succeeded, wait_exit, wait_log, walbox,
};

/// How the events of one transaction are written.
#[derive(Clone, Copy)]
pub(crate) enum Writes {
    /// Every event through `walbox.emit`.
    Messages,
    /// Even events as outbox rows, odd ones through `walbox.emit`.
    Both,
}

/// Writes events `from..to` (payload `n`, key `agg-{n % aggregates}`) in
/// transactions; `tx_size(k)` sizes the k-th one.
pub(crate) async fn write_events(
    client: &Client,
    from: usize,
    to: usize,
    tx_size: impl Fn(usize) -> usize,
    aggregates: usize,
    writes: Writes,
) {
    let (mut n, mut k) = (from, 0);
    while n < to {
        let end = (n + tx_size(k).max(1)).min(to);
        let mut sql = String::from("BEGIN;");
        for i in n..end {
            let (key, payload) = (format!("agg-{}", i % aggregates), format!("{{\"n\": {i}}}"));
            match writes {
                Writes::Both if i % 2 == 0 => sql.push_str(&format!(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', '{key}', 'E{i}', '{payload}');"
                )),
                _ => sql.push_str(&format!(
                    "SELECT walbox.emit('order', '{key}', 'E{i}', '{payload}');"
                )),
            }
        }
        sql.push_str("COMMIT;");
        client.batch_execute(&sql).await.unwrap();
        n = end;
        k += 1;
    }
}

async fn init(db: &TestDb, source: &str) -> Client {
    let client = db.connect().await;
    apply_migrations(&client).await;
    let out = walbox(db, &["init-slot", "--source", source])
        .output()
        .unwrap();
    let said = succeeded(&out);
    assert!(
        said.contains("publication \"walbox_outbox\": created"),
        "{said}"
    );
    client
}

/// 10,000 events in transactions of 1 to 50 while walbox is killed three
/// times: every event arrives, per-key order holds.
async fn survives_kill_9(source: &str, writes: Writes) {
    let db = fresh_db().await;
    let client = init(&db, source).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let total = 10_000;
    let writer_client = db.connect().await;
    let writer = tokio::spawn(async move {
        for chunk in 0..100 {
            write_events(
                &writer_client,
                chunk * 100,
                (chunk + 1) * 100,
                move |k| 1 + (chunk * 7 + k * 13) % 50,
                100,
                writes,
            )
            .await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    let args = ["--source", source, "--mapping-topic-template", &topic];
    let run = || spawn_run(&db, &kafka, &args);
    let mut relay =
        kill_9_at_random_moments(run(), 3, (150, 400), 0x9e37_79b9_7f4a_7c15, run).await;
    writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, total).await;
    eprintln!("source = {source}: {total} events through 3 kill -9s, {duplicates} duplicates");
    stop(&mut relay).await;
    // Every record has its event id and type.
    let records = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    for r in &records {
        let n = crate::support::n_of(r);
        let headers = headers_of(r);
        assert_eq!(headers.get("event_type"), Some(&format!("E{n}")));
        assert!(
            headers.get("id").is_some_and(|id| id.len() == 36),
            "a uuid event id"
        );
        assert_eq!(
            rdkafka::message::Message::key(r),
            Some(format!("agg-{}", n % 100).as_bytes())
        );
    }
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_arrive_once_or_more_in_order_through_kill_9() {
    survives_kill_9("messages", Writes::Messages).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_and_messages_of_the_same_transactions_keep_their_order_through_kill_9() {
    survives_kill_9("both", Writes::Both).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolled_back_and_non_transactional_messages_are_not_events() {
    let db = fresh_db().await;
    let client = init(&db, "messages").await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &["--source", "messages", "--mapping-topic-template", &topic],
    );
    client
        .batch_execute(
            "BEGIN; SELECT walbox.emit('order', 'a', 'E0', '{\"n\": 0}'); COMMIT;
             BEGIN; SELECT walbox.emit('order', 'a', 'Rolled', '{\"n\": 100}'); ROLLBACK;
             SELECT pg_logical_emit_message(false, 'walbox',
                 '{\"v\":1,\"id\":\"00000000-0000-0000-0000-000000000000\",\"aggregate_type\":\"order\",\"aggregate_id\":\"a\",\"payload\":{\"n\":101}}');
             SELECT pg_logical_emit_message(true, 'another-app', 'not an envelope');
             BEGIN; SELECT walbox.emit('order', 'a', 'E1', '{\"n\": 1}'); COMMIT;",
        )
        .await
        .unwrap();
    let duplicates = expect_all(&kafka, &topic, 2).await;
    assert_eq!(duplicates, 0);
    wait_log(
        &relay,
        "a non-transactional logical decoding message has the events' prefix",
    )
    .await;
    let log = stop(&mut relay).await;
    assert_eq!(
        log.matches("non-transactional logical decoding message")
            .count(),
        1,
        "reported once: {log}"
    );
    // The slot moved past all of it.
    let retained: i64 = client
        .query_one(
            "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::int8 FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(retained < 1024 * 1024, "{retained} bytes behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walbox_emit_refuses_an_event_without_a_key_in_the_transaction() {
    let db = fresh_db().await;
    let client = init(&db, "messages").await;
    let e = client
        .batch_execute("SELECT walbox.emit('order', '', 'E', '{}')")
        .await
        .unwrap_err();
    let e = e.as_db_error().unwrap().message().to_owned();
    assert!(e.contains("aggregate_id must not be empty"), "{e}");
    let e = client
        .batch_execute("SELECT walbox.emit('order', 'a', 'E', '{}', '[1]')")
        .await
        .unwrap_err();
    assert!(
        e.as_db_error()
            .unwrap()
            .message()
            .contains("headers must be a JSON object"),
        "{e}"
    );
}

/// Messages need pgoutput's `messages` option (Postgres 14): on 13,
/// init-slot and run say so in one line; on 14 and later the slot is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_need_postgres_14_and_say_so() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    let out = walbox(&db, &["init-slot", "--source", "messages"])
        .output()
        .unwrap();
    if version >= 140_000 {
        let said = succeeded(&out);
        assert!(said.contains("slot \"walbox\": created"), "{said}");
        let tables: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'walbox_outbox'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            tables, 0,
            "a publication of no table: messages belong to none"
        );
    } else {
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("need Postgres 14 or later") && stderr.trim().lines().count() == 1,
            "{stderr}"
        );
        let kafka = TestKafka::from_env();
        let mut relay = spawn_run(&db, &kafka, &["--source", "both"]);
        let (status, log) = wait_exit(&mut relay).await;
        assert!(
            !status.success() && log.contains("need Postgres 14 or later"),
            "{log}"
        );
    }
}

/// docs/configuration.md, "Who may write events": the recipe that limits
/// `pg_logical_emit_message` (and so `walbox.emit`) to the application's
/// role, whatever the function's signatures on this Postgres version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emit_rights_can_be_limited_to_the_applications_role() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let roles = format!("{}_app", db.name());
    client
        .batch_execute(&format!(
            "CREATE ROLE {roles}; CREATE ROLE {roles}_other;
             DO $$ DECLARE f regprocedure; BEGIN
               FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP
                 EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
                 EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO {roles}', f);
               END LOOP;
             END $$;"
        ))
        .await
        .unwrap();
    let emit = |role: String| {
        let client = &client;
        async move {
            client
                .batch_execute(&format!(
                    "SET ROLE {role}; SELECT walbox.emit('order', '1', 'E', '{{}}'); RESET ROLE;"
                ))
                .await
        }
    };
    emit(roles.clone()).await.unwrap();
    let e = emit(format!("{roles}_other")).await.unwrap_err();
    client.batch_execute("RESET ROLE").await.unwrap();
    assert!(
        e.as_db_error()
            .unwrap()
            .message()
            .contains("permission denied for function pg_logical_emit_message"),
        "{e}"
    );
    // Roles are cluster-wide: leave none behind.
    client
        .batch_execute(&format!(
            "DO $$ DECLARE f regprocedure; BEGIN
               FOR f IN SELECT oid::regprocedure FROM pg_proc WHERE proname = 'pg_logical_emit_message' LOOP
                 EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f);
                 EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM {roles}', f);
               END LOOP;
             END $$; DROP ROLE {roles}; DROP ROLE {roles}_other;"
        ))
        .await
        .unwrap();
}
