//! `sink = "rabbitmq"`: the `[rabbitmq]` settings, and what is refused
//! with them ([`super::broker_limits`]).

use sink_amqp::{AmqpConfig, AmqpUrl, AuditStream, TlsFiles};

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
        let audit_stream = match &q.audit_stream {
            None => None,
            Some(name) => Some(audit_stream(
                name,
                &q.audit_stream_max_age,
                &q.exchange_type,
            )?),
        };
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
            audit_stream,
        })
    }
}

/// `rabbitmq.audit_stream` and its `audit_stream_max_age`, checked.
fn audit_stream(
    name: &str,
    max_age: &str,
    exchange_type: &str,
) -> Result<AuditStream, ConfigError> {
    if name.is_empty() || name.len() > 255 || name.starts_with("amq.") {
        return Err(ConfigError(
            "rabbitmq.audit_stream: a queue name of 1 to 255 bytes, not starting with amq. (the broker's own)".into(),
        ));
    }
    if !matches!(exchange_type, "topic" | "fanout") {
        return Err(ConfigError(format!(
            "rabbitmq.audit_stream needs a topic or fanout exchange: it is bound for every routing key (#), which a {exchange_type} exchange does not route"
        )));
    }
    // RabbitMQ's x-max-age: a whole number and one unit.
    let last = max_age.char_indices().last().map_or(0, |(i, _)| i);
    let (digits, unit) = max_age.split_at(last);
    if !matches!(unit, "Y" | "M" | "D" | "h" | "m" | "s")
        || digits.is_empty()
        || !digits.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(ConfigError(format!(
            "rabbitmq.audit_stream_max_age: {max_age:?} is not a number and one of Y, M, D, h, m, s (RabbitMQ's x-max-age, e.g. 7D or 12h)"
        )));
    }
    Ok(AuditStream {
        name: name.to_owned(),
        max_age: max_age.to_owned(),
    })
}
