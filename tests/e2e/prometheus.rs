//! A real Prometheus scrapes a running walbox: the metrics parse, carry the
//! values walbox has, the alert rules load and evaluate, and every query of
//! the Grafana dashboard is valid PromQL over what walbox exports.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use walbox_test_harness::kafka::TestKafka;
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A Prometheus process, killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
    _dir: tempfile::TempDir,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Scrapes `target` every second, with walbox's alert rules loaded.
    fn start(bin: &str, target: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        let rules = repo().join("deploy/prometheus/walbox-rules.yml");
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {}\n\
                 scrape_configs:\n  - job_name: walbox\n    static_configs:\n      - targets: ['{target}']\n",
                rules.display()
            ),
        )
        .unwrap();
        let addr = free_addr();
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).unwrap())
            .spawn()
            .expect("start prometheus");
        Prometheus {
            child,
            addr,
            _dir: dir,
        }
    }

    /// `GET /api/v1/…` as JSON (HTTP/1.0: a body without chunks).
    fn api(&self, path: &str) -> Option<serde_json::Value> {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&self.addr).ok()?;
        write!(s, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let (_, body) = out.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    }

    /// An instant query's result vector, or the error Prometheus gave.
    fn query(&self, promql: &str) -> Result<Vec<serde_json::Value>, String> {
        let answer = self
            .api(&format!("/api/v1/query?query={}", percent_encode(promql)))
            .ok_or("no answer")?;
        if answer["status"] != "success" {
            return Err(format!("{promql}: {answer}"));
        }
        Ok(answer["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default())
    }

    /// Waits until `promql` returns at least one sample; returns the first value.
    async fn value(&self, promql: &str) -> f64 {
        wait_for(
            &format!("Prometheus to have {promql}"),
            Duration::from_secs(30),
            || {
                let got = self.query(promql);
                async move {
                    match got {
                        Ok(v) if !v.is_empty() => v[0]["value"][1]
                            .as_str()
                            .and_then(|s| s.parse().ok())
                            .ok_or_else(|| format!("{v:?}")),
                        other => Err(format!("{other:?}")),
                    }
                }
            },
        )
        .await
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_walbox_and_the_rules_and_dashboard_queries_evaluate() {
    let Ok(bin) = std::env::var("WALBOX_PROMETHEUS_BIN") else {
        eprintln!("WALBOX_PROMETHEUS_BIN is not set (scripts/test sets it): test not run");
        return;
    };
    let db = fresh_db().await;
    let client = init(&db).await;
    let kafka = TestKafka::from_env();
    let topic = kafka.create_topic(3).await;
    let (mut relay, metrics) = spawn_run_watched(&db, &kafka, &topic).await;
    insert_events(&client, 0, 120, |_| 4, 10).await;
    expect_all(&kafka, &topic, 120).await;
    let prometheus = Prometheus::start(&bin, &metrics);

    assert_eq!(
        prometheus.value(r#"walbox_build_info{job="walbox"}"#).await,
        1.0
    );
    assert_eq!(prometheus.value("walbox_streaming").await, 1.0);
    assert_eq!(
        prometheus
            .value(&format!(
                r#"walbox_events_published_total{{topic="{topic}"}}"#
            ))
            .await,
        120.0
    );
    assert_eq!(prometheus.value("walbox_in_flight_events").await, 0.0);
    assert!(prometheus.value("process_resident_memory_bytes").await > 1e6);
    assert!(prometheus.value("walbox_slot_lag_bytes").await >= 0.0);
    // librdkafka's statistics come every 5 s.
    assert!(prometheus.value("walbox_producer_queue_messages").await >= 0.0);
    assert!(
        prometheus
            .value(r#"walbox_broker_round_trip_seconds{stat="p99"}"#)
            .await
            >= 0.0
    );
    let p99 = prometheus
        .value("histogram_quantile(0.99, sum by (le) (walbox_commit_to_ack_seconds_bucket))")
        .await;
    assert!(p99 > 0.0 && p99 <= 60.0, "{p99}");

    // The rules load and evaluate without error; none fires on a healthy relay.
    let rules = wait_for("the rules to be evaluated", Duration::from_secs(30), || {
        let answer = prometheus.api("/api/v1/rules");
        async move {
            let groups = answer.ok_or("no answer")?["data"]["groups"].clone();
            let rules: Vec<serde_json::Value> = groups
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
                .collect();
            // Evaluated, and settled since a scrape: before the first one,
            // WalboxAbsent is rightly pending.
            let settled = rules.iter().all(|r| {
                r["lastEvaluation"] != "0001-01-01T00:00:00Z"
                    && (r["health"] != "ok" || r["state"] == "inactive")
            });
            if !rules.is_empty() && settled {
                Ok(rules)
            } else {
                Err(format!("{rules:?}"))
            }
        }
    })
    .await;
    assert_eq!(rules.len(), 16);
    for rule in &rules {
        assert_eq!(rule["health"], "ok", "{rule}");
        assert_eq!(rule["state"], "inactive", "{rule}");
    }

    // Every dashboard query is valid PromQL over walbox's metrics.
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("deploy/grafana/walbox.json")).unwrap(),
    )
    .unwrap();
    let mut queries = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"]
                .as_str()
                .unwrap()
                .replace("$job", ".*")
                .replace("$namespace", ".*")
                .replace("$__rate_interval", "1m");
            let result = prometheus.query(&expr);
            assert!(result.is_ok(), "{}: {result:?}", panel["title"]);
            queries += 1;
        }
    }
    assert!(queries >= 15, "{queries}");
    stop(&mut relay).await;
}
