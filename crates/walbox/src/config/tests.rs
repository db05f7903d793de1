use std::path::PathBuf;

use super::table::{Kind, SETTINGS};
use super::*;
use crate::mapping::format::EventFormat;
use crate::mapping::OutboxMapping;
use std::time::Duration;

fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("walbox.toml");
    std::fs::write(&path, text).unwrap();
    (dir, path)
}

/// A secret file as walbox accepts one: 0600.
fn secret_file(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
}

fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
    vars.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn load(
    file: Option<&Path>,
    vars: &[(&str, &str)],
    flags: &[(&'static str, &[&str])],
) -> Result<Config, ConfigError> {
    Config::load(Sources {
        file,
        env: env(vars),
        flags: flags.iter().map(|(k, v)| (*k, v.to_vec())).collect(),
    })
}

const PG: (&str, &str) = ("WALBOX_PG_URL", "host=h user=u");
const BROKERS: (&str, &str) = ("WALBOX_KAFKA_BROKERS", "b:9092");

#[test]
fn defaults() {
    let c = load(None, &[PG], &[]).unwrap();
    let conn = c.connection().unwrap();
    assert_eq!(
        (conn.slot.as_str(), conn.publication.as_str()),
        ("walbox", "walbox_outbox")
    );
    assert_eq!(
        conn.table("a test").unwrap().quoted(),
        "\"public\".\"outbox_events\""
    );
    assert_eq!(c.mapping().unwrap(), OutboxMapping::default());
    assert_eq!(c.log_format(), LogFormat::Text);
    let e = c.run().unwrap_err().to_string();
    assert!(e.contains("kafka.brokers is required"), "{e}");
}

#[test]
fn flags_win_over_the_environment_which_wins_over_the_file() {
    let (_d, path) = file(
        "slot = \"from_file\"\npublication = \"file_pub\"\ntable = \"file.t\"\n[kafka]\nbrokers = \"file:9092\"\n[kafka.properties]\n\"linger.ms\" = \"50\"\n\"client.id\" = \"file\"\n[mapping]\npreset = \"debezium\"\nheader_columns = { tenant = \"x-tenant\" }\n",
    );
    let c = load(
        Some(&path),
        &[
            PG,
            ("WALBOX_SLOT", "from_env"),
            ("WALBOX_PUBLICATION", "env_pub"),
            ("WALBOX_KAFKA_PROPERTY_CLIENT_ID", "env"),
            ("WALBOX_MAPPING_HEADER_COLUMNS", "region=x-region"),
        ],
        &[
            ("slot", &["from_flag"]),
            ("kafka.properties", &["acks=all"]),
        ],
    )
    .unwrap();
    let conn = c.connection().unwrap();
    assert_eq!(conn.slot, "from_flag");
    assert_eq!(conn.publication, "env_pub");
    assert_eq!(conn.tables.to_string(), "\"file\".\"t\"");
    let m = c.mapping().unwrap();
    assert_eq!(m.aggregate_type, "aggregatetype");
    assert_eq!(
        m.header_columns,
        [
            ("region".to_owned(), "x-region".to_owned()),
            ("tenant".to_owned(), "x-tenant".to_owned())
        ],
        "maps merge entry by entry"
    );
    let run = c.run().unwrap();
    assert_eq!(run.sink.kafka().unwrap().bootstrap_servers, "file:9092");
    let p = &run.sink.kafka().unwrap().properties;
    assert_eq!(p.get("linger.ms").map(String::as_str), Some("50"));
    assert_eq!(p.get("client.id").map(String::as_str), Some("env"));
    assert_eq!(p.get("acks").map(String::as_str), Some("all"));
}

#[test]
fn every_setting_can_come_from_the_environment() {
    let mut vars: Vec<(String, String)> = Vec::new();
    for s in SETTINGS {
        let value = match (s.key, s.kind) {
            ("pg_url", _) => "host=h user=u".to_owned(),
            ("slot", _) => "s_env".to_owned(),
            ("table", _) => "app.events".to_owned(),
            ("metrics_addr", _) => "127.0.0.1:9756".to_owned(),
            ("mapping.topic_template", _) => "t.{aggregate_type}".to_owned(),
            ("retention", _) => "7d".to_owned(),
            ("audit.interval", _) => "90s".to_owned(),
            ("backlog.max_age", _) => "5m".to_owned(),
            // Receipts are refused with exactly-once (the choice below),
            // and so is skip_delivered = true.
            ("receipts", _) => "false".to_owned(),
            ("skip_delivered", _) => "false".to_owned(),
            // Recreating and retention need the table's rows, and
            // recreating an unsharded slot.
            ("source", _) => "table".to_owned(),
            ("shards", _) => "1".to_owned(),
            ("otlp_endpoint", _) => "http://127.0.0.1:4318".to_owned(),
            ("claim_check.endpoint", _) => "http://127.0.0.1:9000".to_owned(),
            // RabbitMQ's settings are read, and Kafka stays the sink.
            ("sink", _) => "kafka".to_owned(),
            ("rabbitmq.url", _) => "amqp://u:p@rabbit:5672/%2F".to_owned(),
            (_, Kind::Number) => "4096".to_owned(),
            (_, Kind::Choice(words)) => words[1].to_owned(),
            (_, Kind::Bool) => "true".to_owned(),
            ("kafka.properties", Kind::Map) => "client.id=walbox-env".to_owned(),
            (_, Kind::Map) => "k=v".to_owned(),
            (key, Kind::Text) => format!("{}_env", key.replace('.', "_")),
        };
        vars.push((s.env(), value));
    }
    let c = Config::load(Sources {
        file: None,
        env: vars,
        flags: Vec::new(),
    })
    .unwrap();
    let sources: Vec<_> = c.effective();
    for s in SETTINGS {
        let row = sources
            .iter()
            .find(|(k, _, _)| k == s.key || k.starts_with(&format!("{}.", s.key)))
            .unwrap_or_else(|| panic!("{} missing from `walbox config`", s.key));
        assert_eq!(row.2, "environment", "{}: {row:?}", s.key);
    }
    let run = c.run().unwrap();
    assert_eq!(run.sink.kafka().unwrap().max_in_flight, 4096);
    assert_eq!(run.status_interval, Duration::from_millis(4096));
    assert_eq!(run.retention, Some(Duration::from_secs(7 * 86_400)));
    assert_eq!(run.audit_interval, Some(Duration::from_secs(90)));
    assert_eq!(run.backlog.max_age, Some(Duration::from_secs(300)));
    assert_eq!(run.backlog.max_bytes, Some(4096));
    assert_eq!(run.recreate_margin, Some(Duration::from_secs(4096)));
    assert_eq!(c.log_format(), LogFormat::Json);
    assert_eq!(c.mapping().unwrap().id, "mapping_id_env");
}

#[test]
fn a_secret_can_come_from_a_file_and_is_never_shown() {
    let dir = tempfile::tempdir().unwrap();
    let url = dir.path().join("pg_url");
    secret_file(&url, "postgres://walbox:hunter2@db:5432/app\n");
    let pw = dir.path().join("sasl");
    secret_file(&pw, "s3cret\n");
    let c = load(
        None,
        &[
            ("WALBOX_PG_URL_FILE", url.to_str().unwrap()),
            (
                "WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE",
                pw.to_str().unwrap(),
            ),
            ("WALBOX_KAFKA_BROKERS", "k:9092"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.connection().unwrap().pg.password(),
        Some(b"hunter2".as_slice())
    );
    let run = c.run().unwrap();
    assert_eq!(
        run.sink.kafka().unwrap().properties["sasl.password"],
        "s3cret"
    );
    let shown = format!("{:?}", c.effective());
    assert!(
        !shown.contains("hunter2") && !shown.contains("s3cret"),
        "{shown}"
    );
    assert!(shown.contains("<redacted>"), "{shown}");
    assert!(!format!("{run:?}").contains("s3cret"));

    // A secret file others can read is refused, naming the variable.
    let open = dir.path().join("open");
    std::fs::write(&open, "s3cret\n").unwrap();
    let e = load(
        None,
        &[
            PG,
            (
                "WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE",
                open.to_str().unwrap(),
            ),
        ],
        &[],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("configuration: WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE: ")
            && e.contains("readable by others (mode 644)")
            && !e.contains("s3cret"),
        "{e}"
    );

    let e = load(
        None,
        &[PG, ("WALBOX_PG_URL_FILE", url.to_str().unwrap())],
        &[],
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("both WALBOX_PG_URL and WALBOX_PG_URL_FILE"),
        "{e}"
    );
    let e = load(None, &[("WALBOX_PG_URL_FILE", "/nonexistent/x")], &[]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("configuration: WALBOX_PG_URL_FILE: cannot read /nonexistent/x"),
        "{e}"
    );
}

#[test]
fn bad_input_names_the_key_and_its_source() {
    let (_d, path) = file("slot = \"s\"\nslto = \"typo\"\n");
    let e = load(Some(&path), &[PG], &[]).unwrap_err().to_string();
    assert!(
        e.contains("line 2") && e.contains("unknown field `slto`"),
        "{e}"
    );

    let (_d, path) = file("status_interval_ms = \"soon\"\n");
    let e = load(Some(&path), &[PG], &[]).unwrap_err().to_string();
    assert!(
        e.contains("line 1") && e.contains("expected a whole number"),
        "{e}"
    );

    // What Helm's toToml writes for a YAML number is whole; a fraction is not.
    let (_d, path) = file("shutdown_timeout_secs = 20.0\n[topics]\npartitions = 3.0\n");
    let c = load(Some(&path), &[PG], &[]).unwrap();
    assert_eq!(c.raw.shutdown_timeout_secs, 20);
    assert_eq!(c.raw.topics.partitions, Some(3));
    let (_d, path) = file("shutdown_timeout_secs = 20.5\n");
    let e = load(Some(&path), &[PG], &[]).unwrap_err().to_string();
    assert!(
        e.contains("20.5") && e.contains("expected a whole number"),
        "{e}"
    );

    // What toToml writes in the string-valued property maps: whole floats,
    // integers and booleans are their obvious strings.
    let (_d, path) = file(
        "[kafka.properties]\n\"linger.ms\" = 5.0\n\"batch.size\" = 100000\n\"enable.ssl.certificate.verification\" = false\n\"client.id\" = \"w\"\n[topics.config]\n\"min.insync.replicas\" = 2\n",
    );
    let c = load(Some(&path), &[PG], &[]).unwrap();
    let props = &c.raw.kafka.properties;
    assert_eq!(props["linger.ms"], "5");
    assert_eq!(props["batch.size"], "100000");
    assert_eq!(props["enable.ssl.certificate.verification"], "false");
    assert_eq!(props["client.id"], "w");
    assert_eq!(c.raw.topics.config["min.insync.replicas"], "2");
    let (_d, path) = file("[topics.config]\n\"min.insync.replicas\" = 2.5\n");
    let e = load(Some(&path), &[PG], &[]).unwrap_err().to_string();
    assert!(e.contains("2.5") && e.contains("quote a fraction"), "{e}");

    let e = load(None, &[PG, ("WALBOX_STATUS_INTERVAL_MS", "soon")], &[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "configuration: WALBOX_STATUS_INTERVAL_MS: expected a whole number, got \"soon\""
    );
    let e = load(None, &[PG], &[("log_format", &["xml"])]).unwrap_err();
    assert!(
        e.to_string()
            .contains("--log-format: expected one of text, json"),
        "{e}"
    );
    let e = load(None, &[PG], &[("kafka.properties", &["novalue"])]).unwrap_err();
    assert!(
        e.to_string()
            .contains("--kafka-property: expected KEY=VALUE"),
        "{e}"
    );

    let e = load(None, &[PG, ("WALBOX_COLUMN_ID", "event_id")], &[]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "configuration: WALBOX_COLUMN_ID is now called WALBOX_MAPPING_ID"
    );

    let c = load(None, &[PG, ("WALBOX_SLOT", "My Slot")], &[]).unwrap();
    assert!(c
        .connection()
        .unwrap_err()
        .to_string()
        .contains("slot \"My Slot\""));
    let c = load(None, &[], &[]).unwrap();
    assert!(c
        .connection()
        .unwrap_err()
        .to_string()
        .contains("pg_url is required"));
    let c = load(
        None,
        &[(
            "WALBOX_PG_URL",
            "host=h user=u password=hunter2 sslmode=nope",
        )],
        &[],
    )
    .unwrap();
    let e = c.connection().unwrap_err().to_string();
    assert!(
        e.starts_with("configuration: pg_url:") && !e.contains("hunter2"),
        "{e}"
    );
    for (key, value, want) in [
        (
            "WALBOX_MAX_IN_FLIGHT_EVENTS",
            "0",
            "max_in_flight_events: must be at least 1",
        ),
        (
            "WALBOX_MAX_IN_FLIGHT_BYTES",
            "10",
            "max_in_flight_bytes: must be at least 1024",
        ),
        (
            "WALBOX_METRICS_ADDR",
            "localhost",
            "metrics_addr \"localhost\"",
        ),
        (
            "WALBOX_MAPPING_TOPIC_TEMPLATE",
            "t.{type}",
            "the placeholders are {aggregate_type}, {schema} and {table}",
        ),
        ("WALBOX_MAPPING_ID", "", "mapping.id: must not be empty"),
        (
            "WALBOX_RETENTION",
            "7 dayz",
            "retention \"7 dayz\": unknown time unit",
        ),
        ("WALBOX_RETENTION", "0s", "retention: must be at least 1s"),
        (
            "WALBOX_AUDIT_INTERVAL",
            "often",
            "audit.interval \"often\": expected number at 0; expected a duration such as 1m",
        ),
        (
            "WALBOX_AUDIT_INTERVAL",
            "500ms",
            "audit.interval: must be at least 1s",
        ),
    ] {
        let c = load(
            None,
            &[PG, ("WALBOX_KAFKA_BROKERS", "k:1"), (key, value)],
            &[],
        )
        .unwrap();
        let e = c
            .mapping()
            .err()
            .or_else(|| c.run().err())
            .unwrap()
            .to_string();
        assert!(e.contains(want), "{key}: {e}");
    }
}

#[test]
fn names_follow_one_rule() {
    for s in SETTINGS {
        let env = s.env();
        assert!(
            env.starts_with("WALBOX_") && env == env.to_uppercase(),
            "{env}"
        );
        match s.kind {
            Kind::Map => assert!(s.flag_name.is_some(), "{}: a map's flag is singular", s.key),
            _ => assert_eq!(s.flag(), s.key.replace(['.', '_'], "-")),
        }
    }
}

/// The settings table of docs/configuration.md, from [`SETTINGS`].
fn settings_markdown() -> String {
    let mut out = String::from(
        "| file key | environment | flag | default | meaning |\n|---|---|---|---|---|\n",
    );
    for s in SETTINGS {
        let default = if s.default == "—" {
            "—".to_owned()
        } else {
            format!("`{}`", s.default)
        };
        let flag = match s.kind {
            Kind::Map => format!("`--{} K=V` (repeat)", s.flag()),
            _ => format!("`--{}`", s.flag()),
        };
        out.push_str(&format!(
            "| `{}` | `{}` | {flag} | {default} | {} |\n",
            s.key,
            s.env(),
            s.doc.replace('|', "\\|")
        ));
    }
    out
}

/// docs/configuration.md lists every setting with its file key, variable and
/// flag, exactly as the table says: it cannot drift from the code. Run with
/// `WALBOX_WRITE_DOCS=1` to rewrite it.
#[test]
fn the_configuration_doc_lists_every_setting() {
    const BEGIN: &str = "<!-- settings: generated from crates/walbox/src/config/table.rs -->\n";
    const END: &str = "<!-- settings: end -->";
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md");
    let doc = std::fs::read_to_string(path).unwrap();
    let start = doc.find(BEGIN).expect("the begin marker") + BEGIN.len();
    let end = doc.find(END).expect("the end marker");
    let want = settings_markdown();
    if doc[start..end] != want {
        if std::env::var_os("WALBOX_WRITE_DOCS").is_some() {
            std::fs::write(path, format!("{}{want}{}", &doc[..start], &doc[end..])).unwrap();
        } else {
            panic!(
                "docs/configuration.md's settings table differs from the code; \
                 rerun with WALBOX_WRITE_DOCS=1 to rewrite it.\nwant:\n{want}"
            );
        }
    }
}

#[test]
fn topic_creation_settings() {
    // Off by default: nothing is created, and gapless without dead letters.
    let run = load(None, &[PG, BROKERS], &[]).unwrap().run().unwrap();
    assert_eq!(run.sink.kafka().unwrap().create_topics, None);
    assert!(run.sink.kafka().unwrap().gapless);
    let run = load(
        None,
        &[PG, BROKERS, ("WALBOX_DEAD_LETTER_TOPIC", "dlq")],
        &[],
    )
    .unwrap()
    .run()
    .unwrap();
    assert!(
        !run.sink.kafka().unwrap().gapless,
        "dead letters: the stream goes on"
    );

    let (_d, path) = file(
        "[topics]\ncreate = true\npartitions = 6\nreplication_factor = 3\nconfig = { \"min.insync.replicas\" = \"2\" }\n",
    );
    let spec = load(Some(&path), &[PG, BROKERS], &[])
        .unwrap()
        .run()
        .unwrap()
        .sink
        .kafka()
        .unwrap()
        .create_topics
        .clone()
        .expect("create");
    assert_eq!(
        (spec.partitions, spec.replication_factor),
        (Some(6), Some(3))
    );
    assert_eq!(spec.config["min.insync.replicas"], "2");

    let spec = load(None, &[PG, BROKERS, ("WALBOX_TOPICS_CREATE", "true")], &[])
        .unwrap()
        .run()
        .unwrap()
        .sink
        .kafka()
        .unwrap()
        .create_topics
        .clone()
        .expect("create");
    assert_eq!((spec.partitions, spec.replication_factor), (None, None));

    let e = load(None, &[PG, BROKERS, ("WALBOX_TOPICS_CREATE", "yes")], &[]).unwrap_err();
    assert!(e.to_string().contains("expected true or false"), "{e}");
    let e = load(None, &[PG, BROKERS], &[("topics.partitions", &["3"])])
        .unwrap()
        .run()
        .unwrap_err();
    assert!(e.to_string().contains("set topics.create = true"), "{e}");
    let e = load(
        None,
        &[PG, BROKERS, ("WALBOX_TOPICS_CREATE", "true")],
        &[("topics.partitions", &["0"])],
    )
    .unwrap()
    .run()
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("topics.partitions: must be between 1"),
        "{e}"
    );
    // The producer property walbox derives from dead_letter_topic is not
    // the operator's: refused with the configuration, before any connection.
    let e = load(
        None,
        &[PG, BROKERS],
        &[("kafka.properties", &["enable.gapless.guarantee=false"])],
    )
    .unwrap()
    .run()
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("enable.gapless.guarantee is set by walbox"),
        "{e}"
    );
}

#[test]
fn names_postgres_would_cut_are_refused() {
    let long = "p".repeat(64);
    let e = load(None, &[PG, ("WALBOX_PUBLICATION", &long)], &[])
        .unwrap()
        .connection()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("64 bytes; Postgres names are at most 63"),
        "{e}"
    );
    let e = load(
        None,
        &[PG, ("WALBOX_TABLE", &format!("app.{}", "t".repeat(64)))],
        &[],
    )
    .unwrap()
    .connection()
    .unwrap_err();
    assert!(
        e.to_string().contains("Postgres names are at most 63"),
        "{e}"
    );
    let ok = load(None, &[PG, ("WALBOX_PUBLICATION", &"p".repeat(63))], &[]).unwrap();
    assert!(ok.connection().is_ok());
}

#[test]
fn libpq_variables_fill_in_or_replace_pg_url() {
    let c = load(
        None,
        &[
            ("PGHOST", "db.example"),
            ("PGPORT", "6543"),
            ("PGUSER", "walbox"),
            ("PGDATABASE", "app"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.connection().unwrap().pg.describe(),
        "host=db.example port=6543 user=walbox dbname=app sslmode=prefer"
    );
    // pg_url's values win; the variables fill in the rest.
    let c = load(
        None,
        &[("WALBOX_PG_URL", "host=h user=u"), ("PGDATABASE", "app")],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.connection().unwrap().pg.describe(),
        "host=h port=5432 user=u dbname=app sslmode=prefer"
    );
    let e = load(None, &[], &[]).unwrap().connection().unwrap_err();
    assert!(e.to_string().contains("pg_url is required"), "{e}");
}

#[test]
fn exactly_once_settings() {
    const BROKERS: (&str, &str) = ("WALBOX_KAFKA_BROKERS", "k:9092");
    // At least once by default: no transactional producer.
    let run = load(None, &[PG, BROKERS], &[]).unwrap().run().unwrap();
    assert!(run.exactly_once.is_none());
    assert_eq!(run.sink.kafka().unwrap().transactional_id, None);

    let run = load(
        None,
        &[PG, BROKERS, ("WALBOX_SLOT", "orders")],
        &[("delivery", &["exactly-once"])],
    )
    .unwrap()
    .run()
    .unwrap();
    let eos = run.exactly_once.expect("exactly-once");
    assert_eq!(eos.transactional_id, "walbox-orders");
    assert_eq!(eos.progress_topic, "walbox.progress");
    assert_eq!(eos.bounds, crate::exactly_once::Bounds::default());
    assert_eq!(
        run.sink.kafka().unwrap().transactional_id.as_deref(),
        Some("walbox-orders")
    );

    let (_d, path) = file(
        "delivery = \"exactly-once\"\n[transactions]\nid = \"billing-eu\"\nprogress_topic = \"ops.walbox\"\nmax_events = 500\nmax_bytes = 65536\nmax_ms = 50\n",
    );
    let eos = load(Some(&path), &[PG, BROKERS], &[])
        .unwrap()
        .run()
        .unwrap()
        .exactly_once
        .unwrap();
    assert_eq!(
        (eos.transactional_id.as_str(), eos.progress_topic.as_str()),
        ("billing-eu", "ops.walbox")
    );
    assert_eq!(eos.bounds.max_events, 500);
    assert_eq!(eos.bounds.max_bytes, 65536);
    assert_eq!(eos.bounds.max_time, Duration::from_millis(50));

    // Each shard is its own producer: its own id, and its own slot.
    let shard = |vars: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS, ("WALBOX_SHARDS", "4"), ("WALBOX_SHARD", "2")];
        all.extend_from_slice(vars);
        let eos = load(None, &all, &[("delivery", &["exactly-once"])])
            .unwrap()
            .run()
            .unwrap()
            .exactly_once
            .unwrap();
        (eos.transactional_id, eos.slot)
    };
    assert_eq!(shard(&[]), ("walbox-walbox_2".into(), "walbox_2".into()));
    assert_eq!(
        shard(&[("WALBOX_TRANSACTIONS_ID", "billing")]),
        ("billing-2".into(), "walbox_2".into())
    );

    let refused = |vars: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(vars);
        load(None, &all, &[])
            .and_then(|c| c.run())
            .unwrap_err()
            .to_string()
    };
    let e = refused(&[("WALBOX_TRANSACTIONS_ID", "x")]);
    assert!(e.contains("apply to delivery = \"exactly-once\""), "{e}");
    let e = refused(&[("WALBOX_DELIVERY", "exactly-twice")]);
    assert!(
        e.contains("WALBOX_DELIVERY") && e.contains("exactly-once"),
        "{e}"
    );
    let eos = ("WALBOX_DELIVERY", "exactly-once");
    let e = refused(&[eos, ("WALBOX_TRANSACTIONS_MAX_EVENTS", "0")]);
    assert!(
        e.contains("transactions.max_events: must be at least 1"),
        "{e}"
    );
    let e = refused(&[eos, ("WALBOX_TRANSACTIONS_MAX_MS", "3600000")]);
    assert!(e.contains("transactions.max_ms"), "{e}");
    let e = refused(&[eos, ("WALBOX_TRANSACTIONS_ID", "")]);
    assert!(e.contains("transactions.id: must not be empty"), "{e}");
}

#[test]
fn sources_and_formats() {
    const BROKERS: (&str, &str) = ("WALBOX_KAFKA_BROKERS", "b:9092");
    let c = load(None, &[PG, BROKERS], &[]).unwrap();
    assert_eq!(c.connection().unwrap().source, EventSource::Table);
    assert_eq!(c.mapping().unwrap().format, EventFormat::AsStored);
    assert_eq!(c.run().unwrap().message_prefix, "walbox");

    let c = load(
        None,
        &[PG, BROKERS, ("WALBOX_SLOT", "orders")],
        &[
            ("source", &["both"]),
            ("format", &["cloudevents-structured"]),
            ("message_prefix", &["app.events"]),
        ],
    )
    .unwrap();
    assert_eq!(c.connection().unwrap().source, EventSource::Both);
    assert_eq!(
        c.mapping().unwrap().format,
        EventFormat::CloudEventsStructured {
            source: "/walbox/orders".into()
        },
        "the source attribute defaults to the slot's"
    );
    assert_eq!(c.run().unwrap().message_prefix, "app.events");

    let c = load(
        None,
        &[
            PG,
            ("WALBOX_FORMAT", "cloudevents-binary"),
            ("WALBOX_CLOUDEVENTS_SOURCE", "urn:shop:orders"),
        ],
        &[],
    )
    .unwrap();
    assert_eq!(
        c.mapping().unwrap().format,
        EventFormat::CloudEventsBinary {
            source: "urn:shop:orders".into()
        }
    );

    for (vars, expected) in [
        (
            vec![("WALBOX_CLOUDEVENTS_SOURCE", "urn:x")],
            "cloudevents_source \"urn:x\" applies to format = \"cloudevents-binary\"",
        ),
        (
            vec![("WALBOX_FORMAT", "thrift")],
            "WALBOX_FORMAT: expected one of as-stored",
        ),
    ] {
        let mut all = vec![PG];
        all.extend(vars);
        let e = load(None, &all, &[])
            .and_then(|c| c.mapping())
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{e}");
    }
    for (vars, expected) in [
        (
            vec![
                ("WALBOX_SOURCE", "both"),
                ("WALBOX_ON_SLOT_INVALIDATED", "recreate"),
            ],
            "on_slot_invalidated = \"recreate\" republishes rows of the outbox table",
        ),
        (
            vec![("WALBOX_SOURCE", "messages"), ("WALBOX_RETENTION", "7d")],
            "retention deletes rows of the outbox table",
        ),
        (
            vec![
                ("WALBOX_SHARDS", "4"),
                ("WALBOX_SHARD", "1"),
                ("WALBOX_ON_SLOT_INVALIDATED", "recreate"),
            ],
            "on_slot_invalidated = \"recreate\" is not supported with shards > 1",
        ),
        (
            vec![("WALBOX_SOURCE", "messages"), ("WALBOX_ON_DRIFT", "heal")],
            "on_drift = \"heal\" republishes rows of the outbox table",
        ),
        (
            vec![
                ("WALBOX_SHARDS", "2"),
                ("WALBOX_SHARD", "1"),
                ("WALBOX_ON_DRIFT", "heal"),
            ],
            "on_drift = \"heal\" is not supported with shards > 1",
        ),
        (
            vec![
                ("WALBOX_MAPPING_TIMESTAMP", ""),
                ("WALBOX_ON_DRIFT", "heal"),
            ],
            "on_drift = \"heal\" republishes by time and needs the timestamp column",
        ),
        (
            vec![("WALBOX_MESSAGE_PREFIX", "")],
            "message_prefix: must not be empty",
        ),
    ] {
        let mut all = vec![PG, BROKERS];
        all.extend(vars);
        let e = load(None, &all, &[])
            .unwrap()
            .run()
            .unwrap_err()
            .to_string();
        assert!(e.contains(expected), "{e}");
    }
}

#[test]
fn config_refuses_what_run_refuses() {
    const BROKERS: (&str, &str) = ("WALBOX_KAFKA_BROKERS", "k:9092");
    // Every check `run` makes is `for_run`'s, which `walbox config` calls.
    let sharded = load(None, &[PG, BROKERS, ("WALBOX_SHARDS", "2")], &[]).unwrap();
    let e = sharded.for_run().unwrap_err().to_string();
    assert!(e.contains("say which shard this process streams"), "{e}");
    let one = load(
        None,
        &[PG, BROKERS, ("WALBOX_SHARDS", "2"), ("WALBOX_SHARD", "1")],
        &[],
    )
    .unwrap();
    assert_eq!(one.for_run().unwrap().connection.slot, "walbox_1");
    // No timestamp column (empty: none).
    let retention = load(
        None,
        &[
            PG,
            BROKERS,
            ("WALBOX_RETENTION", "7d"),
            ("WALBOX_MAPPING_TIMESTAMP", ""),
        ],
        &[],
    )
    .unwrap();
    let e = retention.for_run().unwrap_err().to_string();
    assert!(e.contains("retention needs the timestamp column"), "{e}");
    // A Debezium table has no timestamp column: a lost slot could not be
    // recreated, so recreate is refused at start, not when it is lost.
    let debezium = load(
        None,
        &[
            PG,
            BROKERS,
            ("WALBOX_MAPPING_PRESET", "debezium"),
            ("WALBOX_ON_SLOT_INVALIDATED", "recreate"),
        ],
        &[],
    )
    .unwrap();
    let e = debezium.for_run().unwrap_err().to_string();
    assert!(
        e.contains("on_slot_invalidated = \"recreate\" republishes the rows written since the slot was lost, by the timestamp column (mapping.timestamp), and the mapping has none"),
        "{e}"
    );
    let with_column = load(
        None,
        &[
            PG,
            BROKERS,
            ("WALBOX_RETENTION", "7d"),
            ("WALBOX_MAPPING_TIMESTAMP", "created_at"),
        ],
        &[],
    )
    .unwrap();
    with_column.for_run().unwrap();
}

#[test]
fn a_misspelt_variable_is_refused_with_the_name_it_is_near() {
    for (typo, meant) in [
        ("WALBOX_SLOTT", "WALBOX_SLOT"),
        ("WALBOX_KAFKA_BROKER", "WALBOX_KAFKA_BROKERS"),
        ("WALBOX_PUBLICATON", "WALBOX_PUBLICATION"),
        ("WALBOX_PG_UR_FILE", "WALBOX_PG_URL_FILE"),
    ] {
        let e = load(None, &[PG, (typo, "x")], &[]).unwrap_err().to_string();
        assert!(
            e.contains(&format!(
                "{typo} is not a walbox setting: did you mean {meant}?"
            )),
            "{e}"
        );
    }
    // walbox's own variables, and the project scripts' (far from any
    // setting's), are not refused.
    let own = [
        PG,
        ("WALBOX_LOG", "debug"),
        ("WALBOX_CONFIG", "walbox.toml"),
        ("WALBOX_TEST_PG_URL", "host=h"),
        ("WALBOX_KAFKA_LIBS", "/libs"),
        ("WALBOX_PG_BIN", "/bin"),
        ("WALBOX_CACHE", "/cache"),
        ("WALBOX_KAFKA_PROPERTY_LINGER_MS", "5"),
        // Two edits from WALBOX_SINK, and set by scripts/bench.
        ("WALBOX_BIN", "/target/release/walbox"),
        ("WALBOX_ELASTICMQ_LIBS", "/libs"),
        ("WALBOX_RABBITMQ_BIN", "/usr/lib/rabbitmq/bin"),
        ("WALBOX_PIKA_PYTHON", "/py"),
    ];
    let c = load(None, &own, &[]).unwrap();
    assert_eq!(c.connection().unwrap().slot, "walbox");
}

/// No password reaches any printed form of the configuration: its Debug
/// (pg_url, secret properties, libpq's PGPASSWORD), and the effective view
/// (URLs with user information, wherever they are).
#[test]
fn no_secret_in_any_printed_form() {
    const BROKERS: (&str, &str) = ("WALBOX_KAFKA_BROKERS", "b:9092");
    let (_d, path) = file(
        "otlp_endpoint = \"http://otel:h1dden@collector:4318\"\n[kafka.properties]\n\"sasl.oauthbearer.token.endpoint.url\" = \"https://client:h2dden@idp.example/token\"\n\"sasl.password\" = \"h3dden\"\n",
    );
    let c = load(
        Some(&path),
        &[
            ("WALBOX_PG_URL", "postgres://walbox:h4dden@db:5432/app"),
            ("PGPASSWORD", "h5dden"),
            BROKERS,
        ],
        &[],
    )
    .unwrap();
    let debug = format!("{c:?}");
    let effective = format!("{:?}", c.effective());
    let run = format!("{:?}", c.run().unwrap());
    for shown in [&debug, &effective, &run] {
        for secret in ["h1dden", "h2dden", "h3dden", "h4dden", "h5dden"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
    }
    assert!(
        effective.contains("http://<redacted>@collector:4318")
            && effective.contains("https://<redacted>@idp.example/token"),
        "{effective}"
    );
    let e = load(
        None,
        &[
            PG,
            BROKERS,
            ("WALBOX_OTLP_ENDPOINT", "https://otel:h1dden@collector:4318"),
        ],
        &[],
    )
    .unwrap()
    .run()
    .unwrap_err()
    .to_string();
    assert!(
        !e.contains("h1dden") && e.contains("<redacted>@collector"),
        "{e}"
    );
}

/// Settings that work but expose the events or a secret are warned about.
#[test]
fn insecure_settings_are_warned_about() {
    let ca = tempfile::NamedTempFile::new().unwrap();
    let ca = ca.path().to_str().unwrap().to_owned();
    let verified = format!("host=db user=u password=pw sslmode=verify-full sslrootcert={ca}");
    let tls = ["security.protocol=SSL"];
    let warnings = |vars: &[(&str, &str)], flags: &[(&'static str, &[&str])]| {
        load(None, vars, flags).unwrap().warnings()
    };
    // Verified both ways, secrets from the environment: nothing to say.
    let quiet = warnings(
        &[
            ("WALBOX_PG_URL", &verified),
            ("WALBOX_KAFKA_BROKERS", "k:9093"),
        ],
        &[("kafka.properties", &tls)],
    );
    assert_eq!(quiet, Vec::<String>::new());
    // A Unix socket has no TLS to verify.
    let socket = warnings(
        &[
            ("WALBOX_PG_URL", "host=/var/run/postgresql user=u"),
            ("WALBOX_KAFKA_BROKERS", "k:9093"),
        ],
        &[("kafka.properties", &tls)],
    );
    assert_eq!(socket, Vec::<String>::new());

    let all = warnings(
        &[("WALBOX_KAFKA_BROKERS", "k:9092")],
        &[
            ("pg_url", &["postgres://u:pw@db/app?sslmode=require"]),
            ("kafka.properties", &["sasl.password=x"]),
        ],
    );
    let said = all.join("\n");
    assert_eq!(all.len(), 4, "{said}");
    assert!(
        said.contains("does not verify the server (sslmode=require)"),
        "{said}"
    );
    assert!(said.contains("Kafka is reached over plaintext"), "{said}");
    assert!(
        said.contains("give it as WALBOX_PG_URL_FILE instead"),
        "{said}"
    );
    assert!(
        said.contains("give it as WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE instead"),
        "{said}"
    );
    assert!(!said.contains("pw"), "{said}");

    let unverified = warnings(
        &[
            ("WALBOX_PG_URL", &verified),
            ("WALBOX_KAFKA_BROKERS", "k:9093"),
        ],
        &[(
            "kafka.properties",
            &[
                "security.protocol=SSL",
                "enable.ssl.certificate.verification=false",
            ],
        )],
    );
    assert_eq!(unverified.len(), 1);
    assert!(unverified[0].contains("does not verify the brokers"));
}

/// `walbox config` shows what applies: the whole connection (but the
/// password), the defaults derived from other settings, and the librdkafka
/// properties walbox sets itself.
#[test]
fn config_shows_what_it_derives_and_what_walbox_sets() {
    let c = load(
        None,
        &[
            (
                "WALBOX_PG_URL",
                "postgres://u:pw@h/db?sslmode=verify-full&sslrootcert=system&target_session_attrs=read-write&application_name=pod-a",
            ),
            ("WALBOX_SLOT", "orders"),
            ("WALBOX_KAFKA_BROKERS", "b:9092"),
            ("WALBOX_KAFKA_PROPERTY_LINGER_MS", "20"),
        ],
        &[],
    )
    .unwrap();
    let rows = c.effective();
    let get = |k: &str| {
        rows.iter()
            .find(|(key, _, _)| key == k)
            .map(|(_, v, s)| (v.as_str(), s.as_str()))
            .unwrap_or_else(|| panic!("no {k} in {rows:?}"))
    };
    let (pg, _) = get("pg_url");
    assert!(
        pg.ends_with("sslmode=verify-full sslrootcert=system target_session_attrs=read-write application_name=pod-a channel_binding=prefer")
            && !pg.contains("pw"),
        "{pg}"
    );
    assert_eq!(get("transactions.id"), ("walbox-orders", "default"));
    assert_eq!(
        get("transactions.progress_topic"),
        ("walbox.progress", "default")
    );
    assert_eq!(get("cloudevents_source"), ("/walbox/orders", "default"));
    assert_eq!(get("kafka.properties.acks"), ("all", "walbox"));
    assert_eq!(
        get("kafka.properties.partitioner"),
        ("murmur2_random", "walbox")
    );
    assert_eq!(get("kafka.properties.message.timeout.ms"), ("0", "walbox"));
    assert_eq!(get("kafka.properties.linger.ms"), ("20", "environment"));
    assert_eq!(
        rows.iter()
            .filter(|(k, _, _)| k == "kafka.properties.linger.ms")
            .count(),
        1
    );
}

#[test]
fn the_failure_policy_is_one_of_three_and_quarantine_is_bounded() {
    let run = |env: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(env);
        load(None, &all, &[]).unwrap().run()
    };
    // Unset: stop, or dead-letter when a topic is named (as before).
    let stop = run(&[]).unwrap();
    assert!(stop.sink.kafka().unwrap().gapless && stop.quarantine.is_none());
    let dlq = run(&[("WALBOX_DEAD_LETTER_TOPIC", "dlq")]).unwrap();
    assert!(!dlq.sink.kafka().unwrap().gapless && dlq.dead_letters.topic() == Some("dlq"));
    // Quarantine: held events go on, so the producer is not gapless.
    let q = run(&[("WALBOX_ON_FAILURE", "quarantine")]).unwrap();
    assert_eq!(q.quarantine, Some(100_000));
    assert!(!q.sink.kafka().unwrap().gapless && q.dead_letters.topic().is_none());
    let q = run(&[
        ("WALBOX_ON_FAILURE", "quarantine"),
        ("WALBOX_QUARANTINE_MAX_EVENTS", "5"),
    ])
    .unwrap();
    assert_eq!(q.quarantine, Some(5));
    for (env, says) in [
        (
            vec![("WALBOX_ON_FAILURE", "dead-letter")],
            "on_failure = \"dead-letter\" needs dead_letter_topic",
        ),
        (
            vec![
                ("WALBOX_ON_FAILURE", "quarantine"),
                ("WALBOX_DEAD_LETTER_TOPIC", "dlq"),
            ],
            "on_failure = \"quarantine\" and dead_letter_topic contradict",
        ),
        (
            vec![
                ("WALBOX_ON_FAILURE", "stop"),
                ("WALBOX_DEAD_LETTER_TOPIC", "dlq"),
            ],
            "on_failure = \"stop\" and dead_letter_topic contradict",
        ),
        (
            vec![
                ("WALBOX_ON_FAILURE", "quarantine"),
                ("WALBOX_QUARANTINE_MAX_EVENTS", "0"),
            ],
            "quarantine.max_events: must be at least 1",
        ),
        (
            vec![
                ("WALBOX_ON_FAILURE", "quarantine"),
                ("WALBOX_DELIVERY", "exactly-once"),
            ],
            "not supported with delivery = \"exactly-once\"",
        ),
    ] {
        let e = run(&env).unwrap_err();
        assert!(e.to_string().contains(says), "{env:?}: {e}");
    }
    let e = load(None, &[PG, BROKERS, ("WALBOX_ON_FAILURE", "skip")], &[]).unwrap_err();
    assert!(
        e.to_string()
            .contains("WALBOX_ON_FAILURE: expected one of stop, dead-letter, quarantine"),
        "{e}"
    );
}

#[test]
fn avro_needs_a_registry_which_is_checked() {
    let run = |env: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(env);
        load(None, &all, &[]).unwrap().run()
    };
    let avro = ("WALBOX_FORMAT", "avro");
    let url = ("WALBOX_SCHEMA_REGISTRY_URL", "https://registry:8081/");
    assert!(run(&[]).unwrap().schema_registry.is_none());
    let on = run(&[
        avro,
        url,
        ("WALBOX_SCHEMA_REGISTRY_USERNAME", "svc"),
        ("WALBOX_SCHEMA_REGISTRY_PASSWORD", "hunter2"),
        ("WALBOX_SCHEMA_REGISTRY_SUBJECT_STRATEGY", "topic-record"),
    ])
    .unwrap()
    .schema_registry
    .unwrap();
    assert_eq!(on.url, "https://registry:8081/");
    assert_eq!(on.password.as_deref(), Some("hunter2"));
    assert_eq!(
        on.strategy,
        crate::schema_registry::SubjectStrategy::TopicRecord
    );
    assert!(!format!("{on:?}").contains("hunter2"), "{on:?}");
    for (env, says) in [
        (vec![avro], "format = \"avro\" needs schema_registry.url"),
        (
            vec![avro, ("WALBOX_SCHEMA_REGISTRY_URL", "registry:8081")],
            "schema_registry.url \"registry:8081\": expected an http:// or https:// URL",
        ),
        (
            vec![
                avro,
                ("WALBOX_SCHEMA_REGISTRY_URL", "https://u:hunter2@registry"),
            ],
            "put the credentials in schema_registry.username and schema_registry.password",
        ),
        (
            vec![avro, url, ("WALBOX_SCHEMA_REGISTRY_PASSWORD", "x")],
            "schema_registry.password is set without schema_registry.username",
        ),
        (
            vec![
                avro,
                url,
                ("WALBOX_SCHEMA_REGISTRY_SUBJECT_STRATEGY", "record"),
                ("WALBOX_MAPPING_EVENT_TYPE", ""),
            ],
            "mapping.event_type is empty",
        ),
    ] {
        let e = run(&env).unwrap_err().to_string();
        assert!(e.contains(says), "{env:?}: {e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
    let warned = |env: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(env);
        load(None, &all, &[]).unwrap().warnings().join("\n")
    };
    assert!(warned(&[url]).contains(
        "only format = \"avro\", \"json-schema\" or \"protobuf\" uses a schema registry"
    ));
    let keyed = ("WALBOX_SCHEMA_REGISTRY_KEY", "schema");
    assert!(
        run(&[avro, url, keyed])
            .unwrap()
            .schema_registry
            .unwrap()
            .keys
    );
    assert!(!run(&[avro, url]).unwrap().schema_registry.unwrap().keys);
    for (env, says) in [
        (
            vec![("WALBOX_FORMAT", "protobuf"), url, keyed],
            "schema_registry.key = \"schema\" is not supported with format = \"protobuf\"",
        ),
        (
            vec![avro, url, keyed, ("WALBOX_ON_FAILURE", "quarantine")],
            "schema_registry.key = \"schema\" is not supported with on_failure = \"quarantine\"",
        ),
    ] {
        let e = run(&env).unwrap_err().to_string();
        assert!(e.contains(says), "{env:?}: {e}");
    }
    assert!(warned(&[keyed]).contains("only format = \"avro\" or \"json-schema\" serializes keys"));
    let json = run(&[("WALBOX_FORMAT", "json-schema"), url])
        .unwrap()
        .schema_registry
        .unwrap();
    assert_eq!(json.kind, crate::schema_registry::SchemaKind::JsonSchema);
    let e = run(&[("WALBOX_FORMAT", "json-schema")])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("format = \"json-schema\" needs schema_registry.url"),
        "{e}"
    );
    let plain = warned(&[
        avro,
        ("WALBOX_SCHEMA_REGISTRY_URL", "http://registry:8081"),
        ("WALBOX_SCHEMA_REGISTRY_USERNAME", "svc"),
        ("WALBOX_SCHEMA_REGISTRY_PASSWORD", "hunter2"),
    ]);
    assert!(
        plain.contains("the password travels unencrypted"),
        "{plain}"
    );
    assert!(!plain.contains("hunter2"));
}

#[test]
fn claim_check_is_off_without_a_bucket_and_checked_with_one() {
    let run = |env: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(env);
        load(None, &all, &[]).unwrap().run()
    };
    assert!(run(&[]).unwrap().claim_check.is_none());
    let on = run(&[
        ("WALBOX_CLAIM_CHECK_BUCKET", "events"),
        ("WALBOX_CLAIM_CHECK_ENDPOINT", "http://127.0.0.1:9000"),
    ])
    .unwrap()
    .claim_check
    .unwrap();
    assert_eq!(on.bucket, "events");
    assert_eq!(on.threshold, 900_000);
    assert_eq!(on.prefix, "walbox/");
    for (env, says) in [
        (
            vec![
                ("WALBOX_CLAIM_CHECK_BUCKET", "events"),
                ("WALBOX_CLAIM_CHECK_ENDPOINT", "minio:9000"),
            ],
            "claim_check.endpoint \"minio:9000\": expected an http:// or https:// URL",
        ),
        (
            vec![
                ("WALBOX_CLAIM_CHECK_BUCKET", "events"),
                ("WALBOX_CLAIM_CHECK_THRESHOLD_BYTES", "10"),
            ],
            "claim_check.threshold_bytes: must be at least 1024",
        ),
        (
            vec![("WALBOX_CLAIM_CHECK_BUCKET", "")],
            "claim_check.bucket: must not be empty",
        ),
    ] {
        let e = run(&env).unwrap_err();
        assert!(e.to_string().contains(says), "{env:?}: {e}");
    }
}

