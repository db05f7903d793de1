//! `sink = "nats"` against a real nats-server with JetStream (the NATS
//! project's Go server, which scripts/test installs with `go install`),
//! read back by the NATS project's own client (async-nats' pull consumer),
//! not by walbox's sink: 3,000 events in transactions of 1 to 50 through
//! three kill -9s of walbox and a kill -9 of the server: every event in
//! the stream, the duplicates a consumer sees (the stream drops re-sends
//! by `Nats-Msg-Id` within its duplicate window), each aggregate's first
//! arrivals in commit order; an event whose subject no stream takes
//! dead-lettered with the reason.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures_util::StreamExt;
use walbox_test_harness::nats::NatsServer;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const TOTAL: usize = 3_000;
const AGGREGATES: usize = 37;

/// A stored message: its subject, headers and payload's `n`.
#[derive(Debug)]
struct Got {
    subject: String,
    headers: HashMap<String, String>,
    n: usize,
}

/// Every message of `stream`, in stream order, read by a fresh ordered
/// consumer (reading consumes nothing).
async fn read_stream(url: &str, stream: &str) -> Vec<Got> {
    let client = async_nats::connect(url).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(stream).await.unwrap();
    let count = stream.info().await.unwrap().state.messages as usize;
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let m = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("a message within 10 s")
            .unwrap()
            .unwrap();
        let headers: HashMap<String, String> = m
            .headers
            .iter()
            .flat_map(|h| h.iter())
            .map(|(k, v)| {
                (
                    k.to_string(),
                    v.first().map(|v| v.to_string()).unwrap_or_default(),
                )
            })
            .collect();
        let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
        out.push(Got {
            subject: m.subject.to_string(),
            headers,
            n: v["n"].as_u64().unwrap_or(u64::MAX) as usize,
        });
    }
    out
}

/// `walbox run` to the NATS server at `url`, with `extra` flags.
fn run_nats(db: &walbox_test_harness::pg::TestDb, url: &str, extra: &[&str]) -> Relay {
    spawn_logged(walbox(
        db,
        &[&["run", "--sink", "nats", "--nats-url", url][..], extra].concat(),
    ))
}

/// Every message of `stream` once it holds `n` distinct events (2 minutes
/// at most).
async fn wait_all(url: &str, stream: &str, n: usize) -> Vec<Got> {
    wait_for(
        "every event in the stream",
        Duration::from_secs(120),
        || async move {
            let all = read_stream(url, stream).await;
            let distinct = all.iter().map(|g| g.n).collect::<HashSet<_>>().len();
            match distinct == n {
                true => Ok(all),
                false => Err(format!("{distinct} of {n} distinct events")),
            }
        },
    )
    .await
}

async fn create_stream(url: &str, name: &str, subjects: &[&str]) {
    let client = async_nats::connect(url).await.unwrap();
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            name: name.into(),
            subjects: subjects.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        })
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_reaches_a_jetstream_stream_in_order_through_kills() {
    let mut server = NatsServer::start();
    let url = server.url();
    create_stream(&url, "OUTBOX", &["outbox.event.order"]).await;
    create_stream(&url, "DEAD", &["walbox.dead"]).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let start = || run_nats(&db, &url, &["--dead-letter-topic", "walbox.dead"]);
    let mut relay = start();
    wait_log(&relay, "connected to NATS").await;
    let writer = spawn_writer(
        db.connect().await,
        20,
        TOTAL / 20 - 50,
        Duration::from_millis(150),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 50,
        AGGREGATES,
    );
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        relay.kill9();
        relay = start();
    }
    writer.await.unwrap();
    // The server killed while events come: what it did not ack comes
    // again, and what it stored is dropped as a duplicate.
    server.kill9();
    let written = TOTAL - 20 * 50;
    insert_events(&client, written, TOTAL, |k| 1 + k % 50, AGGREGATES).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    server.restart();

    let got = wait_all(&url, "OUTBOX", TOTAL).await;
    let mut last: HashMap<String, usize> = HashMap::new();
    let mut seen = HashSet::new();
    for g in &got {
        assert_eq!(g.subject, "outbox.event.order");
        let key = &g.headers["walbox.key"];
        assert_eq!(key, &format!("agg-{}", g.n % AGGREGATES));
        assert_eq!(g.headers["event_type"], format!("E{}", g.n));
        assert!(g.headers["Nats-Msg-Id"].starts_with("walbox/"), "{g:?}");
        if seen.insert(g.n) {
            let prev = last.insert(key.clone(), g.n);
            assert!(
                prev.is_none_or(|p| p < g.n),
                "{key}: {} after {prev:?}",
                g.n
            );
        }
    }
    let duplicates = got.len() - TOTAL;
    eprintln!("{duplicates} duplicates in the stream after three kill -9s of walbox and one of the server");
    assert_eq!(
        duplicates, 0,
        "re-sends within the duplicate window are dropped"
    );

    // No stream takes this subject: dead-lettered with the reason.
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('nobody', 'agg-x', 'Lost', '{\"n\": 99999}')",
        )
        .await
        .unwrap();
    let why = wait_for("the dead-letter copy", Duration::from_secs(60), || {
        let url = url.clone();
        async move {
            let dead = read_stream(&url, "DEAD").await;
            match dead.first() {
                Some(d) => Ok(d.headers["walbox.error"].clone()),
                None => Err("none yet".to_owned()),
            }
        }
    })
    .await;
    assert!(
        why.contains("no JetStream stream takes subject \"outbox.event.nobody\""),
        "{why}"
    );
    stop(&mut relay).await;
}

