//! Sharded streaming (`shards = N`): the outbox split over N publications
//! with row filters on a hash of the aggregate id, one slot and one walbox
//! process per shard (Postgres 15+).

use std::time::Duration;

use walbox_test_harness::kafka::{consume_n, consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{fresh_db, server_version_num, TestDb};

use crate::support::{
    expect_all, http_get, insert_events, metrics_addr, n_of, signal, sigterm, spawn_run,
    spawn_writer, stop, succeeded, wait_exit, wait_http, wait_log, walbox, Relay, ANY_PORT,
};

const SHARDS: usize = 4;

/// Shard `i`'s process, publishing to `topic`, with its metrics on a free
/// port; returns it and that endpoint's address.
async fn shard(db: &TestDb, kafka: &TestKafka, topic: &str, i: usize) -> (Relay, String) {
    shard_of(db, kafka, topic, i, SHARDS, &[]).await
}

/// Shard `i` of `count`, with `extra` flags.
async fn shard_of(
    db: &TestDb,
    kafka: &TestKafka,
    topic: &str,
    i: usize,
    count: usize,
    extra: &[&str],
) -> (Relay, String) {
    let (count, i) = (count.to_string(), i.to_string());
    let mut args = vec![
        "--shards",
        &count,
        "--shard",
        &i,
        "--mapping-topic-template",
        topic,
        "--metrics-addr",
        ANY_PORT,
    ];
    args.extend(extra);
    let relay = spawn_run(db, kafka, &args);
    let addr = metrics_addr(&relay).await;
    (relay, addr)
}

/// Events a process published, from its metrics.
fn published(addr: &str) -> u64 {
    let (_, body) = http_get(addr, "/metrics").expect("metrics answer");
    body.lines()
        .filter(|l| l.starts_with("walbox_events_published_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_shards_deliver_every_event_in_key_order_through_kill_9_and_a_standby_takeover() {
    let db = fresh_db().await;
    let client = db.connect().await;
    if server_version_num(&client).await < 150_000 {
        // Row filters are Postgres 15's: init-slot says so (checked below).
        let out = walbox(&db, &["init-slot", "--shards", "4"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("Postgres 15"),
            "{err}"
        );
        eprintln!("sharding needs Postgres 15: the refusal was checked, the rest skipped");
        return;
    }
    apply_migrations(&client).await;
    let out = succeeded(
        &walbox(&db, &["init-slot", "--shards", "4"])
            .output()
            .unwrap(),
    );
    for i in 0..SHARDS {
        assert!(
            out.contains(&format!("slot \"walbox_{i}\": created")),
            "{out}"
        );
    }
    // Run again: idempotent, each shard's filter recognised.
    let again = succeeded(
        &walbox(&db, &["init-slot", "--shards", "4"])
            .output()
            .unwrap(),
    );
    assert_eq!(
        again.matches("already present").count(),
        2 * SHARDS,
        "{again}"
    );

    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let mut shards: Vec<(Relay, String)> = Vec::new();
    for i in 0..SHARDS {
        shards.push(shard(&db, &kafka, &topic, i).await);
    }
    for (relay, _) in &shards {
        wait_log(relay, "streaming from the slot").await;
    }
    // Shard 2's standby: a second process for the same shard.
    let (mut standby, standby_addr) = shard(&db, &kafka, &topic, 2).await;
    wait_http(&standby_addr, "/readyz?standby=ready", 200).await;

    // `status` shows every shard, each covered by its own filter.
    let status = succeeded(
        &walbox(&db, &["status", "--shards", "4", "--json"])
            .output()
            .unwrap(),
    );
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    let every = status["shards"].as_array().expect("one entry per shard");
    assert_eq!(every.len(), SHARDS);
    for (i, s) in every.iter().enumerate() {
        assert_eq!(s["slot"], format!("walbox_{i}"));
        assert_eq!(s["publication"], format!("walbox_outbox_{i}"));
        assert_eq!(s["shard"], format!("{i} of 4"));
        assert_eq!(s["publication_covers"], true, "{s}");
        assert_eq!(s["active"], true, "{s}");
    }

    let total = 8_000;
    let writer = spawn_writer(
        db.connect().await,
        80,
        100,
        Duration::from_millis(25),
        |_, k| 1 + k % 7,
        200,
    );
    // kill -9 of shard 1's process, restarted; kill -9 of shard 2's
    // active process, whose standby takes over.
    tokio::time::sleep(Duration::from_millis(500)).await;
    signal(&shards[1].0, "-KILL");
    shards[1].0.wait();
    shards[1] = shard(&db, &kafka, &topic, 1).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    signal(&shards[2].0, "-KILL");
    shards[2].0.wait();
    wait_http(&standby_addr, "/readyz", 200).await;
    assert!(
        !writer.is_finished(),
        "the kills and the takeover happen while events flow"
    );
    writer.await.unwrap();

    // Every event at least once, per-key order of first arrivals kept.
    let duplicates = expect_all(&kafka, &topic, total).await;
    // Every shard carried a share (200 aggregates over 4 shards).
    let shares: Vec<u64> = [0, 3]
        .iter()
        .map(|&i| published(&shards[i].1))
        .chain([published(&standby_addr)])
        .collect();
    assert!(shares.iter().all(|&n| n > 0), "shares {shares:?}");
    eprintln!("{total} events over {SHARDS} shards through a kill -9 and a takeover; {duplicates} duplicates; shares of shards 0, 3 and 2's standby: {shares:?}");

    for i in [0, 1, 3] {
        stop(&mut shards[i].0).await;
    }
    sigterm(&standby);
    assert!(wait_exit(&mut standby).await.0.success());
}

/// A row whose aggregate id is NULL (in a table that allows it) or empty is
/// an unmappable event, sharded or not: one shard owns both and
/// dead-letters them, as an unsharded walbox would. (Under the filter of
/// earlier releases a NULL id made the filter NULL, and Postgres published
/// the row to no shard: it was never sent anywhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn null_and_empty_aggregate_ids_are_dead_lettered_by_exactly_one_shard() {
    let db = fresh_db().await;
    let client = db.connect().await;
    if server_version_num(&client).await < 150_000 {
        eprintln!("sharding needs Postgres 15: skipped");
        return;
    }
    apply_migrations(&client).await;
    client
        .batch_execute("ALTER TABLE outbox_events ALTER COLUMN aggregate_id DROP NOT NULL")
        .await
        .unwrap();
    succeeded(
        &walbox(&db, &["init-slot", "--shards", "2"])
            .output()
            .unwrap(),
    );
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let dead = kafka.create_topic(1).await;
    let mut shards = Vec::new();
    for i in 0..2 {
        let (relay, _) = shard_of(&db, &kafka, &topic, i, 2, &["--dead-letter-topic", &dead]).await;
        wait_log(&relay, "streaming from the slot").await;
        shards.push(relay);
    }
    insert_events(&client, 0, 50, |_| 5, 10).await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('order', NULL, 'E50', '{\"n\": 50}'), ('order', '', 'E51', '{\"n\": 51}')",
        )
        .await
        .unwrap();
    insert_events(&client, 52, 100, |_| 5, 10).await;
    let good = consume_n(&kafka, &topic, 98, Duration::from_secs(60))
        .await
        .unwrap();
    let mut ns: Vec<i64> = good.iter().map(n_of).collect();
    ns.sort_unstable();
    let expected: Vec<i64> = (0..100).filter(|n| *n != 50 && *n != 51).collect();
    assert_eq!(ns, expected, "every mappable event once, on its topic");
    let dead_letters = consume_n(&kafka, &dead, 2, Duration::from_secs(30))
        .await
        .unwrap();
    let mut errors: Vec<(i64, String)> = dead_letters
        .iter()
        .map(|m| (n_of(m), headers_of(m)["walbox.error"].clone()))
        .collect();
    errors.sort();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_eq!(errors[0].0, 50);
    assert!(errors[0].1.contains("is NULL"), "{errors:?}");
    assert_eq!(errors[1].0, 51);
    assert!(errors[1].1.contains("aggregate id is empty"), "{errors:?}");
    // Exactly one shard owned them: nothing more arrives.
    let all = consume_until_quiet(
        &kafka,
        &dead,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(all.len(), 2, "a NULL or empty id dead-lettered twice");
    for relay in &mut shards {
        stop(relay).await;
    }
}

#[tokio::test]
async fn shard_settings_are_checked_and_a_wrong_filter_stops_the_shard() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let refuse = |args: &[&str], needle: &str| {
        let out = walbox(&db, args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    };
    refuse(
        &["run", "--shards", "4", "--kafka-brokers", "127.0.0.1:1"],
        "--shard 0 to 3",
    );
    refuse(
        &["status", "--shards", "4", "--shard", "4"],
        "not one of the 4 shards",
    );
    refuse(&["status", "--shards", "0"], "shards: 0");
    refuse(&["status", "--shard", "1"], "shards is 1");
    refuse(
        &["status", "--shards", "2", "--source", "messages"],
        "source = table",
    );
    if server_version_num(&client).await < 150_000 {
        return;
    }
    succeeded(
        &walbox(&db, &["init-slot", "--shards", "2"])
            .output()
            .unwrap(),
    );
    // A shard's publication with another shard's filter is drift: init-slot
    // and status say so, with the fix.
    client
        .batch_execute(
            "ALTER PUBLICATION walbox_outbox_1 SET TABLE outbox_events
               WHERE ((hashtext(aggregate_id) & 2147483647) % 2 = 0)",
        )
        .await
        .unwrap();
    refuse(&["init-slot", "--shards", "2"], "not shard 1 of 2's");
    // The same tokens as shard 1's filter, without its parentheses: `%`
    // binds before `&`, so it selects other rows, and is not shard 1's.
    client
        .batch_execute(
            "ALTER PUBLICATION walbox_outbox_1 SET TABLE outbox_events
               WHERE (hashtext(COALESCE(aggregate_id::text, '')) & 2147483647 % 2 = 1)",
        )
        .await
        .unwrap();
    refuse(&["init-slot", "--shards", "2"], "not shard 1 of 2's");
    let status = succeeded(
        &walbox(&db, &["status", "--shards", "2", "--shard", "1", "--json"])
            .output()
            .unwrap(),
    );
    let status: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(status["publication_covers"], false, "{status}");
    assert!(
        status["publication_problem"]
            .as_str()
            .unwrap()
            .contains("% 2 = 1"),
        "{status}"
    );
}
