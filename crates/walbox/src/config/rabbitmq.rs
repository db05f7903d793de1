//! `sink = "rabbitmq"`: the `[rabbitmq]` settings, and what is refused
//! with them ([`super::kafka_only`]).

use sink_amqp::{AmqpConfig, AmqpUrl};

use super::{Config, ConfigError};

/// Most routing partitions.
const MAX_PARTITIONS: u64 = 1024;

impl Config {
    /// `[rabbitmq]`, checked (with `sink = "rabbitmq"`).
    pub(super) fn rabbitmq(
        &self,
        max_in_flight: usize,
        max_in_flight_bytes: usize,
    ) -> Result<AmqpConfig, ConfigError> {
        let r = &self.raw;
        let q = &r.rabbitmq;
        let Some(url) = &q.url else {
            return Err(ConfigError(
                "sink = \"rabbitmq\" needs rabbitmq.url (amqp://user:password@host:5672/vhost; WALBOX_RABBITMQ_URL or WALBOX_RABBITMQ_URL_FILE)".into(),
            ));
        };
        let url =
            AmqpUrl::parse(url.expose()).map_err(|e| ConfigError(format!("rabbitmq.url: {e}")))?;
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
        super::kafka_only::refuse(
            r,
            "rabbitmq",
            "a message may arrive twice after a crash: deduplicate by message_id",
        )?;
        Ok(AmqpConfig {
            url,
            exchange: q.exchange.clone(),
            declare_exchange: q.declare_exchange,
            exchange_type: q.exchange_type.clone(),
            max_in_flight,
            max_in_flight_bytes,
            connection_name: format!("walbox {}", r.slot),
            partitions: q.partitions as u32,
            message_id_header: crate::mapping::ID_HEADER.to_owned(),
        })
    }
}
