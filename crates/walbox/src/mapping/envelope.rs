//! The event envelope: the content of a logical decoding message that is an
//! event (`source = "messages"` or `"both"`).
//!
//! An application writes an event without an outbox table by calling
//! `walbox.emit(…)` (installed by `walbox migrate`) or, from any language,
//! `pg_logical_emit_message(true, '<message_prefix>', '<envelope>')` in the
//! transaction of its business change. The envelope is a JSON object,
//! version 1:
//!
//! | field | | becomes |
//! |---|---|---|
//! | `v` | required, `1` | the envelope version |
//! | `id` | required, string | header `id`, the consumers' dedup key |
//! | `aggregate_type` | required, string | the topic, via `mapping.topic_template` |
//! | `aggregate_id` | required, non-empty string | the message key |
//! | `event_type` | string | header `event_type` |
//! | `payload` | any JSON | the message value, its bytes as written (`null` or absent: no value) |
//! | `headers` | object | one header per key: strings as is, other values as JSON text |
//! | `created_at` | RFC 3339 or Postgres timestamptz text | the message timestamp |
//! | `traceparent`, `tracestate` | strings | the W3C trace context headers of the same names |
//!
//! Fields walbox does not know are ignored, so version 1 can grow fields
//! that older walbox versions skip; a version other than 1 is refused, like
//! a row that cannot be mapped (to the dead-letter topic, or walbox stops
//! before it). The payload is not copied: the value is a slice of the
//! replication frame.

use std::borrow::Cow;

use bytes::Bytes;
use pgoutput_decoder::Lsn;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::mapping::{Fields, MapError, MappedEvent, OutboxMapping, Topics};
use crate::mapping::{TRACEPARENT, TRACESTATE};

/// The envelope version this walbox reads.
pub const VERSION: u64 = 1;

#[derive(Deserialize)]
struct Envelope<'a> {
    v: Option<u64>,
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    aggregate_type: Option<Cow<'a, str>>,
    #[serde(borrow)]
    aggregate_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    event_type: Option<Cow<'a, str>>,
    #[serde(borrow)]
    payload: Option<&'a RawValue>,
    #[serde(borrow)]
    headers: Option<&'a RawValue>,
    #[serde(borrow)]
    created_at: Option<Cow<'a, str>>,
    #[serde(borrow)]
    traceparent: Option<Cow<'a, str>>,
    #[serde(borrow)]
    tracestate: Option<Cow<'a, str>>,
}

/// The event id of a message's envelope, if it has one (for labelling a
/// message that cannot be mapped).
pub fn event_id_of(content: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Id<'a> {
        #[serde(borrow)]
        id: Option<Cow<'a, str>>,
    }
    serde_json::from_slice::<Id<'_>>(content)
        .ok()?
        .id
        .map(Cow::into_owned)
}

