//! The relay with logical decoding messages as events (`source = messages`
//! or `both`), against the in-memory fakes.

use super::fakes::{self, begin, commit, envelope, header, insert, key_of, message, relation};
use super::{idle, until, Fixture};
use crate::config::EventSource;
use crate::dead_letter::{headers, DeadLetters};
use crate::mapping::MapError;
use crate::relay::{RunError, Stop};

fn fixture(source: EventSource, dead_letters: DeadLetters) -> Fixture {
    let mut fx = Fixture::new(dead_letters, 100, 1024);
    fx.config.source = source;
    fx
}

#[tokio::test(start_paused = true)]
async fn rows_and_messages_of_one_transaction_go_out_in_wal_order() {
    let mut fx = fixture(EventSource::Both, DeadLetters::halt());
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        server.send(relation());
        server.send(begin(190));
        server.send(insert(110, "row-1", Some("a"), r#"{"n":1}"#));
        server.send(message(
            120,
            true,
            "walbox",
            &envelope("msg-2", "a", r#"{"n":2}"#),
        ));
        server.send(insert(130, "row-3", Some("b"), r#"{"n":3}"#));
        server.send(message(
            140,
            true,
            "walbox",
            &envelope("msg-4", "a", r#"{"n":4}"#),
        ));
        server.send(commit(190, 200));
        until("4 sent", || b.pending() == 4).await;
        // Sent, not acked: the slot stays before the transaction.
        idle(1500).await;
        assert_eq!(server.confirmed(), 10);
        b.ack_all();
        until("confirmed", || server.confirmed() == 200).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    let delivered = fx.broker.delivered();
    let got: Vec<_> = delivered
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
    assert!(delivered
        .iter()
        .all(|r| header(r, "event_type") == Some("Created") && &*r.topic == "events"));
}

#[tokio::test(start_paused = true)]
async fn only_transactional_messages_with_the_prefix_are_events() {
    let mut fx = fixture(EventSource::Messages, DeadLetters::halt());
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let metrics = fx.metrics.clone();
    fx.run(|stop| async move {
        // Sent at once, outside any transaction: not an event, but the
        // position moves past it.
        server.send(message(50, false, "walbox", &envelope("loose", "a", "{}")));
        server.send(relation());
        server.send(begin(190));
        server.send(insert(110, "a-row", Some("a"), "{}")); // source = messages: not an event
        server.send(message(120, true, "other-app", "anything at all"));
        server.send(message(130, true, "walbox", &envelope("m1", "a", "{}")));
        server.send(commit(190, 200));
        until("1 sent", || b.pending() == 1).await;
        b.ack_all();
        until("confirmed", || server.confirmed() == 200).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    let ids: Vec<_> = fx
        .broker
        .delivered()
        .iter()
        .map(|r| header(r, "id").unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["m1"]);
    assert!(
        metrics
            .encode()
            .contains("walbox_nontransactional_messages_total 1"),
        "{}",
        metrics.encode()
    );
}

#[tokio::test(start_paused = true)]
async fn with_source_table_messages_are_not_events() {
    let mut fx = fixture(EventSource::Table, DeadLetters::halt());
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        server.send(relation());
        server.send(begin(190));
        server.send(message(110, true, "walbox", &envelope("m1", "a", "{}")));
        server.send(insert(120, "r1", Some("a"), "{}"));
        server.send(commit(190, 200));
        until("1 sent", || b.pending() == 1).await;
        b.ack_all();
        until("confirmed", || server.confirmed() == 200).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    let delivered = fx.broker.delivered();
    assert_eq!(delivered.len(), 1);
    assert_eq!(header(&delivered[0], "id"), Some("r1"));
}

#[tokio::test(start_paused = true)]
async fn a_bad_envelope_stops_walbox_before_it_without_a_dead_letter_topic() {
    let mut fx = fixture(EventSource::Messages, DeadLetters::halt());
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let status = server.status_handle();
    let result = fx
        .run(|_stop| async move {
            server.send(begin(190));
            server.send(message(110, true, "walbox", &envelope("ok", "a", "{}")));
            server.send(commit(190, 200));
            until("1 sent", || b.pending() == 1).await;
            b.ack_all();
            server.send(begin(290));
            server.send(message(
                210,
                true,
                "walbox",
                r#"{"v":2,"id":"from-the-future"}"#,
            ));
            server.send(commit(290, 300));
            idle(60_000).await;
            panic!("the relay should have stopped");
        })
        .await;
    match result {
        Err(RunError::Map(MapError::Envelope { lsn, reason })) => {
            assert_eq!(lsn, "0/D2");
            assert!(
                reason.contains("event from-the-future: envelope version 2"),
                "{reason}"
            );
        }
        other => panic!("expected the envelope error, got {other:?}"),
    }
    let confirmed = fakes::highest_confirmed(&status);
    assert_eq!(
        confirmed,
        Some(200),
        "confirmed up to the good transaction, not past the bad message"
    );
}

#[tokio::test(start_paused = true)]
async fn a_bad_envelope_goes_whole_to_the_dead_letter_topic() {
    let mut fx = fixture(EventSource::Messages, DeadLetters::to_topic("dlq"));
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let bad = r#"{"v":1,"id":"no-key","aggregate_type":"order"}"#;
    fx.run(|stop| async move {
        server.send(begin(190));
        server.send(message(110, true, "walbox", bad));
        server.send(message(120, true, "walbox", &envelope("fine", "b", "{}")));
        server.send(commit(190, 200));
        until("2 sent", || b.pending() == 2).await;
        b.ack_all();
        until("confirmed", || server.confirmed() == 200).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    let delivered = fx.broker.delivered();
    assert_eq!(delivered.len(), 2);
    let dead = &delivered[0];
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
    assert_eq!(header(&delivered[1], "id"), Some("fine"));
}
