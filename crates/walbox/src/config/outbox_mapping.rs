//! The outbox mapping: which columns hold what.

use super::{optional, Config, ConfigError, MappingPreset, RawFormat};
use crate::mapping::format::EventFormat;
use crate::mapping::OutboxMapping;

impl Config {
    /// The outbox mapping: the preset's columns, overridden one by one.
    pub fn mapping(&self) -> Result<OutboxMapping, ConfigError> {
        let m = &self.raw.mapping;
        let mut mapping = match m.preset {
            MappingPreset::Walbox => OutboxMapping::default(),
            MappingPreset::Debezium => OutboxMapping::debezium(),
        };
        if let Some(v) = &m.topic_template {
            let rest = crate::mapping::TEMPLATE_PLACEHOLDERS
                .iter()
                .fold(v.clone(), |t, p| t.replace(p, ""));
            if rest.contains(['{', '}']) {
                return Err(ConfigError(format!(
                    "mapping.topic_template {v:?}: the placeholders are {{aggregate_type}}, {{schema}} and {{table}}"
                )));
            }
            if self.raw.source.messages() && crate::mapping::names_table(v) {
                return Err(ConfigError(format!(
                    "mapping.topic_template {v:?} names the table ({{schema}}, {{table}}), and events written as messages (source = messages or both) have none"
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
            None => self.default_cloudevents_source(),
        };
        mapping.format = match r.format {
            RawFormat::AsStored => EventFormat::AsStored,
            RawFormat::CloudeventsBinary => EventFormat::CloudEventsBinary { source },
            RawFormat::CloudeventsStructured => EventFormat::CloudEventsStructured { source },
            RawFormat::Debezium => EventFormat::Debezium,
            RawFormat::Avro => EventFormat::Avro,
            RawFormat::JsonSchema => EventFormat::JsonSchema,
            RawFormat::Protobuf => EventFormat::Protobuf,
        };
        Ok(mapping)
    }
}

impl Config {
    /// `cloudevents_source` when none is set: `/walbox/<slot>`.
    pub(super) fn default_cloudevents_source(&self) -> String {
        format!("/walbox/{}", self.raw.slot)
    }
}
