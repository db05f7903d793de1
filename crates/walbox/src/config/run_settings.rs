//! What `walbox run` needs beyond the connection and the mapping: the
//! producer, the dead-letter policy, exactly-once, retention, timers.

use std::net::SocketAddr;
use std::time::Duration;

use sink_kafka::{SinkConfig, TopicSpec};

use super::connection::shard_name;

use super::{
    Config, ConfigError, Connection, Delivery, EventSource, OnDrift, OnFailure, OnSlotInvalidated,
};
use crate::dead_letter::DeadLetters;
use crate::exactly_once::{Bounds, ExactlyOnce};
use crate::mapping::OutboxMapping;

/// What `walbox run` needs beyond the connection and mapping.
#[derive(Clone, Debug)]
pub struct RunSettings {
    /// The broker events go to, and its client's settings.
    pub sink: SinkSettings,
    /// What happens to undeliverable events.
    pub dead_letters: DeadLetters,
    /// Hold them instead, at most this many (`on_failure = "quarantine"`);
    /// `None`: off.
    pub quarantine: Option<u64>,
    /// Status update interval.
    pub status_interval: Duration,
    /// Shutdown drain bound.
    pub shutdown_timeout: Duration,
    /// Where to serve metrics and health endpoints.
    pub metrics_addr: Option<SocketAddr>,
    /// Exactly-once mode; `None`: at least once.
    pub exactly_once: Option<ExactlyOnce>,
    /// Recreating an invalidated slot: `None` to stop instead; else how far
    /// before the last delivered commit the republishing starts.
    pub recreate_margin: Option<Duration>,
    /// Healing publication drift (`on_drift = "heal"`): `None` to stop
    /// instead; else how far before the last delivered commit the
    /// republishing starts.
    pub drift_heal_margin: Option<Duration>,
    /// How far before the last delivered commit rows stay (retention and
    /// recreating alike).
    pub margin: Duration,
    /// Delete outbox rows older than this; `None`: keep them.
    pub retention: Option<Duration>,
    /// The prefix of the logical decoding messages that are events.
    pub message_prefix: String,
    /// Where to export a span per event; `None`: off.
    pub otlp_endpoint: Option<super::secret::Endpoint>,
    /// The continuous audit's interval (`audit.interval`); `None`: off.
    pub audit_interval: Option<Duration>,
    /// The budget `walbox.require_capacity()` holds the relay to
    /// (`backlog.*`).
    pub backlog: crate::backlog::Budget,
    /// Write delivery receipts (`receipts`).
    pub receipts: bool,
    /// At a start, skip what the broker holds of the replay
    /// (`skip_delivered`): the look-back per partition; `None`: off.
    pub skip_delivered: Option<u64>,
    /// Where oversized values go (`claim_check.*`); `None`: off.
    pub claim_check: Option<crate::claim_check::ClaimCheckConfig>,
    /// Where format = avro finds its schemas (`schema_registry.*`);
    /// `None` with any other format.
    pub schema_registry: Option<crate::schema_registry::RegistryConfig>,
}

/// The one choice of broker (`sink`), with its client's settings. Every
/// path that publishes (the stream, backfills, heals, resyncs, a recreated
/// slot, quarantine releases, dead letters) goes to it.
#[derive(Clone, Debug)]
pub enum SinkSettings {
    /// `sink = "kafka"`.
    Kafka(SinkConfig),
    /// `sink = "rabbitmq"`.
    RabbitMq(sink_amqp::AmqpConfig),
    /// `sink = "sqs"`.
    Sqs(sink_sqs::SqsConfig),
    /// `sink = "nats"`.
    Nats(sink_nats::NatsConfig),
    /// `sink = "webhook"`.
    Webhook(sink_webhook::WebhookConfig),
}

impl SinkSettings {
    /// The broker, as `sink` names it.
    pub fn name(&self) -> &'static str {
        match self {
            SinkSettings::Kafka(_) => "kafka",
            SinkSettings::RabbitMq(_) => "rabbitmq",
            SinkSettings::Sqs(_) => "sqs",
            SinkSettings::Nats(_) => "nats",
            SinkSettings::Webhook(_) => "webhook",
        }
    }

    /// Kafka's settings, when events go to Kafka.
    pub fn kafka(&self) -> Option<&SinkConfig> {
        match self {
            SinkSettings::Kafka(k) => Some(k),
            _ => None,
        }
    }

    /// The same broker without transactions: republished rows (a backfill,
    /// a heal, a resync) are written outside any Kafka transaction.
    pub fn without_transactions(&self) -> SinkSettings {
        match self {
            SinkSettings::Kafka(k) => {
                let mut k = k.clone();
                k.transactional_id = None;
                SinkSettings::Kafka(k)
            }
            other => other.clone(),
        }
    }
}

