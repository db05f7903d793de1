//! `sink = "sqs"` against a real SQS API server (ElasticMQ, run as a
//! process: the queues keep their messages when walbox dies, and SIGSTOP
//! freezes the server as an outage does; see the harness for why not
//! moto), the queues created and read back by boto3 (moto's venv), not by walbox's
//! client. Both tests write 10,000 events in transactions
//! of 1 to 50 through three kill -9s of walbox:
//! - on a FIFO queue (and the server frozen for 20 s, walbox killed
//!   meanwhile): every event once (the deduplication id drops re-sends),
//!   each aggregate's message group in commit order; an oversized event
//!   dead-lettered with the reason; a SIGTERM leaving nothing to send again;
//! - on a standard queue: every event at least once, and the duplicates
//!   counted; an oversized event stops walbox before it, nothing after it
//!   sent.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use walbox_test_harness::elasticmq::ElasticMq;
use walbox_test_harness::pg::{fresh_db, TestDb};
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const TOTAL: usize = 10_000;
const AGGREGATES: usize = 37;

/// A message as boto3 read it.
#[derive(Debug)]
pub(crate) struct Got {
    pub(crate) body: String,
    pub(crate) message_id: String,
    pub(crate) attributes: HashMap<String, serde_json::Value>,
    pub(crate) group: Option<String>,
    dedup: Option<String>,
    pub(crate) sequence: Option<String>,
}

impl Got {
    fn n(&self) -> usize {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        v["n"].as_u64().unwrap() as usize
    }

    pub(crate) fn attribute(&self, name: &str) -> &str {
        self.attributes[name].as_str().unwrap()
    }
}

fn tool(sqs: &ElasticMq, args: &[&str]) -> String {
    let endpoint = sqs.endpoint();
    let mut all = vec![args[0], endpoint.as_str()];
    all.extend(&args[1..]);
    run_tool(&moto_python(), "sqs_queues.py", &all, "")
}

pub(crate) fn create(sqs: &ElasticMq, name: &str) -> String {
    tool(sqs, &["create", name]).trim().to_owned()
}

fn count(sqs: &ElasticMq, url: &str) -> usize {
    tool(sqs, &["count", url]).trim().parse().unwrap()
}

pub(crate) fn read(sqs: &ElasticMq, url: &str) -> Vec<Got> {
    let all: Vec<serde_json::Value> = serde_json::from_str(&tool(sqs, &["read", url])).unwrap();
    all.into_iter()
        .map(|m| Got {
            body: m["body"].as_str().unwrap().to_owned(),
            message_id: m["message_id"].as_str().unwrap().to_owned(),
            attributes: m["attributes"]
                .as_object()
                .map(|a| a.clone().into_iter().collect())
                .unwrap_or_default(),
            group: m["group"].as_str().map(str::to_owned),
            dedup: m["dedup"].as_str().map(str::to_owned),
            sequence: m["sequence"].as_str().map(str::to_owned),
        })
        .collect()
}

/// `walbox run` to `queue` (dead letters to `dead`, if any), credentials
/// and region from the environment as the AWS chain reads them.
fn relay(db: &TestDb, sqs: &ElasticMq, queue: &str, dead: Option<&str>) -> Relay {
    match dead {
        Some(dead) => relay_with(db, sqs, queue, &["--sqs-dead-letter-queue-url", dead]),
        None => relay_with(db, sqs, queue, &[]),
    }
}

/// `walbox run` to `queue` with `extra` arguments.
pub(crate) fn relay_with(db: &TestDb, sqs: &ElasticMq, queue: &str, extra: &[&str]) -> Relay {
    let endpoint = sqs.endpoint();
    let mut args = vec![
        "run",
        "--sink",
        "sqs",
        "--sqs-queue-url",
        queue,
        "--sqs-endpoint",
        &endpoint,
        "--metrics-addr",
        ANY_PORT,
    ];
    args.extend(extra);
    let mut command = walbox(db, &args);
    command
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "walbox-secret-key")
        .env("AWS_REGION", "us-east-1")
        .env_remove("AWS_PROFILE");
    spawn_logged(command)
}

