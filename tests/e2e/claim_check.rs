//! Claim-check (`claim_check.bucket`) against a real S3 API server (moto's
//! server mode, `WALBOX_MOTO_PYTHON`, which scripts/test installs) and
//! Apache Kafka with its default 1 MiB record limit: 1 MiB events are
//! stored as objects, their records carry pointers, and an independent
//! client (Python boto3) fetches and verifies every object. While the store
//! does not answer, nothing past the oversized event is confirmed: a kill -9
//! then loses nothing. The same pointers go to RabbitMQ (read back by
//! pika) and to an SQS FIFO queue (ElasticMQ, read back by boto3), whose
//! 256 KiB limit brings the threshold under it.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use rdkafka::message::{Message, OwnedMessage};
use walbox_test_harness::kafka::{headers_of, TestKafka};
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const BUCKET: &str = "walbox-events";
/// The secret access key walbox is given (moto takes any).
const SECRET: &str = "s3cr3t-claim-check-key";
/// 1 MiB of payload padding: the record is past the broker's limit.
const BIG: i32 = 1 << 20;

impl MotoServer {
    /// Runs the boto3 tool with `action`, `input` on its stdin; its stdout.
    pub(crate) fn tool(&self, action: &str, input: &str) -> String {
        run_tool(
            &moto_python(),
            "s3_claim_check.py",
            &[action, &self.endpoint, BUCKET],
            input,
        )
    }
}

/// Inserts events `from..to` in one transaction (key `agg-{n % 7}`, event
/// type `E{n}`); those with `n % 11 == 5` carry 1 MiB of padding.
async fn insert(client: &tokio_postgres::Client, from: i64, to: i64) {
    insert_padded(client, from, to, BIG).await;
}

/// [`insert`] with `pad` bytes of padding.
async fn insert_padded(client: &tokio_postgres::Client, from: i64, to: i64, pad: i32) {
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             SELECT 'order', 'agg-' || (n % 7), 'E' || n, \
                    jsonb_build_object('n', n, 'pad', CASE WHEN n % 11 = 5 THEN repeat('x', $3) ELSE '' END) \
             FROM generate_series($1::int8, $2::int8 - 1) n",
            &[&from, &to, &pad],
        )
        .await
        .unwrap();
}

/// An event's number, from its `event_type` header.
fn n(m: &OwnedMessage) -> i64 {
    headers_of(m)["event_type"][1..].parse().unwrap()
}