/// Everything `walbox run` needs, checked together: `walbox config` makes
/// the same checks, so the two never disagree.
#[derive(Clone, Debug)]
pub struct RunPlan {
    /// Where Postgres is and what to stream (this process's shard).
    pub connection: Connection,
    /// Which columns hold what.
    pub mapping: OutboxMapping,
    /// The producer, policies and timers.
    pub settings: RunSettings,
}

/// `transactions.progress_topic` when none is set.
pub(super) const DEFAULT_PROGRESS_TOPIC: &str = "walbox.progress";

impl Config {
    /// What `walbox run` needs: the connection (naming its shard when the
    /// outbox is sharded), the mapping and the run settings, with the checks
    /// that need more than one of them.
    pub fn for_run(&self) -> Result<RunPlan, ConfigError> {
        let connection = self.connection()?;
        if connection.shards > 1 && connection.shard.is_none() {
            return Err(ConfigError(format!(
                "shards = {}: say which shard this process streams (--shard 0 to {}, WALBOX_SHARD or shard in the file); each shard runs as its own process",
                connection.shards,
                connection.shards - 1
            )));
        }
        let mapping = self.mapping()?;
        let settings = self.run()?;
        if connection.tables.single().is_none() {
            let one_table = [
                (settings.retention.is_some(), "retention"),
                (settings.drift_heal_margin.is_some(), "on_drift = \"heal\""),
                (
                    settings.recreate_margin.is_some(),
                    "on_slot_invalidated = \"recreate\"",
                ),
            ];
            if let Some((_, what)) = one_table.iter().find(|(on, _)| *on) {
                return Err(ConfigError(format!(
                    "{what} works on one outbox table, and table = {} names several: remove it (docs/configuration.md, \"Several outbox tables\")",
                    connection.tables
                )));
            }
        }
        if settings.retention.is_some() && mapping.timestamp.is_none() {
            return Err(ConfigError(
                "retention needs the timestamp column (mapping.timestamp) to tell old rows".into(),
            ));
        }
        // Refused now rather than when a slot is lost, when it would fail.
        if settings.recreate_margin.is_some() && mapping.timestamp.is_none() {
            return Err(ConfigError(
                "on_slot_invalidated = \"recreate\" republishes the rows written since the slot was lost, by the timestamp column (mapping.timestamp), and the mapping has none: set it (a Debezium outbox table has none: add one, Quarkus's extension calls it timestamp), or use fail".into(),
            ));
        }
        Ok(RunPlan {
            connection,
            mapping,
            settings,
        })
    }
}

