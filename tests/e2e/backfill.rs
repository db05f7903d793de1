//! `walbox init-slot --backfill`: switching over from a polling relay. A
//! legacy outbox holds rows the old relay published (`published_at` set)
//! and rows it did not; a writer keeps inserting throughout. After the
//! backfill and `walbox run`, every unpublished and every new row arrives
//! once, in per-aggregate order, and no published one arrives.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rdkafka::message::Message;
use tokio_postgres::Client;
use walbox_test_harness::kafka::{consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{fresh_db, TestDb};
use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const AGGREGATES: i64 = 13;

/// The legacy outbox: walbox's table plus the polling relay's
/// `published_at`; its ordering sequence is the `seq` the migrations add
/// (a table that has its own `seq` keeps it: migration 0004 adds the
/// column only if it is missing).
async fn legacy_outbox(db: &TestDb) -> Client {
    let client = db.connect().await;
    apply_migrations(&client).await;
    client
        .batch_execute("ALTER TABLE outbox_events ADD COLUMN published_at timestamptz")
        .await
        .unwrap();
    client
}

/// Rows `from..to` (payload `n`, key `agg-{n % 13}`) in transactions of
/// up to `tx` rows; `published` marks them as sent by the old relay.
async fn insert(client: &Client, from: i64, to: i64, tx: i64, published: bool) {
    let mut n = from;
    while n < to {
        let end = (n + tx).min(to);
        let values: Vec<String> = (n..end)
            .map(|i| {
                format!(
                    "('order', 'agg-{}', 'E{i}', '{{\"n\": {i}}}', {})",
                    i.rem_euclid(AGGREGATES),
                    if published { "now()" } else { "NULL" }
                )
            })
            .collect();
        client
            .batch_execute(&format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, published_at) VALUES {}",
                values.join(",")
            ))
            .await
            .unwrap();
        n = end;
    }
}

/// Keeps inserting unpublished rows from `from` on, a transaction of 1–7
/// rows every few milliseconds, until told to stop; returns the next `n`.
fn writer(
    db: &TestDb,
    from: i64,
) -> (
    tokio::sync::watch::Sender<bool>,
    tokio::task::JoinHandle<i64>,
) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let config = db.config().clone();
    let task = tokio::spawn(async move {
        let client = walbox_test_harness::pg::connect(&config).await.unwrap();
        let mut n = from;
        let mut k = 0;
        while !*stopped.borrow() {
            let size = 1 + k % 7;
            insert(&client, n, n + size, size, false).await;
            n += size;
            k += 1;
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        n
    });
    (stop, task)
}

fn init_slot_backfill(db: &TestDb, kafka: &TestKafka, topic: &str) -> std::process::Command {
    let mut c = walbox(
        db,
        &[
            "init-slot",
            "--kafka-brokers",
            &kafka.bootstrap(),
            "--mapping-topic-template",
            topic,
            "--backfill",
            "published_at IS NULL",
            "--backfill-order",
            "seq",
        ],
    );
    c.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    c
}

