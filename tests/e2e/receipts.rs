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

/// A receipt in every broker's terms, as `walbox.await_delivery` gives it.
#[derive(Debug)]
struct Receipt {
    broker: String,
    amqp_exchange: Option<String>,
    amqp_routing_key: Option<String>,
    sqs_message_id: Option<String>,
    sqs_sequence_number: Option<String>,
    kafka_partition: Option<i32>,
    nats_stream: Option<String>,
    nats_sequence: Option<i64>,
    http_status: Option<i32>,
}

/// 1,000 events in transactions of 1 to 20, each waited on by one of 4
/// application connections as soon as it committed, walbox killed -9 and
/// started again while they flow; every wait's receipt.
async fn wait_on_each_through_a_kill_9(
    db: &walbox_test_harness::pg::TestDb,
    start: impl Fn() -> Relay,
) -> (HashMap<String, Receipt>, Relay) {
    const TOTAL: usize = 1_000;
    let mut relay = start();
    wait_log(&relay, "streaming from the slot").await;
    let (ids_tx, ids_rx) = mpsc::unbounded_channel::<String>();
    let ids_rx = Arc::new(Mutex::new(ids_rx));
    let landed: Arc<Mutex<HashMap<String, Receipt>>> = Arc::default();
    let mut waiters = Vec::new();
    for _ in 0..4 {
        let conn = db.connect().await;
        let (ids_rx, landed) = (Arc::clone(&ids_rx), Arc::clone(&landed));
        waiters.push(tokio::spawn(async move {
            loop {
                let Some(id) = ids_rx.lock().await.recv().await else {
                    return;
                };
                let r = conn
                    .query_one(
                        "SELECT broker, amqp_exchange, amqp_routing_key, sqs_message_id,
                                sqs_sequence_number, kafka_partition, nats_stream,
                                nats_sequence, http_status
                           FROM walbox.await_delivery($1::text, '30 seconds')",
                        &[&id],
                    )
                    .await;
                let r = match r {
                    Ok(r) => r,
                    Err(e) => {
                        let receipts: i64 = conn
                            .query_one("SELECT count(*) FROM walbox.receipts", &[])
                            .await
                            .unwrap()
                            .get(0);
                        panic!("await_delivery({id}): {e:?}; {receipts} receipts written")
                    }
                };
                let receipt = Receipt {
                    broker: r.get(0),
                    amqp_exchange: r.get(1),
                    amqp_routing_key: r.get(2),
                    sqs_message_id: r.get(3),
                    sqs_sequence_number: r.get(4),
                    kafka_partition: r.get(5),
                    nats_stream: r.get(6),
                    nats_sequence: r.get(7),
                    http_status: r.get(8),
                };
                landed.lock().await.insert(id, receipt);
            }
        }));
    }
    let conn = db.connect().await;
    let (mut n, mut k) = (0usize, 0usize);
    while n < TOTAL {
        let size = (1 + k % 20).min(TOTAL - n);
        let values: Vec<String> = (n..n + size)
            .map(|i| format!("('order', 'agg-{}', 'E{i}', '{{\"n\": {i}}}')", i % 50))
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
        if k == 40 {
            relay.kill9();
            relay = start();
        }
    }
    drop(ids_tx);
    for w in waiters {
        if let Err(e) = w.await {
            panic!("{e:?}\nthe last walbox's log:\n{}", relay.log());
        }
    }
    let landed = Arc::try_unwrap(landed).unwrap().into_inner();
    assert_eq!(landed.len(), TOTAL);
    (landed, relay)
}

/// Receipts with RabbitMQ: every wait returns the exchange and the routing
/// key (with its routing partition) that pika finds a copy of the event
/// under, through a kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_returns_the_exchange_and_routing_key_on_rabbitmq() {
    let broker = walbox_test_harness::rabbitmq::RabbitMq::start();
    let queues: Vec<(String, String)> = (0..4)
        .map(|p| (format!("orders.{p}"), format!("outbox.event.order.{p}")))
        .collect();
    let pairs: Vec<(&str, &str)> = queues
        .iter()
        .map(|(q, k)| (q.as_str(), k.as_str()))
        .collect();
    crate::rabbitmq::bind(&broker, &pairs);
    let db = fresh_db().await;
    init(&db).await;
    let url = broker.url();
    let flags = [
        "run",
        "--sink",
        "rabbitmq",
        "--rabbitmq-url",
        &url,
        "--rabbitmq-partitions",
        "4",
        "--receipts",
        "true",
    ];
    let (landed, mut relay) =
        wait_on_each_through_a_kill_9(&db, || spawn_logged(walbox(&db, &flags))).await;
    stop(&mut relay).await;
    let names: Vec<String> = queues.iter().map(|(q, _)| q.clone()).collect();
    let mut keys: HashMap<String, Vec<String>> = HashMap::new();
    for g in crate::rabbitmq::read(&broker, &names) {
        keys.entry(g.message_id.unwrap())
            .or_default()
            .push(g.routing_key);
    }
    for (id, r) in &landed {
        assert_eq!(r.broker, "rabbitmq", "{id}: {r:?}");
        assert_eq!(r.amqp_exchange.as_deref(), Some("walbox"), "{id}: {r:?}");
        assert_eq!(r.kafka_partition, None, "{id}: {r:?}");
        let key = r.amqp_routing_key.as_ref().unwrap();
        let copies = keys.get(id).unwrap_or_else(|| panic!("{id}: no message"));
        assert!(
            copies.contains(key),
            "{id}: receipt {key}, copies {copies:?}"
        );
    }
}

