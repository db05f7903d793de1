use super::*;
use proptest::prelude::*;

fn l(v: u64) -> Lsn {
    Lsn::new(v)
}

/// A tracker in session 1 at `confirmed`, whose first update was sent at `t0`.
fn started(confirmed: u64, t0: Instant) -> Progress {
    let mut p = Progress::new(Duration::from_secs(1), EAGER_GAP);
    p.start_session(l(confirmed), History::Same);
    assert!(p.tick(t0).is_some(), "the first update is due at once");
    // Coverage is the relay's concern: here the publication covers all.
    assert_eq!(p.covered(Lsn::new(u64::MAX), t0), None);
    p
}

fn acked(a: Ack) -> Option<StandbyStatusUpdate> {
    match a {
        Ack::Current(u) => u,
        Ack::Stale => panic!("stale"),
    }
}

#[test]
fn confirms_the_newest_complete_prefix() {
    let t = Instant::now();
    let mut p = started(10, t);
    p.begin(l(90)).unwrap();
    let a1 = p.event().unwrap();
    let a2 = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    p.begin(l(190)).unwrap();
    let b1 = p.event().unwrap();
    p.commit(l(190), l(200), t).unwrap();
    p.begin(l(290)).unwrap();
    p.commit(l(290), l(300), t).unwrap();
    assert_eq!(
        p.confirmable(),
        l(10),
        "T3 has no events but waits for T1 and T2"
    );

    p.ack(b1, t).unwrap();
    assert_eq!(p.confirmable(), l(10), "T2 acked first: still waits for T1");
    p.ack(a2, t).unwrap();
    assert_eq!(p.confirmable(), l(10));
    p.ack(a1, t).unwrap();
    assert_eq!(
        p.confirmable(),
        l(300),
        "T1 complete: T1, T2, T3 all confirmable"
    );
    assert_eq!((p.unacked_events(), p.pending_transactions()), (0, 0));
    assert_eq!(
        p.ack(a1, t),
        Err(ProgressError::UnknownToken),
        "a double ack is refused"
    );
}

#[test]
fn keepalives_advance_only_when_nothing_is_pending() {
    let t = Instant::now();
    let mut p = started(10, t);
    p.keepalive(l(50), false, t);
    assert_eq!(p.confirmable(), l(50));
    p.keepalive(l(40), false, t);
    assert_eq!(p.confirmable(), l(50), "never backward");
    p.begin(l(90)).unwrap();
    p.keepalive(l(500), false, t);
    assert_eq!(p.confirmable(), l(50), "a transaction is open");
    let e = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    p.keepalive(l(500), false, t);
    assert_eq!(p.confirmable(), l(50), "an event is unacked");
    p.ack(e, t).unwrap();
    p.keepalive(l(500), false, t);
    assert_eq!(p.confirmable(), l(500));
}

#[test]
fn protocol_errors_are_reported() {
    let t = Instant::now();
    let mut p = started(0, t);
    assert_eq!(p.event(), Err(ProgressError::EventOutsideTransaction));
    assert_eq!(
        p.commit(l(5), l(6), t),
        Err(ProgressError::CommitWithoutBegin(l(5)))
    );
    p.begin(l(9)).unwrap();
    assert_eq!(
        p.begin(l(19)),
        Err(ProgressError::NestedBegin {
            open: l(9),
            new: l(19)
        })
    );
    assert_eq!(
        p.commit(l(8), l(10), t),
        Err(ProgressError::CommitMismatch {
            final_lsn: l(9),
            commit_lsn: l(8)
        })
    );
}

#[test]
fn a_report_from_an_earlier_session_is_ignored() {
    let t = Instant::now();
    let mut p = started(10, t);
    // Session 1: T1 (end 100) sends one event, then the connection breaks.
    p.begin(l(90)).unwrap();
    let old = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    // Session 2 re-reads from the slot's position; the same sequence number
    // now belongs to a different transaction (T1 re-sent with two events).
    p.start_session(l(10), History::Same);
    p.begin(l(90)).unwrap();
    let new1 = p.event().unwrap();
    let new2 = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    assert_eq!(p.ack(old, t), Ok(Ack::Stale));
    assert_eq!(p.unacked_events(), 2, "the stale report acked nothing");
    p.ack(new1, t).unwrap();
    assert_eq!(p.confirmable(), l(10), "one event of T1 is still unacked");
    p.ack(new2, t).unwrap();
    assert_eq!(p.confirmable(), l(100));
}

