//! Configuration: a TOML file, `WALBOX_*` environment variables and flags.
//! Flags win over the environment, which wins over the file, which wins over
//! the defaults. Unknown keys and bad values are errors that name the key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use sink_kafka::SinkConfig;
use slot_manager::{PgConfig, TableName};

use crate::mapping::OutboxMapping;

/// A configuration problem, naming the key.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

/// Log output format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Column-name presets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum MappingPreset {
    /// walbox's `outbox_events` (id, aggregate_type, aggregate_id, event_type, payload, headers, created_at).
    #[default]
    Walbox,
    /// Debezium's EventRouter (id, aggregatetype, aggregateid, type, payload).
    Debezium,
}

/// The configuration file. Every key is optional; unknown keys are refused.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// Postgres connection string.
    pub pg_url: Option<String>,
    /// Replication slot.
    pub slot: Option<String>,
    /// Publication.
    pub publication: Option<String>,
    /// Outbox table.
    pub table: Option<String>,
    /// `text` or `json`.
    pub log_format: Option<LogFormat>,
    /// Standby status update interval, milliseconds.
    pub status_interval_ms: Option<u64>,
    /// How long SIGINT/SIGTERM waits for in-flight deliveries, seconds.
    pub shutdown_timeout_secs: Option<u64>,
    /// HTTP address for /metrics, /healthz and /readyz.
    pub metrics_addr: Option<String>,
    /// `[kafka]`.
    pub kafka: Option<KafkaFile>,
    /// `[mapping]`.
    pub mapping: Option<MappingFile>,
}

/// `[kafka]` in the configuration file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaFile {
    /// Bootstrap servers.
    pub brokers: Option<String>,
    /// Dead-letter topic.
    pub dead_letter_topic: Option<String>,
    /// Most events in flight.
    pub max_in_flight_events: Option<usize>,
    /// Most bytes in flight.
    pub max_in_flight_bytes: Option<usize>,
    /// librdkafka properties (`[kafka.properties]`).
    pub properties: Option<BTreeMap<String, String>>,
}

/// `[mapping]` in the configuration file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MappingFile {
    /// `walbox` or `debezium`.
    pub preset: Option<MappingPreset>,
    /// Topic template.
    pub topic_template: Option<String>,
    /// Event id column.
    pub id: Option<String>,
    /// Aggregate type column.
    pub aggregate_type: Option<String>,
    /// Aggregate id column.
    pub aggregate_id: Option<String>,
    /// Event type column (`""` for none).
    pub event_type: Option<String>,
    /// Payload column.
    pub payload: Option<String>,
    /// Headers column (`""` for none).
    pub headers: Option<String>,
    /// Timestamp column (`""` for none).
    pub timestamp: Option<String>,
    /// Extra columns copied into headers: `column = "header-name"`.
    pub header_columns: Option<BTreeMap<String, String>>,
}

/// Connection, slot and mapping options shared by every subcommand.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CommonArgs {
    /// TOML configuration file (see docs/configuration.md).
    #[arg(long, env = "WALBOX_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Postgres connection string: `postgres://user:pass@host:5432/db?sslmode=verify-full&sslrootcert=ca.pem`
    /// or `host=… user=… dbname=…`. The role needs REPLICATION.
    #[arg(
        long,
        env = "WALBOX_PG_URL",
        hide_env_values = true,
        value_name = "URL"
    )]
    pub pg_url: Option<String>,
    /// Logical replication slot to stream from [default: walbox].
    #[arg(long, env = "WALBOX_SLOT")]
    pub slot: Option<String>,
    /// Publication on the outbox table [default: walbox_outbox].
    #[arg(long, env = "WALBOX_PUBLICATION")]
    pub publication: Option<String>,
    /// Outbox table, `schema.table` [default: public.outbox_events].
    #[arg(long, env = "WALBOX_TABLE")]
    pub table: Option<String>,
    /// Log format [default: text].
    #[arg(long, env = "WALBOX_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Column-name preset: `walbox` or `debezium` (EventRouter) [default: walbox].
    #[arg(long, env = "WALBOX_MAPPING_PRESET", value_enum)]
    pub mapping_preset: Option<MappingPreset>,
    /// Topic template; `{aggregate_type}` is replaced [default: outbox.event.{aggregate_type}].
    #[arg(long, env = "WALBOX_TOPIC_TEMPLATE")]
    pub topic_template: Option<String>,
    /// Event id column (header `id`).
    #[arg(long, env = "WALBOX_COLUMN_ID")]
    pub column_id: Option<String>,
    /// Aggregate type column (chooses the topic).
    #[arg(long, env = "WALBOX_COLUMN_AGGREGATE_TYPE")]
    pub column_aggregate_type: Option<String>,
    /// Aggregate id column (the message key).
    #[arg(long, env = "WALBOX_COLUMN_AGGREGATE_ID")]
    pub column_aggregate_id: Option<String>,
    /// Event type column (header `event_type`); empty for none.
    #[arg(long, env = "WALBOX_COLUMN_EVENT_TYPE")]
    pub column_event_type: Option<String>,
    /// Payload column (the message value).
    #[arg(long, env = "WALBOX_COLUMN_PAYLOAD")]
    pub column_payload: Option<String>,
    /// jsonb column expanded into headers; empty for none.
    #[arg(long, env = "WALBOX_COLUMN_HEADERS")]
    pub column_headers: Option<String>,
    /// Timestamp column (the message timestamp); empty for none.
    #[arg(long, env = "WALBOX_COLUMN_TIMESTAMP")]
    pub column_timestamp: Option<String>,
    /// Copy a column into a header: `COLUMN=HEADER` (repeatable).
    #[arg(long = "header-column", value_name = "COLUMN=HEADER")]
    pub header_columns: Vec<String>,
}

