//! What walbox writes to stderr: JSON line by line in JSON mode (the fatal
//! line included), no colour codes off a terminal, a startup line with the
//! effective settings (secrets redacted) and the servers' versions.

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;

use crate::support::*;

const PASSWORD: &str = "hunter2-never-printed";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_json_line_by_line_through_the_fatal_line() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    // Trust authentication ignores the password: it is only there to be hidden.
    let mut command = walbox(&db, &[]);
    command.env(
        "WALBOX_PG_URL",
        format!("{} sslmode=disable password={PASSWORD}", db.conninfo()),
    );
    let mut relay = spawn_run_with(
        command,
        &kafka,
        &["--log-format", "json", "--mapping-topic-template", &topic],
    );
    insert_events(&client, 0, 20, |_| 5, 3).await;
    expect_all(&kafka, &topic, 20).await;

    // Taking the table out of the publication is a definite error: walbox stops.
    client
        .batch_execute("ALTER PUBLICATION walbox_outbox DROP TABLE public.outbox_events")
        .await
        .unwrap();
    let (status, log) = wait_exit(&mut relay).await;
    assert_eq!(status.code(), Some(1), "{log}");

    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l:?}")))
        .collect();
    let message = |v: &serde_json::Value| v["fields"]["message"].as_str().unwrap_or("").to_owned();
    let last = lines.last().expect("some lines");
    assert_eq!(last["level"], "ERROR", "{last}");
    assert!(
        message(last).contains("does not include table"),
        "the fatal line says why: {last}"
    );
    let starting = lines
        .iter()
        .find(|l| message(l) == "walbox run starting")
        .expect("a startup line");
    let settings = starting["fields"]["config"].as_str().unwrap();
    assert!(
        settings.contains(&format!("mapping.topic_template={topic}")),
        "{settings}"
    );
    assert!(settings.contains("log_format=json"), "{settings}");
    assert!(starting["fields"]["librdkafka"].is_string(), "{starting}");
    let postgres = lines
        .iter()
        .find(|l| message(l) == "connected to Postgres")
        .expect("a line with Postgres' version");
    assert!(
        postgres["fields"]["postgres"]
            .as_str()
            .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit())),
        "{postgres}"
    );
    assert!(
        lines.iter().any(|l| message(l) == "connected to Kafka"),
        "{log}"
    );
    assert!(!log.contains(PASSWORD), "a secret was printed: {log}");

    // `status` says the publication no longer covers the table, and how to fix it.
    let out = walbox(&db, &["status", "--json"]).output().unwrap();
    let status: serde_json::Value = serde_json::from_str(&succeeded(&out)).unwrap();
    assert_eq!(status["publication_covers"], false, "{status}");
    assert!(
        status["publication_problem"]
            .as_str()
            .is_some_and(|p| p.contains("ADD TABLE")),
        "{status}"
    );
    let out = walbox(&db, &["status"]).output().unwrap();
    assert!(succeeded(&out).contains("(covers: NO: "));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_carry_no_colour_codes_off_a_terminal() {
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(1).await;
    let mut relay = spawn_run(&db, &kafka, &["--mapping-topic-template", &topic]);
    insert_events(&client, 0, 5, |_| 1, 5).await;
    expect_all(&kafka, &topic, 5).await;
    let log = stop(&mut relay).await;
    assert!(log.contains("walbox run starting"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in a file: {log:?}");

    // A configuration error (before logging is set up) in JSON mode is JSON.
    // So is a usage error.
    for (args, says) in [
        (
            &["run", "--log-format", "json", "--max-in-flight-events=-3"][..],
            "--max-in-flight-events",
        ),
        (
            &["run", "--log-format=json", "--no-such-flag"][..],
            "--no-such-flag",
        ),
    ] {
        let out = walbox(&db, args).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        let v: serde_json::Value = serde_json::from_str(stderr.trim())
            .unwrap_or_else(|e| panic!("not JSON ({e}): {stderr:?}"));
        assert_eq!(v["level"], "ERROR");
        assert!(
            v["fields"]["message"].as_str().unwrap().contains(says),
            "{stderr}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_no_broker_answers_stops_at_once_and_cleanly() {
    let db = fresh_db().await;
    init(&db).await;
    // Nothing listens there: the startup check would wait 10 s, then fail.
    let nobody = free_addr();
    let mut relay = spawn_run_with(
        walbox(&db, &[]),
        &TestKafka::External { bootstrap: nobody },
        &[],
    );
    // Past the slot's preparation (a signal there stops with a line of its
    // own), into the brokers' check.
    wait_log(&relay, "connecting to Kafka").await;
    sigterm(&relay);
    let (status, log) = wait_exit(&mut relay).await;
    assert!(status.success(), "{log}");
    assert!(log.contains("while waiting for the brokers"), "{log}");
}
