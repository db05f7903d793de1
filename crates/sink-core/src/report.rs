//! A record's fate: where it landed, or why it did not.

use std::sync::Arc;

use crate::Record;

/// Where a delivered record landed, in the broker's own terms.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivered {
    /// A Kafka partition and offset.
    Kafka {
        /// Partition.
        partition: i32,
        /// Offset.
        offset: i64,
    },
    /// A RabbitMQ exchange and routing key, confirmed by the broker.
    Amqp {
        /// The exchange.
        exchange: Arc<str>,
        /// The routing key.
        routing_key: String,
    },
    /// A message a NATS JetStream stream stored.
    Nats {
        /// The stream.
        stream: String,
        /// Its sequence number in the stream.
        sequence: u64,
        /// The stream had it already (the same `Nats-Msg-Id` within its
        /// duplicate window): this copy was dropped.
        duplicate: bool,
    },
    /// An HTTP endpoint that answered 2xx.
    Http {
        /// The status it answered with.
        status: u16,
    },
    /// An SQS message.
    Sqs {
        /// The message id SQS gave it.
        message_id: String,
        /// Its sequence number in its group (FIFO queues).
        sequence_number: Option<String>,
    },
}

impl Delivered {
    /// The Kafka partition and offset, when it landed on Kafka.
    pub fn kafka(&self) -> Option<(i32, i64)> {
        match self {
            Delivered::Kafka { partition, offset } => Some((*partition, *offset)),
            _ => None,
        }
    }
}

/// How a delivery failed, which decides what the caller does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeliveryErrorKind {
    /// The client gave up retrying (Kafka, only with a finite
    /// `message.timeout.ms`). Safe to resend after a restart.
    RetriableExhausted,
    /// The broker will never take this record as it is (authorization,
    /// size, unknown topic, a nack, an unroutable message): dead-letter it,
    /// hold it, or stop.
    Permanent,
    /// The client is unusable, or the broker refused the whole request for
    /// good (credentials, the queue): stop.
    Fatal,
    /// A newer producer with the same transactional id took over: stop,
    /// the other one carries on.
    Fenced,
    /// Given up at shutdown before the broker answered: not delivered, not
    /// failed.
    Purged,
    /// Not sent: an earlier record failed for good and the sink is gapless,
    /// so nothing may be written after it. Sent again after a restart,
    /// behind the failed one.
    Withheld,
}

impl DeliveryErrorKind {
    /// Its name in metrics and dead-letter headers.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryErrorKind::RetriableExhausted => "retriable_exhausted",
            DeliveryErrorKind::Permanent => "permanent",
            DeliveryErrorKind::Fatal => "fatal",
            DeliveryErrorKind::Fenced => "fenced",
            DeliveryErrorKind::Purged => "purged",
            DeliveryErrorKind::Withheld => "withheld",
        }
    }
}

/// A record's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{kind:?} delivery failure: {message}")]
pub struct DeliveryError {
    /// What to do about it.
    pub kind: DeliveryErrorKind,
    /// What happened, without secrets.
    pub message: String,
}

impl DeliveryError {
    /// A failure of `kind`.
    pub fn new(kind: DeliveryErrorKind, message: impl Into<String>) -> Self {
        DeliveryError {
            kind,
            message: message.into(),
        }
    }
}

/// A record's fate, once per record sent.
#[derive(Debug)]
pub struct Report<T> {
    /// The record's token.
    pub token: T,
    /// Where it landed, or why it did not.
    pub result: Result<Delivered, DeliveryError>,
    /// The record itself when the broker refused it for good
    /// ([`DeliveryErrorKind::Permanent`]), for a dead-letter copy or the
    /// quarantine.
    pub returned: Option<Record<()>>,
    /// How long the broker's client held the record, from the send until it
    /// reported, by the client's own clock, in µs (Kafka: librdkafka's
    /// latency from `produce()` to the delivery report: its queue, the
    /// linger, the broker's round trip). `None` when the client does not
    /// say. With walbox's own time of the send and of this report's
    /// arrival, it tells walbox's part of the latency from the broker's.
    pub client_micros: Option<u64>,
}

impl<T> Report<T> {
    /// `token`'s record landed `at`.
    pub fn delivered(token: T, at: Delivered) -> Self {
        Report {
            token,
            result: Ok(at),
            returned: None,
            client_micros: None,
        }
    }

    /// `token`'s record failed with `kind`; a refusal for good
    /// ([`DeliveryErrorKind::Permanent`]) hands the record back.
    pub fn failed(
        token: T,
        kind: DeliveryErrorKind,
        message: impl Into<String>,
        record: Record<()>,
    ) -> Self {
        Report {
            token,
            result: Err(DeliveryError::new(kind, message)),
            returned: (kind == DeliveryErrorKind::Permanent).then_some(record),
            client_micros: None,
        }
    }
}
