//! A slot invalidated for real (`max_slot_wal_keep_size` exceeded while
//! walbox was stopped): with the default policy walbox stops with a clear
//! line; with `on_slot_invalidated = "recreate"` it recreates the slot and
//! republishes from the outbox table what the lost WAL held.

use std::process::Command;
use std::time::Duration;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg;
use walbox_test_harness::slot::{
    current_wal_lsn, server_that_loses_slots, wait_confirmed_at_least, write_wal_past_the_slot,
};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_stops_walbox_or_is_recreated_with_the_missed_events() {
    let server = server_that_loses_slots();
    let admin = server.config("postgres");
    let url = format!("{} sslmode=disable", pg::conninfo(&admin));
    let client = pg::connect(&admin).await.unwrap();
    apply_migrations(&client).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let walbox = |args: &[&str]| {
        let mut c = Command::new(walbox_e2e::walbox_bin());
        c.env("WALBOX_PG_URL", &url)
            .env("WALBOX_LOG", "info")
            .args(args);
        c
    };
    assert!(walbox(&["init-slot"]).status().unwrap().success());
    let recreate = [
        "--mapping-topic-template",
        topic.as_str(),
        "--on-slot-invalidated",
        "recreate",
        "--slot-recreate-margin-secs",
        "2",
    ];

    // Streaming, walbox saves its delivered position.
    let mut relay = spawn_run_with(walbox(&[]), &kafka, &recreate);
    insert_events(&client, 0, 200, |k| 1 + k % 5, 7).await;
    // Older than the margin before the last delivered commit: never
    // republished.
    tokio::time::sleep(Duration::from_secs(3)).await;
    insert_events(&client, 200, 260, |k| 1 + k % 5, 7).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    wait_for(
        "the delivered position saved",
        Duration::from_secs(30),
        || {
            let client = &client;
            async move {
                let row = client
                    .query_opt(
                        "SELECT delivered_lsn::text FROM walbox.positions WHERE slot = 'walbox'",
                        &[],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                match row.map(|r| r.get::<_, String>(0).parse::<pgoutput_decoder::Lsn>()) {
                    Some(Ok(saved)) if saved >= head => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;
    let shown = walbox(&["status"]).output().unwrap();
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(shown.contains("saved position:"), "{shown}");
    stop(&mut relay).await;

    // Stopped: 500 events are written, then the WAL holding them is gone.
    insert_events(&client, 260, 760, |k| 1 + k % 5, 7).await;
    assert_eq!(
        write_wal_past_the_slot(&client, "walbox").await.as_deref(),
        Some("lost")
    );
    // `status` says so; Postgres 17+ also says why.
    let shown = walbox(&["status", "--json"]).output().unwrap();
    let shown: serde_json::Value = serde_json::from_str(&succeeded(&shown)).unwrap();
    assert_eq!(shown["wal_status"], "lost", "{shown}");
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    if version >= 170_000 {
        assert_eq!(shown["invalidation_reason"], "wal_removed", "{shown}");
    } else {
        assert!(shown["invalidation_reason"].is_null(), "{shown}");
    }

    // The default policy: one clear line, exit 1.
    let out = walbox(&[
        "run",
        "--kafka-brokers",
        &kafka.bootstrap(),
        "--mapping-topic-template",
        &topic,
    ])
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.contains("is invalidated") && last.contains("on_slot_invalidated"),
        "{stderr}"
    );

    // Recreate: the missed events are republished, then streaming goes on.
    let mut relay = spawn_run_with(walbox(&[]), &kafka, &recreate);
    wait_log(&relay, "backfill published").await;
    insert_events(&client, 760, 860, |k| 1 + k % 5, 7).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(60)).await;
    let duplicates = expect_all(&kafka, &topic, 860).await;
    eprintln!("after the slot was recreated: {duplicates} duplicates");
    // Republished from the saved commit time less 2 s: the last 60
    // delivered events at most, not the 200 written 3 s before them.
    assert!(
        duplicates <= 60,
        "only events within the margin before the saved position repeat ({duplicates})"
    );
    let log = stop(&mut relay).await;
    assert!(log.contains("the slot is invalidated"), "{log}");
}

/// A test database with the outbox and walbox's slot, a topic, and the time
/// an hour ago: what the `walbox resync` tests start from.
struct Resync {
    db: walbox_test_harness::pg::TestDb,
    client: tokio_postgres::Client,
    kafka: TestKafka,
    topic: String,
    since: String,
}

impl Resync {
    async fn new() -> Resync {
        let db = walbox_test_harness::pg::fresh_db().await;
        let client = init(&db).await;
        let kafka = TestKafka::from_env();
        let topic = kafka.create_topic(2).await;
        let since: String = client
            .query_one("SELECT (now() - interval '1 hour')::text", &[])
            .await
            .unwrap()
            .get(0);
        Resync {
            db,
            client,
            kafka,
            topic,
            since,
        }
    }

    /// The topic flags every command here takes.
    fn flags(&self) -> [&str; 2] {
        ["--mapping-topic-template", self.topic.as_str()]
    }

    /// `walbox SUBCOMMAND` with the Kafka settings (and `--since` for
    /// `resync`).
    fn command(&self, subcommand: &str) -> Command {
        let mut c = walbox(
            &self.db,
            &[subcommand, "--kafka-brokers", &self.kafka.bootstrap()],
        );
        c.args(self.flags());
        if subcommand == "resync" {
            c.args(["--since", &self.since]);
        }
        c
    }

    /// `walbox run`, started.
    fn run(&self) -> Relay {
        spawn_run(&self.db, &self.kafka, &self.flags())
    }

    /// `walbox SUBCOMMAND` started, held at the test point `point`.
    fn paused_at(&self, subcommand: &str, point: &str) -> Relay {
        let mut c = self.command(subcommand);
        c.env("WALBOX_TEST_PAUSE_AT", point);
        spawn_logged(c)
    }
}

/// `walbox resync --since`: refused while walbox streams from the slot;
/// once stopped, it recreates the slot and republishes from that time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_republishes_from_a_time_and_refuses_a_slot_in_use() {
    let r = Resync::new().await;
    insert_events(&r.client, 0, 50, |_| 5, 7).await;
    let mut relay = r.run();
    let head = current_wal_lsn(&r.client).await;
    wait_confirmed_at_least(&r.client, "walbox", head, Duration::from_secs(30)).await;
    let refused = r.command("resync").output().unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is in use by process"), "{stderr}");
    stop(&mut relay).await;

    let out = r.command("resync").output().unwrap();
    let stdout = succeeded(&out);
    assert!(
        stdout.contains("recreated; republished 50 events"),
        "{stdout}"
    );
    let mut relay = r.run();
    insert_events(&r.client, 50, 60, |_| 5, 7).await;
    // The 50 events twice (streamed, then republished), the next 10 once.
    assert_eq!(expect_all(&r.kafka, &r.topic, 60).await, 50);
    stop(&mut relay).await;
}

/// A heal (here `walbox resync`, the path `on_slot_invalidated = "recreate"`
/// takes too) killed with -9 at each of its steps: every next `walbox run`
/// resumes it from the record it wrote before dropping anything, and a
/// second instance started while one heals waits instead of exiting or
/// streaming, then takes the heal over when that one dies. Every event
/// arrives, in per-key order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_killed_at_any_step_is_resumed_and_loses_nothing() {
    let r = Resync::new().await;
    insert_events(&r.client, 0, 50, |_| 5, 7).await;
    let mut relay = r.run();
    let head = current_wal_lsn(&r.client).await;
    wait_confirmed_at_least(&r.client, "walbox", head, Duration::from_secs(30)).await;
    stop(&mut relay).await;

    let kill_9 = |mut relay: Relay| {
        signal(&relay, "-KILL");
        relay.wait();
    };
    // The heal begins, and dies once it recorded itself; each next start
    // of `walbox run` resumes it and dies one step further.
    let mut written = 50;
    let mut heal = r.paused_at("resync", "heal.recorded");
    for next in [
        "backfill.slot_dropped",
        "backfill.slot_created",
        "backfill.copied",
    ] {
        wait_log(&heal, "paused at test point").await;
        kill_9(heal);
        insert_events(&r.client, written, written + 10, |_| 3, 7).await;
        written += 10;
        heal = r.paused_at("run", next);
    }
    wait_log(&heal, "paused at test point backfill.copied").await;
    // Paused with the heal's lock held: a second instance waits for it,
    // neither exiting nor streaming.
    let mut standby = r.run();
    wait_log(&standby, "waiting for it to finish").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(standby.running(), "{}", standby.log());
    assert!(
        !standby.log().contains("streaming from the slot"),
        "{}",
        standby.log()
    );
    // The healing one dies: the waiting one takes the heal over, then streams.
    kill_9(heal);
    wait_log(&standby, "streaming from the slot").await;
    insert_events(&r.client, written, written + 10, |_| 3, 7).await;
    written += 10;
    let duplicates = expect_all(&r.kafka, &r.topic, written).await;
    eprintln!("{written} events through a heal killed at 4 steps: {duplicates} duplicates");
    let log = stop(&mut standby).await;
    assert!(
        log.contains("finishing the interrupted backfill or heal"),
        "{log}"
    );
}

/// The race a standby can lose: it checks that the slot has no unfinished
/// heal, another instance then begins one (recording it, remaking the
/// slot, copying the rows), and the standby starts streaming from the new
/// slot. It must check again once it holds the slot, and wait: else the
/// events committed after the new slot's creation overtake, per key, the
/// older ones the heal has yet to publish. (The test holds the standby
/// between its check and START_REPLICATION with a test point.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_that_raced_a_heal_waits_for_it_before_streaming() {
    let r = Resync::new().await;
    // Never streamed: only the heal will publish these.
    insert_events(&r.client, 0, 50, |_| 5, 7).await;
    let mut standby = r.paused_at("run", "stream.checked:8");
    wait_log(&standby, "paused at test point stream.checked").await;
    let heal = r.paused_at("resync", "backfill.copied");
    wait_log(&heal, "paused at test point backfill.copied").await;
    // Committed after the new slot: the stream's, after the heal's rows.
    insert_events(&r.client, 50, 60, |_| 5, 7).await;
    wait_log(&standby, "going on from test point stream.checked").await;
    wait_log(&standby, "waiting for it to finish").await;
    assert!(
        !standby.log().contains("streaming from the slot"),
        "{}",
        standby.log()
    );
    signal(&heal, "-KILL");
    let duplicates = expect_all(&r.kafka, &r.topic, 60).await;
    eprintln!("60 events, the standby raced the heal: {duplicates} duplicates");
    stop(&mut standby).await;
}

/// Events published from the table keep the order the stream would have
/// given them: `created_at` is one value per transaction and the event id
/// random, so ordering by them scrambles a transaction's events of one
/// aggregate. With the sequence column `walbox migrate` adds, resync
/// publishes in insertion order; without it, it warns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn republished_events_keep_the_order_the_stream_gives() {
    let r = Resync::new().await;
    // Never streamed: only resync publishes them. 20 transactions of 6
    // events over 2 aggregates.
    insert_events(&r.client, 0, 120, |_| 6, 2).await;
    let out = r.command("resync").output().unwrap();
    succeeded(&out);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("insertion order"), "{log}");
    // Every event once, and per key in the order they were inserted.
    assert_eq!(expect_all(&r.kafka, &r.topic, 120).await, 0);

    // Without a sequence column (and commit timestamps off), walbox says
    // the order is not the stream's.
    r.client
        .batch_execute("ALTER TABLE outbox_events DROP COLUMN seq")
        .await
        .unwrap();
    let out = r.command("resync").output().unwrap();
    succeeded(&out);
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("rows published in timestamp order"), "{log}");
}
