//! Delivery receipts (`receipts = true`) and `walbox.await_delivery`: an
//! application waits on each of its events and learns where it landed,
//! through a kill -9 of walbox; a wait that times out says so.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::message::Message;
use tokio::sync::{mpsc, Mutex};
use walbox_test_harness::kafka::{consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::pg::fresh_db;

use crate::support::*;

/// Where a wait said an event landed.
type Landed = (String, i32, i64);

/// 10,000 events in transactions of 1 to 20, each waited on by one of 8
/// application connections with `walbox.await_delivery` as soon as it
/// committed; walbox is killed with SIGKILL while they flow and started
/// again a second later. Every wait returns, with the topic, partition
/// and offset of a copy of its event that a consumer reads there (the
/// first one, when the event has only one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_wait_returns_where_its_event_landed_through_a_kill_9() {
    const TOTAL: usize = 10_000;
    const WAITERS: usize = 8;
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let flags = [
        "--mapping-topic-template",
        topic.as_str(),
        "--receipts",
        "true",
    ];
    let relay = spawn_run(&db, &kafka, &flags);

    // The application: commits events, hands each id to a waiter.
    let (ids_tx, ids_rx) = mpsc::unbounded_channel::<String>();
    let ids_rx = Arc::new(Mutex::new(ids_rx));
    let landed: Arc<Mutex<HashMap<String, Landed>>> = Arc::default();
    let mut waiters = Vec::new();
    for _ in 0..WAITERS {
        let conn = db.connect().await;
        let (ids_rx, landed) = (Arc::clone(&ids_rx), Arc::clone(&landed));
        waiters.push(tokio::spawn(async move {
            loop {
                let Some(id) = ids_rx.lock().await.recv().await else {
                    return;
                };
                let row = conn
                    .query_one(
                        "SELECT event_id, topic, kafka_partition, kafka_offset
                           FROM walbox.await_delivery($1::text, '90 seconds')",
                        &[&id],
                    )
                    .await
                    .unwrap_or_else(|e| panic!("await_delivery({id}): {e}"));
                assert_eq!(row.get::<_, String>(0), id);
                landed
                    .lock()
                    .await
                    .insert(id, (row.get(1), row.get(2), row.get(3)));
            }
        }));
    }
    let writer = {
        let conn = db.connect().await;
        tokio::spawn(async move {
            let (mut n, mut k) = (0usize, 0usize);
            while n < TOTAL {
                let size = (1 + k % 20).min(TOTAL - n);
                let values: Vec<String> = (n..n + size)
                    .map(|i| format!("('order', 'agg-{}', 'E', '{{\"n\": {i}}}')", i % 50))
                    .collect();
                let rows = conn
                    .query(
                        &format!(
                            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES {} RETURNING id::text",
                            values.join(",")
                        ),
                        &[],
                    )
                    .await
                    .unwrap();
                for r in rows {
                    ids_tx.send(r.get(0)).unwrap();
                }
                n += size;
                k += 1;
                if k % 10 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
    };
    // Mid-stream: walbox killed, down for a second while the waits go on,
    // then started again.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let mut relay = relay;
    relay.kill9();
    let written_at_kill: i64 = client
        .query_one("SELECT count(*) FROM walbox.receipts", &[])
        .await
        .unwrap()
        .get(0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let relay = spawn_run(&db, &kafka, &flags);
    writer.await.unwrap();
    for w in waiters {
        w.await.unwrap();
    }
    let landed = Arc::try_unwrap(landed).unwrap().into_inner();
    assert_eq!(landed.len(), TOTAL);
    assert!(
        (1..TOTAL as i64).contains(&written_at_kill),
        "the kill came while events flowed: {written_at_kill} receipts then"
    );

    // Where a consumer finds each event: every copy of it.
    let records = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(3),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let mut copies: HashMap<String, Vec<(i32, i64)>> = HashMap::new();
    for m in &records {
        copies
            .entry(headers_of(m)["id"].clone())
            .or_default()
            .push((m.partition(), m.offset()));
    }
    let mut single = 0;
    for (id, (t, partition, offset)) in &landed {
        assert_eq!(t, &topic, "{id}");
        let at = copies
            .get(id)
            .unwrap_or_else(|| panic!("{id}: a receipt, but no record"));
        assert!(
            at.contains(&(*partition, *offset)),
            "{id}: the receipt says [{partition}] @{offset}; its copies are at {at:?}"
        );
        single += usize::from(at.len() == 1);
    }
    assert!(single > TOTAL / 2, "most events have one copy: {single}");
    let stored: i64 = client
        .query_one("SELECT count(DISTINCT event_id) FROM walbox.receipts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, TOTAL as i64, "a receipt for every event");
    let mut relay = relay;
    stop(&mut relay).await;
}

/// A wait for an event walbox never delivers ends at its timeout with
/// SQLSTATE 57014 and a message naming the event; an event that is there
/// already returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_times_out_with_a_clear_error_and_a_present_receipt_returns_at_once() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &["--mapping-topic-template", &topic, "--receipts", "true"],
    );
    let id: String = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'k', 'E', '{\"n\": 0}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let first = client
        .query_one(
            "SELECT kafka_partition, kafka_offset FROM walbox.await_delivery($1::text::uuid, '30 seconds')",
            &[&id],
        )
        .await;
    let first = first.unwrap();
    assert_eq!((first.get::<_, i32>(0), first.get::<_, i64>(1)), (0, 0));
    let t0 = std::time::Instant::now();
    let again = client
        .query_one(
            "SELECT kafka_offset FROM walbox.await_delivery($1::text, '30 seconds')",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(again.get::<_, i64>(0), 0);
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "a receipt there returns at once"
    );

    let t0 = std::time::Instant::now();
    let e = client
        .query_one(
            "SELECT * FROM walbox.await_delivery('00000000-0000-4000-8000-00000000dead', '300 milliseconds')",
            &[],
        )
        .await
        .unwrap_err();
    let waited = t0.elapsed();
    let db_error = e.as_db_error().expect("a server error");
    assert_eq!(db_error.code().code(), "57014");
    assert!(
        db_error
            .message()
            .contains("was not delivered within 00:00:00.3"),
        "{}",
        db_error.message()
    );
    assert!(
        (Duration::from_millis(250)..Duration::from_secs(3)).contains(&waited),
        "{waited:?}"
    );
    // The session's lock_timeout is the caller's again.
    let lock_timeout: String = client
        .query_one("SHOW lock_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(lock_timeout, "0");
    stop(&mut relay).await;
}

/// Receipts with exactly-once, or without the migration, stop walbox at
/// start, the reason on its last line (exit 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_refused_where_they_cannot_be_kept() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let out = walbox(
        &db,
        &[
            "run",
            "--kafka-brokers",
            "127.0.0.1:1",
            "--receipts",
            "true",
            "--delivery",
            "exactly-once",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("not supported with delivery = \"exactly-once\""),
        "{stderr}"
    );

    client
        .batch_execute("DROP TABLE walbox.receipts")
        .await
        .unwrap();
    let kafka = TestKafka::from_env();
    let out = walbox(
        &db,
        &[
            "run",
            "--kafka-brokers",
            &kafka.bootstrap(),
            "--receipts",
            "true",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("run `walbox migrate`"), "{stderr}");
    let last = stderr.trim().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("walbox: configuration: receipts = true needs walbox.receipts"),
        "{stderr}"
    );
}
