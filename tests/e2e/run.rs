//! `walbox init-slot` and `walbox run` as processes, against real Postgres
//! and the test broker.

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::Duration;

use rdkafka::message::Message;
use walbox_test_harness::kafka::{consume_n, consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::proxy::Proxy;
use walbox_test_harness::slot::{
    confirmed_flush_lsn, current_wal_lsn, wait_confirmed_at_least, wait_retained_below,
    write_wal_elsewhere,
};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_publishes_each_event_once_in_order_and_confirms_the_slot() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;

    let out = walbox(&db, &["init-slot"]).output().unwrap();
    let stdout = succeeded(&out);
    assert_eq!(
        stdout,
        "publication \"walbox_outbox\": created\nslot \"walbox\": created\n"
    );
    let again =
        String::from_utf8_lossy(&walbox(&db, &["init-slot"]).output().unwrap().stdout).into_owned();
    assert_eq!(
        again,
        "publication \"walbox_outbox\": already present\nslot \"walbox\": already present\n"
    );

    // All events to one test topic: the template has no placeholder.
    let (mut relay, metrics_addr) = spawn_run_watched(&db, &kafka, &topic).await;
    // 10,000 events over 100 aggregates in transactions of 1 to 50 events.
    let (n, aggregates) = (10_000, 100);
    insert_events(&client, 0, n, |k| 1 + (k * 37) % 50, aggregates).await;
    let after_last_commit = current_wal_lsn(&client).await;
    let messages = consume_n(&kafka, &topic, n, Duration::from_secs(120))
        .await
        .unwrap();

    let ids: Vec<String> = client
        .query(
            "SELECT id::text FROM outbox_events ORDER BY created_at, event_type",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut seen = HashSet::new();
    let mut last_n_per_key: HashMap<Vec<u8>, i64> = HashMap::new();
    // Within a partition, offsets are in arrival order.
    let mut sorted = messages.clone();
    sorted.sort_by_key(|m| (m.partition(), m.offset()));
    for m in &sorted {
        let h = headers_of(m);
        assert!(
            seen.insert(h["id"].clone()),
            "event {} arrived twice",
            h["id"]
        );
        let payload: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        let n = payload["n"].as_i64().unwrap();
        assert_eq!(
            m.key(),
            Some(format!("agg-{}", n % aggregates as i64).as_bytes())
        );
        assert_eq!(h["event_type"], format!("E{n}"));
        let prev = last_n_per_key.insert(m.key().unwrap().to_vec(), n);
        assert!(
            prev.is_none_or(|p| p < n),
            "per-key order follows commit order"
        );
    }
    assert_eq!(seen, ids.iter().cloned().collect::<HashSet<_>>());

    // The slot is confirmed through the last commit.
    wait_confirmed_at_least(
        &client,
        "walbox",
        after_last_commit,
        Duration::from_secs(15),
    )
    .await;

    // The metrics saw the same.
    wait_http(&metrics_addr, "/healthz", 200).await;
    wait_http(&metrics_addr, "/readyz", 200).await;
    let want = format!("walbox_events_published_total{{topic=\"{topic}\"}} {n}");
    let body = wait_for(
        "the metrics to count every event",
        Duration::from_secs(10),
        || {
            let got = http_get(&metrics_addr, "/metrics");
            let want = want.clone();
            async move {
                match got {
                    Some((200, body)) if body.contains(&want) => Ok(body),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await;
    assert!(body.contains("walbox_in_flight_events 0"), "{body}");
    assert!(
        body.contains(&format!("walbox_commit_to_ack_seconds_count {n}")),
        "{body}"
    );
    assert!(!body.contains("walbox_confirmed_lsn 0\n"), "{body}");

    // SIGTERM: exit 0; a restart sends nothing again.
    sigterm(&relay);
    let (status, stderr) = wait_exit(&mut relay).await;
    assert!(status.success(), "{status}: {stderr}");
    assert!(stderr.contains("confirmed on shutdown"), "{stderr}");
    // The exact latencies of every event, logged at exit: to the ack, to
    // walbox's read of the event's transaction, and from that read to the
    // ack split into walbox's own part and the Kafka client's (librdkafka
    // says how long it held each record).
    for line in [
        "commit to ack",
        "commit to read",
        "read to send",
        "read to ack",
        "the broker client's part",
        "walbox's own part",
    ] {
        let exact = stderr
            .lines()
            .find(|l| l.contains(&format!("{line} since start (exact)")))
            .unwrap_or_else(|| panic!("no exact {line} line: {stderr}"));
        assert!(exact.contains(&format!("events={n} ")), "{exact}");
        for field in ["p50_ms=", "p99_ms=", "p999_ms=", "max_ms="] {
            assert!(exact.contains(field), "{exact}");
        }
    }
    let mut again = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    let all = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(4),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert_eq!(all.len(), n, "no duplicates after a clean restart");
    sigterm(&again);
    let (status, stderr) = wait_exit(&mut again).await;
    assert!(status.success(), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmappable_row_stops_walbox_with_the_event_id_and_holds_the_slot() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE loose (id uuid DEFAULT gen_random_uuid(), aggregate_type text, aggregate_id text,
                                 event_type text, payload jsonb, headers jsonb, created_at timestamptz DEFAULT now())",
        )
        .await
        .unwrap();
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    assert!(walbox(&db, &["init-slot", "--table", "loose"])
        .status()
        .unwrap()
        .success());
    let before = confirmed_flush_lsn(&client, "walbox").await.unwrap();
    client
        .batch_execute(
            "INSERT INTO loose (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'ok-1', 'E', '{}');
             INSERT INTO loose (id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('6d1f1c9e-0000-4000-8000-0000000000bb', 'order', NULL, 'E', '{}');",
        )
        .await
        .unwrap();
    let mut relay = spawn_run(
        &db,
        &kafka,
        &["--table", "loose", "--mapping-topic-template", &topic],
    );
    let (status, stderr) = wait_exit(&mut relay).await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("walbox: event 6d1f1c9e-0000-4000-8000-0000000000bb: column \"aggregate_id\" (the aggregate id) is NULL"),
        "{stderr}"
    );
    // The good event before it was delivered and may be confirmed; nothing past the bad one.
    let bad_commit: pgoutput_decoder::Lsn = current_wal_lsn(&client).await;
    let confirmed = confirmed_flush_lsn(&client, "walbox").await.unwrap();
    assert!(
        confirmed >= before && confirmed < bad_commit,
        "{before} <= {confirmed} < {bad_commit}"
    );
    let delivered = consume_n(&kafka, &topic, 1, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(delivered[0].key(), Some(b"ok-1".as_slice()));
}

#[test]
fn bad_configuration_is_a_usage_error_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("walbox.toml");
    std::fs::write(&file, "pg_url = \"host=h user=u\"\nslto = \"x\"\n").unwrap();
    let out = Command::new(walbox_e2e::walbox_bin())
        .args(["status", "--config", file.to_str().unwrap()])
        .env_remove("WALBOX_PG_URL")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("line 2") && stderr.contains("unknown field `slto`"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_instance_waits_for_the_slot_and_takes_over() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    // As the Helm chart runs it: application_name is the pod's name.
    let mut command = walbox(&db, &[]);
    command.env("PGAPPNAME", "orders-walbox-7d9f-abcde");
    let mut first = spawn_run_with(command, &kafka, &["--mapping-topic-template", &topic]);
    wait_log(&first, "streaming from the slot").await;
    let (mut second, second_metrics) = spawn_run_watched(&db, &kafka, &topic).await;
    wait_log(&second, "is in use by process").await;
    assert_eq!(
        wait_http(&second_metrics, "/readyz", 503).await,
        "standby: waiting for the slot another instance holds\n"
    );
    // What the Kubernetes chart probes: a waiting standby is a ready pod.
    assert_eq!(
        wait_http(&second_metrics, "/readyz?standby=ready", 200).await,
        "standby: waiting for the slot another instance holds\n"
    );
    assert!(second.running(), "the second instance keeps waiting");
    let (_, metrics) = http_get(&second_metrics, "/metrics").expect("metrics");
    assert!(metrics.contains("walbox_streaming 0"), "{metrics}");
    assert!(metrics.contains("walbox_standby 1"), "{metrics}");
    assert!(
        metrics.contains("walbox_reconnects_total{reason=\"slot_busy\"}"),
        "{metrics}"
    );
    // `status --json` names who streams and how far behind the slot is.
    let out = walbox(&db, &["status", "--json"]).output().unwrap();
    let status: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
    assert_eq!(status["active"], true, "{status}");
    let walsender = status["walsender_pid"].as_i64().expect("walsender_pid");
    assert_eq!(status["active_pid"], walsender, "{status}");
    assert_ne!(
        walsender,
        i64::from(first.id()),
        "the walsender is Postgres's"
    );
    assert_eq!(
        status["application_name"], "orders-walbox-7d9f-abcde",
        "{status}"
    );
    let text = succeeded(&walbox(&db, &["status"]).output().unwrap());
    assert!(
        text.contains("active:              yes: streamed by orders-walbox-7d9f-abcde from ")
            && text.contains(&format!("(walsender pid {walsender})")),
        "{text}"
    );
    assert_eq!(status["publication_covers"], true, "{status}");
    assert!(status["confirmed_lag_bytes"].as_i64().is_some(), "{status}");
    assert!(status["invalidation_reason"].is_null(), "{status}");

    insert_events(&client, 0, 10, |_| 5, 3).await;
    assert_eq!(expect_all(&kafka, &topic, 10).await, 0);

    sigterm(&first);
    assert!(wait_exit(&mut first).await.0.success());
    let exited = std::time::Instant::now();
    wait_log(&second, "streaming from the slot").await;
    eprintln!(
        "the standby took over {:?} after the active instance exited",
        exited.elapsed()
    );
    wait_http(&second_metrics, "/readyz", 200).await;
    // The waiting, the normal state of a standby, was said once, at INFO.
    let log = second.log();
    let waits: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("is in use by process"))
        .collect();
    assert_eq!(waits.len(), 1, "{log}");
    assert!(waits[0].contains("INFO"), "{log}");
    insert_events(&client, 10, 20, |_| 5, 3).await;
    assert_eq!(
        expect_all(&kafka, &topic, 20).await,
        0,
        "the standby took over without duplicates"
    );
    stop(&mut second).await;
}

/// What the Kubernetes chart's rolling update does to a pair, with events
/// flowing: a new pod starts as a standby (ready), an old one gets SIGTERM,
/// twice over, so the active one is replaced. Every event arrives, in
/// per-key order; the pods are ready throughout but for the moment of the
/// handover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_of_an_active_standby_pair_loses_nothing() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let pod = || spawn_run_watched(&db, &kafka, &topic);
    let (mut old_active, active_addr) = pod().await;
    wait_log(&old_active, "streaming from the slot").await;
    let (mut old_standby, standby_addr) = pod().await;
    wait_http(&standby_addr, "/readyz?standby=ready", 200).await;

    let total = 6_000;
    let writer_client = db.connect().await;
    let writer = tokio::spawn(async move {
        for chunk in 0..60 {
            insert_events(&writer_client, chunk * 100, (chunk + 1) * 100, |_| 10, 20).await;
            tokio::time::sleep(Duration::from_millis(100)).await; // keep events flowing through the rollout
        }
    });
    // Surge: a new pod, ready as a standby; then the old standby goes.
    let (mut new_a, new_a_addr) = pod().await;
    wait_http(&new_a_addr, "/readyz?standby=ready", 200).await;
    sigterm(&old_standby);
    assert!(wait_exit(&mut old_standby).await.0.success());
    // Another new pod; then the old active goes, and a new one takes over.
    let (mut new_b, new_b_addr) = pod().await;
    wait_http(&new_b_addr, "/readyz?standby=ready", 200).await;
    wait_http(&active_addr, "/readyz", 200).await;
    assert!(
        !writer.is_finished(),
        "the handover happens while events flow"
    );
    sigterm(&old_active);
    let (status, log) = wait_exit(&mut old_active).await;
    assert!(status.success(), "{log}");
    writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, total).await;
    let streaming: Vec<bool> = [&new_a_addr, &new_b_addr]
        .iter()
        .map(|a| http_get(a, "/readyz").is_some_and(|(s, _)| s == 200))
        .collect();
    assert_eq!(
        streaming.iter().filter(|s| **s).count(),
        1,
        "one new pod streams, the other waits: {streaming:?}"
    );
    eprintln!("{total} events through a rolling update of the pair; {duplicates} duplicates");
    stop(&mut new_a).await;
    stop(&mut new_b).await;
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_lost_when_walbox_is_killed_repeatedly() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let total = 50_000;
    let writer = spawn_writer(
        db.connect().await,
        500,
        100,
        Duration::from_millis(5),
        |chunk, _| 1 + chunk % 20,
        30,
    );
    let run = || spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    let mut relay =
        kill_9_at_random_moments(run(), 5, (200, 600), 0x2545_f491_4f6c_dd1d, run).await;
    writer.await.unwrap();
    let duplicates = expect_all(&kafka, &topic, total).await;
    eprintln!("{total} events survived 5 kill -9s; {duplicates} duplicates (bounded by what was in flight)");
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
    drop(client);
}

/// Before PG 17 a fast shutdown does not write a slot whose only change is
/// its confirmed position: the slot comes back behind what walbox
/// confirmed, and Postgres re-sends those transactions. walbox, still
/// running, skips them. Then a crash (immediate stop) the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walbox_reconnects_after_postgres_restarts_and_sends_nothing_twice() {
    let (mut server, url, client) = private_outbox().await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let mut command = Command::new(walbox_e2e::walbox_bin());
    command.env("WALBOX_PG_URL", &url);
    let mut relay = spawn_run_with(command, &kafka, &["--mapping-topic-template", &topic]);
    let mut client = client;
    for (round, immediate) in [(0usize, false), (1, true)] {
        let from = round * 200;
        insert_events(&client, from, from + 200, |_| 10, 5).await;
        let head = current_wal_lsn(&client).await;
        wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
        assert_eq!(expect_all(&kafka, &topic, from + 200).await, 0);
        drop(client);
        (server, client) = restart_postgres(server, immediate).await;
    }
    insert_events(&client, 400, 450, |_| 10, 5).await;
    let duplicates = expect_all(&kafka, &topic, 450).await;
    assert!(relay.running(), "walbox kept running");
    let log = relay.log();
    assert!(log.contains("will retry"), "{log}");
    let version = walbox_test_harness::pg::server_version_num(&client).await;
    if version < 170_000 {
        assert!(
            log.contains("the slot resumed before what walbox confirmed"),
            "the restart really sent the slot back (else this test proves nothing)\n{log}"
        );
    }
    assert_eq!(
        duplicates, 0,
        "what walbox confirmed before the restarts was not sent again\n{log}"
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

/// Postgres restarted (fast shutdown) five times while walbox is still
/// delivering what it just read: the events in flight at each restart are
/// acknowledged after the connection is gone, and Postgres (before 17)
/// sends their transactions again. walbox takes those reports before it
/// reconnects and skips the transactions they completed. What may come
/// twice is the part of the one transaction walbox was in the middle of
/// reading when its session ended (at most 9 events here, per restart).
/// (Acceptance runs of 4,000 events and one restart saw 0, 176, 161, 30 and
/// 0 duplicates, and this test 64 per run: the acknowledgements that came
/// after the connection broke were dropped as another session's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_with_events_in_flight_send_nothing_twice() {
    const ROUNDS: usize = 5;
    const PER_ROUND: usize = 800;
    const MAX_TX: usize = 10;
    let (mut server, url, client) = private_outbox().await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    // Acknowledgements take a while (on Apache Kafka they take what they
    // take): events are in flight when Postgres goes down.
    if let Some(mock) = kafka.mock_cluster() {
        for broker in 1..=3 {
            mock.broker_round_trip_time(broker, Duration::from_millis(300))
                .unwrap();
        }
    }
    let mut command = Command::new(walbox_e2e::walbox_bin());
    command.env("WALBOX_PG_URL", &url);
    let mut relay = spawn_run_with(command, &kafka, &["--mapping-topic-template", &topic]);
    wait_log(&relay, "streaming from the slot").await;
    let mut client = client;
    for round in 0..ROUNDS {
        let from = round * PER_ROUND;
        // Committed, then Postgres goes down at once: walbox is still
        // reading and delivering them.
        insert_events(&client, from, from + PER_ROUND, |k| 1 + k % MAX_TX, 7).await;
        drop(client);
        (server, client) = restart_postgres(server, false).await;
    }
    let total = ROUNDS * PER_ROUND;
    let duplicates = expect_all(&kafka, &topic, total).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    let log = relay.log();
    assert!(relay.running(), "walbox kept running\n{log}");
    eprintln!("{total} events through {ROUNDS} Postgres restarts: {duplicates} duplicates");
    assert!(
        duplicates <= ROUNDS * (MAX_TX - 1),
        "{duplicates} duplicates: more than a partly read transaction per restart\n{log}"
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

/// A restore that keeps the system identifier and the timeline (a disk
/// snapshot brought back, a base backup started without recovery): the
/// restored server's WAL ends before what walbox delivered, and the new
/// transactions it writes at those positions were never sent. walbox,
/// still running, sees the WAL went backwards and skips none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restore_on_the_same_timeline_every_new_event_arrives() {
    let (mut server, url, client) = private_outbox().await;
    drop(client);
    server = tokio::task::spawn_blocking(move || {
        server.stop();
        server.snapshot("before").unwrap();
        server.start().unwrap();
        server
    })
    .await
    .unwrap();
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let mut command = Command::new(walbox_e2e::walbox_bin());
    command.env("WALBOX_PG_URL", &url);
    let mut relay = spawn_run_with(command, &kafka, &["--mapping-topic-template", &topic]);
    let client = walbox_test_harness::pg::connect(&server.config("postgres"))
        .await
        .unwrap();
    insert_events(&client, 0, 300, |_| 10, 5).await;
    let head = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", head, Duration::from_secs(30)).await;
    assert_eq!(expect_all(&kafka, &topic, 300).await, 0);
    drop(client);
    server = tokio::task::spawn_blocking(move || {
        server.stop();
        server.restore("before").unwrap();
        server.start().unwrap();
        server
    })
    .await
    .unwrap();
    let client = walbox_test_harness::pg::connect(&server.config("postgres"))
        .await
        .unwrap();
    insert_events(&client, 300, 350, |_| 10, 5).await;
    let now = current_wal_lsn(&client).await;
    assert!(
        now < head,
        "the restored server writes below what walbox delivered ({now} < {head}), else this test proves nothing"
    );
    expect_all(&kafka, &topic, 350).await;
    let log = relay.log();
    assert!(
        log.contains("restored on the same timeline"),
        "walbox said why it skipped nothing\n{log}"
    );
    assert!(relay.running(), "walbox kept running");
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

/// The outbox table removed from the publication while walbox runs: walbox
/// stops with a line that says so, and the slot stays before the change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_removed_from_the_publication_stops_walbox_before_the_change() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    insert_events(&client, 0, 20, |_| 5, 2).await;
    assert_eq!(expect_all(&kafka, &topic, 20).await, 0);
    let before = current_wal_lsn(&client).await;
    wait_confirmed_at_least(&client, "walbox", before, Duration::from_secs(30)).await;
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox DROP TABLE outbox_events")
        .await
        .unwrap();
    let change = current_wal_lsn(&client).await;
    // Rows the stream no longer carries, and WAL elsewhere for keepalives.
    insert_events(&client, 20, 40, |_| 5, 2).await;
    write_wal_elsewhere(&client, "elsewhere", 1 << 20).await;
    let (status, log) = wait_exit(&mut relay).await;
    assert_eq!(status.code(), Some(1), "{log}");
    let last = log.lines().last().unwrap_or_default();
    assert!(last.contains("does not include table"), "{last}");
    assert!(last.contains("ALTER PUBLICATION"), "{last}");
    let confirmed = confirmed_flush_lsn(&client, "walbox").await.unwrap();
    assert!(
        confirmed <= change,
        "the slot ({confirmed}) stayed before the change ({change})"
    );
    // Restarted as is, walbox refuses again instead of streaming past it.
    let mut again = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    let (status, log) = wait_exit(&mut again).await;
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("does not include table"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_does_not_hold_wal_while_other_tables_change() {
    const MB: i64 = 1024 * 1024;
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    wait_log(&relay, "streaming from the slot").await;

    let written = write_wal_elsewhere(&client, "busy", 100 * MB as u64).await;
    let started = std::time::Instant::now();
    let retained = wait_retained_below(&client, "walbox", 32 * MB, Duration::from_secs(30)).await;
    eprintln!(
        "wrote {} MB to another table; the slot retains {} MB {:?} later",
        written / MB as u64,
        retained / MB,
        started.elapsed()
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_killed_mid_stream_holds_the_slot_and_loses_nothing() {
    let mut broker = kafka_cluster(1);
    let kafka = broker.kafka();
    wait_broker(&kafka).await;
    let topic = kafka.create_topic(3).await;

    let db = fresh_db().await;
    let client = init(&db).await;
    let (mut relay, addr) = spawn_run_watched(&db, &kafka, &topic).await;
    insert_events(&client, 0, 200, |k| 1 + k % 20, 10).await;
    expect_all(&kafka, &topic, 200).await;

    // Broker gone; the application keeps writing.
    let lines_before_outage = relay.log().lines().count();
    tokio::task::block_in_place(|| broker.kill9(0));
    insert_events(&client, 200, 250, |_| 50, 10).await;
    let after_first_unacked_commit = current_wal_lsn(&client).await;
    insert_events(&client, 250, 500, |k| 1 + k % 20, 10).await;

    // For 20 s the slot must not pass an event the broker has not acknowledged.
    let outage_end = std::time::Instant::now() + Duration::from_secs(20);
    let mut checks = 0;
    while std::time::Instant::now() < outage_end {
        let confirmed = confirmed_flush_lsn(&client, "walbox").await.unwrap();
        assert!(
            confirmed < after_first_unacked_commit,
            "confirmed {confirmed} past an unacknowledged commit ({after_first_unacked_commit})"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(500)).await; // sampling the outage window
    }
    assert!(
        relay.running(),
        "walbox waits out the outage: {}",
        relay.log()
    );
    // The wait shows: deliveries have not moved for most of the outage.
    let (_, metrics) = http_get(&addr, "/metrics").expect("metrics");
    let stalled: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("walbox_delivery_stalled_seconds "))
        .and_then(|v| v.trim().parse().ok())
        .expect("walbox_delivery_stalled_seconds");
    assert!(
        stalled >= 10.0,
        "stalled for {stalled} s at the end of a 20 s outage"
    );

    // An outage is said in a handful of lines, not one per reconnect attempt.
    let log = relay.log();
    let outage_lines: Vec<&str> = log.lines().skip(lines_before_outage).collect();
    eprintln!("{} lines logged during a 20 s outage", outage_lines.len());
    assert!(
        outage_lines.len() <= 8,
        "{} lines logged during a 20 s broker outage:\n{}",
        outage_lines.len(),
        outage_lines.join("\n")
    );

    tokio::task::block_in_place(|| broker.restart(0));
    let duplicates = expect_all(&kafka, &topic, 500).await;
    eprintln!("{checks} checks during a 20 s broker outage; after restart all 500 events present, {duplicates} duplicates");
    wait_confirmed_at_least(
        &client,
        "walbox",
        after_first_unacked_commit,
        Duration::from_secs(30),
    )
    .await;
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmappable_row_goes_to_the_dead_letter_topic_when_configured() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE loose (id uuid DEFAULT gen_random_uuid(), aggregate_type text, aggregate_id text,
                                 event_type text, payload jsonb, headers jsonb, created_at timestamptz DEFAULT now())",
        )
        .await
        .unwrap();
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let dlq = kafka.create_topic(1).await;
    assert!(walbox(&db, &["init-slot", "--table", "loose"])
        .status()
        .unwrap()
        .success());
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--table",
            "loose",
            "--mapping-topic-template",
            &topic,
            "--dead-letter-topic",
            &dlq,
        ],
    );
    client
        .batch_execute(
            "INSERT INTO loose (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'ok-1', 'E', '{}');
             INSERT INTO loose (id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('6d1f1c9e-0000-4000-8000-0000000000cc', 'order', NULL, 'E', '{\"lost\": false}');
             INSERT INTO loose (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'ok-2', 'E', '{}');",
        )
        .await
        .unwrap();
    let after = current_wal_lsn(&client).await;
    let good = consume_n(&kafka, &topic, 2, Duration::from_secs(30))
        .await
        .unwrap();
    let keys: Vec<&[u8]> = good.iter().map(|m| m.key().unwrap()).collect();
    assert_eq!(
        keys,
        [b"ok-1".as_slice(), b"ok-2".as_slice()],
        "walbox went on after the bad row"
    );
    let dead = consume_n(&kafka, &dlq, 1, Duration::from_secs(30))
        .await
        .unwrap();
    let h = headers_of(&dead[0]);
    assert_eq!(
        h["walbox.error"],
        "event 6d1f1c9e-0000-4000-8000-0000000000cc: column \"aggregate_id\" (the aggregate id) is NULL"
    );
    assert_eq!(h["walbox.error.kind"], "unmappable");
    assert_eq!(dead[0].payload(), Some(b"{\"lost\": false}".as_slice()));
    // Dead-lettered counts as delivered: the slot moves past it.
    wait_confirmed_at_least(&client, "walbox", after, Duration::from_secs(15)).await;
    assert!(relay.running());
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

/// The broker refuses one event's topic for good: with a dead-letter topic,
/// walbox publishes the event there with its origin, goes on, and confirms
/// past it; the events around it arrive on their own topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_goes_to_the_dead_letter_topic_with_its_origin() {
    // The MockCluster, whatever the pass: the refusal is injected into it.
    let kafka = TestKafka::mock(1);
    let good = kafka.create_topic(1).await;
    let dlq = kafka.create_topic(1).await;
    let refused = "walbox-test-refused";
    kafka
        .mock_cluster()
        .unwrap()
        .topic_error(
            refused,
            rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
        )
        .unwrap();
    let db = fresh_db().await;
    let client = init(&db).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            "--mapping-topic-template",
            "{aggregate_type}",
            "--dead-letter-topic",
            &dlq,
        ],
    );
    client
        .batch_execute(&format!(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('{good}', 'ok-1', 'E', '{{}}');
             INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ('6d1f1c9e-0000-4000-8000-0000000000dd', '{refused}', 'agg-r', 'Refused', '{{\"n\": 2}}');
             INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES ('{good}', 'ok-2', 'E', '{{}}');"
        ))
        .await
        .unwrap();
    let after = current_wal_lsn(&client).await;
    let delivered = consume_n(&kafka, &good, 2, Duration::from_secs(30))
        .await
        .unwrap();
    let keys: Vec<&[u8]> = delivered.iter().map(|m| m.key().unwrap()).collect();
    assert_eq!(keys, [b"ok-1".as_slice(), b"ok-2".as_slice()]);
    let dead = consume_n(&kafka, &dlq, 1, Duration::from_secs(30))
        .await
        .unwrap();
    let h = headers_of(&dead[0]);
    assert_eq!(h["walbox.error.kind"], "refused");
    assert_eq!(h["walbox.original.topic"], refused);
    assert_eq!(h["walbox.event.id"], "6d1f1c9e-0000-4000-8000-0000000000dd");
    assert!(h["walbox.source.lsn"].contains('/'), "{h:?}");
    assert!(h["walbox.error"].contains(refused), "{h:?}");
    assert_eq!(h["event_type"], "Refused", "the record's own headers stay");
    assert_eq!(dead[0].key(), Some(b"agg-r".as_slice()));
    assert_eq!(dead[0].payload(), Some(b"{\"n\": 2}".as_slice()));
    wait_confirmed_at_least(&client, "walbox", after, Duration::from_secs(15)).await;
    assert!(relay.running(), "walbox went on");
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_datestyle_does_not_change_what_walbox_reads() {
    let db = fresh_db().await;
    let client = init(&db).await;
    // A database whose sessions print dates the European SQL way.
    client
        .batch_execute(&format!(
            "ALTER DATABASE {} SET datestyle = 'SQL, DMY'",
            db.name()
        ))
        .await
        .unwrap();
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ('order', 'o-1', 'Placed', '{\"n\": 0}', '2026-11-21 23:51:18.55+00')",
        )
        .await
        .unwrap();
    let got = consume_n(&kafka, &topic, 1, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}: {}", relay.log()));
    assert_eq!(
        got[0].timestamp(),
        rdkafka::Timestamp::CreateTime(1_795_305_078_550),
        "the created_at column, read as ISO whatever the database's DateStyle"
    );
    sigterm(&relay);
    assert!(wait_exit(&mut relay).await.0.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_on_a_missing_slot_prints_a_json_error_and_fails() {
    let db = fresh_db().await;
    let out = walbox(&db, &["status", "--slot", "nowhere", "--json"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let error: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {stdout:?}"));
    assert_eq!(error["kind"], "no_slot", "{error}");
    assert!(
        error["error"]
            .as_str()
            .is_some_and(|m| m.contains("\"nowhere\" does not exist")),
        "{error}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
}

/// Kafka down when walbox starts (routine broker maintenance) is waited for
/// as an unreachable Postgres is: not ready, one log line per distinct
/// cause, no exit; once a broker answers, every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_down_at_start_is_waited_for_then_streamed_to() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    // Nothing listens there yet: connections are refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let brokers = format!("127.0.0.1:{port}");
    let mut command = walbox(&db, &[]);
    command.args([
        "run",
        "--kafka-brokers",
        &brokers,
        "--mapping-topic-template",
        &topic,
        "--metrics-addr",
        ANY_PORT,
    ]);
    let mut relay = spawn_logged(command);
    let metrics = metrics_addr(&relay).await;
    wait_log(&relay, "Kafka unreachable").await;
    assert_eq!(wait_http(&metrics, "/readyz", 503).await, "not streaming\n");
    insert_events(&client, 0, 20, |i| i % 4, 5).await;
    // A second failed attempt (each waits 10 s) with the same cause: counted,
    // not said again.
    wait_for("two failed attempts", Duration::from_secs(40), || {
        let addr = metrics.clone();
        async move {
            let (_, text) = http_get(&addr, "/metrics").ok_or("no metrics")?;
            let attempts = text
                .lines()
                .find_map(|l| l.strip_prefix("walbox_reconnects_total{reason=\"kafka\"} "))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            if attempts >= 2.0 {
                Ok(())
            } else {
                Err(format!("{attempts} attempts"))
            }
        }
    })
    .await;
    assert!(relay.running(), "walbox must wait, not exit");
    assert_eq!(
        relay.log().matches("Kafka unreachable").count(),
        1,
        "{}",
        relay.log()
    );

    // The broker comes back (a proxy to one of them on that port).
    let first = kafka.bootstrap().split(',').next().unwrap().to_owned();
    let _proxy = Proxy::start_on(port, first).await;
    assert_eq!(expect_all(&kafka, &topic, 20).await, 0);
    wait_http(&metrics, "/readyz", 200).await;
    stop(&mut relay).await;
}

/// Postgres unreachable is retried, and the retry line says why in the
/// operating system's words, not only "error connecting to server".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_retry_line_carries_the_os_cause() {
    let kafka = TestKafka::from_env();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut command = Command::new(walbox_e2e::walbox_bin());
    command.env(
        "WALBOX_PG_URL",
        format!("host=127.0.0.1 port={port} user=walbox dbname=app sslmode=disable"),
    );
    let mut relay = spawn_run_with(command, &kafka, &[]);
    let line = wait_log(&relay, "will retry").await;
    assert!(line.contains("Connection refused"), "{line}");
    assert!(relay.running());
    stop(&mut relay).await;
}

/// `drop-slot` on a slot that still holds undelivered events refuses,
/// counting them; `--force` drops it anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_slot_refuses_to_lose_undelivered_events_without_force() {
    let db = fresh_db().await;
    let client = init(&db).await;
    insert_events(&client, 0, 7, |i| i % 3, 7).await;
    let out = walbox(&db, &["drop-slot"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("replication slot \"walbox\" was not dropped: it still holds 7 event(s) not yet delivered")
            && stderr.contains("--force"),
        "{stderr}"
    );
    succeeded(&walbox(&db, &["status"]).output().unwrap());
    let out = walbox(&db, &["drop-slot", "--force"]).output().unwrap();
    assert!(succeeded(&out).contains("slot \"walbox\": dropped"));
}

/// An idle outbox's slot is confirmed past what other tables write within
/// seconds: while nothing waits for the broker, walbox asks the server for
/// a keepalive every second and confirms the position it carries, instead
/// of waiting for the walsender's own (`wal_sender_timeout / 2`: 30 s
/// here). So `walbox.backlog()` reads no backlog, and an audit of an idle
/// window need not wait for the slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_slot_is_confirmed_past_other_tables_writes_within_seconds() {
    let server = walbox_test_harness::pg::PgServer::builder()
        .setting("wal_sender_timeout", "60s")
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let admin = walbox_test_harness::pg::connect(&server.config("postgres"))
        .await
        .unwrap();
    apply_migrations(&admin).await;
    let url = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres sslmode=disable",
        server.port()
    );
    let with_url = |args: &[&str]| {
        let mut c = Command::new(walbox_e2e::walbox_bin());
        c.args(args)
            .env("WALBOX_PG_URL", &url)
            .env("WALBOX_LOG", "info");
        c
    };
    succeeded(&with_url(&["init-slot"]).output().unwrap());
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run_with(with_url(&[]), &kafka, &["--mapping-topic-template", &topic]);
    insert_events(&admin, 0, 10, |_| 5, 3).await;
    assert_eq!(expect_all(&kafka, &topic, 10).await, 0);
    tokio::time::sleep(Duration::from_secs(2)).await; // idle

    for round in 0..3 {
        admin
            .batch_execute(&format!(
                "CREATE TABLE busy_{round} (x int); INSERT INTO busy_{round} SELECT generate_series(1, 10000)"
            ))
            .await
            .unwrap();
        let written = current_wal_lsn(&admin).await;
        let started = std::time::Instant::now();
        wait_confirmed_at_least(&admin, "walbox", written, Duration::from_secs(5)).await;
        eprintln!(
            "round {round}: confirmed past other tables' writes in {:?}",
            started.elapsed()
        );
    }
    let row = admin
        .query_one(
            "SELECT streaming, oldest_undelivered_age = interval '0', unconfirmed_bytes < 1048576
               FROM walbox.backlog()",
            &[],
        )
        .await
        .unwrap();
    for i in 0..3 {
        assert!(row.get::<_, bool>(i), "column {i} of walbox.backlog()");
    }
    stop(&mut relay).await;
}
