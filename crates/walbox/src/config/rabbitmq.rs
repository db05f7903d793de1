//! `sink = "rabbitmq"`: the `[rabbitmq]` settings, and what is refused
//! with them ([`super::broker_limits`]).

use sink_amqp::{AmqpConfig, AmqpUrl, TlsFiles};

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
        let mut url =
            AmqpUrl::parse(url.expose()).map_err(|e| ConfigError(format!("rabbitmq.url: {e}")))?;
        if let Some(password) = &q.password {
            if !url.password.is_empty() && url.password != "guest" {
                return Err(ConfigError(
                    "rabbitmq.password is set and rabbitmq.url has a password too: keep one".into(),
                ));
            }
            url.password = password.expose().to_owned();
        }
        let tls = TlsFiles {
            ca_file: q.ca_file.as_ref().map(Into::into),
            cert_file: q.cert_file.as_ref().map(Into::into),
            key_file: q.key_file.as_ref().map(Into::into),
            server_name: q.server_name.clone(),
        };
        if url.tls {
            // The files are read now, so that `config` and `run` refuse
            // the same ones, then again at each connection.
            tls.server_name(&url.host)
                .map_err(|e| ConfigError(e.to_string()))?;
            tls.client_config()
                .map_err(|e| ConfigError(e.to_string()))?;
        } else if tls != TlsFiles::default() {
            return Err(ConfigError(
                "rabbitmq.ca_file, cert_file, key_file and server_name are for TLS: write the URL as amqps://".into(),
            ));
        }
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
        super::broker_limits::refuse(r)?;
        Ok(AmqpConfig {
            url,
            tls,
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
