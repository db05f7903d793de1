//! The small backlog drained by 1, 2 and 4 shards (`shards = N`, one
//! slot, walsender and walbox process each).

use std::time::Instant;

use crate::peers::{preload, watch, Backlog, TICK};
use crate::procstat;
use crate::relay::{Kind, Relay};
use crate::results::Results;
use crate::world::World;

pub(crate) const SHARDS: [u32; 3] = [1, 2, 4];

pub(crate) async fn shards(results: &mut Results, walbox: &str, events: i64) {
    for n in SHARDS {
        let world = World::start(walbox).await;
        world.walbox(&["init-slot", "--shards", &n.to_string()]);
        let topic = "walbox.order";
        world.create_topic(topic).await;
        eprintln!("bench: shards: {n} shard(s) drain {events} events");
        let end = preload(&world, Backlog::small("shards", events)).await;
        let from = world.ends(topic);
        let cpu0 = world.server_cpu().await;
        let t0 = Instant::now();
        let (total, shard_flags) = (n.to_string(), (0..n).map(|i| i.to_string()));
        let mut relays: Vec<Relay> = shard_flags
            .map(|i| {
                let flags: &[&str] = if n > 1 {
                    &["--shards", &total, "--shard", &i]
                } else {
                    &[]
                };
                Relay::start_with(Kind::Walbox, &world, flags)
            })
            .collect();
        let slots: Vec<String> = if n > 1 {
            (0..n).map(|i| format!("walbox_{i}")).collect()
        } else {
            vec!["walbox".into()]
        };
        // Each walsender's CPU, sampled as it goes (it ends with walbox).
        let mut walsender_cpu = vec![0.0; slots.len()];
        loop {
            let mut done = true;
            for (i, slot) in slots.iter().enumerate() {
                if let Some(u) = world.walsender(slot).await.and_then(procstat::usage) {
                    walsender_cpu[i] = u.cpu_s;
                }
                done &= world.confirmed(slot, &end).await;
            }
            if done {
                break;
            }
            for r in &mut relays {
                watch(r, t0, "a shard");
            }
            tokio::time::sleep(TICK).await;
        }
        let secs = t0.elapsed().as_secs_f64();
        let server = world.server_cpu().await - cpu0;
        let walbox_cpu: f64 = relays
            .iter()
            .filter_map(|r| procstat::usage(r.pid()))
            .map(|u| u.cpu_s)
            .sum();
        for r in &mut relays {
            r.stop();
        }
        assert_eq!(
            world.tally(topic, &from).distinct as i64,
            events,
            "shards: distinct events on {topic}"
        );
        let m = |x: &str| format!("n{n}_{x}");
        results.record("shards", "events", events as f64);
        results.record("shards", &m("s"), secs);
        results.record("shards", &m("eps"), events as f64 / secs);
        results.record("shards", &m("walsender_cpu_s"), walsender_cpu.iter().sum());
        results.record("shards", &m("pg_cpu_s"), server);
        results.record("shards", &m("walbox_cpu_s"), walbox_cpu);
    }
}
