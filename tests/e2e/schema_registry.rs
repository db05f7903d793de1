//! `format = "avro"`, `"json-schema"` and `"protobuf"` against a real schema registry
//! (Apicurio Registry 3.0.9, in-memory storage, its Confluent-compatible
//! API; scripts/test fetches it from Maven Central) and Apache Kafka. The
//! schemas are registered, and every record read back, by Confluent's own
//! Python client (confluent-kafka's SchemaRegistryClient, AvroDeserializer,
//! JSONDeserializer, which validates, and ProtobufDeserializer with classes
//! Google's protoc generates), not by walbox's code: 5,000
//! events over 50 event types (RecordNameStrategy), two kill -9s, an
//! invalid payload dead-lettered with the reason, and the registry stopped
//! for more than 10 s while event types walbox has not looked up yet
//! arrive: nothing skipped. And the registry over HTTPS with basic
//! authentication: the right password, a wrong one (a stop before the
//! event, in one line), neither in the log.

use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdkafka::message::{Message, OwnedMessage};
use walbox_test_harness::kafka::{consume_until_quiet, headers_of};
use walbox_test_harness::pg::fresh_db;
use walbox_test_harness::wait::wait_for;

use crate::support::*;

/// Event types: `shop.Event0` … `shop.Event49`; the last 10 first appear
/// at event 3,000.
const TYPES: i64 = 50;
const TOTAL: i64 = 5_000;
/// The event whose payload does not fit its schema (`n` is text).
const INVALID: i64 = 1_234;

/// The Python with confluent-kafka's schema-registry client, fastavro,
/// jsonschema, protobuf and protoc (grpcio-tools).
fn python() -> String {
    python_with(
        "WALBOX_CONFLUENT_PYTHON",
        "confluent_kafka.schema_registry.avro, confluent_kafka.schema_registry.json_schema, confluent_kafka.schema_registry.protobuf, grpc_tools.protoc",
        "confluent-kafka[avro,json,protobuf,schemaregistry]==2.12.2 grpcio-tools==1.85.1",
    )
}

/// A format under test: its name, and the registry's name for its schemas.
#[derive(Clone, Copy)]
enum Format {
    Avro,
    JsonSchema,
    Protobuf,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Format::Avro => "avro",
            Format::JsonSchema => "json-schema",
            Format::Protobuf => "protobuf",
        }
    }

    fn schema_type(self) -> &'static str {
        match self {
            Format::Avro => "AVRO",
            Format::JsonSchema => "JSON",
            Format::Protobuf => "PROTOBUF",
        }
    }
}

/// Apicurio Registry on a free local port, killed when dropped.
struct Registry {
    child: Child,
    /// Its Confluent-compatible API.
    url: String,
    /// The confluent-kafka client's settings beyond the URL (TLS, auth).
    client_conf: Vec<(String, String)>,
    _dir: tempfile::TempDir,
}

/// The user the secured registry knows, and its password.
const USER: &str = "walbox";
const PASSWORD: &str = "s3cret-registry-password";

impl Registry {
    async fn start() -> Registry {
        Registry::start_with(None).await
    }

