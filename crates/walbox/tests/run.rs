//! `walbox init-slot` and `walbox run` as processes, against real Postgres
//! and the test broker.

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdkafka::message::Message;
use walbox_test_harness::kafka::{consume_n, consume_until_quiet, headers_of, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{fresh_db, TestDb};
use walbox_test_harness::slot::{confirmed_flush_lsn, current_wal_lsn};
use walbox_test_harness::wait::wait_for;

fn walbox(db: &TestDb, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_walbox"));
    c.args(args)
        .env(
            "WALBOX_PG_URL",
            format!("{} sslmode=disable", db.conninfo()),
        )
        .env("WALBOX_LOG", "info");
    c
}

fn spawn_run(db: &TestDb, kafka: &TestKafka, extra: &[&str]) -> Child {
    let mut args = vec!["run", "--kafka-brokers"];
    let bootstrap = kafka.bootstrap();
    args.push(&bootstrap);
    args.extend_from_slice(extra);
    walbox(db, &args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start walbox run")
}

fn sigterm(child: &Child) {
    assert!(Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

async fn wait_exit(child: &mut Child) -> (std::process::ExitStatus, String) {
    let status = wait_for("walbox to exit", Duration::from_secs(40), || {
        let s = child.try_wait().unwrap();
        async move { s.ok_or_else(|| "running".to_owned()) }
    })
    .await;
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_publishes_each_event_once_in_order_and_confirms_the_slot() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;

    let out = walbox(&db, &["init-slot"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    let mut relay = spawn_run(&db, &kafka, &["--topic-template", &topic]);
    let (txs, per_tx, aggregates) = (20, 10, 7);
    for t in 0..txs {
        let values: Vec<String> = (0..per_tx)
            .map(|i| {
                let n = t * per_tx + i;
                format!(
                    "('order', 'agg-{}', 'E{n}', '{{\"n\": {n}}}')",
                    n % aggregates
                )
            })
            .collect();
        client
            .batch_execute(&format!(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES {}",
                values.join(",")
            ))
            .await
            .unwrap();
    }
    let after_last_commit = current_wal_lsn(&client).await;
    let n = (txs * per_tx) as usize;
    let messages = consume_n(&kafka, &topic, n, Duration::from_secs(60))
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
    wait_for(
        "confirmed_flush_lsn to pass the last commit",
        Duration::from_secs(15),
        || {
            let client = &client;
            async move {
                match confirmed_flush_lsn(client, "walbox").await {
                    Some(l) if l >= after_last_commit => Ok(()),
                    other => Err(format!("{other:?} < {after_last_commit}")),
                }
            }
        },
    )
    .await;

    // SIGTERM: exit 0; a restart sends nothing again.
    sigterm(&relay);
    let (status, stderr) = wait_exit(&mut relay).await;
    assert!(status.success(), "{status}: {stderr}");
    assert!(stderr.contains("confirmed on shutdown"), "{stderr}");
    let mut again = spawn_run(&db, &kafka, &["--topic-template", &topic]);
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
        &["--table", "loose", "--topic-template", &topic],
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
    let out = Command::new(env!("CARGO_BIN_EXE_walbox"))
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
