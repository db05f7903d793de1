//! walbox's retention under a steady 5,000 events/s: none, `retention =
//! 1m` (its chunked DELETE), and `retention = 1m` on an outbox
//! partitioned by minute (it drops and creates partitions).

use std::time::{Duration, Instant};

use crate::peers::{pgbench, TICK};
use crate::relay::{Kind, Relay};
use crate::results::Results;
use crate::world::World;

/// The configurations, and how the report names them.
pub(crate) const WAYS: [(&str, &str); 3] = [
    ("none", "no retention"),
    ("delete", "retention = 1m (chunked DELETE)"),
    ("partitions", "retention = 1m, partitioned by minute"),
];

pub(crate) async fn retention(results: &mut Results, walbox: &str, seconds: u32) {
    let dir = tempfile::tempdir().expect("a directory for pgbench's scripts");
    for (way, _) in WAYS {
        let world = World::start(walbox).await;
        if way == "partitions" {
            // The first minutes made here, the rest by walbox's retention.
            world
                .execute(
                    "DROP TABLE outbox_events;
                     CREATE TABLE outbox_events (id uuid NOT NULL DEFAULT gen_random_uuid(), aggregate_type text NOT NULL,
                       aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL,
                       headers jsonb NOT NULL DEFAULT '{}', created_at timestamptz NOT NULL DEFAULT now(),
                       PRIMARY KEY (id, created_at)) PARTITION BY RANGE (created_at);
                     CREATE TABLE outbox_events_first PARTITION OF outbox_events FOR VALUES
                       FROM (date_trunc('minute', now()) - interval '1 minute') TO (date_trunc('minute', now()) + interval '3 minutes');
                     CREATE TABLE outbox_events_next PARTITION OF outbox_events FOR VALUES
                       FROM (date_trunc('minute', now()) + interval '3 minutes') TO (date_trunc('minute', now()) + interval '4 minutes')",
                )
                .await;
        }
        world.walbox(&["init-slot"]);
        world.create_topic("walbox.order").await;
        let metrics = format!("127.0.0.1:{}", walbox_test_harness::port::free_port());
        let mut flags = vec!["--metrics-addr", &metrics];
        if way != "none" {
            flags.extend(["--retention", "1m", "--slot-recreate-margin-secs", "0"]);
        }
        let mut relay = Relay::start_with(Kind::Walbox, &world, &flags);
        // Writes start once walbox streams.
        let t0 = Instant::now();
        while walbox_test_harness::http::get(&metrics, "/readyz").map(|r| r.0) != Some(200) {
            crate::peers::watch(&mut relay, t0, "walbox");
            tokio::time::sleep(TICK).await;
        }
        eprintln!("bench: retention: {way}, 5000 events/s for {seconds} s");
        let writing = {
            let (writer, dir) = (world.writer(), dir.path().to_owned());
            tokio::task::spawn_blocking(move || {
                pgbench(&writer, &dir, "retention", Some(5000), seconds)
            })
        };
        // The table's rows and bytes every 10 s while the writes run.
        let (mut max_rows, mut max_bytes, mut last_rows) = (0.0f64, 0.0f64, 0.0);
        while !writing.is_finished() {
            tokio::time::sleep(Duration::from_secs(10)).await;
            let row = world
                .client
                .query_one(
                    "SELECT (SELECT coalesce(sum(n_live_tup), 0) FROM pg_stat_user_tables WHERE relname LIKE 'outbox_events%')::float8,
                            (pg_total_relation_size('outbox_events') + coalesce((SELECT sum(pg_total_relation_size(inhrelid))
                               FROM pg_inherits WHERE inhparent = 'outbox_events'::regclass), 0))::float8",
                    &[],
                )
                .await
                .expect("the table's rows and size");
            last_rows = row.get(0);
            max_rows = max_rows.max(last_rows);
            max_bytes = max_bytes.max(row.get(1));
        }
        let written = writing.await.expect("pgbench");
        let end = world.wal_lsn().await;
        super::wait_confirmed(&world, &mut [&mut relay], "walbox", &end).await;
        let scraped = walbox_test_harness::http::get(&metrics, "/metrics")
            .map(|r| r.1)
            .unwrap_or_default();
        let counter = |name: &str| -> f64 {
            scraped
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().last()?.parse().ok())
                .unwrap_or(0.0)
        };
        let dead = world.dead_tuples_like("outbox_events%").await;
        let exact = relay.stop_walbox().expect("walbox's exact latency line");
        let phase = format!("retention_{way}");
        results.record(&phase, "written", written as f64);
        results.record(&phase, "acked", exact.events);
        results.record(&phase, "p50_ms", exact.p50_ms);
        results.record(&phase, "p99_ms", exact.p99_ms);
        results.record(&phase, "max_ms", exact.max_ms);
        results.record(&phase, "max_rows", max_rows);
        results.record(&phase, "last_rows", last_rows);
        results.record(&phase, "max_table_mib", max_bytes / 1_048_576.0);
        results.record(&phase, "dead_tuples", dead);
        results.record(
            &phase,
            "rows_deleted",
            counter("walbox_retention_rows_deleted_total"),
        );
        results.record(
            &phase,
            "partitions_dropped",
            counter("walbox_retention_partitions_dropped_total"),
        );
        results.record(
            &phase,
            "partitions_created",
            counter("walbox_retention_partitions_created_total"),
        );
    }
}
