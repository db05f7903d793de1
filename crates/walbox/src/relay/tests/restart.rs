//! Idempotent restart (`skip_delivered`): a session that starts after
//! events were delivered but never confirmed reads the broker back and
//! sends again exactly what is not there.

use std::time::Duration;

use super::fakes::{self, relation};
use super::{idle, until, Fixture};
use crate::dead_letter::DeadLetters;
use crate::metrics::Metrics;
use crate::relay::Stop;

fn fixture(look_back: Option<u64>) -> Fixture {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    fx.config.skip_delivered = look_back;
    fx
}

fn ids(fx: &Fixture) -> Vec<String> {
    fx.broker
        .delivered()
        .iter()
        .map(|r| fakes::header(r, "id").unwrap().to_owned())
        .collect()
}

fn counter(metrics: &Metrics, name: &str) -> f64 {
    super::gauge(metrics, name)
}

/// The first session delivers e1 and e3 of a transaction and dies with e2
/// in flight (lost); the next one sends the transaction again. What it
/// finds on the broker (e1, e3) is not sent again; e2, never delivered, is,
/// though a later event of the transaction is there.
async fn crash_mid_transaction(fx: &mut Fixture, history: &str) {
    let mut first = fx.source.session(10);
    let second = fx.source.session_on(history, 10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        first.send(relation());
        first.transaction(
            190,
            &[("e1", Some("a")), ("e2", Some("b")), ("e3", Some("c"))],
        );
        until("3 in flight", || b.pending() == 3).await;
        assert!(b.ack_key("a") && b.ack_key("c"));
        b.lose_in_flight();
        first.disconnect();
        second.send(relation());
        second.transaction(
            190,
            &[("e1", Some("a")), ("e2", Some("b")), ("e3", Some("c"))],
        );
        second.transaction(290, &[("e4", Some("a"))]);
        until("the replay in flight", || b.pending() > 0).await;
        until("confirmed", || {
            b.ack_all();
            second.confirmed() == 300
        })
        .await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_restart_sends_again_exactly_what_the_broker_does_not_hold() {
    let mut fx = fixture(Some(100));
    crash_mid_transaction(&mut fx, "system 1 timeline 1").await;
    assert_eq!(ids(&fx), ["e1", "e3", "e2", "e4"], "each once");
    assert_eq!(
        counter(&fx.metrics, "walbox_events_found_delivered_total"),
        2.0
    );
    // Once per session: the first one looked too (for an earlier process).
    assert_eq!(
        fx.broker.tail_reads(),
        2,
        "the topic is read back once a session"
    );
}

#[tokio::test(start_paused = true)]
async fn without_skip_delivered_the_replay_is_sent_whole() {
    let mut fx = fixture(None);
    crash_mid_transaction(&mut fx, "system 1 timeline 1").await;
    assert_eq!(ids(&fx), ["e1", "e3", "e1", "e2", "e3", "e4"]);
    assert_eq!(fx.broker.tail_reads(), 0);
}

#[tokio::test(start_paused = true)]
async fn records_of_another_history_are_never_taken_for_delivered() {
    let mut fx = fixture(Some(100));
    crash_mid_transaction(&mut fx, "system 1 timeline 2").await;
    assert_eq!(ids(&fx), ["e1", "e3", "e1", "e2", "e3", "e4"]);
    assert_eq!(
        counter(&fx.metrics, "walbox_events_found_delivered_total"),
        0.0
    );
}

#[tokio::test(start_paused = true)]
async fn past_the_look_back_events_are_sent_again() {
    // One record read back: e3 is found, e1 (before it) is not looked at.
    let mut fx = fixture(Some(1));
    crash_mid_transaction(&mut fx, "system 1 timeline 1").await;
    assert_eq!(ids(&fx), ["e1", "e3", "e1", "e2", "e4"]);
}

#[tokio::test(start_paused = true)]
async fn a_topic_that_cannot_be_read_back_gets_its_replay_again() {
    let mut fx = fixture(Some(100));
    fx.broker.set_unreadable();
    crash_mid_transaction(&mut fx, "system 1 timeline 1").await;
    assert_eq!(ids(&fx), ["e1", "e3", "e1", "e2", "e3", "e4"]);
    assert_eq!(counter(&fx.metrics, "walbox_tail_reads_failed_total"), 2.0);
}

/// A dead-letter copy is looked for in the dead-letter topic: an event the
/// broker refuses again after a restart is not dead-lettered twice.
#[tokio::test(start_paused = true)]
async fn a_dead_letter_copy_found_is_not_sent_again() {
    let (fx, dead_letters) = dead_letter_replay(Duration::ZERO).await;
    assert_eq!(dead_letters, 1, "one copy");
    assert_eq!(
        counter(&fx.metrics, "walbox_events_found_delivered_total"),
        1.0
    );
}

/// The reads of a start stop after 20 s together (the stream waits
/// meanwhile): a topic not read by then gets its replay again.
#[tokio::test(start_paused = true)]
async fn reads_past_the_budget_are_given_up_and_the_replay_sent() {
    let (fx, dead_letters) = dead_letter_replay(Duration::from_secs(21)).await;
    assert_eq!(dead_letters, 2, "the dead-letter topic was not read");
    assert_eq!(counter(&fx.metrics, "walbox_tail_reads_failed_total"), 1.0);
}

/// e1 refused and dead-lettered, e2 lost in flight; the next session
/// sends the transaction again, e1 refused again. Returns the fixture and
/// the dead-letter copies of e1 on the broker.
async fn dead_letter_replay(read_delay: Duration) -> (Fixture, usize) {
    let mut fx = fixture(Some(100));
    fx.config.dead_letters = DeadLetters::to_topic("dlq");
    let mut first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        first.send(relation());
        first.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        until("2 in flight", || b.pending() == 2).await;
        assert!(b.refuse_key("a"));
        until("the dead-letter copy in flight", || b.pending() == 2).await;
        assert!(b.ack_key("a"), "the dead-letter copy");
        // Dies with e2 in flight.
        b.lose_in_flight();
        b.set_read_delay(read_delay);
        first.disconnect();
        second.send(relation());
        second.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        until("e1 and e2 sent again", || b.pending_keys() == ["a", "b"]).await;
        assert!(b.refuse_key("a"), "refused again");
        idle(100).await;
        b.ack_all();
        b.ack_all();
        until("confirmed", || second.confirmed() == 200).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    let copies = fx
        .broker
        .delivered()
        .iter()
        .filter(|r| &*r.topic == "dlq" && fakes::header(r, "id") == Some("e1"))
        .count();
    let events: Vec<String> = fx
        .broker
        .delivered()
        .iter()
        .filter(|r| &*r.topic == "events")
        .map(|r| fakes::header(r, "id").unwrap().to_owned())
        .collect();
    assert_eq!(events, ["e2"]);
    (fx, copies)
}

/// A server restored on the same timeline reuses WAL positions: a new
/// transaction at a position an old one had is another event, whatever the
/// broker holds of the old one there (its commit time differs). Skipping
/// it would lose it.
#[tokio::test(start_paused = true)]
async fn a_new_transaction_at_a_reused_position_is_never_taken_for_delivered() {
    let mut fx = fixture(Some(100));
    let mut first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        first.send(relation());
        first.transaction_at(190, 1_000, &[("old1", Some("a")), ("old2", Some("b"))]);
        until("2 in flight", || b.pending() == 2).await;
        assert!(b.ack_key("a"));
        b.lose_in_flight();
        first.disconnect();
        // Restored: at 190 now, another transaction.
        second.send(relation());
        second.transaction_at(190, 2_000, &[("new1", Some("a")), ("new2", Some("b"))]);
        until("confirmed", || {
            b.ack_all();
            second.confirmed() == 200
        })
        .await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    assert_eq!(ids(&fx), ["old1", "new1", "new2"]);
}
