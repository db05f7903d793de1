//! `format = "avro"` through the relay loop, with an in-memory registry:
//! values go out in the wire format with their subject's schema id; a
//! payload that does not fit follows the failure policy; a registry that
//! does not answer stalls the stream without skipping an event.

use std::sync::{Arc, Mutex};

use super::fakes::{header, key_of};
use super::*;
use crate::mapping::format::EventFormat;
use crate::quarantine::Request;
use crate::schema_registry::{Memory, SchemaError, SchemaKind, SchemaRegistry, SubjectStrategy};

const SCHEMA: &str =
    r#"{"type": "record", "name": "Created", "fields": [{"name": "n", "type": "int"}]}"#;

/// A fixture whose records are Avro with subject `events-value` (id 7).
fn avro_fixture(dead_letters: DeadLetters) -> (Fixture, Arc<Mutex<Memory>>) {
    let mut fx = Fixture::new(dead_letters, 100, 1024);
    let memory = Arc::new(Mutex::new(Memory::default()));
    memory
        .lock()
        .unwrap()
        .subjects
        .insert("events-value".into(), (7, SCHEMA.into()));
    fx.config.mapping.format = EventFormat::Avro;
    fx.config.schema_registry = Some(SchemaRegistry::in_memory(
        SubjectStrategy::Topic,
        SchemaKind::Avro,
        Arc::clone(&memory),
    ));
    (fx, memory)
}

