//! The settings as the file spells them ([`super::table::SETTINGS`]), merged
//! from every layer before they are checked.

use std::collections::BTreeMap;

use super::secret::{Secret, REDACTED};
use super::{whole, EventSource, LogFormat, MappingPreset};
use serde::{Deserialize, Serialize};

/// How an event becomes a Kafka record's value and headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum RawFormat {
    #[default]
    AsStored,
    CloudeventsBinary,
    CloudeventsStructured,
    Debezium,
    Avro,
    JsonSchema,
    Protobuf,
}

/// The merged settings, as the file spells them (see [`table::SETTINGS`]).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct Raw {
    pub(super) pg_url: Option<Secret>,
    pub(super) slot: String,
    pub(super) publication: String,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) shards: u64,
    #[serde(deserialize_with = "whole::opt_u64")]
    pub(super) shard: Option<u64>,
    #[serde(deserialize_with = "whole::list")]
    pub(super) table: String,
    pub(super) source: EventSource,
    pub(super) message_prefix: String,
    pub(super) log_format: LogFormat,
    pub(super) format: RawFormat,
    pub(super) cloudevents_source: Option<String>,
    pub(super) mapping: RawMapping,
    pub(super) sink: RawSink,
    pub(super) kafka: RawKafka,
    pub(super) rabbitmq: RawRabbitMq,
    pub(super) nats: RawNats,
    pub(super) webhook: RawWebhook,
    pub(super) sqs: RawSqs,
    pub(super) topics: RawTopics,
    pub(super) delivery: Delivery,
    pub(super) transactions: RawTransactions,
    pub(super) dead_letter_topic: Option<String>,
    pub(super) on_failure: Option<OnFailure>,
    pub(super) quarantine: RawQuarantine,
    pub(super) claim_check: RawClaimCheck,
    pub(super) schema_registry: RawSchemaRegistry,
    pub(super) on_slot_invalidated: OnSlotInvalidated,
    pub(super) on_drift: OnDrift,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) slot_recreate_margin_secs: u64,
    pub(super) retention: Option<String>,
    pub(super) audit: RawAudit,
    pub(super) backlog: RawBacklog,
    pub(super) receipts: bool,
    pub(super) skip_delivered: Option<bool>,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) skip_delivered_look_back: u64,
    pub(super) otlp_endpoint: Option<String>,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) max_in_flight_events: u64,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) max_in_flight_bytes: u64,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) status_interval_ms: u64,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) shutdown_timeout_secs: u64,
    pub(super) metrics_addr: Option<String>,
}

impl Default for Raw {
    fn default() -> Self {
        Raw {
            pg_url: None,
            slot: "walbox".into(),
            publication: "walbox_outbox".into(),
            shards: 1,
            shard: None,
            table: "public.outbox_events".into(),
            source: EventSource::Table,
            message_prefix: "walbox".into(),
            log_format: LogFormat::Text,
            format: RawFormat::AsStored,
            cloudevents_source: None,
            mapping: RawMapping::default(),
            sink: RawSink::Kafka,
            kafka: RawKafka::default(),
            rabbitmq: RawRabbitMq::default(),
            nats: RawNats::default(),
            webhook: RawWebhook::default(),
            sqs: RawSqs::default(),
            topics: RawTopics::default(),
            delivery: Delivery::AtLeastOnce,
            transactions: RawTransactions::default(),
            dead_letter_topic: None,
            on_failure: None,
            quarantine: RawQuarantine::default(),
            claim_check: RawClaimCheck::default(),
            schema_registry: RawSchemaRegistry::default(),
            on_slot_invalidated: OnSlotInvalidated::Fail,
            on_drift: OnDrift::Stop,
            slot_recreate_margin_secs: 600,
            retention: None,
            audit: RawAudit::default(),
            backlog: RawBacklog::default(),
            receipts: false,
            skip_delivered: None,
            skip_delivered_look_back: 100_000,
            otlp_endpoint: None,
            max_in_flight_events: 10_000,
            // 8 MiB: ~200-byte events stay bound by the event count; ~2 KB
            // ones drained as fast with it as with 64 MiB, in 43 MiB of
            // peak RSS against 58 (docs/benchmarks.md, "What bounds walbox").
            max_in_flight_bytes: 8 * 1024 * 1024,
            status_interval_ms: 1000,
            shutdown_timeout_secs: 20,
            metrics_addr: None,
        }
    }
}

