//! The effective view: every setting's value and where it came from, secrets
//! redacted, and the user information of any URL (`walbox config`, the
//! startup line of `walbox run`).

use super::{redact_userinfo, source_name, table, Config};
use crate::mapping::TableMapping;
use sink_kafka::is_secret_property;
use slot_manager::PgConfig;

impl Config {
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
        // Where the mapping's preset was set, if it was: the source of the
        // columns it chose.
        let preset = self.figment.find_value("mapping.preset").ok();
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
                            redact_userinfo(&text(&v))
                        };
                        out.push((format!("{}.{k}", s.key), shown, source));
                    }
                }
                continue;
            }
            let shown = if s.key == "pg_url" {
                // Where it points and how, never the password; with what
                // libpq's variables add, as the connection gets it.
                match (self.connection(), self.raw.pg_url.as_ref()) {
                    (Ok(c), _) => c.pg.describe_fully(),
                    (Err(_), Some(url)) => PgConfig::parse(url.expose())
                        .map_or_else(|_| "<invalid>".into(), |c| c.describe_fully()),
                    (Err(_), None) => "(none)".into(),
                }
            } else if s.secret {
                // Whether one is set is no secret; its value is.
                match lookup(s.key).map(|v| text(&v)) {
                    Some(v) if v != "(none)" => "<redacted>".into(),
                    _ => "(none)".into(),
                }
            } else {
                // Unset: what it takes from others, else the default
                // `--help` and the docs give.
                lookup(s.key)
                    .map(|v| redact_userinfo(&text(&v)))
                    .filter(|v| v != "(none)")
                    .or_else(|| self.derived_default(s.key))
                    .or_else(|| (s.default != "—").then(|| s.default.to_owned()))
                    .unwrap_or_else(|| "(none)".into())
            };
            let shown = if shown.is_empty() {
                "(none)".into()
            } else {
                shown
            };
            let source = match (&given, &preset) {
                (Some(v), _) => source_of(v),
                // A column the preset chose, not walbox's default.
                (None, Some(p))
                    if s.key.starts_with("mapping.") && s.scope == table::Scope::Mapping =>
                {
                    format!("mapping.preset = {}, {}", text(p), source_of(p))
                }
                (None, _) => "default".into(),
            };
            out.push((s.key.to_owned(), shown, source));
        }
        // Each table's own mapping, as it applies (file only).
        if let Ok(m) = self.mapping() {
            let source = self
                .figment
                .find_value("mapping.tables")
                .ok()
                .map_or_else(|| "default".into(), |v| source_of(&v));
            for TableMapping {
                key, mapping: t, ..
            } in &m.tables
            {
                let mut line = |column: &str, value: &str| {
                    out.push((
                        format!("mapping.tables.{key:?}.{column}"),
                        value.to_owned(),
                        source.clone(),
                    ))
                };
                line("topic_template", &t.topic_template);
                line("id", &t.id);
                line("aggregate_type", &t.aggregate_type);
                line("aggregate_id", &t.aggregate_id);
                line("event_type", t.event_type.as_deref().unwrap_or_default());
                line("payload", &t.payload);
                line("headers", t.headers.as_deref().unwrap_or_default());
                line("timestamp", t.timestamp.as_deref().unwrap_or_default());
                for (column, header) in &t.header_columns {
                    line(&format!("header_columns.{column}"), header);
                }
            }
        }
        // What walbox sets in librdkafka itself, beside the operator's own.
        // (none with another sink)
        if let Ok(run) = self.run() {
            if let Some(Ok(props)) = run.sink.kafka().map(|k| k.walbox_properties()) {
                for (k, v) in props {
                    out.push((format!("kafka.properties.{k}"), v, "walbox".into()));
                }
            }
        }
        out
    }

    /// The value a setting left unset takes from others.
    fn derived_default(&self, key: &str) -> Option<String> {
        match key {
            "transactions.id" => Some(self.default_transactional_id()),
            "transactions.progress_topic" => {
                Some(super::run_settings::DEFAULT_PROGRESS_TOPIC.to_owned())
            }
            "cloudevents_source" => Some(self.default_cloudevents_source()),
            "on_failure" => Some(
                if self.raw.dead_letter_topic.is_some() {
                    "dead-letter"
                } else {
                    "stop"
                }
                .to_owned(),
            ),
            _ => None,
        }
    }
}
