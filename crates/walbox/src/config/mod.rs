//! Configuration: defaults < TOML file < `WALBOX_*` environment < flags.
//!
//! Every setting has one name ([`table::SETTINGS`]): the file key
//! `kafka.brokers` (`[kafka] brokers = …`) is the variable
//! `WALBOX_KAFKA_BROKERS` and the flag `--kafka-brokers`. Any setting can
//! come from a file named by `…_FILE` (`WALBOX_PG_URL_FILE`,
//! `WALBOX_KAFKA_PROPERTY_SASL_PASSWORD_FILE`), so a secret never has to be on
//! the command line. The layers are merged by figment, which keeps where each
//! value came from for errors and `walbox config`; each layer is made here
//! ([`layers`]): the file read once with the `toml` crate (its errors name
//! the line), the environment and the flags by the one table of settings.
//!
//! The merged settings are checked and split by who needs them:
//! [`Connection`] (every command), [`OutboxMapping`] (the commands that read
//! the outbox's columns) and [`RunSettings`] (`walbox run`). Unknown keys and
//! bad values are errors that name the key and its source.

mod args;
mod broker_limits;
mod connection;
mod effective;
mod files;
mod json_schema;
mod layers;
mod nats;
mod outbox_mapping;
mod rabbitmq;
mod raw;
mod run_settings;
mod secret;
mod sqs;
pub mod table;
mod warnings;
mod webhook;
mod whole;

use std::path::Path;

use figment::Figment;
use serde::{Deserialize, Serialize};

pub use crate::event_source::EventSource;
pub use args::{ConnectionFlags, MappingFlags, RunFlags};
pub use connection::Connection;
pub use raw::{Delivery, OnDrift, OnFailure, OnSlotInvalidated};
use raw::{Raw, RawFormat};
pub use run_settings::{RunPlan, RunSettings, SinkSettings};

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

pub use broker_limits::unreadable;
pub use json_schema::json_schema;
pub use layers::renamed_flag;
pub use secret::{redact_userinfo, Endpoint};

/// The loaded configuration. Its `Debug` shows the settings with every
/// secret redacted (not the layers, nor the libpq variables such as
/// `PGPASSWORD`).
pub struct Config {
    raw: Raw,
    figment: Figment,
    /// `PG*` variables (and `HOME`, for `~/.pgpass`) from the environment.
    pg_env: Vec<(String, String)>,
    /// Variables that look like settings but are none, warned of.
    ignored: Vec<String>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URLs' user information too (otlp_endpoint, any property).
        let settings = redact_userinfo(&format!("{:?}", self.raw));
        write!(f, "Config {{ settings: {settings}, .. }}")
    }
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
            figment = figment.merge(layers::file(path)?);
        }
        // libpq's variables, for what pg_url leaves out.
        let pg_env: Vec<(String, String)> = sources
            .env
            .iter()
            .filter(|(k, _)| k.starts_with("PG") || k == "HOME")
            .cloned()
            .collect();
        crate::redaction::register_environment(&sources.env);
        let ignored = layers::unread_variables(&sources.env);
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
            ignored,
        })
    }

    /// The log format.
    pub fn log_format(&self) -> LogFormat {
        self.raw.log_format
    }
}

#[cfg(test)]
mod tests;
