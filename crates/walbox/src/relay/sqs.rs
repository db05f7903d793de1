//! `sink = "sqs"`: the relay's [`Destination`] on Amazon SQS (sink-sqs).
//! A record becomes a message on `sqs.queue_url` (a dead-letter copy on
//! `sqs.dead_letter_queue_url`): its value the body, its headers message
//! attributes and its key the `walbox.key` attribute. On a FIFO queue the
//! key is the message group (each aggregate's order) and the event id the
//! deduplication id (the row's WAL position when the row has no id: the
//! same on every re-send). Stored is a delivery; a refusal is for good,
//! which the dead-letter policy handles as a broker's refusal on Kafka; a
//! request SQS refuses for good (the queue, the credentials) stops walbox.

use bytes::Bytes;
use sink_kafka::{Delivered, DeliveryError, DeliveryErrorKind, Record, Report};
use sink_sqs::{Failure, Message, Permit, QueueRole, Reports, SqsSink};

use super::destination::{Deliveries, Destination};
use super::Token;
use crate::mapping::ID_HEADER;

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
}

impl Sqs {
    /// The destination on `sink`.
    pub fn new(sink: SqsSink<SqsSent>) -> Self {
        Sqs { sink }
    }

    /// Stops sending after waiting up to `within` for what is in flight;
    /// how many messages were left unreported.
    pub async fn close(self, within: std::time::Duration) -> usize {
        self.sink.close(within).await
    }
}

/// `record` as an SQS message.
fn message(record: &Record<()>, token: &Token) -> Message {
    let mut attributes: Vec<(String, Bytes)> = record
        .headers
        .iter()
        .map(|h| (h.name.to_string(), h.value.clone()))
        .collect();
    if let Some(key) = &record.key {
        attributes.push((SQS_KEY_ATTRIBUTE.to_owned(), key.clone()));
    }
    let dedup = match record.headers.iter().find(|h| h.name == ID_HEADER) {
        Some(id) if !id.value.is_empty() => String::from_utf8_lossy(&id.value).into_owned(),
        // The row's place in the WAL names it on every re-send.
        _ => format!("{}.{}", token.lsn, token.index),
    };
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
        let message = message(&record, &token);
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