impl Config {
    /// What `walbox run` needs, checked.
    pub fn run(&self) -> Result<RunSettings, ConfigError> {
        let r = &self.raw;
        let kafka = r.sink == super::raw::RawSink::Kafka;
        let brokers = match (&r.kafka.brokers, kafka) {
            (Some(b), _) => b.clone(),
            // Unused: events go to RabbitMQ or SQS.
            (None, false) => String::new(),
            (None, true) => {
                return Err(ConfigError(
                    "kafka.brokers is required (--kafka-brokers, WALBOX_KAFKA_BROKERS or [kafka] brokers in the file)"
                        .into(),
                ))
            }
        };
        let mut sink = SinkConfig::new(brokers);
        super::files::check_kafka(&r.kafka.properties)?;
        sink.properties = r.kafka.properties.clone();
        sink.aws_region = r.kafka.aws_region.clone();
        if r.max_in_flight_events == 0 {
            return Err(ConfigError(
                "max_in_flight_events: must be at least 1".into(),
            ));
        }
        if r.max_in_flight_bytes < 1024 {
            return Err(ConfigError(
                "max_in_flight_bytes: must be at least 1024".into(),
            ));
        }
        sink.max_in_flight = usize::try_from(r.max_in_flight_events)
            .map_err(|_| ConfigError("max_in_flight_events: too large".into()))?;
        sink.max_in_flight_bytes = usize::try_from(r.max_in_flight_bytes)
            .map_err(|_| ConfigError("max_in_flight_bytes: too large".into()))?;
        if r.status_interval_ms == 0 {
            return Err(ConfigError("status_interval_ms: must be above 0".into()));
        }
        let metrics_addr = match &r.metrics_addr {
            None => None,
            Some(a) => Some(a.parse().map_err(|_| {
                ConfigError(format!(
                    "metrics_addr {a:?}: expected HOST:PORT with an IP address, e.g. 0.0.0.0:9756"
                ))
            })?),
        };
        let dead_letter_topic = self.dead_letter_topic();
        let dead_letters = match &dead_letter_topic {
            Some(t) if t.is_empty() => {
                return Err(ConfigError("dead_letter_topic: must not be empty".into()))
            }
            Some(t) => DeadLetters::to_topic(t.clone()),
            None => DeadLetters::halt(),
        };
        sink.create_topics = self.topic_spec()?;
        let on_failure = match (r.on_failure, &dead_letter_topic) {
            (None, Some(_)) => OnFailure::DeadLetter,
            (None, None) => OnFailure::Stop,
            (Some(OnFailure::DeadLetter), None) => {
                return Err(ConfigError(
                    match r.sink {
                        super::raw::RawSink::Sqs => {
                            "on_failure = \"dead-letter\" needs sqs.dead_letter_queue_url"
                        }
                        _ => "on_failure = \"dead-letter\" needs dead_letter_topic",
                    }
                    .into(),
                ))
            }
            (Some(p @ (OnFailure::Stop | OnFailure::Quarantine)), Some(_)) => {
                let word = if p == OnFailure::Stop {
                    "stop"
                } else {
                    "quarantine"
                };
                let dead_letters = match r.sink {
                    super::raw::RawSink::Sqs => "sqs.dead_letter_queue_url",
                    _ => "dead_letter_topic",
                };
                return Err(ConfigError(format!(
                    "on_failure = \"{word}\" and {dead_letters} contradict each other: remove one"
                )));
            }
            (Some(p), _) => p,
        };
        // When an event that fails for good stops walbox, nothing after it
        // may be written ahead of it.
        sink.gapless = on_failure == OnFailure::Stop;
        let exactly_once = self.exactly_once()?;
        if on_failure == OnFailure::Quarantine {
            if exactly_once.is_some() {
                return Err(ConfigError(
                    "on_failure = \"quarantine\" is not supported with delivery = \"exactly-once\" yet: use stop or dead-letter".into(),
                ));
            }
            if r.quarantine.max_events == 0 {
                return Err(ConfigError(
                    "quarantine.max_events: must be at least 1".into(),
                ));
            }
        }
        sink.transactional_id = exactly_once.as_ref().map(|e| e.transactional_id.clone());
        if r.message_prefix.is_empty() {
            return Err(ConfigError("message_prefix: must not be empty".into()));
        }
        if r.source != EventSource::Table && r.on_slot_invalidated == OnSlotInvalidated::Recreate {
            return Err(ConfigError(
                "on_slot_invalidated = \"recreate\" republishes rows of the outbox table; events written as messages (source = messages or both) are in no table and would be lost: use fail".into(),
            ));
        }
        if r.shards > 1 && r.on_slot_invalidated == OnSlotInvalidated::Recreate {
            return Err(ConfigError(
                "on_slot_invalidated = \"recreate\" is not supported with shards > 1: the heal republishes every row of the table, not the shard's own, so each shard would send every other shard's events again: use fail (docs/operations.md, \"Sharded streaming\")".into(),
            ));
        }
        if r.on_drift == OnDrift::Heal {
            if r.source != EventSource::Table {
                return Err(ConfigError(
                    "on_drift = \"heal\" republishes rows of the outbox table; events written as messages (source = messages or both) are in no table: use stop".into(),
                ));
            }
            if r.shards > 1 {
                return Err(ConfigError(
                    "on_drift = \"heal\" is not supported with shards > 1: the heal republishes every row of the table, not the shard's own: use stop".into(),
                ));
            }
            if self.mapping()?.timestamp.is_none() {
                return Err(ConfigError(
                    "on_drift = \"heal\" republishes by time and needs the timestamp column (mapping.timestamp): set it, or use stop".into(),
                ));
            }
        }
        if r.source == EventSource::Messages && r.retention.is_some() {
            return Err(ConfigError(
                "retention deletes rows of the outbox table; with source = messages there is none: remove it".into(),
            ));
        }
        let otlp_endpoint = match &r.otlp_endpoint {
            None => None,
            Some(e) if e.starts_with("http://") => match url::Url::parse(e) {
                Ok(u) if u.host().is_some() => Some(super::secret::Endpoint(e.clone())),
                Ok(_) => {
                    return Err(ConfigError(format!(
                        "otlp_endpoint {:?}: no host (http://127.0.0.1:4318)",
                        super::redact_userinfo(e)
                    )))
                }
                // The parser's reason never quotes the URL.
                Err(why) => {
                    return Err(ConfigError(format!(
                        "otlp_endpoint: not a URL ({why}); expected one such as http://127.0.0.1:4318"
                    )))
                }
            },
            Some(e) if e.starts_with("https://") => {
                return Err(ConfigError(format!(
                    "otlp_endpoint {:?}: this build exports over plain HTTP only; point it at a local collector agent or sidecar (http://…:4318)",
                    super::redact_userinfo(e)
                )))
            }
            Some(e) => {
                return Err(ConfigError(format!(
                    "otlp_endpoint {:?}: expected an OTLP/HTTP URL such as http://127.0.0.1:4318",
                    super::redact_userinfo(e)
                )))
            }
        };
        // What librdkafka itself would refuse (an unknown property, a bad
        // value), found now without connecting: `walbox config` and `run`
        // refuse the same configuration, both as configuration errors.
        sink.validate().map_err(|e| ConfigError(e.to_string()))?;
        if r.receipts && exactly_once.is_some() {
            return Err(ConfigError(
                "receipts = true is not supported with delivery = \"exactly-once\": an acknowledged record may still be aborted with its Kafka transaction, so its receipt could point at a record consumers never see".into(),
            ));
        }
        if r.receipts && r.shards > 1 {
            return Err(ConfigError(
                "receipts = true is not supported with shards > 1: walbox.await_delivery wakes on one writer's receipts, and each shard would be one".into(),
            ));
        }
        let audit_interval = duration_setting("audit.interval", &r.audit.interval, "1m or 30s")?;
        let claim_check = self.claim_check()?;
        let schema_registry = self.schema_registry()?;
        if on_failure == OnFailure::Quarantine && schema_registry.as_ref().is_some_and(|s| s.keys) {
            return Err(ConfigError(
                "schema_registry.key = \"schema\" is not supported with on_failure = \"quarantine\" yet: the quarantine holds aggregates by their key as text; use stop or dead-letter".into(),
            ));
        }
        let sink = match r.sink {
            super::raw::RawSink::Kafka => SinkSettings::Kafka(sink),
            super::raw::RawSink::Rabbitmq => {
                SinkSettings::RabbitMq(self.rabbitmq(sink.max_in_flight, sink.max_in_flight_bytes)?)
            }
            super::raw::RawSink::Webhook => {
                SinkSettings::Webhook(self.webhook(sink.max_in_flight, sink.max_in_flight_bytes)?)
            }
            super::raw::RawSink::Nats => {
                SinkSettings::Nats(self.nats(sink.max_in_flight, sink.max_in_flight_bytes)?)
            }
            super::raw::RawSink::Sqs => SinkSettings::Sqs(self.sqs(
                sink.max_in_flight,
                sink.max_in_flight_bytes,
                sink.gapless,
            )?),
        };
        let skip_delivered = skip_delivered(
            &sink,
            r.skip_delivered,
            r.skip_delivered_look_back,
            exactly_once.is_some(),
        )?;
        Ok(RunSettings {
            skip_delivered,
            schema_registry,
            claim_check,
            otlp_endpoint,
            audit_interval,
            backlog: crate::backlog::Budget {
                max_bytes: match r.backlog.max_bytes {
                    Some(0) => {
                        return Err(ConfigError(
                            "backlog.max_bytes: must be above 0 (leave it out for no budget)"
                                .into(),
                        ))
                    }
                    other => other,
                },
                max_age: duration_setting("backlog.max_age", &r.backlog.max_age, "5m or 30s")?,
            },
            receipts: r.receipts,
            message_prefix: r.message_prefix.clone(),
            sink,
            dead_letters,
            quarantine: (on_failure == OnFailure::Quarantine).then_some(r.quarantine.max_events),
            status_interval: Duration::from_millis(r.status_interval_ms),
            shutdown_timeout: Duration::from_secs(r.shutdown_timeout_secs),
            metrics_addr,
            exactly_once,
            recreate_margin: (r.on_slot_invalidated == OnSlotInvalidated::Recreate)
                .then(|| Duration::from_secs(r.slot_recreate_margin_secs)),
            drift_heal_margin: (r.on_drift == OnDrift::Heal)
                .then(|| Duration::from_secs(r.slot_recreate_margin_secs)),
            margin: Duration::from_secs(r.slot_recreate_margin_secs),
            retention: duration_setting("retention", &r.retention, "7d, 12h or 30m")?,
        })
    }

