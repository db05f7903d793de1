//! Runs shaped like two published benchmarks of other Postgres → Kafka
//! relays, so their figures can be read beside walbox's
//! (docs/benchmarks.md, "Shaped like published benchmarks"). Only the
//! shape is theirs: the machine, the rows and the relay are this
//! harness's, and the report states the differences.
//!
//! * `conduit`: Conduit's Postgres → Kafka CDC run
//!   (ConduitIO/streaming-benchmarks, `benchmarks/postgres-kafka-cdc`):
//!   rows written in transactions of 200 while the relay is stopped, then
//!   the relay started, and its message rate, CPU % and memory taken over
//!   the drain, its start included. walbox and Debezium, each from its own
//!   slot; each one's RSS is sampled every half second, for the RSS over
//!   time figure.
//! * `sequin`: Sequin's sustained mixed workload
//!   (sequinstream/sequin-vs-debezium-benchmark, `workload_generator.py`):
//!   transactions of 100 INSERTs, 100 UPDATEs and 100 DELETEs on the one
//!   table, at the two rates Sequin published (Debezium's 6,000 and its own
//!   50,000 operations/s); latency from
//!   the row's timestamp (`now()` in its transaction) to the record's
//!   timestamp on Kafka. walbox publishes the INSERTs (an outbox relay's
//!   events); the walsender decodes and streams all three.

use std::time::{Duration, Instant};

use crate::peers::{measured, preload, watch, Backlog, Rows, RELAYS, TICK};
use crate::procstat;
use crate::relay::{Kind, Relay};
use crate::results::{quantile, Results};
use crate::world::World;

/// Rows per transaction in Conduit's run (`insert_test_employees.sh`, 200
/// per batch).
pub(crate) const CONDUIT_TX: i64 = 200;

/// How often the relays' memory is sampled in the `conduit` phase.
pub(crate) const SAMPLE: Duration = Duration::from_millis(500);

/// Rows of each kind in a transaction of Sequin's workload (its
/// generator's default batch size).
pub(crate) const SEQUIN_BATCH: i64 = 100;

/// Sequin-shaped points, transactions/s of 300 operations: 20 are 6,000
/// operations/s, the rate Sequin reports Debezium on MSK Connect
/// sustaining; 167 are 50,000, Sequin's own.
pub(crate) const SEQUIN_RATES: [u32; 2] = [20, 167];

/// Rows the UPDATEs of the `sequin` phase touch (100-row ranges drawn at
/// random, updated again and again).
const UPDATED: i64 = 200_000;

/// The metric of a relay's RSS sample `i` (taken `i * SAMPLE` after its
/// start).
pub(crate) fn rss_sample(slot: &str, i: usize) -> String {
    format!("{slot}_rss_mib_at_{i}")
}

pub(crate) async fn conduit(results: &mut Results, walbox: &str, events: i64) {
    let world = World::start(walbox).await;
    let kinds = measured(RELAYS);
    for &kind in &kinds {
        kind.init(&world).await;
        world.create_topic(&kind.topic()).await;
    }
    eprintln!("bench: conduit: writing {events} events in transactions of {CONDUIT_TX}");
    let b = Backlog {
        phase: "conduit",
        events,
        tx: CONDUIT_TX,
        rows: Rows::Small,
        debezium: true,
        pollers: false,
        heaps: false,
    };
    preload(&world, b).await;
    results.record("conduit", "events", events as f64);
    let row: i32 = world
        .one("SELECT avg(pg_column_size(t.*))::int FROM outbox_events t")
        .await;
    results.record("conduit", "row_bytes", f64::from(row));
    for kind in kinds {
        let label = kind.label();
        eprintln!("bench: conduit: {label} starts and drains them");
        let topic = kind.topic();
        let from = world.ends(&topic);
        let t0 = Instant::now();
        let mut relay = Relay::start(kind, &world);
        let pid = relay.pid();
        let mut rss = Vec::new();
        let mut next = t0;
        let mut cpu_s = 0.0;
        loop {
            let on = world.count_since(&topic, &from);
            if let Some(u) = procstat::usage(pid) {
                cpu_s = u.cpu_s;
            }
            if Instant::now() >= next {
                if let Some(mib) = procstat::rss_mib(pid) {
                    rss.push(mib);
                }
                next += SAMPLE;
            }
            if on >= events {
                break;
            }
            watch(&mut relay, t0, &label);
            tokio::time::sleep(TICK).await;
        }
        let secs = t0.elapsed().as_secs_f64();
        let peak = procstat::usage(pid).map_or(0.0, |u| u.peak_rss_mib);
        relay.stop();
        let read = world.tally(&topic, &from);
        assert_eq!(
            read.distinct as i64, events,
            "{label}: every event on the topic"
        );
        let p = |m: &str| format!("{}_{m}", kind.slot());
        let n = events as f64;
        results.record("conduit", &p("s"), secs);
        results.record("conduit", &p("eps"), n / secs);
        results.record("conduit", &p("cpu_pct"), cpu_s / secs * 100.0);
        results.record("conduit", &p("cpu_us"), cpu_s / n * 1e6);
        results.record(
            "conduit",
            &p("rss_mean_mib"),
            rss.iter().sum::<f64>() / rss.len().max(1) as f64,
        );
        results.record("conduit", &p("rss_mib"), peak);
        results.record("conduit", &p("duplicates"), read.duplicates() as f64);
        for (i, mib) in rss.iter().enumerate() {
            results.record("conduit", &rss_sample(&kind.slot(), i), *mib);
        }
    }
}