#[test]
fn a_new_session_starts_at_the_slot_and_forgets_the_open_transaction() {
    let t = Instant::now();
    let mut p = started(10, t);
    p.begin(l(90)).unwrap();
    let _ = p.event().unwrap();
    p.start_session(l(10), History::Same);
    assert!(!p.in_transaction());
    assert_eq!((p.unacked_events(), p.pending_transactions()), (0, 0));
    p.keepalive(l(1000), false, t);
    assert_eq!(
        p.confirmable(),
        l(1000),
        "nothing of this session is pending"
    );
}

#[test]
fn updates_are_periodic_on_request_or_eager() {
    let t0 = Instant::now();
    let mut p = started(1, t0);
    let ms = Duration::from_millis;
    assert!(p.tick(t0 + ms(500)).is_none());
    assert!(
        p.keepalive(l(1), true, t0 + ms(500)).is_some(),
        "reply requested"
    );
    let t1 = t0 + ms(500);
    assert_eq!(p.next_due(), Some(t1 + Duration::from_secs(1)));
    // The position moves: an update goes out at once (the gap has passed).
    p.begin(l(1)).unwrap();
    let e = p.event().unwrap();
    assert!(
        p.commit(l(1), l(2), t1 + ms(200)).unwrap().is_none(),
        "nothing new yet"
    );
    let u = acked(p.ack(e, t1 + ms(200)).unwrap()).expect("eager");
    assert_eq!((u.write, u.flush, u.apply), (l(2), l(2), l(2)));
    assert!(p.tick(t1 + ms(201)).is_none(), "nothing new to confirm");
    assert!(p.tick(t1 + ms(1200)).is_some(), "periodic");
}

#[test]
fn eager_updates_respect_the_gap_and_a_held_back_one_is_due_at_its_end() {
    let t0 = Instant::now();
    let mut p = started(1, t0);
    p.begin(l(1)).unwrap();
    let e = p.event().unwrap();
    p.commit(l(1), l(2), t0).unwrap();
    assert!(
        acked(p.ack(e, t0 + EAGER_GAP / 2).unwrap()).is_none(),
        "too soon"
    );
    assert_eq!(
        p.next_due(),
        Some(t0 + EAGER_GAP),
        "the held-back confirmation is due at the gap's end, not the interval's"
    );
    assert_eq!(p.tick(t0 + EAGER_GAP).unwrap().flush, l(2));
    assert_eq!(
        p.next_due(),
        Some(t0 + EAGER_GAP + Duration::from_secs(1)),
        "nothing held back: the periodic update is next"
    );
}

#[test]
fn write_is_never_behind_flush() {
    let t = Instant::now();
    let mut p = started(100, t);
    p.received(l(300));
    p.received(l(200));
    assert_eq!(p.received_lsn(), l(300));
    p.keepalive(l(400), false, t);
    let u = p.final_update(t);
    assert_eq!((u.write, u.flush), (l(400), l(400)));
}

/// A transaction of the property test: how many events it has.
fn transactions() -> impl Strategy<Value = (Vec<u8>, Vec<usize>, Vec<bool>)> {
    proptest::collection::vec(0u8..5, 1..30).prop_flat_map(|events| {
        let n: usize = events.iter().map(|e| *e as usize).sum();
        (
            Just(events),
            Just(n).prop_flat_map(|n| Just((0..n).collect::<Vec<_>>()).prop_shuffle()),
            proptest::collection::vec(any::<bool>(), 0..200),
        )
    })
}

