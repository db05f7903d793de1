//! The relay loop against in-memory fakes: no Postgres, no Kafka. Time is
//! paused, so timers (status interval, backoff) run instantly and in order.

mod claim_check;
mod exactly_once;
pub(in crate::relay) mod fakes;
mod no_loss;
mod quarantine;
mod restart;
mod schema_registry;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use slot_manager::TableName;
use tokio::sync::watch;

use super::{run, RelayConfig, RunError, Stop};
use crate::config::EventSource;
use crate::dead_letter::DeadLetters;
use crate::mapping::OutboxMapping;
use crate::metrics::Metrics;
use fakes::{begin, commit, header, insert, keepalive, relation, Broker, FakeSource};

pub(in crate::relay) fn config(dead_letters: DeadLetters) -> RelayConfig {
    RelayConfig {
        stream: std::sync::Arc::from("walbox"),
        save_positions: true,
        tables: slot_manager::OutboxTables::one(TableName::new("public", "outbox_events")),
        mapping: OutboxMapping {
            headers: None,
            timestamp: None,
            topic_template: "events".into(),
            ..OutboxMapping::default()
        },
        source: EventSource::Table,
        message_prefix: "walbox".into(),
        dead_letters,
        quarantine: None,
        status_interval: Duration::from_secs(1),
        shutdown_timeout: Duration::from_secs(30),
        exactly_once: None,
        skip_delivered: None,
        spans: None,
        audit: None,
        receipts: None,
        claim_check: None,
        schema_registry: None,
    }
}

/// A relay's world: its configuration, a scripted source, a fake broker
/// bounded to `events` and `kib` in flight, and its metrics.
struct Fixture {
    config: RelayConfig,
    source: FakeSource,
    broker: Broker,
    reports: fakes::FakeReports,
    metrics: Arc<Metrics>,
}

impl Fixture {
    fn new(dead_letters: DeadLetters, events: usize, kib: usize) -> Fixture {
        let (broker, reports) = Broker::new(events, kib);
        Fixture {
            config: config(dead_letters),
            source: FakeSource::default(),
            broker,
            reports,
            metrics: Metrics::new(),
        }
    }

    /// Runs the relay beside `script`, which gets the shutdown switch;
    /// returns the relay's result once it ended.
    async fn run<F, Fut>(&mut self, script: F) -> Result<(), RunError>
    where
        F: FnOnce(watch::Sender<Stop>) -> Fut,
        Fut: Future<Output = ()>,
    {
        // Time is paused, so a relay that spins without yielding would hang the
        // test instead of failing it: a real-time watchdog ends the process.
        let (_alive, watched) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                watched.recv_timeout(Duration::from_secs(30))
            {
                use std::io::Write;
                let _ = writeln!(
                    std::io::stderr(),
                    "the relay spun for 30 s without yielding (a busy loop)"
                );
                std::process::exit(101);
            }
        });
        let (stop, stopped) = watch::channel(Stop::No);
        let relay = run(
            &self.config,
            &mut self.source,
            fakes::ends(&self.config, &self.broker),
            &mut self.reports,
            stopped,
            Arc::clone(&self.metrics),
        );
        tokio::pin!(relay);
        let script = script(stop);
        tokio::pin!(script);
        let mut script_done = false;
        loop {
            tokio::select! {
                result = &mut relay => return result,
                () = &mut script, if !script_done => script_done = true,
            }
        }
    }
}

/// Lets the relay run until `cond` holds (virtual time; panics after a minute).
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..6000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Lets the relay run for `ms` of virtual time.
async fn idle(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

#[tokio::test(start_paused = true)]
async fn events_go_out_once_in_order_and_the_slot_follows_the_acks() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            for (t, keys) in [(0u64, ["a", "b"]), (1, ["a", "c"])] {
                let base = 100 * (t + 1);
                server.send(begin(base + 90));
                for (i, k) in keys.iter().enumerate() {
                    server.send(insert(
                        base + 10 * i as u64,
                        &format!("e{t}{i}"),
                        Some(k),
                        "{}",
                    ));
                }
                server.send(commit(base + 90, base + 100));
            }
            until("4 sent", || b.pending() == 4).await;
            assert_eq!(b.pending_keys(), ["a", "b", "a", "c"], "commit order");
            b.ack_all();
            until("the slot at the last commit", || server.confirmed() == 300).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let ids: Vec<_> = fx
        .broker
        .delivered()
        .iter()
        .map(|r| header(r, "id").unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["e00", "e01", "e10", "e11"]);
    assert!(fx
        .metrics
        .encode()
        .contains("walbox_events_published_total{topic=\"events\"} 4"));
    // Every event's latency, exactly: to its ack, and to its transaction's read.
    let exact = |l: &crate::metrics::latency::ExactLatency| l.summary().map(|s| s.events);
    assert_eq!(exact(&fx.metrics.commit_to_ack_exact), Some(4));
    assert_eq!(exact(&fx.metrics.commit_to_read_exact), Some(4));
}

