//! The dead-letter policy, stated once: what happens to an event walbox
//! cannot deliver as it is.
//!
//! Three things make an event undeliverable:
//! - **unmappable**: its outbox row cannot become a Kafka record (a NULL
//!   aggregate id, a text payload that is not JSON, a topic name Kafka refuses);
//! - **invalid**: its payload does not fit its subject's schema
//!   (`format = "avro"`, [`crate::schema_registry`]);
//! - **refused**: the broker refused the record for good
//!   ([`DeliveryErrorKind::Permanent`]: authorization, size, unknown topic).
//!
//! Without a dead-letter topic either one halts walbox, and the slot stays
//! before the event. With one, the event is published there instead, and it
//! counts as delivered (its transaction may be confirmed) only when the broker
//! acknowledged that copy; if the copy fails too, walbox halts.
//!
//! Every dead-lettered record carries the same headers, beside the original
//! record's own (a refused record keeps its key, value and headers; an
//! unmappable row's value is its payload column as stored):
//!
//! | header | value |
//! |---|---|
//! | `walbox.error` | the error, as text |
//! | `walbox.error.kind` | `unmappable`, `invalid` or `refused` |
//! | `walbox.original.topic` | the topic the event was meant for (absent when the row named none) |
//! | `walbox.source.lsn` | the WAL position of the row, e.g. `0/16B3748` |
//! | `walbox.event.id` | the event id (absent when the row has none) |

use bytes::Bytes;
use pgoutput_decoder::Lsn;
use sink_core::{DeliveryError, DeliveryErrorKind, Header, Record};

/// Header names on dead-lettered records.
pub mod headers {
    /// The error that sent the record to the dead-letter topic.
    pub const ERROR: &str = "walbox.error";
    /// Its kind: [`super::DeadLetterKind::as_str`].
    pub const ERROR_KIND: &str = "walbox.error.kind";
    /// The topic the record was meant for.
    pub const ORIGINAL_TOPIC: &str = "walbox.original.topic";
    /// The WAL position of the outbox row.
    pub const SOURCE_LSN: &str = "walbox.source.lsn";
    /// The event id.
    pub const EVENT_ID: &str = "walbox.event.id";
}

/// Why an event went to the dead-letter topic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeadLetterKind {
    /// The row could not be mapped to a record.
    Unmappable,
    /// Its payload does not fit its schema.
    Invalid,
    /// The broker refused the record for good.
    Refused,
}

impl DeadLetterKind {
    /// The stable word used in headers and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterKind::Unmappable => "unmappable",
            DeadLetterKind::Invalid => "invalid",
            DeadLetterKind::Refused => "refused",
        }
    }
}

/// Where undeliverable events go: nowhere (halt) or a topic.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeadLetters {
    topic: Option<String>,
}

/// What an undeliverable event's source was: enough to label its copy.
#[derive(Clone, Copy, Debug)]
pub struct Origin<'a> {
    /// The topic the event was meant for, if the row named one.
    pub topic: Option<&'a str>,
    /// The row's WAL position.
    pub lsn: Lsn,
    /// The event id, if the row has one.
    pub event_id: Option<&'a str>,
}

impl DeadLetters {
    /// Halt on undeliverable events.
    pub fn halt() -> Self {
        DeadLetters { topic: None }
    }

    /// The dead-letter topic, if any.
    pub fn topic(&self) -> Option<&str> {
        self.topic.as_deref()
    }

    /// Publish undeliverable events to `topic`.
    pub fn to_topic(topic: impl Into<String>) -> Self {
        DeadLetters {
            topic: Some(topic.into()),
        }
    }

    /// The dead-letter copy of an unmappable row, or `None` to halt.
    pub fn unmappable<T>(
        &self,
        error: &dyn std::fmt::Display,
        payload: Option<Bytes>,
        origin: Origin<'_>,
        token: T,
    ) -> Option<Record<T>> {
        let topic = self.topic.as_deref()?;
        let record = Record::new(topic, None, payload, token);
        Some(label(
            record,
            DeadLetterKind::Unmappable,
            &error.to_string(),
            origin,
        ))
    }

    /// The dead-letter copy of a record whose payload does not fit its
    /// schema (its value still the JSON payload), or `None` to halt.
    pub fn invalid<T>(
        &self,
        error: &dyn std::fmt::Display,
        record: Record<T>,
        lsn: Lsn,
    ) -> Option<Record<T>> {
        self.copy(record, DeadLetterKind::Invalid, &error.to_string(), lsn)
    }

    /// The dead-letter copy of a record the broker refused, or `None` to
    /// halt (no topic, or not a permanent refusal).
    pub fn refused<T>(
        &self,
        error: &DeliveryError,
        returned: Option<Record<()>>,
        lsn: Lsn,
        token: T,
    ) -> Option<Record<T>> {
        self.topic.as_ref()?;
        if error.kind != DeliveryErrorKind::Permanent {
            return None;
        }
        let returned = returned?;
        let record = Record {
            topic: returned.topic,
            key: returned.key,
            value: returned.value,
            headers: returned.headers,
            timestamp_ms: returned.timestamp_ms,
            origin: None,
            token,
        };
        self.copy(record, DeadLetterKind::Refused, &error.message, lsn)
    }

