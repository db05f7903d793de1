//! What a broker other than Kafka cannot honour, each refusal with the
//! broker's own limit as its reason. Everything not listed here works with every
//! broker.

use super::raw::{Raw, RawFormat, RawSink};
use super::{ConfigError, Delivery};

/// The first setting `r` turns on that its sink cannot honour.
pub(super) fn refuse(r: &Raw) -> Result<(), ConfigError> {
    let (sink, exactly_once_instead) = match r.sink {
        RawSink::Kafka => return Ok(()),
        RawSink::Rabbitmq => (
            "rabbitmq",
            "a message may arrive twice after a crash: deduplicate by message_id",
        ),
        RawSink::Nats => (
            "nats",
            "a re-sent message within the stream's duplicate window is dropped by its Nats-Msg-Id, the event's place in the stream; after it, it arrives twice: deduplicate by the id header",
        ),
        RawSink::Webhook => (
            "webhook",
            "a re-sent event carries the same Idempotency-Key header: the endpoint deduplicates by it",
        ),
        RawSink::Sqs => (
            "sqs",
            "on a FIFO queue SQS drops a re-sent message within five minutes by its deduplication id, the event's place in the stream; a re-send after that, or on a standard queue, arrives twice: deduplicate by the id attribute",
        ),
    };
    let sqs = r.sink == RawSink::Sqs;
    let refusals = [
        (
            r.delivery == Delivery::ExactlyOnce,
            format!("delivery = \"exactly-once\" is Kafka's (its transactions); with sink = \"{sink}\" delivery is at least once ({exactly_once_instead})"),
        ),
        (
            sqs && matches!(r.format, RawFormat::Avro | RawFormat::JsonSchema | RawFormat::Protobuf),
            "the schema-registry formats cannot go to SQS: a message body is text (UTF-8 without control characters), and Confluent's wire format is binary (a zero byte, the schema id, then the serialized value); use as-stored, cloudevents-* or debezium".into(),
        ),
        (
            r.audit.interval.is_some() && r.sink != RawSink::Nats,
            format!(
                "audit.interval cannot be used with sink = \"{sink}\": {}",
                match r.sink {
                    RawSink::Sqs => unreadable::SQS,
                    RawSink::Webhook => unreadable::WEBHOOK,
                    _ => unreadable::CONFIRM_HAS_NO_OFFSET,
                }
            ),
        ),
        (
            r.topics.create,
            format!("topics.create makes Kafka topics; with sink = \"{sink}\" {}", match r.sink {
                RawSink::Sqs => "create the queues yourself (docs/sqs.md)",
                RawSink::Nats => "create a stream whose subjects take the topics (docs/nats.md)",
                RawSink::Webhook => "the topic is the Walbox-Topic header of the POST (docs/webhooks.md)",
                _ => "bind queues to the exchange instead (docs/rabbitmq.md)",
            }),
        ),
    ];
    match refusals.into_iter().find(|(on, _)| *on) {
        Some((_, why)) => Err(ConfigError(why)),
        None => Ok(()),
    }
}

/// Why a broker cannot be read back (`walbox audit`, `audit.interval`).
pub mod unreadable {
    /// Why RabbitMQ without an audit stream cannot be read back.
    pub const NO_AUDIT_STREAM: &str = "RabbitMQ's queues are consumed by reading them: set rabbitmq.audit_stream, a stream queue walbox binds to the exchange and reads without consuming (it holds what was published since it was declared)";
    /// Why SQS cannot be read back.
    pub const SQS: &str = "a queue cannot be read without taking its messages from the consumers (a receive hides them for the visibility timeout)";
    /// Why webhooks cannot be read back.
    pub const WEBHOOK: &str = "what an endpoint did with a request cannot be read back";
    /// Why the continuous audit does not sample RabbitMQ.
    pub const CONFIRM_HAS_NO_OFFSET: &str = "a RabbitMQ publisher confirm does not say where in the audit stream the message landed, so one acknowledged event cannot be found and read back with its neighbours; run walbox audit (with rabbitmq.audit_stream) instead";
}