/// `[mapping]`: `None` takes the preset's column.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawMapping {
    pub(super) preset: MappingPreset,
    pub(super) topic_template: Option<String>,
    pub(super) id: Option<String>,
    pub(super) aggregate_type: Option<String>,
    pub(super) aggregate_id: Option<String>,
    pub(super) event_type: Option<String>,
    pub(super) payload: Option<String>,
    pub(super) headers: Option<String>,
    pub(super) timestamp: Option<String>,
    pub(super) header_columns: BTreeMap<String, String>,
    /// `[mapping.tables."schema.table"]`: tables with columns of their own
    /// (file only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub(super) tables: BTreeMap<String, RawTableMapping>,
}

/// `[mapping.tables."schema.table"]`: a preset (else `[mapping]`'s
/// columns), then columns of its own. [`RawMapping`]'s columns again, not
/// a flattened struct: serde's `flatten` ignores `deny_unknown_fields`, and
/// a misspelt column must be refused.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawTableMapping {
    pub(super) preset: Option<MappingPreset>,
    pub(super) topic_template: Option<String>,
    pub(super) id: Option<String>,
    pub(super) aggregate_type: Option<String>,
    pub(super) aggregate_id: Option<String>,
    pub(super) event_type: Option<String>,
    pub(super) payload: Option<String>,
    pub(super) headers: Option<String>,
    pub(super) timestamp: Option<String>,
    pub(super) header_columns: Option<BTreeMap<String, String>>,
}

/// `sink`: the broker events go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum RawSink {
    #[default]
    Kafka,
    Rabbitmq,
    Sqs,
    Nats,
    Webhook,
}

/// `[rabbitmq]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawRabbitMq {
    pub(super) url: Option<super::secret::Secret>,
    pub(super) password: Option<super::secret::Secret>,
    pub(super) ca_file: Option<String>,
    pub(super) cert_file: Option<String>,
    pub(super) key_file: Option<String>,
    pub(super) server_name: Option<String>,
    pub(super) exchange: String,
    pub(super) exchange_type: String,
    pub(super) declare_exchange: bool,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) partitions: u64,
    pub(super) audit_stream: Option<String>,
    pub(super) audit_stream_max_age: String,
}

impl Default for RawRabbitMq {
    fn default() -> Self {
        RawRabbitMq {
            url: None,
            password: None,
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            exchange: "walbox".into(),
            exchange_type: "topic".into(),
            declare_exchange: true,
            partitions: 1,
            audit_stream: None,
            audit_stream_max_age: "7D".into(),
        }
    }
}

/// `[nats]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawNats {
    pub(super) url: Option<super::secret::Secret>,
    pub(super) ca_file: Option<String>,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) ack_timeout_ms: u64,
}

impl Default for RawNats {
    fn default() -> Self {
        RawNats {
            url: None,
            ca_file: None,
            ack_timeout_ms: 10_000,
        }
    }
}

/// `[webhook]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawWebhook {
    pub(super) url: Option<super::secret::Secret>,
    pub(super) secret: Option<super::secret::Secret>,
    pub(super) ca_file: Option<String>,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) timeout_ms: u64,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) concurrency: u64,
}

impl Default for RawWebhook {
    fn default() -> Self {
        RawWebhook {
            url: None,
            secret: None,
            ca_file: None,
            timeout_ms: 10_000,
            concurrency: 16,
        }
    }
}

/// `[sqs]`.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawSqs {
    pub(super) queue_url: Option<String>,
    pub(super) dead_letter_queue_url: Option<String>,
    pub(super) region: Option<String>,
    pub(super) endpoint: Option<String>,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) concurrency: u64,
}

impl Default for RawSqs {
    fn default() -> Self {
        RawSqs {
            queue_url: None,
            dead_letter_queue_url: None,
            region: None,
            endpoint: None,
            concurrency: 4,
        }
    }
}

/// `[kafka]`. Its `Debug` redacts the secret properties.
#[derive(Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawKafka {
    pub(super) brokers: Option<String>,
    pub(super) aws_region: Option<String>,
    #[serde(deserialize_with = "whole::properties")]
    pub(super) properties: BTreeMap<String, String>,
}

