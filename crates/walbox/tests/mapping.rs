//! The outbox mapping on rows as Postgres really sends them (pgoutput text
//! format: jsonb output, timestamptz formatting, NULLs).

use std::collections::HashMap;

use bytes::Bytes;
use pgoutput_decoder::{Decoder, LogicalMessage, RelationBody, TupleData};
use tokio_postgres::Client;
use walbox::mapping::{MapError, OutboxMapping};
use walbox_test_harness::migrations::apply_migrations;
use walbox_test_harness::pg::fresh_db;

/// Creates a publication and slot for `table`, runs `sql`, and returns the
/// relation and the inserted tuples the slot decoded.
async fn decoded_inserts(
    client: &Client,
    table: &str,
    sql: &str,
) -> (RelationBody, Vec<TupleData>) {
    client
        .batch_execute(&format!(
            "CREATE PUBLICATION p FOR TABLE {table} WITH (publish = 'insert')"
        ))
        .await
        .unwrap();
    client
        .execute(
            "SELECT pg_create_logical_replication_slot('s', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    client.batch_execute(sql).await.unwrap();
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_get_binary_changes('s', NULL, NULL, 'proto_version', '1', 'publication_names', 'p')",
            &[],
        )
        .await
        .unwrap();
    let mut decoder = Decoder::new(1).unwrap();
    let mut relation = None;
    let mut tuples = Vec::new();
    for row in rows {
        match decoder
            .decode(Bytes::from(row.get::<_, Vec<u8>>(0)))
            .unwrap()
        {
            LogicalMessage::Relation(r) => relation = Some(r),
            LogicalMessage::Insert(i) => tuples.push(i.tuple().clone()),
            _ => {}
        }
    }
    (relation.expect("a Relation message"), tuples)
}