    /// `schema_registry.*`, checked: required by format = avro, refused
    /// with any other format.
    fn schema_registry(
        &self,
    ) -> Result<Option<crate::schema_registry::RegistryConfig>, ConfigError> {
        use super::raw::{RawFormat, RawSubjectStrategy};
        use crate::schema_registry::{RegistryConfig, SchemaKind, SubjectStrategy};
        let s = &self.raw.schema_registry;
        let kind = match self.raw.format {
            RawFormat::Avro => SchemaKind::Avro,
            RawFormat::JsonSchema => SchemaKind::JsonSchema,
            RawFormat::Protobuf => SchemaKind::Protobuf,
            // Unused: a warning (config/warnings.rs).
            _ => return Ok(None),
        };
        let Some(url) = &s.url else {
            return Err(ConfigError(format!(
                "format = \"{}\" needs schema_registry.url, the registry's Confluent-compatible API (e.g. http://registry:8081 or Apicurio's http://apicurio:8080/apis/ccompat/v7)",
                kind.format()
            )));
        };
        let after_scheme = match url.split_once("://") {
            Some(("http" | "https", rest)) if !rest.is_empty() => rest,
            _ => {
                return Err(ConfigError(format!(
                    "schema_registry.url {:?}: expected an http:// or https:// URL, e.g. http://registry:8081",
                    super::redact_userinfo(url)
                )))
            }
        };
        if after_scheme
            .split('/')
            .next()
            .is_some_and(|host| host.contains('@'))
        {
            return Err(ConfigError(format!(
                "schema_registry.url {:?}: put the credentials in schema_registry.username and schema_registry.password, not in the URL",
                super::redact_userinfo(url)
            )));
        }
        if s.password.is_some() && s.username.is_none() {
            return Err(ConfigError(
                "schema_registry.password is set without schema_registry.username".into(),
            ));
        }
        let strategy = match s.subject_strategy {
            RawSubjectStrategy::Topic => SubjectStrategy::Topic,
            RawSubjectStrategy::Record => SubjectStrategy::Record,
            RawSubjectStrategy::TopicRecord => SubjectStrategy::TopicRecord,
        };
        let mapping = self.mapping()?;
        let without_type = match mapping.event_type {
            None => Some("mapping.event_type".to_owned()),
            Some(_) => mapping
                .tables
                .iter()
                .find(|t| t.mapping.event_type.is_none())
                .map(|t| format!("mapping.tables.{:?}.event_type", t.key)),
        };
        if let (true, Some(key)) = (strategy.needs_event_type(), without_type) {
            return Err(ConfigError(format!(
                "schema_registry.subject_strategy = \"{}\" names subjects by the event type, and {key} is empty: map the event type column, or use subject_strategy = \"topic\"",
                strategy.name()
            )));
        }
        let keys = s.key == super::raw::RawRegistryKey::Schema;
        if keys && kind == SchemaKind::Protobuf {
            return Err(ConfigError(
                "schema_registry.key = \"schema\" is not supported with format = \"protobuf\": a Protobuf key is a message, and the aggregate id is text; use key = \"string\"".into(),
            ));
        }
        let derive = s.schemas == super::raw::RawSchemas::Derived;
        if derive && kind == SchemaKind::Protobuf {
            return Err(ConfigError(
                "schema_registry.schemas = \"derived\" is not supported with format = \"protobuf\": a .proto's field numbers are the contract, and no payload says which to use; register a .proto, or derive with avro or json-schema".into(),
            ));
        }
        Ok(Some(RegistryConfig {
            derive,
            keys,
            url: url.clone(),
            username: s.username.clone(),
            password: s.password.as_ref().map(|p| p.expose().to_owned()),
            ca_file: s.ca_file.as_ref().map(Into::into),
            strategy,
            kind,
        }))
    }

