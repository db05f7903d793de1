//! Exactly-once in the core, synchronously: a refusal fails the Kafka
//! transaction, and its replay dead-letters exactly the refused event.

use std::time::Duration;

use sink_core::{DeliveryError, DeliveryErrorKind, Record, Report};

use super::{
    acked, config, confirmable, feed, records, report, rows, start, started, transactions, Harness,
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
fn commit_all(core: &mut Harness<'_>, mut sent: Vec<Record<Token>>) -> Vec<(String, String)> {
    core.upkeep(true, sent.len()).unwrap();
    sent.extend(records(core));
    core.upkeep(true, sent.len()).unwrap();
    assert_eq!(core.commits, 1, "the progress record was sent: commit");
    for r in &sent {
        report(core, acked(r.token.clone())).unwrap();
    }
    core.committed(Ok(())).unwrap();
    sent.iter()
        .filter(|r| !r.token.is_progress())
        .map(|r| (r.topic.to_string(), header(r, "id").unwrap().to_owned()))
        .collect()
}

/// The session ends after its transaction failed: everything sent has
/// reported; the transaction is aborted.
fn abort(core: &mut Harness<'_>) -> RunError {
    let e = core.upkeep(false, 0).expect_err("the transaction failed");
    assert!(core.abort_needed());
    assert!(core.on_aborted(Ok(()), 1).unwrap());
    e
}

/// `config` with status updates an hour apart: the core's other timers
/// show in [`Harness::poll_timeout`].
fn quiet(config: crate::relay::RelayConfig) -> crate::relay::RelayConfig {
    crate::relay::RelayConfig {
        status_interval: Duration::from_secs(3600),
        ..config
    }
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
    let config = quiet(config(DeadLetters::to_topic("dlq"), transactions(100)));
    let mut core = started(&config, 10);
    let events = [("e1", Some("a")), ("e2", Some("b"))];
    feed(
        &mut core,
        [vec![relation()], rows(190, &events, false)].concat(),
    );
    let [e1, _e2] = <[Record<Token>; 2]>::try_from(records(&mut core)).expect("two records");
    let t0 = core.now();
    report(&mut core, refused(e1)).unwrap();
    assert!(core.upkeep(false, 1).is_ok(), "e2 may still report");
    assert!(
        core.upkeep(false, 0).is_err(),
        "every record reported: at once"
    );
    assert_eq!(
        core.poll_timeout(),
        Some(t0 + Duration::from_secs(5)),
        "the driver is woken when the wait ends, whether a report comes or not"
    );
    core.advance(Duration::from_millis(4_999));
    assert!(core.upkeep(false, 1).is_ok(), "e2 may still report");
    core.advance(Duration::from_millis(1));
    let e = core
        .upkeep(false, 1)
        .expect_err("five seconds after the failure");
    assert!(
        matches!(e, RunError::Aborted(AbortCause::Refused(_))),
        "{e}"
    );
}

/// On the test's own clock: an open transaction closes when its time bound
/// passed since its first record (60 s here), not before, however few
/// events it holds; closing queues its progress record.
#[test]
fn a_transaction_closes_when_its_time_bound_passed_since_its_first_record() {
    let config = quiet(config(DeadLetters::halt(), transactions(100)));
    let mut core = started(&config, 10);
    feed(
        &mut core,
        [vec![relation()], rows(190, &[("e1", Some("a"))], false)].concat(),
    );
    let t0 = core.now();
    let first = core.take_send().expect("e1 waits");
    assert!(first.begin_transaction, "the first record begins one");
    assert_eq!(
        core.poll_timeout(),
        Some(t0 + Duration::from_secs(60)),
        "the driver is woken at the bound"
    );
    core.advance(Duration::from_millis(59_999));
    core.upkeep(false, 1).unwrap();
    assert!(core.take_send().is_none(), "still open");
    core.advance(Duration::from_millis(1));
    core.upkeep(false, 1).unwrap();
    let progress = core.take_send().expect("closed");
    assert!(progress.record.token.is_progress());
    assert!(
        !progress.begin_transaction,
        "inside the closing transaction"
    );
}

/// Sends what waits, lets the open transaction close if it is due, sends
/// its progress record, and acks everything: true when a commit was asked
/// for (it is then carried out).
fn turn(core: &mut Harness<'_>) -> bool {
    let mut sent = records(core);
    core.upkeep(false, sent.len()).unwrap();
    sent.extend(records(core));
    core.upkeep(false, sent.len()).unwrap();
    for r in &sent {
        report(core, acked(r.token.clone())).unwrap();
    }
    if core.commits == 0 {
        return false;
    }
    core.committed(Ok(())).unwrap();
    true
}

/// On the test's own clock (interval 10 s, bound 60 s): once walbox has
/// read all there was, an event that comes alone commits at once; one that
/// follows a commit by less than the interval waits for the interval,
/// counted from that commit's start; one read while more was waiting waits
/// for the time bound.
#[test]
fn the_commit_cadence_follows_the_rate() {
    let config = quiet(config(DeadLetters::halt(), transactions(100)));
    let mut core = started(&config, 10);
    let t0 = core.now();
    feed(
        &mut core,
        [vec![relation()], rows(190, &[("e1", Some("a"))], false)].concat(),
    );
    core.read_caught_up(true);
    assert!(turn(&mut core), "alone and caught up: committed at once");
    assert_eq!(confirmable(&mut core), 200);

    // A second event a second after that commit began.
    core.advance(Duration::from_secs(1));
    feed(&mut core, rows(290, &[("e2", Some("b"))], false));
    core.read_caught_up(true);
    assert!(!turn(&mut core), "within the interval: still open");
    assert_eq!(
        core.poll_timeout(),
        Some(t0 + Duration::from_secs(10)),
        "the driver is woken when the interval has passed"
    );
    core.advance(Duration::from_millis(8_999));
    assert!(!turn(&mut core), "still within the interval");
    core.advance(Duration::from_millis(1));
    assert!(
        turn(&mut core),
        "the interval passed since the last commit began"
    );
    assert_eq!(confirmable(&mut core), 300);

    // A commit slower than the interval: what follows it commits at once.
    core.advance(Duration::from_secs(10));
    let t1 = core.now();
    feed(&mut core, rows(390, &[("e3", Some("c"))], false));
    core.read_caught_up(true);
    let mut sent = records(&mut core);
    core.upkeep(false, sent.len()).unwrap();
    sent.extend(records(&mut core));
    core.upkeep(false, sent.len()).unwrap();
    assert_eq!(core.commits, 1, "e3's commit asked for at {t1:?}");
    core.advance(Duration::from_secs(15));
    core.committed(Ok(())).unwrap();
    feed(&mut core, rows(490, &[("e4", Some("d"))], false));
    core.read_caught_up(true);
    assert!(turn(&mut core), "the interval passed while e3 committed");

    // Read while more was waiting: the time bound (60 s), whatever the
    // interval.
    core.advance(Duration::from_secs(20));
    let t2 = core.now();
    feed(&mut core, rows(590, &[("e5", Some("e"))], false));
    core.read_caught_up(false);
    assert!(!turn(&mut core), "not caught up: open");
    assert_eq!(core.poll_timeout(), Some(t2 + Duration::from_secs(60)));
    core.advance(Duration::from_secs(59));
    assert!(!turn(&mut core), "not caught up: open until the bound");
    core.read_caught_up(true);
    assert!(turn(&mut core), "caught up, the interval long passed");
    assert_eq!(confirmable(&mut core), 600);
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
