//! `retention`: outbox rows older than it are removed once delivered, never
//! before; a partitioned outbox loses whole partitions instead of rows.

use std::time::Duration;

use tokio_postgres::Client;
use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

async fn count(client: &Client, table: &str) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// Waits until `table` holds exactly `n` rows.
async fn wait_rows(client: &Client, table: &str, n: i64) {
    wait_for(
        &format!("{table} to hold {n} rows"),
        Duration::from_secs(60),
        || async move {
            let c = count(client, table).await;
            if c == n {
                Ok(())
            } else {
                Err(format!("{c} rows"))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_older_than_the_retention_go_only_once_delivered() {
    let db = fresh_db().await;
    let client = init(&db).await;
    // Its own MockCluster: the brokers go down in the middle.
    let kafka = TestKafka::mock(1);
    let topic = kafka.create_topic(2).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            &topic,
            "--retention",
            "1s",
            "--slot-recreate-margin-secs",
            "0",
            "--metrics-addr",
            ANY_PORT,
        ],
    );
    let addr = metrics_addr(&relay).await;
    insert_events(&client, 0, 200, |k| 1 + k % 5, 7).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    // Delivered and older than 1 s: gone within a save (10 s) and a round.
    wait_rows(&client, "outbox_events", 0).await;

    // The brokers go down: these events wait, older than the retention,
    // and stay in the table however long.
    let mock = kafka.mock_cluster().unwrap();
    mock.broker_down(1).unwrap();
    insert_events(&client, 200, 400, |k| 1 + k % 5, 7).await;
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert_eq!(
        count(&client, "outbox_events").await,
        200,
        "nothing undelivered is deleted"
    );

    mock.broker_up(1).unwrap();
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    wait_rows(&client, "outbox_events", 0).await;
    assert_eq!(expect_all(&kafka, &topic, 400).await, 0);
    assert_eq!(
        metric_at(&addr, "walbox_retention_rows_deleted_total"),
        400.0
    );
    stop(&mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_loses_whole_partitions_and_gains_new_ones() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE outbox_parted (
                 id uuid NOT NULL DEFAULT gen_random_uuid(),
                 aggregate_type text NOT NULL,
                 aggregate_id text NOT NULL,
                 event_type text NOT NULL,
                 payload jsonb NOT NULL,
                 headers jsonb NOT NULL DEFAULT '{}',
                 created_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (id, created_at)
             ) PARTITION BY RANGE (created_at);",
        )
        .await
        .unwrap();
    let table = ["--table", "public.outbox_parted"];
    let out = walbox(&db, &["init-slot", table[0], table[1]])
        .output()
        .unwrap();
    succeeded(&out);
    // Partitions 2 s wide, from 10 s ago to 6 s from now (walbox makes the
    // later ones); made once the walbox binary is built.
    client
        .batch_execute(
            "DO $$
             DECLARE t0 timestamptz := date_trunc('second', now()) - interval '10 s';
             BEGIN
                 FOR i IN 0..7 LOOP
                     EXECUTE format('CREATE TABLE outbox_parted_%s PARTITION OF outbox_parted FOR VALUES FROM (%L) TO (%L)',
                                    i, t0 + i * interval '2 s', t0 + (i + 1) * interval '2 s');
                 END LOOP;
             END $$;",
        )
        .await
        .unwrap();
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(2).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            table[0],
            table[1],
            "--mapping-topic-template",
            &topic,
            "--retention",
            "2s",
            "--slot-recreate-margin-secs",
            "0",
            "--metrics-addr",
            ANY_PORT,
        ],
    );
    let addr = metrics_addr(&relay).await;
    // 12 s of events: partitions are made ahead as time passes, old ones
    // dropped once delivered.
    let mut n = 0;
    for _ in 0..60 {
        let values: Vec<String> = (n..n + 10)
            .map(|i| format!("('order', 'agg-{}', 'E{i}', '{{\"n\": {i}}}')", i % 7))
            .collect();
        client
            .batch_execute(&format!(
                "INSERT INTO outbox_parted (aggregate_type, aggregate_id, event_type, payload) VALUES {}",
                values.join(",")
            ))
            .await
            .unwrap_or_else(|e| panic!("{e:?}; walbox's log:\n{}", relay.log()));
        n += 10;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    assert_eq!(expect_all(&kafka, &topic, n).await, 0);
    wait_for(
        "old partitions dropped",
        Duration::from_secs(40),
        || async {
            let dropped = metric_at(&addr, "walbox_retention_partitions_dropped_total");
            let created = metric_at(&addr, "walbox_retention_partitions_created_total");
            if dropped >= 8.0 && created >= 3.0 {
                Ok(())
            } else {
                Err(format!("{dropped} dropped, {created} created"))
            }
        },
    )
    .await;
    assert_eq!(metric_at(&addr, "walbox_retention_rows_deleted_total"), 0.0);
    let first_six: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname ~ '^outbox_parted_[0-7]$'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(first_six, 0, "the partitions made by hand are gone");
    assert!(count(&client, "outbox_parted").await < n as i64);
    stop(&mut relay).await;
}
