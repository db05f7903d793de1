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
    core.upkeep(false, sent.len()).unwrap();
    assert_eq!(
        core.commits, 0,
        "records not yet reported: a refusal may still come, no commit"
    );
    for r in &sent {
        report(core, acked(r.token.clone())).unwrap();
    }
    core.upkeep(false, 0).unwrap();
    assert_eq!(core.commits, 1, "every record reported: commit");
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

/// Two events, e1 and e2, of one Postgres transaction, read and sent.
fn send_two(core: &mut Harness<'_>) -> [Record<Token>; 2] {
    feed(core, [vec![relation()], rows(190, &TWO, false)].concat());
    <[Record<Token>; 2]>::try_from(records(core)).expect("two records")
}

/// A new session's replay of [`send_two`]'s transaction, committed: what
/// went where.
fn replay_two(core: &mut Harness<'_>) -> Vec<(String, String)> {
    start(core, 10);
    feed(core, [vec![relation()], rows(190, &TWO, false)].concat());
    let replay = records(core);
    commit_all(core, replay)
}

const TWO: [(&str, Option<&str>); 2] = [("e1", Some("a")), ("e2", Some("b"))];

#[test]
fn an_event_refused_for_good_is_dead_lettered_in_the_replayed_transaction() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let [e1, e2] = send_two(&mut core);
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
    assert_eq!(
        replay_two(&mut core),
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
    let [e1, _e2] = send_two(&mut core);
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

/// The commit is asked for only once every record of the transaction has
/// reported, so a refusal is always heard before it: the transaction is
/// aborted, never committed, and the replay dead-letters the refused
/// event. (Asking once the progress record was sent, walbox began commits
/// during which a refusal came: librdkafka's flush then held the records
/// queued behind the refused one until its 30 s timeout.)
#[test]
fn the_commit_waits_for_every_report_so_a_refusal_is_heard_before_it() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let [e1, e2] = send_two(&mut core);
    core.upkeep(true, 2).unwrap();
    let progress = records(&mut core).remove(0);
    core.upkeep(false, 3).unwrap();
    assert_eq!(core.commits, 0, "three records in flight: no commit");
    report(&mut core, acked(e2.token)).unwrap();
    report(&mut core, acked(progress.token)).unwrap();
    core.upkeep(false, 1).unwrap();
    assert_eq!(core.commits, 0, "e1 has not reported: still no commit");
    assert!(core.transaction_busy(), "nothing is read meanwhile");
    report(&mut core, refused(e1)).unwrap();
    let e = abort(&mut core);
    assert!(
        matches!(e, RunError::Aborted(AbortCause::Refused(_))),
        "{e}"
    );
    assert_eq!(core.commits, 0, "a doomed transaction is never committed");
    assert_eq!(
        replay_two(&mut core),
        pairs(&[("dlq", "e1"), ("events", "e2")])
    );
}

/// Shutting down, the commit is asked for as soon as the progress record
/// is sent: the shutdown is bounded, and a commit the brokers do not
/// answer in time is left to the next start.
#[test]
fn while_shutting_down_the_commit_is_asked_once_the_progress_record_is_sent() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let _sent = send_two(&mut core);
    core.upkeep(true, 2).unwrap();
    let _progress = records(&mut core).remove(0);
    core.upkeep(true, 3).unwrap();
    assert_eq!(core.commits, 1, "finishing: no wait for the reports");
}

/// Shutting down, a commit may begin before every record reported; it
/// fails (librdkafka's flush saw the refusal) before the refusal's own
/// report reaches walbox: the session waits for that report, and the
/// replay dead-letters the refused event. (Ending at the commit's failure,
/// walbox forgot the refusal, sent the event again, and was refused and
/// aborted again, for ever.)
#[test]
fn a_refusal_reported_after_a_failed_commit_is_dead_lettered() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let [e1, e2] = send_two(&mut core);
    core.upkeep(true, 2).unwrap();
    let progress = records(&mut core).remove(0);
    core.upkeep(true, 3).unwrap();
    assert_eq!(core.commits, 1, "finishing: the commit is asked for");
    report(&mut core, acked(e2.token)).unwrap();
    report(&mut core, acked(progress.token)).unwrap();
    let failed = sink_core::TxnError {
        kind: sink_core::TxnErrorKind::Abortable,
        message: "ProduceRequest failed: Broker: Message size too large".into(),
    };
    core.committed(Err(failed)).unwrap();
    assert!(
        core.upkeep(false, 1).is_ok(),
        "e1 has not reported: the session waits"
    );
    assert!(core.commit_under_way(), "nothing is sent meanwhile");
    assert!(core.transaction_busy(), "nor read");
    report(&mut core, refused(e1)).unwrap();
    let e = abort(&mut core);
    assert!(
        matches!(e, RunError::Aborted(AbortCause::CommitFailed(_))),
        "{e}"
    );
    assert_eq!(
        replay_two(&mut core),
        pairs(&[("dlq", "e1"), ("events", "e2")])
    );
}

/// The progress record refused for good: its transaction is aborted and
/// written again; the third time in a row walbox stops, naming the topic.
#[test]
fn a_refused_progress_record_fails_its_transaction_and_three_in_a_row_stop_walbox() {
    let config = config(DeadLetters::to_topic("dlq"), transactions(100));
    let mut core = started(&config, 10);
    let events = [("e1", Some("a"))];
    for attempt in 1..=3 {
        if attempt > 1 {
            start(&mut core, 10);
        }
        feed(
            &mut core,
            [vec![relation()], rows(190, &events, false)].concat(),
        );
        let e1 = records(&mut core).remove(0);
        core.upkeep(true, 1).unwrap();
        let progress = records(&mut core).remove(0);
        assert!(progress.token.is_progress());
        report(&mut core, acked(e1.token)).unwrap();
        let result = report(&mut core, refused(progress));
        if attempt < 3 {
            result.unwrap();
            let e = abort(&mut core);
            assert!(
                matches!(e, RunError::Aborted(AbortCause::RecordFailed(_))),
                "{e}"
            );
        } else {
            let e = result.expect_err("the third refusal in a row");
            let text = e.to_string();
            assert!(
                text.contains(
                    "refused walbox's progress record for good 3 times in a row on topic progress"
                ),
                "{text}"
            );
        }
    }
    assert_eq!(confirmable(&mut core), 10, "nothing committed");
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
