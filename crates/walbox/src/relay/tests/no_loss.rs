//! The relay against the faults that used to lose or repeat events without a
//! word: the outbox table leaving the publication, a slot that resumes
//! before what was confirmed, a relation that changed under the stream, and
//! shutdowns in the middle of a transaction.

use super::fakes::{self, begin, commit, insert, keepalive, relation, OUTBOX};
use super::{idle, until, Fixture};
use crate::dead_letter::DeadLetters;
use crate::relay::{RunError, Stop};
use slot_manager::ChangeInFlight;

#[tokio::test(start_paused = true)]
async fn a_table_removed_from_the_publication_stops_the_relay_before_its_unseen_events() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let database = fx.source.database();
    let status = server.status_handle();
    let b = fx.broker.clone();
    let result = fx
        .run(|_stop| async move {
            server.send(relation());
            server.transaction(190, &[("e1", Some("a"))]);
            until("1 in flight", || b.pending() == 1).await;
            b.ack_all();
            server.send(keepalive(1000, false));
            until("the idle slot confirmed", || server.confirmed() == 1000).await;
            // ALTER PUBLICATION … DROP TABLE: the stream goes silent about
            // the table, while other tables' WAL moves the server on.
            database.alter(
                "table dropped from the publication",
                Some(OUTBOX),
                Some("publication walbox_outbox does not include table public.outbox_events"),
            );
            server.send(keepalive(5000, true));
            idle(60_000).await;
            panic!("the relay should have stopped");
        })
        .await;
    let e = result.unwrap_err();
    assert!(matches!(e, RunError::Drift(_)), "{e}");
    let e = e.to_string();
    assert!(
        e.contains("does not include table public.outbox_events"),
        "{e}"
    );
    assert!(e.contains("stopped with the slot at 0/3E8"), "{e}");
    let confirmed = fakes::highest_confirmed(&status);
    assert_eq!(
        confirmed,
        Some(1000),
        "the keepalive past the change was not confirmed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_recreated_table_stops_the_relay_even_when_it_is_published_again() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let database = fx.source.database();
    let result = fx
        .run(|_stop| async move {
            server.send(relation());
            server.send(keepalive(1000, false));
            until("confirmed", || server.confirmed() == 1000).await;
            database.alter("recreated", Some(OUTBOX + 7), None);
            idle(60_000).await;
            panic!("the relay should have stopped");
        })
        .await;
    let e = result.unwrap_err().to_string();
    assert!(
        e.contains("dropped and recreated (OID 16384 → 16391)"),
        "{e}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_gap_at_start_stops_before_anything_is_confirmed() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    fx.source.database().alter(
        "partitioned",
        Some(OUTBOX),
        Some("table public.outbox_events is partitioned and publication walbox_outbox publishes its partitions under their own names"),
    );
    let status = server.status_handle();
    let result = fx
        .run(|_stop| async move {
            server.send(keepalive(5000, true));
            idle(60_000).await;
        })
        .await;
    let e = result.unwrap_err().to_string();
    assert!(e.contains("is partitioned"), "{e}");
    assert!(
        status
            .lock()
            .unwrap()
            .iter()
            .all(|u| u.flush.as_u64() <= 10),
        "nothing past the slot's position"
    );
}

/// A disk snapshot restored under the running relay: same system, same
/// timeline, but the server's WAL ends before what was delivered. The new
/// transactions at those positions are not replays: each is sent.
#[tokio::test(start_paused = true)]
async fn sigterm_inside_a_transaction_reads_the_rest_of_it_first() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(150, "e1", Some("a"), "{}"));
            until("e1 in flight", || b.pending() == 1).await;
            stop.send(Stop::Graceful).unwrap();
            idle(100).await;
            server.send(insert(160, "e2", Some("a"), "{}"));
            server.send(commit(190, 200));
            until("e2 in flight", || b.pending() == 2).await;
            b.ack_all();
            until("a clean close", || server.closed()).await;
            assert_eq!(server.confirmed(), 200, "the whole transaction confirmed");
        })
        .await;
    result.unwrap();
    assert_eq!(fx.broker.delivered().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_second_signal_stops_at_once_confirming_only_what_was_acked() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let status = server.status_handle();
    let b = fx.broker.clone();
    let started = tokio::time::Instant::now();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("e1", Some("a"))]);
            until("e1 in flight", || b.pending() == 1).await;
            b.ack_all();
            until("confirmed", || server.confirmed() == 200).await;
            server.transaction(290, &[("e2", Some("a"))]);
            until("e2 in flight", || b.pending() == 1).await;
            stop.send(Stop::Graceful).unwrap();
            idle(1000).await;
            stop.send(Stop::Now).unwrap();
            idle(60_000).await;
        })
        .await;
    result.unwrap();
    assert!(
        started.elapsed() < std::time::Duration::from_secs(5),
        "did not wait out the 30 s shutdown timeout"
    );
    let confirmed = fakes::highest_confirmed(&status);
    assert_eq!(confirmed, Some(200), "nothing past the unacked event");
}