/// Reads `topic` until the events `expected` all arrived; asserts nothing
/// else arrived, per-key order of all arrivals (duplicates included, a
/// duplicate repeats an earlier prefix) and the `id` header; returns the
/// number of duplicates.
async fn expect_exactly(kafka: &TestKafka, topic: &str, expected: &HashSet<i64>) -> usize {
    let messages = wait_for(
        "every event to arrive",
        Duration::from_secs(120),
        || async {
            let messages = consume_until_quiet(
                kafka,
                topic,
                Duration::from_secs(2),
                Duration::from_secs(60),
            )
            .await
            .map_err(|e| e.to_string())?;
            let distinct: HashSet<i64> = messages.iter().map(n_of).collect();
            if expected.is_subset(&distinct) {
                Ok(messages)
            } else {
                Err(format!(
                    "{} of {} events",
                    distinct.intersection(expected).count(),
                    expected.len()
                ))
            }
        },
    )
    .await;
    let mut sorted = messages.clone();
    sorted.sort_by_key(|m| (m.partition(), m.offset()));
    let mut seen = HashSet::new();
    let mut last_first: HashMap<Vec<u8>, i64> = HashMap::new();
    for m in &sorted {
        let n = n_of(m);
        assert!(
            expected.contains(&n),
            "event {n} was published by the old relay, or never written"
        );
        let key = m.key().unwrap().to_vec();
        assert_eq!(
            key,
            format!("agg-{}", n.rem_euclid(AGGREGATES)).into_bytes()
        );
        assert_eq!(
            headers_of(m).get("event_type").map(String::as_str),
            Some(format!("E{n}").as_str())
        );
        assert!(headers_of(m).contains_key("id"));
        if seen.insert(n) {
            let prev = last_first.insert(key, n);
            assert!(
                prev.is_none_or(|p| p < n),
                "per-key order: {n} after {prev:?}"
            );
        }
    }
    messages.len() - seen.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switch_over_from_a_polling_relay_publishes_each_unpublished_row_once() {
    let db = fresh_db().await;
    let client = legacy_outbox(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    insert(&client, -2000, 0, 50, true).await;
    insert(&client, 0, 3000, 50, false).await;

    let (stop_writing, writing) = writer(&db, 3000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = tokio::task::spawn_blocking({
        let mut c = init_slot_backfill(&db, &kafka, &topic);
        move || c.output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("backfill published"), "{stdout}");
    eprintln!("{stderr}");

    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop_writing.send(true).unwrap();
    let end = writing.await.unwrap();
    assert!(
        end > 3100,
        "the writer wrote during the backfill and the run ({end})"
    );
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;

    let expected: HashSet<i64> = (0..end).collect();
    let duplicates = expect_exactly(&kafka, &topic, &expected).await;
    assert_eq!(
        duplicates, 0,
        "nothing is sent by both the backfill and the stream"
    );
    stop(&mut relay).await;

    // Done once: a rerun changes nothing.
    let again = init_slot_backfill(&db, &kafka, &topic).output().unwrap();
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("already present, its backfill done"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_backfill_killed_half_way_is_finished_by_run_and_loses_nothing() {
    let db = fresh_db().await;
    let client = legacy_outbox(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    insert(&client, -500, 0, 100, true).await;
    insert(&client, 0, 60_000, 1000, false).await;

    // Killed once it has published part of the rows.
    // Few events in flight: the backfill takes seconds, and is killed
    // part of the way.
    let mut first = init_slot_backfill(&db, &kafka, &topic)
        .args(["--max-in-flight-events", "50"])
        .spawn()
        .unwrap();
    wait_for(
        "the backfill to publish part of the rows",
        Duration::from_secs(60),
        || {
            let client = &client;
            async move {
                let published: i64 = client
                    .query_opt(
                        "SELECT published FROM walbox.backfills WHERE slot = 'walbox'",
                        &[],
                    )
                    .await
                    .ok()
                    .flatten()
                    .map_or(0, |r| r.get(0));
                if published > 0 {
                    Ok(())
                } else {
                    Err("nothing saved yet".to_owned())
                }
            }
        },
    )
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    let (published, total): (i64, i64) = {
        let r = client
            .query_one(
                "SELECT published, total FROM walbox.backfills WHERE slot = 'walbox'",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    assert_eq!(total, 60_000);
    assert!(
        published < total,
        "killed before it finished (else this proves nothing)"
    );
    let before = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(60),
    )
    .await
    .unwrap()
    .len() as i64;
    assert!(before >= published, "saved only what was delivered");

    // Meanwhile events are written.
    insert(&client, 60_000, 61_000, 10, false).await;
    let status = walbox(&db, &["status"]).output().unwrap();
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&format!(
            "backfill:            unfinished: {published} of 60000"
        )),
        "{status}"
    );

    // `walbox run` finishes the backfill before it streams (a rerun of the
    // same `init-slot --backfill` would too).
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    wait_log(&relay, "finishing the interrupted backfill").await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let expected: HashSet<i64> = (0..61_000).collect();
    let duplicates = expect_exactly(&kafka, &topic, &expected).await;
    // Only what was delivered after the last saved position is sent again.
    eprintln!(
        "kill -9 at {published} of {total} saved, {before} delivered: {duplicates} duplicates"
    );
    assert!(
        duplicates as i64 <= before - published,
        "{duplicates} duplicates"
    );
    let rows_left: i64 = client
        .query_one("SELECT count(*) FROM walbox.backfill_rows", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        rows_left, 0,
        "the copied rows are dropped when the backfill is done"
    );
    stop(&mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_condition_is_one_clear_line_and_the_corrected_rerun_backfills() {
    let db = fresh_db().await;
    let client = legacy_outbox(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    insert(&client, 0, 100, 10, false).await;

    let bad = init_slot_backfill(&db, &kafka, &topic);
    let args: Vec<String> = bad
        .get_args()
        .map(|a| {
            a.to_string_lossy()
                .replace("published_at IS NULL", "publishd_at IS NULL")
        })
        .collect();
    let mut bad_cmd = walbox(&db, &[]);
    bad_cmd.args(&args);
    let out = bad_cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("select the rows to backfill") && last.contains("publishd_at"),
        "{stderr}"
    );

    // The slot it made never streamed: the rerun makes it again.
    let out = init_slot_backfill(&db, &kafka, &topic).output().unwrap();
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("backfill published 100 of 100 events"),
        "{stdout}"
    );
    let expected: HashSet<i64> = (0..100).collect();
    assert_eq!(expect_exactly(&kafka, &topic, &expected).await, 0);
}

/// A new slot streams what commits after it: rows already in the table are
/// said not to be streamed (a Debezium connector with
/// `slot.drop.on.stop=true` leaves exactly this), with the backfill that
/// publishes them; an empty table, or a slot already there, says nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_slot_over_rows_already_in_the_table_says_they_are_not_streamed() {
    let warning = "already holds rows; the new slot streams only what commits from now on";
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let out = walbox(&db, &["init-slot"]).output().unwrap();
    succeeded(&out);
    assert!(!String::from_utf8_lossy(&out.stderr).contains(warning));
    let out = walbox(&db, &["drop-slot"]).output().unwrap();
    succeeded(&out);

    insert_events(&client, 0, 3, |_| 1, 1).await;
    let out = walbox(&db, &["init-slot"]).output().unwrap();
    succeeded(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(warning), "{stderr}");
    assert!(stderr.contains("init-slot --backfill"), "{stderr}");
    // Run again: the slot is there, nothing new to say.
    let out = walbox(&db, &["init-slot"]).output().unwrap();
    succeeded(&out);
    assert!(!String::from_utf8_lossy(&out.stderr).contains(warning));
}
