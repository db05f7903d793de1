//! What only a real broker can show, on Apache Kafka itself (KRaft, the
//! jars scripts/install-kafka resolves; `WALBOX_KAFKA_LIBS`): transaction
//! markers and `read_committed` isolation, fencing of a zombie producer,
//! and the Java client's partitioner. Each test starts its own cluster
//! (about 4 s for one node).

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::message::Message;
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::kafka::consume_uncommitted_until_quiet;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least};

use crate::support::*;

/// A cluster of `nodes` nodes, started off the async workers.
fn cluster(nodes: usize) -> KafkaCluster {
    tokio::task::block_in_place(|| KafkaCluster::start(nodes))
}

/// A progress topic as walbox requires it on a real broker: compacted.
async fn progress_topic(kafka: &walbox_test_harness::kafka::TestKafka) -> String {
    kafka
        .create_topic_configured(1, 1, &[("cleanup.policy", "compact")])
        .await
}

/// The flags of an exactly-once run writing to `topic`, progress to `progress`.
fn exactly_once<'a>(topic: &'a str, progress: &'a str) -> Vec<&'a str> {
    vec![
        "--mapping-topic-template",
        topic,
        "--delivery",
        "exactly-once",
        "--transactions-progress-topic",
        progress,
    ]
}

/// 20,000 events in Postgres transactions of 1 to 50 events over 100 keys,
/// walbox killed with SIGKILL five times while they stream: a
/// `read_committed` consumer sees every event exactly once, each key's
/// events in commit order, and the slot is confirmed to the end. What the
/// killed instances left in open transactions is on the log (a
/// `read_uncommitted` consumer sees it) and hidden by Kafka's abort markers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_five_times_leaves_every_event_exactly_once_for_read_committed_consumers() {
    const TOTAL: usize = 20_000;
    let kafka_cluster = cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let progress = progress_topic(&kafka).await;
    let mut flags = exactly_once(&topic, &progress);
    flags.extend(["--transactions-max-events", "500"]);

    let writer = spawn_writer(
        db.connect().await,
        40,
        TOTAL / 40,
        Duration::from_millis(100),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 50,
        100,
    );
    for _ in 0..5 {
        let mut relay = spawn_run(&db, &kafka, &flags);
        wait_log(&relay, "streaming from the slot").await;
        tokio::time::sleep(Duration::from_millis(700)).await; // let it stream a while
        signal(&relay, "-KILL");
        wait_exit(&mut relay).await;
    }
    writer.await.unwrap();
    let mut relay = spawn_run(&db, &kafka, &flags);
    let duplicates = expect_all(&kafka, &topic, TOTAL).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let on_the_log = consume_uncommitted_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let log = relay.log();
    eprintln!(
        "{TOTAL} events through 5 kill -9s: {} records on the log, {duplicates} duplicates for read_committed",
        on_the_log.len()
    );
    assert_eq!(
        duplicates, 0,
        "a read_committed consumer saw {duplicates} events twice\n{log}"
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success(), "{}", relay.log());
}
