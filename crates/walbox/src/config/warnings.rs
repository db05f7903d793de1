//! What a configuration allows but should not: said at startup (`walbox
//! run`, and `walbox config`) as warnings, never refused.
//!
//! - Postgres without `sslmode=verify-full` over TCP: the server is not
//!   verified (or not even encrypted to), so a man in the middle can read
//!   the events and the password.
//! - Kafka over plaintext, or TLS that does not verify the broker.
//! - A secret given as a command-line flag: every user of the machine can
//!   read it in the process list, and it stays in shell history.
//! - A schema registry's password sent over http://, or a registry URL
//!   with a format that uses none.

use slot_manager::SslMode;

use super::Config;

impl Config {
    /// The warnings, each one line saying what to change.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = self.ignored.clone();
        let connection = self.connection().ok();
        if let Some(c) = &connection {
            let tcp =
                c.pg.hosts()
                    .iter()
                    .any(|(h, _)| matches!(h, tokio_postgres::config::Host::Tcp(_)));
            let mode = c.pg.ssl_mode();
            if tcp && mode != SslMode::VerifyFull {
                out.push(format!(
                    "the Postgres connection does not verify the server (sslmode={mode}): anyone on the path can read the events{}; use sslmode=verify-full with sslrootcert (docs/configuration.md, \"Postgres\")",
                    if c.pg.password().is_some() { " and the password" } else { "" }
                ));
            }
        }
        let rabbitmq = self.raw.sink == super::raw::RawSink::Rabbitmq;
        let sqs = self.raw.sink == super::raw::RawSink::Sqs;
        let nats = self.raw.sink == super::raw::RawSink::Nats;
        let webhook = self.raw.sink == super::raw::RawSink::Webhook;
        let kafka_set = self.raw.kafka.brokers.is_some() || !self.raw.kafka.properties.is_empty();
        if kafka_set && self.raw.sink != super::raw::RawSink::Kafka {
            let sink = match self.raw.sink {
                super::raw::RawSink::Rabbitmq => "rabbitmq",
                super::raw::RawSink::Sqs => "sqs",
                super::raw::RawSink::Nats => "nats",
                _ => "webhook",
            };
            out.push(format!(
                "sink = \"{sink}\": the kafka.* settings are ignored"
            ));
        }
        if sqs
            && self
                .raw
                .sqs
                .queue_url
                .as_deref()
                .is_some_and(|u| !u.ends_with(".fifo"))
        {
            out.push("sqs.queue_url is a standard queue (not .fifo): events arrive in no particular order and a re-sent event arrives twice; use a FIFO queue for each aggregate's order and deduplication (docs/sqs.md)".into());
        }
        let plain_amqp = self.raw.rabbitmq.url.as_ref().is_some_and(|u| {
            u.expose()
                .get(..7)
                .is_some_and(|s| s.eq_ignore_ascii_case("amqp://"))
        });
        let plain_nats = self.raw.nats.url.as_ref().is_some_and(|u| {
            u.expose()
                .get(..7)
                .is_some_and(|s| s.eq_ignore_ascii_case("nats://"))
        });
        let plain_http = self.raw.webhook.url.as_ref().is_some_and(|u| {
            u.expose()
                .get(..7)
                .is_some_and(|s| s.eq_ignore_ascii_case("http://"))
        });
        if webhook && plain_http {
            out.push("the webhook is reached over http:// (no TLS): events and their signatures travel unencrypted; use https:// (docs/webhooks.md)".into());
        }
        if nats && plain_nats {
            out.push("NATS is reached over nats:// (no TLS): events and the credentials travel unencrypted; use tls:// or keep the server on a trusted network (docs/nats.md)".into());
        }
        if rabbitmq && self.raw.rabbitmq.audit_stream.is_some() {
            out.push("rabbitmq.audit_stream is bound to the exchange for every routing key: a message no queue of yours is bound for reaches the stream and is confirmed, not returned, so it is neither dead-lettered nor held by the quarantine (docs/rabbitmq.md, \"Auditing\")".into());
        }
        if rabbitmq && plain_amqp {
            out.push("RabbitMQ is reached over amqp:// (no TLS): events and the password travel unencrypted; use amqps:// or keep the broker on a trusted network (docs/rabbitmq.md)".into());
        }
        let props = &self.raw.kafka.properties;
        let get = |k: &str| props.get(k).map(|v| v.to_ascii_lowercase());
        let protocol = get("security.protocol").unwrap_or_else(|| "plaintext".into());
        if self.raw.kafka.brokers.is_some() && !rabbitmq && !sqs {
            if protocol.ends_with("plaintext") {
                out.push(format!(
                    "Kafka is reached over plaintext (security.protocol={protocol}): events{} travel unencrypted; use SSL or SASL_SSL (docs/configuration.md, \"Secured clusters\")",
                    if protocol.starts_with("sasl") { " and the SASL credentials" } else { "" }
                ));
            } else if get("enable.ssl.certificate.verification").as_deref() == Some("false") {
                out.push("Kafka's TLS does not verify the brokers (enable.ssl.certificate.verification=false): anyone on the path can pose as the broker; remove it and set ssl.ca.location".into());
            } else if get("ssl.endpoint.identification.algorithm").as_deref() == Some("none") {
                out.push("Kafka's TLS does not check the brokers' host names (ssl.endpoint.identification.algorithm=none); remove it".into());
            }
        }
        let msk_iam = props
            .get("sasl.mechanism")
            .is_some_and(|m| m.eq_ignore_ascii_case(sink_kafka::msk_iam::MECHANISM));
        if self.raw.kafka.aws_region.is_some() && !msk_iam {
            out.push("kafka.aws_region is set, and only sasl.mechanism = \"AWS_MSK_IAM\" uses it: it is ignored".into());
        }
        let registry = &self.raw.schema_registry;
        if let Some(url) = &registry.url {
            use super::raw::RawFormat;
            if !matches!(
                self.raw.format,
                RawFormat::Avro | RawFormat::JsonSchema | RawFormat::Protobuf
            ) {
                out.push("schema_registry.url is set, and only format = \"avro\", \"json-schema\" or \"protobuf\" uses a schema registry: it is ignored".into());
            } else if url.starts_with("http://") && registry.password.is_some() {
                out.push("the schema registry is reached over http:// with basic authentication: the password travels unencrypted; use https://".into());
            }
        }
        if registry.key == super::raw::RawRegistryKey::Schema
            && !matches!(
                self.raw.format,
                super::raw::RawFormat::Avro | super::raw::RawFormat::JsonSchema
            )
        {
            out.push("schema_registry.key = \"schema\" is set, and only format = \"avro\" or \"json-schema\" serializes keys: keys stay text".into());
        }
        for (key, _, source) in self.effective() {
            if source != "command line" {
                continue;
            }
            let secret = if key == "schema_registry.password" {
                true
            } else if key == "pg_url" {
                connection
                    .as_ref()
                    .is_some_and(|c| c.pg.password().is_some())
            } else {
                key.strip_prefix("kafka.properties.")
                    .is_some_and(sink_kafka::is_secret_property)
            };
            if secret {
                out.push(format!(
                    "{key} holds a secret and was given on the command line, where every user of this machine can read it (ps) and shell history keeps it; give it as {}_FILE instead",
                    variable(&key)
                ));
            }
        }
        out
    }
}

/// The environment variable of a setting or Kafka property key.
fn variable(key: &str) -> String {
    match key.strip_prefix("kafka.properties.") {
        Some(p) => format!(
            "WALBOX_KAFKA_PROPERTY_{}",
            p.replace('.', "_").to_ascii_uppercase()
        ),
        None => format!("WALBOX_{}", key.replace('.', "_").to_ascii_uppercase()),
    }
}
