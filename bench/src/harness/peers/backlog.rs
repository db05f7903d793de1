//! The backlogs: pg_recvlogical, walbox, Debezium and the polling relay
//! drain the same rows; what each took, and what reading cost the primary.

use std::process::Stdio;
use std::time::{Duration, Instant};

use super::{launch_warm, preload, watch, Backlog, Rows, Warm, TICK, TIMEOUT};
use crate::procstat;
use crate::results::Results;
use crate::world::{TableStats, World};

pub(crate) async fn backlog(results: &mut Results, walbox: &str, b: Backlog) {
    let world = World::start(walbox).await;
    let kinds = b.relays();
    for &kind in &kinds {
        kind.init_with(&world, &["--source", b.source()]).await;
        world.create_topic(&kind.topic()).await;
    }
    let warm = launch_warm(&world, &kinds, b).await;
    for w in &warm {
        let p = |m: &str| format!("{}_{m}", w.kind.slot());
        results.record(b.phase, &p("startup_s"), w.startup_s);
        results.record(b.phase, &p("startup_cpu_s"), w.startup_cpu_s);
    }
    // Made after the warm-up: it reads the backlog alone.
    world.create_slot("bench_recvlogical").await;
    let recvlogical = Recvlogical::start(&world, b.rows == Rows::Messages).await;
    let start = world.wal_lsn().await;
    eprintln!(
        "bench: {}: writing {} events in transactions of {}",
        b.phase, b.events, b.tx
    );
    let end = preload(&world, b).await;
    let row: i32 = if b.rows == Rows::Messages {
        // The envelope walbox.emit() writes.
        world
            .one(
                "SELECT length(jsonb_build_object('v', 1, 'id', gen_random_uuid(),
                   'aggregate_type', 'order', 'aggregate_id', 'order-1', 'event_type', 'OrderCreated',
                   'payload', jsonb_build_object('order_id', 'order-1', 'total', 1, 'pad', repeat('x', 60)),
                   'headers', '{}'::jsonb, 'created_at', now())::text)",
            )
            .await
    } else {
        world
            .one("SELECT avg(pg_column_size(t.*))::int FROM outbox_events t")
            .await
    };
    results.record(b.phase, "events", b.events as f64);
    results.record(b.phase, "row_bytes", f64::from(row));

    let n = b.events as f64;
    results.record(
        b.phase,
        "recvlogical_ahead",
        world.decoded_ahead("bench_recvlogical", &start, &end).await,
    );
    // What its walsender decoded while the backlog was written counts in
    // the server's CPU for it, as it counts in the walsender's own.
    let ahead = procstat::usage(recvlogical.walsender).map_or(0.0, |u| u.cpu_s)
        - recvlogical.walsender_cpu0;
    let c0 = world.server_cpu().await;
    let (secs, walsender) = recvlogical.drain(b.events).await;
    let c1 = world.server_cpu().await;
    results.record(b.phase, "recvlogical_s", secs);
    results.record(b.phase, "recvlogical_eps", n / secs);
    results.record(b.phase, "recvlogical_walsender_us", walsender / n * 1e6);
    results.record(b.phase, "recvlogical_pg_us", (c1 - c0 + ahead) / n * 1e6);

    for w in warm {
        let kind = w.kind;
        eprintln!("bench: {}: {} drains it", b.phase, kind.label());
        let before = Primary::read(&world, "outbox_events").await;
        results.record(
            b.phase,
            &format!("{}_ahead", kind.slot()),
            world.decoded_ahead(&kind.slot(), &start, &end).await,
        );
        // Its walsender's decoding during the write, counted in the server's
        // CPU as in the walsender's (from the pause, see `drain`).
        let ahead = w.walsender.map_or(0.0, |(pid, at_pause)| {
            procstat::usage(pid).map_or(0.0, |u| u.cpu_s - at_pause)
        });
        let broker0 = world.broker_cpu();
        let d = drain(&world, w, b, &end).await;
        let broker = world.broker_cpu() - broker0;
        let mut cost = before.cost(&world).await;
        cost.cpu_s += ahead;
        let p = |m: &str| format!("{}_{m}", kind.slot());
        results.record(b.phase, &p("s"), d.secs);
        results.record(b.phase, &p("first_s"), d.first_secs);
        results.record(b.phase, &p("eps"), n / d.secs);
        results.record(b.phase, &p("cpu_s"), d.cpu_s);
        results.record(b.phase, &p("cpu_us"), d.cpu_s / n * 1e6);
        results.record(b.phase, &p("events_per_cpu_s"), n / d.cpu_s);
        results.record(b.phase, &p("rss_mib"), d.peak_rss_mib);
        results.record(b.phase, &p("walsender_us"), d.walsender_cpu_s / n * 1e6);
        results.record(b.phase, &p("broker_us"), broker / n * 1e6);
        results.record(b.phase, &p("duplicates"), d.duplicates as f64);
        if let Some(c) = d.confirmed_secs {
            results.record(b.phase, &p("confirmed_s"), c);
        }
        cost.record(results, b.phase, &kind.slot(), n);
    }
    if b.pollers {
        pollers(results, &world, b).await;
    }
}

