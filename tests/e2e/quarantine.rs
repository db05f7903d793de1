//! `on_failure = "quarantine"` on Apache Kafka (its own one-node cluster):
//! the broker refuses the events of three aggregates for good (the topic's
//! `max.message.bytes`, which only the broker knows) while 197 others flow;
//! after the fix, `walbox quarantine release` republishes the held events
//! in order, before the newer events of their aggregates, also across a
//! kill -9 in the middle of a release.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::Message;
use walbox_test_harness::kafka::{consume_until_quiet, TestKafka};
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const AGGREGATES: i64 = 200;
/// The aggregates whose events the broker refuses from `REFUSED_FROM` on.
const REFUSED: [i64; 3] = [7, 77, 177];
const REFUSED_FROM: i64 = 5_000;
const TOTAL: i64 = 20_000;

/// Inserts events `from..to` in transactions of 1,000 (key `agg-{n % 200}`,
/// payload `{"n": n, "pad": …}`); when `big`, the refused aggregates'
/// events from `REFUSED_FROM` on carry 150 KB of random hex, which the
/// topic refuses (compression cannot bring it under 64 KiB).
async fn insert(client: &tokio_postgres::Client, from: i64, to: i64, big: bool) {
    let mut n = from;
    while n < to {
        let end = (n + 1_000).min(to);
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'agg-' || (n % $3), 'E' || n, \
                        jsonb_build_object('n', n, 'pad', CASE WHEN $4 AND n >= $5 AND (n % $3) = ANY($6) THEN \
                            (SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, 4800) g) \
                            ELSE '' END) \
                 FROM generate_series($1::int8, $2::int8 - 1) n",
                &[&n, &end, &AGGREGATES, &big, &REFUSED_FROM, &REFUSED.to_vec()],
            )
            .await
            .unwrap();
        n = end;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_refused_aggregates_are_held_while_the_rest_flow_and_released_in_order() {
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka
        .create_topic_configured(3, 1, &[("max.message.bytes", "65536")])
        .await;
    // Batches of small records stay well under the topic's limit.
    let flags = [
        "--mapping-topic-template",
        &topic,
        "--on-failure",
        "quarantine",
        "--kafka-property",
        "batch.size=16384",
        "--metrics-addr",
        ANY_PORT,
    ];
    let start = || spawn_run(&db, &kafka, &flags);
    let mut relay = start();
    let addr = metrics_addr(&relay).await;
    wait_log(&relay, "streaming from the slot").await;
    insert(&client, 0, TOTAL, true).await;
    let written = current_wal_lsn(&client).await;

    // Every other aggregate's events arrive, in order; the slot passes the
    // held ones.
    let held_per_key = (REFUSED_FROM..TOTAL)
        .filter(|n| n % AGGREGATES == 7)
        .count();
    let flowing = TOTAL as usize - REFUSED.len() * held_per_key;
    let refused = |n: i64| REFUSED.contains(&(n % AGGREGATES)) && n >= REFUSED_FROM;
    let messages = wait_distinct(&kafka, &topic, flowing, n_of).await;
    assert!(
        messages.iter().all(|m| !refused(n_of(m))),
        "a refused event reached the topic"
    );
    wait_confirmed_at_least(&client, "walbox", written, Duration::from_secs(60)).await;
    wait_for("the quarantine's gauges", Duration::from_secs(10), || {
        let (keys, events) = (
            metric_at(&addr, "walbox_quarantined_aggregates"),
            metric_at(&addr, "walbox_quarantined_events"),
        );
        async move {
            if keys == 3.0 && events == (3 * held_per_key) as f64 {
                Ok(())
            } else {
                Err(format!("{keys} aggregates, {events} events"))
            }
        }
    })
    .await;
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&quarantine(&db, &["list", "--json"])).unwrap();
    let mut keys: Vec<&str> = listed.iter().map(|l| l["key"].as_str().unwrap()).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["agg-177", "agg-7", "agg-77"]);
    assert!(
        listed
            .iter()
            .all(|l| l["events"] == held_per_key
                && l["error"].as_str().unwrap().contains("too large"))
    );

    let shown = quarantine(&db, &["show", "agg-7", "--limit", "3"]);
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.len(), 3, "{shown}");
    // The first is the refusal that held the aggregate. Each later one was
    // either in flight already, and refused by the broker too, or not yet
    // sent, and held behind it: which depends on when the broker's answer
    // came, and both are right.
    assert!(
        lines[0].contains("refused: ") && lines[0].contains("too large"),
        "{shown}"
    );
    assert!(
        lines.iter().all(|l| l.contains(&topic)
            && (l.contains("refused: ") || l.contains("held: held behind an earlier event"))),
        "{shown}"
    );
    let status = succeeded(&walbox(&db, &["status"]).output().unwrap());
    assert!(
        status.contains(&format!("3 aggregates, {} events held", 3 * held_per_key)),
        "{status}"
    );

    // New events of the held aggregates join them; a release before the
    // fix fails and leaves them held.
    insert(&client, TOTAL, TOTAL + 1_000, false).await;
    let out = walbox(&db, &["quarantine", "release", "agg-7"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("release of \"agg-7\" failed"), "{stderr}");

    // The fix, then the releases: one waited for, one interrupted by kill -9.
    let admin: AdminClient<DefaultClientContext> = kafka.client_config().create().unwrap();
    let fix =
        AlterConfig::new(ResourceSpecifier::Topic(&topic)).set("max.message.bytes", "1048588");
    let results = admin
        .alter_configs(&[fix], &AdminOptions::new())
        .await
        .unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    quarantine(&db, &["release", "agg-7"]);
    // kill -9 once the broker acknowledged agg-77's batch, before its held
    // events are deleted: the next start releases them again, in order.
    stop(&mut relay).await;
    let mut paused = walbox(&db, &[]);
    paused.env("WALBOX_TEST_PAUSE_AT", "quarantine.acked");
    relay = spawn_run_with(paused, &kafka, &flags);
    quarantine(&db, &["release", "agg-77", "--wait", "0"]);
    wait_log(&relay, "paused at test point quarantine.acked").await;
    relay.kill9();
    relay = start();
    quarantine(&db, &["release", "agg-77"]);
    quarantine(&db, &["release", "agg-177"]);
    let listed = quarantine(&db, &["list"]);
    assert!(listed.contains("nothing held"), "{listed}");

    // Their aggregates flow again, after their held events.
    insert(&client, TOTAL + 1_000, TOTAL + 2_000, false).await;
    let duplicates = expect_all(&kafka, &topic, (TOTAL + 2_000) as usize).await;
    eprintln!("{duplicates} duplicates (the release interrupted by kill -9)");
    assert_eq!(
        duplicates,
        held_per_key + 5,
        "agg-77's batch (its 75 held events and 5 behind them) twice, nothing else"
    );
    let all = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    for key in REFUSED {
        let key = format!("agg-{key}");
        let mut firsts = Vec::new();
        let mut sorted: Vec<_> = all
            .iter()
            .filter(|m| m.key() == Some(key.as_bytes()))
            .collect();
        sorted.sort_by_key(|m| m.offset());
        for m in sorted {
            if !firsts.contains(&n_of(m)) {
                firsts.push(n_of(m));
            }
        }
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{key}: {firsts:?}");
    }
    stop(&mut relay).await;
}

