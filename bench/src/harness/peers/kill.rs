//! Duplicates after one kill -9 mid-backlog and a restart.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::{measured, preload, wait_on_topic, watch, Backlog, KILLED};
use crate::relay::Relay;
use crate::results::Results;
use crate::world::World;

pub(crate) async fn kill(results: &mut Results, walbox: &str, events: i64) {
    let world = World::start(walbox).await;
    for kind in measured(KILLED) {
        kind.init(&world).await;
        world.create_topic(&kind.topic()).await;
    }
    eprintln!("bench: kill: writing {events} events");
    preload(&world, Backlog::small("kill", events)).await;
    results.record("kill", "events", events as f64);
    for kind in measured(KILLED) {
        let label = kind.label();
        let topic = kind.topic();
        let from = world.ends(&topic);
        let mut relay = Relay::start(kind, &world);
        wait_on_topic(&world, &mut relay, &label, &topic, &from, events / 2).await;
        let at = world.count_since(&topic, &from);
        relay.kill9();
        eprintln!("bench: kill: {label} killed at {at} of {events} events; restarting");
        relay.restart();
        let t0 = Instant::now();
        let (records, distinct) = loop {
            wait_on_topic(&world, &mut relay, &label, &topic, &from, events).await;
            let records = world.read_back(&topic, &from);
            let distinct = records
                .iter()
                .map(|r| r.id.as_str())
                .collect::<HashSet<_>>()
                .len();
            if distinct as i64 == events {
                break (records.len(), distinct);
            }
            watch(&mut relay, t0, &label);
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        relay.stop();
        results.record("kill", &format!("{}_at", kind.slot()), at as f64);
        results.record(
            "kill",
            &format!("{}_duplicates", kind.slot()),
            (records - distinct) as f64,
        );
    }
}