fn headers(e: &walbox::mapping::MappedEvent) -> HashMap<String, String> {
    e.headers
        .iter()
        .map(|h| {
            (
                h.name.to_string(),
                String::from_utf8(h.value.to_vec()).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn maps_the_default_outbox_row() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    client
        .batch_execute("ALTER TABLE outbox_events ADD COLUMN tenant text")
        .await
        .unwrap();
    let (relation, tuples) = decoded_inserts(
        &client,
        "outbox_events",
        r#"INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at, tenant)
           VALUES ('6d1f1c9e-0000-4000-8000-000000000001', 'order', 'order-17', 'OrderCreated',
                   '{"total": 42, "lines": [1, 2]}', '{"trace": "t-1", "n": 5, "flag": true}',
                   '2026-11-21 17:00:00.123456+00', 'acme'),
                  ('6d1f1c9e-0000-4000-8000-000000000002', 'order', 'order-18', 'OrderPaid', '{}', '{}',
                   '2026-11-21 22:30:00+05:30', NULL)"#,
    )
    .await;
    let mut mapping = OutboxMapping::default();
    mapping
        .header_columns
        .push(("tenant".into(), "tenant".into()));
    let columns = mapping.resolve(&relation).unwrap();

    let e = mapping.map(&columns, &tuples[0]).unwrap();
    assert_eq!(&*e.topic, "outbox.event.order");
    assert_eq!(e.key, Bytes::from_static(b"order-17"));
    assert_eq!(
        e.value.as_deref(),
        Some(br#"{"lines": [1, 2], "total": 42}"#.as_slice()),
        "jsonb as stored"
    );
    assert_eq!(e.timestamp_ms, Some(1_795_280_400_123));
    assert_eq!(
        (e.event_id.as_str(), e.aggregate_id.as_str()),
        ("6d1f1c9e-0000-4000-8000-000000000001", "order-17")
    );
    let h = headers(&e);
    assert_eq!(e.headers[0].name, "id", "id comes first");
    assert_eq!(h["id"], "6d1f1c9e-0000-4000-8000-000000000001");
    assert_eq!(h["event_type"], "OrderCreated");
    assert_eq!(
        (h["trace"].as_str(), h["n"].as_str(), h["flag"].as_str()),
        ("t-1", "5", "true")
    );
    assert_eq!(h["tenant"], "acme");

    let e = mapping.map(&columns, &tuples[1]).unwrap();
    assert_eq!(
        e.timestamp_ms,
        Some(1_795_280_400_000),
        "the server's zone does not matter"
    );
    assert!(
        !headers(&e).contains_key("tenant"),
        "a NULL extra column sends no header"
    );
}

#[tokio::test]
async fn a_debezium_event_router_table_works_by_configuration_alone() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE outbox (id uuid PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
                                  aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)",
        )
        .await
        .unwrap();
    let (relation, tuples) = decoded_inserts(
        &client,
        "outbox",
        "INSERT INTO outbox VALUES ('6d1f1c9e-0000-4000-8000-0000000000aa', 'customer', 'c-9', 'CustomerMoved', '{\"city\": \"Oslo\"}')",
    )
    .await;
    let mapping = OutboxMapping::debezium();
    assert_eq!(
        mapping.required_columns(),
        ["id", "aggregatetype", "aggregateid", "payload", "type"]
    );
    let e = mapping
        .map(&mapping.resolve(&relation).unwrap(), &tuples[0])
        .unwrap();
    assert_eq!(
        (&*e.topic, &e.key[..]),
        ("outbox.event.customer", b"c-9".as_slice())
    );
    assert_eq!(headers(&e)["event_type"], "CustomerMoved");
    assert_eq!(e.timestamp_ms, None);
    // The default names do not fit this table, and say which column is missing.
    let err = OutboxMapping::default().resolve(&relation).unwrap_err();
    assert_eq!(
        err.to_string(),
        "table public.outbox has no column \"aggregate_type\" (mapped as the aggregate type)"
    );
}

#[tokio::test]
async fn rows_that_cannot_be_mapped_name_the_event() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE loose (id uuid, aggregate_type text, aggregate_id text, event_type text,
                                 payload text, headers jsonb, created_at timestamptz)",
        )
        .await
        .unwrap();
    let (relation, tuples) = decoded_inserts(
        &client,
        "loose",
        "INSERT INTO loose VALUES
           ('6d1f1c9e-0000-4000-8000-000000000001', 'order', NULL, 'E', '{}', '{}', now()),
           ('6d1f1c9e-0000-4000-8000-000000000002', 'order', 'o-2', 'E', 'not json', '{}', now()),
           ('6d1f1c9e-0000-4000-8000-000000000003', 'my order', 'o-3', 'E', '{}', '{}', now()),
           ('6d1f1c9e-0000-4000-8000-000000000004', 'order', 'o-4', 'E', '{}', '[1]', now()),
           ('6d1f1c9e-0000-4000-8000-000000000005', 'order', 'o-5', NULL, '{}', NULL, NULL)",
    )
    .await;
    let mapping = OutboxMapping::default();
    let columns = mapping.resolve(&relation).unwrap();
    let errors: Vec<String> = [&tuples[0], &tuples[2], &tuples[3]]
        .iter()
        .map(|t| mapping.map(&columns, t).unwrap_err().to_string())
        .collect();
    assert_eq!(
        errors[0],
        "event 6d1f1c9e-0000-4000-8000-000000000001: column \"aggregate_id\" (the aggregate id) is NULL"
    );
    // A text payload is sent as it is; a format that writes JSON checks it.
    let e = mapping.map(&columns, &tuples[1]).unwrap();
    assert_eq!(e.value.as_deref(), Some(&b"not json"[..]));
    let debezium = OutboxMapping {
        format: walbox::mapping::format::EventFormat::Debezium,
        ..OutboxMapping::default()
    };
    let columns_debezium = debezium.resolve(&relation).unwrap();
    let e = debezium
        .map(&columns_debezium, &tuples[1])
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("event 6d1f1c9e-0000-4000-8000-000000000002: payload is not valid JSON"),
        "{e}"
    );
    let errors = [errors[0].clone(), e, errors[1].clone(), errors[2].clone()];
    assert!(
        errors[2].contains("topic \"outbox.event.my order\" is not a valid Kafka topic name"),
        "{}",
        errors[2]
    );
    assert_eq!(
        errors[3],
        "event 6d1f1c9e-0000-4000-8000-000000000004: headers column is not a JSON object"
    );
    // Optional columns may be NULL.
    let e = mapping.map(&columns, &tuples[4]).unwrap();
    assert_eq!((e.headers.len(), e.timestamp_ms), (1, None));

    client
        .batch_execute("ALTER TABLE loose ALTER COLUMN payload TYPE int USING 0")
        .await
        .unwrap();
    let (relation, _) = {
        client.batch_execute("DROP PUBLICATION p").await.unwrap();
        client
            .execute("SELECT pg_drop_replication_slot('s')", &[])
            .await
            .unwrap();
        decoded_inserts(
            &client,
            "loose",
            "INSERT INTO loose (id, payload) VALUES (gen_random_uuid(), 1)",
        )
        .await
    };
    let err = mapping.resolve(&relation).unwrap_err();
    assert!(
        matches!(err, MapError::PayloadType { type_oid: 23, .. }),
        "{err}"
    );
}

