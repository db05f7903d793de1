//! `sink = "rabbitmq"`: the `[rabbitmq]` settings, and what is refused
//! with them (the features that live in Kafka, or are not proven on
//! RabbitMQ yet).

use sink_amqp::{AmqpConfig, AmqpUrl};

use super::raw::{RawFormat, RawSink};
use super::{Config, ConfigError, Delivery, OnFailure};

/// Most routing partitions.
const MAX_PARTITIONS: u64 = 1024;

/// What `walbox run` needs to publish to RabbitMQ.
#[derive(Clone, Debug)]
pub struct RabbitSettings {
    /// The connection, exchange and in-flight bounds.
    pub amqp: AmqpConfig,
    /// Routing partitions: above 1, routing keys are `<topic>.<n>`.
    pub partitions: u32,
}

impl Config {
    /// `[rabbitmq]`, checked; `None` with `sink = "kafka"`.
    pub(super) fn rabbitmq(
        &self,
        max_in_flight: usize,
        max_in_flight_bytes: usize,
    ) -> Result<Option<RabbitSettings>, ConfigError> {
        let r = &self.raw;
        if r.sink != RawSink::Rabbitmq {
            return Ok(None);
        }
        let q = &r.rabbitmq;
        let Some(url) = &q.url else {
            return Err(ConfigError(
                "sink = \"rabbitmq\" needs rabbitmq.url (amqp://user:password@host:5672/vhost; WALBOX_RABBITMQ_URL or WALBOX_RABBITMQ_URL_FILE)".into(),
            ));
        };
        let url =
            AmqpUrl::parse(url.expose()).map_err(|e| ConfigError(format!("rabbitmq.url {e}")))?;
        if q.exchange.is_empty() || q.exchange.len() > 255 {
            return Err(ConfigError(
                "rabbitmq.exchange: a name of 1 to 255 bytes (the default exchange \"\" routes by queue name, which walbox does not use)".into(),
            ));
        }
        if !(1..=MAX_PARTITIONS).contains(&q.partitions) {
            return Err(ConfigError(format!(
                "rabbitmq.partitions: from 1 to {MAX_PARTITIONS}"
            )));
        }
        let unsupported = [
            (
                r.delivery == Delivery::ExactlyOnce,
                "delivery = \"exactly-once\" is Kafka's (its transactions); with sink = \"rabbitmq\" delivery is at least once (a message may arrive twice after a crash: deduplicate by message_id)",
            ),
            (
                r.on_failure == Some(OnFailure::Quarantine),
                "on_failure = \"quarantine\" is not supported with sink = \"rabbitmq\" yet: use stop or dead-letter",
            ),
            (
                matches!(r.format, RawFormat::Avro | RawFormat::JsonSchema | RawFormat::Protobuf),
                "the schema-registry formats are not supported with sink = \"rabbitmq\" yet",
            ),
            (
                r.claim_check.bucket.is_some(),
                "claim_check is not supported with sink = \"rabbitmq\" yet",
            ),
            (
                r.receipts,
                "receipts = true is not supported with sink = \"rabbitmq\" yet (a receipt names a Kafka partition and offset)",
            ),
            (
                r.audit.interval.is_some(),
                "audit.interval (the continuous audit reads Kafka) is not supported with sink = \"rabbitmq\"",
            ),
            (
                r.topics.create,
                "topics.create makes Kafka topics; with sink = \"rabbitmq\" bind queues to the exchange instead (docs/rabbitmq.md)",
            ),
        ];
        if let Some((_, why)) = unsupported.iter().find(|(on, _)| *on) {
            return Err(ConfigError((*why).to_owned()));
        }
        Ok(Some(RabbitSettings {
            amqp: AmqpConfig {
                url,
                exchange: q.exchange.clone(),
                declare_exchange: q.declare_exchange,
                exchange_type: q.exchange_type.clone(),
                max_in_flight,
                max_in_flight_bytes,
                connection_name: format!("walbox {}", r.slot),
            },
            partitions: q.partitions as u32,
        }))
    }
}