#[test]
fn aws_msk_iam_is_checked_with_the_other_kafka_settings() {
    let run = |env: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(env);
        load(None, &all, &[]).and_then(|c| c.run())
    };
    let iam = ("WALBOX_KAFKA_PROPERTY_SASL_MECHANISM", "AWS_MSK_IAM");
    let sink = run(&[iam, ("WALBOX_KAFKA_AWS_REGION", "eu-west-1")])
        .unwrap()
        .sink
        .kafka()
        .cloned()
        .unwrap();
    assert!(sink.msk_iam());
    assert_eq!(sink.aws_region.as_deref(), Some("eu-west-1"));
    for (env, says) in [
        (
            vec![iam, ("WALBOX_KAFKA_PROPERTY_SECURITY_PROTOCOL", "SSL")],
            "sasl.mechanism = AWS_MSK_IAM needs security.protocol = SASL_SSL",
        ),
        (
            vec![iam, ("WALBOX_KAFKA_PROPERTY_SASL_PASSWORD", "hunter2")],
            "sasl.password contradicts sasl.mechanism = AWS_MSK_IAM",
        ),
        (
            vec![iam, ("WALBOX_KAFKA_AWS_REGION", "EU_WEST")],
            "kafka.aws_region \"EU_WEST\": expected a region name",
        ),
    ] {
        let e = run(&env).unwrap_err().to_string();
        assert!(e.contains(says), "{env:?}: {e}");
        assert!(!e.contains("hunter2"), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
    let warnings = load(
        None,
        &[PG, BROKERS, ("WALBOX_KAFKA_AWS_REGION", "eu-west-1")],
        &[],
    )
    .unwrap()
    .warnings()
    .join("\n");
    assert!(
        warnings
            .contains("kafka.aws_region is set, and only sasl.mechanism = \"AWS_MSK_IAM\" uses it"),
        "{warnings}"
    );
}

#[test]
fn several_outbox_tables_come_as_a_list_and_refuse_what_works_on_one() {
    let (_dir, path) = file(
        "pg_url = \"host=h user=u\"\ntable = [\"tenant_*.outbox_events\", \"billing.outbox\"]\n[kafka]\nbrokers = \"b:9092\"\n",
    );
    let c = load(Some(&path), &[], &[]).unwrap();
    let conn = c.connection().unwrap();
    assert!(conn.tables.matches("tenant_x", "outbox_events"));
    assert!(conn.tables.matches("billing", "outbox"));
    assert!(!conn.tables.matches("billing", "outbox_events"));
    let e = conn.table("walbox audit").unwrap_err().to_string();
    assert!(
        e.contains("names several outbox tables; walbox audit works on one table"),
        "{e}"
    );
    c.for_run().unwrap();
    let several = ("WALBOX_TABLE", "tenant_*.outbox_events, billing.outbox");
    for (setting, says) in [
        (
            ("WALBOX_RETENTION", "7d"),
            "retention works on one outbox table",
        ),
        (
            ("WALBOX_ON_DRIFT", "heal"),
            "on_drift = \"heal\" works on one outbox table",
        ),
        (
            ("WALBOX_ON_SLOT_INVALIDATED", "recreate"),
            "on_slot_invalidated = \"recreate\" works on one outbox table",
        ),
        (("WALBOX_SHARDS", "2"), "shards > 1 needs one outbox table"),
    ] {
        let e = load(
            None,
            &[PG, BROKERS, several, setting, ("WALBOX_SHARD", "0")],
            &[],
        )
        .and_then(|c| c.for_run())
        .unwrap_err()
        .to_string();
        assert!(e.contains(says), "{setting:?}: {e}");
    }
    // {schema} and {table} name the row's table, which messages lack.
    let e = load(
        None,
        &[
            PG,
            BROKERS,
            ("WALBOX_SOURCE", "both"),
            ("WALBOX_MAPPING_TOPIC_TEMPLATE", "{schema}.events"),
        ],
        &[],
    )
    .and_then(|c| c.mapping())
    .unwrap_err()
    .to_string();
    assert!(e.contains("names the table"), "{e}");
}

#[test]
fn a_table_laid_out_differently_maps_by_its_own_section() {
    let head = "pg_url = \"host=h user=u\"\ntable = [\"tenant_*.outbox_events\", \"legacy.outbox\"]\nformat = \"cloudevents-binary\"\n[kafka]\nbrokers = \"b:9092\"\n[mapping]\npayload = \"body\"\ntopic_template = \"{schema}.{aggregate_type}\"\n";
    let (_dir, path) = file(&format!(
        "{head}[mapping.tables.\"legacy.outbox\"]\npreset = \"debezium\"\ntopic_template = \"legacy.{{aggregate_type}}\"\n[mapping.tables.\"tenant_old*.outbox_events\"]\nid = \"event_id\"\nheader_columns = {{ tenant = \"tenant\" }}\n"
    ));
    let c = load(Some(&path), &[], &[]).unwrap();
    c.for_run().unwrap();
    let m = c.mapping().unwrap();
    assert_eq!(m.payload, "body");
    let legacy = m.for_table("legacy", "outbox").unwrap();
    assert_eq!(
        (legacy.aggregate_type.as_str(), legacy.payload.as_str()),
        ("aggregatetype", "payload"),
        "a preset starts from its own columns, not [mapping]'s"
    );
    assert_eq!(legacy.topic_template, "legacy.{aggregate_type}");
    assert!(
        matches!(legacy.format, EventFormat::CloudEventsBinary { .. }),
        "the format is everyone's"
    );
    let old = m.for_table("tenant_old7", "outbox_events").unwrap();
    assert_eq!(
        (old.id.as_str(), old.payload.as_str()),
        ("event_id", "body"),
        "without a preset, [mapping]'s columns with its own over them"
    );
    assert_eq!(old.header_columns, [("tenant".into(), "tenant".into())]);
    assert_eq!(old.topic_template, "{schema}.{aggregate_type}");
    assert_eq!(m.for_table("tenant_a", "outbox_events").unwrap().id, "id");
    // `walbox config` shows each table's mapping as it applies.
    let shown = c.effective();
    let line = |k: &str| {
        shown
            .iter()
            .find(|(key, _, _)| key == k)
            .map(|(_, v, s)| (v.as_str(), s.contains("walbox.toml")))
    };
    assert_eq!(
        line("mapping.tables.\"legacy.outbox\".aggregate_id"),
        Some(("aggregateid", true))
    );
    assert_eq!(
        line("mapping.tables.\"tenant_old*.outbox_events\".payload"),
        Some(("body", true))
    );

    for (section, says) in [
        (
            "[mapping.tables.\"billing.outbox\"]\nid = \"x\"\n",
            "mapping.tables.\"billing.outbox\": table \"billing\".\"outbox\" is not one of the outbox tables",
        ),
        (
            "[mapping.tables.\"legacy.outbox\"]\npayload = \"\"\n",
            "mapping.tables.\"legacy.outbox\".payload: must not be empty",
        ),
        (
            "[mapping.tables.\"legacy.outbox\"]\ntopic_template = \"{tenant}\"\n",
            "mapping.tables.\"legacy.outbox\".topic_template \"{tenant}\": the placeholders are",
        ),
        (
            "[mapping.tables.\"legacy.outbox\"]\ncolour = \"red\"\n",
            "unknown field `colour`",
        ),
        (
            "[mapping.tables.\"a.b.c\"]\nid = \"x\"\n",
            "mapping.tables.\"a.b.c\"",
        ),
        (
            "[mapping.tables.\"legacy.outbox\"]\nid = \"x\"\n[mapping.tables.\"tenant_a.outbox_events, legacy.outbox\"]\nid = \"y\"\n",
            "table \"legacy\".\"outbox\" is named by mapping.tables.\"legacy.outbox\" too: give it one section",
        ),
    ] {
        let (_dir, path) = file(&format!("{head}{section}"));
        let e = load(Some(&path), &[], &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{section}: {e}");
    }
    // With one table, its columns are [mapping]'s own; with messages, there
    // is no table.
    let (_dir, path) = file(
        "pg_url = \"host=h user=u\"\n[kafka]\nbrokers = \"b:9092\"\n[mapping.tables.\"public.outbox_events\"]\nid = \"x\"\n",
    );
    let e = load(Some(&path), &[], &[])
        .and_then(|c| c.for_run())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(
            "and table = \"public\".\"outbox_events\" is one: set its columns in [mapping] itself"
        ),
        "{e}"
    );
    let e = load(Some(&path), &[("WALBOX_SOURCE", "messages")], &[])
        .and_then(|c| c.for_run())
        .unwrap_err()
        .to_string();
    assert!(e.contains("source = messages reads none"), "{e}");
    // A subject named by event type needs every table's event type.
    let (_dir, path) = file(&format!(
        "{head}[mapping.tables.\"legacy.outbox\"]\nevent_type = \"\"\n"
    ));
    let e = load(
        Some(&path),
        &[
            ("WALBOX_FORMAT", "avro"),
            ("WALBOX_SCHEMA_REGISTRY_URL", "http://r:8081"),
            ("WALBOX_SCHEMA_REGISTRY_SUBJECT_STRATEGY", "record"),
        ],
        &[],
    )
    .and_then(|c| c.for_run())
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("and mapping.tables.\"legacy.outbox\".event_type is empty"),
        "{e}"
    );
}