/// The 10,000 events written in transactions of 1 to 50 while walbox is
/// killed three times; returns the last walbox, running.
async fn write_through_kills(
    db: &TestDb,
    mut relay: Relay,
    restart: impl Fn() -> Relay,
    last: usize,
) -> Relay {
    let writer = spawn_writer(
        db.connect().await,
        20,
        last / 20,
        Duration::from_millis(150),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 50,
        AGGREGATES,
    );
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        relay.kill9();
        relay = restart();
    }
    writer.await.unwrap();
    relay
}

/// Waits until the queue holds at least `n` messages (nothing taken off).
async fn wait_count(sqs: &ElasticMq, url: &str, n: usize) {
    wait_for(
        "the messages in the queue",
        Duration::from_secs(180),
        || {
            let have = count(sqs, url);
            async move {
                match have >= n {
                    true => Ok(()),
                    false => Err(format!("{have} of {n}")),
                }
            }
        },
    )
    .await;
}

/// Reads the queue until it gave `total` distinct events.
async fn read_all(sqs: &ElasticMq, url: &str, total: usize) -> Vec<Got> {
    let mut got: Vec<Got> = Vec::new();
    wait_for("every event in the queue", Duration::from_secs(120), || {
        got.extend(read(sqs, url));
        let distinct: HashSet<usize> = got.iter().map(Got::n).collect();
        let n = distinct.len();
        async move {
            match n == total {
                true => Ok(()),
                false => Err(format!("{n} of {total} distinct events")),
            }
        }
    })
    .await;
    got
}

