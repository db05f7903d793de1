//! The outbox mapping: one inserted outbox row → one Kafka record.
//!
//! | column (default name) | becomes |
//! |---|---|
//! | `id` | header `id`, the consumers' dedup key |
//! | `aggregate_type` | the topic, via the template `outbox.event.{aggregate_type}` |
//! | `aggregate_id` | the message key |
//! | `event_type` | header `event_type` |
//! | `payload` | the message value, as stored: json/jsonb/text/varchar not copied, `bytea` its bytes ([`bytea`]) |
//! | `headers` (jsonb object) | one header per key: strings as is, other values as JSON text |
//! | `created_at` | the message timestamp |
//!
//! Every name is configurable, so a Debezium EventRouter table
//! (`id, aggregatetype, aggregateid, type, payload`) works by configuration
//! alone ([`OutboxMapping::debezium`]). Extra columns can become headers.
//!
//! Column positions are resolved once per Relation message
//! ([`OutboxMapping::resolve`]); mapping a row is then one pass over its tuple.
//!
//! Beside it: [`envelope`] (an event emitted as a logical decoding message,
//! mapped the same way), [`format`] (how the value and headers are written:
//! as stored, CloudEvents, Debezium's envelope) and [`timestamp`] (the
//! record timestamp from a column's text).

pub mod bytea;
pub mod envelope;
pub mod format;
pub mod timestamp;

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use pgoutput_decoder::{Column, ColumnCountMismatch, RelationBody, TupleData};
use sink_core::Header;
use slot_manager::{OutboxTables, TableName};

use format::{Attributes, EventFormat};
use timestamp::parse_timestamp_ms;

/// Type OIDs the payload column may have.
const JSON: u32 = 114;
const JSONB: u32 = 3802;
const TEXT: u32 = 25;
const VARCHAR: u32 = 1043;
const BYTEA: u32 = 17;

/// What the payload column holds, by its type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PayloadKind {
    /// json or jsonb: JSON, as Postgres checked it.
    Json,
    /// text or varchar: anything; checked as JSON when the format needs it.
    Text,
    /// bytea: the application's own bytes (its serializer's), sent as they are.
    Bytes,
}

/// Which columns hold what, and how topics are named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxMapping {
    /// Event id column (`id`).
    pub id: String,
    /// Aggregate type column (`aggregate_type`).
    pub aggregate_type: String,
    /// Aggregate id column (`aggregate_id`): the message key.
    pub aggregate_id: String,
    /// Event type column (`event_type`); `None` to send no `event_type` header.
    pub event_type: Option<String>,
    /// Payload column (`payload`): json, jsonb, text, varchar or bytea.
    pub payload: String,
    /// A jsonb object column expanded into headers (`headers`); `None` for none.
    pub headers: Option<String>,
    /// Timestamp column (`created_at`); `None` to let the producer stamp the send time.
    pub timestamp: Option<String>,
    /// Topic template; `{aggregate_type}` is replaced by the row's value.
    pub topic_template: String,
    /// Extra `(column, header name)` pairs copied into headers.
    pub header_columns: Vec<(String, String)>,
    /// How the event becomes a record.
    pub format: EventFormat,
    /// Tables whose columns map by a mapping of their own
    /// (`[mapping.tables."schema.table"]`), with several outbox tables.
    pub tables: Vec<TableMapping>,
}

/// The mapping of the outbox tables a key names (`legacy.outbox`,
/// `tenant_*.outbox_events`): the columns, and the topic template, of
/// tables laid out differently from the others. Its `format` is the base
/// mapping's and its own `tables` is empty.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableMapping {
    /// The key as the configuration wrote it.
    pub key: String,
    /// The tables it maps.
    pub tables: OutboxTables,
    /// Their mapping.
    pub mapping: OutboxMapping,
}

impl Default for OutboxMapping {
    fn default() -> Self {
        OutboxMapping {
            id: "id".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: Some("event_type".into()),
            payload: "payload".into(),
            headers: Some("headers".into()),
            timestamp: Some("created_at".into()),
            topic_template: "outbox.event.{aggregate_type}".into(),
            header_columns: Vec::new(),
            format: EventFormat::AsStored,
            tables: Vec::new(),
        }
    }
}