/// Reads the topic until `total` distinct events arrived; checks that each
/// key's first arrivals follow commit order; returns the claim-checked
/// records' pointers as the boto3 tool reads them.
async fn all_arrived(
    kafka: &TestKafka,
    topic: &str,
    total: usize,
) -> (Vec<serde_json::Value>, usize) {
    let messages = wait_distinct(kafka, topic, total, n).await;
    let mut sorted = messages.clone();
    sorted.sort_by_key(|m| (m.partition(), m.offset()));
    let (mut seen, mut last) = (HashSet::new(), HashMap::<Vec<u8>, i64>::new());
    let mut pointers = Vec::new();
    for m in &sorted {
        let n = n(m);
        if !seen.insert(n) {
            continue;
        }
        let prev = last.insert(m.key().unwrap().to_vec(), n);
        assert!(
            prev.is_none_or(|p| p < n),
            "per-key order of first arrivals"
        );
        let h = headers_of(m);
        let value: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        if n % 11 == 5 {
            let url = &h["walbox.claim-check.url"];
            assert_eq!(value["claim_check"]["url"], url.as_str());
            assert!(
                m.payload().unwrap().len() < 1024,
                "a pointer, not the value"
            );
            pointers.push(serde_json::json!({
                "url": url,
                "sha256": h["walbox.claim-check.sha256"],
                "size": h["walbox.claim-check.size"].parse::<u64>().unwrap(),
                "n": n,
            }));
        } else {
            assert!(!h.contains_key("walbox.claim-check.url"));
            assert_eq!(value["n"], n);
        }
    }
    (pointers, messages.len() - total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_mib_events_go_to_the_bucket_and_their_records_point_there() {
    let s3 = MotoServer::start().await;
    assert_eq!(s3.tool("create", "").trim(), "created");
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    // Apache Kafka's default record limit, stated.
    let topic = kafka
        .create_topic_configured(3, 1, &[("max.message.bytes", "1048588")])
        .await;
    let flags = [
        "--mapping-topic-template",
        &topic,
        "--claim-check-bucket",
        BUCKET,
        "--claim-check-endpoint",
        &s3.endpoint,
        "--metrics-addr",
        ANY_PORT,
    ];
    let start = || {
        let mut c = walbox(&db, &[]);
        c.env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .env("AWS_REGION", "us-east-1");
        spawn_run_with(c, &kafka, &flags)
    };
    let mut relay = start();
    let addr = metrics_addr(&relay).await;
    for chunk in 0..4 {
        insert(&client, chunk * 55, (chunk + 1) * 55).await;
    }
    let (pointers, _) = all_arrived(&kafka, &topic, 220).await;
    assert_eq!(pointers.len(), 20);
    let verified = s3.tool("verify", &serde_json::to_string(&pointers).unwrap());
    assert_eq!(verified.trim(), "verified 20");
    assert_eq!(metric_at(&addr, "walbox_claim_checks_total"), 20.0);
    assert!(!relay.log().contains(SECRET), "a secret in the log");

    // The store stops answering: the oversized event waits, nothing past it
    // is confirmed, and a kill -9 meanwhile loses nothing.
    s3.signal("-STOP");
    insert(&client, 220, 240).await;
    wait_log(&relay, "claim-check: storing the value").await;
    relay.kill9();
    s3.signal("-CONT");
    relay = start();
    let (pointers, duplicates) = all_arrived(&kafka, &topic, 240).await;
    assert_eq!(pointers.len(), 22);
    let verified = s3.tool("verify", &serde_json::to_string(&pointers).unwrap());
    assert_eq!(verified.trim(), "verified 22");
    eprintln!("{duplicates} duplicates after the kill -9 during the store's outage");
    assert!(!relay.log().contains(SECRET), "a secret in the log");
    stop(&mut relay).await;
}

/// The pointers among `(n, headers, body)` messages, checked as
/// [`all_arrived`] checks a Kafka record's: a claim-checked event's body is
/// the pointer (under 1 KiB) and its headers name the object; every other
/// body is the payload.
fn pointers_of(messages: &[(i64, HashMap<String, String>, String)]) -> Vec<serde_json::Value> {
    let mut pointers = Vec::new();
    let mut seen = HashSet::new();
    for (n, h, body) in messages {
        if !seen.insert(*n) {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(body).unwrap();
        if n % 11 == 5 {
            assert_eq!(
                value["claim_check"]["url"],
                h["walbox.claim-check.url"].as_str()
            );
            assert!(body.len() < 1024, "a pointer, not the value");
            pointers.push(serde_json::json!({
                "url": h["walbox.claim-check.url"],
                "sha256": h["walbox.claim-check.sha256"],
                "size": h["walbox.claim-check.size"].parse::<u64>().unwrap(),
                "n": n,
            }));
        } else {
            assert!(!h.contains_key("walbox.claim-check.url"));
            assert_eq!(value["n"], *n);
        }
    }
    pointers
}

/// Claim-check on RabbitMQ: 1 MiB events (RabbitMQ would take them; the
/// threshold is walbox's) go to the bucket through a kill -9, their
/// messages carry pointers, and boto3 verifies every object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_checked_events_reach_rabbitmq_as_pointers() {
    let s3 = MotoServer::start().await;
    assert_eq!(s3.tool("create", "").trim(), "created");
    let broker = walbox_test_harness::rabbitmq::RabbitMq::start();
    crate::rabbitmq::bind(&broker, &[("orders", "outbox.event.order")]);
    let db = fresh_db().await;
    let client = init(&db).await;
    let url = broker.url();
    let flags = [
        "run",
        "--sink",
        "rabbitmq",
        "--rabbitmq-url",
        &url,
        "--claim-check-bucket",
        BUCKET,
        "--claim-check-endpoint",
        &s3.endpoint,
    ];
    let start = || {
        let mut c = walbox(&db, &flags);
        c.env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", SECRET)
            .env("AWS_REGION", "us-east-1");
        spawn_logged(c)
    };
    let mut relay = start();
    wait_log(&relay, "streaming from the slot").await;
    insert(&client, 0, 55).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.kill9();
    relay = start();
    insert(&client, 55, 110).await;
    let queue = vec!["orders".to_owned()];
    let mut got: Vec<(i64, HashMap<String, String>, String)> = Vec::new();
    wait_for("every event on the queue", Duration::from_secs(90), || {
        for g in crate::rabbitmq::read(&broker, &queue) {
            let h: HashMap<String, String> = g
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            got.push((h["event_type"][1..].parse().unwrap(), h, g.body));
        }
        let n = got.iter().map(|g| g.0).collect::<HashSet<_>>().len();
        async move {
            match n {
                110 => Ok(()),
                n => Err(format!("{n} of 110")),
            }
        }
    })
    .await;
    let log = stop(&mut relay).await;
    let pointers = pointers_of(&got);
    assert_eq!(pointers.len(), 10);
    let verified = s3.tool("verify", &serde_json::to_string(&pointers).unwrap());
    assert_eq!(verified.trim(), "verified 10");
    assert!(!log.contains(SECRET), "a secret in the log");
}

/// Claim-check on an SQS FIFO queue (ElasticMQ, MaximumMessageSize 256
/// KiB): the default threshold (900,000 bytes) is brought under the
/// queue's limit and said so; 400 KiB events (under the threshold as
/// configured, over the queue's limit) go to the bucket through a kill -9, their messages carry pointers in their message group, and
/// boto3 verifies every object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_checked_events_reach_an_sqs_queue_under_its_limit() {
    let s3 = MotoServer::start().await;
    assert_eq!(s3.tool("create", "").trim(), "created");
    let sqs = walbox_test_harness::elasticmq::ElasticMq::start();
    let queue = crate::sqs::create(&sqs, "claims.fifo");
    let db = fresh_db().await;
    let client = init(&db).await;
    let flags = [
        "--claim-check-bucket",
        BUCKET,
        "--claim-check-endpoint",
        &s3.endpoint,
    ];
    let start = || crate::sqs::relay_with(&db, &sqs, &queue, &flags);
    let mut relay = start();
    wait_log(&relay, "streaming from the slot").await;
    insert_padded(&client, 0, 55, 400 << 10).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.kill9();
    relay = start();
    insert_padded(&client, 55, 110, 400 << 10).await;
    let mut got: Vec<(i64, HashMap<String, String>, String)> = Vec::new();
    wait_for("every event in the queue", Duration::from_secs(90), || {
        for g in crate::sqs::read(&sqs, &queue) {
            assert_eq!(g.group.as_deref(), Some(g.attribute("walbox.key")));
            let h: HashMap<String, String> = g
                .attributes
                .iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect();
            got.push((h["event_type"][1..].parse().unwrap(), h, g.body));
        }
        let n = got.iter().map(|g| g.0).collect::<HashSet<_>>().len();
        async move {
            match n {
                110 => Ok(()),
                n => Err(format!("{n} of 110")),
            }
        }
    })
    .await;
    let log = stop(&mut relay).await;
    assert!(
        log.contains("claim_check.threshold_bytes lowered under the broker's largest message"),
        "{log}"
    );
    let pointers = pointers_of(&got);
    assert_eq!(pointers.len(), 10);
    let verified = s3.tool("verify", &serde_json::to_string(&pointers).unwrap());
    assert_eq!(verified.trim(), "verified 10");
    assert!(!log.contains(SECRET), "a secret in the log");
}