/// An event of aggregate `agg-big` larger than SQS's 256 KiB.
async fn insert_oversized(client: &tokio_postgres::Client) {
    let payload = format!("{{\"n\": 99999, \"pad\": \"{}\"}}", "x".repeat(300 * 1024));
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'agg-big', 'Big', $1::text::jsonb)",
            &[&payload],
        )
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_reaches_a_fifo_queue_once_in_order_through_kills_and_an_outage() {
    let sqs = ElasticMq::start();
    let queue = create(&sqs, "orders.fifo");
    let dead = create(&sqs, "dead");
    let db = fresh_db().await;
    let client = init(&db).await;
    let start = || relay(&db, &sqs, &queue, Some(&dead));
    let first = start();
    wait_log(&first, "connected to SQS").await;
    let mut relay = write_through_kills(&db, first, start, 8_000).await;

    // The server frozen for 20 s while events keep coming, and walbox
    // killed meanwhile: what it had not confirmed must come again.
    sqs.freeze(true);
    insert_events(&client, 8_000, 9_000, |k| 1 + k % 50, AGGREGATES).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    // The stall is measured (and past 30 s would make /readyz say so).
    let addr = metrics_addr(&relay).await;
    let stalled = metric_at(&addr, "walbox_delivery_stalled_seconds");
    assert!(stalled >= 5.0, "stalled for {stalled} s");
    relay.kill9();
    relay = start();
    insert_events(&client, 9_000, TOTAL, |k| 1 + k % 50, AGGREGATES).await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    sqs.freeze(false);

    wait_count(&sqs, &queue, TOTAL).await;
    let got = read_all(&sqs, &queue, TOTAL).await;
    // Each aggregate's group, its first arrivals in commit order.
    let mut last: HashMap<String, usize> = HashMap::new();
    let mut seen = HashSet::new();
    // The deduplication id is the event's place in the stream: one per
    // event, the same on each copy of it.
    let mut dedup_of: HashMap<usize, String> = HashMap::new();
    for g in &got {
        let n = g.n();
        let key = g.attribute("walbox.key");
        assert_eq!(key, format!("agg-{}", n % AGGREGATES));
        assert_eq!(
            g.group.as_deref(),
            Some(key),
            "the message group is the key"
        );
        let dedup = g
            .dedup
            .clone()
            .expect("a FIFO message has its deduplication id");
        assert!(dedup.starts_with("walbox/"), "{dedup}");
        assert_eq!(
            dedup_of.entry(n).or_insert_with(|| dedup.clone()),
            &dedup,
            "one deduplication id per event"
        );
        assert_eq!(g.attribute("event_type"), format!("E{n}"));
        if seen.insert(n) {
            let prev = last.insert(key.to_owned(), n);
            assert!(prev.is_none_or(|p| p < n), "{key}: {n} after {prev:?}");
        }
    }
    let distinct: HashSet<&String> = dedup_of.values().collect();
    assert_eq!(distinct.len(), dedup_of.len(), "no two events share one");
    let duplicates = got.len() - TOTAL;
    eprintln!(
        "FIFO queue: {duplicates} duplicates after three kill -9s of walbox and the server's 20 s outage"
    );
    assert_eq!(duplicates, 0, "the deduplication ids drop every re-send");

    // An event larger than the queue takes: dead-lettered with the reason,
    // its body replaced by a note (the dead-letter queue's limit is the
    // same), never in the events' queue.
    insert_oversized(&client).await;
    let mut copies = Vec::new();
    wait_for("the dead-letter copy", Duration::from_secs(60), || {
        copies.extend(read(&sqs, &dead));
        let n = copies.len();
        async move {
            match n {
                0 => Err("none yet".to_owned()),
                _ => Ok(()),
            }
        }
    })
    .await;
    let copy = &copies[0];
    assert!(copy.body.contains("walbox.body_omitted"), "{}", copy.body);
    assert_eq!(copy.attribute("walbox.error.kind"), "refused");
    let why = copy.attribute("walbox.error");
    assert!(
        why.contains("the queue takes at most 262144 (its MaximumMessageSize)"),
        "{why}"
    );
    assert_eq!(copy.attribute("walbox.key"), "agg-big");

    // SIGTERM: everything confirmed, nothing sent again by the next start.
    let confirmed_before = confirmed(&client).await;
    let log = stop(&mut relay).await;
    assert!(
        !log.contains("walbox-secret-key"),
        "the secret key in the log"
    );
    assert!(read(&sqs, &queue).is_empty(), "the big event in the queue");
    let mut again = start();
    wait_log(&again, "streaming from the slot").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop(&mut again).await;
    let resent = read(&sqs, &queue);
    assert!(
        resent.is_empty(),
        "sent again after a SIGTERM: {}",
        resent.len()
    );
    assert!(lsn_le(&client, &confirmed_before, &confirmed(&client).await).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standard_queue_gets_every_event_and_an_oversized_one_stops_walbox_before_it() {
    let sqs = ElasticMq::start();
    let queue = create(&sqs, "orders");
    let db = fresh_db().await;
    let client = init(&db).await;
    let start = || relay(&db, &sqs, &queue, None);
    let first = start();
    // Said at the start: a standard queue keeps no order.
    wait_log(
        &first,
        "a standard SQS queue: events arrive in no particular order",
    )
    .await;
    let mut relay = write_through_kills(&db, first, start, TOTAL).await;

    wait_count(&sqs, &queue, TOTAL).await;
    let got = read_all(&sqs, &queue, TOTAL).await;
    for g in &got {
        assert_eq!(
            g.attribute("walbox.key"),
            format!("agg-{}", g.n() % AGGREGATES)
        );
        assert_eq!(g.group, None, "no message group on a standard queue");
    }
    eprintln!(
        "standard queue: {} duplicates after three kill -9s of walbox",
        got.len() - TOTAL
    );

    // An oversized event, then another: walbox stops before the first
    // (on_failure = stop), sends nothing after it, the slot stays before it.
    let held = confirmed(&client).await;
    insert_oversized(&client).await;
    insert_events(&client, TOTAL, TOTAL + 1, |_| 1, AGGREGATES).await;
    let status = exit_within(&mut relay, Duration::from_secs(60)).await;
    assert!(!status.success());
    let log = relay.log();
    assert!(
        log.contains("the queue takes at most 262144 (its MaximumMessageSize)"),
        "{log}"
    );
    assert!(lsn_le(&client, &held, &confirmed(&client).await).await);
    // The slot still holds it: its change is what decoding gives next.
    let held_back: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('walbox', NULL, NULL,
                 'proto_version', '1', 'publication_names', 'walbox_outbox')
              WHERE position('agg-big'::bytea IN data) > 0",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held_back, 1, "confirmed past the oversized event");
    let after = read(&sqs, &queue);
    assert!(
        after.iter().all(|g| g.n() != TOTAL),
        "the event after the refused one was sent"
    );

    // A queue that is not there: one line at the start, no retrying, no
    // secret shown.
    let missing = queue.replace("/orders", "/no-such-queue");
    let mut relay = self::relay(&db, &sqs, &missing, None);
    let status = exit_within(&mut relay, Duration::from_secs(60)).await;
    assert!(!status.success());
    let log = relay.log();
    let line = log
        .lines()
        .find(|l| l.starts_with("walbox: SQS queue") && l.contains("no-such-queue"))
        .unwrap_or_else(|| panic!("no error line naming the queue:\n{log}"));
    assert!(
        line.contains("NonExistentQueue") || line.contains("QueueDoesNotExist"),
        "{line}"
    );
    assert!(!log.contains("walbox-secret-key"), "{log}");
}

/// A heal and a resync republish to SQS, the configured broker, read back
/// by boto3 (see `republish.rs`). On a FIFO queue the resync's copies are
/// stored although the first ones are within the deduplication window:
/// a republished row has a place of its own (the backfill's), not the
/// streamed event's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_and_a_resync_republish_to_sqs() {
    let sqs = ElasticMq::start();
    let queue = create(&sqs, "republished.fifo");
    let db = fresh_db().await;
    let client = init(&db).await;
    let endpoint = sqs.endpoint();
    let command = |args: &[&str]| {
        let mut c = walbox(&db, args);
        c.args([
            "--sink",
            "sqs",
            "--sqs-queue-url",
            &queue,
            "--sqs-endpoint",
            &endpoint,
        ])
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "walbox-secret-key")
        .env("AWS_REGION", "us-east-1")
        .env_remove("AWS_PROFILE");
        c
    };
    let read = || read(&sqs, &queue).iter().map(Got::n).collect();
    crate::republish::heal_then_resync(&client, command, read).await;
}