/// Why a row (or a table) cannot be mapped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// The table lacks a mapped column.
    #[error("table {table} has no column {column:?} (mapped as the {role})")]
    MissingColumn {
        /// `schema.table`.
        table: String,
        /// The configured column name.
        column: String,
        /// What it was mapped as.
        role: &'static str,
    },
    /// The payload column has a type walbox cannot publish.
    #[error("payload column {column:?} of {table} has type OID {type_oid}; use json, jsonb, text, varchar or bytea (or a domain over one)")]
    PayloadType {
        /// `schema.table`.
        table: String,
        /// The column.
        column: String,
        /// Its type OID.
        type_oid: u32,
    },
    /// A `bytea` payload with a format that writes JSON.
    #[error("payload column {column:?} of {table} is bytea, and format = {format} writes the payload as JSON: use format = as-stored (the bytes as they are), or a json, jsonb or text payload column")]
    BinaryPayload {
        /// `schema.table`.
        table: String,
        /// The column.
        column: String,
        /// The configured format.
        format: &'static str,
    },
    /// A `bytea` payload whose text is not `bytea` output.
    #[error("event {event_id}: bytea payload unreadable: {reason}")]
    PayloadNotBytea {
        /// The event id.
        event_id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A required column is NULL (or not sent) in this row.
    #[error("event {event_id}: column {column:?} (the {role}) is NULL")]
    NullColumn {
        /// The event id, or `<unknown>` when the id itself is missing.
        event_id: String,
        /// The column.
        column: String,
        /// What it was mapped as.
        role: &'static str,
    },
    /// The aggregate id is the empty string: it would pick a partition at
    /// random, not the aggregate's.
    #[error("event {event_id}: the aggregate id is empty; every event needs the id of its aggregate (the message key)")]
    EmptyAggregateId {
        /// The event id.
        event_id: String,
    },
    /// A text payload that is not JSON, with a format that needs JSON.
    #[error("event {event_id}: payload is not valid JSON: {reason}")]
    PayloadNotJson {
        /// The event id.
        event_id: String,
        /// The parser's message.
        reason: String,
    },
    /// The headers column is not a JSON object.
    #[error("event {event_id}: headers column is not a JSON object")]
    HeadersNotObject {
        /// The event id.
        event_id: String,
    },
    /// The headers column names a header walbox sets itself.
    #[error("event {event_id}: headers column sets {name:?}, a header walbox sets itself; rename it in the row")]
    ReservedHeader {
        /// The event id.
        event_id: String,
        /// The header name.
        name: String,
    },
    /// A logical decoding message with the events' prefix that is not an
    /// event envelope walbox can read.
    #[error("event message at {lsn}: {reason}")]
    Envelope {
        /// The message's WAL position.
        lsn: String,
        /// What is wrong, and for a known event, its id.
        reason: String,
    },
    /// The timestamp column could not be read.
    #[error("event {event_id}: timestamp {value:?} is not a Postgres timestamp")]
    BadTimestamp {
        /// The event id.
        event_id: String,
        /// The text.
        value: String,
    },
    /// Two `[mapping.tables]` patterns match one table.
    #[error("table {table} matches mapping.tables {first:?} and {second:?}: name the table itself as a key of its own, or narrow a pattern")]
    AmbiguousMapping {
        /// `schema.table`.
        table: String,
        /// One key.
        first: String,
        /// Another.
        second: String,
    },
    /// The template produced a name Kafka does not accept.
    #[error("event {event_id}: topic {topic:?} is not a valid Kafka topic name (letters, digits, '.', '_', '-'; at most 249)")]
    InvalidTopic {
        /// The event id.
        event_id: String,
        /// The topic name.
        topic: String,
    },
}

/// Column positions of one relation, resolved from its Relation message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnIndexes {
    /// `schema.table`, as the Relation message named it.
    table: String,
    /// The position of the table's own mapping in [`OutboxMapping::tables`];
    /// `None` for the base mapping.
    mapping: Option<usize>,
    /// The topic template with the table's `{schema}` and `{table}`
    /// filled in, when it names them.
    topic_template: Option<Box<str>>,
    /// The number of columns the Relation message declared.
    width: usize,
    id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: Option<usize>,
    payload: usize,
    payload_kind: PayloadKind,
    headers: Option<usize>,
    timestamp: Option<usize>,
    header_columns: Vec<(usize, String)>,
}

impl ColumnIndexes {
    /// The payload column's position.
    pub fn payload_index(&self) -> usize {
        self.payload
    }

