//! SQS as sink-core's [`Destination`]: how a record becomes a message, and
//! an answer a report.
//!
//! A record becomes a message on the events' queue, or on the dead-letter
//! queue when its topic is [`DEAD_LETTER_TOPIC`]: its value the body, its
//! headers message attributes and its key the [`KEY_ATTRIBUTE`] attribute.
//! On a FIFO queue the key is the message group (each key's order) and the
//! record's [`Origin`](sink_core::Origin) its deduplication id: the same on
//! every re-send of an event and never shared by two events (event ids may
//! repeat across tables, and SQS would drop the second as a duplicate while
//! reporting it sent). Stored is a delivery; a refusal is for good
//! ([`DeliveryErrorKind::Permanent`], the record returned for the caller's
//! dead-letter copy or quarantine); a request SQS refuses for good (the
//! queue, the credentials) is [`DeliveryErrorKind::Fatal`].

use std::time::Duration;

use bytes::Bytes;
use sink_core::{
    Admission, Delivered, Deliveries, DeliveryErrorKind, Destination, Permit, Record, Report,
};

use crate::{ConnectError, Failure, Message, QueueInfo, QueueRole, Reports, SqsConfig, SqsSink};

/// The attribute that carries the record key.
pub const KEY_ATTRIBUTE: &str = "walbox.key";

/// The topic of records bound for the dead-letter queue.
pub const DEAD_LETTER_TOPIC: &str = "walbox.dead-letters";

/// A record on its way: its token, and itself for a refusal's report.
#[derive(Debug)]
pub(crate) struct Carried<T> {
    token: T,
    record: Record<()>,
}

/// Sends records to SQS; their reports arrive on [`Outcomes`].
#[derive(Debug)]
pub struct Publisher<T> {
    sink: SqsSink<Carried<T>>,
}

/// Each sent record's report, once.
#[derive(Debug)]
pub struct Outcomes<T> {
    reports: Reports<Carried<T>>,
}

impl<T: Send + 'static> Publisher<T> {
    /// Reads the queues' attributes (a queue that is not there, or
    /// credentials SQS refuses, fail now in one line), then sends through a
    /// task of its own.
    pub async fn connect(config: SqsConfig) -> Result<(Self, Outcomes<T>), ConnectError> {
        let (sink, reports) = SqsSink::connect(config).await?;
        Ok((Publisher { sink }, Outcomes { reports }))
    }

    /// The events' queue, as read at connect.
    pub fn events_queue(&self) -> &QueueInfo {
        self.sink.events_queue()
    }

    /// The dead-letter queue, as read at connect.
    pub fn dead_letter_queue(&self) -> Option<&QueueInfo> {
        self.sink.dead_letter_queue()
    }

    /// Waits up to `within` for what is in flight, then stops sending; how
    /// many messages were left unreported.
    pub async fn close(self, within: Duration) -> usize {
        self.sink.close(within).await
    }
}

/// `record` as an SQS message.
fn message(record: &Record<()>) -> Message {
    let mut attributes: Vec<(String, Bytes)> = record
        .headers
        .iter()
        .map(|h| (h.name.to_string(), h.value.clone()))
        .collect();
    if let Some(key) = &record.key {
        attributes.push((KEY_ATTRIBUTE.to_owned(), key.clone()));
    }
    Message {
        queue: match &*record.topic {
            DEAD_LETTER_TOPIC => QueueRole::DeadLetters,
            _ => QueueRole::Events,
        },
        body: record.value.clone().unwrap_or_default(),
        key: record.key.clone(),
        // A record of no stream position is deduplicated by nothing but
        // its content's place in time: it is never re-sent by walbox.
        dedup: record
            .origin
            .as_ref()
            .map_or_else(|| format!("{:x}", fnv(&record.value)), |o| o.dedup_id()),
        attributes,
    }
}

/// A 64-bit FNV-1a of a value (a deduplication id for a record without an
/// origin).
fn fnv(value: &Option<Bytes>) -> u64 {
    value
        .as_deref()
        .unwrap_or_default()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
        })
}

impl<T: Send + 'static> Destination<T> for Publisher<T> {
    fn admission(&self) -> &Admission {
        self.sink.worker().admission()
    }

    async fn send(&self, permit: Permit, record: Record<T>) {
        let (record, token) = record.split_token();
        let message = message(&record);
        self.sink
            .publish(permit, message, Carried { token, record });
    }
}

impl<T: Send + 'static> Deliveries<T> for Outcomes<T> {
    async fn next(&mut self) -> Option<Report<T>> {
        let report = self.reports.next().await?;
        let Carried { token, record } = report.token;
        let (kind, why) = match report.result {
            Ok(stored) => {
                let at = Delivered::Sqs {
                    message_id: stored.message_id,
                    sequence_number: stored.sequence_number,
                };
                return Some(Report::delivered(token, at));
            }
            Err(e @ Failure::Refused(_)) => (DeliveryErrorKind::Permanent, e),
            Err(e @ Failure::Stopped(_)) => (DeliveryErrorKind::Fatal, e),
            Err(e @ Failure::Withheld) => (DeliveryErrorKind::Withheld, e),
        };
        Some(Report::failed(token, kind, why.to_string(), record))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use sink_core::Origin;

    use super::*;

    fn origin(stream: &str, position: u64, index: u64) -> Origin {
        Origin {
            stream: Arc::from(stream),
            history: 0,
            position,
            index,
            commit_time: 0,
        }
    }

    /// Two events with one id (two tables' own id sequences) are two
    /// messages to SQS; one event sent again is the same one. With the
    /// event id as deduplication id, FIFO SQS dropped the second event and
    /// reported it sent.
    #[test]
    fn the_deduplication_id_is_the_events_place_not_its_id() {
        let record = |o: Origin| {
            Record::new(
                "orders",
                Some(Bytes::from_static(b"a")),
                Some(Bytes::from_static(b"{}")),
                (),
            )
            .with_header("id", Bytes::from_static(b"17"))
            .with_origin(o)
        };
        let first = message(&record(origin("walbox", 200, 0)));
        let other_table = message(&record(origin("walbox", 200, 1)));
        let later = message(&record(origin("walbox", 300, 0)));
        let other_shard = message(&record(origin("walbox_1", 200, 0)));
        let again = message(&record(origin("walbox", 200, 0)));
        // A server restored on the same timeline reuses the position: its
        // new event there committed at another time.
        let restored = message(&record(Origin {
            commit_time: 1_700_000_000_000_000,
            ..origin("walbox", 200, 0)
        }));
        let longest = message(&record(Origin {
            commit_time: i64::MAX,
            position: u64::MAX,
            index: u64::MAX,
            ..origin(&"s".repeat(63), 0, 0)
        }));
        assert!(longest.dedup.len() <= 128, "{}", longest.dedup);
        assert_eq!(first.dedup, again.dedup);
        for m in [&other_table, &later, &other_shard, &restored] {
            assert_ne!(first.dedup, m.dedup);
        }
        assert!(first.dedup.len() <= 128, "{}", first.dedup);
        assert_eq!(first.queue, QueueRole::Events);
        let attrs: Vec<&str> = first.attributes.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(attrs, ["id", KEY_ATTRIBUTE]);
    }

    #[test]
    fn dead_letters_go_to_their_queue() {
        let record = Record::new(DEAD_LETTER_TOPIC, None, Some(Bytes::from_static(b"x")), ());
        assert_eq!(message(&record).queue, QueueRole::DeadLetters);
    }
}
