//! What mapping one event costs walbox, by source and record format: an
//! outbox row (the default columns, a ~200-byte jsonb payload) and the
//! envelope `walbox.emit()` writes for the same event. `map/row/avro` is
//! the mapping plus serializing the payload with its (cached) schema in
//! Confluent's wire format, what `format = "avro"` adds to every event;
//! `map/row/json-schema` the same with validating against a JSON Schema,
//! `map/row/protobuf` with writing a Protobuf message. The `-derived`
//! variants are `schema_registry.schemas = "derived"` once the subject's
//! schema is registered: the payload's shape, checked against the
//! subject's, then the same serializing with the derived schema.
//!
//! `cargo bench -p walbox --bench map`

#![allow(missing_docs)] // criterion_group! generates an undocumented pub fn

use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use pgoutput_decoder::{Lsn, RelationBody, TupleData};
use walbox::mapping::format::EventFormat;
use walbox::mapping::{OutboxMapping, Topics};

const PAYLOAD: &str = r#"{"pad": "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx", "total": 4711, "order_id": "order-711"}"#;

fn row() -> (RelationBody, TupleData) {
    let relation = RelationBody::from_catalog(
        16_384,
        "public",
        "outbox_events",
        [
            ("id".to_owned(), 2950),
            ("aggregate_type".to_owned(), 25),
            ("aggregate_id".to_owned(), 25),
            ("event_type".to_owned(), 25),
            ("payload".to_owned(), 3802),
            ("headers".to_owned(), 3802),
            ("created_at".to_owned(), 1184),
        ],
    );
    let tuple = TupleData::from_text([
        Some(&b"5b1d3c8e-9f0a-4c71-8a55-2b7e6f0d9c13"[..]),
        Some(b"order"),
        Some(b"order-711"),
        Some(b"OrderCreated"),
        Some(PAYLOAD.as_bytes()),
        Some(b"{}"),
        Some(b"2026-11-22 15:30:00.123456+00"),
    ])
    .unwrap();
    (relation, tuple)
}

fn envelope() -> Bytes {
    Bytes::from(format!(
        r#"{{"v": 1, "id": "5b1d3c8e-9f0a-4c71-8a55-2b7e6f0d9c13", "headers": {{}}, "payload": {PAYLOAD}, "created_at": "2026-11-22T15:30:00.123456+00:00", "event_type": "OrderCreated", "aggregate_id": "order-711", "aggregate_type": "order"}}"#
    ))
}

