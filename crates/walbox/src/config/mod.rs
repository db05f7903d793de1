//! Configuration: defaults < TOML file < `WALBOX_*` environment < flags.
//!
//! Every setting has one name ([`table::SETTINGS`]): the file key
//! `kafka.brokers` (`[kafka] brokers = …`) is the variable
//! `WALBOX_KAFKA_BROKERS` and the flag `--kafka-brokers`. Any setting can
//! come from a file named by `…_FILE` (`WALBOX_PG_URL_FILE`,
//! `WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE`), so a secret never has to be on
//! the command line. The layers are merged by figment, which keeps where each
//! value came from for errors and `walbox config`.
//!
//! The merged settings are checked and split by who needs them:
//! [`Connection`] (every command), [`OutboxMapping`] (the commands that read
//! the outbox's columns) and [`RunSettings`] (`walbox run`). Unknown keys and
//! bad values are errors that name the key and its source.

mod args;
mod layers;
pub mod table;
mod whole;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::providers::Format;
use figment::Figment;
use serde::{Deserialize, Serialize};
use sink_kafka::{is_secret_property, SinkConfig, TopicSpec};
use slot_manager::{PgConfig, ShardFilter, TableName};

use crate::dead_letter::DeadLetters;
use crate::exactly_once::{Bounds, ExactlyOnce};
use crate::format::EventFormat;
use crate::mapping::OutboxMapping;

pub use args::{ConnectionFlags, MappingFlags, RunFlags};

/// A configuration problem, naming the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Column-name presets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MappingPreset {
    /// walbox's `outbox_events`.
    #[default]
    Walbox,
    /// Debezium's EventRouter.
    Debezium,
}

/// Where events come from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EventSource {
    /// Rows inserted into the outbox table.
    #[default]
    Table,
    /// Transactional logical decoding messages with the configured prefix
    /// (`walbox.emit`, `pg_logical_emit_message`; Postgres 14+).
    Messages,
    /// Both, in commit order.
    Both,
}

impl EventSource {
    /// Rows of the outbox table are events.
    pub fn table(self) -> bool {
        self != EventSource::Messages
    }

    /// Logical decoding messages are events.
    pub fn messages(self) -> bool {
        self != EventSource::Table
    }

    /// The oldest server this source streams from (`server_version_num`),
    /// and what to say to an older one.
    pub fn least_server(self) -> (i32, &'static str) {
        if self.messages() {
            (
                140_000,
                "logical decoding messages as events (source = messages or both) need Postgres 14 or later (pgoutput's messages option); use source = table",
            )
        } else {
            slot_manager::LEAST_SERVER
        }
    }
}

/// How an event becomes a Kafka record's value and headers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
enum RawFormat {
    #[default]
    AsStored,
    CloudeventsBinary,
    CloudeventsStructured,
    Debezium,
}

/// The merged settings, as the file spells them (see [`table::SETTINGS`]).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct Raw {
    pg_url: Option<String>,
    slot: String,
    publication: String,
    #[serde(deserialize_with = "whole::u64")]
    shards: u64,
    #[serde(deserialize_with = "whole::opt_u64")]
    shard: Option<u64>,
    table: String,
    source: EventSource,
    message_prefix: String,
    log_format: LogFormat,
    format: RawFormat,
    cloudevents_source: Option<String>,
    mapping: RawMapping,
    kafka: RawKafka,
    topics: RawTopics,
    delivery: Delivery,
    transactions: RawTransactions,
    dead_letter_topic: Option<String>,
    on_slot_invalidated: OnSlotInvalidated,
    #[serde(deserialize_with = "whole::u64")]
    slot_recreate_margin_secs: u64,
    retention: Option<String>,
    otlp_endpoint: Option<String>,
    #[serde(deserialize_with = "whole::u64")]
    max_in_flight_events: u64,
    #[serde(deserialize_with = "whole::u64")]
    max_in_flight_bytes: u64,
    #[serde(deserialize_with = "whole::u64")]
    status_interval_ms: u64,
    #[serde(deserialize_with = "whole::u64")]
    shutdown_timeout_secs: u64,
    metrics_addr: Option<String>,
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
            kafka: RawKafka::default(),
            topics: RawTopics::default(),
            delivery: Delivery::AtLeastOnce,
            transactions: RawTransactions::default(),
            dead_letter_topic: None,
            on_slot_invalidated: OnSlotInvalidated::Fail,
            slot_recreate_margin_secs: 600,
            retention: None,
            otlp_endpoint: None,
            max_in_flight_events: 10_000,
            max_in_flight_bytes: 64 * 1024 * 1024,
            status_interval_ms: 1000,
            shutdown_timeout_secs: 20,
            metrics_addr: None,
        }
    }
}