/// `on_failure = "quarantine"` on a FIFO queue: five events of `agg-big`
/// too large for the queue are held, in order, with the three small ones
/// written behind them, while 36 other aggregates flow and the slot passes
/// them; fixed with SQL (the held values made small), `walbox quarantine
/// release` sends the aggregate's eight events in order, in its message
/// group, before its newer ones. Read back by boto3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_events_are_held_in_their_group_fixed_with_sql_and_released_in_order() {
    const FLOWING: usize = 1_000;
    let sqs = ElasticMq::start();
    let queue = create(&sqs, "held.fifo");
    let db = fresh_db().await;
    let client = init(&db).await;
    let mut relay = relay_with(&db, &sqs, &queue, &["--on-failure", "quarantine"]);
    wait_log(&relay, "streaming from the slot").await;
    // agg-big's events n = 100_000.. are oversized, between the others.
    let big = |n: usize| {
        let client = &client;
        async move {
            let payload = format!("{{\"n\": {n}, \"pad\": \"{}\"}}", "x".repeat(300 * 1024));
            client
                .execute(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', 'agg-big', 'Big', $1::text::jsonb)",
                    &[&payload],
                )
                .await
                .unwrap();
        }
    };
    for chunk in 0..5 {
        insert_events(
            &client,
            chunk * 200,
            chunk * 200 + 200,
            |k| 1 + k % 20,
            AGGREGATES - 1,
        )
        .await;
        big(100_000 + chunk).await;
    }
    let written = walbox_test_harness::slot::current_wal_lsn(&client).await;
    let got = read_all(&sqs, &queue, FLOWING).await;
    assert!(
        got.iter().all(|g| g.n() < FLOWING),
        "an oversized event was sent"
    );
    walbox_test_harness::slot::wait_confirmed_at_least(
        &client,
        "walbox",
        written,
        Duration::from_secs(60),
    )
    .await;
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&quarantine(&db, &["list", "--json"])).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["key"], "agg-big");
    assert_eq!(listed[0]["events"], 5);
    let error = listed[0]["error"].as_str().unwrap();
    assert!(error.contains("(its MaximumMessageSize)"), "{error}");

    // Three small events of agg-big join them, behind.
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES
               ('order', 'agg-big', 'Small', '{\"n\": 100005}'),
               ('order', 'agg-big', 'Small', '{\"n\": 100006}'),
               ('order', 'agg-big', 'Small', '{\"n\": 100007}')",
        )
        .await
        .unwrap();
    wait_for("the small events held", Duration::from_secs(30), || {
        let listed: Vec<serde_json::Value> =
            serde_json::from_str(&quarantine(&db, &["list", "--json"])).unwrap();
        async move {
            match listed.first().map(|l| l["events"].clone()) {
                Some(n) if n == 8 => Ok(()),
                other => Err(format!("{other:?} held")),
            }
        }
    })
    .await;
    // The fix: each oversized value cut to its number.
    let fixed = client
        .execute(
            "UPDATE walbox.quarantine \
             SET value = convert_to(jsonb_build_object('n', (convert_from(value, 'UTF8')::jsonb->>'n')::int8, 'fixed', true)::text, 'UTF8') \
             WHERE slot = 'walbox' AND length(value) > 262144",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(fixed, 5);
    quarantine(&db, &["release", "agg-big"]);
    let listed = quarantine(&db, &["list"]);
    assert!(listed.contains("nothing held"), "{listed}");
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) VALUES
               ('order', 'agg-big', 'Small', '{\"n\": 100008}')",
        )
        .await
        .unwrap();
    let mut big_events: Vec<Got> = Vec::new();
    wait_for("agg-big's nine events", Duration::from_secs(60), || {
        big_events.extend(read(&sqs, &queue));
        let n = big_events.len();
        async move {
            match n {
                9 => Ok(()),
                n => Err(format!("{n} of 9")),
            }
        }
    })
    .await;
    let order: Vec<usize> = big_events.iter().map(Got::n).collect();
    assert_eq!(
        order,
        (100_000..100_009).collect::<Vec<_>>(),
        "in order, once"
    );
    for g in &big_events {
        assert_eq!(g.group.as_deref(), Some("agg-big"));
    }
    assert!(big_events[..5]
        .iter()
        .all(|g| g.body.contains("\"fixed\": true")));
    stop(&mut relay).await;
}