fn bench(c: &mut Criterion) {
    let (relation, tuple) = row();
    let content = envelope();
    let lsn: Lsn = "0/16B3748".parse().unwrap();
    for (name, format) in [
        ("as-stored", EventFormat::AsStored),
        (
            "cloudevents-binary",
            EventFormat::CloudEventsBinary {
                source: "/walbox/walbox".into(),
            },
        ),
        (
            "cloudevents-structured",
            EventFormat::CloudEventsStructured {
                source: "/walbox/walbox".into(),
            },
        ),
        ("debezium", EventFormat::Debezium),
    ] {
        let mapping = OutboxMapping {
            format,
            ..OutboxMapping::default()
        };
        let columns = mapping.resolve(&relation).unwrap();
        // As the relay maps: topic names kept from one event to the next.
        let mut topics = Topics::default();
        c.bench_function(&format!("map/row/{name}"), |b| {
            b.iter(|| {
                black_box(
                    mapping
                        .map_with(&columns, black_box(&tuple), &mut topics)
                        .unwrap(),
                )
            })
        });
        c.bench_function(&format!("map/message/{name}"), |b| {
            b.iter(|| {
                black_box(
                    walbox::mapping::envelope::map(&mapping, black_box(&content), lsn, &mut topics)
                        .unwrap(),
                )
            })
        });
    }
    let schema = walbox::schema_registry::avro::parse(
        r#"{"type": "record", "name": "OrderCreated", "namespace": "shop", "fields": [
            {"name": "pad", "type": "string"},
            {"name": "total", "type": "long"},
            {"name": "order_id", "type": "string"}]}"#,
    )
    .unwrap();
    let mapping = OutboxMapping {
        format: EventFormat::Avro,
        ..OutboxMapping::default()
    };
    let columns = mapping.resolve(&relation).unwrap();
    let mut topics = Topics::default();
    c.bench_function("map/row/avro", |b| {
        b.iter(|| {
            let event = mapping
                .map_with(&columns, black_box(&tuple), &mut topics)
                .unwrap();
            let value = event.value.as_deref().unwrap();
            black_box(walbox::schema_registry::avro::encode(&schema, 7, value).unwrap())
        })
    });
    let validator = walbox::schema_registry::json_schema::compile(
        r#"{"type": "object", "additionalProperties": false,
            "required": ["pad", "total", "order_id"],
            "properties": {"pad": {"type": "string"}, "total": {"type": "integer"},
                           "order_id": {"type": "string"}}}"#,
    )
    .unwrap();
    let mapping = OutboxMapping {
        format: EventFormat::JsonSchema,
        ..OutboxMapping::default()
    };
    c.bench_function("map/row/json-schema", |b| {
        b.iter(|| {
            let event = mapping
                .map_with(&columns, black_box(&tuple), &mut topics)
                .unwrap();
            let value = event.value.as_deref().unwrap();
            black_box(walbox::schema_registry::json_schema::encode(&validator, 7, value).unwrap())
        })
    });
    // Derived schemas: the subject's shape from one payload, its schemas.
    use walbox::schema_registry::derive::Shape;
    let payload: serde_json::Value = serde_json::from_slice(
        mapping
            .map_with(&columns, &tuple, &mut topics)
            .unwrap()
            .value
            .as_deref()
            .unwrap(),
    )
    .unwrap();
    let known = Shape::of(&payload).unwrap();
    let holds = |value: &[u8]| {
        let json: serde_json::Value = serde_json::from_slice(value).unwrap();
        assert!(known.holds(&Shape::of(&json).unwrap()));
    };
    let derived_json = walbox::schema_registry::json_schema::compile(&known.json_schema()).unwrap();
    c.bench_function("map/row/json-schema-derived", |b| {
        b.iter(|| {
            let event = mapping
                .map_with(&columns, black_box(&tuple), &mut topics)
                .unwrap();
            let value = event.value.as_deref().unwrap();
            holds(value);
            black_box(
                walbox::schema_registry::json_schema::encode(&derived_json, 7, value).unwrap(),
            )
        })
    });
    let derived_avro =
        walbox::schema_registry::avro::parse(&known.avro_schema("shop.OrderCreated").unwrap())
            .unwrap();
    let mapping = OutboxMapping {
        format: EventFormat::Avro,
        ..OutboxMapping::default()
    };
    c.bench_function("map/row/avro-derived", |b| {
        b.iter(|| {
            let event = mapping
                .map_with(&columns, black_box(&tuple), &mut topics)
                .unwrap();
            let value = event.value.as_deref().unwrap();
            holds(value);
            black_box(walbox::schema_registry::avro::encode(&derived_avro, 7, value).unwrap())
        })
    });
    let file = walbox::schema_registry::protobuf::compile(
        "syntax = \"proto3\"; package shop;
         message OrderCreated { string pad = 1; int64 total = 2; string order_id = 3; }",
    )
    .unwrap();
    let mapping = OutboxMapping {
        format: EventFormat::Protobuf,
        ..OutboxMapping::default()
    };
    c.bench_function("map/row/protobuf", |b| {
        b.iter(|| {
            let event = mapping
                .map_with(&columns, black_box(&tuple), &mut topics)
                .unwrap();
            let value = event.value.as_deref().unwrap();
            black_box(
                walbox::schema_registry::protobuf::encode(
                    &file,
                    7,
                    Some("shop.OrderCreated"),
                    value,
                )
                .unwrap(),
            )
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
