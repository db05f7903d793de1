//! Publication drift healed from the outbox table: rows inserted while the
//! publication did not cover the table never enter the stream (Postgres
//! decodes each change with the catalog of its time); `walbox resync
//! --drift` and `on_drift = "heal"` republish them from the table before
//! the slot streams on, in each key's order, and a kill -9 mid-heal loses
//! nothing.

use std::time::Duration;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::{fresh_db, TestDb};
use walbox_test_harness::slot::{
    confirmed_flush_lsn, current_wal_lsn, wait_confirmed_at_least, write_wal_elsewhere,
};

use crate::support::*;

const UNPUBLISH: &str = "ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events";
const REPUBLISH: &str = "ALTER PUBLICATION walbox_outbox ADD TABLE outbox_events";

/// `walbox SUBCOMMAND` with the Kafka settings and `topic`.
fn command(
    db: &TestDb,
    kafka: &TestKafka,
    topic: &str,
    subcommand: &[&str],
) -> std::process::Command {
    let mut c = walbox(db, subcommand);
    c.args([
        "--kafka-brokers",
        &kafka.bootstrap(),
        "--mapping-topic-template",
        topic,
    ]);
    c
}

/// Events 0..100, delivered and confirmed; then the table taken out of the
/// publication and events 100..300 committed (the gap the stream will not
/// carry), with WAL elsewhere for keepalives to report.
async fn deliver_then_unpublish(client: &tokio_postgres::Client) {
    insert_events(client, 0, 100, |k| 1 + k % 5, 7).await;
    let head = current_wal_lsn(client).await;
    wait_confirmed_at_least(client, "walbox", head, Duration::from_secs(30)).await;
    client.batch_execute(UNPUBLISH).await.unwrap();
    insert_events(client, 100, 300, |k| 1 + k % 5, 7).await;
    write_wal_elsewhere(client, "elsewhere", 1 << 20).await;
}

/// walbox stops for drift (the default policy); `resync --drift` refuses
/// while the publication still does not cover the table, then, once it
/// does, republishes what the stream did not carry and keeps the slot:
/// every event arrives, first arrivals in each key's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resync_drift_republishes_what_the_stream_did_not_carry_and_keeps_the_slot() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let flags = ["--mapping-topic-template", topic.as_str()];
    let mut relay = spawn_run(&db, &kafka, &flags);
    deliver_then_unpublish(&client).await;
    let (status, log) = wait_exit(&mut relay).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("walbox resync --drift"), "{log}");
    let held = confirmed_flush_lsn(&client, "walbox").await.unwrap();

    let status = succeeded(&walbox(&db, &["status"]).output().unwrap());
    assert!(status.contains("drift stop:"), "{status}");
    // Not before the publication covers the table again.
    let refused = command(&db, &kafka, &topic, &["resync", "--drift"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("fix the publication first"), "{stderr}");

    client.batch_execute(REPUBLISH).await.unwrap();
    // After the fix: in the stream as well as in the snapshot.
    insert_events(&client, 300, 400, |k| 1 + k % 5, 7).await;
    let out = succeeded(
        &command(&db, &kafka, &topic, &["resync", "--drift"])
            .output()
            .unwrap(),
    );
    assert!(out.contains("kept; republished"), "{out}");
    assert_eq!(
        confirmed_flush_lsn(&client, "walbox").await,
        Some(held),
        "the slot was kept where the stop held it"
    );
    let status = succeeded(&walbox(&db, &["status"]).output().unwrap());
    assert!(
        !status.contains("drift stop:"),
        "the stop is healed: {status}"
    );

    let mut relay = spawn_run(&db, &kafka, &flags);
    insert_events(&client, 400, 500, |k| 1 + k % 5, 7).await;
    let duplicates = expect_all(&kafka, &topic, 500).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    let log = stop(&mut relay).await;
    assert!(
        !log.contains("stopped for publication drift before"),
        "{log}"
    );
    eprintln!("resync --drift: 500 events, {duplicates} duplicates");
}

/// `on_drift = "heal"`: walbox stays up while the publication does not
/// cover the table (a restart meanwhile finds the recorded stop and waits
/// too), heals once it does; killed with SIGKILL after the rows are copied
/// and before they are published, the next start publishes them before it
/// streams. Every event arrives, first arrivals in each key's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_drift_heal_waits_for_the_fix_and_a_kill_9_mid_heal_loses_nothing() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let flags = [
        "--mapping-topic-template",
        topic.as_str(),
        "--on-drift",
        "heal",
        "--slot-recreate-margin-secs",
        "1",
        "--metrics-addr",
        ANY_PORT,
    ];
    let run = |pause: Option<&str>| {
        let mut c = walbox(&db, &[]);
        if let Some(point) = pause {
            c.env("WALBOX_TEST_PAUSE_AT", point);
        }
        spawn_run_with(c, &kafka, &flags)
    };
    let mut relay = run(None);
    deliver_then_unpublish(&client).await;
    wait_log(
        &relay,
        "waiting for the publication to cover the outbox table",
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(relay.running(), "walbox stays up: {}", relay.log());
    relay.kill9();
    // Restarted before the fix: the recorded stop makes it wait again,
    // and says so on /metrics (what WalboxDriftUnhealed alerts on).
    let mut relay = run(Some("drift_heal.copied"));
    let addr = metrics_addr(&relay).await;
    wait_log(
        &relay,
        "waiting for the publication to cover the outbox table",
    )
    .await;
    assert_eq!(metric_at(&addr, "walbox_drift_unhealed"), 1.0);
    assert_eq!(metric_at(&addr, "walbox_streaming"), 0.0);

    client.batch_execute(REPUBLISH).await.unwrap();
    insert_events(&client, 300, 400, |k| 1 + k % 5, 7).await;
    wait_log(&relay, "paused at test point drift_heal.copied").await;
    relay.kill9();
    let mut relay = run(None);
    wait_log(
        &relay,
        "finishing the interrupted backfill or heal before streaming",
    )
    .await;
    insert_events(&client, 400, 500, |k| 1 + k % 5, 7).await;
    let duplicates = expect_all(&kafka, &topic, 500).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    let addr = metrics_addr(&relay).await;
    assert_eq!(metric_at(&addr, "walbox_drift_unhealed"), 0.0, "healed");
    stop(&mut relay).await;
    eprintln!("on_drift = heal, killed mid-heal: 500 events, {duplicates} duplicates");
}
