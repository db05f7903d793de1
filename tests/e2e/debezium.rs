//! Record compatibility with Debezium's outbox EventRouter: for the same
//! outbox rows, on the same Apache Kafka, walbox with the debezium mapping
//! preset writes what EventRouter wrote, record for record: partition, key
//! bytes, value bytes and headers. Debezium runs for real (Kafka Connect
//! standalone, `WALBOX_DEBEZIUM_LIBS`).

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::message::{Headers, Message, OwnedMessage};
use walbox_test_harness::apache_kafka::KafkaCluster;
use walbox_test_harness::debezium::{self, Connector, Debezium};
use walbox_test_harness::kafka::{consume_n, consume_until_quiet, TestKafka};
use walbox_test_harness::pg::{fresh_db, TestDb};
use walbox_test_harness::wait::wait_for;

use crate::support::{kafka_cluster, spawn_run, stop};

/// A Debezium EventRouter outbox table, as its documentation has it.
const OUTBOX: &str = "CREATE TABLE public.outbox (
    id            uuid PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid   varchar(255) NOT NULL,
    type          varchar(255) NOT NULL,
    payload       jsonb,
    -- Not EventRouter's: when the row was written, for a backfill's
    -- condition and order (docs/migrating-from-debezium.md).
    created_at    timestamptz NOT NULL DEFAULT clock_timestamp()
)";

/// One record as a consumer sees it: what the comparison covers.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    partition: i32,
    key: Option<Vec<u8>>,
    value: Option<Vec<u8>>,
    headers: Vec<(String, Option<Vec<u8>>)>,
}

fn seen(m: &OwnedMessage) -> Seen {
    let headers = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default();
    Seen {
        partition: m.partition(),
        key: m.key().map(<[u8]>::to_vec),
        value: m.payload().map(<[u8]>::to_vec),
        headers,
    }
}

/// The records by event id (the `id` header both write).
fn by_id(records: &[OwnedMessage]) -> BTreeMap<String, Seen> {
    records
        .iter()
        .map(|m| {
            let s = seen(m);
            let id = s
                .headers
                .iter()
                .find(|(k, _)| k == "id")
                .and_then(|(_, v)| v.clone())
                .map(|v| String::from_utf8_lossy(&v).into_owned())
                .unwrap_or_else(|| panic!("a record without an id header: {s:?}"));
            (id, s)
        })
        .collect()
}

fn connector(db: &TestDb, kafka: &TestKafka, slot: &str, topic: &str) -> Connector {
    let config = db.config();
    let (host, port) = match (config.get_hosts().first(), config.get_ports().first()) {
        (Some(tokio_postgres::config::Host::Tcp(h)), Some(p)) => (h.clone(), *p),
        other => panic!("the test database is not on TCP: {other:?}"),
    };
    Connector {
        bootstrap: kafka.bootstrap(),
        host,
        port,
        user: config.get_user().unwrap_or("postgres").to_owned(),
        dbname: config.get_dbname().unwrap_or("postgres").to_owned(),
        table: "public.outbox".into(),
        slot: slot.into(),
        publication: "dbz_publication".into(),
        worker: vec![],
        connector: vec![
            // Every event to one topic, as walbox's template below.
            (
                "transforms.outbox.route.topic.replacement".into(),
                topic.into(),
            ),
        ],
        jvm: vec![],
    }
}

