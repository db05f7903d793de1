//! What only a real broker can show, on Apache Kafka itself (KRaft, the
//! jars scripts/install-kafka resolves; `WALBOX_KAFKA_LIBS`): transaction
//! markers and `read_committed` isolation, fencing of a zombie producer,
//! and the Java client's partitioner. Each test starts its own cluster
//! (about 4 s for one node).

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::message::Message;
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::kafka::{consume_n, consume_uncommitted_until_quiet, consume_until_quiet};
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::slot::{current_wal_lsn, wait_confirmed_at_least};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

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
    let kafka_cluster = kafka_cluster(1);
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
    kill_9_while_streaming(&db, &kafka, &flags, 5).await;
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

/// Kafka's default `auto.create.topics.enable=true`, and a progress topic
/// walbox makes itself: its first start creates it compacted before any
/// metadata request can have the broker auto-create it with
/// `cleanup.policy=delete` (which every restart then refused), and walbox
/// restarts after kill -9 with every event once for `read_committed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_restarts_on_a_broker_that_auto_creates_topics() {
    const TOTAL: usize = 3_000;
    let kafka_cluster = tokio::task::block_in_place(|| {
        KafkaCluster::start_with(1, &[("auto.create.topics.enable", "true")])
    });
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let progress = walbox_test_harness::unique_name("progress");
    let flags = exactly_once(&topic, &progress);

    let writer = spawn_writer(
        db.connect().await,
        30,
        TOTAL / 30,
        Duration::from_millis(100),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 20,
        50,
    );
    kill_9_while_streaming(&db, &kafka, &flags, 3).await;
    writer.await.unwrap();
    let mut relay = spawn_run(&db, &kafka, &flags);
    let duplicates = expect_all(&kafka, &topic, TOTAL).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let log = relay.log();
    assert_eq!(duplicates, 0, "{log}");
    assert!(!log.contains("cleanup.policy=delete"), "{log}");
    let described = kafka_cluster.tool(
        "org.apache.kafka.tools.TopicCommand",
        &[
            "--bootstrap-server",
            &kafka_cluster.bootstrap(),
            "--describe",
            "--topic",
            &progress,
        ],
        b"",
    );
    assert!(described.contains("cleanup.policy=compact"), "{described}");
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success(), "{}", relay.log());
}

/// For 10,000 keys, the partition walbox chose for each key's event is the
/// one Kafka's own Java producer (the console producer, default
/// partitioner) chooses for the same key and partition count: consumers
/// that join walbox's topics with Java-produced ones see one key in one
/// partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_lands_in_the_partition_the_java_producer_chooses() {
    const KEYS: usize = 10_000;
    const PARTITIONS: i32 = 7;
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let by_walbox = kafka.create_topic(PARTITIONS).await;
    let by_java = kafka.create_topic(PARTITIONS).await;

    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &by_walbox]);
    insert_events(&client, 0, KEYS, |_| 500, KEYS).await;
    assert_eq!(expect_all(&kafka, &by_walbox, KEYS).await, 0);
    stop(&mut relay).await;

    let lines: String = (0..KEYS).map(|n| format!("agg-{n}\t{n}\n")).collect();
    tokio::task::block_in_place(|| {
        kafka_cluster.tool(
            "org.apache.kafka.tools.ConsoleProducer",
            &[
                "--bootstrap-server",
                &kafka_cluster.bootstrap(),
                "--topic",
                &by_java,
                "--property",
                "parse.key=true",
                "--property",
                "key.separator=\t",
            ],
            lines.as_bytes(),
        )
    });
    let partitions = |messages: Vec<rdkafka::message::OwnedMessage>| -> HashMap<Vec<u8>, i32> {
        messages
            .into_iter()
            .map(|m| (m.key().unwrap_or_default().to_vec(), m.partition()))
            .collect()
    };
    let java = wait_for_records(&kafka, &by_java, KEYS).await;
    let walbox = partitions(
        consume_until_quiet(
            &kafka,
            &by_walbox,
            Duration::from_secs(2),
            Duration::from_secs(60),
        )
        .await
        .unwrap(),
    );
    let java = partitions(java);
    assert_eq!(java.len(), KEYS);
    let differ: Vec<_> = walbox
        .iter()
        .filter(|(k, p)| java.get(*k) != Some(*p))
        .take(5)
        .map(|(k, p)| (String::from_utf8_lossy(k), p, java.get(k)))
        .collect();
    assert!(
        differ.is_empty(),
        "keys in another partition than Java's (key, walbox's, Java's): {differ:?}"
    );
    let used: std::collections::HashSet<i32> = walbox.values().copied().collect();
    assert_eq!(used.len(), PARTITIONS as usize, "every partition used");
}

