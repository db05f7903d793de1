//! walbox and Debezium side by side (docs/benchmarks.md, "walbox and
//! Debezium"): the same outbox rows, the same Postgres, the same Apache
//! Kafka broker, one relay at a time.
//!
//! * `backlog`: a backlog drained by pg_recvlogical (the slot's own limit),
//!   walbox and Debezium, each from its own slot made before the backlog
//!   was written: time until every event is on the topic (counted by the
//!   topic's end offsets, then read back: every event id once), CPU
//!   seconds, peak RSS, the walsender's CPU; then by the polling relay,
//!   from a copy of the rows; and what each reader cost the primary.
//! * `curve`: commit → on the topic at 1,000, 5,000 and 20,000 events/s
//!   and as fast as pgbench writes, exact percentiles over every event:
//!   the commit's timestamp (`track_commit_timestamp`) against the
//!   broker's append time (`LogAppendTime`, ms).
//! * `kill`: duplicates after one `kill -9` mid-backlog and a restart.

mod backlog;
mod curve;
mod kill;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::relay::{Kind, Relay, CONNECT_DEFAULT_FLUSH_MS, DEBEZIUM_FLUSH_MS};
use crate::world::World;

pub(crate) use backlog::backlog;
pub(crate) use curve::curve;
pub(crate) use kill::kill;

static WALBOX_ONLY: AtomicBool = AtomicBool::new(false);

/// Leaves Debezium out of every phase.
pub(crate) fn set_walbox_only() {
    WALBOX_ONLY.store(true, Ordering::Relaxed);
}

/// `kinds`, less Debezium when only walbox is measured.
pub(super) fn measured<const N: usize>(kinds: [Kind; N]) -> Vec<Kind> {
    let walbox_only = WALBOX_ONLY.load(Ordering::Relaxed);
    kinds
        .into_iter()
        .filter(|k| !walbox_only || *k == Kind::Walbox)
        .collect()
}

/// The relays of the throughput and latency phases.
pub(crate) const RELAYS: [Kind; 2] = [
    Kind::Walbox,
    Kind::Debezium {
        flush_ms: DEBEZIUM_FLUSH_MS,
    },
];

/// The relays of the kill phase: Debezium also as most deploy it.
pub(crate) const KILLED: [Kind; 3] = [
    Kind::Walbox,
    Kind::Debezium {
        flush_ms: DEBEZIUM_FLUSH_MS,
    },
    Kind::Debezium {
        flush_ms: CONNECT_DEFAULT_FLUSH_MS,
    },
];

/// The curve's points: events/s, `None` as fast as pgbench writes.
pub(crate) const RATES: [Option<u32>; 4] = [Some(1000), Some(5000), Some(20000), None];

/// How a curve point is named in the figures: its rate, or `max`.
pub(crate) fn point_name(rate: Option<u32>) -> String {
    rate.map_or("max".to_owned(), |r| r.to_string())
}

pub(super) const TIMEOUT: Duration = Duration::from_secs(20 * 60);

pub(super) const TICK: Duration = Duration::from_millis(20);

#[derive(Clone, Copy)]
pub(crate) struct Backlog {
    pub(crate) phase: &'static str,
    pub(crate) events: i64,
    pub(crate) large: bool,
}

/// Writes `events` outbox rows of aggregate type `order` over 1,000
/// aggregates in transactions of 100: ~200-byte rows, or ~2 KB ones (hex
/// text, which neither compresses nor moves out of line). Returns the WAL
/// position after the last commit.
pub(super) async fn preload(world: &World, events: i64, large: bool) -> String {
    let pad = if large {
        "(SELECT string_agg(md5(g::text || ':' || i), '') FROM generate_series(1, 55) i)"
    } else {
        "repeat('x', 60)"
    };
    // One statement: a DO block may COMMIT only outside a transaction block.
    world
        .execute(&format!(
            "DO $$
             BEGIN
               FOR t IN 0..({events} / 100 - 1) LOOP
                 INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                 SELECT 'order', 'order-' || (g % 1000), 'OrderCreated',
                        jsonb_build_object('order_id', 'order-' || (g % 1000), 'total', g, 'pad', {pad})
                   FROM generate_series(t * 100, t * 100 + 99) g;
                 COMMIT;
               END LOOP;
             END $$"
        ))
        .await;
    let end = world.wal_lsn().await;
    // Neither relay should meet autovacuum or a checkpoint of the preload.
    world.execute("VACUUM ANALYZE outbox_events").await;
    world.execute("CHECKPOINT").await;
    end
}

/// Fails the phase when the relay exited or took too long.
pub(super) fn watch(relay: &mut Relay, t0: Instant, label: &str) {
    if let Some(log) = relay.exited() {
        panic!("{label} exited:\n{log}");
    }
    assert!(
        t0.elapsed() < TIMEOUT,
        "{label}: not done within {TIMEOUT:?}"
    );
}

/// Waits until `topic` has `n` records past `from`.
pub(super) async fn wait_on_topic(
    world: &World,
    relay: &mut Relay,
    label: &str,
    topic: &str,
    from: &[i64],
    n: i64,
) {
    let t0 = Instant::now();
    while world.count_since(topic, from) < n {
        watch(relay, t0, label);
        tokio::time::sleep(TICK).await;
    }
}