/// With receipts, the slot is confirmed past an acknowledged event only
/// once its receipt is written: a kill -9 in between would otherwise
/// leave a confirmed event with no receipt, its waits never answered.
/// (Found by the RabbitMQ receipts test: 241 of 1,000 waits timed out
/// after a kill -9 right after the first events.)
#[tokio::test(start_paused = true)]
async fn the_slot_waits_for_the_receipts_of_what_it_confirms() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let (recorder, mut receipts) = crate::receipts::Recorder::new(Arc::clone(&fx.metrics));
    fx.config.receipts = Some(recorder);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let (written_tx, mut written_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    // The writer: writes a receipt each time the script says so.
    let writer = tokio::spawn(async move {
        while written_rx.recv().await.is_some() {
            receipts.recv().await;
        }
    });
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "e0", Some("a"), "{}"));
            server.send(insert(110, "e1", Some("b"), "{}"));
            server.send(commit(190, 200));
            until("2 sent", || b.pending() == 2).await;
            b.ack_all();
            // Acknowledged, receipts recorded, none written: not confirmed,
            // status updates going out all the same.
            idle(5_000).await;
            assert!(server.confirmed() < 200, "confirmed before the receipts");
            written_tx.send(()).unwrap();
            idle(5_000).await;
            assert!(
                server.confirmed() < 200,
                "confirmed with one receipt of two"
            );
            written_tx.send(()).unwrap();
            until("the slot at the commit", || server.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    drop(fx);
    writer.await.unwrap();
}

/// The continuous audit's tap: asked, it samples the next event queued,
/// and hands back where the broker acknowledged it; unasked, nothing.
#[tokio::test(start_paused = true)]
async fn the_audit_samples_the_next_event_after_it_asks_with_where_it_landed() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let tap = crate::continuous_audit::Tap::new();
    fx.config.audit = Some(Arc::clone(&tap));
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let asker = Arc::clone(&tap);
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "e0", Some("a"), "{}"));
            server.send(commit(190, 200));
            until("1 sent", || b.pending() == 1).await;
            asker.ask();
            server.send(begin(290));
            server.send(insert(210, "e1", Some("a"), "{}"));
            server.send(insert(220, "e2", Some("b"), "{}"));
            server.send(commit(290, 300));
            until("3 sent", || b.pending() == 3).await;
            b.ack_all();
            until("the slot at the last commit", || server.confirmed() == 300).await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let samples = tap.drain();
    assert_eq!(samples.len(), 1, "{samples:?}");
    let s = &samples[0];
    assert_eq!(
        (&*s.id, &*s.topic, s.partition, s.offset),
        ("e1", "events", 0, 1)
    );
}

/// Postgres restarts (or the connection breaks) with events in flight:
/// walbox still takes their reports, and the next session skips the
/// transactions they completed when Postgres sends them again (before
/// Postgres 17 a restart sets the slot back to its last checkpoint).
/// Without that, every transaction in flight at the restart was sent twice
/// (0 to 176 duplicates per restart in acceptance runs).
#[tokio::test(start_paused = true)]
async fn a_reconnect_with_events_in_flight_sends_nothing_twice_once_they_are_acknowledged() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let mut first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        first.send(relation());
        first.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        first.transaction(290, &[("e3", Some("a"))]);
        until("3 in flight", || b.pending() == 3).await;
        first.disconnect();
        // The deliveries succeed after the connection is gone.
        idle(100).await;
        b.ack_all();
        // The server sends both transactions again, and a new one.
        idle(2000).await;
        second.send(relation());
        second.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        second.transaction(290, &[("e3", Some("a"))]);
        second.transaction(390, &[("e4", Some("b"))]);
        until("e4 in flight", || b.pending() == 1).await;
        assert_eq!(b.pending_keys(), ["b"]);
        b.ack_all();
        until("confirmed", || second.confirmed() == 400).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    let ids: Vec<String> = fx
        .broker
        .delivered()
        .iter()
        .map(|r| fakes::header(r, "id").unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["e1", "e2", "e3", "e4"], "each once");
}