/// Every record of `topic` once it holds `count`.
async fn wait_for_records(
    kafka: &walbox_test_harness::kafka::TestKafka,
    topic: &str,
    count: usize,
) -> Vec<rdkafka::message::OwnedMessage> {
    walbox_test_harness::wait::wait_for(
        "the Java producer's records",
        Duration::from_secs(60),
        || async {
            let got = consume_until_quiet(
                kafka,
                topic,
                Duration::from_secs(2),
                Duration::from_secs(30),
            )
            .await
            .map_err(|e| e.to_string())?;
            if got.len() >= count {
                Ok(got)
            } else {
                Err(format!("{} of {count}", got.len()))
            }
        },
    )
    .await
}

/// A zombie: the first instance frozen (SIGSTOP) mid-stream, a second one
/// with the same transactional id takes the slot over and streams, then the
/// first is resumed (SIGCONT). Its producer is fenced: it exits when it
/// writes (or, its session gone first, waits as a standby), and nothing it
/// wrote after the takeover is visible; a `read_committed` consumer sees
/// every event exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_zombie_is_fenced_and_writes_nothing_visible() {
    const TOTAL: usize = 3_000;
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let progress = progress_topic(&kafka).await;
    let flags = exactly_once(&topic, &progress);

    let writer = spawn_writer(
        db.connect().await,
        30,
        TOTAL / 30,
        Duration::from_millis(300),
        |chunk, k| 1 + (chunk + k) % 20,
        50,
    );
    let mut zombie = spawn_run(&db, &kafka, &flags);
    wait_log(&zombie, "streaming from the slot").await;
    tokio::time::sleep(Duration::from_millis(1500)).await; // mid-stream
    signal(&zombie, "-STOP");
    // The slot is free once Postgres' wal_sender_timeout (10 s in tests)
    // ends the frozen instance's walsender.
    let mut successor = spawn_run(&db, &kafka, &flags);
    wait_log(&successor, "streaming from the slot").await;
    tokio::time::sleep(Duration::from_secs(2)).await; // the successor commits a while
    signal(&zombie, "-CONT");
    // Resumed, the zombie either writes (its producer is fenced: it stops),
    // or finds its session gone first (Postgres ended its walsender while
    // it was frozen) and waits as a standby for the slot, writing nothing;
    // its producer stays fenced should it ever take the slot over.
    let outcome = wait_for(
        "the zombie to stop or stand by",
        Duration::from_secs(40),
        || {
            let exited = zombie.try_exit();
            let standby = zombie.log().contains("waiting as a standby");
            async move {
                match (exited, standby) {
                    (Some(status), _) => Ok(Some(status)),
                    (None, true) => Ok(None),
                    (None, false) => Err("running".to_owned()),
                }
            }
        },
    )
    .await;
    let fenced = outcome.is_some();
    if let Some(status) = outcome {
        assert!(
            !status.success(),
            "the zombie exited cleanly\n{}",
            zombie.log()
        );
    } else {
        sigterm(&zombie);
        assert!(wait_exit(&mut zombie).await.0.success(), "{}", zombie.log());
    }
    let zombie_log = zombie.log();
    writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, TOTAL).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let last = zombie_log
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default()
        .to_owned();
    assert!(
        !fenced || (last.contains("was fenced off") && last.contains("another walbox instance")),
        "the zombie's last line does not say it was fenced off: {last}"
    );
    assert_eq!(
        duplicates,
        0,
        "read_committed saw {duplicates} events twice\nzombie:\n{zombie_log}\nsuccessor:\n{}",
        successor.log()
    );
    sigterm(&successor);
    assert!(
        wait_exit(&mut successor).await.0.success(),
        "{}",
        successor.log()
    );
}

