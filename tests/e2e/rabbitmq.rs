//! `sink = "rabbitmq"` against a real RabbitMQ (Debian's rabbitmq-server,
//! run by the harness as a plain process), the queues declared and read
//! back by Python's pika, not by walbox's client: 10,000 events in
//! transactions of 1 to 50 over four routing partitions through three
//! kill -9s of walbox and the broker killed for 20 s (walbox killed too
//! meanwhile): every event there, each aggregate on one queue with its
//! first arrivals in commit order; an unroutable event dead-lettered with
//! the reason; a SIGTERM leaving nothing to send twice.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::rabbitmq::RabbitMq;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

const TOTAL: usize = 10_000;
const PARTITIONS: usize = 4;
const DEAD: &str = "walbox.dead";

pub(crate) fn pika() -> String {
    python_with("WALBOX_PIKA_PYTHON", "pika", "pika==1.3.2")
}

/// A message as pika read it.
#[derive(Debug)]
pub(crate) struct Got {
    pub(crate) queue: String,
    pub(crate) routing_key: String,
    pub(crate) message_id: Option<String>,
    pub(crate) headers: HashMap<String, serde_json::Value>,
    /// The body as text ("" when it is not UTF-8).
    pub(crate) body: String,
    /// The body's bytes, hex.
    pub(crate) body_hex: String,
    pub(crate) delivery_mode: Option<u8>,
}

/// Declares each queue (durable) and binds it to exchange `walbox` with
/// its routing key, by pika.
pub(crate) fn bind(broker: &RabbitMq, queues: &[(&str, &str)]) {
    let queues: HashMap<&str, &str> = queues.iter().copied().collect();
    run_tool(
        &pika(),
        "amqp_queues.py",
        &["bind", &broker.url(), "walbox"],
        &serde_json::to_string(&queues).unwrap(),
    );
}

/// Every message of `queues`, taken off them by pika.
pub(crate) fn read(broker: &RabbitMq, queues: &[String]) -> Vec<Got> {
    let out = run_tool(
        &pika(),
        "amqp_queues.py",
        &["read", &broker.url()],
        &serde_json::to_string(queues).unwrap(),
    );
    let all: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap();
    all.into_iter()
        .map(|m| Got {
            queue: m["queue"].as_str().unwrap().to_owned(),
            routing_key: m["routing_key"].as_str().unwrap().to_owned(),
            message_id: m["message_id"].as_str().map(str::to_owned),
            headers: m["headers"]
                .as_object()
                .map(|h| h.clone().into_iter().collect())
                .unwrap_or_default(),
            body: m["body"].as_str().unwrap_or_default().to_owned(),
            body_hex: m["body_hex"].as_str().unwrap().to_owned(),
            delivery_mode: m["delivery_mode"].as_u64().map(|d| d as u8),
        })
        .collect()
}

fn n_of(g: &Got) -> usize {
    let v: serde_json::Value = serde_json::from_str(&g.body).unwrap();
    v["n"].as_u64().unwrap() as usize
}