/// Receipts with SQS (ElasticMQ, a FIFO queue): every wait returns the
/// message id boto3 reads the event with (and its sequence number, where
/// the server gives one), through a kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_returns_the_message_id_on_sqs() {
    let sqs = walbox_test_harness::elasticmq::ElasticMq::start();
    let queue = crate::sqs::create(&sqs, "receipts.fifo");
    let db = fresh_db().await;
    init(&db).await;
    let (landed, mut relay) = wait_on_each_through_a_kill_9(&db, || {
        crate::sqs::relay_with(&db, &sqs, &queue, &["--receipts", "true"])
    })
    .await;
    stop(&mut relay).await;
    let mut copies: HashMap<String, Vec<(String, Option<String>)>> = HashMap::new();
    for _ in 0..3 {
        for g in crate::sqs::read(&sqs, &queue) {
            copies
                .entry(g.attribute("id").to_owned())
                .or_default()
                .push((g.message_id.clone(), g.sequence.clone()));
        }
    }
    let mut sequenced = 0;
    for (id, r) in &landed {
        assert_eq!(r.broker, "sqs", "{id}: {r:?}");
        assert_eq!(r.amqp_routing_key, None, "{id}: {r:?}");
        let message_id = r.sqs_message_id.clone().unwrap();
        let found = copies.get(id).unwrap_or_else(|| panic!("{id}: no message"));
        let copy = found
            .iter()
            .find(|(m, _)| *m == message_id)
            .unwrap_or_else(|| panic!("{id}: receipt {message_id}, copies {found:?}"));
        // ElasticMQ leaves the sequence number out of SendMessageBatch's
        // result (Amazon SQS gives it for a FIFO queue): where there is
        // one, it is the message's.
        if let Some(seq) = &r.sqs_sequence_number {
            assert_eq!(Some(seq), copy.1.as_ref(), "{id}");
            sequenced += 1;
        }
    }
    eprintln!(
        "{sequenced} of {} receipts with a sequence number",
        landed.len()
    );
}

/// A database migrated before 0006 (receipts in Kafka's terms only): a
/// Kafka walbox keeps writing its receipts there, and a RabbitMQ one is
/// refused at start with what to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_migrated_before_0006_keeps_kafka_receipts_and_asks_for_it_elsewhere() {
    let db = fresh_db().await;
    let client = db.connect().await;
    for file in walbox_test_harness::migrations::migration_files() {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        if name.as_str() < "0006" {
            walbox_test_harness::migrations::apply_sql_file(&client, &file).await;
        }
    }
    succeeded(&walbox(&db, &["init-slot"]).output().unwrap());
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &["--mapping-topic-template", &topic, "--receipts", "true"],
    );
    wait_log(&relay, "streaming from the slot").await;
    let id: String = client
        .query_one(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'a', 'E', '{}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let row = client
        .query_one(
            "SELECT topic, kafka_offset FROM walbox.await_delivery($1::text, '30 seconds')",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), topic);
    assert_eq!(row.get::<_, i64>(1), 0);
    stop(&mut relay).await;

    let out = walbox(
        &db,
        &[
            "run",
            "--sink",
            "rabbitmq",
            "--rabbitmq-url",
            "amqp://127.0.0.1:1",
            "--receipts",
            "true",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("run `walbox migrate`; with RabbitMQ or SQS, migration 0006 too"),
        "{stderr}"
    );
}

/// Receipts with NATS JetStream: every wait returns the stream and the
/// sequence at which the stream holds the event, through a kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_returns_the_stream_sequence_on_nats() {
    let server = walbox_test_harness::nats::NatsServer::start();
    let url = server.url();
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    let stream = js
        .create_stream(async_nats::jetstream::stream::Config {
            name: "OUTBOX".into(),
            subjects: vec!["outbox.event.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
    let db = fresh_db().await;
    init(&db).await;
    let flags = [
        "run",
        "--sink",
        "nats",
        "--nats-url",
        &url,
        "--receipts",
        "true",
    ];
    let (landed, mut relay) =
        wait_on_each_through_a_kill_9(&db, || spawn_logged(walbox(&db, &flags))).await;
    stop(&mut relay).await;
    for (id, r) in &landed {
        assert_eq!(r.broker, "nats", "{id}: {r:?}");
        assert_eq!(r.nats_stream.as_deref(), Some("OUTBOX"), "{id}: {r:?}");
        let seq = r.nats_sequence.unwrap() as u64;
        let m = stream.get_raw_message(seq).await.unwrap();
        assert_eq!(
            m.headers.get("id").map(|v| v.to_string()).as_deref(),
            Some(id.as_str()),
            "{id}: the receipt's sequence {seq} holds another event"
        );
    }
}

/// Receipts with a webhook: every wait returns the status the endpoint
/// answered, through a kill -9.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_returns_the_status_on_a_webhook() {
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(|| async { axum::http::StatusCode::ACCEPTED }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let db = fresh_db().await;
    init(&db).await;
    let start = || {
        let mut c = walbox(&db, &["run", "--sink", "webhook", "--receipts", "true"]);
        c.env("WALBOX_WEBHOOK_URL", &url);
        spawn_logged(c)
    };
    let (landed, mut relay) = wait_on_each_through_a_kill_9(&db, start).await;
    stop(&mut relay).await;
    for (id, r) in &landed {
        assert_eq!(
            (r.broker.as_str(), r.http_status),
            ("webhook", Some(202)),
            "{id}: {r:?}"
        );
    }
}