/// Another producer's transaction open on the progress topic (another
/// shard's, or a killed one's until its `transaction.timeout.ms`) holds a
/// `read_committed` reader's end of partition at its first record. walbox
/// committed more progress after it; Postgres crashes and re-sends what
/// Kafka already holds. The restart reads its own latest progress (it waits
/// for the open transaction to end) and writes nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_committed_behind_another_producers_open_transaction_is_read() {
    use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let (server, url, client) = private_outbox().await;
    let topic = kafka.create_topic(3).await;
    let progress = progress_topic(&kafka).await;
    let flags = exactly_once(&topic, &progress);
    let run = || {
        let mut command = std::process::Command::new(walbox_e2e::walbox_bin());
        command.env("WALBOX_PG_URL", &url).env("WALBOX_LOG", "info");
        spawn_run_with(command, &kafka, &flags)
    };
    let mut relay = run();
    insert_events(&client, 0, 100, |k| 1 + k % 10, 7).await;
    assert_eq!(expect_all(&kafka, &topic, 100).await, 0);

    // Another producer opens a transaction on the progress topic.
    let other: ThreadedProducer<DefaultProducerContext> = kafka
        .client_config()
        .set("transactional.id", "another-shard")
        .set("transaction.timeout.ms", "60000")
        .create()
        .unwrap();
    let t = Duration::from_secs(30);
    tokio::task::block_in_place(|| {
        other.init_transactions(t).unwrap();
        other.begin_transaction().unwrap();
        other
            .send(
                BaseRecord::to(&progress)
                    .key("another-shard")
                    .payload("open"),
            )
            .map_err(|(e, _)| e)
            .unwrap();
        other.flush(t).unwrap();
    });
    // walbox commits past it.
    insert_events(&client, 100, 300, |k| 1 + k % 10, 7).await;
    assert_eq!(expect_all(&kafka, &topic, 300).await, 0);
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    stop(&mut relay).await;

    // A crash of Postgres: the slot goes back to the last checkpoint, and
    // Postgres will send events Kafka already holds again.
    drop(client);
    let (_server, client) = crash_and_restart(server).await; // held to the end: dropping it stops Postgres
    let mut relay = run();
    // The other producer ends its transaction a while later.
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| other.abort_transaction(t).unwrap());
    insert_events(&client, 300, 350, |k| 1 + k % 10, 7).await;
    let duplicates = expect_all(&kafka, &topic, 350).await;
    let log = relay.log();
    assert_eq!(
        duplicates, 0,
        "walbox resumed from progress older than its own latest\n{log}"
    );
    assert!(
        log.contains("resuming after the committed progress"),
        "{log}"
    );
    stop(&mut relay).await;
}

/// Exactly-once, the broker frozen (SIGSTOP: connections open, nothing
/// answers) with a Kafka transaction open: SIGTERM ends walbox within
/// `shutdown_timeout_secs` (5 s here) and a little, a second SIGTERM at
/// once; neither confirms past the last commit, and after the broker is
/// back every event arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_is_bounded_in_exactly_once_mode_with_the_broker_frozen() {
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let progress = progress_topic(&kafka).await;
    let mut flags = exactly_once(&topic, &progress);
    // Transactions stay open long enough for the freeze to find one.
    flags.extend([
        "--transactions-max-ms",
        "3000",
        "--shutdown-timeout-secs",
        "5",
    ]);
    let mut total = 0;
    let mut took = Vec::new();
    for second_sigterm in [false, true] {
        let mut relay = spawn_run(&db, &kafka, &flags);
        wait_log(&relay, "streaming from the slot").await;
        insert_events(&client, total, total + 200, |k| 1 + k % 10, 7).await;
        total += 200;
        tokio::time::sleep(Duration::from_millis(500)).await; // sent, not committed
        kafka_cluster.pause(0);
        let t0 = std::time::Instant::now();
        sigterm(&relay);
        if second_sigterm {
            tokio::time::sleep(Duration::from_millis(200)).await;
            sigterm(&relay);
        }
        let (status, _) = wait_exit(&mut relay).await;
        let elapsed = t0.elapsed();
        kafka_cluster.resume(0);
        let log = relay.log();
        assert!(status.success(), "{log}");
        let bound = if second_sigterm {
            Duration::from_secs(3)
        } else {
            Duration::from_secs(5 + 1 + 3)
        };
        assert!(
            elapsed <= bound,
            "second SIGTERM: {second_sigterm}: exit after {elapsed:?} (bound {bound:?})\n{log}"
        );
        took.push(elapsed);
    }
    eprintln!(
        "exit with the broker frozen: after SIGTERM {:?}, after a second SIGTERM {:?}",
        took[0], took[1]
    );
    let mut relay = spawn_run(&db, &kafka, &flags);
    let duplicates = expect_all(&kafka, &topic, total).await;
    assert_eq!(duplicates, 0, "{}", relay.log());
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    stop(&mut relay).await;
}