/// What the primary had done when a reader started: its CPU, the outbox
/// table's statistics and its WAL position.
struct Primary {
    table: &'static str,
    cpu_s: f64,
    stats: TableStats,
    wal: String,
}

/// What reading cost the primary: see [`Primary::cost`].
struct Cost {
    cpu_s: f64,
    scans: f64,
    rows_written: f64,
    dead_tuples: f64,
    wal_bytes: f64,
}

impl Primary {
    async fn read(world: &World, table: &'static str) -> Primary {
        Primary {
            table,
            cpu_s: world.server_cpu().await,
            stats: world.table_stats(table).await,
            wal: world.wal_lsn().await,
        }
    }

    /// What the server did since [`Primary::read`]: CPU of all its
    /// processes, statements that scanned the table, rows written to it,
    /// dead tuples left in it, WAL written by anyone.
    async fn cost(self, world: &World) -> Cost {
        let cpu_s = world.server_cpu().await - self.cpu_s;
        let wal = world.wal_lsn().await;
        let wal_bytes = world.wal_between(&self.wal, &wal).await;
        // Statistics reach the shared counters within a second.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let stats = world.table_stats(self.table).await;
        Cost {
            cpu_s,
            scans: stats.scans - self.stats.scans,
            rows_written: stats.rows_written - self.stats.rows_written,
            dead_tuples: stats.dead_tuples,
            wal_bytes,
        }
    }
}

impl Cost {
    fn record(&self, results: &mut Results, phase: &str, reader: &str, events: f64) {
        let p = |m: &str| format!("{reader}_{m}");
        results.record(phase, &p("pg_us"), self.cpu_s / events * 1e6);
        results.record(phase, &p("outbox_scans"), self.scans);
        results.record(phase, &p("outbox_rows_written"), self.rows_written);
        results.record(phase, &p("dead_tuples"), self.dead_tuples);
        results.record(phase, &p("wal_per_event"), self.wal_bytes / events);
    }
}

/// The polling relay (bench/src/bin/outbox-poller.rs) drains a copy of the
/// backlog (the last rows written, not the relays' warm-up), batch 50 and batch 500, to its own topic.
async fn pollers(results: &mut Results, world: &World, b: Backlog) {
    let bin = std::env::current_exe()
        .expect("this binary's path")
        .with_file_name("outbox-poller");
    let topic = "poller.order";
    world.create_topic(topic).await;
    let n = b.events as f64;
    for batch in [50, 500] {
        eprintln!(
            "bench: {}: the polling relay, batch {batch}, drains a copy",
            b.phase
        );
        world
            .execute(&format!(
                "DROP TABLE IF EXISTS outbox_poll;
                 CREATE TABLE outbox_poll (LIKE outbox_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING IDENTITY,
                                           published_at timestamptz, PRIMARY KEY (id));
                 INSERT INTO outbox_poll (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at)
                 SELECT id, aggregate_type, aggregate_id, event_type, payload, headers, created_at
                   FROM (SELECT * FROM outbox_events ORDER BY seq DESC LIMIT {}) backlog ORDER BY seq;
                 CREATE INDEX outbox_poll_unpublished ON outbox_poll (seq) WHERE published_at IS NULL;",
                b.events
            ))
            .await;
        world.execute("VACUUM ANALYZE outbox_poll").await;
        world.execute("CHECKPOINT").await;
        let from = world.ends(topic);
        let before = Primary::read(world, "outbox_poll").await;
        let own: i32 = world.one("SELECT pg_backend_pid()").await;
        let mut child = std::process::Command::new(&bin)
            .args(["--pg-url", &world.url, "--brokers", &world.bootstrap()])
            .args(["--batch", &batch.to_string(), "--until-empty"])
            .args(["--topic-template", "poller.{aggregate_type}"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", bin.display()));
        let (mut usage, mut backend, mut backend_cpu) = (procstat::Usage::default(), None, 0.0);
        let t0 = Instant::now();
        while child.try_wait().expect("the poller").is_none() {
            if let Some(u) = procstat::usage(child.id()) {
                usage = u;
            }
            if backend.is_none() {
                backend = world
                    .client
                    .query_opt(
                        "SELECT pid FROM pg_stat_activity
                          WHERE backend_type = 'client backend' AND pid <> $1 LIMIT 1",
                        &[&own],
                    )
                    .await
                    .expect("the poller's backend")
                    .map(|r| r.get::<_, i32>(0) as u32);
            }
            if let Some(u) = backend.and_then(procstat::usage) {
                backend_cpu = u.cpu_s;
            }
            assert!(t0.elapsed() < TIMEOUT, "the poller took over {TIMEOUT:?}");
            tokio::time::sleep(TICK).await;
        }
        let out = child.wait_with_output().expect("the poller's output");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "the poller: {}: {text}", out.status);
        let field = |name: &str| -> f64 {
            text.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("the poller's {name}: {text}"))
        };
        let cost = before.cost(world).await;
        assert_eq!(field("events"), n, "events the poller published");
        assert_eq!(
            world.count_since(topic, &from),
            b.events,
            "records the poller wrote"
        );
        let p = |m: &str| format!("poll{batch}_{m}");
        let secs = field("seconds");
        results.record(b.phase, &p("s"), secs);
        results.record(b.phase, &p("eps"), n / secs);
        results.record(b.phase, &p("cpu_s"), usage.cpu_s);
        results.record(b.phase, &p("cpu_us"), usage.cpu_s / n * 1e6);
        results.record(b.phase, &p("rss_mib"), usage.peak_rss_mib);
        results.record(b.phase, &p("statements"), field("statements"));
        results.record(b.phase, &p("outbox_statements"), field("table_statements"));
        results.record(b.phase, &p("backend_us"), backend_cpu / n * 1e6);
        cost.record(results, b.phase, &format!("poll{batch}"), n);
    }
}