/// `walbox run` to the broker over four partitions, dead letters to
/// [`DEAD`].
fn relay(db: &walbox_test_harness::pg::TestDb, broker: &RabbitMq) -> Relay {
    let url = broker.url();
    let parts = PARTITIONS.to_string();
    spawn_logged(walbox(
        db,
        &[
            "run",
            "--sink",
            "rabbitmq",
            "--rabbitmq-url",
            &url,
            "--rabbitmq-partitions",
            &parts,
            "--dead-letter-topic",
            DEAD,
        ],
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_reaches_rabbitmq_in_order_through_kills_and_a_broker_outage() {
    let mut broker = RabbitMq::start();
    let mut queues: HashMap<String, String> = (0..PARTITIONS)
        .map(|p| (format!("orders.{p}"), format!("outbox.event.order.{p}")))
        .collect();
    // Dead letters are routed by partition too: <dead_letter_topic>.<n>.
    queues.insert("dead".into(), format!("{DEAD}.*"));
    run_tool(
        &pika(),
        "amqp_queues.py",
        &["bind", &broker.url(), "walbox"],
        &serde_json::to_string(&queues).unwrap(),
    );
    let db = fresh_db().await;
    let client = init(&db).await;
    let mut relay = relay(&db, &broker);
    wait_log(&relay, "connected to RabbitMQ").await;

    // Transactions of 1 to 50 events, three kill -9s of walbox meanwhile.
    let writer = spawn_writer(
        db.connect().await,
        20,
        400,
        Duration::from_millis(150),
        |chunk, k| 1 + (chunk * 7 + k * 13) % 50,
        37,
    );
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(700)).await;
        relay.kill9();
        relay = self::relay(&db, &broker);
    }
    writer.await.unwrap();

    // The broker killed for 20 s while events keep coming, and walbox
    // killed meanwhile: what it had not confirmed must come again.
    broker.kill9();
    insert_events(&client, 8_000, 9_000, |k| 1 + k % 50, 37).await;
    tokio::time::sleep(Duration::from_secs(8)).await;
    relay.kill9();
    relay = self::relay(&db, &broker);
    insert_events(&client, 9_000, TOTAL, |k| 1 + k % 50, 37).await;
    tokio::time::sleep(Duration::from_secs(12)).await;
    broker.restart();

    let names: Vec<String> = (0..PARTITIONS).map(|p| format!("orders.{p}")).collect();
    let mut got: Vec<Got> = Vec::new();
    wait_for(
        "every event in the queues",
        Duration::from_secs(120),
        || {
            got.extend(read(&broker, &names));
            let distinct: HashSet<usize> = got.iter().map(n_of).collect();
            let n = distinct.len();
            async move {
                match n {
                    TOTAL => Ok(()),
                    n => Err(format!("{n} of {TOTAL} distinct events")),
                }
            }
        },
    )
    .await;
    // Each aggregate on one queue, its first arrivals in commit order.
    let mut queue_of: HashMap<String, String> = HashMap::new();
    let mut last: HashMap<String, usize> = HashMap::new();
    let mut seen = HashSet::new();
    for g in &got {
        let n = n_of(g);
        let key = g.headers["walbox.key"].as_str().unwrap().to_owned();
        assert_eq!(key, format!("agg-{}", n % 37));
        assert_eq!(
            g.message_id.as_deref(),
            g.headers["id"].as_str(),
            "message_id is the event id"
        );
        assert_eq!(g.headers["event_type"], format!("E{n}"));
        assert_eq!(g.delivery_mode, Some(2), "persistent");
        let first = queue_of
            .entry(key.clone())
            .or_insert_with(|| g.queue.clone());
        assert_eq!(*first, g.queue, "{key} stays on one queue");
        assert!(g.routing_key.ends_with(&g.queue[g.queue.len() - 2..]));
        if seen.insert(n) {
            let prev = last.insert(key.clone(), n);
            assert!(prev.is_none_or(|p| p < n), "{key}: {n} after {prev:?}");
        }
    }
    let used: HashSet<&String> = queue_of.values().collect();
    assert_eq!(used.len(), PARTITIONS, "37 aggregates over every partition");
    eprintln!(
        "{} duplicates after three kill -9s of walbox and the broker's 20 s outage",
        got.len() - TOTAL
    );

    // An event no queue is bound for: dead-lettered with the reason.
    client
        .batch_execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('nobody', 'agg-x', 'Lost', '{\"n\": 99999}')",
        )
        .await
        .unwrap();
    let dead = vec!["dead".to_owned()];
    let mut copies = Vec::new();
    wait_for("the dead-letter copy", Duration::from_secs(60), || {
        copies.extend(read(&broker, &dead));
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
    assert_eq!(copy.body, "{\"n\": 99999}");
    let why = copy.headers["walbox.error"].as_str().unwrap();
    assert!(
        why.contains("returned the message as unroutable (312 NO_ROUTE)"),
        "{why}"
    );

    // SIGTERM: everything confirmed, nothing sent again by the next start.
    let confirmed_before = confirmed(&client).await;
    let log = stop(&mut relay).await;
    assert!(
        !log.contains("guest:guest"),
        "the URL's password in the log"
    );
    read(&broker, &names);
    let mut again = self::relay(&db, &broker);
    wait_log(&again, "streaming from the slot").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop(&mut again).await;
    let resent = read(&broker, &names);
    assert!(
        resent.is_empty(),
        "sent again after a SIGTERM: {}",
        resent.len()
    );
    assert!(lsn_le(&client, &confirmed_before, &confirmed(&client).await).await);
}

/// A heal and a resync republish to RabbitMQ, the configured broker, read
/// back by pika (see `republish.rs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_and_a_resync_republish_to_rabbitmq() {
    let broker = RabbitMq::start();
    let url = broker.url();
    let queues: HashMap<String, String> = [("all".to_owned(), "outbox.event.#".to_owned())].into();
    run_tool(
        &pika(),
        "amqp_queues.py",
        &["bind", &url, "walbox"],
        &serde_json::to_string(&queues).unwrap(),
    );
    let db = fresh_db().await;
    let client = init(&db).await;
    let command = |args: &[&str]| {
        let mut c = walbox(&db, args);
        c.args(["--sink", "rabbitmq", "--rabbitmq-url", &url]);
        c
    };
    let read = || {
        read(&broker, &["all".to_owned()])
            .iter()
            .map(n_of)
            .collect()
    };
    crate::republish::heal_then_resync(&client, command, read).await;
}

/// `amqps://` to a broker that requires a client certificate (a CA the
/// test makes), the password in a file of its own
/// (`WALBOX_RABBITMQ_PASSWORD_FILE`): 2,000 events through a kill -9 of
/// walbox, every one read back by pika, each aggregate's first arrivals in
/// commit order; the password in no output; no plain-text warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walbox_streams_to_rabbitmq_over_tls_with_a_client_certificate() {
    const PASSWORD: &str = "Rabbit-S3cret-9";
    const EVENTS: usize = 2_000;
    let certs = walbox_test_harness::tls::Certificates::generate();
    let broker = RabbitMq::start_with_tls(&certs);
    for args in [
        &["add_user", "walbox", PASSWORD][..],
        &["set_permissions", "-p", "/", "walbox", ".*", ".*", ".*"],
    ] {
        let out = broker.ctl(args);
        assert!(out.status.success(), "rabbitmqctl {args:?}: {out:?}");
    }
    let queues: HashMap<String, String> = [("all".to_owned(), "outbox.event.#".to_owned())].into();
    run_tool(
        &pika(),
        "amqp_queues.py",
        &["bind", &broker.url(), "walbox"],
        &serde_json::to_string(&queues).unwrap(),
    );
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("password");
    walbox_test_harness::secret_file::write(&password_file, PASSWORD);
    let db = fresh_db().await;
    let client = init(&db).await;
    let url = format!("amqps://walbox@localhost:{}/%2F", broker.tls_port());
    let relay = || {
        let mut c = walbox(&db, &["run"]);
        c.env("WALBOX_SINK", "rabbitmq")
            .env("WALBOX_RABBITMQ_URL", &url)
            .env("WALBOX_RABBITMQ_PASSWORD_FILE", &password_file)
            .env("WALBOX_RABBITMQ_CA_FILE", certs.ca())
            .env("WALBOX_RABBITMQ_CERT_FILE", certs.client_cert())
            .env("WALBOX_RABBITMQ_KEY_FILE", certs.client_key_plain());
        spawn_logged(c)
    };
    let mut walbox_run = relay();
    wait_log(&walbox_run, "connected to RabbitMQ").await;
    insert_events(&client, 0, EVENTS / 2, |k| 1 + k % 20, 11).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let first_log = walbox_run.log();
    walbox_run.kill9();
    insert_events(&client, EVENTS / 2, EVENTS, |k| 1 + k % 20, 11).await;
    walbox_run = relay();

    let all = vec!["all".to_owned()];
    let mut got: Vec<Got> = Vec::new();
    wait_for("every event over TLS", Duration::from_secs(90), || {
        got.extend(read(&broker, &all));
        let n = got.iter().map(n_of).collect::<HashSet<_>>().len();
        async move {
            match n {
                EVENTS => Ok(()),
                n => Err(format!("{n} of {EVENTS} distinct events")),
            }
        }
    })
    .await;
    let mut last: HashMap<String, usize> = HashMap::new();
    let mut seen = HashSet::new();
    for g in &got {
        let n = n_of(g);
        let key = g.headers["walbox.key"].as_str().unwrap().to_owned();
        assert_eq!(key, format!("agg-{}", n % 11));
        if seen.insert(n) {
            let prev = last.insert(key.clone(), n);
            assert!(prev.is_none_or(|p| p < n), "{key}: {n} after {prev:?}");
        }
    }
    let log = format!("{first_log}{}", stop(&mut walbox_run).await);
    assert!(log.contains("connected to RabbitMQ"), "{log}");
    assert!(log.contains("amqps://walbox@localhost"), "{log}");
    assert!(!log.contains(PASSWORD), "the password in the log: {log}");
    assert!(!log.contains("no TLS"), "{log}");
    eprintln!(
        "{} duplicates after a kill -9 of walbox over amqps://",
        got.len() - EVENTS
    );

    // `walbox config` shows the TLS settings, never the password.
    let out = walbox(&db, &["config"])
        .env("WALBOX_SINK", "rabbitmq")
        .env("WALBOX_RABBITMQ_URL", &url)
        .env("WALBOX_RABBITMQ_PASSWORD_FILE", &password_file)
        .env("WALBOX_RABBITMQ_CA_FILE", certs.ca())
        .output()
        .unwrap();
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{shown}");
    assert!(shown.contains("rabbitmq.ca_file"), "{shown}");
    assert!(!shown.contains(PASSWORD), "{shown}");
    // A CA that did not sign the broker's certificate: one line, exit 1,
    // not a crash loop of retries.
    let out = walbox(&db, &["run"])
        .env("WALBOX_SINK", "rabbitmq")
        .env("WALBOX_RABBITMQ_URL", &url)
        .env("WALBOX_RABBITMQ_PASSWORD_FILE", &password_file)
        .env("WALBOX_RABBITMQ_CA_FILE", certs.other_ca())
        .env("WALBOX_RABBITMQ_CERT_FILE", certs.client_cert())
        .env("WALBOX_RABBITMQ_KEY_FILE", certs.client_key_plain())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("not trusted or not for this host"),
        "{stderr}"
    );
    assert!(!stderr.contains(PASSWORD), "{stderr}");
}

