//! The effective view: every setting's value and where it came from, secrets
//! redacted, and the user information of any URL (`walbox config`, the
//! startup line of `walbox run`).

use super::{redact_userinfo, source_name, table, Config};
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
                // Where it points, never the password.
                self.raw.pg_url.as_ref().map(|u| u.expose()).map_or_else(
                    || "(none)".into(),
                    |url| {
                        PgConfig::parse(url).map_or_else(|_| "<invalid>".into(), |c| c.describe())
                    },
                )
            } else if s.secret {
                "<redacted>".into()
            } else {
                lookup(s.key).map_or_else(|| "(none)".into(), |v| redact_userinfo(&text(&v)))
            };
            let source = given.as_ref().map_or_else(|| "default".into(), source_of);
            out.push((s.key.to_owned(), shown, source));
        }
        out
    }
}