/// Inserts events `from..to` in one transaction (payload `{"n": i, "pad": …}`,
/// key `agg-{i % 7}`), event `big` with `big_bytes` of random hex padding
/// (which compression cannot shrink below half).
async fn insert_with_one_big(
    client: &tokio_postgres::Client,
    from: i64,
    to: i64,
    big: i64,
    big_bytes: i32,
) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-' || (n % 7), 'E' || n, \
                    jsonb_build_object('n', n, 'pad', CASE WHEN n = $3 THEN \
                        (SELECT string_agg(md5(random()::text || g), '') FROM generate_series(1, $4 / 32) g) \
                        ELSE '' END) \
             FROM generate_series($1::int8, $2::int8 - 1) n",
            &[&from, &to, &big, &big_bytes],
        )
        .await
        .unwrap();
}

/// Gapless on the real broker: a record Apache Kafka refuses for good (the
/// topic's `max.message.bytes`, which only the broker knows) stops walbox
/// without a dead-letter topic, and nothing after it is stored (the broker
/// checks the idempotent producer's sequences, so what was pipelined
/// behind it fails too); the slot stays before it. Restarted with a
/// dead-letter topic, the refused event goes there and the rest follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_refuses_for_good_leaves_nothing_after_it_on_the_topic() {
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka
        .create_topic_configured(1, 1, &[("max.message.bytes", "2000")])
        .await;
    let before = current_wal_lsn(&client).await;
    // Pipelined: many small requests in flight behind the refused one.
    let flags = [
        "--mapping-topic-template",
        &topic,
        "--kafka-property",
        "linger.ms=0",
        "--kafka-property",
        "batch.num.messages=1",
    ];
    let mut relay = spawn_run(&db, &kafka, &flags);
    wait_log(&relay, "streaming from the slot").await;
    insert_with_one_big(&client, 0, 300, 40, 8000).await;
    let status = exit_within(&mut relay, Duration::from_secs(40)).await;
    let log = relay.log();
    assert!(
        !status.success(),
        "walbox went on past a refused event\n{log}"
    );
    let last = log
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or_default();
    assert!(
        last.contains("too large") || last.contains("TooLarge"),
        "{last}"
    );
    let stored: Vec<i64> = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(3),
        Duration::from_secs(30),
    )
    .await
    .unwrap()
    .iter()
    .map(n_of)
    .collect();
    assert!(
        stored.iter().all(|n| *n < 40),
        "records after the refused event 40 were stored: {:?}",
        stored
            .iter()
            .filter(|n| **n >= 40)
            .take(10)
            .collect::<Vec<_>>()
    );
    // The slot stays before the refused event's transaction: every row of
    // it is still to be streamed. (Its confirmed position may pass
    // `before`: while idle, walbox confirms WAL other databases of the
    // shared server write, up to the transaction's commit.)
    let confirmed = walbox_test_harness::slot::confirmed_flush_lsn(&client, "walbox")
        .await
        .unwrap();
    let still_to_stream: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('walbox', NULL, NULL, \
                 'proto_version', '1', 'publication_names', 'walbox_outbox') \
             WHERE get_byte(data, 0) = ascii('I')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        still_to_stream, 300,
        "the slot passed the refused event's transaction (confirmed {confirmed:?}, {before:?} before it)"
    );
    eprintln!(
        "{} of the 40 events before the refused one were stored; none after it",
        stored.len()
    );

    let dead = kafka.create_topic(1).await;
    let mut with_dlq = flags.to_vec();
    with_dlq.extend(["--dead-letter-topic", &dead]);
    let mut relay = spawn_run(&db, &kafka, &with_dlq);
    let dead_lettered = consume_n(&kafka, &dead, 1, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(n_of(&dead_lettered[0]), 40);
    let all = wait_for_records(&kafka, &topic, 299).await;
    let distinct: std::collections::BTreeSet<i64> = all.iter().map(n_of).collect();
    assert_eq!(distinct.len(), 299, "every event but the refused one");
    assert!(!distinct.contains(&40));
    stop(&mut relay).await;
}

