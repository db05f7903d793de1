//! Several outbox tables on one slot: a schema per tenant
//! (`table = tenant_*.outbox_events`), on Apache Kafka (`WALBOX_KAFKA_LIBS`)
//! with a topic per tenant (`{schema}` in the template, topics created by
//! walbox). Three tenants written at once and a fourth created while
//! walbox runs: every event once, in order per aggregate and table. A new
//! tenant table that held a row before walbox could add it, a table
//! dropped from the publication, one added to it by hand while walbox was
//! stopped, and one renamed into the pattern and added while it runs:
//! walbox stops, the slot before anything those could hide, and the
//! documented fix brings every event.

use std::time::Duration;

use rdkafka::Message;
use tokio_postgres::Client;
use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;

use crate::support::*;

const TABLES: &str = "tenant_*.outbox_events";

async fn create_tenant(client: &Client, schema: &str) {
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.outbox_events (LIKE public.outbox_events INCLUDING ALL)"
        ))
        .await
        .unwrap();
}

/// Inserts `from..to` into `schema`'s outbox (payload `n` and the tenant,
/// key `agg-{n % 7}`), `per_tx` to a transaction.
async fn write(client: &Client, schema: &str, from: usize, to: usize, per_tx: usize) {
    let mut at = from;
    while at < to {
        let end = (at + per_tx).min(to);
        client
            .execute(
                &format!(
                    "INSERT INTO {schema}.outbox_events (aggregate_type, aggregate_id, event_type, payload)
                     SELECT 'order', 'agg-' || (n % 7), 'E' || n, jsonb_build_object('n', n, 'tenant', $3::text)
                       FROM generate_series($1::int8, $2::int8 - 1) n"
                ),
                &[&(at as i64), &(end as i64), &schema],
            )
            .await
            .unwrap();
        at = end;
    }
}

/// Waits for walbox to stop by itself (30 s at most; its log otherwise).
async fn stopped(relay: &mut Relay) -> (std::process::ExitStatus, String) {
    let status = exit_within(relay, Duration::from_secs(30)).await;
    (status, relay.log())
}

