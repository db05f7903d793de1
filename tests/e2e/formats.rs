//! Record formats read by consumers' own libraries: CloudEvents (binary and
//! structured) parsed by the CloudEvents Python SDK, the Debezium format's
//! JSON key, and W3C trace context carried from the row or the message.

use std::collections::HashMap;
use std::time::Duration;

use rdkafka::message::{Message, OwnedMessage};
use serde_json::{json, Value};
use tokio_postgres::Client;
use walbox_test_harness::kafka::{consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{fresh_db, TestDb};

use crate::support::{expect_all, python_with, run_tool, spawn_run, stop, succeeded, walbox};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The Python with the CloudEvents SDK.
fn python() -> String {
    python_with(
        "WALBOX_CLOUDEVENTS_PYTHON",
        "cloudevents.core.bindings.kafka",
        "cloudevents==2.2.0",
    )
}

/// Parses records with the SDK: one JSON result per record.
fn parse_with_sdk(records: &[OwnedMessage]) -> Vec<Value> {
    let mut input = String::new();
    for r in records {
        let text = |b: Option<&[u8]>| b.map(|b| String::from_utf8(b.to_vec()).unwrap());
        input.push_str(
            &json!({"headers": headers_of(r), "key": text(r.key()), "value": text(r.payload())})
                .to_string(),
        );
        input.push('\n');
    }
    run_tool(&python(), "cloudevents_parse.py", &[], &input)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Events 0..10 in one transaction: even ones as rows, odd ones through
/// `walbox.emit`; those divisible by 3 carry a traceparent.
async fn write_events(client: &Client) {
    let mut sql = String::from("BEGIN;");
    for n in 0..10 {
        let headers = if n % 3 == 0 {
            format!(r#"{{"traceparent": "{TRACEPARENT}"}}"#)
        } else {
            "{}".into()
        };
        if n % 2 == 0 {
            sql.push_str(&format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers)
                 VALUES ('order', 'agg-{n}', 'E{n}', '{{\"n\": {n}}}', '{headers}');"
            ));
        } else {
            sql.push_str(&format!(
                "SELECT walbox.emit('order', 'agg-{n}', 'E{n}', '{{\"n\": {n}}}', '{headers}');"
            ));
        }
    }
    sql.push_str("COMMIT;");
    client.batch_execute(&sql).await.unwrap();
}

/// Runs walbox with `format` over events from rows and messages; returns
/// the records.
async fn records_in(format: &str) -> (TestDb, Vec<OwnedMessage>) {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    succeeded(
        &walbox(&db, &["init-slot", "--source", "both"])
            .output()
            .unwrap(),
    );
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--source",
            "both",
            "--format",
            format,
            "--mapping-topic-template",
            &topic,
        ],
    );
    write_events(&client).await;
    if format != "cloudevents-structured" {
        expect_all(&kafka, &topic, 10).await;
    }
    let records = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(3),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    stop(&mut relay).await;
    assert_eq!(records.len(), 10, "every event once");
    (db, records)
}

fn n_of_key(r: &OwnedMessage) -> i64 {
    let key = std::str::from_utf8(r.key().unwrap()).unwrap();
    key.trim_matches('"')
        .trim_start_matches("agg-")
        .parse()
        .unwrap()
}