/// `on_failure = "quarantine"` on RabbitMQ: the events of two invoice
/// aggregates are returned (no queue is bound for `outbox.event.invoice`)
/// and held in `walbox.quarantine`, in order, while twenty order
/// aggregates flow and the slot passes them; a release before the fix
/// fails and leaves them held; once a queue is bound, `walbox quarantine
/// release` republishes each in order before its newer events, one release
/// interrupted by kill -9 after RabbitMQ confirmed it. Read back by pika.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returned_events_are_held_while_the_rest_flow_and_released_in_order() {
    const EVENTS: i64 = 2_000;
    let broker = RabbitMq::start();
    let url = broker.url();
    let bind = |queue: &str, key: &str| {
        let queues: HashMap<String, String> = [(queue.to_owned(), key.to_owned())].into();
        run_tool(
            &pika(),
            "amqp_queues.py",
            &["bind", &url, "walbox"],
            &serde_json::to_string(&queues).unwrap(),
        );
    };
    bind("orders", "outbox.event.order");
    let db = fresh_db().await;
    let client = init(&db).await;
    let flags = [
        "run",
        "--sink",
        "rabbitmq",
        "--rabbitmq-url",
        &url,
        "--on-failure",
        "quarantine",
    ];
    let start = |pause: Option<&str>| {
        let mut c = walbox(&db, &flags);
        if let Some(at) = pause {
            c.env("WALBOX_TEST_PAUSE_AT", at);
        }
        spawn_logged(c)
    };
    // Every tenth event an invoice, of inv-0 or inv-1; the rest orders.
    let insert = |from: i64, to: i64| {
        let client = &client;
        async move {
            client
                .execute(
                    "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload) \
                     SELECT CASE WHEN n % 10 = 0 THEN 'invoice' ELSE 'order' END, \
                            CASE WHEN n % 10 = 0 THEN 'inv-' || (n / 10 % 2) ELSE 'agg-' || (n % 20) END, \
                            'E' || n, jsonb_build_object('n', n) \
                     FROM generate_series($1::int8, $2::int8 - 1) n",
                    &[&from, &to],
                )
                .await
                .unwrap();
        }
    };
    let mut relay = start(None);
    wait_log(&relay, "streaming from the slot").await;
    insert(0, EVENTS).await;
    let written = walbox_test_harness::slot::current_wal_lsn(&client).await;

    let orders = vec!["orders".to_owned()];
    let flowing = (EVENTS - EVENTS / 10) as usize;
    let mut got: Vec<Got> = Vec::new();
    wait_for("the orders", Duration::from_secs(90), || {
        got.extend(read(&broker, &orders));
        let n = got.iter().map(n_of).collect::<HashSet<_>>().len();
        async move {
            match n == flowing {
                true => Ok(()),
                false => Err(format!("{n} of {flowing}")),
            }
        }
    })
    .await;
    assert!(got.iter().all(|g| n_of(g) % 10 != 0), "an invoice flowed");
    walbox_test_harness::slot::wait_confirmed_at_least(
        &client,
        "walbox",
        written,
        Duration::from_secs(60),
    )
    .await;
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&quarantine(&db, &["list", "--json"])).unwrap();
    let mut keys: Vec<&str> = listed.iter().map(|l| l["key"].as_str().unwrap()).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["inv-0", "inv-1"], "{listed:?}");
    for l in &listed {
        assert_eq!(l["events"], EVENTS / 20, "{l}");
        let error = l["error"].as_str().unwrap();
        assert!(error.contains("unroutable (312 NO_ROUTE)"), "{error}");
    }

    // Newer invoices join them; a release before the fix fails.
    insert(EVENTS, EVENTS + 200).await;
    let out = walbox(&db, &["quarantine", "release", "inv-0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("release of \"inv-0\" failed"), "{stderr}");

    // The fix: a queue for the invoices. inv-0 released and waited for;
    // inv-1's release killed -9 once RabbitMQ confirmed its batch, before
    // its rows were deleted, then done by the next start.
    bind("invoices", "outbox.event.invoice");
    quarantine(&db, &["release", "inv-0"]);
    stop(&mut relay).await;
    relay = start(Some("quarantine.acked"));
    quarantine(&db, &["release", "inv-1", "--wait", "0"]);
    wait_log(&relay, "paused at test point quarantine.acked").await;
    relay.kill9();
    relay = start(None);
    quarantine(&db, &["release", "inv-1"]);
    let listed = quarantine(&db, &["list"]);
    assert!(listed.contains("nothing held"), "{listed}");

    // They flow again, after their held events.
    insert(EVENTS + 200, EVENTS + 400).await;
    let invoices = vec!["invoices".to_owned()];
    let total = ((EVENTS + 400) / 10) as usize;
    let mut inv: Vec<Got> = Vec::new();
    wait_for("every invoice", Duration::from_secs(90), || {
        inv.extend(read(&broker, &invoices));
        let n = inv.iter().map(n_of).collect::<HashSet<_>>().len();
        async move {
            match n == total {
                true => Ok(()),
                false => Err(format!("{n} of {total}")),
            }
        }
    })
    .await;
    for key in ["inv-0", "inv-1"] {
        let mut firsts = Vec::new();
        for g in inv.iter().filter(|g| g.headers["walbox.key"] == key) {
            if !firsts.contains(&n_of(g)) {
                firsts.push(n_of(g));
            }
        }
        assert!(firsts.windows(2).all(|w| w[0] < w[1]), "{key}: {firsts:?}");
        assert_eq!(firsts.len(), total / 2, "{key}");
    }
    let twice = inv.len() - total;
    eprintln!("{twice} invoices twice (inv-1's release interrupted by kill -9)");
    assert_eq!(
        twice,
        (EVENTS / 20 + 10) as usize,
        "inv-1's batch (its 100 held events and the 10 behind them) twice, nothing else"
    );
    got.extend(read(&broker, &orders));
    let orders_seen = got.iter().map(n_of).collect::<HashSet<_>>().len();
    assert_eq!(orders_seen, (EVENTS + 400) as usize - total);
    stop(&mut relay).await;
}

