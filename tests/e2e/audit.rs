//! `walbox audit` on Apache Kafka (its time index finds where a window
//! starts): what it reports after real runs, and what it finds when a test
//! takes events away or adds records no row explains, each count checked
//! against what the test did or what an independent consumer counts.

use std::collections::HashSet;
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::Value;
use tokio_postgres::Client;
use walbox_test_harness::kafka::{consume_until_quiet, TestKafka};
use walbox_test_harness::pg::{fresh_db, TestDb};
use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

/// `walbox audit --last 1h --json` (and `extra`) over `topic`.
fn audit(db: &TestDb, kafka: &TestKafka, topic: &str, extra: &[&str]) -> (Output, Value) {
    let brokers = kafka.bootstrap();
    let mut flags = vec![
        "--kafka-brokers",
        &brokers,
        "--mapping-topic-template",
        topic,
    ];
    flags.extend(extra);
    audit_report(db, &flags)
}

/// `walbox audit --last 1h --json` with `flags` (the broker's): its exit
/// and report.
pub(crate) fn audit_report(db: &TestDb, flags: &[&str]) -> (Output, Value) {
    let out = walbox(db, &["audit"])
        .args(flags)
        .args(["--last", "1h", "--json"])
        .output()
        .unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, report)
}

pub(crate) fn count(report: &Value, what: &str) -> u64 {
    report["total"][what]
        .as_u64()
        .unwrap_or_else(|| panic!("no total.{what} in {report:#}"))
}

/// Waits until the slot is confirmed up to the WAL written so far.
pub(crate) async fn wait_caught_up(client: &Client) {
    let head = current_wal_lsn(client).await;
    wait_confirmed_at_least(client, "walbox", head, Duration::from_secs(60)).await;
}

