//! The quarantine (`on_failure = "quarantine"`) through the relay loop: a
//! failing event holds its aggregate, every other aggregate flows, the slot
//! passes held events only once they are written, and a release
//! republishes them in order before the aggregate's newer events.

use super::fakes::{header, insert_row, key_of, OUTBOX};
use super::*;
use crate::quarantine::{QuarantineError, Request};

fn quarantined(max_events: u64) -> Fixture {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    fx.config.quarantine = Some(max_events);
    fx
}

/// The ids of the delivered records of `key`, in order.
fn delivered_ids(fx: &Fixture, key: &str) -> Vec<String> {
    fx.broker
        .delivered()
        .iter()
        .filter(|r| key_of(r) == key)
        .map(|r| header(r, "id").unwrap().to_owned())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_refused_event_holds_its_aggregate_while_the_others_flow_and_a_release_keeps_its_order() {
    let mut fx = quarantined(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let metrics = Arc::clone(&fx.metrics);
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("a1", Some("a")), ("b1", Some("b"))]);
            until("2 sent", || b.pending() == 2).await;
            assert!(b.refuse_key("a"));
            assert!(b.ack_key("b"));
            server.transaction(290, &[("a2", Some("a")), ("b2", Some("b"))]);
            until("b2 sent", || b.pending() == 1).await;
            assert_eq!(b.pending_keys(), ["b"], "a2 is held, not sent");
            b.ack_all();
            // Both transactions are passed: a1 and a2 are held, b's delivered.
            until("the slot past both", || server.confirmed() == 300).await;
            assert_eq!(db.held_ids("a"), ["a1", "a2"]);
            let text = metrics.encode();
            assert!(text.contains("walbox_quarantined_aggregates 1"), "{text}");
            assert!(text.contains("walbox_quarantined_events 2"), "{text}");

            // Released: a1 alone first, a2 once it is acknowledged (the
            // rest of the batch), then a3, which joined meanwhile.
            assert!(db.request("a", Request::Release));
            until("the batch's first sent", || b.pending() == 1).await;
            server.transaction(390, &[("a3", Some("a")), ("b3", Some("b"))]);
            until("b3 sent", || b.pending() == 2).await;
            assert_eq!(b.pending_keys(), ["a", "b"], "a3 joins the quarantine");
            until("a3 held", || db.held_ids("a").len() == 3).await;
            b.ack_all();
            until("the rest of the batch sent", || b.pending() == 1).await;
            b.ack_all();
            until("a3 released", || b.pending() == 1).await;
            b.ack_all();
            until("the aggregate flows again", || db.held_keys().is_empty()).await;
            server.transaction(490, &[("a4", Some("a"))]);
            until("a4 sent", || b.pending() == 1).await;
            b.ack_all();
            until("the slot at the end", || server.confirmed() == 500).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    assert_eq!(delivered_ids(&fx, "a"), ["a1", "a2", "a3", "a4"]);
    assert_eq!(delivered_ids(&fx, "b"), ["b1", "b2", "b3"]);
    let text = fx.metrics.encode();
    assert!(text.contains("walbox_quarantined_aggregates 0"), "{text}");
    assert!(text.contains("walbox_quarantine_held_total 3"), "{text}");
    assert!(
        text.contains("walbox_quarantine_released_total 3"),
        "{text}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_held_event_is_not_confirmed_until_its_write_committed() {
    let mut fx = quarantined(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let status = server.status_handle();
    let result = fx
        .run(|stop| async move {
            db.held.lock().unwrap().unwritable = true;
            server.send(relation());
            server.transaction(190, &[("a1", Some("a"))]);
            until("a1 sent", || b.pending() == 1).await;
            assert!(b.refuse_key("a"));
            server.transaction(290, &[("b1", Some("b"))]);
            idle(5_000).await;
            stop.send(Stop::Graceful).unwrap();
            idle(1_000).await;
        })
        .await;
    result.unwrap();
    // The write failed: the session ended without confirming a1's
    // transaction (the server sends it again to the next one).
    assert!(fakes::highest_confirmed(&status).unwrap_or(0) < 200);
}

#[tokio::test(start_paused = true)]
async fn a_full_quarantine_stops_with_the_slot_before_the_event_it_cannot_hold() {
    let mut fx = quarantined(2);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let status = server.status_handle();
    let result = fx
        .run(|_stop| async move {
            server.send(relation());
            server.transaction(190, &[("a1", Some("a"))]);
            until("a1 sent", || b.pending() == 1).await;
            assert!(b.refuse_key("a"));
            until("a1 held", || server.confirmed() == 200).await;
            server.transaction(290, &[("a2", Some("a")), ("a3", Some("a"))]);
            idle(60_000).await;
        })
        .await;
    match result {
        Err(RunError::Quarantine(QuarantineError::Full { held: 2 })) => {}
        other => panic!("expected a full quarantine, got {other:?}"),
    }
    assert_eq!(fakes::highest_confirmed(&status), Some(200));
}

#[tokio::test(start_paused = true)]
async fn a_release_refused_again_stops_and_the_aggregate_stays_held() {
    let mut fx = quarantined(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("a1", Some("a"))]);
            until("a1 sent", || b.pending() == 1).await;
            assert!(b.refuse_key("a"));
            until("a1 held", || server.confirmed() == 200).await;
            assert!(db.request("a", Request::Release));
            until("a1 released", || b.pending() == 1).await;
            assert!(b.refuse_key("a"));
            until("the failure recorded", || {
                !db.held.lock().unwrap().failed_releases.is_empty()
            })
            .await;
            server.transaction(290, &[("a2", Some("a"))]);
            until("a2 held", || db.held_ids("a").len() == 2).await;
            assert_eq!(b.pending(), 0);
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    assert!(fx.broker.delivered().is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_unmappable_row_is_held_under_its_aggregate_and_one_without_an_aggregate_stops() {
    let mut fx = quarantined(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let status = server.status_handle();
    let row = |lsn, id, key| {
        insert_row(
            lsn,
            OUTBOX,
            &[id, Some("order"), key, Some("Created"), Some("{}")],
        )
    };
    let result = fx
        .run(|_stop| async move {
            server.send(relation());
            server.send(begin(190));
            // No event id: unmappable, but its aggregate is known.
            server.send(row(100, None, Some("a")));
            server.send(row(110, Some("a2"), Some("a")));
            server.send(row(120, Some("b1"), Some("b")));
            server.send(commit(190, 200));
            until("b1 sent", || b.pending() == 1).await;
            b.ack_all();
            until("the slot past it", || server.confirmed() == 200).await;
            assert_eq!(db.held_keys(), ["a"]);
            assert_eq!(db.held_ids("a").len(), 2);
            let kinds: Vec<String> = db
                .held
                .lock()
                .unwrap()
                .events
                .values()
                .map(|e| e.kind.clone())
                .collect();
            assert_eq!(kinds, ["unmappable", "held"]);
            // No aggregate id: nothing to hold it under.
            server.send(begin(290));
            server.send(row(210, Some("c1"), None));
            server.send(commit(290, 300));
            idle(60_000).await;
        })
        .await;
    match result {
        Err(RunError::Quarantine(QuarantineError::NoKey(_))) => {}
        other => panic!("expected a stop for a row without an aggregate, got {other:?}"),
    }
    assert_eq!(fakes::highest_confirmed(&status), Some(200));
}

#[tokio::test(start_paused = true)]
async fn a_new_session_holds_what_the_table_holds_and_a_drop_lets_the_aggregate_flow() {
    let mut fx = quarantined(100);
    let mut first = fx.source.session(10);
    let second = fx.source.session(200);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let result = fx
        .run(|stop| async move {
            first.send(relation());
            first.transaction(190, &[("a1", Some("a"))]);
            until("a1 sent", || b.pending() == 1).await;
            assert!(b.refuse_key("a"));
            until("a1 held", || first.confirmed() == 200).await;
            first.disconnect();
            // The next session reads what is held before its first event.
            second.send(relation());
            second.transaction(290, &[("a2", Some("a")), ("b1", Some("b"))]);
            until("b1 sent", || b.pending() == 1).await;
            assert_eq!(b.pending_keys(), ["b"]);
            b.ack_all();
            until("a2 held", || db.held_ids("a") == ["a1", "a2"]).await;
            assert!(db.request("a", Request::Drop));
            until("the aggregate forgotten", || db.held_keys().is_empty()).await;
            assert!(db.held_ids("a").is_empty());
            second.transaction(390, &[("a3", Some("a"))]);
            until("a3 sent", || b.pending() == 1).await;
            b.ack_all();
            until("the slot at the end", || second.confirmed() == 400).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || second.closed()).await;
        })
        .await;
    result.unwrap();
    assert_eq!(delivered_ids(&fx, "a"), ["a3"], "a1 and a2 were dropped");
}

/// Two held aggregates released one after the other: the first release
/// fails with records still in flight, whose late acknowledgements must
/// count for nothing in the second. Before reports were matched to their
/// release, a's late ack sent b's rest before b's first was acknowledged
/// and let b's rows be deleted with b2 unacknowledged: b2's refusal then
/// lost it.
#[tokio::test(start_paused = true)]
async fn a_failed_releases_late_acks_never_let_the_next_release_delete_unacknowledged_events() {
    let mut fx = quarantined(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    db.held.lock().unwrap().release_batch = Some(10);
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("a1", Some("a")), ("b1", Some("b"))]);
            until("2 sent", || b.pending() == 2).await;
            assert!(b.refuse_key("a"));
            assert!(b.refuse_key("b"));
            server.transaction(
                290,
                &[("a2", Some("a")), ("a3", Some("a")), ("b2", Some("b"))],
            );
            until("all held", || {
                db.held_ids("a").len() == 3 && db.held_ids("b").len() == 2
            })
            .await;
            assert!(db.request("a", Request::Release));
            assert!(db.request("b", Request::Release));
            until("a1 sent alone", || b.pending_keys() == ["a"]).await;
            assert!(b.ack_key("a"));
            until("a's rest sent", || b.pending() == 2).await;
            // a2 refused again: a's release fails with a3 in flight, and
            // b's release starts.
            assert!(b.refuse_key("a"));
            until("b1 sent", || b.pending_keys() == ["a", "b"]).await;
            // a3's late acknowledgement is a's, not b's.
            assert!(b.ack_key("a"));
            idle(2_000).await;
            assert_eq!(b.pending_keys(), ["b"], "b2 waits for b1's ack");
            assert!(b.ack_key("b"));
            until("b2 sent", || b.pending_keys() == ["b"]).await;
            // b2 refused again: b's release fails, and nothing of b was
            // deleted (its batch was not all acknowledged).
            assert!(b.refuse_key("b"));
            until("both failures recorded", || {
                db.held.lock().unwrap().failed_releases.len() == 2
            })
            .await;
            assert_eq!(db.held_ids("b"), ["b1", "b2"]);
            assert_eq!(db.held_ids("a"), ["a1", "a2", "a3"]);
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
}

/// A released event that the broker acknowledged gets its receipt, as a
/// streamed one does: `walbox.await_delivery` returns for it. (Released
/// reports returned before the receipt was written: waiters timed out on
/// delivered events.)
#[tokio::test(start_paused = true)]
async fn a_released_event_gets_its_receipt() {
    let mut fx = quarantined(100);
    let (recorder, mut receipts) = crate::receipts::Recorder::new(Arc::clone(&fx.metrics));
    fx.config.receipts = Some(recorder);
    // The writer: takes each receipt (settled), as walbox's writes them.
    let written = Arc::new(std::sync::Mutex::new(Vec::new()));
    let writer = {
        let written = Arc::clone(&written);
        tokio::spawn(async move {
            while let Some(r) = receipts.recv().await {
                written.lock().unwrap().push(r.event_id.to_string());
            }
        })
    };
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let db = fx.source.database();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("a1", Some("a")), ("b1", Some("b"))]);
            until("2 sent", || b.pending() == 2).await;
            assert!(b.refuse_key("a"));
            assert!(b.ack_key("b"));
            until("a1 held", || server.confirmed() == 200).await;
            assert!(db.request("a", Request::Release));
            until("a1 released", || b.pending() == 1).await;
            b.ack_all();
            until("the aggregate flows again", || db.held_keys().is_empty()).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    drop(fx);
    writer.await.unwrap();
    let ids = written.lock().unwrap().clone();
    assert_eq!(ids, ["b1", "a1"]);
}
