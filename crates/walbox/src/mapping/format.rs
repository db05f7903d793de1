//! Record formats: what a mapped event's key, value and headers look like
//! on the wire, beyond the payload as stored.
//!
//! | format | key | value | headers added |
//! |---|---|---|---|
//! | as stored (default) | aggregate id | the payload | — |
//! | CloudEvents binary | aggregate id | the payload (the event's `data`) | `ce_specversion`, `ce_id`, `ce_source`, `ce_type`, `ce_subject`, `ce_time`, `content-type` |
//! | CloudEvents structured | aggregate id | a JSON CloudEvent, the payload as `data` | `content-type: application/cloudevents+json` |
//! | Debezium | aggregate id as a JSON string (`"42"`) | the payload, compact JSON (none: `null`) | — |
//!
//! walbox's own headers (`id`, `event_type`, the headers column's) stay in
//! every format, so consumers that deduplicate on `id` keep working.
//! CloudEvents' `type` is the event type, else the aggregate type; `subject`
//! is the aggregate id; `time` is the event's timestamp when it has one. The
//! Debezium format is the record Debezium's EventRouter wrote with
//! `table.expand.json.payload = true` and the JSON key converter: the same
//! key bytes hash to the same partition, so a topic keeps each aggregate on
//! its partition across a switch-over from Debezium.

use bytes::Bytes;
use sink_core::Header;

use crate::mapping::timestamp::rfc3339_ms;
use crate::mapping::MappedEvent;
use crate::mapping::{TRACEPARENT, TRACESTATE};

/// How an event becomes a record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum EventFormat {
    /// The payload as stored; headers `id` and `event_type`.
    #[default]
    AsStored,
    /// CloudEvents 1.0, Kafka protocol binding, binary content mode.
    CloudEventsBinary {
        /// The `source` attribute.
        source: String,
    },
    /// CloudEvents 1.0, Kafka protocol binding, structured content mode (JSON).
    CloudEventsStructured {
        /// The `source` attribute.
        source: String,
    },
    /// Debezium EventRouter's record with the JSON key converter.
    Debezium,
    /// The JSON payload serialized with its subject's schema from a schema
    /// registry, in Confluent's wire format ([`crate::schema_registry`]):
    /// the mapping leaves the value JSON, and the relay serializes it just
    /// before the record is sent.
    Avro,
    /// The JSON payload validated against its subject's JSON Schema, in
    /// Confluent's wire format; serialized by the relay as [`Self::Avro`].
    JsonSchema,
    /// The JSON payload as a message of its subject's `.proto` file, in
    /// Confluent's wire format; serialized by the relay as [`Self::Avro`].
    Protobuf,
}

/// `json` without the whitespace between its tokens (Postgres writes
/// `jsonb` as `{"a": 1, "b": [1, 2]}`, JsonConverter as `{"a":1,"b":[1,2]}`);
/// strings are kept byte for byte. The payload is JSON already (checked
/// when mapped): this only drops bytes, in one pass.
fn compact_json(json: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for &b in json {
        if in_string {
            out.push(b);
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else if !matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
            in_string = b == b'"';
            out.push(b);
        }
    }
    Bytes::from(out)
}

/// What a format reads of the event besides the record.
pub(crate) struct Attributes<'a> {
    pub(crate) aggregate_type: &'a str,
    pub(crate) event_type: Option<&'a str>,
}

fn header(name: &'static str, value: impl Into<Bytes>) -> Header {
    Header {
        name: name.into(),
        value: value.into(),
    }
}