/// 3,000 events in transactions of 1 to 20 over 30 keys, walbox killed
/// with SIGKILL twice while they stream: the audit reports every row
/// delivered, nothing missing, out of order or unknown, and exactly the
/// duplicates an independent consumer counts (exit 1 if there are any).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_kill_9_the_audit_counts_the_duplicates_a_consumer_sees_and_nothing_else() {
    const TOTAL: usize = 3_000;
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    // A restart that skips what the broker holds leaves no duplicate to
    // count: this test wants some.
    let flags = [
        "--mapping-topic-template",
        topic.as_str(),
        "--skip-delivered",
        "false",
    ];
    let writer = spawn_writer(
        db.connect().await,
        10,
        TOTAL / 10,
        Duration::from_millis(150),
        |_, k| 1 + k % 20,
        30,
    );
    let relay = spawn_run(&db, &kafka, &flags);
    let relay = kill_9_at_random_moments(relay, 2, (400, 600), 0x5eed_a0d1, || {
        spawn_run(&db, &kafka, &flags)
    })
    .await;
    writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, TOTAL).await;
    wait_caught_up(&client).await;
    let mut relay = relay;
    stop(&mut relay).await;

    let (out, report) = audit(&db, &kafka, &topic, &[]);
    assert_eq!(count(&report, "rows"), TOTAL as u64, "{report:#}");
    assert_eq!(count(&report, "delivered"), TOTAL as u64);
    for clean in [
        "missing",
        "unconfirmed",
        "out_of_order",
        "unknown",
        "misrouted",
    ] {
        assert_eq!(count(&report, clean), 0, "{clean}: {report:#}");
    }
    assert_eq!(
        count(&report, "duplicates"),
        duplicates as u64,
        "{report:#}"
    );
    assert_eq!(report["slots_caught_up"], true);
    assert_eq!(
        out.status.code(),
        Some(if duplicates == 0 { 0 } else { 1 }),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The created_at of event `n` in ms (records carry it as their timestamp).
async fn created_ms(client: &Client, n: i64) -> (String, i64) {
    let row = client
        .query_one(
            "SELECT id::text, (extract(epoch FROM created_at) * 1000)::int8 FROM outbox_events
              WHERE (payload->>'n')::int8 = $1",
            &[&n],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

async fn produce(producer: &FutureProducer, topic: &str, key: &str, id: Option<&str>, ms: i64) {
    let mut headers = OwnedHeaders::new();
    if let Some(id) = id {
        headers = headers.insert(Header {
            key: "id",
            value: Some(id),
        });
    }
    producer
        .send(
            FutureRecord::to(topic)
                .key(key)
                .payload("{}")
                .headers(headers)
                .timestamp(ms),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
}

/// Events taken away and records added behind walbox's back, each kind
/// found with its exact count and the exit status 1:
/// - 7 events the slot was moved past while walbox was stopped: missing;
/// - 2 events of one key whose records were written in the other order
///   (by hand, the slot moved past them): 1 out of order;
/// - 3 records with ids no row has (one not even a uuid): unknown; 1
///   without an id: not walbox's;
/// - the first 5 records of partition 0 deleted (`DeleteRecords`): missing,
///   with a warning that the partition was truncated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_finds_each_event_taken_away_and_each_record_no_row_explains() {
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(2).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    insert_events(&client, 0, 100, |_| 10, 10).await;
    expect_all(&kafka, &topic, 100).await;
    wait_caught_up(&client).await;
    stop(&mut relay).await;

    // A clean audit first: the faults below are all it finds.
    let (out, report) = audit(&db, &kafka, &topic, &[]);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(count(&report, "rows"), 100);

    // Lost: written while walbox was stopped, the slot moved past them.
    insert_events(&client, 100, 107, |_| 1, 10).await;
    // Reordered: two events of one key, published by hand in reverse.
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', 'k-order', 'E200', '{\"n\": 200}');
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', 'k-order', 'E201', '{\"n\": 201}');",
        )
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_replication_slot_advance('walbox', pg_current_wal_lsn())")
        .await
        .unwrap();
    let producer: FutureProducer = kafka.client_config().create().unwrap();
    let (id_200, ms_200) = created_ms(&client, 200).await;
    let (id_201, ms_201) = created_ms(&client, 201).await;
    produce(&producer, &topic, "k-order", Some(&id_201), ms_201).await;
    produce(&producer, &topic, "k-order", Some(&id_200), ms_200).await;
    // Unknown: ids no row has, stamped inside the window.
    let now_ms = ms_201;
    for ghost in [
        "00000000-0000-4000-8000-000000000001",
        "00000000-0000-4000-8000-000000000002",
        // Another producer's id, which the uuid column cannot hold.
        "not-a-uuid",
    ] {
        produce(&producer, &topic, "ghost", Some(ghost), now_ms).await;
    }
    produce(&producer, &topic, "foreign", None, now_ms).await;

    // Deleted from the broker: the first 5 records of partition 0.
    let before = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let deleted: HashSet<String> = before
        .iter()
        .filter(|m| m.partition() == 0 && m.offset() < 5)
        .map(|m| walbox_test_harness::kafka::headers_of(m)["id"].clone())
        .collect();
    assert_eq!(deleted.len(), 5);
    let admin: AdminClient<DefaultClientContext> = kafka.client_config().create().unwrap();
    let mut cut = TopicPartitionList::new();
    cut.add_partition_offset(&topic, 0, Offset::Offset(5))
        .unwrap();
    admin
        .delete_records(&cut, &AdminOptions::new())
        .await
        .unwrap();

    let (out, report) = audit(&db, &kafka, &topic, &[]);
    assert_eq!(count(&report, "rows"), 109, "{report:#}");
    assert_eq!(count(&report, "missing"), 7 + 5, "{report:#}");
    assert_eq!(count(&report, "out_of_order"), 1, "{report:#}");
    assert_eq!(count(&report, "unknown"), 3, "{report:#}");
    assert_eq!(count(&report, "duplicates"), 0, "{report:#}");
    assert_eq!(count(&report, "misrouted"), 0, "{report:#}");
    assert_eq!(report["records_without_id"], 1);
    assert_eq!(report["truncated_partitions"][0]["partition"], 0);
    let examples = report["examples"].as_array().unwrap();
    let missing: HashSet<String> = examples
        .iter()
        .filter(|e| e["kind"] == "missing")
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    let lost: HashSet<String> = client
        .query(
            "SELECT id::text FROM outbox_events WHERE (payload->>'n')::int BETWEEN 100 AND 106",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(missing, &lost | &deleted, "{report:#}");
    let reordered = examples
        .iter()
        .find(|e| e["kind"] == "out_of_order")
        .unwrap();
    assert_eq!(reordered["id"], id_200.as_str());
    assert_eq!(reordered["key"], "k-order");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("audit: 16 findings"), "{stderr}");

    // The same report for a person.
    let text = walbox(&db, &["audit"])
        .args(["--kafka-brokers", &kafka.bootstrap()])
        .args(["--mapping-topic-template", &topic, "--last", "1h"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("16 findings:"), "{text}");
    let listed = text
        .lines()
        .filter(|l| l.trim_start().starts_with("missing "))
        .count();
    assert_eq!(listed, 12, "{text}");
    assert!(text.contains("records before it were deleted"), "{text}");
}

/// With walbox stopped, rows written since are in flight, not lost: the
/// audit waits `--wait` for the slot, then counts them as unconfirmed and
/// exits 0, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_slot_has_not_passed_are_unconfirmed_not_missing() {
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(1).await;
    insert_events(&client, 0, 40, |_| 4, 5).await;

    let out = walbox(&db, &["audit"])
        .args(["--kafka-brokers", &kafka.bootstrap()])
        .args([
            "--mapping-topic-template",
            &topic,
            "--last",
            "1h",
            "--wait",
            "1s",
        ])
        .output()
        .unwrap();
    let text = succeeded(&out);
    assert!(text.contains("counted as unconfirmed"), "{text}");
    let (_, report) = audit(&db, &kafka, &topic, &["--wait", "1s"]);
    assert_eq!(count(&report, "unconfirmed"), 40, "{report:#}");
    assert_eq!(count(&report, "missing"), 0);
    assert_eq!(report["slots_caught_up"], false);

    // Once walbox delivered them, they are delivered.
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    expect_all(&kafka, &topic, 40).await;
    wait_caught_up(&client).await;
    stop(&mut relay).await;
    let (out, report) = audit(&db, &kafka, &topic, &[]);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(count(&report, "delivered"), 40);
}

/// Bad arguments exit 2 and an unreachable broker exits 3, each with one
/// line on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_windows_exit_2_and_an_unreachable_broker_exits_3() {
    let db = fresh_db().await;
    init(&db).await;
    let run = |args: &[&str]| {
        let out = walbox(&db, &["audit"]).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr)
    };
    let (code, stderr) = run(&["--kafka-brokers", "127.0.0.1:1", "--since", "yesterday-ish"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("the window"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let (code, stderr) = run(&[
        "--kafka-brokers",
        "127.0.0.1:1",
        "--since",
        "2026-01-02 00:00:00+00",
        "--until",
        "2026-01-01 00:00:00+00",
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("the window is empty"), "{stderr}");
    let (code, stderr) = run(&[
        "--kafka-brokers",
        "127.0.0.1:1",
        "--last",
        "1h",
        "--mapping-timestamp",
        "",
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    let (code, stderr) = run(&["--kafka-brokers", "127.0.0.1:1"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--since") || stderr.contains("--last"),
        "{stderr}"
    );

    // A row to map, so the audit has a topic to read.
    let client = db.connect().await;
    insert_events(&client, 0, 1, |_| 1, 1).await;
    let (code, stderr) = run(&[
        "--kafka-brokers",
        "127.0.0.1:1",
        "--last",
        "1h",
        "--wait",
        "0s",
    ]);
    assert_eq!(code, Some(3), "{stderr}");
    assert!(stderr.starts_with("walbox: audit: kafka:"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

/// A counter's value in a `/metrics` text.
pub(crate) fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in /metrics"))
}

/// Waits until the counter `name` on `/metrics` is at least `least`;
/// returns that `/metrics`.
pub(crate) async fn wait_counter(addr: &str, name: &str, least: f64) -> String {
    wait_for(
        &format!("{name} >= {least}"),
        Duration::from_secs(60),
        || {
            let got = http_get(addr, "/metrics");
            async move {
                match got {
                    Some((200, body)) if counter(&body, name) >= least => Ok(body),
                    other => Err(format!("{:?}", other.map(|(s, _)| s))),
                }
            }
        },
    )
    .await
}

/// The continuous audit (`--audit-interval 1s`) while events flow: events
/// read back are all there at first; once acknowledged records are deleted
/// behind walbox's back (`DeleteRecords` up to each partition's end, every
/// 200 ms), it counts them missing and logs each one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_continuous_audit_counts_acknowledged_events_deleted_from_the_broker() {
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(2).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            &topic,
            "--audit-interval",
            "1s",
            "--metrics-addr",
            ANY_PORT,
        ],
    );
    let addr = metrics_addr(&relay).await;
    let writing = Arc::new(AtomicBool::new(true));
    let writer = {
        let client = db.connect().await;
        let writing = Arc::clone(&writing);
        tokio::spawn(async move {
            let mut n = 0;
            while writing.load(Ordering::Relaxed) {
                insert_events(&client, n, n + 10, |_| 5, 7).await;
                n += 10;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let metrics = wait_counter(&addr, "walbox_audit_checked_total", 3.0).await;
    assert_eq!(
        counter(&metrics, "walbox_audit_missing_total"),
        0.0,
        "{metrics}"
    );
    assert_eq!(counter(&metrics, "walbox_audit_duplicates_total"), 0.0);

    // Behind walbox's back: everything acknowledged is deleted, over and over.
    let deleting = Arc::new(AtomicBool::new(true));
    let deleter = {
        let config = kafka.client_config();
        let topic = topic.clone();
        let deleting = Arc::clone(&deleting);
        tokio::spawn(async move {
            let admin: AdminClient<DefaultClientContext> = config.create().unwrap();
            let ends: rdkafka::consumer::BaseConsumer = config.create().unwrap();
            while deleting.load(Ordering::Relaxed) {
                let mut cut = TopicPartitionList::new();
                for p in 0..2 {
                    let (_, high) = tokio::task::block_in_place(|| {
                        ends.fetch_watermarks(&topic, p, Duration::from_secs(5))
                    })
                    .unwrap();
                    cut.add_partition_offset(&topic, p, Offset::Offset(high))
                        .unwrap();
                }
                let _ = admin.delete_records(&cut, &AdminOptions::new()).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let metrics = wait_counter(&addr, "walbox_audit_missing_total", 1.0).await;
    assert!(counter(&metrics, "walbox_audit_checked_total") >= 4.0);
    deleting.store(false, Ordering::Relaxed);
    writing.store(false, Ordering::Relaxed);
    deleter.await.unwrap();
    writer.await.unwrap();
    wait_caught_up(&client).await;
    let log = stop(&mut relay).await;
    assert!(
        log.contains("audit: an event the broker acknowledged is gone from it: below the partition's first offset"),
        "{log}"
    );
}