/// `[mapping]`: `None` takes the preset's column.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawMapping {
    preset: MappingPreset,
    topic_template: Option<String>,
    id: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    payload: Option<String>,
    headers: Option<String>,
    timestamp: Option<String>,
    header_columns: BTreeMap<String, String>,
}

/// `[kafka]`.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawKafka {
    brokers: Option<String>,
    properties: BTreeMap<String, String>,
}

/// `[topics]`: creating missing topics.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawTopics {
    create: bool,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    partitions: Option<u64>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    replication_factor: Option<u64>,
    config: BTreeMap<String, String>,
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

/// `[transactions]`: exactly-once mode's settings.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
struct RawTransactions {
    id: Option<String>,
    progress_topic: Option<String>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    max_events: Option<u64>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    max_bytes: Option<u64>,
    #[serde(deserialize_with = "whole::opt_u64", default)]
    max_ms: Option<u64>,
}

/// Where Postgres is and what to stream: every command's settings.
#[derive(Clone, Debug)]
pub struct Connection {
    /// Postgres.
    pub pg: PgConfig,
    /// Slot.
    pub slot: String,
    /// Publication.
    pub publication: String,
    /// Outbox table.
    pub table: TableName,
    /// Where events come from.
    pub source: EventSource,
    /// How many shards the outbox is split over (1: not sharded).
    pub shards: u32,
    /// The shard this connection streams (its slot and publication are the
    /// shard's); `None` when not sharded, or for every shard.
    pub shard: Option<ShardFilter>,
    /// The names shards derive theirs from, when sharded.
    shard_base: Option<ShardBase>,
}

/// What every shard's names and filter derive from.
#[derive(Clone, Debug)]
struct ShardBase {
    slot: String,
    publication: String,
    /// The column shards hash: the aggregate id.
    column: String,
}

impl Connection {
    /// The connections this one stands for: itself when not sharded or when
    /// it names its shard; otherwise every shard's.
    pub fn selected_shards(&self) -> Vec<Connection> {
        match self.shard {
            Some(_) => vec![self.clone()],
            None => self.all_shards(),
        }
    }

    /// Every shard's connection (itself when not sharded).
    pub fn all_shards(&self) -> Vec<Connection> {
        let Some(base) = &self.shard_base else {
            return vec![self.clone()];
        };
        (0..self.shards)
            .map(|index| Connection {
                slot: shard_name(&base.slot, index),
                publication: shard_name(&base.publication, index),
                shard: Some(ShardFilter {
                    index,
                    count: self.shards,
                    column: base.column.clone(),
                }),
                ..self.clone()
            })
            .collect()
    }

    /// What to say to an older server than the source and sharding need.
    pub fn least_server(&self) -> (i32, &'static str) {
        least_server(self.source, self.shards > 1)
    }
}

/// The oldest server `source` streams from, sharded or not, and what to
/// say to an older one.
pub fn least_server(source: EventSource, sharded: bool) -> (i32, &'static str) {
    let (least, why) = source.least_server();
    if sharded && least < slot_manager::LEAST_SHARDED_SERVER {
        return (
            slot_manager::LEAST_SHARDED_SERVER,
            "sharded streaming (shards > 1) needs Postgres 15 or later (publication row filters)",
        );
    }
    (least, why)
}

/// A shard's slot or publication: the name with `_index` appended.
fn shard_name(name: &str, index: u32) -> String {
    format!("{name}_{index}")
}