    /// With `certs`: HTTPS only (Quarkus' TLS listener with the server
    /// certificate) and HTTP basic authentication of [`USER`] on its APIs.
    async fn start_with(certs: Option<&walbox_test_harness::tls::Certificates>) -> Registry {
        let jar = std::env::var("WALBOX_APICURIO_JAR").unwrap_or_else(|_| {
            panic!("WALBOX_APICURIO_JAR is not set: run scripts/test (scripts/install-apicurio fetches Apicurio Registry)")
        });
        let port = walbox_test_harness::port::free_port();
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("registry.log")).unwrap();
        let mut args = vec![
            "-Xmx384m".to_owned(),
            format!("-Dquarkus.http.port={port}"),
            "-Dquarkus.http.host=127.0.0.1".to_owned(),
        ];
        let mut client_conf = Vec::new();
        let secured_port = certs.map(|certs| {
            let tls_port = walbox_test_harness::port::free_port();
            let users = format!("-Dquarkus.security.users.embedded.users.{USER}={PASSWORD}");
            let roles = format!("-Dquarkus.security.users.embedded.roles.{USER}=sr-admin");
            args.extend([
                format!("-Dquarkus.http.ssl-port={tls_port}"),
                format!(
                    "-Dquarkus.http.ssl.certificate.files={}",
                    certs.server_cert().display()
                ),
                format!(
                    "-Dquarkus.http.ssl.certificate.key-files={}",
                    certs.server_key().display()
                ),
                "-Dquarkus.http.auth.basic=true".to_owned(),
                "-Dquarkus.security.users.embedded.enabled=true".to_owned(),
                "-Dquarkus.security.users.embedded.plain-text=true".to_owned(),
                users,
                roles,
                "-Dquarkus.http.auth.permission.apis.paths=/apis/*".to_owned(),
                "-Dquarkus.http.auth.permission.apis.policy=authenticated".to_owned(),
            ]);
            client_conf.push((
                "basic.auth.user.info".to_owned(),
                format!("{USER}:{PASSWORD}"),
            ));
            client_conf.push((
                "ssl.ca.location".to_owned(),
                certs.ca().display().to_string(),
            ));
            tls_port
        });
        args.extend(["-jar".to_owned(), jar]);
        let child = Command::new("java")
            .args(&args)
            .current_dir(dir.path())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start java");
        let addr = format!("127.0.0.1:{port}");
        let url = match secured_port {
            Some(tls) => format!("https://127.0.0.1:{tls}/apis/ccompat/v7"),
            None => format!("http://{addr}/apis/ccompat/v7"),
        };
        let registry = Registry {
            child,
            url,
            client_conf,
            _dir: dir,
        };
        wait_for("the registry to be ready", Duration::from_secs(120), || {
            let got = http_get(&addr, "/health/ready");
            async move {
                match got {
                    Some((200, _)) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            }
        })
        .await;
        registry
    }

    /// `walbox run`'s flags for events to `topic` in `format` (`avro`,
    /// `json-schema`, `protobuf`) with this registry, a subject per event
    /// type (RecordNameStrategy).
    fn flags<'a>(&'a self, topic: &'a str, format: &'a str) -> Vec<&'a str> {
        vec![
            "--mapping-topic-template",
            topic,
            "--format",
            format,
            "--schema-registry-url",
            &self.url,
            "--schema-registry-subject-strategy",
            "record",
        ]
    }

    /// Registers every event type's schema in `format` (subject
    /// `shop.Event<k>`); the ids by subject.
    fn register_all(&self, format: Format) -> serde_json::Value {
        let schemas: HashMap<String, String> = (0..TYPES)
            .map(|k| (format!("shop.Event{k}"), schema(format, k)))
            .collect();
        self.tool(
            "register",
            format.schema_type(),
            &serde_json::to_string(&schemas).unwrap(),
        )
    }

    /// Runs the confluent-kafka tool with `action` on schemas of type
    /// `schema_type`, `input` on its stdin.
    fn tool(&self, action: &str, schema_type: &str, input: &str) -> serde_json::Value {
        let conf = serde_json::to_string(
            &self
                .client_conf
                .iter()
                .cloned()
                .collect::<HashMap<String, String>>(),
        )
        .unwrap();
        let out = run_tool(
            &python(),
            "registry_client.py",
            &[action, &self.url, schema_type, &conf],
            input,
        );
        serde_json::from_str(&out).unwrap()
    }

    fn signal(&self, signal: &str) {
        signal_child(&self.child, signal);
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.signal("-CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Event type `k`'s schema: named after it, with a field of its own
/// (`f<k>`), so a record read with another type's schema fails.
fn schema(format: Format, k: i64) -> String {
    if let Format::Protobuf = format {
        return format!(
            "syntax = \"proto3\";\npackage shop;\nmessage Event{k} {{\n  int64 n = 1;\n  int32 k = 2;\n  string label = 3;\n  optional string note = 4;\n  int64 f{k} = 5;\n}}\n"
        );
    }
    if let Format::JsonSchema = format {
        let mut properties = serde_json::json!({
            "n": {"type": "integer"},
            "k": {"type": "integer"},
            "label": {"type": "string"},
            "note": {"type": ["string", "null"]},
        });
        properties[format!("f{k}")] = serde_json::json!({"type": "integer"});
        return serde_json::json!({
            "$schema": "http://json-schema.org/draft-07/schema#",
            "title": format!("shop.Event{k}"),
            "type": "object",
            "properties": properties,
            "required": ["n", "k", "label", format!("f{k}")],
            "additionalProperties": false,
        })
        .to_string();
    }
    serde_json::json!({
        "type": "record", "name": format!("Event{k}"), "namespace": "shop",
        "fields": [
            {"name": "n", "type": "long"},
            {"name": "k", "type": "int"},
            {"name": "label", "type": "string"},
            {"name": "note", "type": ["null", "string"], "default": null},
            {"name": format!("f{k}"), "type": "long"},
        ]
    })
    .to_string()
}

/// The event type of event `n`.
fn type_of(n: i64) -> i64 {
    if n < 3_000 {
        n % 40
    } else {
        n % TYPES
    }
}

/// The payload walbox must have serialized for event `n`, as the
/// deserializer gives it back.
fn expected(n: i64) -> serde_json::Value {
    let k = type_of(n);
    let mut v = serde_json::json!({
        "n": n, "k": k, "label": format!("e{n}"),
        "note": if n % 3 == 0 { serde_json::Value::Null } else { format!("note {n}").into() },
    });
    v[format!("f{k}")] = (n * 2).into();
    v
}

/// Inserts events `from..to`, `per_tx` to a transaction.
async fn insert(client: &tokio_postgres::Client, from: i64, to: i64, per_tx: i64) {
    let mut at = from;
    while at < to {
        let end = (at + per_tx).min(to);
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) \
                 SELECT 'shop', 'agg-' || (n % 37), 'shop.Event' || k, \
                        jsonb_build_object('n', CASE WHEN n = $3 THEN to_jsonb('n' || n) ELSE to_jsonb(n) END, \
                                           'k', k, 'label', 'e' || n, \
                                           'note', CASE WHEN n % 3 = 0 THEN NULL ELSE 'note ' || n END, \
                                           'f' || k, n * 2), \
                        jsonb_build_object('n', n::text) \
                 FROM (SELECT n, CASE WHEN n < 3000 THEN n % 40 ELSE n % 50 END AS k \
                       FROM generate_series($1::int8, $2::int8 - 1) n) s",
                &[&at, &end, &INVALID],
            )
            .await
            .unwrap();
        at = end;
    }
}

