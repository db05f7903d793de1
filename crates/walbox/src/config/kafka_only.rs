//! What lives in Kafka only, refused with another broker (`sink =
//! "rabbitmq"` or `"sqs"`), each with its reason.

use super::raw::{Raw, RawFormat};
use super::{ConfigError, Delivery};

/// The first setting `r` turns on that `sink` cannot honour.
pub(super) fn refuse(r: &Raw, sink: &str, exactly_once_instead: &str) -> Result<(), ConfigError> {
    let refusals = [
        (
            r.delivery == Delivery::ExactlyOnce,
            format!("delivery = \"exactly-once\" is Kafka's (its transactions); with sink = \"{sink}\" delivery is at least once ({exactly_once_instead})"),
        ),
        (
            matches!(r.format, RawFormat::Avro | RawFormat::JsonSchema | RawFormat::Protobuf),
            format!("the schema-registry formats are not supported with sink = \"{sink}\" yet"),
        ),
        (
            r.claim_check.bucket.is_some(),
            format!("claim_check is not supported with sink = \"{sink}\" yet"),
        ),
        (
            r.receipts,
            format!("receipts = true is not supported with sink = \"{sink}\" yet (a receipt names a Kafka partition and offset)"),
        ),
        (
            r.audit.interval.is_some(),
            format!("audit.interval (the continuous audit reads Kafka) is not supported with sink = \"{sink}\""),
        ),
        (
            r.topics.create,
            format!("topics.create makes Kafka topics; with sink = \"{sink}\" {}", match sink {
                "sqs" => "create the queues yourself (docs/sqs.md)",
                _ => "bind queues to the exchange instead (docs/rabbitmq.md)",
            }),
        ),
    ];
    match refusals.into_iter().find(|(on, _)| *on) {
        Some((_, why)) => Err(ConfigError(why)),
        None => Ok(()),
    }
}
