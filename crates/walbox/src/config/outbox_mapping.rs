//! The outbox mapping: which columns hold what, for every table, and for
//! tables laid out differently (`[mapping.tables."schema.table"]`).

use std::collections::BTreeMap;

use slot_manager::OutboxTables;

use super::raw::RawTableMapping;
use super::{optional, Config, ConfigError, MappingPreset, RawFormat};
use crate::mapping::format::EventFormat;
use crate::mapping::{OutboxMapping, TableMapping};

/// The columns and template one section sets (`None`: not set there).
struct Given<'a> {
    topic_template: &'a Option<String>,
    id: &'a Option<String>,
    aggregate_type: &'a Option<String>,
    aggregate_id: &'a Option<String>,
    event_type: &'a Option<String>,
    payload: &'a Option<String>,
    headers: &'a Option<String>,
    timestamp: &'a Option<String>,
    header_columns: Option<&'a BTreeMap<String, String>>,
}

impl<'a> From<&'a RawTableMapping> for Given<'a> {
    fn from(t: &'a RawTableMapping) -> Self {
        Given {
            topic_template: &t.topic_template,
            id: &t.id,
            aggregate_type: &t.aggregate_type,
            aggregate_id: &t.aggregate_id,
            event_type: &t.event_type,
            payload: &t.payload,
            headers: &t.headers,
            timestamp: &t.timestamp,
            header_columns: t.header_columns.as_ref(),
        }
    }
}

fn preset(p: MappingPreset) -> OutboxMapping {
    match p {
        MappingPreset::Walbox => OutboxMapping::default(),
        MappingPreset::Debezium => OutboxMapping::debezium(),
    }
}

impl Config {
    /// The outbox mapping: the preset's columns, overridden one by one; and
    /// each `[mapping.tables]` key's, from its preset or `[mapping]`.
    pub fn mapping(&self) -> Result<OutboxMapping, ConfigError> {
        let m = &self.raw.mapping;
        let mut mapping = preset(m.preset);
        self.apply(
            &mut mapping,
            Given {
                topic_template: &m.topic_template,
                id: &m.id,
                aggregate_type: &m.aggregate_type,
                aggregate_id: &m.aggregate_id,
                event_type: &m.event_type,
                payload: &m.payload,
                headers: &m.headers,
                timestamp: &m.timestamp,
                header_columns: Some(&m.header_columns),
            },
            "mapping",
        )?;
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
        mapping.tables = self.table_mappings(&mapping)?;
        Ok(mapping)
    }

    /// `[mapping.tables]`: each key's tables, which must be among the
    /// outbox tables, and their mapping.
    fn table_mappings(&self, base: &OutboxMapping) -> Result<Vec<TableMapping>, ConfigError> {
        let given = &self.raw.mapping.tables;
        if given.is_empty() {
            return Ok(Vec::new());
        }
        let outbox =
            OutboxTables::parse(&self.raw.table).map_err(|e| ConfigError(format!("table: {e}")))?;
        if !self.raw.source.table() {
            return Err(ConfigError(
                "mapping.tables maps the columns of outbox tables, and source = messages reads none: remove it".into(),
            ));
        }
        if let Some(one) = outbox.single() {
            return Err(ConfigError(format!(
                "mapping.tables maps tables laid out differently among several outbox tables, and table = {one} is one: set its columns in [mapping] itself"
            )));
        }
        let mut out: Vec<TableMapping> = Vec::with_capacity(given.len());
        for (key, raw) in given {
            let at = format!("mapping.tables.{key:?}");
            let tables = OutboxTables::parse(key).map_err(|e| ConfigError(format!("{at}: {e}")))?;
            for t in tables.named() {
                if let Some(other) = out.iter().find(|o| o.tables.named().any(|n| n == t)) {
                    return Err(ConfigError(format!(
                        "{at}: table {t} is named by mapping.tables.{:?} too: give it one section",
                        other.key
                    )));
                }
            }
            if let Some(stray) = tables
                .named()
                .find(|t| !outbox.matches(t.schema(), t.name()))
            {
                return Err(ConfigError(format!(
                    "{at}: table {stray} is not one of the outbox tables (table = {outbox})"
                )));
            }
            let mut mapping = match raw.preset {
                Some(p) => preset(p),
                None => OutboxMapping {
                    tables: Vec::new(),
                    ..base.clone()
                },
            };
            self.apply(&mut mapping, Given::from(raw), &at)?;
            mapping.format = base.format.clone();
            out.push(TableMapping {
                key: key.clone(),
                tables,
                mapping,
            });
        }
        Ok(out)
    }

    /// Sets the columns and template `g` gives over `mapping`'s (`at`: the
    /// section, for errors).
    fn apply(
        &self,
        mapping: &mut OutboxMapping,
        g: Given<'_>,
        at: &str,
    ) -> Result<(), ConfigError> {
        if let Some(v) = g.topic_template {
            let rest = crate::mapping::TEMPLATE_PLACEHOLDERS
                .iter()
                .fold(v.clone(), |t, p| t.replace(p, ""));
            if rest.contains(['{', '}']) {
                return Err(ConfigError(format!(
                    "{at}.topic_template {v:?}: the placeholders are {{aggregate_type}}, {{schema}} and {{table}}"
                )));
            }
            if self.raw.source.messages() && crate::mapping::names_table(v) {
                return Err(ConfigError(format!(
                    "{at}.topic_template {v:?} names the table ({{schema}}, {{table}}), and events written as messages (source = messages or both) have none"
                )));
            }
            mapping.topic_template = v.clone();
        }
        let required = [
            (&mut mapping.id, g.id, "id"),
            (
                &mut mapping.aggregate_type,
                g.aggregate_type,
                "aggregate_type",
            ),
            (&mut mapping.aggregate_id, g.aggregate_id, "aggregate_id"),
            (&mut mapping.payload, g.payload, "payload"),
        ];
        for (column, value, key) in required {
            if let Some(v) = value {
                if v.is_empty() {
                    return Err(ConfigError(format!("{at}.{key}: must not be empty")));
                }
                *column = v.clone();
            }
        }
        for (column, value) in [
            (&mut mapping.event_type, g.event_type),
            (&mut mapping.headers, g.headers),
            (&mut mapping.timestamp, g.timestamp),
        ] {
            if let Some(v) = value {
                *column = optional(v.clone());
            }
        }
        if let Some(h) = g.header_columns {
            mapping.header_columns = h.iter().map(|(c, h)| (c.clone(), h.clone())).collect();
        }
        Ok(())
    }
}

impl Config {
    /// `cloudevents_source` when none is set: `/walbox/<slot>`.
    pub(super) fn default_cloudevents_source(&self) -> String {
        format!("/walbox/{}", self.raw.slot)
    }
}
