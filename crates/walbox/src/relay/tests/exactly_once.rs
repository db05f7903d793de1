//! Exactly-once mode against the fakes. The fake broker keeps Kafka's
//! transactional promises (a transaction's records become visible at its
//! commit, all together; an abort or a new producer with the same id
//! discards them; a fenced producer can neither write nor commit), so these
//! tests check what a `read_committed` consumer would see: every event
//! once, in order, across crashes, aborts, splits and takeovers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sink_core::TxnErrorKind;
use tokio::sync::watch;

use super::fakes::{header, relation, Broker, FakeSource};
use super::{idle, until, Fixture};
use crate::dead_letter::DeadLetters;
use crate::exactly_once::{Bounds, ExactlyOnce, Position};
use crate::metrics::Metrics;
use crate::relay::{run, RelayConfig, RunError, Stop};

fn exactly_once(max_events: usize) -> Option<ExactlyOnce> {
    Some(ExactlyOnce {
        progress_topic: "progress".into(),
        transactional_id: "walbox-test".into(),
        slot: "walbox".into(),
        source: crate::config::EventSource::Table,
        bounds: Bounds {
            max_events,
            max_bytes: 1 << 20,
            max_time: Duration::from_millis(20),
        },
    })
}

fn fixture(dead_letters: DeadLetters, max_events: usize) -> Fixture {
    let mut fx = Fixture::new(dead_letters, 1000, 1 << 16);
    fx.config.exactly_once = exactly_once(max_events);
    fx
}

/// The ids of the visible records of `topic`, in order.
fn visible(broker: &Broker, topic: &str) -> Vec<String> {
    broker
        .delivered()
        .iter()
        .filter(|r| &*r.topic == topic)
        .map(|r| header(r, "id").unwrap().to_owned())
        .collect()
}

/// The last committed progress record.
fn committed(broker: &Broker) -> Option<Position> {
    broker
        .delivered()
        .iter()
        .rev()
        .find(|r| &*r.topic == "progress")
        .map(|r| Position::decode(r.value.as_ref().unwrap()).unwrap())
}

/// `n` events named `{prefix}{i}`, one aggregate each of 3.
fn events(prefix: &str, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| (format!("{prefix}{i}"), format!("agg-{}", i % 3)))
        .collect()
}

fn refs(events: &[(String, String)]) -> Vec<(&str, Option<&str>)> {
    events
        .iter()
        .map(|(id, key)| (id.as_str(), Some(key.as_str())))
        .collect()
}

