//! `walbox doctor` against a real Postgres and Apache Kafka (KRaft,
//! `WALBOX_KAFKA_LIBS`): a deployment broken in every way doctor checks
//! fails each check with its fix, and passes it once fixed. The verdicts
//! themselves are unit-tested in `crates/walbox/src/doctor`; here each
//! check is made to fail and pass on the real parts.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::ClientConfig;
use serde_json::Value;
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::{connect, PgServer};
use walbox_test_harness::tls::Certificates;

/// One run of `walbox doctor --json`: its exit status and the checks, each
/// `(check, verdict, saw, fix)`.
struct Doctor {
    status: i32,
    checks: Vec<(String, String, String, String)>,
    stdout: String,
}

impl Doctor {
    fn run(url: &str, args: &[&str]) -> Doctor {
        let out = Command::new(walbox_e2e::walbox_bin())
            .arg("doctor")
            .arg("--json")
            .args(args)
            .env("WALBOX_PG_URL", url)
            .env("WALBOX_LOG", "warn")
            .output()
            .expect("walbox runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let json: Value = serde_json::from_str(stdout.trim())
            .unwrap_or_else(|e| panic!("doctor --json printed no JSON ({e}):\n{stdout}\n{stderr}"));
        let checks = json["checks"]
            .as_array()
            .expect("checks")
            .iter()
            .map(|c| {
                let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
                (s("check"), s("verdict"), s("saw"), s("fix"))
            })
            .collect();
        let status = out.status.code().expect("an exit status");
        assert_eq!(json["exit_status"], status, "{stdout}");
        Doctor {
            status,
            checks,
            stdout,
        }
    }

    /// The verdicts of `check`, in order.
    fn verdicts(&self, check: &str) -> Vec<&str> {
        self.checks
            .iter()
            .filter(|c| c.0 == check)
            .map(|c| c.1.as_str())
            .collect()
    }

    /// The one finding of `check` with `verdict`, as `(saw, fix)`.
    fn find(&self, check: &str, verdict: &str) -> (&str, &str) {
        self.checks
            .iter()
            .find(|c| c.0 == check && c.1 == verdict)
            .map(|c| (c.2.as_str(), c.3.as_str()))
            .unwrap_or_else(|| panic!("no {verdict} {check} in:\n{}", self.stdout))
    }

    /// Every check that did not pass, as `check=verdict`.
    fn not_passed(&self) -> BTreeMap<String, String> {
        self.checks
            .iter()
            .filter(|c| c.1 != "pass" && c.1 != "info")
            .map(|c| (c.0.clone(), c.1.clone()))
            .collect()
    }
}

fn admin(bootstrap: &str) -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .create()
        .expect("an admin client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_check_fails_on_a_broken_deployment_and_passes_once_fixed() {
    let kafka_cluster = tokio::task::block_in_place(|| KafkaCluster::start(1));
    let bootstrap = kafka_cluster.bootstrap();
    let mut server = PgServer::builder()
        .setting("wal_level", "replica")
        .setting("max_wal_senders", "0")
        .setting("wal_sender_timeout", "0")
        .setting("max_replication_slots", "1")
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let su = connect(&server.config("postgres")).await.unwrap();
    apply_migrations(&su).await;
    for sql in [
        "CREATE ROLE app LOGIN",
        // The one slot the server allows, taken by a standby's.
        "SELECT pg_create_physical_replication_slot('a_standby')",
        "CREATE TABLE orders (id int PRIMARY KEY)",
        "CREATE PUBLICATION walbox_outbox FOR TABLE orders",
        "ALTER TABLE outbox_events RENAME COLUMN aggregate_id TO aggregate_key",
        "INSERT INTO outbox_events (aggregate_type, aggregate_key, event_type, payload)
           VALUES ('order', '1', 'created', jsonb_build_object('text', repeat('x', 5000)))",
    ] {
        su.batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let url = format!(
        "host=127.0.0.1 port={} user=app dbname=postgres sslmode=disable",
        server.port()
    );
    let topic = walbox_test_harness::unique_name("doctor").replace('_', "-");
    let dlt = format!("{topic}-dlt");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_addr = taken.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let not_a_cert = dir.path().join("ca.pem");
    std::fs::write(&not_a_cert, "not a certificate").unwrap();
    let flags = |metrics: &str, ca: &str| -> Vec<String> {
        [
            "--kafka-brokers",
            &bootstrap,
            "--mapping-topic-template",
            &topic,
            "--dead-letter-topic",
            &dlt,
            "--metrics-addr",
            metrics,
            "--pg-url",
            &format!("{url} sslrootcert={ca}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };

    // 1. Everything broken that can be on Postgres' side, and no topics.
    let args = flags(&taken_addr, not_a_cert.to_str().unwrap());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let broken = tokio::task::block_in_place(|| Doctor::run(&url, &args));
    assert_eq!(broken.status, 2, "{}", broken.stdout);
    assert_eq!(broken.verdicts("postgres.wal_level"), ["fail"]);
    assert!(broken
        .find("postgres.wal_level", "fail")
        .1
        .contains("wal_level = logical"));
    assert_eq!(broken.verdicts("postgres.wal_senders"), ["fail"]);
    assert_eq!(broken.verdicts("postgres.replication_slots"), ["fail"]);
    assert_eq!(broken.verdicts("postgres.wal_sender_timeout"), ["warn"]);
    assert_eq!(broken.verdicts("postgres.max_slot_wal_keep_size"), ["warn"]);
    assert_eq!(broken.verdicts("postgres.role"), ["warn"]);
    assert!(broken
        .find("postgres.role", "warn")
        .1
        .contains("ALTER ROLE \"app\" REPLICATION"));
    assert_eq!(broken.verdicts("postgres.select"), ["fail"]);
    assert_eq!(broken.verdicts("postgres.backlog"), ["warn"]);
    assert!(broken
        .find("postgres.select", "fail")
        .1
        .contains("GRANT SELECT ON \"public\".\"outbox_events\""));
    assert_eq!(broken.verdicts("postgres.table_fit"), ["fail"]);
    assert!(broken
        .find("postgres.table_fit", "fail")
        .0
        .contains("aggregate_id"));
    assert_eq!(broken.verdicts("postgres.publication"), ["fail", "warn"]);
    assert!(broken
        .find("postgres.publication", "fail")
        .1
        .contains("ADD TABLE \"public\".\"outbox_events\""));
    assert!(broken
        .find("postgres.publication", "warn")
        .0
        .contains("orders"));
    assert_eq!(broken.verdicts("walbox.metrics_addr"), ["fail"]);
    assert_eq!(broken.verdicts("walbox.certificates"), ["fail"]);
    assert_eq!(broken.verdicts("kafka.connect"), ["pass"]);
    // Apache Kafka without an authorizer allows everything.
    assert_eq!(broken.verdicts("kafka.idempotent_write"), ["pass"]);
    assert_eq!(
        broken.verdicts("kafka.topic"),
        ["fail", "fail"],
        "{}",
        broken.stdout
    );
    assert!(broken
        .find("kafka.topic", "fail")
        .1
        .contains(&format!("--create --topic {topic}")));

    // 2. The server and the role fixed; a foreign slot in walbox's name;
    // topics made badly.
    server.stop();
    server.set_setting("wal_level", "logical");
    server.set_setting("max_wal_senders", "10");
    server.set_setting("wal_sender_timeout", "60s");
    server.set_setting("max_slot_wal_keep_size", "1GB");
    server.set_setting("max_replication_slots", "10");
    server.start().unwrap();
    let su = connect(&server.config("postgres")).await.unwrap();
    for sql in [
        "ALTER ROLE app REPLICATION",
        "GRANT SELECT ON outbox_events TO app",
        "GRANT INSERT, UPDATE ON walbox.relay_state TO app",
        "ALTER TABLE outbox_events RENAME COLUMN aggregate_key TO aggregate_id",
        "ALTER PUBLICATION walbox_outbox SET TABLE outbox_events",
        "SELECT pg_create_logical_replication_slot('walbox', 'test_decoding')",
    ] {
        su.batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let kafka = admin(&bootstrap);
    let options = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let made = kafka
        .create_topics(
            &[NewTopic::new(&topic, 2, TopicReplication::Fixed(1))
                .set("cleanup.policy", "compact")
                .set("max.message.bytes", "1000")
                .set("min.insync.replicas", "2")],
            &options,
        )
        .await
        .unwrap();
    assert!(made.iter().all(Result::is_ok), "{made:?}");
    drop(taken);
    let ca = Certificates::generate();
    let args = flags("127.0.0.1:0", ca.ca().to_str().unwrap());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let half = tokio::task::block_in_place(|| Doctor::run(&url, &args));
    assert_eq!(half.status, 2, "{}", half.stdout);
    for check in [
        "postgres.wal_level",
        "postgres.wal_senders",
        "postgres.replication_slots",
        "postgres.wal_sender_timeout",
        "postgres.max_slot_wal_keep_size",
        "postgres.role",
        "postgres.select",
        "postgres.backlog",
        "postgres.table_fit",
        "postgres.publication",
        "walbox.metrics_addr",
    ] {
        assert_eq!(half.verdicts(check), ["pass"], "{check}: {}", half.stdout);
    }
    // The harness' test CA lives for three days: inside doctor's 30.
    assert_eq!(half.verdicts("walbox.certificates"), ["warn"]);
    assert!(half
        .find("walbox.certificates", "warn")
        .0
        .contains("walbox test CA expires in"));
    assert_eq!(half.verdicts("postgres.slot"), ["fail"]);
    assert!(half
        .find("postgres.slot", "fail")
        .0
        .contains("test_decoding"));
    // min.insync.replicas above the replication factor refuses every write.
    assert_eq!(half.verdicts("kafka.topic.replication"), ["fail"]);
    assert_eq!(half.verdicts("kafka.topic.cleanup_policy"), ["warn"]);
    assert_eq!(half.verdicts("kafka.topic.max_message_bytes"), ["fail"]);
    assert!(half
        .find("kafka.topic.max_message_bytes", "fail")
        .0
        .contains("4.9 KiB"));

    // 3. Everything fixed that one broker can fix: a replication factor of
    // 1 stays a warning.
    su.batch_execute("SELECT pg_drop_replication_slot('walbox')")
        .await
        .unwrap();
    let init = Command::new(walbox_e2e::walbox_bin())
        .args(["init-slot", "--pg-url", &url])
        .env("WALBOX_LOG", "warn")
        .output()
        .unwrap();
    crate::support::succeeded(&init);
    let altered = kafka
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(&topic))
                .set("cleanup.policy", "delete")
                .set("max.message.bytes", "1048588")
                .set("min.insync.replicas", "1")],
            &options,
        )
        .await
        .unwrap();
    assert!(altered.iter().all(Result::is_ok), "{altered:?}");
    let made = kafka
        .create_topics(
            &[NewTopic::new(&dlt, 1, TopicReplication::Fixed(1))],
            &options,
        )
        .await
        .unwrap();
    assert!(made.iter().all(Result::is_ok), "{made:?}");
    let fixed = tokio::task::block_in_place(|| Doctor::run(&url, &args));
    let expected: BTreeMap<String, String> = [
        // sslmode=disable.
        ("walbox.config", "warn"),
        ("walbox.certificates", "warn"),
        ("kafka.topic.replication", "warn"),
    ]
    .iter()
    .map(|(c, v)| (c.to_string(), v.to_string()))
    .collect();
    assert_eq!(fixed.not_passed(), expected, "{}", fixed.stdout);
    assert_eq!(fixed.status, 1);
    // Outbox tables by pattern: walbox adds new matching tables to the
    // publication, which needs its ownership.
    let mut patterned = args.clone();
    patterned.extend(["--table", "public.outbox_*"]);
    let not_owner = tokio::task::block_in_place(|| Doctor::run(&url, &patterned));
    assert_eq!(
        not_owner.verdicts("postgres.publication_owner"),
        ["warn"],
        "{}",
        not_owner.stdout
    );
    assert!(not_owner
        .find("postgres.publication_owner", "warn")
        .1
        .contains("OWNER TO"));
    su.batch_execute("ALTER PUBLICATION walbox_outbox OWNER TO app")
        .await
        .unwrap();
    let owner = tokio::task::block_in_place(|| Doctor::run(&url, &patterned));
    assert!(
        owner.verdicts("postgres.publication_owner").is_empty(),
        "{}",
        owner.stdout
    );
    assert_eq!(
        owner.verdicts("postgres.publication"),
        ["pass"],
        "{}",
        owner.stdout
    );

    // A standby that does not answer: not checked, its password not shown.
    let mut with_standby = args.clone();
    with_standby.extend([
        "--standby-url",
        "postgres://replica:StandbyPw7@127.0.0.1:1/postgres?sslmode=disable",
    ]);
    let standby = tokio::task::block_in_place(|| Doctor::run(&url, &with_standby));
    assert_eq!(
        standby.verdicts("postgres.standby"),
        ["unchecked"],
        "{}",
        standby.stdout
    );
    assert_eq!(standby.status, 3);
    assert!(!standby.stdout.contains("StandbyPw7"), "{}", standby.stdout);
    // The Helm hook's mode: warnings said, exit 0.
    let mut lenient = args.clone();
    lenient.push("--allow-warnings");
    let allowed = Command::new(walbox_e2e::walbox_bin())
        .arg("doctor")
        .args(&lenient)
        .env("WALBOX_LOG", "warn")
        .output()
        .unwrap();
    assert!(allowed.status.success(), "{allowed:?}");
    assert!(String::from_utf8_lossy(&allowed.stdout).contains("WARN      kafka.topic.replication"));
    assert_eq!(fixed.verdicts("postgres.slot"), ["pass"]);
    assert_eq!(fixed.verdicts("kafka.topic.max_message_bytes"), ["pass"]);
    assert_eq!(
        fixed.verdicts("kafka.topic.cleanup_policy"),
        ["pass", "pass"]
    );
    assert_eq!(fixed.verdicts("kafka.topic.rights"), ["pass", "pass"]);
}
