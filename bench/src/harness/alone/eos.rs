//! Exactly-once beside at-least-once, on Apache Kafka's transactions.

use std::collections::HashSet;
use std::time::Instant;

use walbox_test_harness::kafka::{consume_to_end, headers_of, TestKafka};

use super::wait_confirmed;
use crate::peers::{pgbench, preload, Backlog, TIMEOUT};
use crate::procstat;
use crate::relay::{Kind, Relay};
use crate::results::Results;
use crate::world::World;
use crate::Scale;

const MODES: [Kind; 2] = [Kind::Walbox, Kind::WalboxExactlyOnce];

pub(crate) async fn eos(results: &mut Results, walbox: &str, scale: Scale) {
    let events = scale.small_events();
    let world = World::start(walbox).await;
    for kind in MODES {
        kind.init(&world).await;
        world.create_topic(&kind.topic()).await;
    }
    eprintln!("bench: eos: writing {events} events");
    let end = preload(&world, Backlog::small("eos", events)).await;
    results.record("eos", "events", events as f64);
    for kind in MODES {
        eprintln!("bench: eos: {} drains them", kind.label());
        drain(results, &world, kind, events, &end, "").await;
    }
    let dir = tempfile::tempdir().expect("a directory for pgbench's scripts");
    for kind in MODES {
        latency(results, &world, dir.path(), kind, scale.curve_seconds()).await;
    }
    drop(world);

    // One transaction of a million rows, split across Kafka transactions.
    let events = 1_000_000 / scale.divisor;
    let world = World::start(walbox).await;
    let kind = Kind::WalboxExactlyOnce;
    kind.init(&world).await;
    world.create_topic(&kind.topic()).await;
    eprintln!("bench: eos: one transaction of {events} rows");
    let huge = Backlog {
        tx: events,
        ..Backlog::small("eos", events)
    };
    let end = preload(&world, huge).await;
    results.record("eos", "huge_events", events as f64);
    drain(results, &world, kind, events, &end, "huge_").await;
}

/// `kind` drains the backlog from its slot: until its slot confirmed
/// `end` (for exactly-once: every Kafka transaction committed), its CPU
/// and peak RSS; then every record is read back with `read_committed`.
async fn drain(
    results: &mut Results,
    world: &World,
    kind: Kind,
    events: i64,
    end: &str,
    prefix: &str,
) {
    let topic = kind.topic();
    let from = world.ends(&topic);
    let t0 = Instant::now();
    let mut relay = Relay::start(kind, world);
    let pid = relay.pid();
    let mut first = None;
    while !world.confirmed(&kind.slot(), end).await {
        if first.is_none() && world.count_since(&topic, &from) > 0 {
            first = Some(t0.elapsed().as_secs_f64());
        }
        crate::peers::watch(&mut relay, t0, &kind.label());
        tokio::time::sleep(crate::peers::TICK).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let usage = procstat::usage(pid).expect("walbox runs");
    relay.stop();
    let kafka = TestKafka::External {
        bootstrap: world.bootstrap(),
    };
    let records = consume_to_end(&kafka, &topic, TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("read {topic} back: {e}"));
    let ids: HashSet<String> = records
        .iter()
        .filter_map(|m| headers_of(m).remove("id"))
        .collect();
    assert_eq!(
        ids.len() as i64,
        events,
        "{}: distinct events read back from {topic}",
        kind.label()
    );
    let duplicates = records.len() - ids.len();
    assert!(
        kind != Kind::WalboxExactlyOnce || duplicates == 0,
        "exactly-once: {duplicates} duplicates read back from {topic} with read_committed"
    );
    let n = events as f64;
    let first = first.unwrap_or(secs);
    let m = |x: &str| format!("{prefix}{}_{x}", kind.slot());
    results.record("eos", &m("s"), secs);
    results.record("eos", &m("start_s"), first);
    results.record("eos", &m("stream_s"), secs - first);
    results.record("eos", &m("eps"), n / (secs - first));
    results.record("eos", &m("cpu_s"), usage.cpu_s);
    results.record("eos", &m("cpu_us"), usage.cpu_s / n * 1e6);
    results.record("eos", &m("rss_mib"), usage.peak_rss_mib);
    results.record("eos", &m("duplicates"), duplicates as f64);
}

/// The rates the latency is measured at, events/s (a Kafka transaction's
/// size, and how long it waits, follow from the rate).
const RATES: [u32; 3] = [100, 1_000, 5_000];

/// Commit → read and commit → ack at each of [`RATES`] (one event per
/// Postgres transaction) for `seconds`, exact over every event from
/// walbox's own histograms (for exactly-once, until the event's Kafka
/// transaction committed), with the Kafka transactions committed and the
/// broker's CPU. A walbox process per rate (its histograms count from its
/// start), ready once a probe event was confirmed (exactly-once: its Kafka
/// transaction committed, so the producer's start is not measured). A
/// first run of 5 s, not measured, warms the broker (its transaction
/// coordinator, the topic's leaders) up.
async fn latency(
    results: &mut Results,
    world: &World,
    dir: &std::path::Path,
    kind: Kind,
    seconds: u32,
) {
    let runs = std::iter::once((None, 5.min(seconds))).chain(RATES.map(|r| (Some(r), seconds)));
    for (rate, secs) in runs {
        let mut relay = Relay::start(kind, world);
        let t0 = Instant::now();
        while world.walsender(&kind.slot()).await.is_none() {
            crate::peers::watch(&mut relay, t0, &kind.label());
            tokio::time::sleep(crate::peers::TICK).await;
        }
        crate::peers::write(world, 1, "probe").await;
        let probe = world.wal_lsn().await;
        wait_confirmed(world, &mut [&mut relay], &kind.slot(), &probe).await;
        let point = rate.map_or("warm-up".to_owned(), |r| r.to_string());
        if rate.is_some() {
            eprintln!(
                "bench: eos: {} at {point} events/s for {secs} s",
                kind.label()
            );
        }
        let tag = format!("{}-{point}", kind.slot());
        let broker0 = world.broker_cpu();
        let written = pgbench(&world.writer(), dir, &tag, Some(rate.unwrap_or(5000)), secs);
        let end = world.wal_lsn().await;
        wait_confirmed(world, &mut [&mut relay], &kind.slot(), &end).await;
        let broker = world.broker_cpu() - broker0;
        let log = relay.stop_walbox_log().expect("walbox's log");
        let Some(rate) = rate else { continue };
        let crate::relay::Split { read, ack, .. } =
            crate::relay::split(&log).expect("walbox's exact latency lines");
        let m = |x: &str| format!("{}_{rate}_{x}", kind.slot());
        results.record("eos", &m("written"), written as f64);
        results.record("eos", &m("eps"), written as f64 / f64::from(secs));
        results.record("eos", &m("events"), ack.events);
        results.record("eos", &m("p50_ms"), ack.p50_ms);
        results.record("eos", &m("p99_ms"), ack.p99_ms);
        results.record("eos", &m("p999_ms"), ack.p999_ms);
        results.record("eos", &m("max_ms"), ack.max_ms);
        results.record("eos", &m("read_p50_ms"), read.p50_ms);
        results.record("eos", &m("read_p99_ms"), read.p99_ms);
        results.record("eos", &m("broker_cpu_s"), broker);
        if let Some(n) =
            crate::relay::log_field(&log, "Kafka transactions since start", "committed")
        {
            results.record("eos", &m("commits"), n);
        }
    }
}
