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
//! * `kill`: duplicates after `kill -9`s at random points of backlogs,
//!   each followed by a restart; and Debezium as most deploy it (offsets
//!   flushed every 60 s) killed after more than 60 s of a steady stream.
//!
//! The backlogs and the kills are drained by warm relays: each is
//! launched (its start-up timed on its own), warmed up, and stopped
//! (SIGSTOP) while the backlog is written; the clock starts at SIGCONT.

mod backlog;
mod curve;
mod kill;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::relay::{Dbz, Kind, Relay, CONNECT_DEFAULT_FLUSH_MS, DEBEZIUM};
use crate::world::World;

pub(crate) use backlog::{backlog, recvlogical};
pub(crate) use curve::{curve, latencies_since, pgbench, write};
pub(crate) use kill::kill;

static WALBOX_ONLY: AtomicBool = AtomicBool::new(false);
/// Whether this run puts the relays in reverse order.
static REVERSED: AtomicBool = AtomicBool::new(false);

/// Leaves Debezium out of every phase.
pub(crate) fn set_walbox_only() {
    WALBOX_ONLY.store(true, Ordering::Relaxed);
}

/// Run `run` (from 1) begins: the relays take turns in going first (the
/// first on a fresh broker pays its coordinators' loading, and the second
/// reads a table its predecessor's reads warmed): walbox first in odd
/// runs, last in even ones.
pub(crate) fn set_run(run: u32) {
    REVERSED.store(run % 2 == 0, Ordering::Relaxed);
}

/// `kinds`, less Debezium when only walbox is measured, in this run's
/// order ([`set_run`]).
pub(crate) fn measured(kinds: impl IntoIterator<Item = Kind>) -> Vec<Kind> {
    let walbox_only = WALBOX_ONLY.load(Ordering::Relaxed);
    let mut kinds: Vec<Kind> = kinds
        .into_iter()
        .filter(|k| !walbox_only || *k == Kind::Walbox)
        .collect();
    if REVERSED.load(Ordering::Relaxed) {
        kinds.reverse();
    }
    kinds
}

/// The relays of the throughput phases, and of the kills at random
/// points of a backlog.
pub(crate) const RELAYS: [Kind; 2] = [Kind::Walbox, Kind::Debezium(DEBEZIUM)];

/// Debezium with smaller heaps than `connect-standalone.sh` gives it, in
/// the small backlog: what its peak RSS is when the heap is sized to the
/// job, and what that costs its throughput.
pub(crate) const SMALL_HEAPS: [Kind; 2] = [
    Kind::Debezium(Dbz {
        heap_mib: 512,
        ..DEBEZIUM
    }),
    Kind::Debezium(Dbz {
        heap_mib: 256,
        ..DEBEZIUM
    }),
];

/// Every relay a backlog may be drained by: [`RELAYS`], then
/// [`SMALL_HEAPS`] (the small backlog's).
pub(crate) fn backlog_relays() -> impl Iterator<Item = Kind> {
    RELAYS.into_iter().chain(SMALL_HEAPS)
}

/// The relays of the latency curve: Debezium also polling its queue every
/// millisecond (records wait up to `poll.interval.ms` at these rates).
pub(crate) const CURVE_RELAYS: [Kind; 3] = [
    Kind::Walbox,
    Kind::Debezium(DEBEZIUM),
    Kind::Debezium(Dbz {
        poll_ms: 1,
        ..DEBEZIUM
    }),
];

/// Debezium as most deploy it (Connect's default offset flush interval),
/// killed once per run after more than that interval of streaming.
pub(crate) const KILLED_STREAMING: Kind = Kind::Debezium(Dbz {
    flush_ms: CONNECT_DEFAULT_FLUSH_MS,
    ..DEBEZIUM
});

/// `kill -9`s per relay over all the runs of the kill phase, at random
/// points.
pub(crate) const KILLS: u32 = 10;

/// The curve's points: events/s, `None` as fast as pgbench writes.
pub(crate) const RATES: [Option<u32>; 4] = [Some(1000), Some(5000), Some(20000), None];

/// How a curve point is named in the figures: its rate, or `max`.
pub(crate) fn point_name(rate: Option<u32>) -> String {
    rate.map_or("max".to_owned(), |r| r.to_string())
}

pub(crate) const TIMEOUT: Duration = Duration::from_secs(20 * 60);

pub(crate) const TICK: Duration = Duration::from_millis(20);

/// A backlog phase: what is written before the readers start, and who
/// reads it.
#[derive(Clone, Copy)]
pub(crate) struct Backlog {
    pub(crate) phase: &'static str,
    pub(crate) events: i64,
    /// Events per transaction.
    pub(crate) tx: i64,
    pub(crate) rows: Rows,
    /// Debezium reads it too (it reads no logical decoding messages).
    pub(crate) debezium: bool,
    /// The polling relay drains a copy of it.
    pub(crate) pollers: bool,
    /// Debezium also with smaller heaps ([`SMALL_HEAPS`]).
    pub(crate) heaps: bool,
}

/// What a backlog's events are.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rows {
    /// Outbox rows of ~200 bytes.
    Small,
    /// Outbox rows of ~2 KB: hex text, which neither compresses nor moves
    /// out of line.
    Large,
    /// The small rows' events through `walbox.emit()`: logical decoding
    /// messages, no table (walbox's `source = "messages"`).
    Messages,
}