/// Kafka options of `walbox run`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KafkaArgs {
    /// Kafka bootstrap servers, `host:port,…`.
    #[arg(long, env = "WALBOX_KAFKA_BROKERS", value_name = "LIST")]
    pub kafka_brokers: Option<String>,
    /// A librdkafka producer property, `KEY=VALUE` (repeatable): security.protocol, sasl.*, ssl.*, linger.ms, …
    #[arg(long = "kafka-property", value_name = "KEY=VALUE")]
    pub kafka_properties: Vec<String>,
    /// Topic for events that fail permanently; without it such a failure stops walbox.
    #[arg(long, env = "WALBOX_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,
    /// Most events in flight (sent, not yet acknowledged) [default: 10000].
    #[arg(long, env = "WALBOX_MAX_IN_FLIGHT_EVENTS")]
    pub max_in_flight_events: Option<usize>,
    /// Most bytes in flight [default: 67108864].
    #[arg(long, env = "WALBOX_MAX_IN_FLIGHT_BYTES")]
    pub max_in_flight_bytes: Option<usize>,
    /// Seconds SIGINT/SIGTERM waits for in-flight deliveries [default: 30].
    #[arg(long, env = "WALBOX_SHUTDOWN_TIMEOUT_SECS")]
    pub shutdown_timeout_secs: Option<u64>,
    /// Serve Prometheus /metrics, /healthz and /readyz on this address, e.g. 0.0.0.0:9187 [default: off].
    #[arg(long, env = "WALBOX_METRICS_ADDR", value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
}

/// Everything resolved and validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Postgres.
    pub pg: PgConfig,
    /// Slot.
    pub slot: String,
    /// Publication.
    pub publication: String,
    /// Outbox table.
    pub table: TableName,
    /// Mapping.
    pub mapping: OutboxMapping,
    /// Log format.
    pub log_format: LogFormat,
    /// Status update interval.
    pub status_interval: Duration,
    /// Kafka, for `run`.
    pub kafka: Option<SinkConfig>,
    /// Shutdown drain bound.
    pub shutdown_timeout: Duration,
    /// Where to serve metrics and health endpoints.
    pub metrics_addr: Option<std::net::SocketAddr>,
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("read {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| {
        let msg = e.message().to_owned();
        let line = e.span().map(|s| text[..s.start].matches('\n').count() + 1);
        ConfigError(match line {
            Some(l) => format!("{}: line {l}: {msg}", path.display()),
            None => format!("{}: {msg}", path.display()),
        })
    })
}

fn key_value(what: &str, s: &str) -> Result<(String, String), ConfigError> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| ConfigError(format!("{what} takes KEY=VALUE, got {s:?}")))
}

/// Slot names: lower-case letters, digits and underscores, at most 63.
fn check_slot(slot: &str) -> Result<(), ConfigError> {
    let ok = !slot.is_empty()
        && slot.len() <= 63
        && slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(ConfigError(format!(
            "slot {slot:?}: slot names are 1-63 lower-case letters, digits and underscores"
        )))
    }
}

/// Empty means "none" for optional columns.
fn optional(v: String) -> Option<String> {
    (!v.is_empty()).then_some(v)
}