/// Waits until Debezium streams from its slot.
async fn wait_streaming(client: &tokio_postgres::Client, dbz: &Debezium, slot: &str) {
    wait_for(
        "Debezium to stream from its slot",
        Duration::from_secs(120),
        || {
            let exited = dbz.exited();
            let tail = dbz.log_tail(20);
            async move {
                if exited {
                    return Err(format!("Kafka Connect exited:\n{tail}"));
                }
                let active = client
                    .query_opt(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await;
                match active {
                    Ok(Some(row)) if row.get::<_, bool>(0) => Ok(()),
                    _ => Err(tail),
                }
            }
        },
    )
    .await;
}

/// Rows with every shape the mapping meets: several aggregates (so the
/// partitioner is compared), nested JSON, unicode, a null payload.
async fn insert_rows(client: &tokio_postgres::Client, n: usize) {
    for i in 0..n {
        let payload = match i % 4 {
            0 => format!(r#"{{"order": {i}, "lines": [{{"sku": "A-{i}", "qty": 2}}]}}"#),
            1 => format!(r#"{{"name": "Zoë {i}", "note": "ünïcode ✓"}}"#),
            2 => format!(r#"{{"b": 1, "a": {{"z": true, "y": null}}, "n": {i}.5}}"#),
            _ => String::new(),
        };
        let payload = (!payload.is_empty()).then_some(payload);
        client
            .execute(
                "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload)
                 VALUES (gen_random_uuid(), 'order', $1, 'OrderCreated', $2::text::jsonb)",
                &[&format!("o-{}", i % 7), &payload],
            )
            .await
            .unwrap();
    }
}

/// One Apache Kafka broker and a database with EventRouter's outbox
/// table; `None` (said once) without Debezium's jars.
async fn world() -> Option<(KafkaCluster, TestKafka, TestDb, tokio_postgres::Client)> {
    if debezium::libs_from_env().is_none() {
        eprintln!("WALBOX_DEBEZIUM_LIBS is not set (scripts/test sets it): test not run");
        return None;
    }
    let cluster = kafka_cluster(1);
    let kafka = cluster.kafka();
    let db = fresh_db().await;
    let client = db.connect().await;
    client.batch_execute(OUTBOX).await.unwrap();
    Some((cluster, kafka, db, client))
}

/// Debezium's converters for keys and values.
fn converters(json: bool, schemas: bool) -> Vec<(String, String)> {
    let class = if json {
        "org.apache.kafka.connect.json.JsonConverter"
    } else {
        "org.apache.kafka.connect.storage.StringConverter"
    };
    let mut p = vec![
        ("key.converter".to_owned(), class.to_owned()),
        ("value.converter".to_owned(), class.to_owned()),
    ];
    if json {
        for side in ["key", "value"] {
            p.push((
                format!("{side}.converter.schemas.enable"),
                schemas.to_string(),
            ));
        }
    }
    p
}

/// The headers Debezium 3 adds to every record about the connector that
/// wrote it (its name, task, run): walbox has no such context and does
/// not imitate them.
const CONTEXT_HEADERS: &str = "__debezium.context.";

/// What a record's headers are once the deliberate differences are set
/// aside: Debezium's context headers, and the `event_type` header walbox
/// adds (EventRouter only with `table.fields.additional.placement`) and
/// its `walbox.origin` (what a restart reads back).
/// Checks that those differences are exactly that.
fn comparable(theirs: &Seen, ours: &Seen) -> (Seen, Seen) {
    let mut t = theirs.clone();
    let mut o = ours.clone();
    let context: Vec<_> = t
        .headers
        .iter()
        .filter(|(k, _)| k.starts_with(CONTEXT_HEADERS))
        .map(|(k, _)| k.clone())
        .collect();
    assert_eq!(context.len(), 4, "Debezium's context headers: {context:?}");
    t.headers.retain(|(k, _)| !k.starts_with(CONTEXT_HEADERS));
    let event_type = o.headers.iter().position(|(k, _)| k == "event_type");
    assert_eq!(
        event_type.map(|i| o.headers[i].1.clone()),
        Some(Some(b"OrderCreated".to_vec()))
    );
    o.headers.retain(|(k, _)| k != "event_type");
    let origin = o.headers.iter().position(|(k, _)| k == "walbox.origin");
    let mark = origin
        .and_then(|i| o.headers[i].1.clone())
        .unwrap_or_default();
    assert!(
        sink_core::tail::Mark::parse(&mark).is_some(),
        "walbox.origin: {:?}",
        String::from_utf8_lossy(&mark)
    );
    o.headers.retain(|(k, _)| k != "walbox.origin");
    (t, o)
}

fn text(bytes: &Option<Vec<u8>>) -> String {
    bytes.as_deref().map_or_else(
        || "(no value)".into(),
        |b| format!("`{}`", String::from_utf8_lossy(b)),
    )
}

fn parsed(bytes: &Option<Vec<u8>>) -> Option<serde_json::Value> {
    serde_json::from_slice(bytes.as_deref()?).ok()
}

/// The JSON value without its null object members, at any depth.
fn nulls_dropped(bytes: &Option<Vec<u8>>) -> Option<serde_json::Value> {
    fn drop_nulls(v: &mut serde_json::Value) {
        match v {
            serde_json::Value::Object(m) => {
                m.retain(|_, v| !v.is_null());
                m.values_mut().for_each(drop_nulls);
            }
            serde_json::Value::Array(a) => a.iter_mut().for_each(drop_nulls),
            _ => {}
        }
    }
    let mut v = parsed(bytes)?;
    drop_nulls(&mut v);
    Some(v)
}

/// Each record of `theirs` against the one of `ours` with its event id.
fn differences(theirs: &BTreeMap<String, Seen>, ours: &BTreeMap<String, Seen>) -> Vec<String> {
    assert_eq!(
        theirs.keys().collect::<Vec<_>>(),
        ours.keys().collect::<Vec<_>>(),
        "the same events"
    );
    let mut out = Vec::new();
    for (id, t) in theirs {
        let (t, mut o) = comparable(t, &ours[id]);
        // The one deliberate difference in values: EventRouter's payload
        // expansion drops members whose value is null (it infers a schema
        // from values, and null has none); walbox keeps the payload whole.
        // Where that is the only difference, it is set aside.
        if t.value != o.value && nulls_dropped(&o.value) == parsed(&t.value) {
            o.value = t.value.clone();
        }
        if t != o {
            out.push(format!(
                "{id}:\n  Debezium p{} key {} value {} headers {:?}\n  walbox   p{} key {} value {} headers {:?}",
                t.partition,
                text(&t.key),
                text(&t.value),
                t.headers.iter().map(|(k, v)| format!("{k}={}", text(v))).collect::<Vec<_>>(),
                o.partition,
                text(&o.key),
                text(&o.value),
                o.headers.iter().map(|(k, v)| format!("{k}={}", text(v))).collect::<Vec<_>>(),
            ));
        }
    }
    out
}

/// Topic for topic, with Debezium's three usual converter setups against
/// walbox's matching format:
/// - StringConverter ↔ `format = "as-stored"` (the default);
/// - JsonConverter without schemas ↔ `format = "debezium"`;
/// - JsonConverter with its default schemas ↔ `format = "debezium"`: the
///   documented difference (the schema envelope), checked to be only that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walbox_writes_what_debeziums_event_router_writes() {
    let Some((_cluster, kafka, db, client)) = world().await else {
        return;
    };

    // Three Debezium connectors, each on its own slot of one publication.
    let mut peers = Vec::new();
    for (slot, json, schemas) in [
        ("dbz_string", false, false),
        ("dbz_json", true, false),
        ("dbz_schemas", true, true),
    ] {
        let topic = kafka.create_topic(3).await;
        let mut c = connector(&db, &kafka, slot, &topic);
        c.worker = converters(json, schemas);
        if json {
            // The payload as JSON, not as a string of JSON text: what
            // walbox's debezium format writes (docs/configuration.md).
            c.connector.push((
                "transforms.outbox.table.expand.json.payload".into(),
                "true".into(),
            ));
        }
        let dbz = tokio::task::block_in_place(|| Debezium::start(c));
        wait_streaming(&client, &dbz, slot).await;
        peers.push((slot, topic, dbz));
    }
    // walbox in both formats, as the migration guide sets it up.
    let mut relays = Vec::new();
    for format in ["as-stored", "debezium"] {
        let slot = format!("walbox_{}", format.replace('-', "_"));
        let topic = kafka.create_topic(3).await;
        let settings = [
            "--slot",
            slot.as_str(),
            "--table",
            "public.outbox",
            "--mapping-preset",
            "debezium",
            "--publication",
            "dbz_publication",
            "--format",
            format,
        ];
        let mut args = vec!["init-slot"];
        args.extend(settings);
        crate::support::succeeded(&crate::support::walbox(&db, &args).output().unwrap());
        let mut run = settings.to_vec();
        run.extend(["--mapping-topic-template", topic.as_str()]);
        relays.push((format, topic.clone(), spawn_run(&db, &kafka, &run)));
    }
    let n = 40;
    insert_rows(&client, n).await;

    let mut records = BTreeMap::new();
    for (slot, topic, dbz) in &peers {
        let got = consume_n(&kafka, topic, n, Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("{slot}: {e}\nDebezium's log:\n{}", dbz.log_tail(40)));
        records.insert(slot.to_string(), by_id(&got));
    }
    for (format, topic, _) in &relays {
        let got = consume_n(&kafka, topic, n, Duration::from_secs(60))
            .await
            .unwrap();
        records.insert(format.to_string(), by_id(&got));
    }
    for (_, _, relay) in &mut relays {
        stop(relay).await;
    }
    for (_, _, dbz) in &mut peers {
        tokio::task::block_in_place(|| dbz.stop());
    }

    for (theirs, ours) in [("dbz_string", "as-stored"), ("dbz_json", "debezium")] {
        let found = differences(&records[theirs], &records[ours]);
        assert!(
            found.is_empty(),
            "{theirs} against walbox {ours}: {} of {n} records differ:\n{}",
            found.len(),
            found[..found.len().min(3)].join("\n")
        );
    }
    // With schemas, JsonConverter wraps key and value in an envelope
    // walbox does not write: unwrapped, they are walbox's bytes.
    let (schemas, json) = (&records["dbz_schemas"], &records["debezium"]);
    let unwrapped: BTreeMap<String, Seen> = schemas
        .iter()
        .map(|(id, s)| {
            let open = |b: &Option<Vec<u8>>| -> Option<Vec<u8>> {
                let v: serde_json::Value = serde_json::from_slice(b.as_deref()?).unwrap();
                assert!(v["schema"].is_object(), "{v}");
                Some(serde_json::to_vec(&v["payload"]).unwrap())
            };
            let mut s = s.clone();
            s.key = open(&s.key);
            s.value = open(&s.value);
            // The envelope's bytes hash to another partition than the
            // plain key (the documented cost of switching from this
            // setup); each aggregate still has one partition.
            s.partition = json[id].partition;
            // Re-serialized here, so compared as JSON, not as bytes.
            let ours = &json[id].value;
            if parsed(&s.value) == parsed(ours) || parsed(&s.value) == nulls_dropped(ours) {
                s.value = ours.clone();
            }
            (id.clone(), s)
        })
        .collect();
    let mut partitions: BTreeMap<Vec<u8>, std::collections::BTreeSet<i32>> = BTreeMap::new();
    for s in schemas.values() {
        partitions
            .entry(s.key.clone().unwrap_or_default())
            .or_default()
            .insert(s.partition);
    }
    assert!(
        partitions.values().all(|p| p.len() == 1),
        "one partition per aggregate: {partitions:?}"
    );
    let found = differences(&unwrapped, json);
    assert!(
        found.is_empty(),
        "dbz_schemas, unwrapped, against walbox debezium: {} of {n} records differ:\n{}",
        found.len(),
        found[..found.len().min(3)].join("\n")
    );
}

/// Which of docs/migrating-from-debezium.md's two ways to switch over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// "Reuse Debezium's slot".
    ReuseSlot,
    /// "A new slot, with a backfill".
    Backfill,
}

/// The switch-over of docs/migrating-from-debezium.md ("Reuse Debezium's
/// slot"), rehearsed to the letter while a writer keeps inserting: Debezium
/// streams the outbox to a topic; its worker is stopped; `walbox init-slot`
/// finds Debezium's slot and publication; `walbox run` writes to the same
/// topic. Every event arrives; duplicates are only what Debezium published
/// after it last confirmed the slot; each aggregate stays on its partition
/// and its events in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_over_the_guide_describes_loses_nothing() {
    rehearse(Path::ReuseSlot).await;
}

/// The guide's other way ("A new slot, with a backfill"), to the letter:
/// Debezium stopped, the time of the last event it published looked up,
/// `walbox init-slot --backfill` from a minute before it on a slot and
/// publication of walbox's own, `walbox run`, Debezium's slot dropped. Every
/// event arrives; duplicates are only rows Debezium had published (the
/// margin's); order and partitions hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_switch_over_with_a_backfill_loses_nothing() {
    rehearse(Path::Backfill).await;
}