/// `walbox audit` on RabbitMQ, through the audit stream walbox declares
/// and binds (`rabbitmq.audit_stream`): 1,000 events in transactions of 1
/// to 30, then one of 30,000 during which walbox is killed with SIGKILL,
/// read back by pika off the user's queue; the audit, reading the stream
/// without consuming, counts every
/// row delivered, nothing missing or out of order, and exactly the
/// duplicates pika saw, plus one copy the test publishes by pika.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_reads_the_audit_stream_and_counts_what_pika_counts() {
    use crate::audit::{audit_report, count, wait_caught_up};
    const N: usize = 31_000;
    let broker = RabbitMq::start();
    bind(&broker, &[("orders", "outbox.event.order")]);
    let db = fresh_db().await;
    let client = init(&db).await;
    let url = broker.url();
    let flags = [
        "--sink",
        "rabbitmq",
        "--rabbitmq-url",
        url.as_str(),
        "--rabbitmq-audit-stream",
        "walbox.audit",
    ];
    // Before walbox declared the stream: said in one line, exit 3.
    let out = walbox(&db, &["audit", "--last", "1h"])
        .args(flags)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("\"walbox.audit\" is not there"), "{stderr}");
    assert!(!stderr.contains("guest:guest"), "{stderr}");

    let start = || spawn_logged(walbox(&db, &[&["run"][..], &flags[..]].concat()));
    let mut relay = start();
    wait_log(&relay, "connected to RabbitMQ").await;
    // Small transactions, then one of 30,000 events killed half-way: the
    // broker confirmed part of it and the slot none, so that part comes
    // twice after the restart.
    insert_events(&client, 0, 1_000, |k| 1 + k % 30, 23).await;
    insert_events(&client, 1_000, N, |_| N, 23).await;
    // RabbitMQ takes ~16,000 messages/s here: a second after the commit
    // the transaction is on its way, and far from confirmed.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let queue = vec!["orders".to_owned()];
    let mut got: Vec<Got> = Vec::new();
    relay.kill9();
    let mut relay = start();
    wait_for("every event in the queue", Duration::from_secs(120), || {
        got.extend(read(&broker, &queue));
        let n = got.iter().map(n_of).collect::<HashSet<_>>().len();
        async move {
            match n {
                N => Ok(()),
                n => Err(format!("{n} of {N} distinct events")),
            }
        }
    })
    .await;
    wait_caught_up(&client).await;
    stop(&mut relay).await;
    got.extend(read(&broker, &queue));
    let seen_twice = got.len() - N;

    // A copy of one event, published by pika as a consumer's bug would.
    let copied = &got[100];
    run_tool(
        &pika(),
        "amqp_queues.py",
        &["publish", &url, "walbox"],
        &serde_json::json!({
            "routing_key": "outbox.event.order",
            "headers": copied.headers,
            "body": copied.body,
        })
        .to_string(),
    );

    let (out, report) = audit_report(&db, &flags);
    assert_eq!(count(&report, "rows"), N as u64, "{report:#}");
    assert_eq!(count(&report, "delivered"), N as u64, "{report:#}");
    for clean in ["missing", "out_of_order", "misrouted", "unconfirmed"] {
        assert_eq!(count(&report, clean), 0, "{clean}: {report:#}");
    }
    assert_eq!(
        count(&report, "duplicates"),
        seen_twice as u64 + 1,
        "pika saw {seen_twice} twice: {report:#}"
    );
    assert_eq!(out.status.code(), Some(1));
    // The stream still holds everything, and the user's queue got nothing
    // from the audit's reads but the test's copy.
    let (_, again) = audit_report(&db, &flags);
    assert_eq!(count(&again, "delivered"), N as u64, "{again:#}");
    assert_eq!(read(&broker, &queue).len(), 1);
    assert!(seen_twice > 0, "the kill -9 left copies to count");
    eprintln!("audit on RabbitMQ: {seen_twice} duplicates after a kill -9, as pika counted");
}