#[test]
fn rabbitmq_is_a_sink_of_its_own_and_refuses_what_lives_in_kafka() {
    const URL: (&str, &str) = (
        "WALBOX_RABBITMQ_URL",
        "amqp://walbox:hunter2@rabbit:5673/prod",
    );
    const SINK: (&str, &str) = ("WALBOX_SINK", "rabbitmq");
    let c = load(
        None,
        &[PG, SINK, URL, ("WALBOX_RABBITMQ_PARTITIONS", "4")],
        &[],
    )
    .unwrap();
    let run = c.for_run().unwrap().settings;
    let crate::config::SinkSettings::RabbitMq(amqp) = &run.sink else {
        panic!("rabbitmq settings")
    };
    assert_eq!(amqp.partitions, 4);
    assert_eq!(amqp.url.to_string(), "amqp://walbox@rabbit:5673/prod");
    assert_eq!(
        (amqp.exchange.as_str(), amqp.exchange_type.as_str()),
        ("walbox", "topic")
    );
    assert!(amqp.declare_exchange);
    // The password is never shown.
    let shown = format!("{:?}{:?}", c.effective(), c);
    assert!(!shown.contains("hunter2"), "{shown}");
    assert!(
        !c.effective()
            .iter()
            .any(|(k, _, _)| k.starts_with("kafka.properties.")),
        "no Kafka properties for a RabbitMQ sink"
    );
    for (extra, says) in [
        (None, "sink = \"rabbitmq\" needs rabbitmq.url"),
        (
            Some((
                "WALBOX_RABBITMQ_URL",
                "amqps://u:hunter2@h?cacertfile=/ca.pem",
            )),
            "rabbitmq.url: no query",
        ),
        (
            Some(("WALBOX_RABBITMQ_CA_FILE", "/etc/ssl/ca.pem")),
            "are for TLS: write the URL as amqps://",
        ),
        (
            Some(("WALBOX_RABBITMQ_PASSWORD", "hunter2")),
            "rabbitmq.url has a password too",
        ),
        (
            Some(("WALBOX_RABBITMQ_URL", "u:hunter2@rabbit:5672")),
            "rabbitmq.url: expected amqp://",
        ),
        (
            Some(("WALBOX_RABBITMQ_URL", "amqp://u:hunter2:rabbit")),
            "rabbitmq.url: the port is not a number",
        ),
        (
            Some(("WALBOX_RABBITMQ_PARTITIONS", "0")),
            "rabbitmq.partitions: from 1 to 1024",
        ),
        (
            Some(("WALBOX_DELIVERY", "exactly-once")),
            "delivery = \"exactly-once\" is Kafka's",
        ),
        (
            Some(("WALBOX_TOPICS_CREATE", "true")),
            "topics.create makes Kafka topics",
        ),
        (
            Some(("WALBOX_AUDIT_INTERVAL", "1m")),
            "audit.interval cannot be used with sink = \"rabbitmq\": a RabbitMQ publisher confirm does not say where in the audit stream",
        ),
        (
            Some(("WALBOX_RABBITMQ_AUDIT_STREAM", "")),
            "rabbitmq.audit_stream: a queue name of 1 to 255 bytes",
        ),
        (
            Some(("WALBOX_RABBITMQ_AUDIT_STREAM_MAX_AGE", "7 days")),
            "rabbitmq.audit_stream_max_age: \"7 days\" is not a number and one of Y, M, D, h, m, s",
        ),
        (
            Some(("WALBOX_RABBITMQ_EXCHANGE_TYPE", "direct")),
            "rabbitmq.audit_stream needs a topic or fanout exchange",
        ),
    ] {
        let mut vars = vec![PG, SINK];
        let stream_setting = extra.is_some_and(|(k, _)| {
            k.starts_with("WALBOX_RABBITMQ_AUDIT_STREAM_") || k == "WALBOX_RABBITMQ_EXCHANGE_TYPE"
        });
        if stream_setting {
            vars.push(("WALBOX_RABBITMQ_AUDIT_STREAM", "walbox.audit"));
        }
        if extra.is_some_and(|(k, _)| k != "WALBOX_RABBITMQ_URL") {
            vars.push(URL);
        }
        vars.extend(extra);
        let e = load(None, &vars, &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
    // The audit stream: its name and the retention walbox declares it with.
    let with_stream = load(
        None,
        &[
            PG,
            SINK,
            URL,
            ("WALBOX_RABBITMQ_AUDIT_STREAM", "walbox.audit"),
        ],
        &[],
    )
    .unwrap();
    let audited = with_stream.for_run().unwrap().settings;
    let crate::config::SinkSettings::RabbitMq(amqp) = &audited.sink else {
        panic!("rabbitmq settings")
    };
    assert_eq!(
        amqp.audit_stream,
        Some(sink_amqp::AuditStream {
            name: "walbox.audit".into(),
            max_age: "7D".into()
        })
    );
    assert!(crate::readback::Readback::of(&audited.sink).is_ok());
    let warned = with_stream.warnings().join("\n");
    assert!(
        warned.contains("confirmed, not returned, so it is neither dead-lettered nor held"),
        "{warned}"
    );
    assert!(crate::readback::Readback::of(&run.sink)
        .unwrap_err()
        .contains("set rabbitmq.audit_stream"));
    // The quarantine holds what RabbitMQ refuses for good (a nack, a return).
    let held = load(
        None,
        &[PG, SINK, URL, ("WALBOX_ON_FAILURE", "quarantine")],
        &[],
    )
    .and_then(|c| c.for_run())
    .unwrap();
    assert!(held.settings.quarantine.is_some());
    // Message bodies are bytes: the registry formats and claim-check too.
    let run = load(
        None,
        &[
            PG,
            SINK,
            URL,
            ("WALBOX_FORMAT", "avro"),
            ("WALBOX_SCHEMA_REGISTRY_URL", "http://registry:8080"),
            ("WALBOX_CLAIM_CHECK_BUCKET", "events"),
        ],
        &[],
    )
    .and_then(|c| c.for_run())
    .unwrap();
    assert!(run.settings.schema_registry.is_some());
    assert!(run.settings.claim_check.is_some());
    // A receipt names the exchange and routing key.
    let run = load(None, &[PG, SINK, URL, ("WALBOX_RECEIPTS", "true")], &[])
        .and_then(|c| c.for_run())
        .unwrap();
    assert!(run.settings.receipts);
    // Said at startup: the Kafka settings are ignored, and no TLS.
    let c = load(None, &[PG, SINK, URL, BROKERS], &[]).unwrap();
    let warnings = c.warnings().join("\n");
    assert!(
        warnings.contains("the kafka.* settings are ignored"),
        "{warnings}"
    );
    assert!(
        warnings.contains("RabbitMQ is reached over amqp:// (no TLS)"),
        "{warnings}"
    );
    assert!(
        !warnings.contains("Kafka is reached over plaintext"),
        "{warnings}"
    );
    // Kafka stays the default, and needs its brokers.
    let e = load(None, &[PG], &[])
        .and_then(|c| c.for_run())
        .unwrap_err()
        .to_string();
    assert!(e.contains("kafka.brokers is required"), "{e}");
}

#[test]
fn rabbitmq_over_tls_reads_its_files_up_front_and_takes_the_password_apart() {
    const SINK: (&str, &str) = ("WALBOX_SINK", "rabbitmq");
    const URL: (&str, &str) = ("WALBOX_RABBITMQ_URL", "amqps://walbox@rabbit.internal/prod");
    let dir = tempfile::tempdir().unwrap();
    let garbage = dir.path().join("ca.pem");
    std::fs::write(&garbage, "hunter2 is no certificate\n").unwrap();
    let garbage = garbage.to_str().unwrap();
    let missing = dir.path().join("missing.pem");
    let missing = missing.to_str().unwrap();

    let c = load(
        None,
        &[PG, SINK, URL, ("WALBOX_RABBITMQ_PASSWORD", "hunter2")],
        &[],
    )
    .unwrap();
    // No plain-text warning with amqps://.
    let warnings = c.warnings().join("\n");
    assert!(
        !warnings.contains("RabbitMQ is reached over amqp://"),
        "{warnings}"
    );
    match c.for_run() {
        Ok(run) => {
            let crate::config::SinkSettings::RabbitMq(amqp) = run.settings.sink else {
                panic!("rabbitmq settings")
            };
            assert!(amqp.url.tls);
            assert_eq!(amqp.url.port, 5671);
            assert_eq!(amqp.url.password, "hunter2");
            assert_eq!(
                amqp.url.to_string(),
                "amqps://walbox@rabbit.internal:5671/prod"
            );
            let shown = format!("{:?}{:?}{amqp:?}", c.effective(), c);
            assert!(!shown.contains("hunter2"), "{shown}");
        }
        // A machine without a system trust store says so, in one line.
        Err(e) => assert!(e.to_string().contains("rabbitmq.ca_file"), "{e}"),
    }
    for (extra, says) in [
        (
            vec![("WALBOX_RABBITMQ_CA_FILE", missing)],
            "rabbitmq.ca_file",
        ),
        (
            vec![("WALBOX_RABBITMQ_CA_FILE", garbage)],
            "no PEM certificate",
        ),
        (
            vec![("WALBOX_RABBITMQ_CERT_FILE", garbage)],
            "rabbitmq.cert_file needs rabbitmq.key_file",
        ),
        (
            vec![("WALBOX_RABBITMQ_SERVER_NAME", "not a name")],
            "rabbitmq.server_name: not a DNS name",
        ),
    ] {
        let mut vars = vec![PG, SINK, URL];
        vars.extend(extra.iter().copied());
        let e = load(None, &vars, &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
}

#[test]
fn nats_is_a_sink_of_its_own() {
    const SINK: (&str, &str) = ("WALBOX_SINK", "nats");
    const URL: (&str, &str) = (
        "WALBOX_NATS_URL",
        "nats://walbox:hunter2@nats.internal:4223",
    );
    // A stream is read without consuming: the continuous audit samples it.
    let c = load(
        None,
        &[
            PG,
            SINK,
            URL,
            ("WALBOX_ON_FAILURE", "quarantine"),
            ("WALBOX_AUDIT_INTERVAL", "1m"),
        ],
        &[],
    )
    .unwrap();
    let run = c.for_run().unwrap().settings;
    assert_eq!(run.audit_interval, Some(std::time::Duration::from_secs(60)));
    assert!(crate::readback::Readback::of(&run.sink).is_ok());
    let crate::config::SinkSettings::Nats(nats) = &run.sink else {
        panic!("nats settings")
    };
    assert_eq!(nats.url.to_string(), "nats://walbox@nats.internal:4223");
    assert_eq!(nats.ack_timeout, std::time::Duration::from_secs(10));
    assert!(run.quarantine.is_some());
    let shown = format!("{:?}{:?}{run:?}", c.effective(), c);
    assert!(!shown.contains("hunter2"), "{shown}");
    let warnings = c.warnings().join("\n");
    assert!(
        warnings.contains("NATS is reached over nats:// (no TLS)"),
        "{warnings}"
    );
    for (extra, says) in [
        (None, "sink = \"nats\" needs nats.url"),
        (
            Some(("WALBOX_NATS_URL", "nats//walbox:hunter2@nats:4222")),
            "nats.url: expected nats://",
        ),
        (
            Some(("WALBOX_NATS_CA_FILE", "/etc/ssl/ca.pem")),
            "nats.ca_file is for TLS",
        ),
        (
            Some(("WALBOX_DELIVERY", "exactly-once")),
            "delivery = \"exactly-once\" is Kafka's",
        ),
        (
            Some(("WALBOX_TOPICS_CREATE", "true")),
            "create a stream whose subjects take the topics",
        ),
    ] {
        let mut vars = vec![PG, SINK];
        if extra.is_some_and(|(k, _)| k != "WALBOX_NATS_URL") {
            vars.push(URL);
        }
        vars.extend(extra);
        let e = load(None, &vars, &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
}

#[test]
fn a_webhook_is_a_sink_of_its_own() {
    const SINK: (&str, &str) = ("WALBOX_SINK", "webhook");
    const URL: (&str, &str) = (
        "WALBOX_WEBHOOK_URL",
        "https://hooks.example/outbox?token=hunter2",
    );
    const SECRET: (&str, &str) = ("WALBOX_WEBHOOK_SECRET", "hunter2-signing");
    let c = load(None, &[PG, SINK, URL, SECRET], &[]).unwrap();
    let run = c.for_run().unwrap().settings;
    let crate::config::SinkSettings::Webhook(hook) = &run.sink else {
        panic!("webhook settings")
    };
    assert_eq!(hook.concurrency, 16);
    assert_eq!(hook.secret.as_deref(), Some("hunter2-signing"));
    let shown = format!("{:?}{:?}{run:?}", c.effective(), c);
    assert!(!shown.contains("hunter2"), "{shown}");
    for (extra, says) in [
        (None, "sink = \"webhook\" needs webhook.url"),
        (
            Some(("WALBOX_WEBHOOK_URL", "ftp://hunter2@hooks.example/")),
            "webhook.url: expected http:// or https://",
        ),
        (
            Some(("WALBOX_WEBHOOK_URL", "hooks.example/hunter2")),
            "webhook.url: relative URL without a base",
        ),
        (
            Some(("WALBOX_WEBHOOK_CONCURRENCY", "0")),
            "webhook.concurrency: from 1 to 256",
        ),
        (
            Some(("WALBOX_AUDIT_INTERVAL", "1m")),
            "audit.interval cannot be used with sink = \"webhook\": what an endpoint did with a request cannot be read back",
        ),
        (Some(("WALBOX_DELIVERY", "exactly-once")), "Idempotency-Key"),
    ] {
        let mut vars = vec![PG, SINK];
        if extra.is_some_and(|(k, _)| k != "WALBOX_WEBHOOK_URL") {
            vars.push(URL);
        }
        vars.extend(extra);
        let e = load(None, &vars, &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
}

#[test]
fn sqs_is_a_sink_of_its_own_with_its_queues() {
    const QUEUE: (&str, &str) = (
        "WALBOX_SQS_QUEUE_URL",
        "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo",
    );
    const DLQ: (&str, &str) = (
        "WALBOX_SQS_DEAD_LETTER_QUEUE_URL",
        "https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dl.fifo",
    );
    const SINK: (&str, &str) = ("WALBOX_SINK", "sqs");
    let c = load(None, &[PG, SINK, QUEUE], &[]).unwrap();
    let run = c.for_run().unwrap().settings;
    let crate::config::SinkSettings::Sqs(q) = run.sink else {
        panic!("sqs settings")
    };
    assert_eq!(q.queue_url, QUEUE.1);
    assert_eq!(
        (q.lanes, q.region.as_deref(), q.endpoint.as_deref()),
        (4, None, None)
    );
    assert!(q.gapless, "on_failure = stop keeps nothing after a refusal");
    assert_eq!(run.dead_letters, crate::dead_letter::DeadLetters::halt());
    assert!(
        !c.warnings().join("\n").contains("sqs"),
        "{:?}",
        c.warnings()
    );
    // A dead-letter queue turns the dead-letter policy on.
    let c = load(
        None,
        &[PG, SINK, QUEUE, DLQ, ("WALBOX_SQS_CONCURRENCY", "16")],
        &[],
    )
    .unwrap();
    let run = c.for_run().unwrap().settings;
    assert!(run.dead_letters.topic().is_some());
    let crate::config::SinkSettings::Sqs(q) = run.sink else {
        panic!("sqs settings")
    };
    assert_eq!(q.dead_letter_queue_url.as_deref(), Some(DLQ.1));
    assert_eq!(q.lanes, 16);
    assert!(!q.gapless);
    for (extra, says) in [
        (None, "sink = \"sqs\" needs sqs.queue_url"),
        (
            Some(("WALBOX_SQS_QUEUE_URL", "orders.fifo")),
            "sqs.queue_url \"orders.fifo\": expected an http:// or https:// URL",
        ),
        (
            Some(("WALBOX_SQS_DEAD_LETTER_QUEUE_URL", QUEUE.1)),
            "the events' queue itself",
        ),
        (
            Some(("WALBOX_DEAD_LETTER_TOPIC", "dl")),
            "with sink = \"sqs\" dead letters go to a queue: set sqs.dead_letter_queue_url",
        ),
        (
            Some(("WALBOX_ON_FAILURE", "dead-letter")),
            "on_failure = \"dead-letter\" needs sqs.dead_letter_queue_url",
        ),
        (
            Some(("WALBOX_SQS_CONCURRENCY", "0")),
            "sqs.concurrency: from 1 to 64",
        ),
        (
            Some(("WALBOX_SQS_ENDPOINT", "localhost:4566")),
            "sqs.endpoint \"localhost:4566\": expected an http:// or https:// URL",
        ),
        (
            Some(("WALBOX_DELIVERY", "exactly-once")),
            "delivery = \"exactly-once\" is Kafka's (its transactions); with sink = \"sqs\" delivery is at least once (on a FIFO queue SQS drops a re-sent message",
        ),
        (
            Some(("WALBOX_TOPICS_CREATE", "true")),
            "create the queues yourself (docs/sqs.md)",
        ),
    ] {
        let mut vars = vec![PG, SINK];
        if extra.is_some_and(|(k, _)| k != "WALBOX_SQS_QUEUE_URL") {
            vars.push(QUEUE);
        }
        vars.extend(extra);
        let e = load(None, &vars, &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e}");
    }
    // The quarantine holds what SQS refuses for good (a per-entry failure,
    // a message too large for the queue).
    let held = load(
        None,
        &[PG, SINK, QUEUE, ("WALBOX_ON_FAILURE", "quarantine")],
        &[],
    )
    .and_then(|c| c.for_run())
    .unwrap();
    assert!(held.settings.quarantine.is_some());
    // Claim-check pointers are text; the registry's wire format is not,
    // and a queue cannot be read without taking its messages.
    let run = load(
        None,
        &[PG, SINK, QUEUE, ("WALBOX_CLAIM_CHECK_BUCKET", "events")],
        &[],
    )
    .and_then(|c| c.for_run())
    .unwrap();
    assert!(run.settings.claim_check.is_some());
    for (extra, says) in [
        (
            vec![
                ("WALBOX_FORMAT", "avro"),
                ("WALBOX_SCHEMA_REGISTRY_URL", "http://registry:8080"),
            ],
            "cannot go to SQS: a message body is text",
        ),
        (
            vec![("WALBOX_AUDIT_INTERVAL", "1m")],
            "audit.interval cannot be used with sink = \"sqs\": a queue cannot be read without taking its messages",
        ),
    ] {
        let mut vars = vec![PG, SINK, QUEUE];
        vars.extend(extra.iter().copied());
        let e = load(None, &vars, &[])
            .and_then(|c| c.for_run())
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{extra:?}: {e}");
    }
    // Said at startup: a standard queue keeps no order; Kafka's settings
    // are ignored.
    let standard = (
        "WALBOX_SQS_QUEUE_URL",
        "https://sqs.eu-west-1.amazonaws.com/123456789012/orders",
    );
    let c = load(None, &[PG, SINK, standard, BROKERS], &[]).unwrap();
    let warnings = c.warnings().join("\n");
    assert!(
        warnings.contains("sqs.queue_url is a standard queue"),
        "{warnings}"
    );
    assert!(
        warnings.contains("sink = \"sqs\": the kafka.* settings are ignored"),
        "{warnings}"
    );
    assert!(
        !warnings.contains("Kafka is reached over plaintext"),
        "{warnings}"
    );
}

/// Heals, recreated slots and resyncs publish through the configured
/// broker (`crate::broker`), so every sink takes them.
#[test]
fn republishing_rows_is_taken_with_every_sink() {
    let rabbit = [
        ("WALBOX_SINK", "rabbitmq"),
        ("WALBOX_RABBITMQ_URL", "amqp://walbox:pw@rabbit:5672/%2F"),
    ];
    let sqs = [
        ("WALBOX_SINK", "sqs"),
        (
            "WALBOX_SQS_QUEUE_URL",
            "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo",
        ),
    ];
    for sink in [&rabbit[..], &sqs[..], &[BROKERS][..]] {
        for policy in [
            ("WALBOX_ON_DRIFT", "heal"),
            ("WALBOX_ON_SLOT_INVALIDATED", "recreate"),
        ] {
            let mut vars = vec![PG, policy];
            vars.extend_from_slice(sink);
            let run = load(None, &vars, &[])
                .and_then(|c| c.for_run())
                .unwrap_or_else(|e| panic!("{policy:?} with {sink:?}: {e}"))
                .settings;
            assert!(
                run.drift_heal_margin.is_some() || run.recreate_margin.is_some(),
                "{policy:?}"
            );
        }
    }
}

/// Every broker-independent feature on every broker: accepted, or refused
/// in one line whose reason names the broker's own limit. The table is the
/// promise of docs/rabbitmq.md, docs/sqs.md, docs/nats.md and
/// docs/webhooks.md ("Not with …").
#[test]
fn each_feature_on_each_broker_is_taken_or_refused_for_the_brokers_own_reason() {
    let brokers: [(&str, &[(&str, &str)]); 5] = [
        ("kafka", &[("WALBOX_KAFKA_BROKERS", "k:9092")]),
        (
            "rabbitmq",
            &[
                ("WALBOX_SINK", "rabbitmq"),
                ("WALBOX_RABBITMQ_URL", "amqp://u:hunter2@rabbit:5672/"),
            ],
        ),
        (
            "sqs",
            &[
                ("WALBOX_SINK", "sqs"),
                (
                    "WALBOX_SQS_QUEUE_URL",
                    "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo",
                ),
            ],
        ),
        (
            "nats",
            &[
                ("WALBOX_SINK", "nats"),
                ("WALBOX_NATS_URL", "nats://u:hunter2@nats:4222"),
            ],
        ),
        (
            "webhook",
            &[
                ("WALBOX_SINK", "webhook"),
                (
                    "WALBOX_WEBHOOK_URL",
                    "https://hooks.example/in?token=hunter2",
                ),
            ],
        ),
    ];
    type Feature = (&'static str, &'static [(&'static str, &'static str)]);
    let features: [Feature; 8] = [
        ("quarantine", &[("WALBOX_ON_FAILURE", "quarantine")]),
        (
            "claim-check",
            &[
                ("WALBOX_CLAIM_CHECK_BUCKET", "events"),
                ("WALBOX_CLAIM_CHECK_ENDPOINT", "http://127.0.0.1:9000"),
            ],
        ),
        (
            "avro",
            &[
                ("WALBOX_FORMAT", "avro"),
                ("WALBOX_SCHEMA_REGISTRY_URL", "http://registry:8081"),
            ],
        ),
        ("receipts", &[("WALBOX_RECEIPTS", "true")]),
        ("audit.interval", &[("WALBOX_AUDIT_INTERVAL", "1m")]),
        ("exactly-once", &[("WALBOX_DELIVERY", "exactly-once")]),
        ("topics.create", &[("WALBOX_TOPICS_CREATE", "true")]),
        (
            "audit stream",
            &[("WALBOX_RABBITMQ_AUDIT_STREAM", "walbox.audit")],
        ),
    ];
    // (broker, feature) → the refusal's words; absent: accepted.
    let refused = |broker: &str, feature: &str| -> Option<&str> {
        Some(match (broker, feature) {
            ("sqs", "avro") => "a message body is text",
            ("sqs", "audit.interval") => "a queue cannot be read without taking its messages",
            ("webhook", "audit.interval") => {
                "what an endpoint did with a request cannot be read back"
            }
            ("rabbitmq", "audit.interval") => {
                "a RabbitMQ publisher confirm does not say where in the audit stream"
            }
            (b, "exactly-once") if b != "kafka" => "is Kafka's (its transactions)",
            (b, "topics.create") if b != "kafka" => "topics.create makes Kafka topics",
            _ => return None,
        })
    };
    let mut checked = 0;
    for (broker, env) in &brokers {
        for (feature, with) in &features {
            // rabbitmq.* settings are RabbitMQ's (ignored elsewhere).
            if *feature == "audit stream" && *broker != "rabbitmq" {
                continue;
            }
            let mut vars = vec![PG];
            vars.extend_from_slice(env);
            vars.extend_from_slice(with);
            let got = load(None, &vars, &[]).and_then(|c| c.for_run());
            match (refused(broker, feature), got) {
                (None, Ok(_)) => {}
                (None, Err(e)) => panic!("{feature} on {broker}: refused: {e}"),
                (Some(_), Ok(_)) => panic!("{feature} on {broker}: accepted"),
                (Some(says), Err(e)) => {
                    let e = e.to_string();
                    assert!(e.contains(says), "{feature} on {broker}: {e}");
                    assert_eq!(e.lines().count(), 1, "{e}");
                    assert!(!e.contains("hunter2"), "{e}");
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 5 * 7 + 1);
}

#[test]
fn a_variable_in_a_settings_family_that_is_none_is_warned_of() {
    let warnings = |var: (&str, &str)| {
        load(None, &[PG, BROKERS, var], &[])
            .unwrap()
            .warnings()
            .join("\n")
    };
    let w = warnings(("WALBOX_METRICS_PORT", "9000"));
    assert!(
        w.contains("WALBOX_METRICS_PORT is not a walbox setting and is ignored: did you mean WALBOX_METRICS_ADDR?"),
        "{w}"
    );
    // The test tooling's own, and a script's variable outside any family.
    for quiet in [
        "WALBOX_KAFKA_LIBS",
        "WALBOX_NATS_SERVER",
        "WALBOX_TEST_PG_URL",
        "WALBOX_MY_SCRIPT",
    ] {
        assert!(!warnings((quiet, "x")).contains(quiet), "{quiet}");
    }
}

#[test]
fn skip_delivered_is_on_for_kafka_at_least_once_and_refused_where_it_cannot_work() {
    let run = |vars: &[(&str, &str)]| {
        let mut all = vec![PG, BROKERS];
        all.extend_from_slice(vars);
        load(None, &all, &[]).unwrap().run()
    };
    assert_eq!(run(&[]).unwrap().skip_delivered, Some(100_000));
    assert_eq!(
        run(&[("WALBOX_SKIP_DELIVERED_LOOK_BACK", "7")])
            .unwrap()
            .skip_delivered,
        Some(7)
    );
    assert_eq!(
        run(&[("WALBOX_SKIP_DELIVERED", "false")])
            .unwrap()
            .skip_delivered,
        None
    );
    let eos = ("WALBOX_DELIVERY", "exactly-once");
    assert_eq!(run(&[eos]).unwrap().skip_delivered, None, "its own skip");
    let e = run(&[eos, ("WALBOX_SKIP_DELIVERED", "true")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("exactly-once mode skips what committed"), "{e}");
    let e = run(&[("WALBOX_SKIP_DELIVERED_LOOK_BACK", "0")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("skip_delivered = false"), "{e}");
    // Other brokers: off by default, `true` refused with the reason.
    let rabbit = [
        ("WALBOX_SINK", "rabbitmq"),
        ("WALBOX_RABBITMQ_URL", "amqp://rabbit:5672/%2F"),
    ];
    assert_eq!(run(&rabbit).unwrap().skip_delivered, None);
    let mut on = rabbit.to_vec();
    on.push(("WALBOX_SKIP_DELIVERED", "true"));
    let e = run(&on).unwrap_err().to_string();
    assert!(e.contains("a RabbitMQ exchange keeps nothing"), "{e}");
}