/// pg_recvlogical's pgoutput options: protocol 1 on walbox's publication,
/// with logical decoding messages when `messages`.
fn recvlogical_options(messages: bool) -> [&'static str; 6] {
    let messages = if messages {
        "messages=true"
    } else {
        "messages=false"
    };
    [
        "-o",
        "proto_version=1",
        "-o",
        "publication_names=walbox_outbox",
        "-o",
        messages,
    ]
}

/// pg_recvlogical on the slot `bench_recvlogical`, started and paused
/// before the backlog is written, as the relays are: its walsender
/// decodes ahead of it as theirs do. Its output goes to a pipe the
/// harness reads, looking for the backlog's last event.
struct Recvlogical {
    child: std::process::Child,
    walsender: u32,
    /// Its walsender's CPU when it was paused.
    walsender_cpu0: f64,
    found: std::sync::mpsc::Receiver<Instant>,
    /// The last event's payload text: `"total": <events - 1>, `.
    marker: std::sync::Arc<std::sync::OnceLock<Vec<u8>>>,
}

impl Recvlogical {
    async fn start(world: &World, messages: bool) -> Recvlogical {
        let mut child = world
            .pg_tool("pg_recvlogical")
            .args(["-d", &world.url, "--slot", "bench_recvlogical", "--start"])
            .args(recvlogical_options(messages))
            .args(["-f", "-"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pg_recvlogical");
        let mut out = child.stdout.take().expect("pg_recvlogical's output");
        let marker: std::sync::Arc<std::sync::OnceLock<Vec<u8>>> = Default::default();
        let (tx, found) = std::sync::mpsc::channel();
        let wanted = marker.clone();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = vec![0u8; 1 << 16];
            let mut carry: Vec<u8> = Vec::new();
            let mut sent = false;
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let Some(m) = wanted.get().filter(|_| !sent) else {
                    continue;
                };
                carry.extend_from_slice(&buf[..n]);
                if carry.windows(m.len()).any(|w| w == m.as_slice()) {
                    let _ = tx.send(Instant::now());
                    sent = true;
                }
                let keep = carry.len().min(m.len());
                carry.drain(..carry.len() - keep);
            }
        });
        let t0 = Instant::now();
        let walsender = loop {
            if let Some(pid) = world.walsender("bench_recvlogical").await {
                break pid;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "pg_recvlogical did not start streaming"
            );
            tokio::time::sleep(TICK).await;
        };
        let mut r = Recvlogical {
            child,
            walsender,
            walsender_cpu0: 0.0,
            found,
            marker,
        };
        r.signal("STOP");
        r.walsender_cpu0 = procstat::usage(walsender).map_or(0.0, |u| u.cpu_s);
        r
    }

    fn signal(&self, name: &str) {
        crate::relay::signal(self.child.id(), name);
    }

    /// Resumes it with the backlog of `events` waiting: seconds until
    /// its last event came through, and its walsender's CPU since the
    /// pause (what it decoded ahead included).
    async fn drain(mut self, events: i64) -> (f64, f64) {
        let _ = self
            .marker
            .set(format!("\"total\": {}, ", events - 1).into_bytes());
        let cpu = || procstat::usage(self.walsender).map_or(0.0, |u| u.cpu_s);
        let (cpu0, mut cpu1) = (self.walsender_cpu0, 0.0);
        let t0 = Instant::now();
        self.signal("CONT");
        let at = loop {
            if let Ok(at) = self.found.try_recv() {
                break at;
            }
            cpu1 = cpu();
            assert!(
                self.child.try_wait().expect("pg_recvlogical").is_none(),
                "pg_recvlogical exited"
            );
            assert!(
                t0.elapsed() < TIMEOUT,
                "pg_recvlogical took over {TIMEOUT:?}"
            );
            tokio::time::sleep(TICK).await;
        };
        cpu1 = cpu().max(cpu1);
        let _ = self.child.kill();
        let _ = self.child.wait();
        ((at - t0).as_secs_f64(), cpu1 - cpu0)
    }
}