/// What the SDK must read from event `n`'s record.
fn check_event(n: i64, parsed: &Value, headers: &HashMap<String, String>) {
    let a = &parsed["attributes"];
    assert!(
        parsed.get("error").is_none(),
        "the SDK refused it: {parsed}"
    );
    assert_eq!(a["specversion"], "1.0");
    assert_eq!(
        a["id"],
        headers["id"].as_str(),
        "ce id is walbox's event id"
    );
    assert_eq!(a["source"], "/walbox/walbox");
    assert_eq!(a["type"], format!("E{n}"));
    assert_eq!(a["subject"], format!("agg-{n}"));
    let time = a["time"].as_str().unwrap();
    assert!(time.starts_with("20") && time.ends_with("+00:00"), "{time}");
    assert_eq!(parsed["data"], json!({"n": n}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_binary_mode_parses_with_the_sdk() {
    let (_db, records) = records_in("cloudevents-binary").await;
    let parsed = parse_with_sdk(&records);
    for (r, p) in records.iter().zip(&parsed) {
        let n = n_of_key(r);
        let headers = headers_of(r);
        check_event(n, p, &headers);
        assert_eq!(p["attributes"]["datacontenttype"], "application/json");
        // W3C trace context: the header OpenTelemetry's Kafka instrumentation reads.
        assert_eq!(
            headers.get("traceparent").map(String::as_str),
            (n % 3 == 0).then_some(TRACEPARENT),
            "event {n}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_structured_mode_parses_with_the_sdk() {
    let (_db, records) = records_in("cloudevents-structured").await;
    let parsed = parse_with_sdk(&records);
    for (r, p) in records.iter().zip(&parsed) {
        let n = n_of_key(r);
        let headers = headers_of(r);
        check_event(n, p, &headers);
        assert_eq!(headers["content-type"], "application/cloudevents+json");
        // The distributed tracing extension's attribute, and the header.
        let want = (n % 3 == 0).then_some(TRACEPARENT);
        assert_eq!(p["attributes"]["traceparent"].as_str(), want, "event {n}");
        assert_eq!(headers.get("traceparent").map(String::as_str), want);
    }
    // A record that is not a CloudEvent is refused by the SDK: the check can fail.
    let mut broken = records[0].clone();
    broken = OwnedMessage::new(
        Some(br#"{"specversion":"1.0","data":{}}"#.to_vec()),
        broken.key().map(<[u8]>::to_vec),
        broken.topic().to_owned(),
        broken.timestamp(),
        broken.partition(),
        broken.offset(),
        None,
    );
    let parsed = parse_with_sdk(&[broken]);
    assert!(parsed[0].get("error").is_some(), "{parsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debezium_format_keys_records_as_json_strings() {
    let (_db, records) = records_in("debezium").await;
    for r in &records {
        let key: Value = serde_json::from_slice(r.key().unwrap()).unwrap();
        let n = n_of_key(r);
        assert_eq!(
            key,
            Value::String(format!("agg-{n}")),
            "the JSON key converter's key"
        );
        let value: Value = serde_json::from_slice(r.payload().unwrap()).unwrap();
        assert_eq!(value, json!({"n": n}), "the expanded payload");
        assert_eq!(headers_of(r)["event_type"], format!("E{n}"));
    }
}

/// A `bytea` payload column (the application serialized its events
/// itself): each record's value is the row's bytes, every byte value
/// included, for rows published by a backfill and rows streamed alike,
/// with the database's `bytea_output` set to `escape`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytea_payloads_arrive_byte_for_byte_backfilled_and_streamed() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    client
        .batch_execute(
            "ALTER TABLE outbox_events ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8');
             DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET bytea_output = ''escape''', current_database()); END $$;",
        )
        .await
        .unwrap();
    // Event i: 0..=255 for i = 0, else i * 13 % 700 bytes of a pattern.
    let payload = |i: usize| -> Vec<u8> {
        if i == 0 {
            (0..=255).collect()
        } else {
            (0..i * 13 % 700)
                .map(|j| ((i * 31 + j * 7) % 256) as u8)
                .collect()
        }
    };
    let mut expected: HashMap<String, Vec<u8>> = HashMap::new();
    let insert = |from: usize, to: usize| {
        let client = &client;
        async move {
            let mut ids = Vec::new();
            for i in from..to {
                let row = client
                    .query_one(
                        "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', $1, 'Serialized', $2) RETURNING id::text",
                        &[&format!("agg-{}", i % 7), &payload(i)],
                    )
                    .await
                    .unwrap();
                ids.push((row.get::<_, String>(0), payload(i)));
            }
            ids
        }
    };
    expected.extend(insert(0, 50).await);
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let flags = ["--mapping-topic-template", topic.as_str()];
    let mut backfill = walbox(&db, &["init-slot", "--kafka-brokers", &kafka.bootstrap()]);
    backfill.args(flags).args(["--backfill", "true"]);
    succeeded(&backfill.output().unwrap());
    let mut relay = spawn_run(&db, &kafka, &flags);
    expected.extend(insert(50, 100).await);
    let records = crate::support::wait_distinct(&kafka, &topic, expected.len(), |r| {
        headers_of(r)["id"].clone()
    })
    .await;
    stop(&mut relay).await;
    let mut seen = HashMap::new();
    for r in &records {
        let id = headers_of(r)["id"].clone();
        let want = expected
            .get(&id)
            .unwrap_or_else(|| panic!("a record of no row: {id}"));
        assert_eq!(
            r.payload().unwrap_or_default(),
            want.as_slice(),
            "event {id}"
        );
        seen.insert(id, ());
    }
    assert_eq!(seen.len(), expected.len(), "every event");
}
