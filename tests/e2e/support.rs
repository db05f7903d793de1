//! What the end-to-end tests share: running the `walbox` binary against a
//! test database, writing events, and reading them back.

use std::collections::{HashMap, HashSet};
use std::process::Command;
use std::time::Duration;

use rdkafka::message::Message;
use tokio_postgres::Client;
use walbox_test_harness::kafka::{consume_until_quiet, TestKafka};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{PgServer, TestDb};
use walbox_test_harness::wait::wait_for;

pub(crate) fn walbox(db: &TestDb, args: &[&str]) -> Command {
    let mut c = Command::new(walbox_e2e::walbox_bin());
    c.args(args)
        .env(
            "WALBOX_PG_URL",
            format!("{} sslmode=disable", db.conninfo()),
        )
        .env("WALBOX_LOG", "info");
    c
}

/// A running walbox command, logging to a file that can be read while it
/// runs: the harness's handle, shared with the torture suite.
pub(crate) type Relay = walbox_test_harness::walbox_process::WalboxProcess;

pub(crate) fn spawn_run(db: &TestDb, kafka: &TestKafka, extra: &[&str]) -> Relay {
    spawn_run_with(walbox(db, &[]), kafka, extra)
}

/// `walbox run` publishing every event to `topic`, serving its metrics on
/// a free local port; returns the relay and that endpoint's address.
pub(crate) async fn spawn_run_watched(
    db: &TestDb,
    kafka: &TestKafka,
    topic: &str,
) -> (Relay, String) {
    let relay = spawn_run(
        db,
        kafka,
        &[
            "--mapping-topic-template",
            topic,
            "--metrics-addr",
            ANY_PORT,
        ],
    );
    let addr = metrics_addr(&relay).await;
    (relay, addr)
}

/// `--metrics-addr` for a relay whose endpoint [`metrics_addr`] then finds:
/// walbox binds port 0 itself and logs the port it got. (A port picked free
/// beforehand can be taken by anyone's outgoing connection before walbox
/// binds it.)
pub(crate) const ANY_PORT: &str = "127.0.0.1:0";

/// The address a relay started with `--metrics-addr` [`ANY_PORT`] serves
/// its metrics on, from its log's "serving /metrics" line.
pub(crate) async fn metrics_addr(relay: &Relay) -> String {
    let line = wait_log(relay, "serving /metrics").await;
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("addr="))
        .unwrap_or_else(|| panic!("no addr= in {line:?}"))
        .to_owned()
}

pub(crate) fn spawn_run_with(mut command: Command, kafka: &TestKafka, extra: &[&str]) -> Relay {
    command
        .args(["run", "--kafka-brokers", &kafka.bootstrap()])
        .args(extra);
    spawn_logged(command)
}

/// Starts a walbox command (any subcommand, its arguments given), logging
/// to a file that can be read while it runs.
pub(crate) fn spawn_logged(command: Command) -> Relay {
    Relay::spawn(command)
}

/// Asserts that a command succeeded (showing its output otherwise) and
/// returns its stdout.
pub(crate) fn succeeded(out: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}: {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// SIGTERM, then asserts a clean exit (showing the log otherwise); returns
/// the log.
pub(crate) async fn stop(relay: &mut Relay) -> String {
    sigterm(relay);
    let (status, log) = wait_exit(relay).await;
    assert!(status.success(), "{log}");
    log
}

pub(crate) fn signal(relay: &Relay, signal: &str) {
    assert!(relay.signal(signal), "could not send {signal}");
}

/// Kills walbox (`kill -9`) `times` times, each at a pseudo-random moment
/// `least_ms` to `least_ms + spread_ms` after the last start (xorshift from
/// `seed`, so a failure replays the same moments), restarting it with
/// `restart` each time; returns the last one, running.
pub(crate) async fn kill_9_at_random_moments(
    mut relay: Relay,
    times: usize,
    (least_ms, spread_ms): (u64, u64),
    mut seed: u64,
    restart: impl Fn() -> Relay,
) -> Relay {
    for _ in 0..times {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        tokio::time::sleep(Duration::from_millis(least_ms + seed % spread_ms)).await;
        relay.kill9();
        relay = restart();
    }
    relay
}

pub(crate) fn sigterm(relay: &Relay) {
    signal(relay, "-TERM");
}

pub(crate) async fn wait_exit(relay: &mut Relay) -> (std::process::ExitStatus, String) {
    let status = wait_for("walbox to exit", Duration::from_secs(40), || {
        // Still running: what it last said, for the timeout's message.
        let s = relay.try_exit().ok_or_else(|| {
            let log = relay.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(20)..].join("\n");
            format!("running; its log ends:\n{tail}")
        });
        async move { s }
    })
    .await;
    (status, relay.log())
}