#[tokio::test]
async fn a_payload_of_a_domain_over_jsonb_or_text_is_accepted() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE DOMAIN event_json AS jsonb CHECK (jsonb_typeof(VALUE) = 'object');
             CREATE DOMAIN strict_event_json AS event_json;
             CREATE TABLE outbox_events (id uuid, aggregate_type text, aggregate_id text,
                                         event_type text, payload strict_event_json)",
        )
        .await
        .unwrap();
    let (relation, tuples) = decoded_inserts(
        &client,
        "outbox_events",
        r#"INSERT INTO outbox_events VALUES
           ('6d1f1c9e-0000-4000-8000-000000000001', 'order', 'o-1', 'Created', '{"n": 1}')"#,
    )
    .await;
    let mapping = OutboxMapping {
        headers: None,
        timestamp: None,
        ..OutboxMapping::default()
    };
    let err = mapping.resolve(&relation).unwrap_err();
    assert!(matches!(err, MapError::PayloadType { .. }), "{err}");
    assert!(err.to_string().contains("or a domain over one"), "{err}");

    let table = slot_manager::TableName::new("public", "outbox_events");
    let domains = slot_manager::domain_base_types(&client, &table)
        .await
        .unwrap();
    assert_eq!(
        domains.len(),
        1,
        "one domain-typed column, nested domains resolved: {domains:?}"
    );
    let columns = mapping.resolve_with(&relation, &domains).unwrap();
    let e = mapping.map(&columns, &tuples[0]).unwrap();
    assert_eq!(e.value.as_deref(), Some(&br#"{"n": 1}"#[..]));
}

#[tokio::test]
async fn a_headers_entry_named_like_a_walbox_header_is_refused() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let (relation, tuples) = decoded_inserts(
        &client,
        "outbox_events",
        r#"INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload, headers)
           VALUES ('6d1f1c9e-0000-4000-8000-000000000001', 'order', 'o-1', 'Created', '{}', '{"id": "forged"}'),
                  ('6d1f1c9e-0000-4000-8000-000000000002', 'order', 'o-1', 'Created', '{}', '{"event_type": "X"}'),
                  ('6d1f1c9e-0000-4000-8000-000000000003', 'order', 'o-1', 'Created', '{}', '{"walbox.error": "x"}'),
                  ('6d1f1c9e-0000-4000-8000-000000000004', 'order', 'o-1', 'Created', '{}', '{"trace": "t"}')"#,
    )
    .await;
    let mapping = OutboxMapping::default();
    let columns = mapping.resolve(&relation).unwrap();
    for (tuple, name) in tuples.iter().zip(["id", "event_type", "walbox.error"]) {
        let err = mapping.map(&columns, tuple).unwrap_err();
        assert!(
            matches!(&err, MapError::ReservedHeader { name: n, .. } if n == name),
            "{err}"
        );
    }
    let ok = mapping.map(&columns, &tuples[3]).unwrap();
    let ids = ok.headers.iter().filter(|h| h.name == "id").count();
    assert_eq!(ids, 1);
}