#[tokio::test(start_paused = true)]
async fn values_go_out_with_their_schema_id_and_an_invalid_one_is_dead_lettered() {
    let (mut fx, _) = avro_fixture(DeadLetters::to_topic("dlq"));
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "e0", Some("a"), r#"{"n": 1}"#));
            server.send(insert(110, "e1", Some("a"), r#"{"n": "one"}"#));
            server.send(insert(120, "e2", Some("a"), r#"{"n": -2}"#));
            server.send(commit(190, 200));
            until("all three sent", || b.pending() == 3).await;
            idle(2_000).await;
            assert!(
                server.confirmed() < 200,
                "nothing confirmed before the acks"
            );
            b.ack_all();
            until("the slot past them", || server.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let delivered = fx.broker.delivered();
    assert_eq!(delivered.len(), 3);
    // Magic byte, schema id 7, the zig-zag varint of n.
    assert_eq!(delivered[0].value.as_deref(), Some(&[0, 0, 0, 0, 7, 2][..]));
    assert_eq!(delivered[2].value.as_deref(), Some(&[0, 0, 0, 0, 7, 3][..]));
    for r in [&delivered[0], &delivered[2]] {
        assert_eq!(&*r.topic, "events");
        assert_eq!(key_of(r), "a", "the key stays the aggregate id");
        assert_eq!(header(r, "event_type"), Some("Created"));
    }
    assert_eq!(header(&delivered[0], "id"), Some("e0"));
    let copy = &delivered[1];
    assert_eq!(&*copy.topic, "dlq");
    assert_eq!(
        copy.value.as_deref(),
        Some(&br#"{"n": "one"}"#[..]),
        "as stored"
    );
    assert_eq!(header(copy, "walbox.error.kind"), Some("invalid"));
    assert_eq!(header(copy, "walbox.original.topic"), Some("events"));
    assert_eq!(header(copy, "walbox.event.id"), Some("e1"));
    let error = header(copy, "walbox.error").unwrap();
    assert!(
        error.starts_with("event e1 does not match schema 7 of subject \"events-value\": "),
        "{error}"
    );
    assert!(fx
        .metrics
        .encode()
        .contains("walbox_events_dead_lettered_total{topic=\"events\",kind=\"invalid\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn without_a_dead_letter_topic_an_invalid_event_stops_with_the_slot_before_it() {
    let (mut fx, _) = avro_fixture(DeadLetters::halt());
    let server = fx.source.session(10);
    let status = server.status_handle();
    let result = fx
        .run(|_stop| async move {
            let s = server;
            s.send(relation());
            s.send(begin(190));
            s.send(insert(100, "e0", Some("a"), r#"{"n": 1}"#));
            s.send(insert(110, "e1", Some("a"), r#"{}"#));
            s.send(commit(190, 200));
            idle(60_000).await;
            panic!("the relay should have stopped");
        })
        .await;
    let e = result.unwrap_err();
    assert!(
        matches!(e, RunError::Schema(SchemaError::Invalid { .. })),
        "{e}"
    );
    assert!(!e.is_transient());
    assert!(
        super::fakes::highest_confirmed(&status).unwrap_or(0) < 200,
        "the slot stays before e1's commit"
    );
}

#[tokio::test(start_paused = true)]
async fn a_registry_outage_stalls_the_stream_and_skips_nothing() {
    let (mut fx, memory) = avro_fixture(DeadLetters::halt());
    memory.lock().unwrap().down = true;
    let first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    let registry = Arc::clone(&memory);
    let metrics = Arc::clone(&fx.metrics);
    let result = fx
        .run(|stop| async move {
            for server in [&first, &second] {
                server.send(relation());
                server.send(begin(190));
                server.send(insert(100, "e0", Some("a"), r#"{"n": 1}"#));
                server.send(commit(190, 200));
            }
            until("the first session ended", || {
                metrics
                    .encode()
                    .contains("walbox_reconnects_total{reason=\"schema_registry\"} 1")
            })
            .await;
            assert!(first.confirmed() < 200, "nothing confirmed past e0");
            assert_eq!(b.pending(), 0, "nothing sent while the registry is down");
            registry.lock().unwrap().down = false;
            until("e0 sent by the next session", || b.pending() == 1).await;
            b.ack_all();
            until("the slot past e0", || second.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || second.closed()).await;
        })
        .await;
    result.unwrap();
    let delivered = fx.broker.delivered();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].value.as_deref(), Some(&[0, 0, 0, 0, 7, 2][..]));
    assert!(fx
        .metrics
        .encode()
        .contains("walbox_reconnects_total{reason=\"schema_registry\"} 1"));
}

#[tokio::test(start_paused = true)]
async fn a_record_waiting_for_room_is_serialized_once() {
    let (mut fx, memory) = avro_fixture(DeadLetters::halt());
    // One event in flight at a time: each next record is serialized, then
    // waits for room while the loop turns.
    fx = Fixture {
        config: fx.config.clone(),
        ..Fixture::new(DeadLetters::halt(), 1, 1024)
    };
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            for (i, lsn) in [100, 110, 120].into_iter().enumerate() {
                server.send(insert(lsn, &format!("e{i}"), Some("a"), r#"{"n": 1}"#));
            }
            server.send(commit(190, 200));
            for sent in 1..=3 {
                until("the next one sent", || b.pending() == 1).await;
                // Turns of the loop while the next record waits for room.
                idle(3_000).await;
                b.ack_all();
                until("acknowledged", || b.delivered().len() == sent).await;
            }
            until("the slot past them", || server.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    for r in fx.broker.delivered() {
        assert_eq!(r.value.as_deref(), Some(&[0, 0, 0, 0, 7, 2][..]));
    }
    assert_eq!(
        memory.lock().unwrap().lookups,
        1,
        "one lookup, then the cache"
    );
}

/// The value `{"n": n}` serialized with schema 7: magic, id, zig-zag n.
fn avro_n(n: i64) -> Vec<u8> {
    vec![0, 0, 0, 0, 7, ((n << 1) ^ (n >> 63)) as u8]
}

#[tokio::test(start_paused = true)]
async fn with_the_quarantine_an_invalid_event_holds_its_aggregate_and_a_release_serializes_once() {
    let (mut fx, _) = avro_fixture(DeadLetters::halt());
    fx.config.quarantine = Some(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "a1", Some("a"), r#"{"n": 1}"#));
            server.send(insert(110, "b1", Some("b"), r#"{"n": 2}"#));
            server.send(commit(190, 200));
            until("both sent", || b.pending() == 2).await;
            // a1 went out serialized and is refused: held as it was sent.
            assert!(b.refuse_key("a"));
            assert!(b.ack_key("b"));
            // a2 is held behind a1 before it is serialized; b2 does not fit
            // its schema and holds b, with b3 behind it.
            server.send(begin(290));
            server.send(insert(200, "a2", Some("a"), r#"{"n": 3}"#));
            server.send(insert(210, "b2", Some("b"), r#"{"n": "four"}"#));
            server.send(insert(220, "b3", Some("b"), r#"{"n": 5}"#));
            server.send(commit(290, 300));
            until("the slot past both", || server.confirmed() == 300).await;
            assert_eq!(db.held_ids("a"), ["a1", "a2"]);
            assert_eq!(db.held_ids("b"), ["b2", "b3"]);
            assert_eq!(b.pending(), 0);

            // Released: a1 as it was held, a2 serialized now.
            assert!(db.request("a", Request::Release));
            until("a1 sent", || b.pending() == 1).await;
            b.ack_all();
            until("a2 sent", || b.pending() == 1).await;
            b.ack_all();
            until("a flows again", || db.held_keys() == ["b"]).await;

            // b2 still does not fit: the release stops, nothing of b is sent.
            assert!(db.request("b", Request::Release));
            until("the release failed", || {
                !db.held.lock().unwrap().failed_releases.is_empty()
            })
            .await;
            assert_eq!(b.pending(), 0);
            assert_eq!(db.held_ids("b"), ["b2", "b3"]);
            // Fixed in the table, as an operator does with SQL; released.
            for e in db.held.lock().unwrap().events.values_mut() {
                if header(&e.record, "id") == Some("b2") {
                    e.record.value = Some(bytes::Bytes::from_static(br#"{"n": 4}"#));
                }
            }
            assert!(db.request("b", Request::Release));
            until("b2 sent", || b.pending() == 1).await;
            b.ack_all();
            until("b3 sent", || b.pending() == 1).await;
            b.ack_all();
            until("nothing held", || db.held_keys().is_empty()).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let values = |key: &str| -> Vec<Vec<u8>> {
        fx.broker
            .delivered()
            .iter()
            .filter(|r| key_of(r) == key)
            .map(|r| r.value.as_deref().unwrap().to_vec())
            .collect()
    };
    assert_eq!(values("a"), [avro_n(1), avro_n(3)]);
    assert_eq!(values("b"), [avro_n(2), avro_n(4), avro_n(5)]);
}

/// A record the broker refused is held as it was sent, and released as it
/// was sent: a claim-check pointer (JSON, no wire-format magic byte) is not
/// serialized again against the subject's schema. (Released values were
/// told serialized by their first byte: the pointer failed its schema and
/// the release failed forever.)
#[tokio::test(start_paused = true)]
async fn a_refused_record_is_released_as_it_was_sent_even_a_claim_check_pointer() {
    let (mut fx, _) = avro_fixture(DeadLetters::halt());
    fx.config.quarantine = Some(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let pointer: &[u8] = br#"{"claim_check":{"bucket":"b","key":"k","size":2000000}}"#;
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "a1", Some("a"), r#"{"n": 1}"#));
            server.send(commit(190, 200));
            until("a1 sent", || b.pending() == 1).await;
            assert!(b.refuse_key("a"));
            until("a1 held", || server.confirmed() == 200).await;
            // What the sink returns for a claim-checked record: the pointer
            // it sent in place of the value.
            for e in db.held.lock().unwrap().events.values_mut() {
                assert_eq!(e.kind, "refused");
                e.record.value = Some(bytes::Bytes::from_static(pointer));
            }
            assert!(db.request("a", Request::Release));
            until("a1 sent again", || b.pending() == 1).await;
            b.ack_all();
            until("a flows again", || db.held_keys().is_empty()).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let delivered = fx.broker.delivered();
    assert_eq!(delivered.len(), 1);
    assert_eq!(delivered[0].value.as_deref(), Some(pointer));
}