impl Backlog {
    /// `events` rows of ~200 bytes in transactions of 100, read by walbox
    /// alone.
    pub(crate) fn small(phase: &'static str, events: i64) -> Backlog {
        Backlog {
            phase,
            events,
            tx: 100,
            rows: Rows::Small,
            debezium: false,
            pollers: false,
            heaps: false,
        }
    }

    /// The relays that read it, in this run's order.
    pub(crate) fn relays(self) -> Vec<Kind> {
        match (self.debezium, self.heaps) {
            (false, _) => vec![Kind::Walbox],
            (true, false) => measured(RELAYS),
            (true, true) => measured(backlog_relays()),
        }
    }

    /// walbox's `--source` for it.
    pub(crate) fn source(self) -> &'static str {
        if self.rows == Rows::Messages {
            "messages"
        } else {
            "table"
        }
    }
}

/// Writes `b.events` events of aggregate type `order` over 1,000
/// aggregates in transactions of `b.tx`. Returns the WAL position after
/// the last commit.
pub(crate) async fn preload(world: &World, b: Backlog) -> String {
    let (events, tx) = (b.events, b.tx);
    let pad = if b.rows == Rows::Large {
        "(SELECT string_agg(md5(g::text || ':' || i), '') FROM generate_series(1, 55) i)"
    } else {
        "repeat('x', 60)"
    };
    let payload =
        format!("jsonb_build_object('order_id', 'order-' || (g % 1000), 'total', g, 'pad', {pad})");
    let write = if b.rows == Rows::Messages {
        format!(
            "PERFORM walbox.emit('order', 'order-' || (g % 1000), 'OrderCreated', {payload})
               FROM generate_series(t * {tx}, t * {tx} + {tx} - 1) g;"
        )
    } else {
        format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'order-' || (g % 1000), 'OrderCreated', {payload}
               FROM generate_series(t * {tx}, t * {tx} + {tx} - 1) g;"
        )
    };
    // One statement: a DO block may COMMIT only outside a transaction block.
    world
        .execute(&format!(
            "DO $$
             BEGIN
               FOR t IN 0..({events} / {tx} - 1) LOOP
                 {write}
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

/// A relay launched (its start-up timed), warmed up and paused: see
/// [`launch_warm`].
pub(super) struct Warm {
    pub(super) kind: Kind,
    pub(super) relay: Relay,
    /// From its launch until the events waiting for it (one per relay
    /// launched so far) were on its topic.
    pub(super) startup_s: f64,
    /// Its CPU until then.
    pub(super) startup_cpu_s: f64,
    /// Its walsender, and that walsender's CPU when the relay was paused:
    /// what it decodes ahead while the relay is paused counts too.
    pub(super) walsender: Option<(u32, f64)>,
}

/// Events each relay reads before the clock starts: enough for a JVM's
/// JIT to compile the hot paths, and for every connection and buffer to
/// exist.
fn warm_events(b: Backlog) -> i64 {
    (b.events / 10).min(50_000)
}

/// Launches `kinds` one after another and pauses them, warm, before a
/// backlog is written. Before each launch one event of `b`'s kind is
/// written; the relay's start-up is the time from its launch until it has
/// put every event written so far on its topic. Then `warm_events(b)`
/// events, in transactions of 100, go through every relay, and each is
/// paused (SIGSTOP) with nothing left to read.
pub(super) async fn launch_warm(world: &World, kinds: &[Kind], b: Backlog) -> Vec<Warm> {
    let probe = Backlog {
        events: 1,
        tx: 1,
        ..b
    };
    let froms: Vec<Vec<i64>> = kinds.iter().map(|k| world.ends(&k.topic())).collect();
    let mut warm: Vec<Warm> = Vec::new();
    for (i, &kind) in kinds.iter().enumerate() {
        preload(world, probe).await;
        let t0 = Instant::now();
        let mut relay = Relay::start_with(kind, world, &["--source", b.source()]);
        let label = kind.label();
        wait_on_topic(
            world,
            &mut relay,
            &label,
            &kind.topic(),
            &froms[i],
            i as i64 + 1,
        )
        .await;
        let startup_s = t0.elapsed().as_secs_f64();
        let startup_cpu_s = crate::procstat::usage(relay.pid()).map_or(0.0, |u| u.cpu_s);
        eprintln!("bench: {}: {label} started in {startup_s:.2} s", b.phase);
        warm.push(Warm {
            kind,
            relay,
            startup_s,
            startup_cpu_s,
            walsender: None,
        });
    }
    let n = warm_events(b);
    eprintln!("bench: {}: warming the relays up with {n} events", b.phase);
    preload(
        world,
        Backlog {
            events: n,
            tx: 100,
            ..b
        },
    )
    .await;
    let all = kinds.len() as i64 + n;
    for (w, from) in warm.iter_mut().zip(&froms) {
        let label = w.kind.label();
        wait_on_topic(world, &mut w.relay, &label, &w.kind.topic(), from, all).await;
    }
    for w in &mut warm {
        w.relay.pause();
        w.walsender = world.walsender(&w.kind.slot()).await.map(|pid| {
            let cpu = crate::procstat::usage(pid).map_or(0.0, |u| u.cpu_s);
            (pid, cpu)
        });
    }
    warm
}

/// Fails the phase when the relay exited or took too long.
pub(crate) fn watch(relay: &mut Relay, t0: Instant, label: &str) {
    if let Some(log) = relay.exited() {
        panic!("{label} exited:\n{log}");
    }
    assert!(
        t0.elapsed() < TIMEOUT,
        "{label}: not done within {TIMEOUT:?}"
    );
}

/// Waits until `topic` has `n` records past `from`.
pub(crate) async fn wait_on_topic(
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
