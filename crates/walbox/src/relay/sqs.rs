//! `sink = "sqs"`: the relay's [`Destination`] on Amazon SQS (sink-sqs).
//! A record becomes a message on `sqs.queue_url` (a dead-letter copy on
//! `sqs.dead_letter_queue_url`): its value the body, its headers message
//! attributes and its key the `walbox.key` attribute. On a FIFO queue the
//! key is the message group (each aggregate's order) and the event's place
//! in the stream the deduplication id: the slot, its transaction's commit
//! position and its index there, the same on every re-send of that event
//! and never shared by two events (event ids may repeat across tables, and
//! SQS would drop the second as a duplicate while reporting it sent).
//! Stored is a delivery; a refusal is for good,
//! which the dead-letter policy handles as a broker's refusal on Kafka; a
//! request SQS refuses for good (the queue, the credentials) stops walbox.

use bytes::Bytes;
use sink_kafka::{Delivered, DeliveryError, DeliveryErrorKind, Record, Report};
use sink_sqs::{Failure, Message, Permit, QueueRole, Reports, SqsSink};

use super::destination::{Deliveries, Destination};
use super::Token;

/// The attribute that carries the record key (the aggregate id).
pub const SQS_KEY_ATTRIBUTE: &str = "walbox.key";

/// A record on its way: its token, and itself for a dead-letter copy.
#[derive(Debug)]
pub struct SqsSent {
    token: Token,
    record: Record<()>,
}

/// Sends records to SQS.
#[derive(Debug)]
pub struct Sqs {
    sink: SqsSink<SqsSent>,
    /// The slot events come from: part of each deduplication id.
    slot: String,
}

impl Sqs {
    /// The destination on `sink`, for events of `slot`.
    pub fn new(sink: SqsSink<SqsSent>, slot: &str) -> Self {
        Sqs {
            sink,
            slot: slot.to_owned(),
        }
    }

    /// Stops sending after waiting up to `within` for what is in flight;
    /// how many messages were left unreported.
    pub async fn close(self, within: std::time::Duration) -> usize {
        self.sink.close(within).await
    }
}

/// The deduplication id of the event of `token` from `slot`: its place in
/// the stream (slot names are at most 63 of `[a-z0-9_]`, so it stays far
/// below SQS's 128 characters).
fn dedup_id(slot: &str, token: &Token) -> String {
    format!("{slot}/{}/{}", token.commit_lsn, token.index)
}

/// `record` as an SQS message, from `slot`.
fn message(record: &Record<()>, token: &Token, slot: &str) -> Message {
    let mut attributes: Vec<(String, Bytes)> = record
        .headers
        .iter()
        .map(|h| (h.name.to_string(), h.value.clone()))
        .collect();
    if let Some(key) = &record.key {
        attributes.push((SQS_KEY_ATTRIBUTE.to_owned(), key.clone()));
    }
    let dedup = dedup_id(slot, token);
    Message {
        queue: match token.dead_letter {
            Some(_) => QueueRole::DeadLetters,
            None => QueueRole::Events,
        },
        body: record.value.clone().unwrap_or_default(),
        key: record.key.clone(),
        dedup,
        attributes,
    }
}

impl Destination for Sqs {
    type Permit = Permit;

    async fn reserve(&self, size: usize) -> Permit {
        self.sink.reserve(size).await
    }

    async fn send(&self, permit: Permit, record: Record<Token>) {
        let (record, token) = record.split_token();
        let message = message(&record, &token, &self.slot);
        self.sink
            .publish(permit, message, SqsSent { token, record });
    }

    fn in_flight(&self) -> usize {
        self.sink.in_flight()
    }

    fn in_flight_bytes(&self) -> usize {
        self.sink.in_flight_bytes()
    }
}

/// SQS's reports as the relay reads Kafka's: stored is delivered
/// (partition 0, offset -1: SQS has neither); a refusal is permanent and
/// returns the record for its dead-letter copy; a request refused for good
/// is fatal; a withheld message (after a refusal, on_failure = stop) was
/// not sent.
#[derive(Debug)]
pub struct SqsReports(pub Reports<SqsSent>);

impl Deliveries for SqsReports {
    async fn next(&mut self) -> Option<Report<Token>> {
        let r = self.0.next().await?;
        let SqsSent { token, record } = r.token;
        let failed = |kind, message: String| DeliveryError {
            kind,
            code: None,
            message,
        };
        Some(match r.result {
            Ok(()) => Report {
                token,
                result: Ok(Delivered {
                    partition: 0,
                    offset: -1,
                }),
                returned: None,
            },
            Err(Failure::Refused(refusal)) => Report {
                token,
                result: Err(failed(DeliveryErrorKind::Permanent, refusal.to_string())),
                returned: Some(record),
            },
            Err(e @ Failure::Stopped(_)) => Report {
                token,
                result: Err(failed(DeliveryErrorKind::Fatal, e.to_string())),
                returned: None,
            },
            Err(e @ Failure::Withheld) => Report {
                token,
                result: Err(failed(DeliveryErrorKind::Withheld, e.to_string())),
                returned: None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use pgoutput_decoder::{Lsn, PgTimestamp};

    use super::*;
    use crate::progress::Progress;

    fn token(commit_lsn: u64, index: u64) -> Token {
        Token {
            event: Progress::new(Duration::from_secs(1), Duration::ZERO).marker(),
            lsn: Lsn::new(commit_lsn - 10),
            commit_lsn: Lsn::new(commit_lsn),
            index,
            commit_time: PgTimestamp::default(),
            topic: Arc::from("orders"),
            dead_letter: None,
            progress_record: false,
            released: None,
            span: None,
            event_id: None,
            sampled: false,
            serialized: false,
        }
    }

    /// Two events with one id (two tables' own id sequences) are two
    /// messages to SQS; one event sent again is the same one. With the
    /// event id as deduplication id, FIFO SQS dropped the second event and
    /// reported it sent.
    #[test]
    fn the_deduplication_id_is_the_events_place_not_its_id() {
        let record = Record::new(
            "orders",
            Some(Bytes::from_static(b"a")),
            Some(Bytes::from_static(b"{}")),
            (),
        )
        .with_header(crate::mapping::ID_HEADER, Bytes::from_static(b"17"));
        let first = message(&record, &token(200, 0), "walbox");
        let other_table = message(&record, &token(200, 1), "walbox");
        let later = message(&record, &token(300, 0), "walbox");
        let other_shard = message(&record, &token(200, 0), "walbox_1");
        let again = message(&record, &token(200, 0), "walbox");
        assert_eq!(first.dedup, again.dedup);
        for m in [&other_table, &later, &other_shard] {
            assert_ne!(first.dedup, m.dedup);
        }
        assert!(first.dedup.len() <= 128, "{}", first.dedup);
    }
}