#[tokio::test(start_paused = true)]
async fn a_reconnect_with_events_in_flight_resends_and_confirms_only_the_new_session() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let mut first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    let m = Arc::clone(&fx.metrics);
    fx.run(|stop| async move {
        first.send(relation());
        first.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        until("2 in flight", || b.pending() == 2).await;
        first.disconnect();
        // The new session: the server re-sends the unconfirmed transaction.
        idle(2000).await;
        second.send(relation());
        second.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        until("4 in flight", || b.pending() == 4).await;
        assert_eq!(gauge(&m, "walbox_streaming"), 1.0);
        assert!(gauge(&m, "walbox_oldest_unacked_event_age_seconds") > 0.0);
        // The first session's deliveries succeed late: nothing moves.
        assert!(b.ack_oldest() && b.ack_oldest());
        idle(1500).await;
        assert_eq!(second.confirmed(), 10, "stale acks confirmed nothing");
        b.ack_all();
        until("confirmed", || second.confirmed() == 200).await;
        assert_eq!(first.confirmed(), 10);
        assert_eq!(
            gauge(&m, "walbox_oldest_unacked_event_age_seconds"),
            0.0,
            "none waits"
        );
        assert!(gauge(&m, "walbox_delivered_commit_age_seconds") > 0.0);
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    assert_eq!(
        fx.broker.delivered().len(),
        4,
        "duplicates only of what was in flight"
    );
    let text = fx.metrics.encode();
    assert!(
        text.contains("walbox_reconnects_total{reason=\"postgres\"} 1"),
        "{text}"
    );
}

/// A gauge's value in the exposition text.
fn gauge(m: &Metrics, name: &str) -> f64 {
    let text = m.encode();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

#[tokio::test(start_paused = true)]
async fn a_stale_report_after_reconnect_is_ignored() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let mut first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        first.send(relation());
        first.send(begin(190));
        first.send(insert(110, "old", Some("old"), "{}"));
        until("1 in flight", || b.pending() == 1).await;
        first.disconnect();
        idle(2000).await;
        // In the new session, the same transaction has two events.
        second.send(relation());
        second.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
        until("3 in flight", || b.pending() == 3).await;
        assert!(b.ack_key("old"), "the old session's report arrives now");
        assert!(b.ack_key("a"));
        idle(1500).await;
        assert_eq!(
            second.confirmed(),
            10,
            "e2 is unacked: the stale report must not count for it"
        );
        assert!(b.ack_key("b"));
        until("confirmed", || second.confirmed() == 200).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
}

#[tokio::test(start_paused = true)]
async fn backpressure_by_count_stops_reading_but_keepalives_are_answered() {
    let mut fx = Fixture::new(DeadLetters::halt(), 3, 1024);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    fx.run(|stop| async move {
        server.send(relation());
        server.send(begin(190));
        for i in 0..3 {
            server.send(insert(110 + i, &format!("e{i}"), Some("a"), "{}"));
        }
        server.send(commit(190, 200));
        until("3 in flight", || b.pending() == 3).await;
        // Full: a keepalive asking for a reply is still answered at once.
        let before = server.updates().len();
        server.send(keepalive(250, true));
        idle(10).await;
        assert_eq!(
            server.updates().len(),
            before + 1,
            "the reply went out while full"
        );
        assert_eq!(server.updates().last().unwrap().write.as_u64(), 250);
        assert_eq!(server.confirmed(), 10, "nothing acked, nothing confirmed");
        // More events: one waits for room, the rest stay unread.
        server.send(begin(390));
        for i in 0..5 {
            server.send(insert(310 + i, &format!("f{i}"), Some("b"), "{}"));
        }
        server.send(commit(390, 400));
        idle(3500).await;
        assert_eq!(b.pending(), 3, "the bound holds");
        assert_eq!(
            server.unread(),
            5,
            "reading stopped behind the one record waiting for room (Begin and f0 read)"
        );
        let periodic = server.updates().len();
        assert!(
            periodic >= before + 4,
            "status updates keep going out every second while full: {periodic}"
        );
        // Room again: everything flows and is confirmed.
        while b.pending() > 0 {
            b.ack_all();
            idle(10).await;
        }
        until("confirmed", || server.confirmed() == 400).await;
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    assert_eq!(fx.broker.delivered().len(), 8);
}

#[tokio::test(start_paused = true)]
async fn backpressure_by_bytes_holds_one_record_at_a_time() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 2);
    let server = fx.source.session(10);
    // 2 KiB in flight; each event is ~1.5 KiB.
    let b = fx.broker.clone();
    let big = fakes::payload(1500);
    fx.run(|stop| async move {
        server.send(relation());
        server.send(begin(190));
        for i in 0..4 {
            server.send(insert(110 + i, &format!("e{i}"), Some("a"), &big));
        }
        server.send(commit(190, 200));
        server.send(keepalive(250, true));
        idle(2500).await;
        assert_eq!(b.pending(), 1, "only one 1.5 KiB record fits in 2 KiB");
        assert!(
            server.updates().len() >= 3,
            "status updates continue while full"
        );
        assert_eq!(server.confirmed(), 10);
        for _ in 0..4 {
            until("the next record", || b.pending() == 1).await;
            b.ack_oldest();
        }
        until("confirmed", || server.confirmed() == 200).await;
        assert_eq!(server.updates().last().unwrap().write.as_u64(), 250);
        stop.send(Stop::Graceful).unwrap();
    })
    .await
    .unwrap();
    assert_eq!(fx.broker.delivered().len(), 4);
}

#[tokio::test(start_paused = true)]
async fn sigterm_mid_transaction_drains_and_confirms_only_complete_transactions() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let status = server.status_handle();
    fx.run(|stop| async move {
        server.send(relation());
        server.transaction(190, &[("e1", Some("a"))]);
        server.send(begin(390));
        server.send(insert(310, "e2", Some("a"), "{}"));
        server.send(insert(320, "e3", Some("a"), "{}"));
        until("3 in flight", || b.pending() == 3).await;
        stop.send(Stop::Graceful).unwrap();
        idle(100).await;
        assert!(!server.closed(), "the relay waits for in-flight reports");
        b.ack_all();
        until("a clean close", || server.closed()).await;
    })
    .await
    .unwrap();
    let last = status.lock().unwrap().last().copied().unwrap();
    assert_eq!(
        last.flush.as_u64(),
        200,
        "the open transaction is not confirmed"
    );
    assert_eq!(fx.broker.delivered().len(), 3);
}

