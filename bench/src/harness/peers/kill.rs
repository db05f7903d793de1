//! Duplicates after `kill -9`: walbox and Debezium (offsets flushed every
//! second), warm, each killed at a random point of a backlog and
//! restarted, [`KILLS`] times over the runs; and Debezium as most deploy
//! it (Connect's 60 s offset flush) killed once per run, at a random time
//! more than 60 s into a steady stream.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::{
    curve, launch_warm, measured, preload, wait_on_topic, watch, Backlog, KILLED_STREAMING, KILLS,
    RELAYS,
};
use crate::relay::Relay;
use crate::results::Results;
use crate::world::World;

pub(crate) async fn kill(results: &mut Results, walbox: &str, events: i64, runs: u32) {
    let world = World::start(walbox).await;
    let kinds = measured(RELAYS);
    for &kind in &kinds {
        kind.init(&world).await;
        world.create_topic(&kind.topic()).await;
    }
    let b = Backlog::small("kill", events);
    let mut warm = launch_warm(&world, &kinds, b).await;
    results.record("kill", "events", events as f64);
    let mut random = Random::new();
    let trials = KILLS.div_ceil(runs);
    for trial in 1..=trials {
        eprintln!("bench: kill: trial {trial} of {trials}: writing {events} events");
        preload(&world, b).await;
        for w in &mut warm {
            let (label, topic) = (w.kind.label(), w.kind.topic());
            let from = world.ends(&topic);
            // Somewhere between a tenth and nine tenths of the backlog.
            let target = events / 10 + random.below(events * 8 / 10);
            w.relay.resume();
            wait_on_topic(&world, &mut w.relay, &label, &topic, &from, target).await;
            w.relay.kill9();
            // What was on its way to the broker lands, or never will.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let at = world.count_since(&topic, &from);
            eprintln!("bench: kill: {label} killed at {at} of {events} events; restarting");
            w.relay.restart();
            let (records, distinct) =
                every_event(&world, &mut w.relay, &label, &topic, &from, events).await;
            results.record("kill", &format!("{}_at", w.kind.slot()), at as f64);
            results.record(
                "kill",
                &format!("{}_duplicates", w.kind.slot()),
                (records - distinct) as f64,
            );
            w.relay.pause();
        }
    }
    for mut w in warm {
        w.relay.resume();
        w.relay.stop();
    }
    if measured([KILLED_STREAMING]).is_empty() {
        return;
    }
    streaming(results, &world, &mut random).await;
}

/// Debezium with Connect's default 60 s offset flush, killed 65–95 s into
/// a stream of 2,000 events/s, restarted, and the stream run 30 s more.
async fn streaming(results: &mut Results, world: &World, random: &mut Random) {
    const RATE: u32 = 2000;
    let kind = KILLED_STREAMING;
    let (label, topic) = (kind.label(), kind.topic());
    // Made now: it reads only what is written from here on.
    kind.init(world).await;
    world.create_topic(&topic).await;
    let from = world.ends(&topic);
    let mut relay = Relay::start(kind, world);
    curve::write(world, 1, "probe").await;
    wait_on_topic(world, &mut relay, &label, &topic, &from, 1).await;
    let kill_after = 65 + random.below(31) as u64;
    let seconds = kill_after as u32 + 30;
    eprintln!("bench: kill: {label} streams {RATE} events/s; killed after {kill_after} s");
    let (writer, dir) = (
        world.writer(),
        tempfile::tempdir().expect("a directory for pgbench's script"),
    );
    let path = dir.path().to_owned();
    let stream = tokio::task::spawn_blocking(move || {
        curve::pgbench(&writer, &path, "kill-stream", Some(RATE), seconds)
    });
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(kill_after) {
        watch(&mut relay, t0, &label);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    relay.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at = world.count_since(&topic, &from);
    relay.restart();
    let written = stream.await.expect("pgbench");
    let (records, distinct) =
        every_event(world, &mut relay, &label, &topic, &from, written + 1).await;
    relay.stop();
    results.record("kill", "streaming_kill_after_s", kill_after as f64);
    results.record("kill", &format!("{}_at", kind.slot()), at as f64);
    results.record(
        "kill",
        &format!("{}_duplicates", kind.slot()),
        (records - distinct) as f64,
    );
}

/// Waits until `events` distinct event ids are on `topic` past `from`:
/// the records read back, and the distinct ids.
async fn every_event(
    world: &World,
    relay: &mut Relay,
    label: &str,
    topic: &str,
    from: &[i64],
    events: i64,
) -> (usize, usize) {
    let t0 = Instant::now();
    loop {
        wait_on_topic(world, relay, label, topic, from, events).await;
        let read = world.tally(topic, from);
        if read.distinct as i64 == events {
            return (read.records, read.distinct);
        }
        watch(relay, t0, label);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Kill points: xorshift64*, seeded from the clock (each run kills
/// elsewhere; the points are recorded with the results).
struct Random(u64);

impl Random {
    fn new() -> Random {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0x9e37_79b9_7f4a_7c15, |d| d.as_nanos() as u64);
        Random(seed | 1)
    }

    /// Uniform enough in `0..n` (`n` > 0).
    fn below(&mut self, n: i64) -> i64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        (x % n.max(1) as u64) as i64
    }
}