/// The records' values for the tool's `decode`: topic and hex bytes.
fn values_of(messages: &[OwnedMessage]) -> String {
    wire_of(messages, |m| m.payload())
}

/// The records' keys for the tool's `decode`, as [`values_of`].
fn keys_of(messages: &[OwnedMessage]) -> String {
    wire_of(messages, |m| m.key())
}

fn wire_of(messages: &[OwnedMessage], part: impl Fn(&OwnedMessage) -> Option<&[u8]>) -> String {
    let values: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            let hex: String = part(m)
                .unwrap()
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            serde_json::json!({"topic": m.topic(), "value": hex})
        })
        .collect();
    serde_json::to_string(&values).unwrap()
}

/// An event's number, from its `n` header (the headers column).
fn n(m: &OwnedMessage) -> i64 {
    headers_of(m)["n"].parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_records_read_back_by_confluents_deserializer_through_kills_and_an_outage() {
    read_back_through_kills_and_an_outage(Format::Avro, false).await;
}

/// The same with `delivery = "exactly-once"`: a `read_committed` consumer
/// reads every event once, through the kills and the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_records_exactly_once_through_kills_and_an_outage() {
    read_back_through_kills_and_an_outage(Format::Avro, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_records_read_back_by_confluents_deserializer_through_kills_and_an_outage() {
    read_back_through_kills_and_an_outage(Format::JsonSchema, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_records_read_back_by_confluents_deserializer_through_kills_and_an_outage() {
    read_back_through_kills_and_an_outage(Format::Protobuf, false).await;
}

async fn read_back_through_kills_and_an_outage(format: Format, exactly_once: bool) {
    let registry = Registry::start().await;
    let ids = registry.register_all(format);
    let id_of = |k: i64| ids[format!("shop.Event{k}")].as_u64().unwrap();

    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let dead_letters = kafka.create_topic(1).await;
    // Created by walbox (compacted) on its first exactly-once start.
    let progress = format!("{topic}.progress");
    let mut flags = registry.flags(&topic, format.name());
    flags.extend(["--dead-letter-topic", &dead_letters]);
    if exactly_once {
        flags.extend([
            "--delivery",
            "exactly-once",
            "--transactions-progress-topic",
            &progress,
        ]);
    }
    let start = || spawn_run(&db, &kafka, &flags);
    let mut relay = start();
    wait_log(&relay, "streaming from the slot").await;

    // kill -9 while the first events are in flight.
    insert(&client, 0, 1_500, 50).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    relay.kill9();
    relay = start();
    insert(&client, 1_500, 3_000, 25).await;
    wait_distinct(&kafka, &topic, 2_999, n).await;

    // The registry stops answering while events of types walbox has not
    // looked up yet arrive (shop.Event40 first at 3,040): they wait, and a
    // kill -9 meanwhile loses nothing.
    registry.signal("-STOP");
    let stopped = std::time::Instant::now();
    insert(&client, 3_000, 4_000, 100).await;
    wait_for(
        "walbox to log the registry's outage",
        Duration::from_secs(60),
        || {
            let log = relay.log();
            async move {
                if log.contains("schema registry: looking up subject \"shop.Event4") {
                    Ok(())
                } else {
                    Err("not yet".to_owned())
                }
            }
        },
    )
    .await;
    relay.kill9();
    relay = start();
    let outage = Duration::from_secs(12).saturating_sub(stopped.elapsed());
    tokio::time::sleep(outage).await;
    eprintln!("registry stopped for {:?}", stopped.elapsed());
    registry.signal("-CONT");
    insert(&client, 4_000, TOTAL, 10).await;

    let messages = wait_distinct(&kafka, &topic, (TOTAL - 1) as usize, n).await;
    let duplicates = messages.len() - (TOTAL - 1) as usize;
    eprintln!("{duplicates} duplicates after two kill -9s");
    if exactly_once {
        assert_eq!(duplicates, 0, "read_committed sees every event once");
    }

    // Every record read by Confluent's deserializer with the schema its
    // id names: the right type's, every field as written.
    let decoded = registry.tool("decode", format.schema_type(), &values_of(&messages));
    let decoded = decoded.as_array().unwrap();
    assert_eq!(decoded.len(), messages.len());
    let mut sorted: Vec<(&OwnedMessage, &serde_json::Value)> =
        messages.iter().zip(decoded).collect();
    sorted.sort_by_key(|(m, _)| (m.partition(), m.offset()));
    let (mut seen, mut last) = (HashSet::new(), HashMap::<Vec<u8>, i64>::new());
    for (m, d) in sorted {
        let n = n(m);
        let k = type_of(n);
        assert_eq!(d["value"], expected(n), "event {n}");
        assert_eq!(d["schema_id"].as_u64().unwrap(), id_of(k), "event {n}");
        let key = m.key().unwrap().to_vec();
        assert_eq!(key, format!("agg-{}", n % 37).into_bytes(), "event {n}");
        let h = headers_of(m);
        assert_eq!(h["event_type"], format!("shop.Event{k}"));
        assert_eq!(h["id"].len(), 36, "the event id header: {h:?}");
        if seen.insert(n) {
            let prev = last.insert(key, n);
            assert!(prev.is_none_or(|p| p < n), "per-key order at {n}");
        }
    }
    assert!(!seen.contains(&INVALID));

    // The invalid event: on the dead-letter topic, as stored, with the reason.
    let copies = consume_until_quiet(
        &kafka,
        &dead_letters,
        Duration::from_secs(2),
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    assert!(!copies.is_empty());
    if exactly_once {
        assert_eq!(copies.len(), 1, "the dead-lettered event once");
    }
    for copy in &copies {
        let h = headers_of(copy);
        assert_eq!(h["walbox.error.kind"], "invalid");
        assert_eq!(h["walbox.original.topic"], topic);
        assert_eq!(h["n"], INVALID.to_string());
        assert!(
            h["walbox.error"].contains(&format!(
                "does not match schema {} of subject \"shop.Event{}\"",
                id_of(type_of(INVALID)),
                type_of(INVALID)
            )),
            "{}",
            h["walbox.error"]
        );
        let value: serde_json::Value = serde_json::from_slice(copy.payload().unwrap()).unwrap();
        assert_eq!(value["n"], format!("n{INVALID}"));
    }
    stop(&mut relay).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_over_https_with_basic_auth_and_a_wrong_password_stops_walbox_before_the_event()
{
    let certs = walbox_test_harness::tls::Certificates::generate();
    let registry = Registry::start_with(Some(&certs)).await;
    registry.register_all(Format::Avro);
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("registry-password");
    let ca = certs.ca().display().to_string();
    let mut flags = registry.flags(&topic, "avro");
    flags.extend([
        "--schema-registry-username",
        USER,
        "--schema-registry-ca-file",
        &ca,
    ]);
    let start = || {
        let mut c = walbox(&db, &[]);
        c.env("WALBOX_SCHEMA_REGISTRY_PASSWORD_FILE", &password_file);
        spawn_run_with(c, &kafka, &flags)
    };
    walbox_test_harness::secret_file::write(&password_file, format!("{PASSWORD}\n"));
    let mut relay = start();
    insert(&client, 0, 100, 10).await;
    let messages = wait_distinct(&kafka, &topic, 100, n).await;
    let decoded = registry.tool("decode", "AVRO", &values_of(&messages));
    for (m, d) in messages.iter().zip(decoded.as_array().unwrap()) {
        assert_eq!(d["value"], expected(n(m)));
    }
    let log = stop(&mut relay).await;
    assert!(!log.contains(PASSWORD), "the password in the log");

    // A CA that did not sign the registry's certificate: no retry fixes
    // that, so walbox stops in one line, the slot before the events.
    let other_ca = certs.other_ca().display().to_string();
    let untrusted: Vec<&str> = flags
        .iter()
        .map(|f| {
            if *f == ca.as_str() {
                other_ca.as_str()
            } else {
                f
            }
        })
        .collect();
    let mut c = walbox(&db, &[]);
    c.env("WALBOX_SCHEMA_REGISTRY_PASSWORD_FILE", &password_file);
    relay = spawn_run_with(c, &kafka, &untrusted);
    insert(&client, 100, 110, 10).await;
    let (status, log) = wait_exit(&mut relay).await;
    assert!(!status.success(), "{log}");
    let line = log.lines().last().unwrap_or_default();
    assert!(
        line.contains("the registry's TLS certificate is not trusted")
            && line.contains("schema_registry.ca_file"),
        "{log}"
    );

    // A wrong password: the registry refuses, walbox stops in one line with
    // the slot before the events; with the right one they all arrive.
    let wrong = "not-the-registry-password";
    walbox_test_harness::secret_file::write(&password_file, wrong);
    relay = start();
    insert(&client, 110, 150, 10).await;
    let (status, log) = wait_exit(&mut relay).await;
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("the registry refused access (HTTP 401"),
        "{log}"
    );
    assert!(
        !log.contains(wrong) && !log.contains(PASSWORD),
        "a password in the log"
    );
    walbox_test_harness::secret_file::write(&password_file, PASSWORD);
    relay = start();
    wait_distinct(&kafka, &topic, 150, n).await;
    stop(&mut relay).await;
}

/// With `on_failure = "quarantine"`, the invalid event holds its aggregate
/// (the event behind it too) while the others flow; fixed with SQL on
/// walbox.quarantine and released, both go out serialized, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_event_is_held_fixed_with_sql_and_released_serialized() {
    let registry = Registry::start().await;
    registry.register_all(Format::Avro);
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            &registry.flags(&topic, "avro")[..],
            &["--on-failure", "quarantine"],
        ]
        .concat(),
    );
    wait_log(&relay, "streaming from the slot").await;
    // 1,234 (aggregate agg-13) does not fit; 1,271 is agg-13's next event.
    insert(&client, 1_200, 1_300, 10).await;
    let flowing = wait_distinct(&kafka, &topic, 98, n).await;
    assert!(flowing.iter().all(|m| m.key() != Some(&b"agg-13"[..])));
    let listed: Vec<serde_json::Value> =
        serde_json::from_str(&quarantine(&db, &["list", "--json"])).unwrap();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["key"], "agg-13");
    assert_eq!(listed[0]["events"], 2);
    let error = listed[0]["error"].as_str().unwrap();
    assert!(error.contains("does not match schema"), "{error}");

    let fixed = client
        .execute(
            "UPDATE walbox.quarantine SET value = convert_to($1, 'UTF8') \
             WHERE slot = 'walbox' AND kind = 'invalid'",
            &[&expected(INVALID).to_string()],
        )
        .await
        .unwrap();
    assert_eq!(fixed, 1);
    quarantine(&db, &["release", "agg-13"]);
    let all = wait_distinct(&kafka, &topic, 100, n).await;
    let decoded = registry.tool("decode", "AVRO", &values_of(&all));
    let mut agg13 = Vec::new();
    for (m, d) in all.iter().zip(decoded.as_array().unwrap()) {
        assert_eq!(d["value"], expected(n(m)), "event {}", n(m));
        if m.key() == Some(&b"agg-13"[..]) {
            agg13.push(n(m));
        }
    }
    assert_eq!(agg13, [INVALID, 1_271], "released in order");
    stop(&mut relay).await;
}

/// `schema_registry.key = "schema"`: each key is written as Confluent's
/// serializers write it, with the latest schema of subject `<topic>-key` (a
/// string schema, as Debezium's outbox router registers with an Avro key
/// converter); Confluent's AvroDeserializer reads every key back as the
/// aggregate id, the values as before, and each aggregate's records are on
/// one partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_keys_serialized_with_the_key_subject_are_read_back_by_confluents_deserializer() {
    let registry = Registry::start().await;
    let value_ids = registry.register_all(Format::Avro);
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let topic = kafka.create_topic(3).await;
    let key_subject = format!("{topic}-key");
    let key_ids = registry.tool(
        "register",
        "AVRO",
        &serde_json::json!({ key_subject.clone(): "\"string\"" }).to_string(),
    );
    let key_id = key_ids[&key_subject].as_i64().unwrap();
    let db = fresh_db().await;
    let client = init(&db).await;
    let mut relay = spawn_run(
        &db,
        &kafka,
        &[
            &registry.flags(&topic, "avro")[..],
            &["--schema-registry-key", "schema"],
        ]
        .concat(),
    );
    insert(&client, 0, 500, 25).await;
    let all = wait_distinct(&kafka, &topic, 500, n).await;
    stop(&mut relay).await;
    let keys = registry.tool("decode", "AVRO", &keys_of(&all));
    let values = registry.tool("decode", "AVRO", &values_of(&all));
    let mut partition_of: HashMap<String, i32> = HashMap::new();
    for ((m, key), value) in all
        .iter()
        .zip(keys.as_array().unwrap())
        .zip(values.as_array().unwrap())
    {
        let n = n(m);
        assert_eq!(key["schema_id"], key_id, "event {n}");
        let aggregate = format!("agg-{}", n % 37);
        assert_eq!(key["value"], aggregate.as_str(), "event {n}");
        assert_eq!(
            value["schema_id"],
            value_ids[&format!("shop.Event{}", type_of(n))],
            "event {n}"
        );
        assert_eq!(value["value"], expected(n), "event {n}");
        let first = *partition_of
            .entry(aggregate.clone())
            .or_insert(m.partition());
        assert_eq!(first, m.partition(), "{aggregate} stays on one partition");
    }
    assert!(
        partition_of.values().collect::<HashSet<_>>().len() > 1,
        "the 37 aggregates spread over the partitions"
    );
}