/// A broker that stops answering during the shutdown drain (a NATS ack
/// timing out): the drain ends there, cleanly, the slot confirmed only up
/// to what was acknowledged; the rest is sent again after the restart.
#[tokio::test(start_paused = true)]
async fn an_unanswered_delivery_during_the_drain_ends_it_cleanly_without_confirming_it() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let status = server.status_handle();
    fx.run(|stop| async move {
        server.send(relation());
        server.transaction(190, &[("e1", Some("a"))]);
        server.transaction(290, &[("e2", Some("b"))]);
        until("2 in flight", || b.pending() == 2).await;
        assert!(b.ack_key("a"));
        stop.send(Stop::Graceful).unwrap();
        idle(100).await;
        assert!(b.time_out_key("b"));
        until("a clean close", || server.closed()).await;
    })
    .await
    .unwrap();
    let last = status.lock().unwrap().last().copied().unwrap();
    assert_eq!(last.flush.as_u64(), 200, "confirmed up to e1, not past e2");
}

/// `on_slot_invalidated = "recreate"` republishes from the saved commit
/// time: it must never be past a transaction whose events wait for acks.
#[tokio::test(start_paused = true)]
async fn the_saved_position_never_passes_an_undelivered_transaction() {
    let mut fx = Fixture::new(DeadLetters::halt(), 100, 1024);
    let server = fx.source.session(10);
    let db = fx.source.database();
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.send(begin(190));
            server.send(insert(100, "e1", Some("a"), "{}"));
            server.send(commit(190, 200));
            server.send(begin(290));
            server.send(insert(200, "e2", Some("b"), "{}"));
            server.send(commit(290, 300));
            until("2 sent", || b.pending() == 2).await;
            assert!(b.ack_key("b"));
            tokio::time::sleep(Duration::from_secs(25)).await;
            assert!(
                db.positions.lock().unwrap().is_empty(),
                "the first transaction waits: no position is saved past it"
            );
            assert!(b.ack_key("a"));
            until("the position saved", || {
                !db.positions.lock().unwrap().is_empty()
            })
            .await;
            stop.send(Stop::Graceful).unwrap();
            until("a clean close", || server.closed()).await;
        })
        .await;
    result.unwrap();
    let saved = fx.source.database().positions.lock().unwrap().clone();
    assert_eq!(saved.len(), 1, "saved once, when it moved: {saved:?}");
    let (lsn, at) = saved[0];
    assert_eq!(lsn, pgoutput_decoder::Lsn::new(300));
    assert_eq!(
        at.as_pg_micros(),
        290,
        "the commit time of the newest delivered transaction"
    );
}