async fn rehearse(path: Path) {
    let Some((_cluster, kafka, db, client)) = world().await else {
        return;
    };
    let topic = kafka.create_topic(3).await;
    let mut dbz =
        tokio::task::block_in_place(|| Debezium::start(connector(&db, &kafka, "debezium", &topic)));
    wait_streaming(&client, &dbz, "debezium").await;

    // The application writes all along: one event per transaction, seven
    // aggregates, each event's number in its payload.
    let stop_writing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let stop_writing = stop_writing.clone();
        let app = db.connect().await;
        tokio::spawn(async move {
            let mut n = 0usize;
            while !stop_writing.load(std::sync::atomic::Ordering::Relaxed) {
                app.execute(
                    "INSERT INTO public.outbox (id, aggregatetype, aggregateid, type, payload)
                     VALUES (gen_random_uuid(), 'order', $1, 'OrderCreated', $2::text::jsonb)",
                    &[&format!("o-{}", n % 7), &format!(r#"{{"n": {n}}}"#)],
                )
                .await
                .unwrap();
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_secs(4)).await;

    // 1. Stop the connector (its worker: SIGTERM), until the slot is free.
    tokio::task::block_in_place(|| dbz.stop());
    wait_for(
        "Debezium's slot to be free",
        Duration::from_secs(60),
        || {
            let client = &client;
            async move {
                let row = client
                    .query_one(
                        "SELECT active FROM pg_replication_slots WHERE slot_name = 'debezium'",
                        &[],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                (!row.get::<_, bool>(0))
                    .then_some(())
                    .ok_or("active".to_owned())
            }
        },
    )
    .await;
    let debezium_records = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(3),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let published_by_debezium = debezium_records.len();
    let brokers = kafka.bootstrap();
    let mut relay = match path {
        Path::ReuseSlot => {
            // 2. init-slot finds Debezium's slot and publication.
            let settings = [
                "--slot",
                "debezium",
                "--publication",
                "dbz_publication",
                "--table",
                "public.outbox",
                "--mapping-preset",
                "debezium",
            ];
            let mut args = vec!["init-slot"];
            args.extend(settings);
            let said =
                crate::support::succeeded(&crate::support::walbox(&db, &args).output().unwrap());
            assert!(
                said.contains("publication \"dbz_publication\": already present")
                    && said.contains("slot \"debezium\": already present"),
                "{said}"
            );
            // 3. walbox runs with the same settings, to the same topic.
            let mut run = settings.to_vec();
            run.extend(["--mapping-topic-template", topic.as_str()]);
            spawn_run(&db, &kafka, &run)
        }
        Path::Backfill => {
            // 1. When the last event Debezium published was written.
            let ids: Vec<String> = by_id(&debezium_records).into_keys().collect();
            let last: String = client
                .query_one(
                    "SELECT max(created_at)::text FROM public.outbox WHERE id::text = ANY($1)",
                    &[&ids],
                )
                .await
                .unwrap()
                .get(0);
            // 2. A slot of walbox's own, made with a backfill of the rows
            // from a minute before it.
            let condition = format!("created_at >= '{last}'::timestamptz - interval '1 minute'");
            let settings = [
                "--table",
                "public.outbox",
                "--mapping-preset",
                "debezium",
                "--mapping-topic-template",
                topic.as_str(),
            ];
            let mut args = vec![
                "init-slot",
                "--backfill",
                condition.as_str(),
                "--backfill-order",
                "created_at, id",
                "--kafka-brokers",
                brokers.as_str(),
            ];
            args.extend(settings);
            let said =
                crate::support::succeeded(&crate::support::walbox(&db, &args).output().unwrap());
            assert!(said.contains("slot \"walbox\""), "{said}");
            // 3. walbox runs.
            let relay = spawn_run(&db, &kafka, &settings);
            // 4. Debezium's slot dropped: it held what the backfill sent.
            let drop = |force: bool| {
                let mut args = vec![
                    "drop-slot",
                    "--slot",
                    "debezium",
                    "--publication",
                    "dbz_publication",
                ];
                if force {
                    args.push("--force");
                }
                crate::support::walbox(&db, &args).output().unwrap()
            };
            let out = drop(false);
            let refused = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                !out.status.success() && refused.contains("not yet delivered"),
                "{refused}"
            );
            crate::support::succeeded(&drop(true));
            relay
        }
    };
    tokio::time::sleep(Duration::from_secs(4)).await;
    stop_writing.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.await.unwrap();

    let records = consume_until_quiet(
        &kafka,
        &topic,
        Duration::from_secs(5),
        Duration::from_secs(120),
    )
    .await
    .unwrap();
    stop(&mut relay).await;
    let mut seen_n = std::collections::BTreeSet::new();
    let mut partition_of: BTreeMap<Vec<u8>, std::collections::BTreeSet<i32>> = BTreeMap::new();
    let mut last_of: BTreeMap<Vec<u8>, i64> = BTreeMap::new();
    let mut duplicates = 0;
    // Consumed partition by partition in offset order: per key, in order.
    for m in &records {
        let key = m.key().unwrap().to_vec();
        let v: serde_json::Value = serde_json::from_slice(m.payload().unwrap()).unwrap();
        let n = v["n"].as_i64().unwrap();
        partition_of
            .entry(key.clone())
            .or_default()
            .insert(m.partition());
        if !seen_n.insert(n) {
            duplicates += 1;
            continue;
        }
        let last = last_of.entry(key).or_insert(-1);
        assert!(n > *last, "out of order: {n} after {last}");
        *last = n;
    }
    eprintln!(
        "switch-over ({path:?}): {written} events written, {published_by_debezium} published by Debezium, {} records on the topic, {duplicates} duplicates",
        records.len()
    );
    assert_eq!(seen_n.len(), written, "every event arrives");
    assert!(
        partition_of.values().all(|p| p.len() == 1),
        "each aggregate on one partition: {partition_of:?}"
    );
    assert!(
        duplicates <= published_by_debezium,
        "duplicates are only events Debezium had published: {duplicates}"
    );
}
