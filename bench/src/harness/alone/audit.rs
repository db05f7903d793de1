//! What proving delivery costs: the small backlog drained with the
//! continuous audit off and on (`--audit-interval 1s`) and with delivery
//! receipts on, each on a fresh world (walbox's throughput and CPU, the
//! primary's CPU and WAL per event); then, walbox still running, `walbox
//! audit` over every event, with its default memory and with 8 MiB (its
//! sorts spill to disk): time, peak RSS, and the CPU it cost the primary.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::alone::wait_confirmed;
use crate::peers::{preload, Backlog};
use crate::procstat;
use crate::relay::{Kind, Relay};
use crate::results::Results;
use crate::world::World;

/// Plain, the continuous audit on, receipts on.
pub(crate) const WAYS: [(&str, &[&str]); 3] = [
    ("off", &[]),
    ("on", &["--audit-interval", "1s"]),
    ("receipts", &["--receipts", "true"]),
];
/// `walbox audit`'s memory for each sort: its default, and small enough
/// to spill.
pub(crate) const MEMORY: [(&str, Option<&str>); 2] = [("default", None), ("spill", Some("8"))];

pub(crate) async fn audit(results: &mut Results, walbox: &str, events: i64) {
    results.record("audit", "events", events as f64);
    for (way, flags) in WAYS {
        let world = World::start(walbox).await;
        let kind = Kind::Walbox;
        kind.init(&world).await;
        world.create_topic(&kind.topic()).await;
        eprintln!("bench: audit: walbox drains {events} events ({way})");
        let end = preload(&world, Backlog::small("audit", events)).await;
        let pg_cpu0 = world.server_cpu().await;
        let t0 = Instant::now();
        let mut relay = Relay::start_with(kind, &world, flags);
        wait_confirmed(&world, &mut [&mut relay], &kind.slot(), &end).await;
        let secs = t0.elapsed().as_secs_f64();
        if way == "receipts" {
            // Written shortly after the acknowledgements: until every event
            // has one, or none came for 2 s (the writer fell behind and
            // dropped some, which the report shows).
            let (mut written, mut moved) = (0i64, Instant::now());
            while written < events && moved.elapsed() < Duration::from_secs(2) {
                tokio::time::sleep(Duration::from_millis(50)).await;
                let now = world
                    .one::<i64>("SELECT count(DISTINCT event_id) FROM walbox.receipts")
                    .await;
                if now > written {
                    (written, moved) = (now, Instant::now());
                }
            }
            results.record("audit", "receipts_share", written as f64 / events as f64);
        }
        let pg_cpu = world.server_cpu().await - pg_cpu0;
        let wal = world.wal_between(&end, &world.wal_lsn().await).await;
        let cpu = procstat::usage(relay.pid()).map_or(0.0, |u| u.cpu_s);
        let per = |x: f64| x / events as f64;
        results.record("audit", &format!("{way}_eps"), events as f64 / secs);
        results.record("audit", &format!("{way}_cpu_us"), per(cpu * 1e6));
        results.record("audit", &format!("{way}_pg_cpu_us"), per(pg_cpu * 1e6));
        results.record("audit", &format!("{way}_wal_bytes"), per(wal));
        if way == "on" {
            for (label, memory) in MEMORY {
                eprintln!("bench: audit: walbox audit over {events} events, memory {label}");
                let cpu0 = world.server_cpu().await;
                let run = run_audit(&world, walbox, kind, memory).await;
                let pg_cpu = world.server_cpu().await - cpu0;
                let total = |k: &str| run.report["total"][k].as_u64().unwrap_or(u64::MAX);
                assert_eq!(total("rows"), events as u64, "audit: rows: {}", run.report);
                assert_eq!(total("delivered"), events as u64, "audit: delivered");
                assert_eq!(
                    total("missing")
                        + total("unknown")
                        + total("out_of_order")
                        + total("misrouted"),
                    0,
                    "audit: findings after a clean drain: {}",
                    run.report
                );
                let m = |x: &str| format!("cli_{label}_{x}");
                results.record("audit", &m("s"), run.secs);
                results.record("audit", &m("eps"), events as f64 / run.secs);
                results.record("audit", &m("rss_mib"), run.peak_rss_mib);
                results.record("audit", &m("cpu_s"), run.cpu_s);
                results.record("audit", &m("pg_cpu_s"), pg_cpu);
                results.record(
                    "audit",
                    &m("runs"),
                    run.report["sort_runs"].as_f64().unwrap_or(0.0),
                );
            }
        }
        relay.stop();
    }
}

struct AuditRun {
    secs: f64,
    peak_rss_mib: f64,
    cpu_s: f64,
    report: serde_json::Value,
}

/// `walbox audit --last 1h --json` over `kind`'s topic, its peak RSS and
/// CPU sampled while it runs.
async fn run_audit(world: &World, walbox: &str, kind: Kind, memory: Option<&str>) -> AuditRun {
    let out = tempfile::NamedTempFile::new().expect("a temp file for the report");
    let mut command = Command::new(walbox);
    command
        .args(["audit", "--last", "1h", "--json", "--slot", &kind.slot()])
        .arg("--mapping-topic-template")
        .arg(format!("{}.{{aggregate_type}}", kind.slot()))
        .args([
            "--pg-url",
            &world.url,
            "--kafka-brokers",
            &world.bootstrap(),
        ])
        .stdout(out.reopen().expect("reopen the report file"))
        .stderr(Stdio::inherit());
    if let Some(m) = memory {
        command.args(["--memory", m]);
    }
    let t0 = Instant::now();
    let mut child = command.spawn().expect("run walbox audit");
    let mut last = procstat::Usage::default();
    let status = loop {
        if let Some(u) = procstat::usage(child.id()) {
            last = u;
        }
        if let Some(status) = child.try_wait().expect("wait for walbox audit") {
            break status;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let secs = t0.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(out.path()).unwrap_or_default();
    assert!(status.success(), "walbox audit: {status}: {text}");
    AuditRun {
        secs,
        peak_rss_mib: last.peak_rss_mib,
        cpu_s: last.cpu_s,
        report: serde_json::from_str(&text).expect("walbox audit's JSON report"),
    }
}
