//! What the outbox costs the primary with no relay running: keeping the
//! table small (`cleanup`), and writing an event (`writecost`).

use crate::results::{quantile, Results};
use crate::world::World;

/// The ways of keeping the outbox small, each on a fresh table: how the
/// report names them.
pub(crate) const CLEANUP_WAYS: [(&str, &str); 5] = [
    ("keep", "keep every row"),
    ("same_tx", "DELETE in the inserting transaction"),
    (
        "retention",
        "walbox retention (its chunked DELETE, afterwards)",
    ),
    (
        "partitions",
        "walbox retention on a partitioned outbox (DROP the partition)",
    ),
    ("messages", "no table (pg_logical_emit_message)"),
];

/// For `events` events of ~200 bytes in transactions of 100, per way:
/// the WAL written per event, the dead tuples and the table's bytes left.
pub(crate) async fn cleanup(results: &mut Results, walbox: &str, events: i64) {
    let world = World::start(walbox).await;
    let tx = 100;
    let row = "'order', 'order-' || (g % 1000), 'OrderCreated', \
               jsonb_build_object('order_id', 'order-' || (g % 1000), 'total', g, 'pad', repeat('x', 60))";
    let rows = format!("FROM generate_series(t * {tx}, t * {tx} + {tx} - 1) g");
    eprintln!("bench: cleanup: {events} events each way");
    for (way, _) in CLEANUP_WAYS {
        world
            .execute("DROP TABLE IF EXISTS outbox_events, outbox_parted CASCADE; DELETE FROM walbox_migrations")
            .await;
        world.walbox(&["migrate"]);
        let mut table = "outbox_events";
        if way == "partitions" {
            table = "outbox_parted";
            world
                .execute(
                    "CREATE TABLE outbox_parted (LIKE outbox_events INCLUDING DEFAULTS, PRIMARY KEY (id, created_at))
                       PARTITION BY RANGE (created_at);
                     CREATE INDEX ON outbox_parted (created_at);
                     CREATE TABLE outbox_parted_now PARTITION OF outbox_parted
                       FOR VALUES FROM (now() - interval '1 day') TO (now() + interval '1 day')",
                )
                .await;
        }
        world.execute("CHECKPOINT").await;
        let wal0 = world.wal_lsn().await;
        let body = match way {
            // The table holds only this transaction's rows: it deletes them.
            "same_tx" => format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) SELECT {row} {rows};
                 DELETE FROM outbox_events;"
            ),
            "messages" => format!(
                "PERFORM pg_logical_emit_message(true, 'walbox', jsonb_build_object(
                   'aggregate_type', 'order', 'aggregate_id', 'order-' || (g % 1000), 'event_type', 'OrderCreated',
                   'payload', jsonb_build_object('order_id', 'order-' || (g % 1000), 'total', g, 'pad', repeat('x', 60)))::text) {rows};"
            ),
            _ => format!(
                "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload) SELECT {row} {rows};"
            ),
        };
        world
            .execute(&format!(
                "DO $$ BEGIN FOR t IN 0..({events} / {tx} - 1) LOOP {body} COMMIT; END LOOP; END $$"
            ))
            .await;
        match way {
            // walbox's statement (crates/walbox/src/retention.rs), until
            // none is left.
            "retention" => loop {
                let deleted = world
                    .client
                    .execute(
                        "DELETE FROM outbox_events WHERE ctid = ANY(ARRAY(
                           SELECT ctid FROM outbox_events WHERE created_at < now() + interval '1 hour' LIMIT 5000))",
                        &[],
                    )
                    .await
                    .expect("retention's DELETE");
                if deleted == 0 {
                    break;
                }
            },
            "partitions" => world.execute("DROP TABLE outbox_parted_now").await,
            _ => {}
        }
        let wal1 = world.wal_lsn().await;
        // Statistics reach the shared counters within a second.
        let _ = world
            .client
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let pattern = format!("{table}%");
        let dead = world.dead_tuples_like(&pattern).await;
        let bytes: f64 = world
            .client
            .query_one(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::float8 FROM pg_class c
                  WHERE c.relname LIKE $1 AND c.relkind IN ('r', 'p')",
                &[&pattern],
            )
            .await
            .expect("the table's size")
            .get(0);
        let m = |x: &str| format!("{way}_{x}");
        results.record("cleanup", "events", events as f64);
        results.record(
            "cleanup",
            &m("wal_per_event"),
            world.wal_between(&wal0, &wal1).await / events as f64,
        );
        results.record("cleanup", &m("dead_tuples"), dead);
        results.record("cleanup", &m("table_bytes"), bytes);
    }
}

/// The application's transactions, for `writecost`: how the report names
/// them.
pub(crate) const WRITE_WAYS: [(&str, &str); 3] = [
    ("business", "a business INSERT alone"),
    ("outbox", "with an outbox-table INSERT"),
    ("emit", "with walbox.emit() (no table)"),
];

/// pgbench, 8 clients as fast as they go for `seconds` per way: tps, the
/// mean and exact p99 latency (every transaction, from pgbench's log), WAL
/// per transaction.
pub(crate) async fn write_cost(results: &mut Results, walbox: &str, seconds: u32) {
    let world = World::start(walbox).await;
    world
        .execute(
            "CREATE TABLE orders (id bigserial PRIMARY KEY, customer int NOT NULL,
               total numeric NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await;
    let dir = tempfile::tempdir().expect("a directory for pgbench");
    let payload = "jsonb_build_object('order_id', :c, 'total', :c * 1.5, 'pad', repeat('x', 60))";
    for (way, _) in WRITE_WAYS {
        eprintln!("bench: writecost: {way} for {seconds} s");
        let event = match way {
            "outbox" => format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ('order', 'order-' || :c, 'OrderCreated', {payload});\n"
            ),
            "emit" => {
                format!("SELECT walbox.emit('order', 'order-' || :c, 'OrderCreated', {payload});\n")
            }
            _ => String::new(),
        };
        let script = dir.path().join(format!("{way}.sql"));
        std::fs::write(
            &script,
            format!(
                "\\set c random(1, 100000)\nBEGIN;\nINSERT INTO orders (customer, total) VALUES (:c, :c * 1.5);\n{event}END;\n"
            ),
        )
        .expect("write pgbench's script");
        let logs = dir.path().join(way);
        std::fs::create_dir_all(&logs).expect("a directory for pgbench's log");
        world.execute("CHECKPOINT").await;
        let wal0 = world.wal_lsn().await;
        let run = world.writer().run(&script, seconds, &logs, &["-l"]);
        let wal1 = world.wal_lsn().await;
        // Per-transaction latencies, µs: the third column of pgbench's log.
        let mut latencies: Vec<f64> = std::fs::read_dir(&logs)
            .expect("pgbench's logs")
            .flatten()
            .flat_map(|e| {
                std::fs::read_to_string(e.path())
                    .unwrap_or_default()
                    .lines()
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .filter_map(|l| l.split_whitespace().nth(2)?.parse::<f64>().ok())
            .map(|us| us / 1000.0)
            .collect();
        latencies.sort_by(f64::total_cmp);
        let m = |x: &str| format!("{way}_{x}");
        results.record("writecost", &m("tps"), run.figure("tps = "));
        results.record(
            "writecost",
            &m("mean_ms"),
            latencies.iter().sum::<f64>() / latencies.len().max(1) as f64,
        );
        results.record("writecost", &m("p99_ms"), quantile(&latencies, 0.99));
        results.record(
            "writecost",
            &m("wal_per_tx"),
            world.wal_between(&wal0, &wal1).await / run.transactions(),
        );
    }
}