/// Maps the content of an event message at `lsn`, with topic names kept in
/// `topics`.
pub fn map(
    mapping: &OutboxMapping,
    content: &Bytes,
    lsn: Lsn,
    topics: &mut Topics,
) -> Result<MappedEvent, MapError> {
    let refuse = |reason: String| MapError::Envelope {
        lsn: lsn.to_string(),
        reason,
    };
    let e: Envelope<'_> = serde_json::from_slice(content)
        .map_err(|e| refuse(format!("not an event envelope (a JSON object): {e}")))?;
    let known = |reason: &str| match &e.id {
        Some(id) => format!("event {id}: {reason}"),
        None => reason.to_owned(),
    };
    match e.v {
        Some(VERSION) => {}
        Some(v) => {
            return Err(refuse(known(&format!(
                "envelope version {v}; this walbox reads version {VERSION} (upgrade walbox)"
            ))))
        }
        None => return Err(refuse(known("the envelope has no version \"v\""))),
    }
    let missing = |name: &str| refuse(known(&format!("the envelope has no {name:?}")));
    let id = e.id.as_deref().ok_or_else(|| missing("id"))?.to_owned();
    let aggregate_type = e
        .aggregate_type
        .as_deref()
        .ok_or_else(|| missing("aggregate_type"))?;
    let aggregate_id = e
        .aggregate_id
        .as_deref()
        .ok_or_else(|| missing("aggregate_id"))?;
    // The payload's bytes, sliced out of the frame.
    let value = e.payload.filter(|p| p.get() != "null").map(|p| {
        let start = p.get().as_ptr() as usize - content.as_ptr() as usize;
        content.slice(start..start + p.get().len())
    });
    let mut extra_headers = Vec::new();
    if let Some(t) = &e.traceparent {
        extra_headers.push((TRACEPARENT, t.as_ref()));
    }
    if let Some(t) = &e.tracestate {
        extra_headers.push((TRACESTATE, t.as_ref()));
    }
    mapping.event(
        Fields {
            template: None,
            id,
            aggregate_type,
            aggregate_id,
            event_type: e.event_type.as_deref(),
            value,
            value_unchecked: false,
            extra_headers,
            headers_json: e.headers.map(RawValue::get),
            timestamp: e.created_at.as_deref(),
        },
        topics,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapping::format::EventFormat;

    fn lsn() -> Lsn {
        "0/16B3748".parse().unwrap()
    }

    fn header<'a>(e: &'a MappedEvent, name: &str) -> Option<&'a str> {
        e.header(name).map(|v| std::str::from_utf8(v).unwrap())
    }

    #[test]
    fn maps_an_envelope_like_a_row() {
        let content = Bytes::from_static(
            br#"{"v":1,"id":"e-1","aggregate_type":"order","aggregate_id":"42","event_type":"OrderPlaced",
                "payload": {"total": 12.5, "items": ["a\"b"]},"headers":{"tenant":"t1","n":3},
                "created_at":"2026-11-21T17:00:00.123Z","traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "future_field": [1,2]}"#,
        );
        let e = map(
            &OutboxMapping::default(),
            &content,
            lsn(),
            &mut Topics::default(),
        )
        .unwrap();
        assert_eq!(&*e.topic, "outbox.event.order");
        assert_eq!(&e.key[..], b"42");
        assert_eq!(
            e.value.as_deref(),
            Some(&br#"{"total": 12.5, "items": ["a\"b"]}"#[..]),
            "the payload's bytes as written"
        );
        assert_eq!(header(&e, "id"), Some("e-1"));
        assert_eq!(header(&e, "event_type"), Some("OrderPlaced"));
        assert_eq!(header(&e, "tenant"), Some("t1"));
        assert_eq!(header(&e, "n"), Some("3"));
        assert_eq!(
            header(&e, "traceparent"),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        assert_eq!(e.timestamp_ms, Some(1_795_280_400_123));
        // Zero-copy: the value is a slice of the content.
        let v = e.value.unwrap();
        assert!(content.as_ptr() <= v.as_ptr() && v.as_ptr() < content[content.len()..].as_ptr());
    }

    #[test]
    fn a_null_or_absent_payload_is_no_value_and_escapes_are_read() {
        for content in [
            r#"{"v":1,"id":"e\u002d2","aggregate_type":"order","aggregate_id":"4\"2","payload":null}"#,
            r#"{"v":1,"id":"e-2","aggregate_type":"order","aggregate_id":"4\"2"}"#,
        ] {
            let e = map(
                &OutboxMapping::default(),
                &Bytes::from(content),
                lsn(),
                &mut Topics::default(),
            )
            .unwrap();
            assert_eq!(e.value, None, "{content}");
            assert_eq!(e.event_id, "e-2");
            assert_eq!(&e.key[..], br#"4"2"#);
            assert_eq!(header(&e, "event_type"), None);
        }
    }

    #[test]
    fn refuses_what_is_not_a_version_1_envelope_in_one_line() {
        let cases: &[(&[u8], &str)] = &[
            (b"", "not an event envelope"),
            (b"\xff\xfe", "not an event envelope"),
            (b"[1,2]", "not an event envelope"),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":7}"#,
                "not an event envelope",
            ),
            (
                br#"{"id":"e","aggregate_type":"o","aggregate_id":"7"}"#,
                "event e: the envelope has no version",
            ),
            (
                br#"{"v":2,"id":"e","aggregate_type":"o","aggregate_id":"7"}"#,
                "event e: envelope version 2; this walbox reads version 1",
            ),
            (
                br#"{"v":1,"aggregate_type":"o","aggregate_id":"7"}"#,
                "the envelope has no \"id\"",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_id":"7"}"#,
                "event e: the envelope has no \"aggregate_type\"",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o"}"#,
                "event e: the envelope has no \"aggregate_id\"",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":""}"#,
                "the aggregate id is empty",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o o","aggregate_id":"7"}"#,
                "is not a valid Kafka topic name",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":"7","headers":[1]}"#,
                "headers column is not a JSON object",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":"7","headers":{"id":"x"}}"#,
                "a header walbox sets itself",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":"7","created_at":"soon"}"#,
                "is not a Postgres timestamp",
            ),
            (
                br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":"7","payload":{"a":}"#,
                "not an event envelope",
            ),
        ];
        for (content, expected) in cases {
            let e = map(
                &OutboxMapping::default(),
                &Bytes::copy_from_slice(content),
                lsn(),
                &mut Topics::default(),
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains(expected), "{e:?} should say {expected:?}");
            assert!(!e.contains('\n'), "{e:?}");
        }
    }

    #[test]
    fn never_panics_on_arbitrary_bytes() {
        // Every prefix of a valid envelope, and byte flips of it.
        let valid = br#"{"v":1,"id":"e","aggregate_type":"o","aggregate_id":"7","payload":{"a":[1,"x"]},"headers":{"h":"v"}}"#;
        for end in 0..=valid.len() {
            let _ = map(
                &OutboxMapping::default(),
                &Bytes::copy_from_slice(&valid[..end]),
                lsn(),
                &mut Topics::default(),
            );
        }
        for i in 0..valid.len() {
            for b in [0u8, b'"', b'{', b'}', b'\\', 0xff] {
                let mut v = valid.to_vec();
                v[i] = b;
                let _ = map(
                    &OutboxMapping::default(),
                    &Bytes::from(v),
                    lsn(),
                    &mut Topics::default(),
                );
            }
        }
    }

    #[test]
    fn the_record_formats_apply_to_envelopes_too() {
        let content = Bytes::from_static(
            br#"{"v":1,"id":"e-1","aggregate_type":"order","aggregate_id":"42","payload":{"a":1}}"#,
        );
        let mapping = OutboxMapping {
            format: EventFormat::Debezium,
            ..OutboxMapping::default()
        };
        let e = map(&mapping, &content, lsn(), &mut Topics::default()).unwrap();
        assert_eq!(&e.key[..], br#""42""#);
        assert_eq!(e.value.as_deref(), Some(&br#"{"a":1}"#[..]));
    }

    #[test]
    fn reads_the_id_of_a_broken_envelope_when_it_can() {
        assert_eq!(
            event_id_of(br#"{"v":9,"id":"e-9"}"#),
            Some("e-9".to_owned())
        );
        assert_eq!(event_id_of(b"nope"), None);
    }
}