#[tokio::test(start_paused = true)]
async fn a_server_gone_silent_is_asked_to_reply_and_then_left_for_a_new_session() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let first = fx.source.session(10);
    let second = fx.source.session(10);
    let result = fx
        .run(|stop| async move {
            first.send(relation());
            first.send(keepalive(100, false));
            // A network that drops packets: nothing more arrives, nothing closes.
            idle(12_000).await;
            assert!(
                first.updates().iter().any(|u| u.reply_requested),
                "after 10 s of silence the status updates ask for a reply"
            );
            until("a new session", || !second.updates().is_empty()).await;
            assert!(
                !first.closed(),
                "the dead session is abandoned, not closed cleanly"
            );
            stop.send(Stop::Graceful).unwrap();
        })
        .await;
    result.unwrap();
}

/// How many coverage readings it takes, from the moment a transaction's WAL
/// is written, until the slot is confirmed past it.
async fn readings_until_confirmed(in_flight: ChangeInFlight) -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let database = fx.source.database();
    database.in_flight(in_flight);
    let b = fx.broker.clone();
    let after_write = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&after_write);
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            idle(600).await;
            let at_write = database.readings.load(Ordering::SeqCst);
            server.transaction(190, &[("e1", Some("a"))]);
            until("1 in flight", || b.pending() == 1).await;
            b.ack_all();
            until("confirmed", || server.confirmed() == 200).await;
            counted.store(
                database.readings.load(Ordering::SeqCst) - at_write,
                Ordering::SeqCst,
            );
            stop.send(Stop::Graceful).unwrap();
        })
        .await;
    result.unwrap();
    after_write.load(Ordering::SeqCst)
}

/// A reading that finds no change of the coverage in flight verifies the
/// coverage up to its own position: the slot is confirmed after one
/// reading, not two, so a crash re-sends less.
#[tokio::test(start_paused = true)]
async fn a_reading_with_nothing_in_flight_verifies_itself() {
    assert_eq!(readings_until_confirmed(ChangeInFlight::Nothing).await, 1);
}

/// A change in flight, here committed in the WAL and not yet visible (a
/// synchronous standby is down: commits wait for it, logical decoding
/// already follows them): no reading verifies anything while it lasts,
/// whatever the WAL moved on to.
#[tokio::test(start_paused = true)]
async fn a_change_held_by_synchronous_replication_verifies_nothing_until_it_is_visible() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let database = fx.source.database();
    database.in_flight(ChangeInFlight::Nothing);
    let status = server.status_handle();
    let b = fx.broker.clone();
    let result = fx
        .run(|_stop| async move {
            server.send(relation());
            server.transaction(190, &[("e1", Some("a"))]);
            until("1 in flight", || b.pending() == 1).await;
            b.ack_all();
            until("confirmed", || server.confirmed() == 200).await;
            // ALTER PUBLICATION … DROP TABLE commits at 250 and waits for
            // the standby; the stream already goes on without the table.
            database.in_flight(ChangeInFlight::Pending);
            server.send(keepalive(5000, false));
            idle(10_000).await;
            assert_eq!(
                server.confirmed(),
                200,
                "nothing past the last verified reading"
            );
            // The standby is back: the change becomes visible.
            database.alter(
                "table dropped from the publication",
                Some(OUTBOX),
                Some("publication walbox_outbox does not include table public.outbox_events"),
            );
            database.in_flight(ChangeInFlight::Nothing);
            idle(60_000).await;
            panic!("the relay should have stopped");
        })
        .await;
    let e = result.unwrap_err();
    assert!(matches!(e, RunError::Drift(_)), "{e}");
    assert_eq!(fakes::highest_confirmed(&status), Some(200));
}

/// Readings that verify themselves still stop the relay at a change,
/// before it.
#[tokio::test(start_paused = true)]
async fn a_reading_with_nothing_in_flight_that_finds_a_change_stops_the_relay_before_it() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let database = fx.source.database();
    database.in_flight(ChangeInFlight::Nothing);
    let status = server.status_handle();
    let b = fx.broker.clone();
    let result = fx
        .run(|_stop| async move {
            server.send(relation());
            server.transaction(190, &[("e1", Some("a"))]);
            until("1 in flight", || b.pending() == 1).await;
            b.ack_all();
            until("confirmed", || server.confirmed() == 200).await;
            // Dropped and added back between two readings: no gap, another
            // fingerprint.
            database.alter("re-added", Some(OUTBOX), None);
            server.transaction(390, &[("e2", Some("a"))]);
            until("2 in flight", || b.pending() == 1).await;
            b.ack_all();
            idle(60_000).await;
            panic!("the relay should have stopped");
        })
        .await;
    let e = result.unwrap_err();
    assert!(matches!(e, RunError::Drift(_)), "{e}");
    assert_eq!(
        fakes::highest_confirmed(&status),
        Some(200),
        "nothing past the reading before the change"
    );
}