    /// `record` moved to the dead-letter topic and labelled (its event id
    /// from its `id` header), or `None` without a topic.
    fn copy<T>(
        &self,
        mut record: Record<T>,
        kind: DeadLetterKind,
        error: &str,
        lsn: Lsn,
    ) -> Option<Record<T>> {
        let topic = self.topic.as_deref()?;
        let event_id = record
            .headers
            .iter()
            .find(|h| h.name == "id")
            .and_then(|h| std::str::from_utf8(&h.value).ok())
            .map(str::to_owned);
        let original_topic = std::mem::replace(&mut record.topic, topic.into());
        let origin = Origin {
            topic: Some(&original_topic),
            lsn,
            event_id: event_id.as_deref(),
        };
        Some(label(record, kind, error, origin))
    }
}

fn label<T>(
    mut record: Record<T>,
    kind: DeadLetterKind,
    error: &str,
    origin: Origin<'_>,
) -> Record<T> {
    let mut add = |name: &str, value: &str| {
        record.headers.push(Header {
            name: name.to_owned().into(),
            value: Bytes::copy_from_slice(value.as_bytes()),
        })
    };
    add(headers::ERROR, error);
    add(headers::ERROR_KIND, kind.as_str());
    if let Some(t) = origin.topic {
        add(headers::ORIGINAL_TOPIC, t);
    }
    add(headers::SOURCE_LSN, &origin.lsn.to_string());
    if let Some(id) = origin.event_id {
        add(headers::EVENT_ID, id);
    }
    record
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn headers_of<T>(r: &Record<T>) -> HashMap<&str, &str> {
        r.headers
            .iter()
            .map(|h| (&*h.name, std::str::from_utf8(&h.value).unwrap()))
            .collect()
    }

    #[test]
    fn both_kinds_carry_the_same_header_set() {
        let dl = DeadLetters::to_topic("dlq");
        let lsn = Lsn::new(0x16B_3748);
        let unmappable = dl
            .unmappable(
                &"event e-1: column \"aggregate_id\" (the aggregate id) is NULL",
                Some(Bytes::from_static(b"{}")),
                Origin {
                    topic: Some("outbox.event.order"),
                    lsn,
                    event_id: Some("e-1"),
                },
                1u8,
            )
            .unwrap();
        let returned = Record::new(
            "outbox.event.order",
            Some(Bytes::from_static(b"agg")),
            Some(Bytes::from_static(b"{}")),
            (),
        )
        .with_header("id", "e-2")
        .with_timestamp_ms(7);
        let error = DeliveryError {
            kind: DeliveryErrorKind::Permanent,
            message: "Broker: Topic authorization failed".into(),
        };
        let refused = dl.refused(&error, Some(returned), lsn, 2u8).unwrap();

        for (r, kind, id) in [
            (&unmappable, "unmappable", "e-1"),
            (&refused, "refused", "e-2"),
        ] {
            let h = headers_of(r);
            assert_eq!(&*r.topic, "dlq");
            assert_eq!(h[headers::ERROR_KIND], kind);
            assert_eq!(h[headers::ORIGINAL_TOPIC], "outbox.event.order");
            assert_eq!(h[headers::SOURCE_LSN], "0/16B3748");
            assert_eq!(h[headers::EVENT_ID], id);
            assert!(!h[headers::ERROR].is_empty());
        }
        assert_eq!(refused.key.as_deref(), Some(b"agg".as_slice()));
        assert_eq!(refused.timestamp_ms, Some(7));
        assert_eq!(
            headers_of(&refused)["id"],
            "e-2",
            "the record's own headers stay"
        );
    }

    #[test]
    fn without_a_topic_or_for_a_passing_failure_it_halts() {
        let error = DeliveryError {
            kind: DeliveryErrorKind::Permanent,
            message: "m".into(),
        };
        let returned = || Some(Record::new("t", None, None, ()));
        let origin = Origin {
            topic: None,
            lsn: Lsn::ZERO,
            event_id: None,
        };
        let halt = DeadLetters::halt();
        assert!(halt.unmappable(&"e", None, origin, ()).is_none());
        assert!(halt.refused(&error, returned(), Lsn::ZERO, ()).is_none());
        let dl = DeadLetters::to_topic("dlq");
        let fatal = DeliveryError {
            kind: DeliveryErrorKind::Fatal,
            ..error.clone()
        };
        assert!(dl.refused(&fatal, returned(), Lsn::ZERO, ()).is_none());
        assert!(dl.refused(&error, None, Lsn::ZERO, ()).is_none());
        let copy = dl.unmappable(&"e", None, origin, ()).unwrap();
        let h = headers_of(&copy).into_keys().collect::<Vec<_>>();
        assert!(!h.contains(&headers::ORIGINAL_TOPIC) && !h.contains(&headers::EVENT_ID));
    }
}