/// Exactly-once on the real broker: an event Apache Kafka refuses for good
/// (the topic's `max.message.bytes`) fails its Kafka transaction, and the
/// replay sends it to the dead-letter topic inside the next one; every
/// other event is on the topic once for a `read_committed` consumer.
/// walbox asks for a commit only once every record of the transaction
/// reported, so the refusal is heard first (a commit begun before it
/// waited, until librdkafka's 30 s flush timeout, for the records held
/// behind the refused one: the test took 76 s then, 23 s now).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_dead_letters_what_the_broker_refuses_for_good() {
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka
        .create_topic_configured(1, 1, &[("max.message.bytes", "2000")])
        .await;
    let progress = progress_topic(&kafka).await;
    let dead = kafka.create_topic(1).await;
    let mut flags = exactly_once(&topic, &progress);
    // A record batch per record: the topic's limit is on batches, and one
    // that holds many small events is refused as a whole.
    flags.extend([
        "--dead-letter-topic",
        &dead,
        "--kafka-property",
        "batch.num.messages=1",
    ]);
    let mut relay = spawn_run(&db, &kafka, &flags);
    wait_log(&relay, "streaming from the slot").await;
    for round in 0..2 {
        let from = round * 100;
        insert_with_one_big(&client, from, from + 100, from + 40, 8000).await;
    }
    let head = current_wal_lsn(&client).await;
    let confirmed = tokio::time::timeout(
        Duration::from_secs(150),
        wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(160)),
    )
    .await;
    assert!(confirmed.is_ok(), "not confirmed:\n{}", relay.log());
    let dead_lettered = consume_n(&kafka, &dead, 2, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", relay.log()));
    let refused: Vec<i64> = dead_lettered.iter().map(n_of).collect();
    assert_eq!(refused, [40, 140], "{}", relay.log());
    let all = wait_for_records(&kafka, &topic, 198).await;
    let distinct: std::collections::BTreeSet<i64> = all.iter().map(n_of).collect();
    assert_eq!(
        (all.len(), distinct.len()),
        (198, 198),
        "every event but the refused ones, once"
    );
    assert!(refused.iter().all(|n| !distinct.contains(n)));
    stop(&mut relay).await;
}

/// The broker leading `topic`'s partition `p`.
fn leader_of(kafka: &walbox_test_harness::kafka::TestKafka, topic: &str, p: i32) -> i32 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let c: BaseConsumer = kafka.client_config().create().unwrap();
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    md.topics()[0].partitions()[p as usize].leader()
}

/// Three brokers (and a controller of their own), the topic replicated
/// three times with `min.insync.replicas=2`, walbox at its defaults
/// (acks=all, idempotent): the leader of a partition killed with SIGKILL
/// while 10,000 events stream loses nothing, and each key's events arrive
/// in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_leader_killed_mid_stream_loses_nothing() {
    const TOTAL: usize = 10_000;
    let mut kafka_cluster = tokio::task::block_in_place(|| KafkaCluster::start_brokers(3, &[]));
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic_with(3, 3).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    wait_log(&relay, "streaming from the slot").await;
    let writer = spawn_writer(
        db.connect().await,
        20,
        TOTAL / 20,
        Duration::from_millis(150),
        |chunk, k| 1 + (chunk + k) % 20,
        50,
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leader = tokio::task::block_in_place(|| leader_of(&kafka, &topic, 0));
    let killed = kafka_cluster.index_of(leader);
    tokio::task::block_in_place(|| kafka_cluster.kill9(killed));
    writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, TOTAL).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    eprintln!("{TOTAL} events, broker {leader} (leader of partition 0) killed mid-stream: {duplicates} duplicates, none missing");
    tokio::task::block_in_place(|| kafka_cluster.restart(killed));
    stop(&mut relay).await;
}