/// `walbox audit` and the continuous audit on JetStream, the stream read
/// without consuming: 600 events sampled while they stream (nothing
/// missing, no copies), the audit clean over all of them; then, behind
/// walbox's back, one message deleted from the stream and another copied
/// into it by the NATS client: the audit finds exactly those two, by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_reads_the_stream_back_and_finds_what_was_taken_and_copied() {
    use crate::audit::{audit_report, count, counter, wait_caught_up, wait_counter};
    const N: usize = 600;
    let server = NatsServer::start();
    let url = server.url();
    create_stream(&url, "OUTBOX", &["outbox.event.order"]).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let mut relay = run_nats(
        &db,
        &url,
        &["--audit-interval", "1s", "--metrics-addr", ANY_PORT],
    );
    let addr = metrics_addr(&relay).await;
    let writer = spawn_writer(
        db.connect().await,
        30,
        N / 30,
        Duration::from_millis(200),
        |_, k| 1 + k % 7,
        13,
    );
    let metrics = wait_counter(&addr, "walbox_audit_checked_total", 2.0).await;
    writer.await.unwrap();
    assert_eq!(
        counter(&metrics, "walbox_audit_missing_total"),
        0.0,
        "{metrics}"
    );
    assert_eq!(counter(&metrics, "walbox_audit_duplicates_total"), 0.0);
    wait_caught_up(&client).await;
    stop(&mut relay).await;

    let flags = ["--sink", "nats", "--nats-url", url.as_str()];
    let (out, report) = audit_report(&db, &flags);
    assert_eq!(count(&report, "rows"), N as u64, "{report:#}");
    assert_eq!(count(&report, "delivered"), N as u64);
    for clean in [
        "missing",
        "duplicates",
        "out_of_order",
        "misrouted",
        "unconfirmed",
    ] {
        assert_eq!(count(&report, clean), 0, "{clean}: {report:#}");
    }
    assert_eq!(out.status.code(), Some(0));
    // Twice: the first read took nothing.
    let (_, again) = audit_report(&db, &flags);
    assert_eq!(count(&again, "delivered"), N as u64, "{again:#}");

    // Behind walbox's back: message 10 deleted, message 20 stored again
    // (another Nats-Msg-Id, so the stream keeps both).
    let nats = async_nats::connect(&url).await.unwrap();
    let js = async_nats::jetstream::new(nats.clone());
    let stream = js.get_stream("OUTBOX").await.unwrap();
    let deleted = stream.get_raw_message(10).await.unwrap();
    let deleted_id = deleted.headers.get("id").unwrap().to_string();
    assert!(stream.delete_message(10).await.unwrap());
    let copied = stream.get_raw_message(20).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    for (name, values) in copied.headers.iter() {
        if name.to_string() != "Nats-Msg-Id" {
            for v in values {
                headers.append(name.to_string().as_str(), v.as_str());
            }
        }
    }
    headers.insert("Nats-Msg-Id", "a-copy");
    let ack = js
        .publish_with_headers(copied.subject.to_string(), headers, copied.payload.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(!ack.duplicate, "the copy is stored");
    let (out, report) = audit_report(&db, &flags);
    assert_eq!(count(&report, "missing"), 1, "{report:#}");
    assert_eq!(count(&report, "duplicates"), 1, "{report:#}");
    assert_eq!(count(&report, "delivered"), N as u64 - 1);
    assert!(
        report.to_string().contains(&deleted_id),
        "the missing event named: {report:#}"
    );
    assert_eq!(out.status.code(), Some(1));
}

/// SIGTERM while the server is gone and events keep coming (the NATS
/// client buffering publishes it cannot send): walbox exits within its
/// drain bound, and the next start, with the server back, delivers every
/// event, none lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_server_is_gone_exits_and_loses_nothing() {
    const N: usize = 4_000;
    let mut server = NatsServer::start();
    let url = server.url();
    create_stream(&url, "OUTBOX", &["outbox.event.order"]).await;
    let db = fresh_db().await;
    let client = init(&db).await;
    let start = || run_nats(&db, &url, &[]);
    let mut relay = start();
    wait_log(&relay, "connected to NATS").await;
    insert_events(&client, 0, 500, |k| 1 + k % 20, AGGREGATES).await;
    server.kill9();
    // More than the client buffers, while the server is gone.
    insert_events(&client, 500, N, |k| 1 + k % 20, AGGREGATES).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let asked = std::time::Instant::now();
    sigterm(&relay);
    let (status, log) = wait_exit(&mut relay).await;
    let took = asked.elapsed();
    eprintln!("exited {took:?} after SIGTERM with the server gone: {status}");
    assert!(took < Duration::from_secs(20), "exit took {took:?}: {log}");
    assert!(status.success(), "a clean stop: {log}");
    server.restart();
    let mut relay = start();
    let got = wait_all(&url, "OUTBOX", N).await;
    assert!(got.len() >= N);
    stop(&mut relay).await;
}