/// `walbox doctor` with `sink = "rabbitmq"`: the exchange is looked up
/// passively — missing and declared by `run` (info), missing and not
/// (fail, with the declaration), there (pass) — and doctor itself never
/// declares it; a wrong password fails in one line without showing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_looks_the_exchange_up_without_declaring_it() {
    let broker = RabbitMq::start();
    let url = broker.url();
    let db = fresh_db().await;
    init(&db).await;
    let exchange = walbox_test_harness::unique_name("doctor");
    let doctor = |url: &str, declare: &str| {
        let out = walbox(&db, &["doctor", "--json"])
            .args(["--sink", "rabbitmq", "--rabbitmq-url", url])
            .args(["--rabbitmq-exchange", &exchange])
            .args(["--rabbitmq-declare-exchange", declare])
            .output()
            .unwrap();
        doctor_checks(&out, "rabbitmq.")
    };
    let verdict = |found: &[DoctorCheck], check: &str| {
        verdicts_of(found, check)
            .first()
            .cloned()
            .unwrap_or_default()
    };
    let (missing_declared, _) = tokio::task::block_in_place(|| doctor(&url, "true"));
    assert_eq!(verdict(&missing_declared, "rabbitmq.connect"), "pass");
    assert_eq!(
        verdict(&missing_declared, "rabbitmq.exchange"),
        "info",
        "{missing_declared:?}"
    );
    // Doctor did not declare it.
    let (missing, _) = tokio::task::block_in_place(|| doctor(&url, "false"));
    assert_eq!(
        verdict(&missing, "rabbitmq.exchange"),
        "fail",
        "{missing:?}"
    );
    assert!(
        missing[1].2.contains("rabbitmqadmin declare exchange"),
        "{missing:?}"
    );
    // walbox run declares it; doctor then finds it.
    let mut relay = spawn_logged({
        let mut c = walbox(&db, &["run"]);
        c.args(["--sink", "rabbitmq", "--rabbitmq-url", &url])
            .args(["--rabbitmq-exchange", &exchange]);
        c
    });
    wait_log(&relay, "connected to RabbitMQ").await;
    stop(&mut relay).await;
    let (there, _) = tokio::task::block_in_place(|| doctor(&url, "false"));
    assert_eq!(verdict(&there, "rabbitmq.exchange"), "pass", "{there:?}");
    let wrong = url.replacen("guest:guest", "guest:not-the-password", 1);
    assert_ne!(wrong, url, "the harness URL carries guest:guest");
    let (refused, stdout) = tokio::task::block_in_place(|| doctor(&wrong, "false"));
    assert_eq!(verdict(&refused, "rabbitmq.connect"), "fail", "{refused:?}");
    assert!(!stdout.contains("not-the-password"), "{stdout}");
}
