//! What counts as delivered, synchronously: transactions confirm in commit
//! order, an unmappable or refused event goes to the dead-letter topic (and
//! counts only once its copy is acked) or stops the relay before it.

use std::time::Duration;

use sink_core::{DeliveryError, DeliveryErrorKind, Record, Report};

use super::{acked, config, confirmable, feed, records, report, rows, started};
use crate::dead_letter::{headers, DeadLetters};
use crate::metrics::latency::LatencySummary;
use crate::relay::tests::fakes::{begin, commit, header, insert, key_of, relation};
use crate::relay::{RunError, Token};

fn refusal() -> DeliveryError {
    DeliveryError {
        kind: DeliveryErrorKind::Permanent,
        message: "Broker: Topic authorization failed".into(),
    }
}

/// The broker refuses `record` for good, handing it back.
fn refused(record: Record<Token>) -> Report<Token> {
    let mut report = super::refused(record);
    report.result = Err(refusal());
    report
}

#[test]
fn a_zero_event_transaction_between_two_with_events_waits_its_turn() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 10);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("e1", Some("a"))], false));
    // No events (another table's change).
    feed(&mut core, vec![begin(290), commit(290, 300)]);
    feed(&mut core, rows(390, &[("e3", Some("c"))], false));
    let [t1, t3] = <[Record<Token>; 2]>::try_from(records(&mut core)).expect("two records");
    report(&mut core, acked(t3.token)).unwrap();
    assert_eq!(
        confirmable(&mut core),
        10,
        "T1 is unacked: neither T2 nor T3 may be confirmed"
    );
    report(&mut core, acked(t1.token)).unwrap();
    assert_eq!(confirmable(&mut core), 400, "all three");
    // Commit to read counts events: the empty transaction adds none.
    let read = core.metrics().commit_to_read_exact.summary().unwrap();
    assert_eq!(read.events, 2);
}

#[test]
fn an_acked_events_latency_is_split_into_walbox_part_and_the_clients() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 10);
    feed(&mut core, vec![relation()]);
    feed(
        &mut core,
        rows(190, &[("e1", Some("a")), ("e2", Some("b"))], false),
    );
    // Read, then sent 2 ms later (as if waiting for room in flight).
    core.advance(Duration::from_millis(2));
    let [r1, r2] = <[Record<Token>; 2]>::try_from(records(&mut core)).expect("two records");
    core.advance(Duration::from_millis(5));
    // The client held the first for 4 of those 5 ms; of the second it
    // says nothing.
    let mut first = acked(r1.token);
    first.client_micros = Some(4_000);
    report(&mut core, first).unwrap();
    report(&mut core, acked(r2.token)).unwrap();
    let s = core.metrics().read_to_ack_split.summary().unwrap();
    // Events and max, to the histograms' three digits.
    let seen = |l: Option<LatencySummary>| {
        let l = l.expect("recorded");
        (l.events, (l.max_ms * 100.0).round() / 100.0)
    };
    assert_eq!(seen(s.read_to_send), (2, 2.0));
    assert_eq!(seen(s.read_to_ack), (2, 7.0));
    assert_eq!(seen(s.client), (1, 4.0));
    assert_eq!(seen(s.walbox), (1, 3.0), "7 ms less the client's 4");
}

#[test]
fn an_unmappable_row_halts_without_a_dead_letter_topic_and_holds_the_slot() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 10);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("e1", Some("a"))], false));
    for r in records(&mut core) {
        report(&mut core, acked(r.token)).unwrap();
    }
    let mut bad = rows(290, &[("bad", None)], false);
    let commit = bad.pop().unwrap();
    let row = bad.pop().unwrap();
    feed(&mut core, bad);
    let e = core.message(row).unwrap_err().to_string();
    drop(commit);
    assert!(
        e.contains("event bad: column \"aggregate_id\" (the aggregate id) is NULL"),
        "{e}"
    );
    assert_eq!(
        confirmable(&mut core),
        200,
        "confirmed up to the good transaction, not past the bad row"
    );
}

#[test]
fn undeliverable_events_go_to_the_dead_letter_topic_with_one_header_set() {
    let config = config(DeadLetters::to_topic("dlq"), None);
    let mut core = started(&config, 10);
    feed(
        &mut core,
        vec![
            relation(),
            begin(190),
            insert(110, "unmappable", None, "{\"n\": 1}"),
            insert(120, "refused", Some("a"), "{\"n\": 2}"),
            insert(130, "fine", Some("b"), "{}"),
            commit(190, 200),
        ],
    );
    let [unmappable, to_refuse, fine] =
        <[Record<Token>; 3]>::try_from(records(&mut core)).expect("three records");
    assert_eq!(
        &*unmappable.topic, "dlq",
        "an unmappable row goes as its copy"
    );
    report(&mut core, acked(unmappable.token.clone())).unwrap();
    report(&mut core, refused(to_refuse)).unwrap();
    let [copy] =
        <[Record<Token>; 1]>::try_from(records(&mut core)).expect("the refused record's copy");
    report(&mut core, acked(fine.token.clone())).unwrap();
    assert_eq!(
        confirmable(&mut core),
        10,
        "the refused event counts only once its copy is acked"
    );
    report(&mut core, acked(copy.token.clone())).unwrap();
    assert_eq!(confirmable(&mut core), 200);
    for (r, kind, id, lsn) in [
        (&unmappable, "unmappable", "unmappable", "0/6E"),
        (&copy, "refused", "refused", "0/78"),
    ] {
        assert_eq!(&*r.topic, "dlq");
        assert_eq!(header(r, headers::ERROR_KIND), Some(kind));
        assert_eq!(header(r, headers::EVENT_ID), Some(id));
        assert_eq!(header(r, headers::ORIGINAL_TOPIC), Some("events"));
        assert_eq!(header(r, headers::SOURCE_LSN), Some(lsn));
        assert!(header(r, headers::ERROR).is_some_and(|e| !e.is_empty()));
    }
    assert_eq!(unmappable.value.as_deref(), Some(b"{\"n\": 1}".as_slice()));
    assert_eq!(key_of(&copy), "a", "a refused record keeps its key");
    assert_eq!(header(&copy, "id"), Some("refused"), "and its own headers");
    let text = core.metrics().encode();
    assert!(
        text.contains("walbox_events_published_total{topic=\"events\"} 1"),
        "{text}"
    );
    for kind in ["unmappable", "refused"] {
        let line =
            format!("walbox_events_dead_lettered_total{{topic=\"events\",kind=\"{kind}\"}} 1");
        assert!(text.contains(&line), "{text}");
    }
}

#[test]
fn a_refused_event_without_a_dead_letter_topic_halts_and_holds_the_slot() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 10);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("e1", Some("a"))], false));
    let [record] = <[Record<Token>; 1]>::try_from(records(&mut core)).expect("one record");
    let result = report(&mut core, refused(record));
    assert!(matches!(result, Err(RunError::Delivery(_))), "{result:?}");
    assert_eq!(confirmable(&mut core), 10);
    assert!(core
        .metrics()
        .encode()
        .contains("walbox_events_failed_total{topic=\"events\",kind=\"permanent\"} 1"));
}
