//! `otlp_endpoint`: walbox exports a span per event to an OTLP/HTTP
//! collector, a child of the writer's `traceparent`, and the record carries
//! walbox's span on to the consumer.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use rdkafka::message::Message;
use walbox_test_harness::kafka::{consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::pg::fresh_db;

use crate::support::{expect_all, init, spawn_run, stop};

const APP_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const APP_SPAN: &str = "00f067aa0ba902b7";

/// A collector that takes OTLP/HTTP protobuf posts and keeps their bodies.
fn collector() -> (String, Arc<Mutex<Vec<Vec<u8>>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = Arc::clone(&bodies);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            let kept = Arc::clone(&kept);
            std::thread::spawn(move || {
                let mut reader = BufReader::new(conn.try_clone().unwrap());
                let mut conn = conn;
                loop {
                    let mut length = 0usize;
                    let mut line = String::new();
                    // The request line, then headers until a blank line.
                    if reader.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    loop {
                        line.clear();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        if line == "\r\n" {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':') {
                            if k.eq_ignore_ascii_case("content-length") {
                                length = v.trim().parse().unwrap();
                            }
                        }
                    }
                    let mut body = vec![0; length];
                    reader.read_exact(&mut body).unwrap();
                    kept.lock().unwrap().push(body);
                    let _ = conn.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    (format!("http://{addr}"), bodies)
}

fn spans_of(bodies: &[Vec<u8>]) -> Vec<Span> {
    bodies
        .iter()
        .flat_map(|b| {
            ExportTraceServiceRequest::decode(&b[..])
                .unwrap()
                .resource_spans
        })
        .flat_map(|r| r.scope_spans)
        .flat_map(|s| s.spans)
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attribute(span: &Span, key: &str) -> Option<String> {
    span.attributes.iter().find(|a| a.key == key).and_then(|a| {
        match a.value.as_ref()?.value.as_ref()? {
            Value::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_event_gets_a_span_from_commit_to_ack_in_the_writers_trace() {
    let (endpoint, bodies) = collector();
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            &topic,
            "--otlp-endpoint",
            &endpoint,
        ],
    );
    let unsampled = format!("00-{APP_TRACE}-{APP_SPAN}-00");
    client
        .batch_execute(&format!(
            r#"INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) VALUES
                 ('order', 'a', 'E0', '{{"n": 0}}', '{{"traceparent": "00-{APP_TRACE}-{APP_SPAN}-01", "tracestate": "vendor=x"}}'),
                 ('order', 'b', 'E1', '{{"n": 1}}', '{{"traceparent": "{unsampled}"}}'),
                 ('order', 'c', 'E2', '{{"n": 2}}', '{{}}')"#
        ))
        .await
        .unwrap();
    expect_all(&kafka, &topic, 3).await;
    let log = stop(&mut relay).await;
    assert!(
        log.contains("exporting a span per event over OTLP"),
        "{log}"
    );

    let records: HashMap<String, HashMap<String, String>> = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .await
    .unwrap()
    .iter()
    .map(|r| {
        let key = String::from_utf8(r.key().unwrap().to_vec()).unwrap();
        (key, headers_of(r))
    })
    .collect();
    let spans = spans_of(&bodies.lock().unwrap());
    assert_eq!(spans.len(), 2, "one per sampled event: {spans:?}");
    let by_id = |id: &str| {
        spans
            .iter()
            .find(|s| attribute(s, "messaging.message.id").as_deref() == Some(id))
            .unwrap_or_else(|| panic!("no span for event {id}"))
    };

    // In the writer's trace: its parent is the writer's span, and the record
    // carries walbox's span to the consumer.
    let a = &records["a"];
    let span = by_id(&a["id"]);
    assert_eq!(hex(&span.trace_id), APP_TRACE);
    assert_eq!(hex(&span.parent_span_id), APP_SPAN);
    assert_eq!(
        a["traceparent"],
        format!("00-{APP_TRACE}-{}-01", hex(&span.span_id))
    );
    assert_eq!(a["tracestate"], "vendor=x");
    assert_eq!(span.kind, SpanKind::Producer as i32);
    assert_eq!(span.name, format!("publish {topic}"));
    assert_eq!(
        attribute(span, "messaging.destination.name"),
        Some(topic.clone())
    );
    assert_eq!(
        attribute(span, "messaging.kafka.message.key").as_deref(),
        Some("a")
    );
    let took = span.end_time_unix_nano - span.start_time_unix_nano;
    assert!(
        span.start_time_unix_nano <= span.end_time_unix_nano && took < 30_000_000_000,
        "from the commit to the ack: {took} ns"
    );

    // Not sampled by the writer: no span, the header as written.
    assert_eq!(records["b"]["traceparent"], unsampled);

    // No trace context: a trace of its own, carried on.
    let c = &records["c"];
    let span = by_id(&c["id"]);
    assert!(span.parent_span_id.is_empty());
    assert_eq!(
        c["traceparent"],
        format!("00-{}-{}-01", hex(&span.trace_id), hex(&span.span_id))
    );
}
