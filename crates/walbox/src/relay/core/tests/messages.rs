//! Logical decoding messages as events (`source = messages` or `both`),
//! synchronously: which messages are events, in what order, and what a bad
//! envelope does.

use super::{acked, config, confirmable, deliver, feed, records, report, started};
use crate::config::EventSource;
use crate::dead_letter::{headers, DeadLetters};
use crate::mapping::MapError;
use crate::relay::tests::fakes::{
    begin, commit, envelope, header, insert, key_of, message, relation,
};
use crate::relay::{RelayConfig, RunError};

fn with_source(source: EventSource, dead_letters: DeadLetters) -> RelayConfig {
    RelayConfig {
        stream: std::sync::Arc::from("walbox"),
        source,
        ..config(dead_letters, None)
    }
}

#[test]
fn rows_and_messages_of_one_transaction_go_out_in_wal_order() {
    let config = with_source(EventSource::Both, DeadLetters::halt());
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            relation(),
            begin(190),
            insert(110, "row-1", Some("a"), r#"{"n":1}"#),
            message(120, true, "walbox", &envelope("msg-2", "a", r#"{"n":2}"#)),
            insert(130, "row-3", Some("b"), r#"{"n":3}"#),
            message(140, true, "walbox", &envelope("msg-4", "a", r#"{"n":4}"#)),
            commit(190, 200),
        ],
    );
    let records: Vec<_> = records(&mut core);
    // Sent, not acked: the slot stays before the transaction.
    assert_eq!(confirmable(&mut core), 10);
    for r in &records {
        report(&mut core, acked(r.token.clone())).unwrap();
    }
    assert_eq!(confirmable(&mut core), 200);
    let got: Vec<_> = records
        .iter()
        .map(|r| {
            (
                header(r, "id").unwrap(),
                key_of(r),
                std::str::from_utf8(r.value.as_deref().unwrap()).unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("row-1", "a".to_owned(), r#"{"n":1}"#),
            ("msg-2", "a".to_owned(), r#"{"n":2}"#),
            ("row-3", "b".to_owned(), r#"{"n":3}"#),
            ("msg-4", "a".to_owned(), r#"{"n":4}"#),
        ]
    );
    assert!(records
        .iter()
        .all(|r| header(r, "event_type") == Some("Created") && &*r.topic == "events"));
}

#[test]
fn only_transactional_messages_with_the_prefix_are_events() {
    let config = with_source(EventSource::Messages, DeadLetters::halt());
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            // Sent at once, outside any transaction: not an event, but the
            // position moves past it.
            message(50, false, "walbox", &envelope("loose", "a", "{}")),
            relation(),
            begin(190),
            // source = messages: a row is not an event.
            insert(110, "a-row", Some("a"), "{}"),
            message(120, true, "other-app", "anything at all"),
            message(130, true, "walbox", &envelope("m1", "a", "{}")),
            commit(190, 200),
        ],
    );
    let records = deliver(&mut core);
    let ids: Vec<_> = records.iter().map(|r| header(r, "id").unwrap()).collect();
    assert_eq!(ids, ["m1"]);
    assert_eq!(confirmable(&mut core), 200);
    let metrics = core.metrics().encode();
    assert!(
        metrics.contains("walbox_nontransactional_messages_total 1"),
        "{metrics}"
    );
}

#[test]
fn with_source_table_messages_are_not_events() {
    let config = with_source(EventSource::Table, DeadLetters::halt());
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            relation(),
            begin(190),
            message(110, true, "walbox", &envelope("m1", "a", "{}")),
            insert(120, "r1", Some("a"), "{}"),
            commit(190, 200),
        ],
    );
    let records = deliver(&mut core);
    assert_eq!(records.len(), 1);
    assert_eq!(header(&records[0], "id"), Some("r1"));
    assert_eq!(confirmable(&mut core), 200);
}

#[test]
fn a_bad_envelope_stops_walbox_before_it_without_a_dead_letter_topic() {
    let config = with_source(EventSource::Messages, DeadLetters::halt());
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            begin(190),
            message(110, true, "walbox", &envelope("ok", "a", "{}")),
            commit(190, 200),
        ],
    );
    deliver(&mut core);
    feed(&mut core, vec![begin(290)]);
    let bad = message(210, true, "walbox", r#"{"v":2,"id":"from-the-future"}"#);
    match core.message(bad) {
        Err(RunError::Map(MapError::Envelope { lsn, reason })) => {
            assert_eq!(lsn, "0/D2");
            assert!(
                reason.contains("event from-the-future: envelope version 2"),
                "{reason}"
            );
        }
        other => panic!("expected the envelope error, got {other:?}"),
    }
    assert_eq!(
        confirmable(&mut core),
        200,
        "confirmed up to the good transaction, not past the bad message"
    );
}

#[test]
fn a_bad_envelope_goes_whole_to_the_dead_letter_topic() {
    let config = with_source(EventSource::Messages, DeadLetters::to_topic("dlq"));
    let mut core = started(&config, 10);
    let bad = r#"{"v":1,"id":"no-key","aggregate_type":"order"}"#;
    feed(
        &mut core,
        vec![
            begin(190),
            message(110, true, "walbox", bad),
            message(120, true, "walbox", &envelope("fine", "b", "{}")),
            commit(190, 200),
        ],
    );
    let records = deliver(&mut core);
    assert_eq!(records.len(), 2);
    let dead = &records[0];
    assert_eq!(&*dead.topic, "dlq");
    assert_eq!(header(dead, headers::ERROR_KIND), Some("unmappable"));
    assert_eq!(header(dead, headers::EVENT_ID), Some("no-key"));
    assert_eq!(header(dead, headers::SOURCE_LSN), Some("0/6E"));
    assert!(header(dead, headers::ERROR).is_some_and(|e| e.contains("aggregate_id")));
    assert_eq!(
        dead.value.as_deref(),
        Some(bad.as_bytes()),
        "the whole envelope"
    );
    assert_eq!(header(&records[1], "id"), Some("fine"));
    assert_eq!(confirmable(&mut core), 200);
}