proptest! {
    /// Whatever order acks arrive in, interleaved with stream messages and
    /// keepalives: the position never moves backward, never passes a
    /// transaction with an unacked event, no status update reports more,
    /// and it ends at the last commit.
    #[test]
    fn never_confirms_past_an_unacked_event((events, ack_order, interleave) in transactions()) {
        let now = Instant::now();
        let mut p = Progress::new(Duration::from_secs(1), EAGER_GAP);
        p.start_session(l(1), History::Same);
        p.covered(Lsn::new(u64::MAX), now);
        // Stream: transaction i spans final 100i+90, end 100i+100.
        let mut tokens = Vec::new(); // (tx index, token)
        let mut remaining = ack_order;
        let mut interleave = interleave.into_iter();
        let mut acked = vec![0u8; events.len()];
        let mut last = p.confirmable();
        let mut clock = 0u64;
        let mut tick = || { clock += 37; now + Duration::from_millis(clock) };
        let check = |p: &Progress, update: Option<StandbyStatusUpdate>, acked: &[u8], last: &mut Lsn, committed: usize| {
            let c = p.confirmable();
            assert!(c >= *last, "moved backward");
            *last = c;
            if let Some(u) = update {
                assert_eq!(u.flush, c, "an update reports the confirmable position");
            }
            // Confirming X means every transaction ending at or before X
            // is complete: X stays below the end of the first transaction
            // that is not (committed with an unacked event, or still open).
            let first_incomplete = (0..committed)
                .find(|&i| acked[i] < events[i])
                .or_else(|| p.in_transaction().then_some(committed));
            if let Some(fi) = first_incomplete {
                let end = l(100 * (fi as u64 + 1));
                assert!(c < end, "confirmed {c}, but transaction {fi} (end {end}) is incomplete");
            }
        };
        for (i, &n) in events.iter().enumerate() {
            let base = 100 * i as u64;
            p.begin(l(base + 90)).unwrap();
            for _ in 0..n {
                tokens.push((i, p.event().unwrap()));
            }
            while interleave.next() == Some(true) {
                if let Some(pos) = remaining.iter().position(|&k| k < tokens.len()) {
                    let (tx, token) = tokens[remaining.remove(pos)];
                    let u = acked_update(p.ack(token, tick()).unwrap());
                    acked[tx] += 1;
                    check(&p, u, &acked, &mut last, i);
                }
            }
            let u = p.keepalive(l(base + 95), false, tick());
            check(&p, u, &acked, &mut last, i);
            let u = p.commit(l(base + 90), l(base + 100), tick()).unwrap();
            check(&p, u, &acked, &mut last, i + 1);
            // A keepalive past the commit: confirmable only if all is acked.
            let u = p.keepalive(l(base + 105), true, tick());
            check(&p, u, &acked, &mut last, i + 1);
        }
        for k in remaining {
            let (tx, token) = tokens[k];
            let u = acked_update(p.ack(token, tick()).unwrap());
            acked[tx] += 1;
            check(&p, u, &acked, &mut last, events.len());
        }
        let end = 100 * events.len() as u64;
        prop_assert!(p.confirmable() == l(end) || p.confirmable() == l(end + 5), "ended at {}", p.confirmable());
        prop_assert_eq!(p.unacked_events(), 0);
        prop_assert_eq!(p.pending_transactions(), 0);
    }
}

fn acked_update(a: Ack) -> Option<StandbyStatusUpdate> {
    match a {
        Ack::Current(u) => u,
        Ack::Stale => panic!("no session change in this test"),
    }
}

#[test]
fn a_replay_of_delivered_transactions_is_recognised_after_a_reconnect() {
    let t = Instant::now();
    let mut p = started(10, t);
    for (commit, end) in [(90, 100), (190, 200)] {
        p.begin(l(commit)).unwrap();
        assert!(!p.replaying());
        let e = p.event().unwrap();
        p.commit(l(commit), l(end), t).unwrap();
        p.ack(e, t).unwrap();
    }
    assert_eq!(p.confirmable(), l(200));
    // Postgres restarted before a checkpoint: the slot resumes at 10.
    assert_eq!(p.start_session(l(10), History::Same), Some(l(200)));
    assert_eq!(
        p.confirmable(),
        l(200),
        "what was delivered stays confirmable"
    );
    let first = p.tick(t).expect("the first update is due at once");
    assert_eq!(first.flush, l(200), "and it is re-confirmed at once");
    for (commit, end) in [(90, 100), (190, 200)] {
        p.begin(l(commit)).unwrap();
        assert!(p.replaying(), "T at {commit} was delivered");
        p.commit(l(commit), l(end), t).unwrap();
    }
    // The server's rule: a commit at the confirmed position is new.
    p.begin(l(200)).unwrap();
    assert!(!p.replaying());
    let e = p.event().unwrap();
    p.commit(l(200), l(300), t).unwrap();
    assert_eq!(p.confirmable(), l(200));
    p.ack(e, t).unwrap();
    assert_eq!(p.confirmable(), l(300));
}

