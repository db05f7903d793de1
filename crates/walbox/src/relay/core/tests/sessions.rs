//! A new session after a reconnect, a failover or a restore, synchronously:
//! what is sent again and what is not.

use sink_core::Record;

use super::{config, confirmable, covered, deliver, feed, rows, start_on, Harness};
use crate::dead_letter::DeadLetters;
use crate::relay::tests::fakes::{header, relation};
use crate::relay::Token;

fn ids(records: &[Record<Token>]) -> Vec<&str> {
    records.iter().map(|r| header(r, "id").unwrap()).collect()
}

/// A session on `history` at the slot's `slot`, the server's WAL ending at
/// `server_wal`, with the coverage read.
fn session(core: &mut Harness<'_>, slot: u64, history: &str, server_wal: u64) {
    start_on(core, slot, history, server_wal);
    core.coverage(covered(1 << 20)).unwrap();
}

#[test]
fn transactions_delivered_before_a_reconnect_are_not_sent_again() {
    let config = config(DeadLetters::halt(), None);
    let mut core = Harness::new(&config);
    session(&mut core, 10, "system 1 timeline 1", 1 << 20);
    feed(&mut core, vec![relation()]);
    feed(
        &mut core,
        rows(190, &[("e1", Some("a")), ("e2", Some("b"))], false),
    );
    let first = deliver(&mut core);
    assert_eq!(confirmable(&mut core), 200);
    // Postgres restarted before a checkpoint: the slot is back at 10, and
    // the server re-sends what it thinks is unconfirmed, then new work.
    session(&mut core, 10, "system 1 timeline 1", 1 << 20);
    assert_eq!(
        confirmable(&mut core),
        200,
        "the first update re-confirms what was delivered"
    );
    feed(&mut core, vec![relation()]);
    feed(
        &mut core,
        rows(190, &[("e1", Some("a")), ("e2", Some("b"))], false),
    );
    feed(&mut core, rows(290, &[("e3", Some("a"))], false));
    let second = deliver(&mut core);
    assert_eq!(confirmable(&mut core), 300);
    assert_eq!(
        [ids(&first), ids(&second)].concat(),
        ["e1", "e2", "e3"],
        "each event once"
    );
    assert!(core
        .metrics()
        .encode()
        .contains("walbox_events_replay_skipped_total 2"));
}

#[test]
fn after_a_failover_to_another_history_nothing_is_skipped() {
    let config = config(DeadLetters::halt(), None);
    let mut core = Harness::new(&config);
    session(&mut core, 10, "system 1 timeline 1", 1 << 20);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("e1", Some("a"))], false));
    let first = deliver(&mut core);
    assert_eq!(confirmable(&mut core), 200);
    // A promoted standby: LSN 190 there is another transaction.
    session(&mut core, 10, "system 1 timeline 2", 1 << 20);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("x1", Some("a"))], false));
    let second = deliver(&mut core);
    assert_eq!(confirmable(&mut core), 200);
    assert_eq!([ids(&first), ids(&second)].concat(), ["e1", "x1"]);
}

#[test]
fn a_restore_on_the_same_timeline_skips_nothing_new() {
    let config = config(DeadLetters::halt(), None);
    let mut core = Harness::new(&config);
    session(&mut core, 10, "system 1 timeline 1", 1 << 20);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("e1", Some("a"))], false));
    feed(&mut core, rows(390, &[("e2", Some("a"))], false));
    let first = deliver(&mut core);
    assert_eq!(confirmable(&mut core), 400);
    // The snapshot was taken at 100: the slot comes back there, and the
    // restored server's WAL ends at 120, before the 400 delivered.
    session(&mut core, 100, "system 1 timeline 1", 120);
    feed(&mut core, vec![relation()]);
    feed(&mut core, rows(190, &[("x1", Some("a"))], false));
    feed(&mut core, rows(290, &[("x2", Some("a"))], false));
    let second = deliver(&mut core);
    assert_eq!(confirmable(&mut core), 300);
    assert_eq!(
        [ids(&first), ids(&second)].concat(),
        ["e1", "e2", "x1", "x2"],
        "the restored server's events"
    );
    let m = core.metrics().encode();
    assert!(
        m.contains(r#"walbox_history_changes_total{reason="wal_behind"} 1"#),
        "{m}"
    );
}