#[tokio::test]
async fn an_empty_aggregate_id_is_unmappable_not_a_random_partition() {
    let db = fresh_db().await;
    let client = db.connect().await;
    apply_migrations(&client).await;
    let (relation, tuples) = decoded_inserts(
        &client,
        "outbox_events",
        r#"INSERT INTO outbox_events (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES ('6d1f1c9e-0000-4000-8000-000000000001', 'order', '', 'Created', '{}')"#,
    )
    .await;
    let mapping = OutboxMapping::default();
    let columns = mapping.resolve(&relation).unwrap();
    let err = mapping.map(&columns, &tuples[0]).unwrap_err();
    assert!(matches!(err, MapError::EmptyAggregateId { .. }), "{err}");
    assert!(err.to_string().contains("aggregate id is empty"), "{err}");
}

/// A `bytea` payload (the application serialized the event itself)
/// becomes the record's value byte for byte, every byte value included,
/// whichever `bytea_output` the server decodes with; a format that writes
/// JSON refuses such a table at once.
#[tokio::test]
async fn a_bytea_payload_is_sent_as_its_bytes_in_either_output_format() {
    let db = fresh_db().await;
    let client = db.connect().await;
    client
        .batch_execute(
            "CREATE TABLE outbox_events (id uuid, aggregate_type text, aggregate_id text,
                                         event_type text, payload bytea)",
        )
        .await
        .unwrap();
    let all: Vec<u8> = (0..=255).collect();
    let inserts = "INSERT INTO outbox_events VALUES
        ('6d1f1c9e-0000-4000-8000-000000000001', 'order', 'o-1', 'E',
         (SELECT string_agg(set_byte('\\x00'::bytea, 0, b), ''::bytea ORDER BY b)
            FROM generate_series(0, 255) b)),
        ('6d1f1c9e-0000-4000-8000-000000000002', 'order', 'o-2', 'E', ''::bytea),
        ('6d1f1c9e-0000-4000-8000-000000000003', 'order', 'o-3', 'E', NULL)";
    // pgoutput writes each value with the decoding session's bytea_output:
    // the slot is read once per setting.
    client
        .batch_execute("CREATE PUBLICATION p FOR TABLE outbox_events WITH (publish = 'insert')")
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
        .await
        .unwrap();
    client.batch_execute(inserts).await.unwrap();
    let mapping = OutboxMapping {
        headers: None,
        timestamp: None,
        ..OutboxMapping::default()
    };
    for output in ["hex", "escape"] {
        client
            .batch_execute(&format!("SET bytea_output = '{output}'"))
            .await
            .unwrap();
        let rows = client
            .query(
                "SELECT data FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL, 'proto_version', '1', 'publication_names', 'p')",
                &[],
            )
            .await
            .unwrap();
        let mut decoder = Decoder::new(1).unwrap();
        let (mut relation, mut values) = (None, Vec::new());
        for row in rows {
            match decoder
                .decode(Bytes::from(row.get::<_, Vec<u8>>(0)))
                .unwrap()
            {
                LogicalMessage::Relation(r) => relation = Some(r),
                LogicalMessage::Insert(i) => {
                    let relation = relation.as_ref().expect("a Relation first");
                    let columns = mapping.resolve(relation).unwrap();
                    if let Some(raw) = i.tuple().value_bytes(columns.payload_index()) {
                        // The text really is in the format under test.
                        assert_eq!(raw.starts_with(b"\\x"), output == "hex", "{raw:?}");
                    }
                    values.push(mapping.map(&columns, i.tuple()).unwrap().value);
                }
                _ => {}
            }
        }
        let got: Vec<Option<Vec<u8>>> = values
            .iter()
            .map(|v| v.as_ref().map(|b| b.to_vec()))
            .collect();
        assert_eq!(
            got,
            [Some(all.clone()), Some(Vec::new()), None],
            "decoded with bytea_output = {output}"
        );

        let relation = relation.expect("a Relation message");
        for format in [
            walbox::mapping::format::EventFormat::Debezium,
            walbox::mapping::format::EventFormat::CloudEventsStructured { source: "s".into() },
        ] {
            let json = OutboxMapping {
                format,
                ..mapping.clone()
            };
            let err = json.resolve(&relation).unwrap_err();
            assert!(matches!(err, MapError::BinaryPayload { .. }), "{err}");
            assert!(err.to_string().contains("use format = as-stored"), "{err}");
        }
    }
}