impl Settings {
    /// Resolves flags/environment over the file over defaults. `kafka` is
    /// given for `run`, which needs brokers.
    pub fn resolve(
        common: &CommonArgs,
        kafka: Option<&KafkaArgs>,
    ) -> Result<Settings, ConfigError> {
        let file = match &common.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let pg_url = common.pg_url.clone().or(file.pg_url).ok_or_else(|| {
            ConfigError("pg_url is required (--pg-url, WALBOX_PG_URL or pg_url in the file)".into())
        })?;
        let pg = PgConfig::parse(&pg_url).map_err(|e| ConfigError(format!("pg_url: {e}")))?;
        let slot = common
            .slot
            .clone()
            .or(file.slot)
            .unwrap_or_else(|| "walbox".into());
        check_slot(&slot)?;
        let publication = common
            .publication
            .clone()
            .or(file.publication)
            .unwrap_or_else(|| "walbox_outbox".into());
        if publication.is_empty() {
            return Err(ConfigError("publication: must not be empty".into()));
        }
        let table_text = common
            .table
            .clone()
            .or(file.table)
            .unwrap_or_else(|| "public.outbox_events".into());
        let table =
            TableName::parse(&table_text).map_err(|e| ConfigError(format!("table: {e}")))?;

        let mf = file.mapping.unwrap_or_default();
        let mut mapping = match common.mapping_preset.or(mf.preset).unwrap_or_default() {
            MappingPreset::Walbox => OutboxMapping::default(),
            MappingPreset::Debezium => OutboxMapping::debezium(),
        };
        if let Some(v) = common.topic_template.clone().or(mf.topic_template) {
            if !v.contains("{aggregate_type}") && v.contains('{') {
                return Err(ConfigError(format!(
                    "topic_template {v:?}: the only placeholder is {{aggregate_type}}"
                )));
            }
            mapping.topic_template = v;
        }
        let set = |slot: &mut String, v: Option<String>, key: &str| -> Result<(), ConfigError> {
            if let Some(v) = v {
                if v.is_empty() {
                    return Err(ConfigError(format!("mapping.{key}: must not be empty")));
                }
                *slot = v;
            }
            Ok(())
        };
        set(&mut mapping.id, common.column_id.clone().or(mf.id), "id")?;
        set(
            &mut mapping.aggregate_type,
            common.column_aggregate_type.clone().or(mf.aggregate_type),
            "aggregate_type",
        )?;
        set(
            &mut mapping.aggregate_id,
            common.column_aggregate_id.clone().or(mf.aggregate_id),
            "aggregate_id",
        )?;
        set(
            &mut mapping.payload,
            common.column_payload.clone().or(mf.payload),
            "payload",
        )?;
        if let Some(v) = common.column_event_type.clone().or(mf.event_type) {
            mapping.event_type = optional(v);
        }
        if let Some(v) = common.column_headers.clone().or(mf.headers) {
            mapping.headers = optional(v);
        }
        if let Some(v) = common.column_timestamp.clone().or(mf.timestamp) {
            mapping.timestamp = optional(v);
        }
        mapping.header_columns = mf.header_columns.unwrap_or_default().into_iter().collect();
        for hc in &common.header_columns {
            mapping
                .header_columns
                .push(key_value("--header-column", hc)?);
        }

        let kf = file.kafka.unwrap_or_default();
        let shutdown_timeout_secs = kafka
            .and_then(|k| k.shutdown_timeout_secs)
            .or(file.shutdown_timeout_secs);
        let metrics_addr = match kafka
            .and_then(|k| k.metrics_addr.clone())
            .or(file.metrics_addr)
        {
            None => None,
            Some(a) => Some(a.parse().map_err(|_| {
                ConfigError(format!(
                    "metrics_addr {a:?}: expected HOST:PORT with an IP address, e.g. 0.0.0.0:9187"
                ))
            })?),
        };
        let kafka = match kafka {
            None => None,
            Some(k) => {
                let brokers = k.kafka_brokers.clone().or(kf.brokers).ok_or_else(|| {
                    ConfigError("kafka brokers are required (--kafka-brokers, WALBOX_KAFKA_BROKERS or [kafka] brokers)".into())
                })?;
                let mut sink = SinkConfig::new(brokers);
                sink.properties = kf.properties.unwrap_or_default();
                for p in &k.kafka_properties {
                    let (key, value) = key_value("--kafka-property", p)?;
                    sink.properties.insert(key, value);
                }
                sink.dead_letter_topic = k.dead_letter_topic.clone().or(kf.dead_letter_topic);
                if let Some(n) = k.max_in_flight_events.or(kf.max_in_flight_events) {
                    if n == 0 {
                        return Err(ConfigError(
                            "max_in_flight_events: must be at least 1".into(),
                        ));
                    }
                    sink.max_in_flight = n;
                }
                if let Some(n) = k.max_in_flight_bytes.or(kf.max_in_flight_bytes) {
                    if n < 1024 {
                        return Err(ConfigError(
                            "max_in_flight_bytes: must be at least 1024".into(),
                        ));
                    }
                    sink.max_in_flight_bytes = n;
                }
                Some(sink)
            }
        };
        let status_interval = Duration::from_millis(file.status_interval_ms.unwrap_or(1000));
        if status_interval.is_zero() {
            return Err(ConfigError("status_interval_ms: must be above 0".into()));
        }
        let shutdown_timeout = Duration::from_secs(shutdown_timeout_secs.unwrap_or(30));
        Ok(Settings {
            pg,
            slot,
            publication,
            table,
            mapping,
            log_format: common.log_format.or(file.log_format).unwrap_or_default(),
            status_interval,
            kafka,
            shutdown_timeout,
            metrics_addr,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn common(pg: &str) -> CommonArgs {
        CommonArgs {
            pg_url: Some(pg.into()),
            ..Default::default()
        }
    }

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("walbox.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn defaults() {
        let s = Settings::resolve(&common("host=h user=u"), None).unwrap();
        assert_eq!(
            (s.slot.as_str(), s.publication.as_str()),
            ("walbox", "walbox_outbox")
        );
        assert_eq!(s.table.quoted(), "\"public\".\"outbox_events\"");
        assert_eq!(s.mapping, OutboxMapping::default());
        assert!(s.kafka.is_none());
    }

    #[test]
    fn flags_win_over_the_file() {
        let (_d, path) = file(
            "slot = \"from_file\"\npublication = \"file_pub\"\n[kafka]\nbrokers = \"file:9092\"\n[kafka.properties]\n\"linger.ms\" = \"50\"\n[mapping]\npreset = \"debezium\"\nheader_columns = { tenant = \"x-tenant\" }\n",
        );
        let mut c = common("host=h user=u");
        c.config = Some(path);
        c.slot = Some("from_flag".into());
        let k = KafkaArgs {
            kafka_properties: vec!["acks=all".into()],
            ..Default::default()
        };
        let s = Settings::resolve(&c, Some(&k)).unwrap();
        assert_eq!(
            (s.slot.as_str(), s.publication.as_str()),
            ("from_flag", "file_pub")
        );
        assert_eq!(s.mapping.aggregate_type, "aggregatetype");
        assert_eq!(
            s.mapping.header_columns,
            [("tenant".to_owned(), "x-tenant".to_owned())]
        );
        let kafka = s.kafka.unwrap();
        assert_eq!(kafka.bootstrap_servers, "file:9092");
        assert_eq!(
            kafka.properties.get("linger.ms").map(String::as_str),
            Some("50")
        );
        assert_eq!(
            kafka.properties.get("acks").map(String::as_str),
            Some("all")
        );
    }

    #[test]
    fn bad_input_names_the_key() {
        let (_d, path) = file("slot = \"s\"\nslto = \"typo\"\n");
        let mut c = common("host=h user=u");
        c.config = Some(path);
        let e = Settings::resolve(&c, None).unwrap_err().to_string();
        assert!(
            e.contains("line 2") && e.contains("unknown field `slto`"),
            "{e}"
        );

        let (_d, path) = file("status_interval_ms = \"soon\"\n");
        c.config = Some(path);
        let e = Settings::resolve(&c, None).unwrap_err().to_string();
        assert!(
            e.contains("status_interval_ms") || e.contains("line 1"),
            "{e}"
        );

        let mut c = common("host=h user=u");
        c.slot = Some("My Slot".into());
        assert!(Settings::resolve(&c, None)
            .unwrap_err()
            .to_string()
            .contains("slot \"My Slot\""));
        let e =
            Settings::resolve(&common("host=h user=u"), Some(&KafkaArgs::default())).unwrap_err();
        assert!(e.to_string().contains("kafka brokers are required"), "{e}");
        let e = Settings::resolve(&CommonArgs::default(), None).unwrap_err();
        assert!(e.to_string().contains("pg_url is required"), "{e}");
        let e = Settings::resolve(&common("host=h user=u password=hunter2 sslmode=nope"), None)
            .unwrap_err();
        assert!(
            e.to_string().starts_with("configuration: pg_url:")
                && !e.to_string().contains("hunter2"),
            "{e}"
        );
    }
}