/// Event types of the derived-schema test: `shop.Event0` … `shop.Event19`.
const DERIVED_TYPES: i64 = 20;
const DERIVED_TOTAL: i64 = 2_000;

/// Inserts events `from..to` whose payloads change shape as they go: a
/// note sometimes null (n < 700); then no note, a nested customer and a
/// list of mixed tags (n < 1,400); then a price (a number, not an
/// integer), no label, an empty list and another customer field.
async fn insert_shapes(client: &tokio_postgres::Client, from: i64, to: i64, per_tx: i64) {
    let mut at = from;
    while at < to {
        let end = (at + per_tx).min(to);
        client
            .execute(
                "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) \
                 SELECT 'shop', 'agg-' || (n % 37), 'shop.Event' || (n % 20), \
                        CASE WHEN n < 700 THEN jsonb_build_object('n', n, 'label', 'e' || n, \
                                 'note', CASE WHEN n % 3 = 0 THEN NULL ELSE 'note ' || n END) \
                             WHEN n < 1400 THEN jsonb_build_object('n', n, 'label', 'e' || n, \
                                 'customer', jsonb_build_object('id', n % 37, 'vip', n % 2 = 0), \
                                 'tags', jsonb_build_array('x', n % 5)) \
                             ELSE jsonb_build_object('n', n, 'price', n / 10.0 + 0.05, 'tags', '[]'::jsonb, \
                                 'customer', jsonb_build_object('id', n % 37, 'since', '2026-01-0' || (n % 9 + 1))) \
                        END, \
                        jsonb_build_object('n', n::text) \
                 FROM generate_series($1::int8, $2::int8 - 1) n",
                &[&at, &end],
            )
            .await
            .unwrap();
        at = end;
    }
}