/// pg_recvlogical drains the slot `bench_recvlogical` to `/dev/null` up to
/// `end` (with logical decoding messages when `messages`): seconds, and
/// its walsender's CPU seconds (sampled every 20 ms).
pub(crate) async fn recvlogical(world: &World, end: &str, messages: bool) -> (f64, f64) {
    let t0 = Instant::now();
    let mut child = world
        .pg_tool("pg_recvlogical")
        .args([
            "-d",
            &world.url,
            "--slot",
            "bench_recvlogical",
            "--start",
            "--endpos",
            end,
        ])
        .args(recvlogical_options(messages))
        .args(["-f", "/dev/null"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("start pg_recvlogical");
    let (mut walsender, mut cpu) = (None, 0.0);
    loop {
        if let Some(status) = child.try_wait().expect("pg_recvlogical") {
            assert!(status.success(), "pg_recvlogical: {status}");
            break;
        }
        if walsender.is_none() {
            walsender = world.walsender("bench_recvlogical").await;
        }
        if let Some(u) = walsender.and_then(procstat::usage) {
            cpu = u.cpu_s;
        }
        assert!(
            t0.elapsed() < TIMEOUT,
            "pg_recvlogical took over {TIMEOUT:?}"
        );
        tokio::time::sleep(TICK).await;
    }
    (t0.elapsed().as_secs_f64(), cpu)
}

struct Drain {
    /// From its resumption until every event was on its topic.
    secs: f64,
    /// Until its first record was.
    first_secs: f64,
    /// Its CPU meanwhile.
    cpu_s: f64,
    /// Over its whole life, the warm-up included.
    peak_rss_mib: f64,
    walsender_cpu_s: f64,
    /// walbox: until its slot confirmed the backlog's end.
    confirmed_secs: Option<f64>,
    duplicates: usize,
}

/// Resumes a warm relay ([`launch_warm`]) with the backlog waiting, and
/// times it until every event is on its topic.
async fn drain(world: &World, w: Warm, b: Backlog, end_lsn: &str) -> Drain {
    let Warm {
        kind,
        mut relay,
        walsender,
        ..
    } = w;
    let events = b.events;
    let topic = kind.topic();
    let slot = kind.slot();
    let from = world.ends(&topic);
    let pid = relay.pid();
    let cpu0 = procstat::usage(pid).map_or(0.0, |u| u.cpu_s);
    // From the pause: what its walsender decoded ahead counts too.
    let (walsender, walsender0) = walsender.map_or((None, 0.0), |(p, c)| (Some(p), c));
    let mut walsender_cpu_s = walsender0;
    let t0 = Instant::now();
    relay.resume();
    let mut first = None;
    loop {
        let n = world.count_since(&topic, &from);
        if first.is_none() && n > 0 {
            first = Some(t0.elapsed().as_secs_f64());
        }
        if let Some(u) = walsender.and_then(procstat::usage) {
            walsender_cpu_s = u.cpu_s;
        }
        if n >= events {
            break;
        }
        watch(&mut relay, t0, &kind.label());
        tokio::time::sleep(TICK).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    let end = procstat::usage(pid).expect("the relay runs");
    let mut confirmed_secs = None;
    if kind.is_walbox() {
        while !world.confirmed(&slot, end_lsn).await {
            watch(&mut relay, t0, &kind.label());
            tokio::time::sleep(TICK).await;
        }
        confirmed_secs = Some(t0.elapsed().as_secs_f64());
    }
    relay.stop();
    let read = world.tally(&topic, &from);
    assert_eq!(
        read.distinct as i64,
        events,
        "{}: distinct events on {topic}",
        kind.label()
    );
    Drain {
        secs,
        first_secs: first.unwrap_or(secs),
        cpu_s: end.cpu_s - cpu0,
        peak_rss_mib: end.peak_rss_mib,
        walsender_cpu_s: walsender_cpu_s - walsender0,
        confirmed_secs,
        duplicates: read.duplicates(),
    }
}
