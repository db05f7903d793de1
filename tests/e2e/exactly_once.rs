//! `delivery = "exactly-once"` end to end: the walbox binary, a private
//! Postgres, and librdkafka's MockCluster (the transaction protocol), or
//! Apache Kafka whose transaction coordinator cannot start (a broker that
//! runs no transactions). What only a real broker shows is in
//! `apache_kafka.rs`.
//!
//! The MockCluster speaks the transaction protocol but keeps no
//! transaction state in its logs: it writes no commit or abort markers and
//! serves what an aborted transaction wrote to every consumer. So these
//! tests prove what does not depend on the broker's isolation: that walbox
//! runs the protocol, that its progress record cuts what Postgres re-sends
//! (nothing committed is written twice, even when the slot went back), and
//! how much a kill -9 leaves in aborted transactions. What a
//! `read_committed` consumer sees across aborts and takeovers is proven
//! against the relay's fake broker, which keeps Kafka's promises
//! (`crates/walbox/src/relay/tests_exactly_once.rs`).

use std::process::Command;
use std::time::Duration;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::slot::{confirmed_flush_lsn, current_wal_lsn, wait_confirmed_at_least};

use crate::support::*;

/// The flags of an exactly-once run writing to `topic`, progress to `progress`.
fn exactly_once_flags<'a>(topic: &'a str, progress: &'a str) -> Vec<&'a str> {
    vec![
        "--mapping-topic-template",
        topic,
        "--delivery",
        "exactly-once",
        "--transactions-progress-topic",
        progress,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_committed_is_written_twice_when_walbox_and_postgres_restart() {
    let (server, url, client) = private_outbox().await;
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(3).await;
    let progress = kafka.create_topic(1).await;
    let flags = exactly_once_flags(&topic, &progress);
    let run = |kafka: &TestKafka| {
        let mut command = Command::new(walbox_e2e::walbox_bin());
        command.env("WALBOX_PG_URL", &url).env("WALBOX_LOG", "info");
        spawn_run_with(command, kafka, &flags)
    };

    let mut relay = run(&kafka);
    insert_events(&client, 0, 300, |k| 1 + k % 20, 7).await;
    assert_eq!(expect_all(&kafka, &topic, 300).await, 0);
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    let log = stop(&mut relay).await;
    assert!(log.contains("delivery: exactly-once"), "{log}");

    // A crash of Postgres: the slot goes back to the last checkpoint, and
    // Postgres will send all 300 events again.
    drop(client);
    let (_server, client) = crash_and_restart(server).await; // held to the end: dropping it stops Postgres
    let slot = confirmed_flush_lsn(&client, "walbox").await.unwrap();
    let version = walbox_test_harness::pg::server_version_num(&client).await;
    // Postgres 17 saves the slot when its walsender exits (walbox stopped
    // first): there the slot stays, and this checks only that nothing repeats.
    if version < 170_000 {
        assert!(
            slot < head,
            "the slot went back to {slot}, before {head} (else this test proves nothing)"
        );
    }

    let mut relay = run(&kafka);
    insert_events(&client, 300, 400, |k| 1 + k % 20, 7).await;
    let duplicates = expect_all(&kafka, &topic, 400).await;
    let log = relay.log();
    assert!(
        log.contains("resuming after the committed progress"),
        "{log}"
    );
    assert_eq!(
        duplicates, 0,
        "Postgres re-sent what Kafka had committed; walbox skipped it\n{log}"
    );
    assert!(!log.contains("ERROR"), "{log}");
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

/// The progress record counts rows and messages alike: after a Postgres
/// crash re-sends transactions that mix them, split across Kafka
/// transactions of 7 events, nothing Kafka committed is written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_committed_are_not_written_twice_when_postgres_restarts() {
    use crate::messages::{write_events, Writes};
    let (server, url, client) = private_outbox_with(&["--source", "both"]).await;
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(3).await;
    let progress = kafka.create_topic(1).await;
    let mut flags = exactly_once_flags(&topic, &progress);
    flags.extend(["--source", "both", "--transactions-max-events", "7"]);
    let run = |kafka: &TestKafka| {
        let mut command = Command::new(walbox_e2e::walbox_bin());
        command.env("WALBOX_PG_URL", &url).env("WALBOX_LOG", "info");
        spawn_run_with(command, kafka, &flags)
    };
    let mut relay = run(&kafka);
    write_events(&client, 0, 300, |k| 1 + k % 20, 7, Writes::Both).await;
    assert_eq!(expect_all(&kafka, &topic, 300).await, 0);
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    stop(&mut relay).await;

    drop(client);
    let (_server, client) = crash_and_restart(server).await; // held to the end: dropping it stops Postgres
    let slot = confirmed_flush_lsn(&client, "walbox").await.unwrap();
    if walbox_test_harness::pg::server_version_num(&client).await < 170_000 {
        assert!(slot < head, "the slot went back to {slot}, before {head}");
    }
    let mut relay = run(&kafka);
    write_events(&client, 300, 400, |k| 1 + k % 20, 7, Writes::Both).await;
    let duplicates = expect_all(&kafka, &topic, 400).await;
    let log = relay.log();
    assert!(
        log.contains("resuming after the committed progress"),
        "{log}"
    );
    assert_eq!(duplicates, 0, "{log}");
    stop(&mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_five_times_loses_nothing_and_repeats_only_aborted_transactions() {
    const TOTAL: usize = 50_000;
    const MAX_EVENTS: usize = 500;
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(3).await;
    let progress = kafka.create_topic(1).await;
    let max_events = MAX_EVENTS.to_string();
    let mut flags = exactly_once_flags(&topic, &progress);
    flags.extend(["--transactions-max-events", &max_events]);

    let writer = spawn_writer(
        db.connect().await,
        50,
        TOTAL / 50,
        Duration::from_millis(100),
        |_, k| 1 + k % 50,
        97,
    );
    let kills = 5;
    kill_9_while_streaming(&db, &kafka, &flags, kills).await;
    writer.await.unwrap();
    let mut relay = spawn_run(&db, &kafka, &flags);
    let duplicates = expect_all_logged(&kafka, &topic, TOTAL, &relay).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    eprintln!(
        "{TOTAL} events through {kills} kill -9s in exactly-once mode: {duplicates} records of aborted transactions (visible on the MockCluster, which keeps no markers)"
    );
    // Each kill leaves at most one open transaction behind; a broker with
    // markers hides it from read_committed consumers.
    assert!(
        duplicates <= kills * MAX_EVENTS,
        "{duplicates} repeated records: more than {kills} open transactions of {MAX_EVENTS}"
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_without_transactions_is_refused_in_one_line() {
    // One broker whose transaction state topic wants three replicas: its
    // transaction coordinator never becomes available.
    let broker = tokio::task::block_in_place(|| {
        walbox_test_harness::apache_kafka::KafkaCluster::start_with(
            1,
            &[("transaction.state.log.replication.factor", "3")],
        )
    });
    let kafka = broker.kafka();
    wait_broker(&kafka).await;
    let topic = kafka.create_topic(1).await;
    // walbox creates it, compacted.
    let progress = format!("{topic}-progress");
    let db = fresh_db().await;
    let client = init(&db).await;
    insert_events(&client, 0, 10, |_| 10, 1).await;
    let started = std::time::Instant::now();
    let mut relay = spawn_run(&db, &kafka, &exactly_once_flags(&topic, &progress));
    let (status, log) = wait_exit(&mut relay).await;
    assert!(!status.success(), "{log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.contains("exactly-once") && last.contains("transactions"),
        "one line naming the problem, got: {last}\n{log}"
    );
    assert!(
        last.contains("at-least-once"),
        "says what to do instead: {last}"
    );
    eprintln!("refused in {:?}: {last}", started.elapsed());
    assert!(
        !log.contains("streaming from the slot"),
        "refused before streaming a single event\n{log}"
    );
    let slot = confirmed_flush_lsn(&client, "walbox").await.unwrap();
    let head = current_wal_lsn(&client).await;
    assert!(slot < head, "nothing confirmed: the slot is at {slot}");
}

/// The value of the metric line starting with `name ` in `metrics`.
fn metric(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from\n{metrics}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_errors_inside_a_transaction_abort_it_and_the_stream_goes_on() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::mock(3);
    let topic = kafka.create_topic(3).await;
    let progress = kafka.create_topic(1).await;
    let dead = kafka.create_topic(1).await;
    let mut flags = exactly_once_flags(&topic, &progress);
    flags.extend(["--metrics-addr", ANY_PORT, "--dead-letter-topic", &dead]);
    let mut relay = spawn_run(&db, &kafka, &flags);
    let addr = metrics_addr(&relay).await;
    insert_events(&client, 0, 100, |k| 1 + k % 10, 5).await;
    assert_eq!(expect_all(&kafka, &topic, 100).await, 0);
    let mock = kafka.mock_cluster().expect("a mock");

    // The coordinator loses the producer id at a commit: the transaction
    // must be aborted (librdkafka bumps the epoch), then written again.
    mock.request_errors(
        RDKafkaApiKey::EndTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_PRODUCER_ID],
    );
    insert_events(&client, 100, 200, |k| 1 + k % 10, 5).await;
    expect_all(&kafka, &topic, 200).await;
    let (_, metrics) = http_get(&addr, "/metrics").expect("metrics");
    assert!(
        metric(&metrics, "walbox_transactions_aborted_total") >= 1.0,
        "{metrics}\n{}",
        relay.log()
    );

    // A produce request refused for good inside a transaction: aborted, and
    // on the replay its events go to the dead-letter topic.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    insert_events(&client, 200, 300, |k| 1 + k % 10, 5).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let (_, metrics) = http_get(&addr, "/metrics").expect("metrics");
    let dead_lettered: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("walbox_events_dead_lettered_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(dead_lettered >= 1.0, "{metrics}\n{}", relay.log());
    assert!(
        metric(&metrics, "walbox_transactions_aborted_total") >= 2.0,
        "{metrics}"
    );
    assert!(relay.running(), "walbox kept streaming\n{}", relay.log());
    eprintln!(
        "exactly-once under injected broker errors: {} transactions committed, {} aborted, {dead_lettered} events dead-lettered",
        metric(&metrics, "walbox_transactions_committed_total"),
        metric(&metrics, "walbox_transactions_aborted_total"),
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}