/// Whether `decoded` (what the deserializer gave back) is `payload`: with
/// Avro, a field of the schema the payload left out reads back as null.
fn same_payload(decoded: &serde_json::Value, payload: &serde_json::Value, avro: bool) -> bool {
    use serde_json::Value;
    match (decoded, payload) {
        (Value::Object(d), Value::Object(p)) => {
            p.iter()
                .all(|(k, v)| d.get(k).is_some_and(|dv| same_payload(dv, v, avro)))
                && d.iter()
                    .all(|(k, v)| p.contains_key(k) || (avro && v.is_null()))
        }
        (Value::Array(d), Value::Array(p)) => {
            d.len() == p.len() && d.iter().zip(p).all(|(a, b)| same_payload(a, b, avro))
        }
        (a, b) => a == b,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derived_avro_schemas_are_registered_and_read_back_by_confluents_deserializer() {
    derived_schemas_read_back(Format::Avro).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn derived_json_schemas_are_registered_and_read_back_by_confluents_deserializer() {
    derived_schemas_read_back(Format::JsonSchema).await;
}

/// `schema_registry.schemas = "derived"`: nothing registered beforehand;
/// 2,000 events over 20 event types whose payloads change shape three
/// times, through two kill -9s and the registry stopped for 12 s as the
/// last shape arrives. Every record is read back by Confluent's
/// deserializer with the schema walbox registered, its payload as written;
/// each subject holds a few versions, each walbox's. A change the
/// subject's compatibility rule forbids stops walbox in one line, the slot
/// before the event; with the rule relaxed, it arrives.
async fn derived_schemas_read_back(format: Format) {
    let registry = Registry::start().await;
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = init(&db).await;
    let topic = kafka.create_topic(3).await;
    let mut flags = registry.flags(&topic, format.name());
    flags.extend(["--schema-registry-schemas", "derived"]);
    let start = || spawn_run(&db, &kafka, &flags);
    let mut relay = start();
    wait_log(&relay, "streaming from the slot").await;

    insert_shapes(&client, 0, 700, 20).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.kill9();
    relay = start();
    insert_shapes(&client, 700, 1_400, 35).await;
    wait_distinct(&kafka, &topic, 1_400, n).await;
    relay.kill9();
    relay = start();
    wait_log(&relay, "streaming from the slot").await;
    // The registry stops as the last shape (a price) needs a new version
    // of every subject: its events wait, nothing is skipped.
    registry.signal("-STOP");
    let stopped = std::time::Instant::now();
    insert_shapes(&client, 1_400, DERIVED_TOTAL, 50).await;
    wait_for(
        "walbox to log the registry's outage",
        Duration::from_secs(60),
        || {
            let log = relay.log();
            async move {
                match log.contains("schema registry: looking up subject") {
                    true => Ok(()),
                    false => Err("not yet".to_owned()),
                }
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(12).saturating_sub(stopped.elapsed())).await;
    registry.signal("-CONT");
    let messages = wait_distinct(&kafka, &topic, DERIVED_TOTAL as usize, n).await;
    eprintln!(
        "{} duplicates after two kill -9s",
        messages.len() - DERIVED_TOTAL as usize
    );

    // Every record, read back with the schema its id names.
    let payloads: HashMap<i64, serde_json::Value> = client
        .query(
            "SELECT (headers->>'n')::int8, payload::text FROM outbox_events",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), serde_json::from_str(r.get(1)).unwrap()))
        .collect();
    let decoded = registry.tool("decode", format.schema_type(), &values_of(&messages));
    let decoded = decoded.as_array().unwrap();
    assert_eq!(decoded.len(), messages.len());
    let mut ids: HashMap<String, HashSet<u64>> = HashMap::new();
    for (m, d) in messages.iter().zip(decoded) {
        let n = n(m);
        let avro = matches!(format, Format::Avro);
        assert!(
            same_payload(&d["value"], &payloads[&n], avro),
            "event {n}: {} read back as {}",
            payloads[&n],
            d["value"]
        );
        assert_eq!(m.key().unwrap(), format!("agg-{}", n % 37).as_bytes());
        ids.entry(format!("shop.Event{}", n % DERIVED_TYPES))
            .or_default()
            .insert(d["schema_id"].as_u64().unwrap());
    }
    // A handful of versions per subject, every one walbox's.
    let subjects: Vec<String> = (0..DERIVED_TYPES)
        .map(|k| format!("shop.Event{k}"))
        .collect();
    let versions = registry.tool(
        "versions",
        format.schema_type(),
        &serde_json::to_string(&subjects).unwrap(),
    );
    for s in &subjects {
        let count = versions[s]["versions"].as_array().unwrap().len();
        assert!(
            (2..=5).contains(&count),
            "{s}: {count} versions for three shapes (and a note first seen null)"
        );
        assert!(
            versions[s]["latest"]
                .as_str()
                .unwrap()
                .contains("derived by walbox from the events' payloads"),
            "{s}"
        );
        assert!(ids[s].len() <= count, "{s}: records name {:?}", ids[s]);
    }

    // A change the subject's rule forbids (label, a string, now a number):
    // walbox stops in one line, the slot before the event.
    registry.tool(
        "compatibility",
        format.schema_type(),
        r#"{"shop.Event3": "FULL"}"#,
    );
    let before: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    client
        .execute(
            "INSERT INTO outbox_events (aggregate_type, aggregate_id, event_type, payload, headers) \
             VALUES ('shop', 'agg-3', 'shop.Event3', '{\"n\": 2000, \"label\": 7}', '{\"n\": \"2000\"}')",
            &[],
        )
        .await
        .unwrap();
    let (status, log) = wait_exit(&mut relay).await;
    assert!(!status.success(), "{log}");
    let line = log.lines().last().unwrap_or_default();
    assert!(
        line.contains("subject \"shop.Event3\"")
            && line.contains("as incompatible with the subject's earlier versions (HTTP 409"),
        "{log}"
    );
    let confirmed: bool = client
        .query_one(
            "SELECT confirmed_flush_lsn <= $1::text::pg_lsn FROM pg_replication_slots WHERE slot_name = 'walbox'",
            &[&before],
        )
        .await
        .unwrap()
        .get(0);
    assert!(confirmed, "the slot stays before the refused event");
    registry.tool(
        "compatibility",
        format.schema_type(),
        r#"{"shop.Event3": "NONE"}"#,
    );
    relay = start();
    let all = wait_distinct(&kafka, &topic, DERIVED_TOTAL as usize + 1, n).await;
    let last: Vec<OwnedMessage> = all.into_iter().filter(|m| n(m) == 2_000).collect();
    let decoded = registry.tool("decode", format.schema_type(), &values_of(&last));
    assert_eq!(decoded[0]["value"]["label"], 7, "{decoded}");
    stop(&mut relay).await;
}

/// `format = "avro"` with `sink = "rabbitmq"`: the message body is the
/// record's value in Confluent's wire format, read off the queue by pika
/// and decoded by Confluent's AvroDeserializer with the registry: 1,200
/// events over 40 event types through a kill -9, every one there, each
/// with its subject's schema id, each aggregate's first arrivals in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_records_reach_rabbitmq_and_are_read_back_by_confluents_deserializer() {
    const EVENTS: i64 = 1_200;
    let registry = Registry::start().await;
    let ids = registry.register_all(Format::Avro);
    let broker = walbox_test_harness::rabbitmq::RabbitMq::start();
    crate::rabbitmq::bind(&broker, &[("shop", "shop-events")]);
    let db = fresh_db().await;
    let client = init(&db).await;
    let url = broker.url();
    let mut flags = vec!["run", "--sink", "rabbitmq", "--rabbitmq-url", &url];
    flags.extend(registry.flags("shop-events", Format::Avro.name()));
    let start = || spawn_logged(walbox(&db, &flags));
    let mut relay = start();
    wait_log(&relay, "streaming from the slot").await;
    insert(&client, 0, EVENTS / 2, 50).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.kill9();
    relay = start();
    insert(&client, EVENTS / 2, EVENTS, 25).await;

    let queue = vec!["shop".to_owned()];
    let mut got = Vec::new();
    wait_for("every event on the queue", Duration::from_secs(90), || {
        got.extend(crate::rabbitmq::read(&broker, &queue));
        let n = got
            .iter()
            .map(|g| g.headers["n"].as_str().unwrap().to_owned())
            .collect::<HashSet<_>>()
            .len();
        async move {
            match n as i64 == EVENTS {
                true => Ok(()),
                false => Err(format!("{n} of {EVENTS}")),
            }
        }
    })
    .await;
    stop(&mut relay).await;
    let values: Vec<serde_json::Value> = got
        .iter()
        .map(|g| serde_json::json!({"topic": "shop-events", "value": g.body_hex}))
        .collect();
    let decoded = registry.tool("decode", "AVRO", &serde_json::to_string(&values).unwrap());
    let decoded = decoded.as_array().unwrap();
    assert_eq!(decoded.len(), got.len());
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for (g, d) in got.iter().zip(decoded) {
        let n: i64 = g.headers["n"].as_str().unwrap().parse().unwrap();
        assert_eq!(d["value"], expected(n), "event {n}");
        assert_eq!(
            d["schema_id"],
            ids[format!("shop.Event{}", type_of(n))],
            "event {n}"
        );
        let key = g.headers["walbox.key"].as_str().unwrap().to_owned();
        assert_eq!(key, format!("agg-{}", n % 37));
        if seen.insert(n) {
            let prev = last.insert(key.clone(), n);
            assert!(prev.is_none_or(|p| p < n), "{key}: {n} after {prev:?}");
        }
    }
    eprintln!(
        "avro on RabbitMQ: {} duplicates after a kill -9",
        got.len() as i64 - EVENTS
    );
}