/// An unmappable row (its headers column sets a header walbox sets itself)
/// is held under its aggregate with the payload as stored; fixed with SQL
/// on walbox.quarantine, it is released first, then the event held behind
/// it. Real Postgres, any broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmappable_row_is_held_fixed_with_sql_and_released_in_order() {
    let kafka = TestKafka::from_env();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            &topic,
            "--on-failure",
            "quarantine",
        ],
    );
    wait_log(&relay, "streaming from the slot").await;
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
               ('order', 'a', 'E0', '{\"n\": 0}', '{}'),
               ('order', 'b', 'E1', '{\"n\": 1}', '{\"walbox.error\": \"mine\"}'),
               ('order', 'b', 'E2', '{\"n\": 2}', '{}'),
               ('order', 'a', 'E3', '{\"n\": 3}', '{}')",
        )
        .await
        .unwrap();
    let flowing = wait_distinct(&kafka, &topic, 2, n_of).await;
    assert!(flowing.iter().all(|m| m.key() == Some(&b"a"[..])));
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&quarantine(&db, &["list", "--json"])).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["key"], "b");
    assert_eq!(listed[0]["events"], 2);
    assert!(
        listed[0]["error"]
            .as_str()
            .unwrap()
            .contains("a header walbox sets itself"),
        "{listed:?}"
    );
    let fixed = client
        .execute(
            "UPDATE walbox.quarantine SET value = convert_to('{\"n\": 1, \"fixed\": true}', 'UTF8') \
             WHERE slot = 'walbox' AND kind = 'unmappable'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(fixed, 1);
    quarantine(&db, &["release", "b"]);
    let all = wait_distinct(&kafka, &topic, 4, n_of).await;
    let b: Vec<serde_json::Value> = all
        .iter()
        .filter(|m| m.key() == Some(&b"b"[..]))
        .map(|m| serde_json::from_slice(m.payload().unwrap()).unwrap())
        .collect();
    assert_eq!(b[0]["n"], 1);
    assert_eq!(b[0]["fixed"], true, "the value as fixed in SQL");
    assert_eq!(b[1]["n"], 2);
    stop(&mut relay).await;
}