/// Two of three brokers down: the partitions' in-sync replicas shrink below
/// `min.insync.replicas=2` and the broker answers `NOT_ENOUGH_REPLICAS`.
/// walbox keeps running and waits; the slot does not move past the events
/// the broker did not take; once the brokers are back, every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_two_of_three_brokers_down_walbox_waits_and_recovers() {
    let mut kafka_cluster = tokio::task::block_in_place(|| KafkaCluster::start_brokers(3, &[]));
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic_with(3, 3).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    insert_events(&client, 0, 100, |k| 1 + k % 10, 7).await;
    assert_eq!(expect_all(&kafka, &topic, 100).await, 0);
    let before = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", before, Duration::from_secs(30)).await;

    tokio::task::block_in_place(|| {
        kafka_cluster.kill9(0);
        kafka_cluster.kill9(1);
    });
    insert_events(&client, 100, 300, |k| 1 + k % 10, 7).await;
    // Long enough for the controller to fence the two brokers (a 6 s
    // session timeout here) and the survivor to refuse writes.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(relay.running(), "walbox exited\n{}", relay.log());
    let confirmed = walbox_test_harness::slot::confirmed_flush_lsn(&client, "walbox")
        .await
        .unwrap();
    let head = current_wal_lsn(&client).await;
    assert!(
        confirmed < head,
        "the slot moved past events no broker took: {confirmed} ≥ {head}"
    );
    // The survivor leads with itself alone in sync: below
    // min.insync.replicas, so it answers acks=all with NOT_ENOUGH_REPLICAS.
    let isr = tokio::task::block_in_place(|| {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let c: BaseConsumer = kafka.client_config().create().unwrap();
        let md = c
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .unwrap();
        md.topics()[0]
            .partitions()
            .iter()
            .map(|p| p.isr().len())
            .collect::<Vec<_>>()
    });
    assert!(
        isr.iter().all(|n| *n == 1),
        "in-sync replicas per partition: {isr:?}"
    );
    eprintln!(
        "two of three brokers down for 12 s: in-sync replicas {isr:?} (min.insync.replicas 2), walbox running, slot at {confirmed} (head {head})"
    );
    tokio::task::block_in_place(|| {
        kafka_cluster.restart(0);
        kafka_cluster.restart(1);
    });
    let duplicates = expect_all(&kafka, &topic, 300).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    eprintln!("after the brokers came back: every event, {duplicates} duplicates");
    stop(&mut relay).await;
}

/// Postgres transactions of 2,000 events, each split across Kafka
/// transactions of at most 300, walbox killed with SIGKILL three times
/// while they stream (so inside split transactions): the progress record's
/// count cuts each replayed transaction where Kafka's copy ends, and a
/// `read_committed` consumer sees every event exactly once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_split_across_kafka_transactions_survive_kill_9_exactly_once() {
    const TOTAL: usize = 12_000;
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let progress = progress_topic(&kafka).await;
    let mut flags = exactly_once(&topic, &progress);
    flags.extend(["--transactions-max-events", "300"]);
    let writer = spawn_writer(
        db.connect().await,
        6,
        TOTAL / 6,
        Duration::from_millis(300),
        |_, _| 2_000,
        40,
    );
    let mut split_resumes = 0;
    for _ in 0..3 {
        let mut relay = spawn_run(&db, &kafka, &flags);
        wait_log(&relay, "streaming from the slot").await;
        tokio::time::sleep(Duration::from_millis(900)).await;
        signal(&relay, "-KILL");
        wait_exit(&mut relay).await;
        split_resumes += relay.log().matches("its first").count();
    }
    writer.await.unwrap();
    let mut relay = spawn_run(&db, &kafka, &flags);
    let duplicates = expect_all(&kafka, &topic, TOTAL).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let log = relay.log();
    split_resumes += log.matches("its first").count();
    eprintln!("{TOTAL} events in transactions of 2,000 split by 300, 3 kill -9s: {duplicates} duplicates for read_committed, {split_resumes} restarts resumed inside a split transaction");
    assert_eq!(duplicates, 0, "{log}");
    stop(&mut relay).await;
}