/// An Apache Kafka cluster of `nodes` KRaft nodes (a few seconds each),
/// started off the async workers.
pub(crate) fn kafka_cluster(nodes: usize) -> walbox_test_harness::apache_kafka::KafkaCluster {
    tokio::task::block_in_place(|| walbox_test_harness::apache_kafka::KafkaCluster::start(nodes))
}

/// A local address nothing listens on now (for walbox's metrics, use
/// [`ANY_PORT`]).
pub(crate) fn free_addr() -> String {
    format!("127.0.0.1:{}", walbox_test_harness::port::free_port())
}

pub(crate) use walbox_test_harness::http::get as http_get;

/// The value of metric `name` (a line `name value`) on `/metrics` at `addr`.
pub(crate) fn metric_at(addr: &str, name: &str) -> f64 {
    let (_, body) = http_get(addr, "/metrics").expect("/metrics answers");
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} in {body}"))
}

/// Waits until `GET path` answers `status`.
pub(crate) async fn wait_http(addr: &str, path: &str, status: u16) -> String {
    wait_for(
        &format!("GET {path} to answer {status}"),
        Duration::from_secs(30),
        || {
            let got = http_get(addr, path);
            async move {
                match got {
                    Some((s, body)) if s == status => Ok(body),
                    other => Err(format!("{other:?}")),
                }
            }
        },
    )
    .await
}

/// Starts `walbox run` with `flags` `times` times, each killed with
/// SIGKILL once it streamed a while (700 ms).
pub(crate) async fn kill_9_while_streaming(
    db: &walbox_test_harness::pg::TestDb,
    kafka: &TestKafka,
    flags: &[&str],
    times: usize,
) {
    for _ in 0..times {
        let mut relay = spawn_run(db, kafka, flags);
        wait_log(&relay, "streaming from the slot").await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        signal(&relay, "-KILL");
        wait_exit(&mut relay).await;
    }
}

/// Waits until the relay's log contains `needle`; returns the first line
/// that does.
pub(crate) async fn wait_log(relay: &Relay, needle: &str) -> String {
    wait_for(
        &format!("walbox to log {needle:?}"),
        Duration::from_secs(30),
        || {
            let log = relay.log();
            async move {
                match log.lines().find(|l| l.contains(needle)) {
                    Some(line) => Ok(line.to_owned()),
                    None => Err(log.lines().last().unwrap_or_default().to_owned()),
                }
            }
        },
    )
    .await
}

/// A private Postgres server (for tests that stop and start it) with the
/// outbox, walbox's slot, and a checkpoint taken just after: a crash restart
/// then loses only positions confirmed since. Returns the server, walbox's
/// `pg_url` for it, and a client.
pub(crate) async fn private_outbox() -> (PgServer, String, Client) {
    private_outbox_with(&[]).await
}

/// [`private_outbox`], with `init-slot` given `init_args`.
pub(crate) async fn private_outbox_with(init_args: &[&str]) -> (PgServer, String, Client) {
    let server = PgServer::start_default().unwrap();
    let admin = server.config("postgres");
    let url = format!(
        "{} sslmode=disable",
        walbox_test_harness::pg::conninfo(&admin)
    );
    let client = walbox_test_harness::pg::connect(&admin).await.unwrap();
    apply_migrations(&client).await;
    let mut cmd = Command::new(walbox_e2e::walbox_bin());
    cmd.args(["init-slot", "--pg-url", &url]).args(init_args);
    assert!(cmd.status().unwrap().success());
    client.batch_execute("CHECKPOINT").await.unwrap();
    (server, url, client)
}

pub(crate) async fn init(db: &TestDb) -> Client {
    let client = db.connect().await;
    apply_migrations(&client).await;
    let out = walbox(db, &["init-slot"]).output().unwrap();
    succeeded(&out);
    client
}

/// Writes events `0..chunks * per_chunk` in the background, `per_chunk` at
/// a time through [`insert_events`] (`tx_size(chunk, k)` sizes a chunk's
/// k-th transaction), pausing `pause` after each chunk: the writes spread
/// over what the test does meanwhile (kills, restarts, takeovers).
pub(crate) fn spawn_writer(
    client: Client,
    chunks: usize,
    per_chunk: usize,
    pause: Duration,
    tx_size: impl Fn(usize, usize) -> usize + Send + Sync + 'static,
    aggregates: usize,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        for chunk in 0..chunks {
            let from = chunk * per_chunk;
            insert_events(
                &client,
                from,
                from + per_chunk,
                |k| tx_size(chunk, k),
                aggregates,
            )
            .await;
            tokio::time::sleep(pause).await;
        }
    })
}