    /// `claim_check.*`, checked; `None` without a bucket.
    fn claim_check(&self) -> Result<Option<crate::claim_check::ClaimCheckConfig>, ConfigError> {
        let c = &self.raw.claim_check;
        let Some(bucket) = &c.bucket else {
            return Ok(None);
        };
        if bucket.is_empty() {
            return Err(ConfigError("claim_check.bucket: must not be empty".into()));
        }
        if let Some(e) = &c.endpoint {
            let scheme = e.split_once("://").map(|(s, _)| s);
            if !matches!(scheme, Some("http" | "https")) || e.ends_with("://") {
                return Err(ConfigError(format!(
                    "claim_check.endpoint {:?}: expected an http:// or https:// URL, e.g. https://s3.eu-central-1.amazonaws.com or http://127.0.0.1:9000",
                    super::redact_userinfo(e)
                )));
            }
        }
        if c.threshold_bytes < 1024 {
            return Err(ConfigError(
                "claim_check.threshold_bytes: must be at least 1024".into(),
            ));
        }
        Ok(Some(crate::claim_check::ClaimCheckConfig {
            bucket: bucket.clone(),
            endpoint: c.endpoint.clone(),
            region: c.region.clone(),
            prefix: c.prefix.clone(),
            threshold: usize::try_from(c.threshold_bytes)
                .map_err(|_| ConfigError("claim_check.threshold_bytes: too large".into()))?,
        }))
    }

