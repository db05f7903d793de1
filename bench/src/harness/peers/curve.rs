//! The latency curve: commit → on the topic at steady rates, every event.

use std::collections::HashMap;

use super::{measured, point_name, wait_on_topic, CURVE_RELAYS, RATES};
use crate::procstat;
use crate::relay::{Kind, Relay};
use crate::results::{quantile, Results};
use crate::world::{World, Writer};

pub(crate) async fn curve(results: &mut Results, walbox: &str, seconds: u32) {
    let world = World::start(walbox).await;
    // walbox's init-slot makes the publication both read.
    Kind::Walbox.init(&world).await;
    let dir = tempfile::tempdir().expect("a directory for pgbench's scripts");
    for (i, kind) in measured(CURVE_RELAYS).into_iter().enumerate() {
        // Made now, its slot skips what the relays before it were given.
        // walbox's, made with the publication, is made again when walbox
        // is not the first (it would drain every event written for them
        // before its first point).
        if kind != Kind::Walbox {
            kind.init(&world).await;
        } else if i > 0 {
            world.drop_slot(&kind.slot()).await;
            kind.init(&world).await;
        }
        let topic = kind.topic();
        world.create_topic(&topic).await;
        let label = kind.label();
        let mut relay = Relay::start(kind, &world);
        // Ready when one event went through; then a warm-up (a JVM's JIT
        // too) at 5,000 events/s, not measured.
        let from = world.ends(&topic);
        write(&world, 1, "probe").await;
        wait_on_topic(&world, &mut relay, &label, &topic, &from, 1).await;
        let from = world.ends(&topic);
        let warm = pgbench(
            &world.writer(),
            dir.path(),
            &format!("{}-warm-up", kind.slot()),
            Some(5000),
            5.min(seconds),
        );
        wait_on_topic(&world, &mut relay, &label, &topic, &from, warm).await;
        // walbox's own split of the latency (commit → read from the slot,
        // commit → ack) comes from the exact histograms it logs as it
        // stops, since its start: a walbox process of its own per rate,
        // ready when a probe went through (one event among thousands).
        let split = kind == Kind::Walbox;
        let mut running = true;
        for rate in RATES {
            let point = point_name(rate);
            if split {
                if running {
                    relay.stop();
                }
                relay.restart();
                running = true;
                let from = world.ends(&topic);
                write(&world, 1, "probe").await;
                wait_on_topic(&world, &mut relay, &label, &topic, &from, 1).await;
            }
            eprintln!("bench: curve: {label} at {point} events/s for {seconds} s");
            let tag = format!("{}-{point}", kind.slot());
            let from = world.ends(&topic);
            let cpu0 = procstat::usage(relay.pid()).map_or(0.0, |u| u.cpu_s);
            let broker0 = world.broker_cpu();
            let written = pgbench(&world.writer(), dir.path(), &tag, rate, seconds);
            wait_on_topic(&world, &mut relay, &label, &topic, &from, written).await;
            let cpu1 = procstat::usage(relay.pid()).map_or(0.0, |u| u.cpu_s);
            let broker = world.broker_cpu() - broker0;
            let latencies = latencies(&world, &topic, &from, &tag).await;
            let n = latencies.len() as f64;
            let key = |m: &str| format!("{}_{point}_{m}", kind.slot());
            results.record("curve", &key("eps"), n / f64::from(seconds));
            results.record("curve", &key("events"), n);
            results.record("curve", &key("cpu_us"), (cpu1 - cpu0) / n * 1e6);
            results.record("curve", &key("broker_us"), broker / n * 1e6);
            for (m, q) in [
                ("p50_ms", 0.5),
                ("p99_ms", 0.99),
                ("p999_ms", 0.999),
                ("max_ms", 1.0),
            ] {
                results.record("curve", &key(m), quantile(&latencies, q));
            }
            if split {
                let split = relay
                    .stop_walbox_split()
                    .expect("walbox's exact latency lines");
                for (m, v) in [
                    ("read_p50_ms", split.read.p50_ms),
                    ("read_p99_ms", split.read.p99_ms),
                    ("ack_p50_ms", split.ack.p50_ms),
                    ("ack_p99_ms", split.ack.p99_ms),
                ] {
                    results.record("curve", &key(m), v);
                }
                for (m, l) in [("own", split.own), ("client", split.client)] {
                    if let Some(l) = l {
                        results.record("curve", &key(&format!("{m}_p50_ms")), l.p50_ms);
                        results.record("curve", &key(&format!("{m}_p99_ms")), l.p99_ms);
                    }
                }
                running = false;
            }
        }
        if running {
            relay.stop();
        }
        world.drop_slot(&kind.slot()).await;
    }
}

/// `n` events tagged `tag` (their event type), in one transaction of their own.
pub(crate) async fn write(world: &World, n: i64, tag: &str) {
    world
        .execute(&format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'order-' || g, '{tag}', jsonb_build_object('n', g) FROM generate_series(1, {n}) g"
        ))
        .await;
}

/// pgbench, 8 clients, one ~200-byte event per transaction tagged `tag`,
/// at `rate` events/s (`None`: as fast as it goes) for `seconds`; returns
/// how many events it committed.
pub(crate) fn pgbench(
    writer: &Writer,
    dir: &std::path::Path,
    tag: &str,
    rate: Option<u32>,
    seconds: u32,
) -> i64 {
    let script = dir.join(format!("{tag}.sql"));
    std::fs::write(
        &script,
        format!(
            "\\set n random(1, 1000)\n\
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
             VALUES ('order', 'order-' || :n, '{tag}', \
             jsonb_build_object('order_id', 'order-' || :n, 'total', :n, 'pad', repeat('x', 60)));\n"
        ),
    )
    .expect("write pgbench's script");
    let rate = rate.map(|r| r.to_string());
    let extra: Vec<&str> = rate.iter().flat_map(|r| ["-R", r.as_str()]).collect();
    writer.run(&script, seconds, dir, &extra).transactions() as i64
}

/// Commit → appended on `topic` of every event tagged `tag`, in ms, sorted.
async fn latencies(world: &World, topic: &str, from: &[i64], tag: &str) -> Vec<f64> {
    latencies_since(world, "pg_xact_commit_timestamp(xmin)", topic, from, tag).await
}

/// `since` (an SQL timestamp of the event's row: its commit's, or a
/// column) → appended on `topic`, of every event tagged `tag`, in ms,
/// sorted. Every one must have arrived.
pub(crate) async fn latencies_since(
    world: &World,
    since: &str,
    topic: &str,
    from: &[i64],
    tag: &str,
) -> Vec<f64> {
    let rows = world
        .client
        .query(
            &format!(
                "SELECT id::text, (extract(epoch FROM {since}) * 1000)::float8
                   FROM outbox_events WHERE event_type = $1"
            ),
            &[&tag],
        )
        .await
        .expect("the events' times");
    let mut at: HashMap<String, f64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut out = Vec::with_capacity(at.len());
    let n = at.len();
    for r in world.read_back(topic, from) {
        // The first copy of each event counts.
        if let Some(t) = at.remove(&r.id) {
            out.push(r.appended_ms as f64 - t);
        }
    }
    assert!(
        at.is_empty(),
        "{topic}: {} of {n} events tagged {tag} never arrived",
        at.len()
    );
    out.sort_by(f64::total_cmp);
    out
}