/// `walbox doctor` with `sink = "sqs"`: a standard queue is a warning, a
/// payload in the outbox over the queue's MaximumMessageSize a failure,
/// both said with the fix; a FIFO queue with every payload fitting
/// passes; a queue that is not there fails; the secret key in no output.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_reads_the_queue_and_weighs_the_largest_payload() {
    let sqs = ElasticMq::start();
    let standard = create(&sqs, "doctor");
    let fifo = create(&sqs, "doctor.fifo");
    let db = fresh_db().await;
    let client = init(&db).await;
    insert_oversized(&client).await;
    let endpoint = sqs.endpoint();
    let doctor = |queue: &str| {
        let out = walbox(&db, &["doctor", "--json", "--sink", "sqs"])
            .args(["--sqs-queue-url", queue, "--sqs-endpoint", &endpoint])
            .env("AWS_ACCESS_KEY_ID", "testing")
            .env("AWS_SECRET_ACCESS_KEY", "walbox-secret-key")
            .env("AWS_REGION", "us-east-1")
            .env_remove("AWS_PROFILE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let (checks, stdout) = crate::support::doctor_checks(&out, "sqs.");
        assert!(!stdout.contains("walbox-secret-key") && !stderr.contains("walbox-secret-key"));
        checks
            .into_iter()
            .map(|(check, verdict, _)| (check, verdict))
            .collect::<std::collections::BTreeMap<String, String>>()
    };
    let verdicts = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(c, v)| (c.to_string(), v.to_string()))
            .collect::<std::collections::BTreeMap<String, String>>()
    };
    let on_standard = tokio::task::block_in_place(|| doctor(&standard));
    assert_eq!(
        on_standard,
        verdicts(&[
            ("sqs.queue", "warn"),
            ("sqs.max_message_size", "fail"),
            ("sqs.permissions", "info"),
        ])
    );
    client
        .execute(
            "DELETE FROM outbox_events WHERE aggregate_id = 'agg-big'",
            &[],
        )
        .await
        .unwrap();
    let on_fifo = tokio::task::block_in_place(|| doctor(&fifo));
    assert_eq!(
        on_fifo,
        verdicts(&[("sqs.queue", "pass"), ("sqs.permissions", "info"),])
    );
    let absent = format!("{}-absent", standard.trim_end_matches('/'));
    let on_absent = tokio::task::block_in_place(|| doctor(&absent));
    assert_eq!(on_absent, verdicts(&[("sqs.queue", "fail")]));
}