    /// This process's slot and the suffix of its shard. Each shard is its
    /// own producer: its own transactional id (also the key of its progress
    /// records), or they would fence each other.
    fn shard_slot(&self) -> (String, String) {
        let r = &self.raw;
        match r.shard {
            Some(i) if r.shards > 1 => (shard_name(&r.slot, i as u32), format!("-{i}")),
            _ => (r.slot.clone(), String::new()),
        }
    }

    /// `transactions.id` when none is set: `walbox-<slot>`.
    pub(super) fn default_transactional_id(&self) -> String {
        format!("walbox-{}", self.shard_slot().0)
    }

    /// Exactly-once mode's settings, when `delivery = "exactly-once"`.
    fn exactly_once(&self) -> Result<Option<ExactlyOnce>, ConfigError> {
        let r = &self.raw;
        let t = &r.transactions;
        if r.delivery == Delivery::AtLeastOnce {
            let set = t.id.is_some()
                || t.progress_topic.is_some()
                || t.max_events.is_some()
                || t.max_bytes.is_some()
                || t.max_ms.is_some();
            if set {
                return Err(ConfigError(
                    "transactions.* apply to delivery = \"exactly-once\": set it, or remove them"
                        .into(),
                ));
            }
            return Ok(None);
        }
        let text = |key: &str, v: &Option<String>, default: String| match v {
            Some(v) if v.is_empty() => Err(ConfigError(format!(
                "transactions.{key}: must not be empty"
            ))),
            Some(v) => Ok(v.clone()),
            None => Ok(default),
        };
        let (slot, suffix) = self.shard_slot();
        let transactional_id = match &t.id {
            Some(id) if !id.is_empty() => format!("{id}{suffix}"),
            _ => text("id", &t.id, self.default_transactional_id())?,
        };
        let progress_topic = text(
            "progress_topic",
            &t.progress_topic,
            DEFAULT_PROGRESS_TOPIC.into(),
        )?;
        let d = Bounds::default();
        let count =
            |key: &str, v: Option<u64>, default: usize, least: u64| -> Result<usize, ConfigError> {
                match v {
                    None => Ok(default),
                    Some(n) if n < least => Err(ConfigError(format!(
                        "transactions.{key}: must be at least {least}"
                    ))),
                    Some(n) => usize::try_from(n)
                        .map_err(|_| ConfigError(format!("transactions.{key}: too large"))),
                }
            };
        let max_ms = count("max_ms", t.max_ms, d.max_time.as_millis() as usize, 1)?;
        if max_ms > 600_000 {
            return Err(ConfigError("transactions.max_ms: at most 600000 (the transaction must commit well within transaction.timeout.ms)".into()));
        }
        Ok(Some(ExactlyOnce {
            progress_topic,
            transactional_id,
            slot,
            source: r.source,
            bounds: Bounds {
                max_events: count("max_events", t.max_events, d.max_events, 1)?,
                max_bytes: count("max_bytes", t.max_bytes, d.max_bytes, 1024)?,
                max_time: Duration::from_millis(max_ms as u64),
            },
        }))
    }

