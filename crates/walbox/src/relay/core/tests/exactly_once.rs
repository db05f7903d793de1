//! Exactly-once in the core, synchronously: a refusal fails the Kafka
//! transaction, and its replay dead-letters exactly the refused event.

use pgoutput_decoder::PgTimestamp;
use sink_core::{DeliveryError, DeliveryErrorKind, Record, Report};
use tokio::time::Instant;

use super::{
    acked, config, confirmable, feed, records, report, rows, start, started, transactions, Core,
};
use crate::dead_letter::DeadLetters;
use crate::relay::tests::fakes::{header, relation};
use crate::relay::{AbortCause, RunError, Token};

fn refused(record: Record<Token>) -> Report<Token> {
    let mut report = super::refused(record);
    report.result = Err(DeliveryError {
        kind: DeliveryErrorKind::Permanent,
        message: "record too large".into(),
    });
    report
}

/// Closes the open Kafka transaction (as at a graceful end), sends its
/// progress record, acks everything sent and commits: what the records of
/// the transaction were, by topic and id.
fn commit_all(core: &mut Core<'_>, mut sent: Vec<Record<Token>>) -> Vec<(String, String)> {
    core.close_if_due(Instant::now(), true);
    sent.extend(records(core));
    assert!(
        core.start_commit(Instant::now()),
        "the progress record was sent"
    );
    for r in &sent {
        report(core, acked(r.token.clone())).unwrap();
    }
    core.on_committed(Ok(()), Instant::now(), PgTimestamp::now())
        .unwrap();
    sent.iter()
        .filter(|r| !r.token.progress_record)
        .map(|r| (r.topic.to_string(), header(r, "id").unwrap().to_owned()))
        .collect()
}

/// The session ends after its transaction failed: everything sent has
/// reported; the transaction is aborted.
fn abort(core: &mut Core<'_>) -> RunError {
    let e = core
        .doomed_and_heard(0, Instant::now())
        .expect("the transaction failed");
    assert!(core.abort_needed());
    assert!(core.on_aborted(Ok(()), 1).unwrap());
    e
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(t, id)| ((*t).to_owned(), (*id).to_owned()))
        .collect()
}

#[test]
fn an_event_refused_for_good_is_dead_lettered_in_the_replayed_transaction() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let events = [("e1", Some("a")), ("e2", Some("b"))];
    feed(
        &mut core,
        [vec![relation()], rows(190, &events, false)].concat(),
    );
    let [e1, e2] = <[Record<Token>; 2]>::try_from(records(&mut core)).expect("two records");
    report(&mut core, refused(e1)).unwrap();
    report(&mut core, acked(e2.token)).unwrap();
    let e = abort(&mut core);
    assert!(
        matches!(e, RunError::Aborted(AbortCause::Refused(_))),
        "{e}"
    );
    assert_eq!(confirmable(&mut core), 10, "nothing committed");
    // The new session's replay: the refused event goes to the dead-letter
    // topic, inside the new transaction.
    start(&mut core, 10);
    feed(
        &mut core,
        [vec![relation()], rows(190, &events, false)].concat(),
    );
    let replay = records(&mut core);
    assert_eq!(
        commit_all(&mut core, replay),
        pairs(&[("dlq", "e1"), ("events", "e2")])
    );
    assert_eq!(confirmable(&mut core), 200);
}

/// On the test's own clock (the core reads none): a failed transaction
/// ends the session once every record sent in it has reported, or
/// `DOOMED_WAIT` (5 s) after the failure when one never reports.
#[test]
fn a_failed_transaction_waits_for_its_reports_five_seconds_at_most() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let events = [("e1", Some("a")), ("e2", Some("b"))];
    feed(
        &mut core,
        [vec![relation()], rows(190, &events, false)].concat(),
    );
    let [e1, _e2] = <[Record<Token>; 2]>::try_from(records(&mut core)).expect("two records");
    let t0 = Instant::now();
    core.on_report(refused(e1), t0, PgTimestamp::default())
        .unwrap();
    let waited = |s: u64, ms: u64| {
        t0 + std::time::Duration::from_secs(s) + std::time::Duration::from_millis(ms)
    };
    assert!(
        core.doomed_and_heard(1, waited(4, 999)).is_none(),
        "e2 may still report"
    );
    let e = core
        .doomed_and_heard(1, waited(5, 0))
        .expect("five seconds after the failure");
    assert!(
        matches!(e, RunError::Aborted(AbortCause::Refused(_))),
        "{e}"
    );
    assert!(
        core.doomed_and_heard(0, t0).is_some(),
        "every record reported: at once"
    );
}

/// On the test's own clock: an open transaction closes when its time bound
/// passed since its first record (60 s here), not before, however few
/// events it holds; closing queues its progress record.
#[test]
fn a_transaction_closes_when_its_time_bound_passed_since_its_first_record() {
    let config = config(DeadLetters::halt(), transactions(100));
    let mut core = started(&config, 10);
    feed(
        &mut core,
        [vec![relation()], rows(190, &[("e1", Some("a"))], false)].concat(),
    );
    let t0 = Instant::now();
    let first = core.take_send(t0).expect("e1 waits");
    assert!(first.begin_transaction, "the first record begins one");
    let later = |s: u64, ms: u64| {
        t0 + std::time::Duration::from_secs(s) + std::time::Duration::from_millis(ms)
    };
    core.close_if_due(later(59, 999), false);
    assert!(core.take_send(later(59, 999)).is_none(), "still open");
    core.close_if_due(later(60, 0), false);
    let progress = core.take_send(later(60, 0)).expect("closed");
    assert!(progress.record.token.progress_record);
    assert!(
        !progress.begin_transaction,
        "inside the closing transaction"
    );
}

#[test]
fn a_refused_row_of_a_copy_is_dead_lettered_alone() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let copied = [("e1", Some("a")), ("e2", Some("b")), ("e3", Some("c"))];
    feed(
        &mut core,
        [vec![relation()], rows(190, &copied, true)].concat(),
    );
    let [e1, e2, _e3] = <[Record<Token>; 3]>::try_from(records(&mut core)).expect("three");
    report(&mut core, acked(e1.token)).unwrap();
    report(&mut core, refused(e2)).unwrap();
    abort(&mut core);
    start(&mut core, 10);
    feed(
        &mut core,
        [vec![relation()], rows(190, &copied, true)].concat(),
    );
    let replay = records(&mut core);
    assert_eq!(
        commit_all(&mut core, replay),
        pairs(&[("events", "e1"), ("dlq", "e2"), ("events", "e3")]),
        "the rows share one WAL position: the refused one is told by its index"
    );
    assert_eq!(confirmable(&mut core), 200);
}

#[test]
fn without_a_dead_letter_topic_a_refused_event_stops_walbox_before_it() {
    let config = config(DeadLetters::halt(), transactions(100));
    let mut core = started(&config, 10);
    feed(
        &mut core,
        [
            vec![relation()],
            rows(190, &[("e1", Some("a")), ("e2", Some("b"))], false),
        ]
        .concat(),
    );
    let e1 = records(&mut core).remove(0);
    let result = report(&mut core, refused(e1));
    assert!(matches!(result, Err(RunError::Delivery(_))), "{result:?}");
    assert_eq!(confirmable(&mut core), 10);
}