impl std::fmt::Debug for RawKafka {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: BTreeMap<&str, String> = self
            .properties
            .iter()
            .map(|(k, v)| {
                let v = if sink_kafka::is_secret_property(k) {
                    REDACTED.to_owned()
                } else {
                    super::secret::redact_userinfo(v)
                };
                (k.as_str(), v)
            })
            .collect();
        f.debug_struct("RawKafka")
            .field("brokers", &self.brokers)
            .field("aws_region", &self.aws_region)
            .field("properties", &shown)
            .finish()
    }
}

/// `[topics]`: creating missing topics.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawTopics {
    pub(super) create: bool,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    pub(super) partitions: Option<u64>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    pub(super) replication_factor: Option<u64>,
    #[serde(deserialize_with = "whole::properties")]
    pub(super) config: BTreeMap<String, String>,
}

/// What `walbox run` does with a slot that lost WAL it needed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnSlotInvalidated {
    /// Stop, saying what to do.
    #[default]
    Fail,
    /// Recreate the slot and republish from the outbox table (see
    /// [`crate::backfill::heal`]).
    Recreate,
}

/// What `walbox run` does when the publication stops covering the outbox
/// table's INSERTs (publication drift).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnDrift {
    /// Stop with the slot before the gap, saying what to fix; `walbox
    /// resync --drift` republishes the rows the stream did not carry.
    #[default]
    Stop,
    /// Wait until the publication covers the table again, republish the
    /// rows the stream did not carry, stream on (see
    /// [`crate::backfill::heal_drift`]).
    Heal,
}

/// What walbox promises about each event.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Delivery {
    /// Every event at least once; duplicates only after a crash or reconnect.
    #[default]
    AtLeastOnce,
    /// Every event once for `read_committed` consumers, through Kafka
    /// transactions (see [`crate::exactly_once`]).
    ExactlyOnce,
}

/// What `walbox run` does with an event that fails for good (see
/// [`crate::dead_letter`] and [`crate::quarantine`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnFailure {
    /// Stop with the slot before it.
    Stop,
    /// Publish it to `dead_letter_topic` and go on.
    DeadLetter,
    /// Hold its aggregate in `walbox.quarantine` and go on.
    Quarantine,
}

/// `[quarantine]`: its bound.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawQuarantine {
    #[serde(deserialize_with = "whole::u64")]
    pub(super) max_events: u64,
}

impl Default for RawQuarantine {
    fn default() -> Self {
        RawQuarantine {
            max_events: 100_000,
        }
    }
}

/// `[claim_check]`: where oversized values go.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawClaimCheck {
    pub(super) bucket: Option<String>,
    pub(super) endpoint: Option<String>,
    pub(super) region: Option<String>,
    pub(super) prefix: String,
    #[serde(deserialize_with = "whole::u64")]
    pub(super) threshold_bytes: u64,
}

impl Default for RawClaimCheck {
    fn default() -> Self {
        RawClaimCheck {
            bucket: None,
            endpoint: None,
            region: None,
            prefix: "walbox/".into(),
            threshold_bytes: 900_000,
        }
    }
}

/// `[schema_registry]`: where format = avro finds its schemas.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawSchemaRegistry {
    pub(super) url: Option<String>,
    pub(super) username: Option<String>,
    pub(super) password: Option<Secret>,
    pub(super) ca_file: Option<String>,
    pub(super) subject_strategy: RawSubjectStrategy,
    pub(super) key: RawRegistryKey,
    pub(super) schemas: RawSchemas,
}

/// `schema_registry.schemas`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum RawSchemas {
    #[default]
    Registered,
    Derived,
}

/// `schema_registry.key`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum RawRegistryKey {
    #[default]
    String,
    Schema,
}

/// `schema_registry.subject_strategy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum RawSubjectStrategy {
    #[default]
    Topic,
    Record,
    TopicRecord,
}

/// `[audit]`: the continuous audit.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawAudit {
    pub(super) interval: Option<String>,
}

/// `[backlog]`: the budget `walbox.require_capacity()` holds the relay to.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawBacklog {
    #[serde(deserialize_with = "whole::opt_u64", default)]
    pub(super) max_bytes: Option<u64>,
    pub(super) max_age: Option<String>,
}

/// `[transactions]`: exactly-once mode's settings.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct RawTransactions {
    pub(super) id: Option<String>,
    pub(super) progress_topic: Option<String>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    pub(super) max_events: Option<u64>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    pub(super) max_bytes: Option<u64>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    pub(super) max_ms: Option<u64>,
}