    /// How to create missing topics, when `topics.create` is on.
    fn topic_spec(&self) -> Result<Option<TopicSpec>, ConfigError> {
        let t = &self.raw.topics;
        let count = |key: &str, v: Option<u64>| -> Result<Option<i32>, ConfigError> {
            v.map(|n| {
                i32::try_from(n).ok().filter(|n| *n >= 1).ok_or_else(|| {
                    ConfigError(format!("topics.{key}: must be between 1 and 2147483647"))
                })
            })
            .transpose()
        };
        let partitions = count("partitions", t.partitions)?;
        let replication_factor = count("replication_factor", t.replication_factor)?;
        if !t.create {
            if partitions.is_some() || replication_factor.is_some() || !t.config.is_empty() {
                return Err(ConfigError(
                    "topics.partitions, topics.replication_factor and topics.config apply to topics walbox creates: set topics.create = true, or remove them".into(),
                ));
            }
            return Ok(None);
        }
        Ok(Some(TopicSpec {
            partitions,
            replication_factor,
            config: t.config.clone(),
        }))
    }
}

/// A duration setting (`7d`, `30s`) of at least 1 s, if set; `examples`
/// name a few for the error.
fn duration_setting(
    key: &str,
    value: &Option<String>,
    examples: &str,
) -> Result<Option<Duration>, ConfigError> {
    let Some(text) = value else {
        return Ok(None);
    };
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        ConfigError(format!(
            "{key} {text:?}: {e}; expected a duration such as {examples}"
        ))
    })?;
    if d < Duration::from_secs(1) {
        return Err(ConfigError(format!("{key}: must be at least 1s")));
    }
    Ok(Some(d))
}

/// `skip_delivered`: on by default where it works (Kafka, at least once);
/// `true` elsewhere is refused with the broker's reason.
fn skip_delivered(
    sink: &SinkSettings,
    on: Option<bool>,
    look_back: u64,
    exactly_once: bool,
) -> Result<Option<u64>, ConfigError> {
    if look_back == 0 {
        return Err(ConfigError(
            "skip_delivered_look_back = 0: at least one record is read back per partition; to read none, set skip_delivered = false".into(),
        ));
    }
    let refusal = |why: &str| Err(ConfigError(format!("skip_delivered = true {why}")));
    match (sink, on, exactly_once) {
        (_, Some(false), _) => Ok(None),
        (SinkSettings::Kafka(_), _, false) => Ok(Some(look_back)),
        (SinkSettings::Kafka(_), None, true) => Ok(None),
        (SinkSettings::Kafka(_), Some(true), true) => refusal(
            "is for delivery = \"at-least-once\": exactly-once mode skips what committed by its progress record already",
        ),
        (_, None, _) => Ok(None),
        (SinkSettings::RabbitMq(_), Some(true), _) => refusal(
            "needs a broker that keeps what it took, in order, for walbox to read back: a RabbitMQ exchange keeps nothing (its queues are consumed); consumers deduplicate by the id header",
        ),
        (SinkSettings::Sqs(_), Some(true), _) => refusal(
            "needs a broker that keeps what it took, in order, for walbox to read back: SQS cannot be read without taking the messages; a FIFO queue drops a re-sent event by its deduplication id (its origin) within 5 minutes instead",
        ),
        (SinkSettings::Nats(_), Some(true), _) => refusal(
            "is Kafka's: JetStream drops a re-sent event by its Nats-Msg-Id (its origin) within the stream's duplicate window instead",
        ),
        (SinkSettings::Webhook(_), Some(true), _) => refusal(
            "needs a broker walbox can read back: an HTTP endpoint cannot be; each request carries an Idempotency-Key (the event's origin) instead",
        ),
    }
}