    /// A tuple must have exactly the columns its Relation declared: any
    /// other count means the positions do not describe it.
    pub fn check_width(&self, tuple: &TupleData) -> Result<(), ColumnCountMismatch> {
        if tuple.len() == self.width {
            return Ok(());
        }
        Err(ColumnCountMismatch {
            table: self.table.clone(),
            tuple: tuple.len(),
            relation: self.width,
        })
    }
}

/// Topic names by aggregate type, each made from the template and checked
/// once and then shared by every record of that type (a mapped row then
/// allocates no topic name).
#[derive(Debug, Default)]
pub struct Topics {
    names: HashMap<Box<str>, Arc<str>>,
    /// By table, for a template that names it: the template filled in with
    /// the table, then the names by aggregate type.
    by_table: HashMap<Box<str>, HashMap<Box<str>, Arc<str>>>,
    /// How many names `by_table` holds.
    by_table_names: usize,
}

/// At most this many topic names are kept; past it the cache starts over (a
/// template fed by arbitrary values must not grow memory).
const MAX_TOPICS: usize = 10_000;

impl Topics {
    /// The topic for `aggregate_type`; `Err` with the name when it is not a
    /// valid Kafka topic name (not kept).
    fn get(
        &mut self,
        mapping: &OutboxMapping,
        template: Option<&str>,
        aggregate_type: &str,
    ) -> Result<Arc<str>, String> {
        let known = match template {
            None => self.names.get(aggregate_type),
            Some(t) => self.by_table.get(t).and_then(|n| n.get(aggregate_type)),
        };
        if let Some(name) = known {
            return Ok(Arc::clone(name));
        }
        let name = mapping.topic_for(template, aggregate_type);
        if !is_valid_topic(&name) {
            return Err(name);
        }
        let name: Arc<str> = name.into();
        match template {
            None => {
                if self.names.len() >= MAX_TOPICS {
                    self.names.clear();
                }
                self.names.insert(aggregate_type.into(), Arc::clone(&name));
            }
            Some(t) => {
                if self.by_table_names >= MAX_TOPICS {
                    self.by_table.clear();
                    self.by_table_names = 0;
                }
                self.by_table
                    .entry(t.into())
                    .or_default()
                    .insert(aggregate_type.into(), Arc::clone(&name));
                self.by_table_names += 1;
            }
        }
        Ok(name)
    }
}

/// The topic template's placeholders.
pub const TEMPLATE_PLACEHOLDERS: [&str; 3] = ["{aggregate_type}", "{schema}", "{table}"];

/// Whether a topic template names the row's table (`{schema}`, `{table}`).
pub fn names_table(template: &str) -> bool {
    template.contains("{schema}") || template.contains("{table}")
}

/// A mapped row, ready to become a [`sink_core::Record`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MappedEvent {
    /// Destination topic.
    pub topic: Arc<str>,
    /// Message key: the aggregate id.
    pub key: Bytes,
    /// Message value: the payload, `None` when NULL.
    pub value: Option<Bytes>,
    /// Headers, `id` first.
    pub headers: Vec<Header>,
    /// Message timestamp (ms since the Unix epoch).
    pub timestamp_ms: Option<i64>,
    /// The event id (for logs and errors).
    pub event_id: String,
    /// The aggregate id (for logs).
    pub aggregate_id: String,
}

impl MappedEvent {
    /// The record of this event, carrying `token` to its delivery report.
    pub fn into_record<T>(self, token: T) -> sink_core::Record<T> {
        sink_core::Record {
            topic: self.topic,
            key: Some(self.key),
            value: self.value,
            headers: self.headers,
            timestamp_ms: self.timestamp_ms,
            origin: None,
            token,
        }
    }

    /// The value of the header `name`, if the record has one.
    pub fn header(&self, name: &str) -> Option<&Bytes> {
        self.headers
            .iter()
            .find(|h| h.name == name)
            .map(|h| &h.value)
    }
}

/// The header that carries the event id, on every record walbox writes:
/// the consumers' dedup key (and what `walbox audit` matches rows by).
pub const ID_HEADER: &str = "id";
/// The header that carries the event type, when the mapping has one.
pub const EVENT_TYPE_HEADER: &str = "event_type";

/// The header W3C Trace Context names (kept from the row's headers, and
/// continued by walbox's span of the event).
pub const TRACEPARENT: &str = "traceparent";
/// Its vendor-specific companion.
pub const TRACESTATE: &str = "tracestate";