/// Inserts events `from..to` (payload `n`, key `agg-{n % aggregates}`,
/// event type `E{n}`) in transactions; `tx_size(k)` sizes the k-th one.
pub(crate) async fn insert_events(
    client: &Client,
    from: usize,
    to: usize,
    tx_size: impl Fn(usize) -> usize,
    aggregates: usize,
) {
    let (mut n, mut k) = (from, 0);
    while n < to {
        let end = (n + tx_size(k).max(1)).min(to);
        let values: Vec<String> = (n..end)
            .map(|i| {
                format!(
                    "('order', 'agg-{}', 'E{i}', '{{\"n\": {i}}}')",
                    i % aggregates
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
        n = end;
        k += 1;
    }
}

/// Reads the topic to its end until its records hold exactly `total`
/// distinct events, as `event` tells them apart (duplicates allowed);
/// returns the records.
pub(crate) async fn wait_distinct<K: std::hash::Hash + Eq>(
    kafka: &TestKafka,
    topic: &str,
    total: usize,
    event: impl Fn(&rdkafka::message::OwnedMessage) -> K,
) -> Vec<rdkafka::message::OwnedMessage> {
    wait_for("every event to arrive", Duration::from_secs(90), || async {
        let messages = consume_until_quiet(
            kafka,
            topic,
            Duration::from_secs(2),
            Duration::from_secs(30),
        )
        .await
        .map_err(|e| e.to_string())?;
        let distinct: HashSet<K> = messages.iter().map(&event).collect();
        if distinct.len() == total {
            Ok(messages)
        } else {
            Err(format!("{} of {total} distinct events", distinct.len()))
        }
    })
    .await
}

/// [`expect_all`]; when the events do not all arrive, the panic carries
/// the end of `relay`'s log (what walbox did meanwhile).
pub(crate) async fn expect_all_logged(
    kafka: &TestKafka,
    topic: &str,
    total: usize,
    relay: &Relay,
) -> usize {
    use futures_util::FutureExt;
    match std::panic::AssertUnwindSafe(expect_all(kafka, topic, total))
        .catch_unwind()
        .await
    {
        Ok(duplicates) => duplicates,
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            let log = relay.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(200)..].join("\n");
            panic!("{why}\nthe end of walbox's log:\n{tail}");
        }
    }
}

/// Reads the topic until every `n` in `0..total` arrived (duplicates allowed);
/// returns how many duplicates there were. Checks that, per key, first
/// arrivals follow commit order.
pub(crate) async fn expect_all(kafka: &TestKafka, topic: &str, total: usize) -> usize {
    let messages = wait_distinct(kafka, topic, total, n_of).await;
    let mut sorted = messages.clone();
    sorted.sort_by_key(|m| (m.partition(), m.offset()));
    let mut seen = HashSet::new();
    let mut last_first_arrival: HashMap<Vec<u8>, i64> = HashMap::new();
    for m in &sorted {
        let n = n_of(m);
        if seen.insert(n) {
            let prev = last_first_arrival.insert(m.key().unwrap().to_vec(), n);
            assert!(
                prev.is_none_or(|p| p < n),
                "per-key order of first arrivals"
            );
        }
    }
    assert!((0..total as i64).all(|n| seen.contains(&n)));
    messages.len() - total
}

pub(crate) fn n_of(m: &rdkafka::message::OwnedMessage) -> i64 {
    let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
    v["n"].as_i64().unwrap()
}

/// Waits until the broker answers a metadata request.
pub(crate) async fn wait_broker(kafka: &TestKafka) {
    let config = kafka.client_config();
    wait_for("the broker to answer", Duration::from_secs(30), || {
        let config = config.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                use rdkafka::consumer::{BaseConsumer, Consumer};
                let c: BaseConsumer = config.create().map_err(|e| e.to_string())?;
                c.fetch_metadata(None, Duration::from_secs(2))
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
            .await
            .unwrap()
        }
    })
    .await;
}

/// Waits up to `timeout` for walbox to exit; panics with its log otherwise.
pub(crate) async fn exit_within(relay: &mut Relay, timeout: Duration) -> std::process::ExitStatus {
    match relay.exit_within(timeout).await {
        Some(status) => status,
        None => {
            let log = relay.log();
            relay.kill9();
            panic!("walbox did not exit within {timeout:?}\n{log}");
        }
    }
}

/// Stops Postgres as a crash does and starts it again: a slot whose only
/// change was its confirmed position goes back to the last checkpoint
/// (before Postgres 17). Returns the server and a new client.
pub(crate) async fn crash_and_restart(
    server: walbox_test_harness::pg::PgServer,
) -> (walbox_test_harness::pg::PgServer, tokio_postgres::Client) {
    restart_postgres(server, true).await
}