/// What `walbox run` needs beyond the connection and mapping.
#[derive(Clone, Debug)]
pub struct RunSettings {
    /// The producer.
    pub sink: SinkConfig,
    /// What happens to undeliverable events.
    pub dead_letters: DeadLetters,
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
    /// How far before the last delivered commit rows stay (retention and
    /// recreating alike).
    pub margin: Duration,
    /// Delete outbox rows older than this; `None`: keep them.
    pub retention: Option<Duration>,
    /// The prefix of the logical decoding messages that are events.
    pub message_prefix: String,
    /// Where to export a span per event; `None`: off.
    pub otlp_endpoint: Option<String>,
}

/// The loaded configuration.
#[derive(Debug)]
pub struct Config {
    raw: Raw,
    figment: Figment,
    /// `PG*` variables (and `HOME`, for `~/.pgpass`) from the environment.
    pg_env: Vec<(String, String)>,
}

/// Where a configuration comes from.
#[derive(Debug, Default)]
pub struct Sources<'a> {
    /// The TOML file, if any.
    pub file: Option<&'a Path>,
    /// Environment variables (normally `std::env::vars()`).
    pub env: Vec<(String, String)>,
    /// Flags: `(key, values)` for each one given.
    pub flags: Vec<(&'static str, Vec<&'a str>)>,
}

/// Reads and checks the TOML file first, for errors with its line numbers.
fn check_file(path: &Path) -> Result<(), ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("read {}: {e}", path.display())))?;
    toml::from_str::<Raw>(&text).map(|_| ()).map_err(|e| {
        let msg = e.message().to_owned();
        let line = e.span().map(|s| text[..s.start].matches('\n').count() + 1);
        ConfigError(match line {
            Some(l) => format!("{}: line {l}: {msg}", path.display()),
            None => format!("{}: {msg}", path.display()),
        })
    })
}

/// Where a value came from: the file's path, `environment` or `command line`.
fn source_name(m: &figment::Metadata) -> String {
    match &m.source {
        Some(figment::Source::File(path)) => path.display().to_string(),
        _ => m.name.to_string(),
    }
}

/// Empty means "none" for optional columns.
fn optional(v: String) -> Option<String> {
    (!v.is_empty()).then_some(v)
}