/// walbox frozen (SIGSTOP) with a Kafka transaction open for longer than
/// the producer's `transaction.timeout.ms` (5 s here): the broker aborts it.
/// Resumed, walbox finds its transaction gone, writes its events again in
/// a new one, and a `read_committed` consumer sees every event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_the_broker_expires_is_written_again_once() {
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let progress = progress_topic(&kafka).await;
    let mut flags = exactly_once(&topic, &progress);
    flags.extend([
        "--transactions-max-ms",
        "2000",
        "--kafka-property",
        "transaction.timeout.ms=5000",
    ]);
    let mut relay = spawn_run(&db, &kafka, &flags);
    wait_log(&relay, "streaming from the slot").await;
    insert_events(&client, 0, 100, |k| 1 + k % 10, 7).await;
    tokio::time::sleep(Duration::from_millis(300)).await; // sent, not committed
    signal(&relay, "-STOP");
    // The coordinator aborts a transaction open past its timeout (it
    // checks every transaction.abort.timed.out.transaction.cleanup.interval.ms,
    // 10 s by default).
    tokio::time::sleep(Duration::from_secs(16)).await;
    signal(&relay, "-CONT");
    insert_events(&client, 100, 200, |k| 1 + k % 10, 7).await;
    // Whether it carries on or stops to be restarted, every event arrives once.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let exited = relay.try_exit();
    let first_log = relay.log();
    if exited.is_some() {
        relay = spawn_run(&db, &kafka, &flags);
    }
    let duplicates = expect_all(&kafka, &topic, 200).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let said = first_log
        .lines()
        .filter(|l| l.contains("WARN") || l.contains("ERROR") || l.starts_with("walbox:"))
        .map(|l| l.chars().take(300).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!(
        "after the broker expired its transaction, walbox {}:\n{said}",
        if exited.is_some() {
            "exited (restarted)"
        } else {
            "carried on"
        }
    );
    assert_eq!(duplicates, 0, "{first_log}\n{}", relay.log());
    stop(&mut relay).await;
}

/// The records of `topic` on the broker: the sum of its partitions' high
/// watermarks.
fn records_on(kafka: &walbox_test_harness::kafka::TestKafka, topic: &str, partitions: i32) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let c: BaseConsumer = kafka.client_config().create().unwrap();
    (0..partitions)
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap()
                .1
        })
        .sum()
}

/// At least once, at walbox's defaults (`skip_delivered` on), on Apache
/// Kafka at its own defaults: 10,000 events in transactions of 1 to 50 over
/// 100 keys with walbox killed with SIGKILL three times while they stream,
/// then one transaction of 20,000 rows with walbox killed when about half
/// of it is on the topic. A plain (`read_uncommitted`) consumer sees every
/// event once: each restart read the topic back and sent only what was
/// not there. Before `skip_delivered`, the same run left thousands of
/// duplicates (the big transaction re-sent whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_least_once_leaves_no_duplicates_where_the_broker_kept_its_log() {
    const STREAMED: usize = 10_000;
    const BIG: usize = 20_000;
    let kafka_cluster = kafka_cluster(1);
    let kafka = kafka_cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let flags = ["--mapping-topic-template", topic.as_str()];

    let writer = spawn_writer(
        db.connect().await,
        40,
        STREAMED / 40,
        Duration::from_millis(100),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 50,
        100,
    );
    kill_9_while_streaming(&db, &kafka, &flags, 3).await;
    writer.await.unwrap();
    // Everything so far delivered and confirmed, then the big transaction.
    let mut relay = spawn_run(&db, &kafka, &flags);
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let before = tokio::task::block_in_place(|| records_on(&kafka, &topic, 3));
    insert_events(&client, STREAMED, STREAMED + BIG, |_| BIG, 100).await;
    wait_for(
        "half the big transaction on the topic",
        Duration::from_secs(60),
        || {
            let on = tokio::task::block_in_place(|| records_on(&kafka, &topic, 3)) - before;
            async move {
                if on >= (BIG / 2) as i64 {
                    Ok(())
                } else {
                    Err(format!("{on} of it"))
                }
            }
        },
    )
    .await;
    signal(&relay, "-KILL");
    wait_exit(&mut relay).await;
    let killed_at = tokio::task::block_in_place(|| records_on(&kafka, &topic, 3)) - before;

    let mut relay = spawn_run(&db, &kafka, &flags);
    let duplicates = expect_all_logged(&kafka, &topic, STREAMED + BIG, &relay).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let log = relay.log();
    eprintln!(
        "{} events, 4 kill -9s ({killed_at} of the {BIG}-row transaction on the topic at the last): {duplicates} duplicates for a plain consumer",
        STREAMED + BIG
    );
    // Killed before the whole transaction was on the topic, it cannot
    // have been confirmed: the restart re-reads it, and looks first. (The
    // kill may come late, the poll above being slower than walbox.)
    if killed_at < BIG as i64 {
        assert!(log.contains("read the topic back"), "{log}");
    }
    assert_eq!(duplicates, 0, "{log}");
    stop(&mut relay).await;
}