/// Tables up to this wide are mapped without allocating.
const MAX_COLUMNS_ON_STACK: usize = 32;

fn is_valid_topic(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 249
        && t != "."
        && t != ".."
        && t.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl OutboxMapping {
    /// The column names of a Debezium EventRouter outbox:
    /// `id, aggregatetype, aggregateid, type, payload`, topic `outbox.event.{aggregate_type}`.
    pub fn debezium() -> Self {
        OutboxMapping {
            id: "id".into(),
            aggregate_type: "aggregatetype".into(),
            aggregate_id: "aggregateid".into(),
            event_type: Some("type".into()),
            payload: "payload".into(),
            headers: None,
            timestamp: None,
            topic_template: "outbox.event.{aggregate_type}".into(),
            header_columns: Vec::new(),
            format: EventFormat::AsStored,
            tables: Vec::new(),
        }
    }

    /// The mapping of table `schema.name`: the mapping of the
    /// `[mapping.tables]` key that names it, else of the one pattern that
    /// matches it, else this one; `None` (with this mapping's position
    /// unused) stands for this one. Two patterns matching it is an error.
    fn pick(&self, schema: &str, name: &str) -> Result<Option<usize>, MapError> {
        let named = |t: &TableMapping| {
            t.tables
                .named()
                .any(|e| e.schema() == schema && e.name() == name)
        };
        if let Some(i) = self.tables.iter().position(named) {
            return Ok(Some(i));
        }
        let mut matching = self
            .tables
            .iter()
            .enumerate()
            .filter(|(_, t)| t.tables.matches(schema, name));
        let Some((first, t)) = matching.next() else {
            return Ok(None);
        };
        if let Some((_, other)) = matching.next() {
            return Err(MapError::AmbiguousMapping {
                table: TableName::new(schema, name).to_string(),
                first: t.key.clone(),
                second: other.key.clone(),
            });
        }
        Ok(Some(first))
    }

    /// The mapping of table `schema.name` ([`OutboxMapping::tables`]).
    pub fn for_table(&self, schema: &str, name: &str) -> Result<&OutboxMapping, MapError> {
        Ok(self.at(self.pick(schema, name)?))
    }

    /// The mapping at a position [`OutboxMapping::pick`] gave.
    fn at(&self, i: Option<usize>) -> &OutboxMapping {
        i.map_or(self, |i| &self.tables[i].mapping)
    }

    /// Refuses a payload column of type `declared` (a domain resolved by
    /// `domains`) that this mapping cannot publish; else says what it holds.
    fn payload_kind(
        &self,
        table: &str,
        declared: u32,
        domains: &HashMap<u32, u32>,
    ) -> Result<PayloadKind, MapError> {
        let type_oid = domains.get(&declared).copied().unwrap_or(declared);
        match type_oid {
            JSON | JSONB => Ok(PayloadKind::Json),
            TEXT | VARCHAR => Ok(PayloadKind::Text),
            BYTEA if self.format.needs_json() => Err(MapError::BinaryPayload {
                table: table.to_owned(),
                column: self.payload.clone(),
                format: self.format.name(),
            }),
            BYTEA => Ok(PayloadKind::Bytes),
            _ => Err(MapError::PayloadType {
                table: table.to_owned(),
                column: self.payload.clone(),
                type_oid: declared,
            }),
        }
    }

    /// Every column the mapping reads (for preflight checks).
    pub fn required_columns(&self) -> Vec<&str> {
        let mut cols = vec![
            self.id.as_str(),
            self.aggregate_type.as_str(),
            self.aggregate_id.as_str(),
            self.payload.as_str(),
        ];
        cols.extend(self.event_type.as_deref());
        cols.extend(self.headers.as_deref());
        cols.extend(self.timestamp.as_deref());
        cols.extend(self.header_columns.iter().map(|(c, _)| c.as_str()));
        cols
    }

    /// Finds the mapped columns in a relation.
    pub fn resolve(&self, relation: &RelationBody) -> Result<ColumnIndexes, MapError> {
        self.resolve_with(relation, &HashMap::new())
    }

    /// Finds the mapped columns in a relation whose columns may have domain
    /// types: `domains` maps a domain's type OID to its base type's. The
    /// relation's table maps by its own mapping when it has one
    /// ([`OutboxMapping::tables`]).
    pub fn resolve_with(
        &self,
        relation: &RelationBody,
        domains: &HashMap<u32, u32>,
    ) -> Result<ColumnIndexes, MapError> {
        let own = self.pick(relation.namespace(), relation.name())?;
        let mut columns = self.at(own).resolve_own(relation, domains)?;
        columns.mapping = own;
        // A table's own template that names no table still differs from
        // the base one: its topic names are kept under it.
        if own.is_some()
            && columns.topic_template.is_none()
            && self.at(own).topic_template != self.topic_template
        {
            columns.topic_template = Some(self.at(own).topic_template.as_str().into());
        }
        Ok(columns)
    }

    /// [`OutboxMapping::resolve_with`] by this mapping's own columns.
    fn resolve_own(
        &self,
        relation: &RelationBody,
        domains: &HashMap<u32, u32>,
    ) -> Result<ColumnIndexes, MapError> {
        let table = format!("{}.{}", relation.namespace(), relation.name());
        let find = |column: &str, role: &'static str| {
            relation
                .column_index(column)
                .ok_or_else(|| MapError::MissingColumn {
                    table: table.clone(),
                    column: column.to_owned(),
                    role,
                })
        };
        let find_opt =
            |column: &Option<String>, role| column.as_deref().map(|c| find(c, role)).transpose();
        let payload = find(&self.payload, "payload")?;
        let declared = relation.columns()[payload].type_oid();
        let payload_kind = self.payload_kind(&table, declared, domains)?;
        Ok(ColumnIndexes {
            mapping: None,
            topic_template: names_table(&self.topic_template).then(|| {
                self.topic_template
                    .replace("{schema}", relation.namespace())
                    .replace("{table}", relation.name())
                    .into()
            }),
            width: relation.columns().len(),
            id: find(&self.id, "event id")?,
            aggregate_type: find(&self.aggregate_type, "aggregate type")?,
            aggregate_id: find(&self.aggregate_id, "aggregate id")?,
            event_type: find_opt(&self.event_type, "event type")?,
            payload,
            payload_kind,
            headers: find_opt(&self.headers, "headers")?,
            timestamp: find_opt(&self.timestamp, "timestamp")?,
            header_columns: self
                .header_columns
                .iter()
                .map(|(c, h)| Ok((find(c, "extra header")?, h.clone())))
                .collect::<Result<_, MapError>>()?,
            table,
        })
    }

    /// The topic a row is meant for, if its aggregate type is set (for
    /// labelling a row that cannot be mapped; the name may be invalid).
    pub fn topic_of(&self, columns: &ColumnIndexes, tuple: &TupleData) -> Option<String> {
        let aggregate_type = tuple.iter().nth(columns.aggregate_type)?;
        Some(self.topic_for(columns.topic_template.as_deref(), aggregate_type.as_str()?))
    }

    /// The topic of an event with `aggregate_type`: the template (the
    /// table's, when given) filled in (unchecked).
    fn topic_for(&self, template: Option<&str>, aggregate_type: &str) -> String {
        template
            .unwrap_or(&self.topic_template)
            .replace("{aggregate_type}", aggregate_type)
    }

    /// A row's record key (its aggregate id, in the format's key), if set.
    pub fn key_of(&self, columns: &ColumnIndexes, tuple: &TupleData) -> Option<Bytes> {
        let aggregate_id = tuple.iter().nth(columns.aggregate_id)?.as_str()?;
        Some(self.format.key_of(aggregate_id))
    }

    /// A row's event id, if set.
    pub fn event_id_of(&self, columns: &ColumnIndexes, tuple: &TupleData) -> Option<String> {
        tuple
            .iter()
            .nth(columns.id)
            .and_then(|c| c.as_str().map(str::to_owned))
    }

    /// Maps one inserted row. The payload is a slice of the replication frame.
    pub fn map(&self, columns: &ColumnIndexes, tuple: &TupleData) -> Result<MappedEvent, MapError> {
        self.map_with(columns, tuple, &mut Topics::default())
    }

    /// [`OutboxMapping::map`], with topic names kept in `topics` from one
    /// row to the next; by the mapping `columns` were resolved by (its
    /// table's own, or this one).
    pub fn map_with(
        &self,
        columns: &ColumnIndexes,
        tuple: &TupleData,
        topics: &mut Topics,
    ) -> Result<MappedEvent, MapError> {
        self.at(columns.mapping).map_own(columns, tuple, topics)
    }

    /// [`OutboxMapping::map_with`] by this mapping's own column names.
    fn map_own(
        &self,
        columns: &ColumnIndexes,
        tuple: &TupleData,
        topics: &mut Topics,
    ) -> Result<MappedEvent, MapError> {
        // One pass over the tuple, into a stack array when the table is
        // not wide (no allocation).
        let mut stack = [None; MAX_COLUMNS_ON_STACK];
        let heap: Vec<Option<Column<'_>>>;
        let values: &[Option<Column<'_>>] = if tuple.len() <= MAX_COLUMNS_ON_STACK {
            for (slot, column) in stack.iter_mut().zip(tuple.iter()) {
                *slot = Some(column);
            }
            &stack
        } else {
            heap = tuple.iter().map(Some).collect();
            &heap
        };
        let text = |i: usize| values.get(i).copied().flatten().and_then(|c| c.as_str());
        let id = text(columns.id);
        let required = |i: usize, column: &str, role: &'static str| {
            text(i).ok_or_else(|| MapError::NullColumn {
                event_id: id.unwrap_or("<unknown>").to_owned(),
                column: column.to_owned(),
                role,
            })
        };
        let id = required(columns.id, &self.id, "event id")?.to_owned();
        let aggregate_type = required(
            columns.aggregate_type,
            &self.aggregate_type,
            "aggregate type",
        )?;
        let aggregate_id = required(columns.aggregate_id, &self.aggregate_id, "aggregate id")?;
        let value = match (tuple.value_bytes(columns.payload), columns.payload_kind) {
            (Some(text), PayloadKind::Bytes) => match bytea::decode(&text) {
                Ok(bytes) => Some(Bytes::from(bytes)),
                Err(e) => {
                    return Err(MapError::PayloadNotBytea {
                        event_id: id,
                        reason: e.to_string(),
                    })
                }
            },
            (value, _) => value,
        };
        self.event(
            Fields {
                template: columns.topic_template.as_deref(),
                id,
                aggregate_type,
                aggregate_id,
                event_type: columns.event_type.and_then(text),
                value,
                value_unchecked: columns.payload_kind == PayloadKind::Text
                    && self.format.needs_json(),
                extra_headers: columns
                    .header_columns
                    .iter()
                    .filter_map(|(i, name)| Some((name.as_str(), text(*i)?)))
                    .collect(),
                headers_json: columns.headers.and_then(text),
                timestamp: columns.timestamp.and_then(text),
            },
            topics,
        )
    }

    /// Builds the record of an event, whichever source its fields came from:
    /// the topic, the key, the value, the headers, the timestamp, in
    /// [`OutboxMapping::format`].
    pub(crate) fn event(
        &self,
        f: Fields<'_>,
        topics: &mut Topics,
    ) -> Result<MappedEvent, MapError> {
        let f_template = f.template;
        let Fields {
            template: _,
            id,
            aggregate_type,
            aggregate_id,
            event_type,
            value,
            value_unchecked,
            extra_headers,
            headers_json,
            timestamp,
        } = f;
        if aggregate_id.is_empty() {
            return Err(MapError::EmptyAggregateId { event_id: id });
        }
        let topic = match topics.get(self, f_template, aggregate_type) {
            Ok(topic) => topic,
            Err(topic) => {
                return Err(MapError::InvalidTopic {
                    event_id: id,
                    topic,
                })
            }
        };
        if let (Some(v), true) = (&value, value_unchecked) {
            if let Err(e) = serde_json::from_slice::<serde::de::IgnoredAny>(v) {
                return Err(MapError::PayloadNotJson {
                    event_id: id,
                    reason: e.to_string(),
                });
            }
        }

        let mut headers = Vec::with_capacity(2 + extra_headers.len());
        headers.push(Header {
            name: ID_HEADER.into(),
            value: Bytes::copy_from_slice(id.as_bytes()),
        });
        if let Some(t) = event_type {
            headers.push(Header {
                name: EVENT_TYPE_HEADER.into(),
                value: Bytes::copy_from_slice(t.as_bytes()),
            });
        }
        for (name, v) in extra_headers {
            headers.push(Header {
                name: name.to_owned().into(),
                value: Bytes::copy_from_slice(v.as_bytes()),
            });
        }
        // jsonb's empty object, the common case, needs no parsing.
        if let Some(json) = headers_json.filter(|j| *j != "{}") {
            match serde_json::from_str::<serde_json::Value>(json) {
                Ok(serde_json::Value::Object(map)) => {
                    for (name, v) in map {
                        if name.starts_with("walbox.") || headers.iter().any(|h| h.name == name) {
                            return Err(MapError::ReservedHeader { event_id: id, name });
                        }
                        let value = match v {
                            serde_json::Value::String(s) => Bytes::from(s),
                            other => Bytes::from(other.to_string()),
                        };
                        headers.push(Header {
                            name: name.into(),
                            value,
                        });
                    }
                }
                _ => return Err(MapError::HeadersNotObject { event_id: id }),
            }
        }
        let timestamp_ms = match timestamp {
            None => None,
            Some(t) => Some(parse_timestamp_ms(t).ok_or_else(|| MapError::BadTimestamp {
                event_id: id.clone(),
                value: t.to_owned(),
            })?),
        };
        let mut event = MappedEvent {
            topic,
            key: Bytes::copy_from_slice(aggregate_id.as_bytes()),
            value,
            headers,
            timestamp_ms,
            aggregate_id: aggregate_id.to_owned(),
            event_id: id,
        };
        let attributes = Attributes {
            aggregate_type,
            event_type,
        };
        self.format.apply(&mut event, &attributes);
        Ok(event)
    }
}