/// Waits for walbox to stop by itself, unsuccessfully, its last line
/// saying each of `says`; returns that line.
async fn stops_saying(relay: &mut Relay, says: &[&str]) -> String {
    let (status, log) = stopped(relay).await;
    let line = log.lines().last().unwrap_or_default().to_owned();
    assert!(
        !status.success() && says.iter().all(|s| line.contains(s)),
        "{says:?}\n{log}"
    );
    line
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_written_at_once_and_one_added_while_running_arrive_once_in_order() {
    let cluster = kafka_cluster(1);
    let kafka: TestKafka = cluster.kafka();
    wait_broker(&kafka).await;
    let db = fresh_db().await;
    let client = db.connect().await;
    walbox_test_harness::migrations::apply_migrations(&client).await;
    for t in ["tenant_a", "tenant_b", "tenant_c"] {
        create_tenant(&client, t).await;
    }
    // Not a tenant: its rows are not events.
    client
        .batch_execute(
            "CREATE SCHEMA billing;
             CREATE TABLE billing.outbox_events (LIKE public.outbox_events INCLUDING ALL)",
        )
        .await
        .unwrap();
    let out = walbox(&db, &["init-slot", "--table", TABLES])
        .output()
        .unwrap();
    assert_eq!(
        succeeded(&out),
        "publication \"walbox_outbox\": created\nslot \"walbox\": created\n"
    );
    let prefix = walbox_test_harness::unique_name("tenants").replace('_', "-");
    let template = format!("{prefix}.{{schema}}");
    let run_flags = [
        "--table",
        TABLES,
        "--mapping-topic-template",
        &template,
        "--topics-create",
        "true",
        "--topics-partitions",
        "3",
    ];
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    wait_log(&relay, "streaming from the slot").await;

    // Three tenants at once, each from its own connection; billing too.
    let mut writers = Vec::new();
    for (i, t) in ["tenant_a", "tenant_b", "tenant_c", "billing"]
        .into_iter()
        .enumerate()
    {
        let c = db.connect().await;
        writers.push(tokio::spawn(async move {
            for round in 0..6 {
                write(
                    &c,
                    t,
                    round * 100,
                    (round + 1) * 100,
                    1 + (i * 7 + round) % 20,
                )
                .await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }));
    }
    // A fourth tenant while they write: picked up before its first row.
    create_tenant(&client, "tenant_d").await;
    wait_log(&relay, "picked up a new outbox table").await;
    write(&client, "tenant_d", 0, 300, 10).await;
    // A fifth made by a migration that creates and publishes it in one
    // transaction: no row can precede its publication, and walbox takes it
    // as it finds it published.
    client
        .batch_execute(
            "BEGIN;
             CREATE SCHEMA tenant_f;
             CREATE TABLE tenant_f.outbox_events (LIKE public.outbox_events INCLUDING ALL);
             ALTER PUBLICATION walbox_outbox ADD TABLE tenant_f.outbox_events;
             COMMIT;",
        )
        .await
        .unwrap();
    write(&client, "tenant_f", 0, 50, 5).await;
    for w in writers {
        w.await.unwrap();
    }
    for (tenant, total) in [
        ("tenant_a", 600),
        ("tenant_b", 600),
        ("tenant_c", 600),
        ("tenant_d", 300),
        ("tenant_f", 50),
    ] {
        let topic = format!("{prefix}.{tenant}");
        let duplicates = expect_all(&kafka, &topic, total).await;
        assert_eq!(duplicates, 0, "{tenant}: a clean run sends nothing twice");
    }
    let billing = format!("{prefix}.billing");
    assert!(
        walbox_test_harness::kafka::consume_until_quiet(
            &kafka,
            &billing,
            Duration::from_secs(1),
            Duration::from_secs(5)
        )
        .await
        .map_or(true, |m| m.is_empty()),
        "billing.outbox_events is not an outbox"
    );
    let log = stop(&mut relay).await;
    assert!(
        log.contains("\"tenant_d\".\"outbox_events\""),
        "the pick-up names the table:\n{log}"
    );

    // A tenant table that holds a row before walbox can add it (created and
    // written in one transaction): the stream never carried that row, so
    // walbox stops and says how to publish it.
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    wait_log(&relay, "streaming from the slot").await;
    client
        .batch_execute(
            "BEGIN;
             CREATE SCHEMA tenant_e;
             CREATE TABLE tenant_e.outbox_events (LIKE public.outbox_events INCLUDING ALL);
             INSERT INTO tenant_e.outbox_events (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'agg-' || (n % 7), 'E' || n, jsonb_build_object('n', n)
               FROM generate_series(0, 4) n;
             COMMIT;",
        )
        .await
        .unwrap();
    stops_saying(
        &mut relay,
        &[
            "\"tenant_e\".\"outbox_events\"",
            "has held rows",
            "re-insert its rows",
        ],
    )
    .await;
    // Until it is fixed, each start stops the same way.
    let mut again = spawn_run(&db, &kafka, &run_flags);
    let (status, log) = stopped(&mut again).await;
    assert!(!status.success() && log.contains("has held rows"), "{log}");
    // The fix the line gives.
    client
        .batch_execute(
            "ALTER PUBLICATION walbox_outbox ADD TABLE tenant_e.outbox_events;
             WITH moved AS (DELETE FROM tenant_e.outbox_events RETURNING *)
             INSERT INTO tenant_e.outbox_events SELECT * FROM moved;",
        )
        .await
        .unwrap();
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    expect_all(&kafka, &format!("{prefix}.tenant_e"), 5).await;
    stop(&mut relay).await;

    // Drift on one table: tenant_b leaves the publication while walbox
    // runs. walbox stops, the slot before anything that could hide.
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    wait_log(&relay, "streaming from the slot").await;
    write(&client, "tenant_a", 600, 610, 10).await;
    expect_all(&kafka, &format!("{prefix}.tenant_a"), 610).await;
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox DROP TABLE tenant_b.outbox_events")
        .await
        .unwrap();
    let after_drop: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    write(&client, "tenant_b", 600, 620, 10).await;
    write(&client, "tenant_a", 610, 620, 10).await;
    stops_saying(
        &mut relay,
        &["\"tenant_b\".\"outbox_events\"", "left publication"],
    )
    .await;
    let held = confirmed(&client).await;
    assert!(
        lsn_le(&client, &held, &after_drop).await,
        "the slot ({held}) stays before the events after the drop ({after_drop})"
    );
    // Added back by hand without its rows re-inserted: the table holds rows
    // from before it joined again (walbox cannot tell those delivered
    // during its first membership from those written while it was out), so
    // the next start stops and names them.
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox ADD TABLE tenant_b.outbox_events")
        .await
        .unwrap();
    let mut again = spawn_run(&db, &kafka, &run_flags);
    stops_saying(
        &mut again,
        &[
            "\"tenant_b\".\"outbox_events\" joined publication",
            "re-insert them",
        ],
    )
    .await;
    // The fix the drift line gave: back and re-inserted in one transaction
    // (every row again: the ones delivered before arrive twice).
    client
        .batch_execute(
            "BEGIN;
             ALTER PUBLICATION walbox_outbox DROP TABLE tenant_b.outbox_events;
             ALTER PUBLICATION walbox_outbox ADD TABLE tenant_b.outbox_events;
             WITH moved AS (DELETE FROM tenant_b.outbox_events RETURNING *)
             INSERT INTO tenant_b.outbox_events SELECT * FROM moved;
             COMMIT;",
        )
        .await
        .unwrap();
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    expect_all(&kafka, &format!("{prefix}.tenant_b"), 620).await;
    expect_all(&kafka, &format!("{prefix}.tenant_a"), 620).await;
    stop(&mut relay).await;

    // A tenant table created, written and added to the publication by hand
    // while walbox is stopped: its rows never entered the stream, so the
    // start stops with the slot before anything, and names the fix.
    let held = confirmed(&client).await;
    create_tenant(&client, "tenant_g").await;
    write(&client, "tenant_g", 0, 50, 10).await;
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox ADD TABLE tenant_g.outbox_events")
        .await
        .unwrap();
    write(&client, "tenant_g", 50, 60, 10).await;
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    let line = stops_saying(
        &mut relay,
        &[
            "\"tenant_g\".\"outbox_events\" joined publication",
            "holds 50 rows inserted before it joined",
        ],
    )
    .await;
    let now = confirmed(&client).await;
    assert!(
        lsn_le(&client, &now, &held).await,
        "the slot ({now}) did not move past {held}"
    );
    let fix = line
        .split("re-insert them so that they stream (")
        .nth(1)
        .and_then(|rest| rest.split("); any of them").next())
        .unwrap_or_else(|| panic!("no fix in {line}"))
        .to_owned();
    client.batch_execute(&fix).await.unwrap();
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    // Every row arrives; rows 50-59 (written after it joined) may have been
    // sent before the stop and come again, and the re-inserted 0-49 come
    // after them (the order the fix committed them in).
    let got = wait_distinct(&kafka, &format!("{prefix}.tenant_g"), 60, n_of).await;
    let ns: std::collections::HashSet<i64> = got.iter().map(n_of).collect();
    assert!((0..60).all(|n| ns.contains(&n)), "{ns:?}");
    stop(&mut relay).await;

    // A table renamed into the pattern and added in one transaction while
    // walbox runs: the rows it held before never entered the stream.
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    wait_log(&relay, "streaming from the slot").await;
    client
        .batch_execute(
            "CREATE SCHEMA tenant_h;
             CREATE TABLE tenant_h.staging (LIKE public.outbox_events INCLUDING ALL);",
        )
        .await
        .unwrap();
    write(&client, "tenant_a", 620, 630, 10).await;
    expect_all(&kafka, &format!("{prefix}.tenant_a"), 630).await;
    client
        .batch_execute(
            "INSERT INTO tenant_h.staging (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'agg-' || (n % 7), 'E' || n, jsonb_build_object('n', n)
               FROM generate_series(0, 39) n;
             BEGIN;
             ALTER TABLE tenant_h.staging RENAME TO outbox_events;
             ALTER PUBLICATION walbox_outbox ADD TABLE tenant_h.outbox_events;
             COMMIT;",
        )
        .await
        .unwrap();
    stops_saying(
        &mut relay,
        &[
            "\"tenant_h\".\"outbox_events\" joined publication",
            "holds 40 rows inserted before it joined",
        ],
    )
    .await;
}

/// Inserts `from..to` into Debezium's EventRouter layout (`legacy.outbox`):
/// payload `n`, key `agg-{n % 7}`, type `E{n}`, `per_tx` to a transaction.
async fn write_legacy(client: &Client, from: usize, to: usize, per_tx: usize) {
    let mut at = from;
    while at < to {
        let end = (at + per_tx).min(to);
        client
            .execute(
                "INSERT INTO legacy.outbox (aggregatetype, aggregateid, type, payload)
                 SELECT 'order', 'agg-' || (n % 7), 'E' || n, jsonb_build_object('n', n)
                   FROM generate_series($1::int8, $2::int8 - 1) n",
                &[&(at as i64), &(end as i64)],
            )
            .await
            .unwrap();
        at = end;
    }
}

/// Tables laid out differently on one slot: the tenants' walbox layout and
/// a legacy Debezium EventRouter table, which maps by its own section
/// (`[mapping.tables."legacy.outbox"]`, file only). Without that section it
/// does not fit, and init-slot and run refuse it; with it, every event of
/// both arrives once, keyed and headed by its own table's columns. A
/// matching table walbox finds while running whose payload it cannot
/// publish stops it before that table joins the publication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_laid_out_differently_map_by_their_own_columns_and_a_table_that_does_not_fit_is_refused(
) {
    let cluster = kafka_cluster(1);
    let kafka: TestKafka = cluster.kafka();
    wait_broker(&kafka).await;
    let db = fresh_db().await;
    let client = db.connect().await;
    walbox_test_harness::migrations::apply_migrations(&client).await;
    create_tenant(&client, "tenant_a").await;
    client
        .batch_execute(
            "CREATE SCHEMA legacy;
             CREATE TABLE legacy.outbox (
                 id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL,
                 payload jsonb)",
        )
        .await
        .unwrap();
    let tables = "tenant_*.outbox_events, legacy.outbox";

    // One mapping for both: legacy.outbox does not fit, and nothing is made.
    let out = walbox(&db, &["init-slot", "--table", tables])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("table \"legacy\".\"outbox\" has no column aggregate_type, aggregate_id, event_type, headers, created_at"),
        "{err}"
    );
    let slots: i64 = client
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "a refused init-slot makes no slot");

    let prefix = walbox_test_harness::unique_name("layouts").replace('_', "-");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("walbox.toml");
    std::fs::write(
        &file,
        format!(
            "table = [\"tenant_*.outbox_events\", \"legacy.outbox\"]\n\
             [mapping]\ntopic_template = \"{prefix}.{{schema}}\"\n\
             [mapping.tables.\"legacy.outbox\"]\npreset = \"debezium\"\n\
             topic_template = \"{prefix}.legacy.{{aggregate_type}}\"\n"
        ),
    )
    .unwrap();
    let config = ["--config", file.to_str().unwrap()];
    let out = walbox(&db, &["init-slot"]).args(config).output().unwrap();
    succeeded(&out);
    let run_flags = [
        config[0],
        config[1],
        "--topics-create",
        "true",
        "--topics-partitions",
        "3",
    ];
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    wait_log(&relay, "streaming from the slot").await;
    let c = db.connect().await;
    let tenant = tokio::spawn(async move {
        for round in 0..4 {
            write(
                &c,
                "tenant_a",
                round * 100,
                (round + 1) * 100,
                1 + round * 6,
            )
            .await;
        }
    });
    for round in 0..4 {
        write_legacy(&client, round * 100, (round + 1) * 100, 1 + round * 4).await;
    }
    tenant.await.unwrap();
    let a = expect_all(&kafka, &format!("{prefix}.tenant_a"), 400).await;
    let legacy_topic = format!("{prefix}.legacy.order");
    let legacy = expect_all(&kafka, &legacy_topic, 400).await;
    assert_eq!((a, legacy), (0, 0), "a clean run sends nothing twice");
    // Each legacy record is keyed and headed by Debezium's columns.
    let records = wait_distinct(&kafka, &legacy_topic, 400, n_of).await;
    let ids: Vec<String> = client
        .query("SELECT id::text FROM legacy.outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    for r in &records {
        let n = n_of(r);
        let headers = walbox_test_harness::kafka::headers_of(r);
        assert_eq!(r.key(), Some(format!("agg-{}", n % 7).as_bytes()));
        assert_eq!(headers["event_type"], format!("E{n}"), "the type column");
        assert!(ids.contains(&headers["id"]), "the row's id: {headers:?}");
    }
    // A tenant whose payload column is a domain made after walbox started,
    // picked up while it runs: its rows arrive (a new session resolves the
    // domain).
    client
        .batch_execute(
            "CREATE DOMAIN event_body AS jsonb CHECK (VALUE IS NULL OR jsonb_typeof(VALUE) = 'object');
             CREATE SCHEMA tenant_g;
             CREATE TABLE tenant_g.outbox_events (LIKE public.outbox_events INCLUDING ALL);
             ALTER TABLE tenant_g.outbox_events ALTER COLUMN payload TYPE event_body",
        )
        .await
        .unwrap();
    wait_log(&relay, "\"tenant_g\".\"outbox_events\"").await;
    write(&client, "tenant_g", 0, 50, 10).await;
    assert_eq!(
        expect_all(&kafka, &format!("{prefix}.tenant_g"), 50).await,
        0
    );
    stop(&mut relay).await;

    // A new tenant table whose payload column walbox cannot publish: it
    // stops, the table left out of the publication, and stops again at each
    // start until the table is fixed.
    let mut relay = spawn_run(&db, &kafka, &run_flags);
    wait_log(&relay, "streaming from the slot").await;
    // Made unfit in the transaction that creates it (one query message is
    // one transaction): walbox may look for new tables at any moment, and
    // one found before the change would rightly be published.
    client
        .batch_execute(
            "CREATE SCHEMA tenant_z;
             CREATE TABLE tenant_z.outbox_events (LIKE public.outbox_events INCLUDING ALL);
             ALTER TABLE tenant_z.outbox_events ALTER COLUMN payload TYPE integer USING NULL",
        )
        .await
        .unwrap();
    let (status, log) = stopped(&mut relay).await;
    assert!(!status.success(), "{log}");
    let line = log.lines().last().unwrap_or_default();
    assert!(
        line.contains("table \"tenant_z\".\"outbox_events\" matches the outbox tables, and cannot be streamed")
            && line.contains("has type OID 23; use json, jsonb, text, varchar or bytea"),
        "{log}"
    );
    let published: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE schemaname = 'tenant_z'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, 0, "a table that does not fit is not added");
    let mut again = spawn_run(&db, &kafka, &run_flags);
    let (status, log) = stopped(&mut again).await;
    assert!(
        !status.success() && log.contains("of tenant_z.outbox_events has type OID 23"),
        "{log}"
    );
}