impl Config {
    /// Merges the layers: defaults < file < environment < flags.
    pub fn load(sources: Sources<'_>) -> Result<Config, ConfigError> {
        let mut figment = Figment::new();
        if let Some(path) = sources.file {
            check_file(path)?;
            figment = figment.merge(figment::providers::Toml::file(path));
        }
        // libpq's variables, for what pg_url leaves out.
        let pg_env: Vec<(String, String)> = sources
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("PG") || k == "HOME")
            .cloned()
            .collect();
        figment = figment
            .merge(layers::environment(sources.env)?)
            .merge(layers::flags(sources.flags)?);
        let raw: Raw = figment.extract().map_err(|e| {
            let source = e
                .metadata
                .as_ref()
                .map(|m| format!(" (from {})", source_name(m)))
                .unwrap_or_default();
            let key = if e.path.is_empty() {
                String::new()
            } else {
                format!("{}: ", e.path.join("."))
            };
            ConfigError(format!("{key}{}{source}", e.kind))
        })?;
        Ok(Config {
            raw,
            figment,
            pg_env,
        })
    }

    /// The log format.
    pub fn log_format(&self) -> LogFormat {
        self.raw.log_format
    }

    /// Postgres, slot, publication and table, checked.
    pub fn connection(&self) -> Result<Connection, ConfigError> {
        let r = &self.raw;
        let env = |name: &str| {
            self.pg_env
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        };
        // Without pg_url, libpq's variables alone may say where to connect.
        let libpq_only = ["PGHOST", "PGUSER", "PGDATABASE"]
            .iter()
            .any(|v| env(v).is_some_and(|v| !v.is_empty()));
        let pg_url = match r.pg_url.as_deref() {
            Some(url) => url,
            None if libpq_only => "",
            None => {
                return Err(ConfigError(
                    "pg_url is required (--pg-url, WALBOX_PG_URL, WALBOX_PG_URL_FILE or pg_url in the file; or libpq's PGHOST, PGUSER, …)"
                        .into(),
                ))
            }
        };
        let pg = PgConfig::parse_with_env(pg_url, env)
            .map_err(|e| ConfigError(format!("pg_url: {e}")))?;
        let slot_ok = !r.slot.is_empty()
            && r.slot.len() <= slot_manager::MAX_NAME_BYTES
            && r.slot
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !slot_ok {
            return Err(ConfigError(format!(
                "slot {:?}: slot names are 1-63 lower-case letters, digits and underscores",
                r.slot
            )));
        }
        if r.publication.is_empty() {
            return Err(ConfigError("publication: must not be empty".into()));
        }
        if r.publication.len() > slot_manager::MAX_NAME_BYTES {
            return Err(ConfigError(format!(
                "publication {:?}: {} bytes; Postgres names are at most {} (it would cut it silently)",
                r.publication,
                r.publication.len(),
                slot_manager::MAX_NAME_BYTES
            )));
        }
        let table = TableName::parse(&r.table).map_err(|e| ConfigError(format!("table: {e}")))?;
        let connection = Connection {
            pg,
            slot: r.slot.clone(),
            publication: r.publication.clone(),
            table,
            source: r.source,
            shards: 1,
            shard: None,
            shard_base: None,
        };
        self.sharded(connection)
    }

    /// `connection` with the shard settings applied: checked, and the
    /// shard's names when it names one.
    fn sharded(&self, mut c: Connection) -> Result<Connection, ConfigError> {
        let r = &self.raw;
        let max = slot_manager::MAX_SHARDS;
        let shards = match u32::try_from(r.shards) {
            Ok(n @ 1..) if n <= max => n,
            _ => {
                return Err(ConfigError(format!(
                    "shards: {} is not a shard count from 1 to {max}",
                    r.shards
                )))
            }
        };
        if shards == 1 {
            return match r.shard {
                None | Some(0) => Ok(c),
                Some(i) => Err(ConfigError(format!(
                    "shard: {i} given, but shards is 1 (set shards to the number of shards)"
                ))),
            };
        }
        if !c.source.table() || c.source.messages() {
            return Err(ConfigError(
                "shards > 1 needs source = table: row filters split table rows, not logical decoding messages".into(),
            ));
        }
        let suffix = shard_name("", shards - 1).len();
        for (what, name) in [("slot", &c.slot), ("publication", &c.publication)] {
            if name.len() + suffix > slot_manager::MAX_NAME_BYTES {
                return Err(ConfigError(format!(
                    "{what} {name:?}: with shards = {shards} its shards' names would exceed {} bytes",
                    slot_manager::MAX_NAME_BYTES
                )));
            }
        }
        c.shards = shards;
        c.shard_base = Some(ShardBase {
            slot: c.slot.clone(),
            publication: c.publication.clone(),
            column: self.mapping()?.aggregate_id,
        });
        if let Some(i) = r.shard {
            let index = u32::try_from(i)
                .ok()
                .filter(|i| *i < shards)
                .ok_or_else(|| {
                    ConfigError(format!(
                        "shard: {i} is not one of the {shards} shards (0 to {})",
                        shards - 1
                    ))
                })?;
            c = c
                .all_shards()
                .into_iter()
                .nth(index as usize)
                .expect("index checked");
        }
        Ok(c)
    }

    /// The outbox mapping: the preset's columns, overridden one by one.
    pub fn mapping(&self) -> Result<OutboxMapping, ConfigError> {
        let m = &self.raw.mapping;
        let mut mapping = match m.preset {
            MappingPreset::Walbox => OutboxMapping::default(),
            MappingPreset::Debezium => OutboxMapping::debezium(),
        };
        if let Some(v) = &m.topic_template {
            if !v.contains("{aggregate_type}") && v.contains('{') {
                return Err(ConfigError(format!(
                    "mapping.topic_template {v:?}: the only placeholder is {{aggregate_type}}"
                )));
            }
            mapping.topic_template = v.clone();
        }
        let required = [
            (&mut mapping.id, &m.id, "id"),
            (
                &mut mapping.aggregate_type,
                &m.aggregate_type,
                "aggregate_type",
            ),
            (&mut mapping.aggregate_id, &m.aggregate_id, "aggregate_id"),
            (&mut mapping.payload, &m.payload, "payload"),
        ];
        for (column, value, key) in required {
            if let Some(v) = value {
                if v.is_empty() {
                    return Err(ConfigError(format!("mapping.{key}: must not be empty")));
                }
                *column = v.clone();
            }
        }
        for (column, value) in [
            (&mut mapping.event_type, &m.event_type),
            (&mut mapping.headers, &m.headers),
            (&mut mapping.timestamp, &m.timestamp),
        ] {
            if let Some(v) = value {
                *column = optional(v.clone());
            }
        }
        mapping.header_columns = m
            .header_columns
            .iter()
            .map(|(c, h)| (c.clone(), h.clone()))
            .collect();
        let r = &self.raw;
        let source = match &r.cloudevents_source {
            Some(s) if s.is_empty() => {
                return Err(ConfigError("cloudevents_source: must not be empty".into()))
            }
            Some(s) if !matches!(r.format, RawFormat::CloudeventsBinary | RawFormat::CloudeventsStructured) => {
                return Err(ConfigError(format!(
                    "cloudevents_source {s:?} applies to format = \"cloudevents-binary\" or \"cloudevents-structured\": set one, or remove it"
                )))
            }
            Some(s) => s.clone(),
            None => format!("/walbox/{}", r.slot),
        };
        mapping.format = match r.format {
            RawFormat::AsStored => EventFormat::AsStored,
            RawFormat::CloudeventsBinary => EventFormat::CloudEventsBinary { source },
            RawFormat::CloudeventsStructured => EventFormat::CloudEventsStructured { source },
            RawFormat::Debezium => EventFormat::Debezium,
        };
        Ok(mapping)
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

    /// What `walbox run` needs, checked.
    pub fn run(&self) -> Result<RunSettings, ConfigError> {
        let r = &self.raw;
        let brokers = r.kafka.brokers.clone().ok_or_else(|| {
            ConfigError(
                "kafka.brokers is required (--kafka-brokers, WALBOX_KAFKA_BROKERS or [kafka] brokers in the file)"
                    .into(),
            )
        })?;
        let mut sink = SinkConfig::new(brokers);
        sink.properties = r.kafka.properties.clone();
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
        let dead_letters = match &r.dead_letter_topic {
            Some(t) if t.is_empty() => {
                return Err(ConfigError("dead_letter_topic: must not be empty".into()))
            }
            Some(t) => DeadLetters::to_topic(t.clone()),
            None => DeadLetters::halt(),
        };
        sink.create_topics = self.topic_spec()?;
        // Without a dead-letter topic an event that fails for good stops
        // walbox, and nothing after it may be written ahead of it.
        sink.gapless = r.dead_letter_topic.is_none();
        let exactly_once = self.exactly_once()?;
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
        if r.source == EventSource::Messages && r.retention.is_some() {
            return Err(ConfigError(
                "retention deletes rows of the outbox table; with source = messages there is none: remove it".into(),
            ));
        }
        let otlp_endpoint = match &r.otlp_endpoint {
            None => None,
            Some(e) if e.starts_with("http://") && e.len() > "http://".len() => Some(e.clone()),
            Some(e) if e.starts_with("https://") => {
                return Err(ConfigError(format!(
                    "otlp_endpoint {e:?}: this build exports over plain HTTP only; point it at a local collector agent or sidecar (http://…:4318)"
                )))
            }
            Some(e) => {
                return Err(ConfigError(format!(
                    "otlp_endpoint {e:?}: expected an OTLP/HTTP URL such as http://127.0.0.1:4318"
                )))
            }
        };
        Ok(RunSettings {
            otlp_endpoint,
            message_prefix: r.message_prefix.clone(),
            sink,
            dead_letters,
            status_interval: Duration::from_millis(r.status_interval_ms),
            shutdown_timeout: Duration::from_secs(r.shutdown_timeout_secs),
            metrics_addr,
            exactly_once,
            recreate_margin: (r.on_slot_invalidated == OnSlotInvalidated::Recreate)
                .then(|| Duration::from_secs(r.slot_recreate_margin_secs)),
            margin: Duration::from_secs(r.slot_recreate_margin_secs),
            retention: match &r.retention {
                None => None,
                Some(text) => {
                    let d = humantime::parse_duration(text.trim()).map_err(|e| {
                        ConfigError(format!(
                            "retention {text:?}: {e}; expected a duration such as 7d, 12h or 30m"
                        ))
                    })?;
                    if d < Duration::from_secs(1) {
                        return Err(ConfigError("retention: must be at least 1s".into()));
                    }
                    Some(d)
                }
            },
        })
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
        // Each shard is its own producer: its own transactional id (also the
        // key of its progress records), or they would fence each other.
        let (slot, suffix) = match r.shard {
            Some(i) if r.shards > 1 => (shard_name(&r.slot, i as u32), format!("-{i}")),
            _ => (r.slot.clone(), String::new()),
        };
        let transactional_id = match &t.id {
            Some(id) if !id.is_empty() => format!("{id}{suffix}"),
            _ => text("id", &t.id, format!("walbox-{slot}"))?,
        };
        let progress_topic = text(
            "progress_topic",
            &t.progress_topic,
            "walbox.progress".into(),
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

    /// Every setting's effective value, secrets redacted, with its source
    /// (`default`, the file's path, `environment`, `command line`):
    /// `(key, value, source)` in the table's order; a map has a line per entry.
    pub fn effective(&self) -> Vec<(String, String, String)> {
        use figment::value::Value;
        // The mapping as it applies: the preset's columns where none was set.
        let mut resolved = self.raw.clone();
        if let Ok(m) = self.mapping() {
            let rm = &mut resolved.mapping;
            rm.topic_template = Some(m.topic_template);
            rm.id = Some(m.id);
            rm.aggregate_type = Some(m.aggregate_type);
            rm.aggregate_id = Some(m.aggregate_id);
            rm.payload = Some(m.payload);
            rm.event_type = Some(m.event_type.unwrap_or_default());
            rm.headers = Some(m.headers.unwrap_or_default());
            rm.timestamp = Some(m.timestamp.unwrap_or_default());
        }
        let values = Value::serialize(&resolved)
            .ok()
            .and_then(Value::into_dict)
            .unwrap_or_default();
        let lookup = |key: &str| -> Option<Value> {
            let mut parts = key.split('.');
            let first = values.get(parts.next()?)?.clone();
            parts.try_fold(first, |v, p| v.into_dict()?.get(p).cloned())
        };
        let source_of = |v: &Value| {
            self.figment
                .get_metadata(v.tag())
                .map_or_else(|| "default".to_owned(), source_name)
        };
        let text = |v: &Value| match v {
            Value::String(_, s) => s.clone(),
            Value::Num(_, n) => n.to_u128().map_or_else(String::new, |n| n.to_string()),
            Value::Bool(_, b) => b.to_string(),
            _ => "(none)".to_owned(),
        };
        let mut out = Vec::new();
        for s in table::SETTINGS {
            let given = self.figment.find_value(s.key).ok();
            if s.kind == table::Kind::Map {
                if let Some(Value::Dict(_, entries)) = lookup(s.key) {
                    for (k, v) in entries {
                        let source = given
                            .as_ref()
                            .and_then(|g| g.as_dict()?.get(&k).map(source_of))
                            .unwrap_or_else(|| "default".into());
                        let shown = if is_secret_property(&k) {
                            "<redacted>".to_owned()
                        } else {
                            text(&v)
                        };
                        out.push((format!("{}.{k}", s.key), shown, source));
                    }
                }
                continue;
            }
            let shown = if s.key == "pg_url" {
                // Where it points, never the password.
                self.raw.pg_url.as_deref().map_or_else(
                    || "(none)".into(),
                    |url| {
                        PgConfig::parse(url).map_or_else(|_| "<invalid>".into(), |c| c.describe())
                    },
                )
            } else if s.secret {
                "<redacted>".into()
            } else {
                lookup(s.key).map_or_else(|| "(none)".into(), |v| text(&v))
            };
            let source = given.as_ref().map_or_else(|| "default".into(), source_of);
            out.push((s.key.to_owned(), shown, source));
        }
        out
    }
}

#[cfg(test)]
mod tests;