/// An event's fields, as a source read them.
pub(crate) struct Fields<'a> {
    /// The topic template with the row's table filled in, if it names it.
    pub(crate) template: Option<&'a str>,
    /// The event id.
    pub(crate) id: String,
    pub(crate) aggregate_type: &'a str,
    pub(crate) aggregate_id: &'a str,
    pub(crate) event_type: Option<&'a str>,
    /// The payload: JSON, unless `value_unchecked`.
    pub(crate) value: Option<Bytes>,
    /// The payload is text that must be checked as JSON.
    pub(crate) value_unchecked: bool,
    /// `(header, value)` pairs.
    pub(crate) extra_headers: Vec<(&'a str, &'a str)>,
    /// A JSON object of headers.
    pub(crate) headers_json: Option<&'a str>,
    /// Postgres or RFC 3339 text.
    pub(crate) timestamp: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_mapping(key: &str, id: &str) -> TableMapping {
        TableMapping {
            key: key.into(),
            tables: OutboxTables::parse(key).unwrap(),
            mapping: OutboxMapping {
                id: id.into(),
                ..OutboxMapping::default()
            },
        }
    }

    #[test]
    fn a_table_named_beats_a_pattern_and_two_patterns_are_ambiguous() {
        let mapping = OutboxMapping {
            tables: vec![
                table_mapping("tenant_*.outbox", "by_pattern"),
                table_mapping("tenant_b.outbox, legacy.outbox", "by_name"),
                table_mapping("*.outbox_v1", "v1"),
                table_mapping("tenant_*.outbox_v*", "v_any"),
            ],
            ..OutboxMapping::default()
        };
        let id = |schema, name| mapping.for_table(schema, name).map(|m| m.id.as_str());
        assert_eq!(id("tenant_a", "outbox"), Ok("by_pattern"));
        assert_eq!(id("tenant_b", "outbox"), Ok("by_name"));
        assert_eq!(id("legacy", "outbox"), Ok("by_name"));
        assert_eq!(
            id("billing", "outbox"),
            Ok("id"),
            "no key: the base mapping"
        );
        assert_eq!(id("billing", "outbox_v1"), Ok("v1"));
        let e = id("tenant_a", "outbox_v1").unwrap_err().to_string();
        assert_eq!(
            e,
            "table \"tenant_a\".\"outbox_v1\" matches mapping.tables \"*.outbox_v1\" and \"tenant_*.outbox_v*\": name the table itself as a key of its own, or narrow a pattern"
        );
        // The relay refuses such a table's Relation, as the start does.
        let relation =
            RelationBody::from_catalog(1, "tenant_a", "outbox_v1", [("id".to_owned(), TEXT)]);
        assert!(matches!(
            mapping.resolve(&relation),
            Err(MapError::AmbiguousMapping { .. })
        ));
    }

    #[test]
    fn validates_topic_names() {
        assert!(is_valid_topic("outbox.event.order"));
        assert!(is_valid_topic("a_b-C.9"));
        for bad in [
            "",
            ".",
            "..",
            "outbox.event.my order",
            "outbox/evil",
            &"x".repeat(250),
        ] {
            assert!(!is_valid_topic(bad), "{bad}");
        }
    }
}