pub(crate) async fn sequin(results: &mut Results, walbox: &str, seconds: u32) {
    let world = World::start(walbox).await;
    // The rows the UPDATEs and DELETEs touch, written before walbox's slot
    // exists (they are no events of the run). Each DELETE takes the next
    // 100 of the older ones (a sequence hands out the blocks: every
    // DELETE removes 100 rows), each UPDATE a random 100 of the newest
    // `UPDATED`. A fifth more than the points' DELETEs need, for
    // pgbench catching up behind its schedule.
    let n = SEQUIN_BATCH;
    let deleted: i64 = SEQUIN_RATES
        .iter()
        .map(|r| i64::from(*r) * i64::from(seconds) * n * 6 / 5)
        .sum();
    let pool = deleted + UPDATED;
    eprintln!("bench: sequin: writing {pool} rows for the UPDATEs and DELETEs");
    preload(
        &world,
        Backlog {
            tx: 1_000,
            ..Backlog::small("sequin", pool)
        },
    )
    .await;
    world
        .execute(
            "CREATE INDEX outbox_events_seq ON outbox_events (seq);
             CREATE SEQUENCE sequin_deletes",
        )
        .await;
    let kind = Kind::Walbox;
    kind.init(&world).await;
    let topic = kind.topic();
    world.create_topic(&topic).await;
    let mut relay = Relay::start(kind, &world);
    let from = world.ends(&topic);
    crate::peers::write(&world, 1, "probe").await;
    crate::peers::wait_on_topic(&world, &mut relay, &kind.label(), &topic, &from, 1).await;
    let dir = tempfile::tempdir().expect("a directory for pgbench's scripts");
    results.record("sequin", "seconds", f64::from(seconds));
    let first: i64 = world.one("SELECT min(seq) FROM outbox_events").await;
    let (low, high) = (first + deleted, first + pool - n);
    for rate in SEQUIN_RATES {
        eprintln!("bench: sequin: walbox at {rate} transactions/s for {seconds} s");
        let tag = format!("sequin-{rate}");
        let script = dir.path().join(format!("{tag}.sql"));
        std::fs::write(
            &script,
            format!(
                "\\set u random({low}, {high})\n\
                 BEGIN;\n\
                 INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                 SELECT 'order', 'order-' || (g % 1000), '{tag}', \
                 jsonb_build_object('order_id', 'order-' || (g % 1000), 'total', g, 'pad', repeat('x', 60)) \
                 FROM generate_series(1, {n}) g;\n\
                 UPDATE outbox_events SET headers = jsonb_build_object('touched', :u) \
                 WHERE seq BETWEEN :u AND :u + {n} - 1;\n\
                 SELECT nextval('sequin_deletes') AS block \\gset\n\
                 DELETE FROM outbox_events WHERE seq BETWEEN {first} + (:block - 1) * {n} AND {first} + :block * {n} - 1;\n\
                 COMMIT;\n"
            ),
        )
        .expect("write pgbench's script");
        let from = world.ends(&topic);
        let ops0 = operations(&world).await;
        let cpu0 = procstat::usage(relay.pid()).map_or(0.0, |u| u.cpu_s);
        let rate_arg = rate.to_string();
        let run = world
            .writer()
            .run(&script, seconds, dir.path(), &["-R", &rate_arg]);
        let written = (run.transactions() as i64) * n;
        crate::peers::wait_on_topic(&world, &mut relay, "walbox", &topic, &from, written).await;
        let cpu = procstat::usage(relay.pid()).map_or(0.0, |u| u.cpu_s) - cpu0;
        let ops = operations(&world).await;
        // The row's timestamp (`now()` of its transaction) → the broker's
        // append time.
        let latencies =
            crate::peers::latencies_since(&world, "created_at", &topic, &from, &tag).await;
        let secs = f64::from(seconds);
        let k = |m: &str| format!("walbox_{rate}_{m}");
        results.record("sequin", &k("inserts_per_s"), (ops[0] - ops0[0]) / secs);
        results.record("sequin", &k("updates_per_s"), (ops[1] - ops0[1]) / secs);
        results.record("sequin", &k("deletes_per_s"), (ops[2] - ops0[2]) / secs);
        let all: f64 = (0..3).map(|i| ops[i] - ops0[i]).sum();
        results.record("sequin", &k("ops_per_s"), all / secs);
        results.record("sequin", &k("eps"), latencies.len() as f64 / secs);
        results.record("sequin", &k("cpu_pct"), cpu / secs * 100.0);
        let mean = latencies.iter().sum::<f64>() / latencies.len().max(1) as f64;
        results.record("sequin", &k("mean_ms"), mean);
        for (m, q) in [("p50_ms", 0.5), ("p99_ms", 0.99), ("max_ms", 1.0)] {
            results.record("sequin", &k(m), quantile(&latencies, q));
        }
    }
    let rss = procstat::usage(relay.pid()).map_or(0.0, |u| u.peak_rss_mib);
    results.record("sequin", "walbox_rss_mib", rss);
    relay.stop();
}

/// Rows inserted, updated and deleted in the outbox table so far.
async fn operations(world: &World) -> [f64; 3] {
    // Statistics reach the shared counters within a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let row = world
        .client
        .query_one(
            "SELECT n_tup_ins::float8, n_tup_upd::float8, n_tup_del::float8
               FROM pg_stat_user_tables WHERE relname = 'outbox_events'",
            &[],
        )
        .await
        .expect("the outbox table's statistics");
    [row.get(0), row.get(1), row.get(2)]
}