impl EventFormat {
    /// Its name in the configuration.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            EventFormat::AsStored => "as-stored",
            EventFormat::CloudEventsBinary { .. } => "cloudevents-binary",
            EventFormat::CloudEventsStructured { .. } => "cloudevents-structured",
            EventFormat::Debezium => "debezium",
            EventFormat::Avro => "avro",
            EventFormat::JsonSchema => "json-schema",
            EventFormat::Protobuf => "protobuf",
        }
    }

    /// Whether the format writes or declares the payload as JSON: every one
    /// but as-stored (CloudEvents binary says `content-type:
    /// application/json`; the structured mode and Debezium's envelope embed
    /// it). A text payload is then checked to be JSON, and a `bytea` one
    /// refused.
    pub(crate) fn needs_json(&self) -> bool {
        !matches!(self, EventFormat::AsStored)
    }

    /// The record key of an event of aggregate `aggregate_id`.
    pub(crate) fn key_of(&self, aggregate_id: &str) -> Bytes {
        match self {
            EventFormat::Debezium => {
                Bytes::from(serde_json::Value::String(aggregate_id.to_owned()).to_string())
            }
            _ => Bytes::copy_from_slice(aggregate_id.as_bytes()),
        }
    }

    /// Rewrites `event`'s record in this format.
    pub(crate) fn apply(&self, event: &mut MappedEvent, attributes: &Attributes<'_>) {
        match self {
            EventFormat::AsStored
            | EventFormat::Avro
            | EventFormat::JsonSchema
            | EventFormat::Protobuf => {}
            EventFormat::Debezium => {
                event.key = self.key_of(&event.aggregate_id);
                // As Kafka Connect's JsonConverter writes it: compact, and a
                // missing payload as JSON `null` (not a record without a
                // value, which a compacted topic takes for a tombstone).
                event.value = Some(match event.value.take() {
                    Some(json) => compact_json(&json),
                    None => Bytes::from_static(b"null"),
                });
            }
            EventFormat::CloudEventsBinary { source } => {
                let mut added = vec![
                    header("ce_specversion", "1.0"),
                    header("ce_id", event.event_id.clone()),
                    header("ce_source", source.clone()),
                    header(
                        "ce_type",
                        attributes
                            .event_type
                            .unwrap_or(attributes.aggregate_type)
                            .to_owned(),
                    ),
                    header("ce_subject", event.aggregate_id.clone()),
                ];
                if let Some(ms) = event.timestamp_ms {
                    added.push(header("ce_time", rfc3339_ms(ms)));
                }
                if event.value.is_some() {
                    added.push(header("content-type", "application/json"));
                }
                event.headers.extend(added);
            }
            EventFormat::CloudEventsStructured { source } => {
                let mut ce = serde_json::Map::new();
                let mut put = |k: &str, v: &str| {
                    ce.insert(k.into(), serde_json::Value::String(v.into()));
                };
                put("specversion", "1.0");
                put("id", &event.event_id);
                put("source", source);
                put(
                    "type",
                    attributes.event_type.unwrap_or(attributes.aggregate_type),
                );
                put("subject", &event.aggregate_id);
                if let Some(ms) = event.timestamp_ms {
                    put("time", &rfc3339_ms(ms));
                }
                // The distributed tracing extension's attributes.
                for name in [TRACEPARENT, TRACESTATE] {
                    if let Some(v) = event.header(name).and_then(|v| std::str::from_utf8(v).ok()) {
                        put(name, v);
                    }
                }
                let mut json = serde_json::Value::Object(ce).to_string();
                if let Some(data) = &event.value {
                    // The payload is JSON already (json, jsonb, or text
                    // checked as JSON): spliced in, not parsed again.
                    json.pop();
                    json.push_str(r#","datacontenttype":"application/json","data":"#);
                    json.push_str(&String::from_utf8_lossy(data));
                    json.push('}');
                }
                event.value = Some(Bytes::from(json));
                event
                    .headers
                    .push(header("content-type", "application/cloudevents+json"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> MappedEvent {
        MappedEvent {
            topic: "outbox.event.order".into(),
            key: Bytes::from_static(b"42"),
            value: Some(Bytes::from_static(br#"{"total":12.5}"#)),
            headers: vec![
                header("id", "e-1"),
                header("event_type", "OrderPlaced"),
                header(
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                ),
            ],
            timestamp_ms: Some(1_795_280_400_123),
            event_id: "e-1".into(),
            aggregate_id: "42".into(),
        }
    }

    fn get<'a>(e: &'a MappedEvent, name: &str) -> Option<&'a str> {
        e.header(name).map(|v| std::str::from_utf8(v).unwrap())
    }

    const ATTRS: Attributes<'static> = Attributes {
        aggregate_type: "order",
        event_type: Some("OrderPlaced"),
    };

    #[test]
    fn binary_mode_adds_the_ce_headers_and_keeps_the_value() {
        let mut e = event();
        EventFormat::CloudEventsBinary {
            source: "/walbox/s".into(),
        }
        .apply(&mut e, &ATTRS);
        for (name, value) in [
            ("ce_specversion", "1.0"),
            ("ce_id", "e-1"),
            ("ce_source", "/walbox/s"),
            ("ce_type", "OrderPlaced"),
            ("ce_subject", "42"),
            ("ce_time", "2026-11-21T17:00:00.123Z"),
            ("content-type", "application/json"),
            ("id", "e-1"),
        ] {
            assert_eq!(get(&e, name), Some(value), "{name}");
        }
        assert_eq!(e.value.as_deref(), Some(&br#"{"total":12.5}"#[..]));
        assert_eq!(&e.key[..], b"42");
        // No event type: the aggregate type; no value: no content type.
        let mut e = event();
        e.value = None;
        let attrs = Attributes {
            event_type: None,
            ..ATTRS
        };
        EventFormat::CloudEventsBinary { source: "s".into() }.apply(&mut e, &attrs);
        assert_eq!(get(&e, "ce_type"), Some("order"));
        assert_eq!(get(&e, "content-type"), None);
    }

    #[test]
    fn structured_mode_is_one_json_cloudevent() {
        let mut e = event();
        EventFormat::CloudEventsStructured {
            source: "/walbox/s".into(),
        }
        .apply(&mut e, &ATTRS);
        let v: serde_json::Value = serde_json::from_slice(e.value.as_deref().unwrap()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "specversion": "1.0", "id": "e-1", "source": "/walbox/s", "type": "OrderPlaced",
                "subject": "42", "time": "2026-11-21T17:00:00.123Z",
                "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "datacontenttype": "application/json", "data": {"total": 12.5}
            })
        );
        assert_eq!(
            get(&e, "content-type"),
            Some("application/cloudevents+json")
        );
        let mut e = event();
        e.value = None;
        e.timestamp_ms = None;
        EventFormat::CloudEventsStructured { source: "s".into() }.apply(&mut e, &ATTRS);
        let v: serde_json::Value = serde_json::from_slice(e.value.as_deref().unwrap()).unwrap();
        assert!(v.get("data").is_none() && v.get("time").is_none(), "{v}");
    }

    #[test]
    fn debezium_keys_are_json_strings() {
        let mut e = event();
        e.aggregate_id = "a\"b".into();
        EventFormat::Debezium.apply(&mut e, &ATTRS);
        assert_eq!(&e.key[..], br#""a\"b""#);
        assert_eq!(e.value.as_deref(), Some(&br#"{"total":12.5}"#[..]));
    }

    #[test]
    fn debezium_values_are_compact_json_and_null() {
        let mut e = event();
        e.value = Some(Bytes::from_static(
            br#"{"a": [1, 2], "s": "x y\" z", "n": {"t": true}}"#,
        ));
        EventFormat::Debezium.apply(&mut e, &ATTRS);
        assert_eq!(
            e.value.as_deref(),
            Some(&br#"{"a":[1,2],"s":"x y\" z","n":{"t":true}}"#[..])
        );
        let mut e = event();
        e.value = None;
        EventFormat::Debezium.apply(&mut e, &ATTRS);
        assert_eq!(e.value.as_deref(), Some(&b"null"[..]));
    }
}