#[test]
fn a_new_server_history_trusts_the_slot() {
    let t = Instant::now();
    let mut p = started(10, t);
    p.begin(l(90)).unwrap();
    let e = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    p.ack(e, t).unwrap();
    // A promoted standby: its LSNs do not compare with the old history's.
    assert_eq!(p.start_session(l(50), History::New), None);
    assert_eq!(p.confirmable(), l(50));
    p.begin(l(90)).unwrap();
    assert!(!p.replaying(), "a transaction of the new history is sent");
}

#[test]
fn the_slot_moved_ahead_by_someone_else_is_the_start() {
    let t = Instant::now();
    let mut p = started(10, t);
    assert_eq!(p.start_session(l(500), History::Same), None);
    assert_eq!(p.confirmable(), l(500));
}

#[test]
fn empty_transactions_behind_a_stuck_event_fold_into_one_entry() {
    let t = Instant::now();
    let mut p = started(10, t);
    p.begin(l(90)).unwrap();
    let stuck = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    // A busy database: every transaction arrives as Begin/Commit (PG 13/14).
    for i in 1..=100_000u64 {
        p.begin(l(100 + 10 * i)).unwrap();
        p.commit(l(100 + 10 * i), l(105 + 10 * i), t).unwrap();
    }
    assert_eq!(
        p.pending_transactions(),
        1,
        "100,000 empty transactions did not grow the tracker"
    );
    p.keepalive(l(2_000_000), false, t);
    assert_eq!(p.confirmable(), l(10), "nothing passes the stuck event");
    // An event behind them still gets its own entry, and completes in order.
    p.begin(l(1_000_100)).unwrap();
    let later = p.event().unwrap();
    p.commit(l(1_000_100), l(1_000_105), t).unwrap();
    p.ack(later, t).unwrap();
    assert_eq!(p.confirmable(), l(10));
    p.ack(stuck, t).unwrap();
    assert_eq!(p.confirmable(), l(1_000_105));
    assert_eq!(p.pending_transactions(), 0);
}

#[test]
fn nothing_is_confirmed_past_the_verified_coverage() {
    let t = Instant::now();
    let mut p = Progress::new(Duration::from_secs(1), EAGER_GAP);
    p.start_session(l(10), History::Same);
    assert_eq!(p.tick(t).unwrap().flush, l(10));
    p.begin(l(90)).unwrap();
    let e = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    p.ack(e, t).unwrap();
    p.keepalive(l(5000), false, t);
    assert_eq!(p.delivered(), l(5000));
    assert_eq!(p.confirmable(), l(10), "coverage not verified yet");
    let later = t + Duration::from_secs(2);
    let u = p.covered(l(400), later).expect("the position moved");
    assert_eq!((u.flush, u.write), (l(400), l(5000)));
    assert_eq!(p.confirmable(), l(400));
    p.covered(l(300), later);
    assert_eq!(p.confirmable(), l(400), "never backward");
    // A reconnect keeps what was verified; a new history does not.
    p.start_session(l(10), History::Same);
    assert_eq!(p.confirmable(), l(400));
    p.start_session(l(10), History::New);
    assert_eq!(p.confirmable(), l(10));
}

#[test]
fn the_delivered_commit_time_is_that_of_the_newest_delivered_prefix() {
    let t = Instant::now();
    let mut p = started(10, t);
    let at = |s: i64| PgTimestamp::from_pg_micros(s * 1_000_000);
    assert_eq!(p.delivered_commit_time(), None);
    p.begin_at(l(90), at(1)).unwrap();
    let a = p.event().unwrap();
    p.commit(l(90), l(100), t).unwrap();
    p.begin_at(l(190), at(2)).unwrap();
    let b = p.event().unwrap();
    p.commit(l(190), l(200), t).unwrap();
    // A transaction without events folds into the one before it.
    p.begin_at(l(290), at(3)).unwrap();
    p.commit(l(290), l(300), t).unwrap();
    acked(p.ack(b, t).unwrap());
    assert_eq!(
        p.delivered_commit_time(),
        None,
        "the first transaction waits: nothing after it counts"
    );
    acked(p.ack(a, t).unwrap());
    assert_eq!(p.delivered_commit_time(), Some((l(300), at(3))));
}