/// Stops Postgres (`immediate`: as a crash does; else a fast shutdown) and
/// starts it again. Returns the server and a new client.
pub(crate) async fn restart_postgres(
    mut server: walbox_test_harness::pg::PgServer,
    immediate: bool,
) -> (walbox_test_harness::pg::PgServer, tokio_postgres::Client) {
    let server = tokio::task::spawn_blocking(move || {
        if immediate {
            server.stop_immediate();
        } else {
            server.stop();
        }
        server.start().unwrap();
        server
    })
    .await
    .unwrap();
    let client = walbox_test_harness::pg::connect(&server.config("postgres"))
        .await
        .unwrap();
    (server, client)
}

/// The Python named by the environment variable `var` (scripts/test
/// installs one in a venv), else `python3`, checked to run `import`;
/// `package` is what to pip install otherwise.
pub(crate) fn python_with(var: &str, import: &str, package: &str) -> String {
    let python = std::env::var(var).unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&python)
        .args(["-c", &format!("import {import}")])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "{python} cannot import {import}: run scripts/test (it installs it), or `pip install '{package}'` and set {var}"
    );
    python
}

/// `walbox quarantine ARGS…`'s standard output, asserting success.
pub(crate) fn quarantine(db: &TestDb, args: &[&str]) -> String {
    let mut all = vec!["quarantine"];
    all.extend_from_slice(args);
    succeeded(&walbox(db, &all).output().unwrap())
}

/// Sends `signal` (`-STOP`, `-CONT`, …) to a server the test started.
pub(crate) fn signal_child(child: &std::process::Child, signal: &str) {
    let status = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {signal}");
}

/// Runs `python` on the e2e tool `script` (in `tests/e2e/tools/`) with
/// `args`, `input` on its standard input; asserts that it succeeded
/// (showing its output otherwise) and returns its standard output.
pub(crate) fn run_tool(python: &str, script: &str, args: &[&str], input: &str) -> String {
    use std::io::Write;
    let path = format!("{}/e2e/tools/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut child = Command::new(python)
        .arg(path)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    succeeded(&child.wait_with_output().unwrap())
}

/// The Python with moto and boto3 (`WALBOX_MOTO_PYTHON`).
pub(crate) fn moto_python() -> String {
    python_with(
        "WALBOX_MOTO_PYTHON",
        "moto.server, boto3",
        "moto[server]==5.1.0",
    )
}

/// moto's server (S3, STS, … on one port) on a free local port, killed
/// when dropped.
pub(crate) struct MotoServer {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub(crate) endpoint: String,
}

impl MotoServer {
    pub(crate) async fn start() -> MotoServer {
        let port = walbox_test_harness::port::free_port();
        let child = Command::new(moto_python())
            .args([
                "-m",
                "moto.server",
                "-H",
                "127.0.0.1",
                "-p",
                &port.to_string(),
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start moto");
        let endpoint = format!("http://127.0.0.1:{port}");
        let server = MotoServer { child, endpoint };
        let addr = format!("127.0.0.1:{port}");
        wait_for("moto to listen", Duration::from_secs(60), || {
            let addr = addr.clone();
            async move {
                tokio::net::TcpStream::connect(&addr)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            }
        })
        .await;
        server
    }

    pub(crate) fn signal(&self, signal: &str) {
        signal_child(&self.child, signal);
    }
}

impl Drop for MotoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `walbox` slot's confirmed position.
pub(crate) async fn confirmed(client: &Client) -> String {
    client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Whether WAL position `a` is at or before `b`.
pub(crate) async fn lsn_le(client: &Client, a: &str, b: &str) -> bool {
    client
        .query_one("SELECT $1::text::pg_lsn <= $2::text::pg_lsn", &[&a, &b])
        .await
        .unwrap()
        .get(0)
}

/// One check of `walbox doctor --json`: its name, verdict, and what it saw
/// joined with its fix (`saw — fix`).
pub(crate) type DoctorCheck = (String, String, String);

/// The checks whose name starts with `prefix` in the output of a finished
/// `walbox doctor --json` (panics, showing the output, when it printed no
/// JSON); and its stdout.
pub(crate) fn doctor_checks(
    out: &std::process::Output,
    prefix: &str,
) -> (Vec<DoctorCheck>, String) {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "doctor --json printed no JSON ({e}): {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let checks = json["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["check"].as_str().unwrap_or_default().starts_with(prefix))
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (
                s("check"),
                s("verdict"),
                format!("{} — {}", s("saw"), s("fix")),
            )
        })
        .collect();
    (checks, stdout)
}

/// The verdicts of `check` among `checks`, in order.
pub(crate) fn verdicts_of(checks: &[DoctorCheck], check: &str) -> Vec<String> {
    checks
        .iter()
        .filter(|c| c.0 == check)
        .map(|c| c.1.clone())
        .collect()
}