/// A second walbox process: its own relay on `source`, a producer of its
/// own on the shared broker. Runs until `until_done` holds, then is killed
/// (dropped, as kill -9 would), or returns the relay's result if it ended.
async fn process(
    config: &RelayConfig,
    source: &mut FakeSource,
    broker: &Broker,
    mut until_done: impl FnMut() -> bool,
) -> Option<Result<(), RunError>> {
    let (producer, mut reports) = broker.another_producer(1000, 1 << 16);
    let (_stop, stopped) = watch::channel(Stop::No);
    let relay = run(
        config,
        source,
        super::fakes::ends(config, &producer),
        &mut reports,
        stopped,
        Metrics::new(),
    );
    tokio::pin!(relay);
    loop {
        tokio::select! {
            result = &mut relay => return Some(result),
            () = tokio::time::sleep(Duration::from_millis(5)) => {
                if until_done() {
                    return None;
                }
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn events_become_visible_at_the_commit_and_only_then_is_the_slot_confirmed() {
    let mut fx = fixture(DeadLetters::halt(), 100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
            until("2 in flight", || b.pending() == 2).await;
            // The broker has them; Kafka shows nothing, Postgres keeps them.
            b.ack_all();
            tokio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(visible(&b, "events"), Vec::<String>::new());
            assert!(server.confirmed() < 200, "confirmed before the commit");
            until("committed", || b.commits_and_aborts().0 == 1).await;
            assert_eq!(visible(&b, "events"), ["e1", "e2"]);
            until("confirmed", || server.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
        })
        .await;
    result.unwrap();
    let p = committed(&fx.broker).unwrap();
    assert_eq!((p.commit_lsn.as_u64(), p.events), (190, None));
}

#[tokio::test(start_paused = true)]
async fn a_crash_mid_transaction_then_a_restart_writes_each_event_once() {
    let fx = fixture(DeadLetters::halt(), 100);
    let config = fx.config.clone();
    let broker = fx.broker.clone();
    // The first process commits T1, sends T2 into a transaction, dies.
    let mut first = FakeSource::default();
    let s1 = first.session(10);
    s1.send(relation());
    s1.transaction(190, &refs(&events("a", 3)));
    let b = broker.clone();
    let mut sent = false;
    let killed = process(&config, &mut first, &broker, || {
        if !sent && b.commits_and_aborts().0 == 1 {
            s1.transaction(290, &refs(&events("b", 3)));
            sent = true;
        }
        sent && b.pending() == 3
    })
    .await;
    assert!(killed.is_none(), "killed with T2 in an open transaction");
    assert_eq!(visible(&broker, "events"), ["a0", "a1", "a2"]);
    // Postgres never saw a confirmation past T1 (or even T1's): it re-sends all.
    let mut second = FakeSource::default();
    let s2 = second.session(10);
    s2.send(relation());
    s2.transaction(190, &refs(&events("a", 3)));
    s2.transaction(290, &refs(&events("b", 3)));
    s2.transaction(390, &refs(&events("c", 2)));
    let b = broker.clone();
    let killed = process(&config, &mut second, &broker, || {
        visible(&b, "events").len() >= 8 && s2.confirmed() == 400
    })
    .await;
    assert!(killed.is_none());
    assert_eq!(
        visible(&broker, "events"),
        ["a0", "a1", "a2", "b0", "b1", "b2", "c0", "c1"],
        "each event once, in commit order"
    );
}

/// The committed progress cannot be read when the restart begins (a
/// leader election on the progress topic, a transaction still open on it):
/// that is never "no progress". The session ends without streaming, the
/// next one reads the progress and skips what Kafka already holds.
#[tokio::test(start_paused = true)]
async fn a_progress_read_that_fails_is_retried_never_taken_for_no_progress() {
    let fx = fixture(DeadLetters::halt(), 100);
    let config = fx.config.clone();
    let broker = fx.broker.clone();
    let mut first = FakeSource::default();
    let s1 = first.session(10);
    s1.send(relation());
    s1.transaction(190, &refs(&events("a", 3)));
    let b = broker.clone();
    let killed = process(&config, &mut first, &broker, || {
        b.commits_and_aborts().0 == 1
    })
    .await;
    assert!(killed.is_none());
    // Postgres re-sends T1 (the slot never saw its confirmation), twice:
    // once to the session whose read fails, once to the next.
    broker.fail_progress_reads(2);
    let mut second = FakeSource::default();
    let mut servers = Vec::new();
    for _ in 0..3 {
        let s = second.session(10);
        s.send(relation());
        s.transaction(190, &refs(&events("a", 3)));
        s.transaction(290, &refs(&events("b", 2)));
        servers.push(s);
    }
    let b = broker.clone();
    let last = servers.last().unwrap();
    let killed = process(&config, &mut second, &broker, || {
        visible(&b, "events").len() >= 5 && last.confirmed() == 300
    })
    .await;
    assert!(killed.is_none(), "the relay ended: {killed:?}");
    assert_eq!(
        visible(&broker, "events"),
        ["a0", "a1", "a2", "b0", "b1"],
        "each event once: T1 skipped after the progress was read"
    );
}

/// The database restored from a snapshot on the same timeline after walbox
/// committed past the snapshot: the progress record lies beyond the
/// server's WAL and describes none of it; the restored server's new
/// transactions at those positions are written, not skipped.
#[tokio::test(start_paused = true)]
async fn after_a_restore_on_the_same_timeline_the_progress_skips_nothing_new() {
    let fx = fixture(DeadLetters::halt(), 100);
    let config = fx.config.clone();
    let broker = fx.broker.clone();
    let mut first = FakeSource::default();
    let s1 = first.session(10);
    s1.send(relation());
    s1.transaction(190, &refs(&events("a", 2)));
    s1.transaction(390, &refs(&events("b", 2)));
    let b = broker.clone();
    let killed = process(&config, &mut first, &broker, || {
        visible(&b, "events").len() == 4
    })
    .await;
    assert!(killed.is_none());
    assert_eq!(committed(&broker).unwrap().commit_lsn.as_u64(), 390);
    // Restored to a snapshot taken at 100, whose WAL ends at 120.
    let mut second = FakeSource::default();
    let s2 = second.session_restored("system 1 timeline 1", 100, 120);
    s2.send(relation());
    s2.transaction(190, &refs(&events("x", 2)));
    s2.transaction(290, &refs(&events("y", 1)));
    let b = broker.clone();
    let written = process(&config, &mut second, &broker, || {
        visible(&b, "events").len() >= 7 && s2.confirmed() == 300
    });
    let killed = tokio::time::timeout(Duration::from_secs(60), written)
        .await
        .unwrap_or_else(|_| panic!("not written: {:?}", visible(&broker, "events")));
    assert!(killed.is_none());
    assert_eq!(
        visible(&broker, "events"),
        ["a0", "a1", "b0", "b1", "x0", "x1", "y0"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_postgres_transaction_larger_than_the_bound_is_split_and_resumed_inside() {
    let fx = fixture(DeadLetters::halt(), 10);
    let config = fx.config.clone();
    let broker = fx.broker.clone();
    let big = events("x", 25);
    let mut first = FakeSource::default();
    let s1 = first.session(10);
    s1.send(relation());
    s1.transaction(10_000, &refs(&big));
    let b = broker.clone();
    let mut most_pending = 0;
    let killed = process(&config, &mut first, &broker, || {
        most_pending = most_pending.max(b.pending());
        b.commits_and_aborts().0 == 2
    })
    .await;
    assert!(killed.is_none());
    assert!(
        most_pending <= 11,
        "{most_pending} records in one transaction"
    );
    let p = committed(&broker).unwrap();
    assert_eq!((p.commit_lsn.as_u64(), p.events), (10_000, Some(20)));
    assert_eq!(
        s1.confirmed(),
        10,
        "the slot cannot move inside a transaction"
    );
    // The restart re-sends the whole transaction; its first 20 rows are in Kafka.
    let mut second = FakeSource::default();
    let s2 = second.session(10);
    s2.send(relation());
    s2.transaction(10_000, &refs(&big));
    let killed = process(&config, &mut second, &broker, || s2.confirmed() == 10_010).await;
    assert!(killed.is_none());
    let want: Vec<String> = big.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(visible(&broker, "events"), want, "each row once, in order");
}

/// Killed inside a split transaction, restarted with another `source`:
/// the progress counts that transaction's events as the old source read
/// them (rows only, say), the new one would count rows and messages, and
/// skip the wrong ones. The restart refuses, in one line that says how to
/// get past it, and writes nothing.
#[tokio::test(start_paused = true)]
async fn a_restart_inside_a_split_transaction_with_another_source_is_refused() {
    let fx = fixture(DeadLetters::halt(), 10);
    let config = fx.config.clone();
    let broker = fx.broker.clone();
    let big = events("x", 25);
    let mut first = FakeSource::default();
    let s1 = first.session(10);
    s1.send(relation());
    s1.transaction(10_000, &refs(&big));
    let b = broker.clone();
    let killed = process(&config, &mut first, &broker, || {
        b.commits_and_aborts().0 == 2
    })
    .await;
    assert!(killed.is_none());
    let p = committed(&broker).unwrap();
    assert_eq!(p.events, Some(20));
    let mut other = config.clone();
    other.exactly_once.as_mut().unwrap().source = crate::config::EventSource::Both;
    let mut second = FakeSource::default();
    let s2 = second.session(10);
    s2.send(relation());
    s2.transaction(10_000, &refs(&big));
    let ended = process(&other, &mut second, &broker, || s2.confirmed() == 10_010).await;
    let Some(Err(e)) = ended else {
        panic!("the restart with another source went on: {ended:?}");
    };
    let message = e.to_string();
    assert!(
        message.contains("source = table") && message.contains("source = both"),
        "{message}"
    );
    assert_eq!(visible(&broker, "events").len(), 20, "nothing more written");
    // With the source it was written with, it finishes the transaction.
    let mut third = FakeSource::default();
    let s3 = third.session(10);
    s3.send(relation());
    s3.transaction(10_000, &refs(&big));
    let killed = process(&config, &mut third, &broker, || s3.confirmed() == 10_010).await;
    assert!(killed.is_none());
    let want: Vec<String> = big.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(visible(&broker, "events"), want, "each row once, in order");
}

/// The transaction's time bound passes while a record waits for room in
/// flight (a slow broker): the record is sent once room frees, and the
/// transaction closes and commits. (The bound's timer, once past, was ready
/// on every turn of the loop and kept it from ever polling for room: the
/// relay spun without sending, reading or committing, and said nothing.)
#[tokio::test(start_paused = true)]
async fn a_transaction_past_its_time_bound_while_a_record_waits_for_room_still_commits() {
    let mut fx = Fixture::new(DeadLetters::halt(), 2, 1 << 16);
    fx.config.exactly_once = exactly_once(100);
    let server = fx.source.session(10);
    let b = fx.broker.clone();
    let five = events("e", 5);
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &refs(&five));
            until("2 in flight, the rest waiting for room", || {
                b.pending() == 2
            })
            .await;
            // Past the 20 ms bound, with records still waiting for room.
            idle(100).await;
            assert_eq!(b.commits_and_aborts(), (0, 0));
            until("all five committed", || {
                b.ack_all();
                visible(&b, "events").len() == 5
            })
            .await;
            until("confirmed", || server.confirmed() == 200).await;
            stop.send(Stop::Graceful).unwrap();
        })
        .await;
    result.unwrap();
    assert_eq!(
        visible(&fx.broker, "events"),
        ["e0", "e1", "e2", "e3", "e4"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_zombie_that_wakes_up_after_the_takeover_writes_nothing_visible() {
    let fx = fixture(DeadLetters::halt(), 100);
    let config = fx.config.clone();
    let broker = fx.broker.clone();
    // The old instance: T1 committed, T2 sent into a transaction, then it stalls.
    let mut old_source = FakeSource::default();
    let s1 = old_source.session(10);
    s1.send(relation());
    s1.transaction(190, &refs(&events("a", 2)));
    let (old_producer, mut old_reports) = broker.another_producer(1000, 1 << 16);
    let (_stop, stopped) = watch::channel(Stop::No);
    let old = run(
        &config,
        &mut old_source,
        super::fakes::ends(&config, &old_producer),
        &mut old_reports,
        stopped,
        Metrics::new(),
    );
    tokio::pin!(old);
    let b = broker.clone();
    tokio::select! {
        r = &mut old => panic!("the old instance ended: {r:?}"),
        () = until("T1 committed", || b.commits_and_aborts().0 == 1) => {}
    }
    s1.transaction(290, &refs(&events("b", 2)));
    tokio::select! {
        r = &mut old => panic!("the old instance ended: {r:?}"),
        () = until("T2 sent", || b.pending() == 2) => {}
    }
    // SIGSTOP: the old instance is not polled any more; the broker has T2
    // in its open transaction.
    b.ack_all();
    assert_eq!(b.uncommitted(), 2);
    // The standby takes over the slot (the walsender dropped the stalled one).
    let mut new_source = FakeSource::default();
    let s2 = new_source.session(10);
    s2.send(relation());
    s2.transaction(190, &refs(&events("a", 2)));
    s2.transaction(290, &refs(&events("b", 2)));
    s2.transaction(390, &refs(&events("c", 1)));
    let b = broker.clone();
    let killed = process(&config, &mut new_source, &broker, || {
        visible(&b, "events").len() >= 5 && s2.confirmed() == 400
    })
    .await;
    assert!(killed.is_none());
    // The old one wakes up: its commit is refused, it stops, nothing shows.
    s1.transaction(390, &refs(&events("c", 1)));
    let result = tokio::time::timeout(Duration::from_secs(60), &mut old)
        .await
        .expect("the zombie stops");
    let e = result.unwrap_err();
    assert!(matches!(e, RunError::Fenced { .. }), "{e}");
    assert!(e.to_string().contains("took over"), "{e}");
    assert_eq!(
        visible(&broker, "events"),
        ["a0", "a1", "b0", "b1", "c0"],
        "the zombie's late writes never become visible"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failed_commit_aborts_and_the_replay_writes_each_event_once() {
    let mut fx = fixture(DeadLetters::halt(), 100);
    let first = fx.source.session(10);
    let second = fx.source.session(10);
    let b = fx.broker.clone();
    b.fail_next_commit(TxnErrorKind::Abortable);
    let metrics = fx.metrics.clone();
    let result = fx
        .run(|stop| async move {
            first.send(relation());
            first.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
            until("aborted", || b.commits_and_aborts().1 == 1).await;
            second.send(relation());
            second.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
            second.transaction(290, &[("e3", Some("a"))]);
            until("confirmed", || second.confirmed() == 300).await;
            stop.send(Stop::Graceful).unwrap();
        })
        .await;
    result.unwrap();
    assert_eq!(visible(&fx.broker, "events"), ["e1", "e2", "e3"]);
    assert!(metrics
        .encode()
        .contains("walbox_transactions_aborted_total 1"));
}

/// A `COPY` into the outbox decodes its rows at one WAL position: the
/// refusal of one of them dead-letters that one on the replay, not its
/// siblings.
/// A fixture whose Kafka transactions stay open up to 10 s after their
/// first event (so a shutdown finds one open), shutting down within
/// `shutdown`.
fn slow_closing(shutdown: Duration) -> Fixture {
    let mut fx = fixture(DeadLetters::halt(), 100);
    fx.config.exactly_once.as_mut().unwrap().bounds.max_time = Duration::from_secs(10);
    fx.config.shutdown_timeout = shutdown;
    fx
}

/// SIGTERM between Postgres transactions, with a Kafka transaction open
/// over complete ones: it is committed (not aborted on a false "timeout
/// inside a transaction"), and the slot confirmed past it.
#[tokio::test(start_paused = true)]
async fn sigterm_between_transactions_commits_the_open_kafka_transaction() {
    let mut fx = slow_closing(Duration::from_secs(20));
    let server = fx.source.session(10);
    let status = server.status_handle();
    let b = fx.broker.clone();
    let result = fx
        .run(|stop| async move {
            server.send(relation());
            server.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
            until("2 in flight", || b.pending() == 2).await;
            b.ack_all();
            tokio::time::sleep(Duration::from_millis(5)).await;
            assert_eq!(b.commits_and_aborts(), (0, 0), "open: its bound is 10 s");
            stop.send(Stop::Graceful).unwrap();
            until("confirmed", || server.confirmed() == 200).await;
            std::future::pending::<()>().await;
        })
        .await;
    result.unwrap();
    let confirmed = status
        .lock()
        .unwrap()
        .iter()
        .map(|u| u.flush.as_u64())
        .max();
    assert_eq!(
        (fx.broker.commits_and_aborts(), confirmed),
        ((1, 0), Some(200)),
        "(commits, aborts), and the slot's last confirmation"
    );
    assert_eq!(visible(&fx.broker, "events"), ["e1", "e2"]);
}

/// Every broker down when SIGTERM comes, a Kafka transaction open: the
/// shutdown ends within its bound (plus the one second an abort is given
/// after it), not after the commit's and the aborts' own timeouts; and a
/// second signal ends it at once. What stays open is aborted by the next
/// start (or the broker's transaction timeout); nothing is confirmed past
/// the last commit.
#[tokio::test(start_paused = true)]
async fn the_shutdown_bound_and_the_second_signal_hold_with_the_brokers_down() {
    for second_signal in [false, true] {
        let mut fx = slow_closing(Duration::from_secs(5));
        let server = fx.source.session(10);
        let b = fx.broker.clone();
        let started = Arc::new(Mutex::new(None));
        let at = Arc::clone(&started);
        let status = server.status_handle();
        let result = fx
            .run(|stop| async move {
                server.send(relation());
                server.transaction(190, &[("e1", Some("a")), ("e2", Some("b"))]);
                until("2 in flight", || b.pending() == 2).await;
                b.set_unresponsive(true);
                *at.lock().unwrap() = Some(tokio::time::Instant::now());
                stop.send(Stop::Graceful).unwrap();
                if second_signal {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    stop.send(Stop::Now).unwrap();
                }
                std::future::pending::<()>().await;
            })
            .await;
        result.unwrap();
        let took = started.lock().unwrap().unwrap().elapsed();
        let bound = if second_signal {
            Duration::from_millis(200) + Duration::from_secs(1)
        } else {
            Duration::from_secs(5 + 1)
        };
        assert!(
            took <= bound,
            "second signal: {second_signal}: the shutdown took {took:?} (bound {bound:?})"
        );
        let confirmed = status
            .lock()
            .unwrap()
            .iter()
            .map(|u| u.flush.as_u64())
            .max();
        assert!(
            confirmed.unwrap_or(0) <= 10,
            "confirmed past an uncommitted transaction: {confirmed:?}"
        );
        assert!(visible(&fx.broker, "events").is_empty());
    }
}
