//! Records serialized against a schema registry (`format = "avro"` or
//! `"json-schema"`), stated once:
//!
//! - **The subject** of a record is named by `schema_registry.subject_strategy`
//!   as Confluent's serializers name it: `topic` (TopicNameStrategy,
//!   `<topic>-value`), `record` (RecordNameStrategy: the event type, which
//!   is then the record's full name, e.g. `shop.OrderPlaced`) or
//!   `topic-record` (TopicRecordNameStrategy, `<topic>-<event type>`).
//! - **The schema** is the subject's latest version, registered by the team.
//!   It is looked up once and cached, and looked up again after [`REFRESH`]
//!   so a new version is picked up; at most [`MAX_SUBJECTS`] subjects and
//!   [`MAX_CACHED_BYTES`] of schema text are kept. Or, opted into
//!   (`schema_registry.schemas = "derived"`), walbox derives the subject's
//!   schema from the payloads and registers it ([`derive`]): a new version
//!   only when a payload holds what the last one did not.
//! - **The value** is in Confluent's wire format: magic byte, the schema
//!   id, then the JSON payload resolved against an Avro schema and written
//!   as its datum ([`avro`]), or the JSON payload as stored once it
//!   validated against a JSON Schema ([`json_schema`]). The key (the
//!   aggregate id) and the headers are unchanged; a NULL payload stays a
//!   record without a value.
//! - **A payload that does not fit** its schema is refused for its own
//!   sake ([`SchemaError::Invalid`]): it follows the failure policy, to the
//!   dead-letter topic with Avro's reason in `walbox.error` (kind
//!   `invalid`), or a stop with the slot before it.
//! - **A registry that does not answer** (a connection error, a timeout, a
//!   5xx or 429 answer) is an outage: the session ends and the event is read
//!   again after a backoff, nothing skipped ([`SchemaError::Unavailable`]).
//!   A subject already cached keeps its schema through an outage.
//! - **A registry that refuses** (401, 403, no such subject, a schema that
//!   is not of the format's type) stops walbox with the slot before the
//!   event, in one line ([`SchemaError::Refused`]).

pub mod avro;
mod client;
pub mod derive;
pub mod json_schema;
pub mod protobuf;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use apache_avro::Schema;
use bytes::Bytes;
use sink_core::Record;
use tokio::time::Instant;

use crate::mapping::EVENT_TYPE_HEADER;

pub use client::RegistryClient;

/// How long a subject's schema is used before it is looked up again.
pub const REFRESH: Duration = Duration::from_secs(300);
/// How soon a stale schema is looked up again after the registry failed
/// to answer (it is used meanwhile).
pub const RETRY_STALE: Duration = Duration::from_secs(30);
/// Most subjects cached.
pub const MAX_SUBJECTS: usize = 10_000;
/// Most schema text cached, in bytes.
pub const MAX_CACHED_BYTES: usize = 64 * 1024 * 1024;
/// How long one request to the registry may take.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// How a record's subject is named.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SubjectStrategy {
    /// `<topic>-value`.
    #[default]
    Topic,
    /// The event type (the record's full name).
    Record,
    /// `<topic>-<event type>`.
    TopicRecord,
}

impl SubjectStrategy {
    /// The subject of a record on `topic` of `event_type`; the error says
    /// why there is none.
    pub fn subject(self, topic: &str, event_type: Option<&str>) -> Result<String, String> {
        let event_type = || {
            match event_type {
            Some(t) if !t.is_empty() => Ok(t),
            _ => Err(format!(
                "the event has no event type, which schema_registry.subject_strategy = {} names its subject by",
                self.name()
            )),
        }
        };
        Ok(match self {
            SubjectStrategy::Topic => format!("{topic}-value"),
            SubjectStrategy::Record => event_type()?.to_owned(),
            SubjectStrategy::TopicRecord => format!("{topic}-{}", event_type()?),
        })
    }

    /// Its name in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            SubjectStrategy::Topic => "topic",
            SubjectStrategy::Record => "record",
            SubjectStrategy::TopicRecord => "topic-record",
        }
    }

    /// Whether subjects are named by the event type.
    pub fn needs_event_type(self) -> bool {
        !matches!(self, SubjectStrategy::Topic)
    }
}

/// Which kind of schema serializes the values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SchemaKind {
    /// Avro (`format = "avro"`).
    #[default]
    Avro,
    /// JSON Schema (`format = "json-schema"`).
    JsonSchema,
    /// Protobuf (`format = "protobuf"`).
    Protobuf,
}

impl SchemaKind {
    /// The registry's `schemaType` for it (Avro's may be absent).
    fn schema_type(self) -> &'static str {
        match self {
            SchemaKind::Avro => "AVRO",
            SchemaKind::JsonSchema => "JSON",
            SchemaKind::Protobuf => "PROTOBUF",
        }
    }

    /// The format that uses it.
    pub fn format(self) -> &'static str {
        match self {
            SchemaKind::Avro => "avro",
            SchemaKind::JsonSchema => "json-schema",
            SchemaKind::Protobuf => "protobuf",
        }
    }
}

/// Where the registry is and how to reach it.
#[derive(Clone, PartialEq, Eq)]
pub struct RegistryConfig {
    /// The base URL of its Confluent-compatible API (Apicurio's is
    /// `…/apis/ccompat/v7`).
    pub url: String,
    /// Basic authentication's user.
    pub username: Option<String>,
    /// Basic authentication's password (never printed).
    pub password: Option<String>,
    /// PEM certificates to trust instead of the system's (https).
    pub ca_file: Option<std::path::PathBuf>,
    /// How subjects are named.
    pub strategy: SubjectStrategy,
    /// Which kind of schema.
    pub kind: SchemaKind,
    /// Serialize the key (the aggregate id) too, with subject `<topic>-key`
    /// (`schema_registry.key = "schema"`); else it stays its text.
    pub keys: bool,
    /// Derive each subject's schema from the payloads and register it
    /// (`schema_registry.schemas = "derived"`), instead of looking up the
    /// one registered.
    pub derive: bool,
}

impl std::fmt::Debug for RegistryConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryConfig")
            .field("url", &sink_kafka::redact_userinfo(&self.url))
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("ca_file", &self.ca_file)
            .field("strategy", &self.strategy)
            .field("kind", &self.kind)
            .field("keys", &self.keys)
            .field("derive", &self.derive)
            .finish()
    }
}

/// Why a record could not be serialized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SchemaError {
    /// The registry did not answer: a new session tries again.
    #[error("schema registry: looking up subject {subject:?} failed: {detail}; nothing is skipped, trying again")]
    Unavailable {
        /// The subject looked up.
        subject: String,
        /// What happened.
        detail: String,
    },
    /// The registry refused, or has no usable schema: walbox stops with
    /// the slot before the event.
    #[error("schema registry: subject {subject:?}: {detail}; the slot stays before this event")]
    Refused {
        /// The subject looked up.
        subject: String,
        /// What happened, with what to do.
        detail: String,
    },
    /// The event's payload does not fit its subject's schema: it follows
    /// the failure policy.
    #[error("event {event_id} does not match {what}: {detail}")]
    Invalid {
        /// The event id.
        event_id: String,
        /// The schema (`schema 3 of subject "orders-value"`) or what named
        /// no subject.
        what: String,
        /// Why.
        detail: String,
    },
    /// The client cannot be set up from the configuration.
    #[error("schema registry: {0}")]
    Setup(String),
}

impl SchemaError {
    /// True when a new session may succeed.
    pub fn is_transient(&self) -> bool {
        matches!(self, SchemaError::Unavailable { .. })
    }
}

/// A schema, ready to serialize with.
#[derive(Debug)]
pub enum Compiled {
    /// An Avro schema.
    Avro(Schema),
    /// A JSON Schema's validator.
    Json(jsonschema::Validator),
    /// A `.proto` file's messages.
    Protobuf(protobuf::ProtoFile),
}

/// A subject's schema as the registry gave it.
#[derive(Clone, Debug)]
pub struct Registered {
    /// The schema id, written into every record.
    pub id: u32,
    /// The parsed schema.
    pub schema: Arc<Compiled>,
    /// The size of its text (the cache's bound).
    pub text_len: usize,
}

impl Registered {
    /// `payload` (JSON) of an event of `event_type` in the wire format
    /// with this schema; the error is why it does not fit.
    pub fn encode(&self, event_type: Option<&str>, payload: &[u8]) -> Result<Vec<u8>, String> {
        // The libraries are not ours to audit for panics on odd inputs
        // (apache-avro unwraps a decimal's bytes, for one): an event must
        // never take walbox down, so a panic is this event's refusal.
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &*self.schema {
            Compiled::Avro(schema) => avro::encode(schema, self.id, payload),
            Compiled::Json(validator) => json_schema::encode(validator, self.id, payload),
            Compiled::Protobuf(file) => protobuf::encode(file, self.id, event_type, payload),
        }))
        .unwrap_or_else(|_| Err("the serializer failed on this payload".to_owned()))
    }
}

struct Cached {
    registered: Registered,
    fetched: Instant,
}

/// The subjects looked up, bounded.
#[derive(Default)]
struct Cache {
    subjects: HashMap<String, Cached>,
    bytes: usize,
}

impl Cache {
    fn insert(&mut self, subject: &str, registered: Registered, now: Instant) {
        if let Some(old) = self.subjects.remove(subject) {
            self.bytes -= old.registered.text_len;
        }
        while !self.subjects.is_empty()
            && (self.subjects.len() >= MAX_SUBJECTS
                || self.bytes + registered.text_len > MAX_CACHED_BYTES)
        {
            let oldest = self
                .subjects
                .iter()
                .min_by_key(|(_, c)| c.fetched)
                .map(|(s, _)| s.clone())
                .expect("not empty");
            let gone = self.subjects.remove(&oldest).expect("present");
            self.bytes -= gone.registered.text_len;
        }
        self.bytes += registered.text_len;
        self.subjects.insert(
            subject.to_owned(),
            Cached {
                registered,
                fetched: now,
            },
        );
    }
}

/// Where schemas are looked up: the registry's API, or (in tests) a map.
#[derive(Clone)]
enum Lookup {
    Http(RegistryClient),
    #[cfg(test)]
    Memory(Arc<Mutex<Memory>>),
}

/// An in-memory registry for the relay's tests: subject → (id, schema).
#[cfg(test)]
#[derive(Default)]
pub struct Memory {
    /// The subjects' latest schemas.
    pub subjects: HashMap<String, (u32, String)>,
    /// Lookups fail as an outage.
    pub down: bool,
    /// Lookups made.
    pub lookups: usize,
    /// Every registration: subject, schema; its id is its place + 100
    /// (the same schema again under a subject: the id it had).
    pub registered: Vec<(String, String)>,
}

#[cfg(test)]
impl Memory {
    /// An outage when `down`, as the HTTP client reports one.
    fn answer(&self, subject: &str) -> Result<(), SchemaError> {
        match self.down {
            true => Err(SchemaError::Unavailable {
                subject: subject.to_owned(),
                detail: "connection refused".into(),
            }),
            false => Ok(()),
        }
    }
}

/// A subject whose schema walbox derives: what its payloads held, and the
/// schema registered for that.
struct DerivedSubject {
    shape: derive::Shape,
    registered: Registered,
    used: Instant,
}

/// The subjects whose schemas walbox derives, at most [`MAX_SUBJECTS`]
/// (one forgotten is continued from the registry's latest version).
#[derive(Default)]
struct Derived {
    subjects: HashMap<String, DerivedSubject>,
}

/// Serializes records against the registry, with the subjects' schemas
/// cached (see the module's documentation).
#[derive(Clone)]
pub struct SchemaRegistry {
    strategy: SubjectStrategy,
    kind: SchemaKind,
    /// See [`RegistryConfig::keys`].
    keys: bool,
    /// See [`RegistryConfig::derive`].
    derive: bool,
    lookup: Lookup,
    cache: Arc<Mutex<Cache>>,
    derived: Arc<Mutex<Derived>>,
}

impl std::fmt::Debug for SchemaRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SchemaRegistry")
            .field("strategy", &self.strategy)
            .finish_non_exhaustive()
    }
}

impl SchemaRegistry {
    /// A client of the configured registry.
    pub fn new(config: &RegistryConfig) -> Result<SchemaRegistry, SchemaError> {
        Ok(SchemaRegistry {
            strategy: config.strategy,
            kind: config.kind,
            keys: config.keys,
            derive: config.derive,
            lookup: Lookup::Http(RegistryClient::new(config)?),
            cache: Arc::default(),
            derived: Arc::default(),
        })
    }

    /// One on an in-memory registry, for tests.
    #[cfg(test)]
    pub fn in_memory(
        strategy: SubjectStrategy,
        kind: SchemaKind,
        memory: Arc<Mutex<Memory>>,
    ) -> SchemaRegistry {
        SchemaRegistry {
            strategy,
            kind,
            keys: false,
            derive: false,
            lookup: Lookup::Memory(memory),
            cache: Arc::default(),
            derived: Arc::default(),
        }
    }

    /// This registry deriving schemas ([`RegistryConfig::derive`]), for tests.
    #[cfg(test)]
    pub fn deriving(self) -> SchemaRegistry {
        SchemaRegistry {
            derive: true,
            ..self
        }
    }

    /// This registry serializing keys too ([`RegistryConfig::keys`]), for tests.
    #[cfg(test)]
    pub fn with_keys(self) -> SchemaRegistry {
        SchemaRegistry { keys: true, ..self }
    }

    /// Rewrites `record`'s JSON value in the wire format with its
    /// subject's schema, and its key with subject `<topic>-key`'s when keys
    /// are serialized too; returns the value's schema id (`None` for a
    /// record without a value). On an error the record is left as it was.
    pub async fn encode<T>(&self, record: &mut Record<T>) -> Result<Option<u32>, SchemaError> {
        let event_id = header(record, crate::mapping::ID_HEADER).unwrap_or("<unknown>");
        let invalid = |what: String, detail: String| SchemaError::Invalid {
            event_id: event_id.to_owned(),
            what,
            detail,
        };
        let value = match record.value.as_ref() {
            None => None,
            Some(payload) => {
                let event_type = header(record, EVENT_TYPE_HEADER);
                let subject = self
                    .strategy
                    .subject(&record.topic, event_type)
                    .map_err(|detail| invalid("any subject".into(), detail))?;
                let registered = match self.derive {
                    true => self.derived(&subject, payload).await?.map_err(|detail| {
                        invalid(
                            format!("the schema derived for subject {subject:?}"),
                            detail,
                        )
                    })?,
                    false => self.schema(&subject).await?,
                };
                let value = registered.encode(event_type, payload).map_err(|detail| {
                    invalid(
                        format!("schema {} of subject {subject:?}", registered.id),
                        detail,
                    )
                })?;
                Some((registered.id, value))
            }
        };
        let key = match record.key.as_ref().filter(|_| self.keys) {
            None => None,
            Some(key) => {
                let subject = format!("{}-key", record.topic);
                let registered = match self.derive {
                    true => self.derived_key(&subject).await?,
                    false => self.schema(&subject).await?,
                };
                let what = || format!("key schema {} of subject {subject:?}", registered.id);
                let text = std::str::from_utf8(key)
                    .map_err(|_| invalid(what(), "the key (aggregate id) is not text".into()))?;
                let json = serde_json::to_vec(text).expect("a string serializes");
                let key = registered
                    .encode(None, &json)
                    .map_err(|detail| invalid(what(), detail))?;
                Some(key)
            }
        };
        if let Some(key) = key {
            record.key = Some(Bytes::from(key));
        }
        Ok(value.map(|(id, value)| {
            record.value = Some(Bytes::from(value));
            id
        }))
    }

    /// The schema of `subject`: cached, or looked up.
    pub async fn schema(&self, subject: &str) -> Result<Registered, SchemaError> {
        let now = Instant::now();
        let stale = {
            let cache = self.cache.lock().expect("not poisoned");
            match cache.subjects.get(subject) {
                Some(c) if now.duration_since(c.fetched) < REFRESH => {
                    return Ok(c.registered.clone())
                }
                Some(c) => Some(c.registered.clone()),
                None => None,
            }
        };
        match (self.fetch(subject).await, stale) {
            (Ok(registered), _) => {
                let mut cache = self.cache.lock().expect("not poisoned");
                cache.insert(subject, registered.clone(), Instant::now());
                Ok(registered)
            }
            (Err(e), Some(stale)) if e.is_transient() => {
                tracing::warn!(error = %e, schema_id = stale.id, "using the cached schema meanwhile");
                let mut cache = self.cache.lock().expect("not poisoned");
                let retry_at = Instant::now()
                    .checked_sub(REFRESH - RETRY_STALE)
                    .unwrap_or_else(Instant::now);
                cache.insert(subject, stale.clone(), retry_at);
                Ok(stale)
            }
            (Err(e), _) => Err(e),
        }
    }

    /// The schema derived for `subject` that fits `payload`: the one
    /// registered last when it does; else, the subject's shape widened to
    /// the payload's, registered. The inner error is why the payload has no
    /// derived schema (the event is invalid).
    async fn derived(
        &self,
        subject: &str,
        payload: &[u8],
    ) -> Result<Result<Registered, String>, SchemaError> {
        let json: serde_json::Value = match serde_json::from_slice(payload) {
            Ok(json) => json,
            Err(e) => return Ok(Err(format!("the payload is not JSON: {e}"))),
        };
        let shape = match derive::Shape::of(&json) {
            Ok(shape) => shape,
            Err(e) => return Ok(Err(e)),
        };
        let known = {
            let mut derived = self.derived.lock().expect("not poisoned");
            match derived.subjects.get_mut(subject) {
                Some(s) if s.shape.holds(&shape) => {
                    s.used = Instant::now();
                    return Ok(Ok(s.registered.clone()));
                }
                Some(s) => Some((s.shape.clone(), s.registered.id)),
                None => None,
            }
        };
        let (mut grown, last_id) = match known {
            Some((shape, id)) => (shape, Some(id)),
            None => (self.derived_so_far(subject).await?, None),
        };
        grown.merge(&shape);
        if grown.size() > derive::MAX_FIELDS {
            return Ok(Err(format!(
                "the schema would hold more than {} fields (payloads whose keys are data, such as {{\"sku-123\": 2}}, need a registered schema with a map)",
                derive::MAX_FIELDS
            )));
        }
        let text = match self.kind {
            SchemaKind::JsonSchema => grown.json_schema(),
            SchemaKind::Avro => match grown.avro_schema(&derive::avro_record_name(subject)) {
                Ok(text) => text,
                Err(e) => return Ok(Err(e)),
            },
            SchemaKind::Protobuf => {
                return Err(SchemaError::Setup(
                    "Protobuf schemas are not derived".into(),
                ))
            }
        };
        let id = self.register(subject, &text).await?;
        let registered = match self.compile(subject, id, &text) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e.to_string())),
        };
        if last_id != Some(id) {
            tracing::info!(
                subject,
                schema_id = id,
                fields = grown.size(),
                "registered the schema derived from the payloads"
            );
        }
        self.remember(subject, grown, &registered);
        Ok(Ok(registered))
    }

    /// Keeps `subject`'s shape and schema, forgetting the least recently
    /// used subject when [`MAX_SUBJECTS`] are kept.
    fn remember(&self, subject: &str, shape: derive::Shape, registered: &Registered) {
        let mut derived = self.derived.lock().expect("not poisoned");
        if derived.subjects.len() >= MAX_SUBJECTS && !derived.subjects.contains_key(subject) {
            let oldest = derived
                .subjects
                .iter()
                .min_by_key(|(_, s)| s.used)
                .map(|(k, _)| k.clone())
                .expect("not empty");
            derived.subjects.remove(&oldest);
        }
        derived.subjects.insert(
            subject.to_owned(),
            DerivedSubject {
                shape,
                registered: registered.clone(),
                used: Instant::now(),
            },
        );
    }

    /// What the payloads of `subject` held before this process, from its
    /// latest schema: one walbox derived is continued; none is a start;
    /// one someone else registered is refused (walbox registers over no
    /// one's schema).
    async fn derived_so_far(&self, subject: &str) -> Result<derive::Shape, SchemaError> {
        let latest = match &self.lookup {
            Lookup::Http(client) => client.latest_if_any(subject).await?,
            #[cfg(test)]
            Lookup::Memory(memory) => {
                let memory = memory.lock().expect("not poisoned");
                memory.answer(subject)?;
                memory
                    .subjects
                    .get(subject)
                    .map(|(id, text)| (*id, text.clone(), None))
            }
        };
        let Some((id, text, _)) = latest else {
            return Ok(derive::Shape::default());
        };
        let shape = match self.kind {
            SchemaKind::JsonSchema => derive::Shape::from_json_schema(&text),
            SchemaKind::Avro => derive::Shape::from_avro_schema(&text),
            SchemaKind::Protobuf => None,
        };
        shape.ok_or_else(|| SchemaError::Refused {
            subject: subject.to_owned(),
            detail: format!(
                "its latest schema (id {id}) was not derived by walbox, and with schema_registry.schemas = \"derived\" walbox registers over no one's schema: use schemas = \"registered\", or another subject"
            ),
        })
    }

    /// The key schema of `subject` (`<topic>-key`) when schemas are
    /// derived: a string, registered once.
    async fn derived_key(&self, subject: &str) -> Result<Registered, SchemaError> {
        if let Some(s) = self
            .derived
            .lock()
            .expect("not poisoned")
            .subjects
            .get(subject)
        {
            return Ok(s.registered.clone());
        }
        let text = match self.kind {
            SchemaKind::Avro => r#""string""#,
            _ => r#"{"type":"string"}"#,
        };
        let id = self.register(subject, text).await?;
        let registered = self.compile(subject, id, text)?;
        self.remember(subject, derive::Shape::default(), &registered);
        Ok(registered)
    }

    /// Registers `text` under `subject`; its id.
    async fn register(&self, subject: &str, text: &str) -> Result<u32, SchemaError> {
        match &self.lookup {
            Lookup::Http(client) => {
                client
                    .register(subject, self.kind.schema_type(), text)
                    .await
            }
            #[cfg(test)]
            Lookup::Memory(memory) => {
                let mut memory = memory.lock().expect("not poisoned");
                memory.answer(subject)?;
                let at = memory
                    .registered
                    .iter()
                    .position(|(s, t)| s == subject && t == text)
                    .unwrap_or_else(|| {
                        memory
                            .registered
                            .push((subject.to_owned(), text.to_owned()));
                        memory.registered.len() - 1
                    });
                let id = 100 + at as u32;
                memory
                    .subjects
                    .insert(subject.to_owned(), (id, text.to_owned()));
                Ok(id)
            }
        }
    }

    async fn fetch(&self, subject: &str) -> Result<Registered, SchemaError> {
        let (id, text, schema_type) =
            match &self.lookup {
                Lookup::Http(client) => client.latest(subject).await?,
                #[cfg(test)]
                Lookup::Memory(memory) => {
                    let mut memory = memory.lock().expect("not poisoned");
                    memory.lookups += 1;
                    memory.answer(subject)?;
                    let (id, text) = memory.subjects.get(subject).cloned().ok_or_else(|| {
                        SchemaError::Refused {
                            subject: subject.to_owned(),
                            detail: "not found".into(),
                        }
                    })?;
                    let schema_type = Some(self.kind.schema_type().to_owned());
                    (id, text, schema_type)
                }
            };
        let wanted = self.kind.schema_type();
        let schema_type = schema_type.as_deref().unwrap_or("AVRO");
        if schema_type != wanted {
            return Err(SchemaError::Refused {
                subject: subject.to_owned(),
                detail: format!(
                    "its latest schema (id {id}) is {schema_type}, and format = \"{}\" needs a {wanted} schema",
                    self.kind.format()
                ),
            });
        }
        self.compile(subject, id, &text)
    }

    /// Schema `id`'s `text`, parsed.
    fn compile(&self, subject: &str, id: u32, text: &str) -> Result<Registered, SchemaError> {
        let wanted = self.kind.schema_type();
        let invalid = |e: String| SchemaError::Refused {
            subject: subject.to_owned(),
            detail: format!("its latest schema (id {id}) is not a valid {wanted} schema: {e}"),
        };
        let schema = match self.kind {
            SchemaKind::Avro => Compiled::Avro(avro::parse(text).map_err(invalid)?),
            SchemaKind::JsonSchema => Compiled::Json(json_schema::compile(text).map_err(invalid)?),
            SchemaKind::Protobuf => Compiled::Protobuf(protobuf::compile(text).map_err(invalid)?),
        };
        Ok(Registered {
            id,
            schema: Arc::new(schema),
            text_len: text.len(),
        })
    }
}

/// A library's error for a header and a log line: one line, at most 1,000
/// bytes (Avro and JSON Schema quote the value they refused).
fn reason(e: impl std::fmt::Display) -> String {
    let line = e
        .to_string()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    crate::error_text::at_most(line, 1000)
}

fn header<'a, T>(record: &'a Record<T>, name: &str) -> Option<&'a str> {
    record
        .headers
        .iter()
        .find(|h| h.name == name)
        .and_then(|h| std::str::from_utf8(&h.value).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA: &str =
        r#"{"type": "record", "name": "R", "fields": [{"name": "a", "type": "int"}]}"#;

    fn registry(subjects: &[(&str, u32)]) -> (SchemaRegistry, Arc<Mutex<Memory>>) {
        let memory = Arc::new(Mutex::new(Memory {
            subjects: subjects
                .iter()
                .map(|(s, id)| (s.to_string(), (*id, SCHEMA.to_owned())))
                .collect(),
            ..Memory::default()
        }));
        (
            SchemaRegistry::in_memory(
                SubjectStrategy::Topic,
                SchemaKind::Avro,
                Arc::clone(&memory),
            ),
            memory,
        )
    }

    #[test]
    fn subjects_are_named_as_confluents_strategies_name_them() {
        use SubjectStrategy::*;
        assert_eq!(Topic.subject("orders", None).unwrap(), "orders-value");
        assert_eq!(
            Record.subject("orders", Some("shop.Placed")).unwrap(),
            "shop.Placed"
        );
        assert_eq!(
            TopicRecord.subject("orders", Some("shop.Placed")).unwrap(),
            "orders-shop.Placed"
        );
        let e = Record.subject("orders", None).unwrap_err();
        assert!(e.contains("no event type"), "{e}");
        assert!(TopicRecord.subject("orders", Some("")).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_schema_is_looked_up_once_and_again_after_the_refresh() {
        let (registry, memory) = registry(&[("t-value", 7)]);
        let mut record = Record::new("t", None, Some(Bytes::from_static(br#"{"a": 5}"#)), ());
        assert_eq!(registry.encode(&mut record).await.unwrap(), Some(7));
        assert_eq!(
            record.value.as_deref().unwrap(),
            &[0, 0, 0, 0, 7, 10][..],
            "magic, id 7, zig-zag 5"
        );
        registry.schema("t-value").await.unwrap();
        assert_eq!(memory.lock().unwrap().lookups, 1);
        tokio::time::advance(REFRESH).await;
        registry.schema("t-value").await.unwrap();
        assert_eq!(memory.lock().unwrap().lookups, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn an_outage_keeps_a_cached_schema_and_stalls_an_uncached_one() {
        let (registry, memory) = registry(&[("t-value", 7), ("u-value", 8)]);
        registry.schema("t-value").await.unwrap();
        memory.lock().unwrap().down = true;
        tokio::time::advance(REFRESH).await;
        assert_eq!(registry.schema("t-value").await.unwrap().id, 7);
        let e = registry.schema("u-value").await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        // The stale one is tried again after RETRY_STALE, not on every event.
        let lookups = memory.lock().unwrap().lookups;
        registry.schema("t-value").await.unwrap();
        assert_eq!(memory.lock().unwrap().lookups, lookups);
        tokio::time::advance(RETRY_STALE).await;
        registry.schema("t-value").await.unwrap();
        assert_eq!(memory.lock().unwrap().lookups, lookups + 1);
    }

    #[tokio::test]
    async fn an_unknown_subject_is_refused_and_a_bad_payload_invalid() {
        let (registry, _) = registry(&[("t-value", 7)]);
        let mut other = Record::new("u", None, Some(Bytes::from_static(b"{}")), ());
        let e = registry.encode(&mut other).await.unwrap_err();
        assert!(matches!(e, SchemaError::Refused { .. }), "{e}");
        let mut bad = Record::new("t", None, Some(Bytes::from_static(br#"{"a": "x"}"#)), ())
            .with_header("id", "e-1");
        let e = registry.encode(&mut bad).await.unwrap_err();
        assert!(
            e.to_string()
                .starts_with("event e-1 does not match schema 7 of subject \"t-value\": "),
            "{e}"
        );
        assert_eq!(
            bad.value.as_deref(),
            Some(&br#"{"a": "x"}"#[..]),
            "untouched"
        );
        let mut null = Record::new("t", None, None, ());
        assert_eq!(registry.encode(&mut null).await.unwrap(), None);
    }

    #[tokio::test]
    async fn keys_are_serialized_with_the_key_subject_as_confluents_serializers_write_them() {
        let memory = Arc::new(Mutex::new(Memory::default()));
        {
            let mut m = memory.lock().unwrap();
            m.subjects.insert("t-value".into(), (7, SCHEMA.into()));
            m.subjects.insert("t-key".into(), (3, r#""string""#.into()));
            m.subjects.insert("r-value".into(), (7, SCHEMA.into()));
            m.subjects.insert("r-key".into(), (4, SCHEMA.into()));
        }
        let avro = SchemaRegistry::in_memory(
            SubjectStrategy::Topic,
            SchemaKind::Avro,
            Arc::clone(&memory),
        )
        .with_keys();
        let mut r = Record::new(
            "t",
            Some(Bytes::from_static(b"agg-1")),
            Some(Bytes::from_static(br#"{"a": 1}"#)),
            (),
        );
        assert_eq!(avro.encode(&mut r).await.unwrap(), Some(7));
        // Magic byte, schema id 3, then the Avro string: zig-zag length 5
        // (0x0a) and the bytes.
        assert_eq!(r.key.as_deref().unwrap(), b"\0\0\0\0\x03\x0aagg-1");
        assert_eq!(r.value.as_deref().unwrap(), b"\0\0\0\0\x07\x02");
        // A key schema that is not a string: the event is invalid, and the
        // record is left as it was (value included).
        let mut bad = Record::new(
            "r",
            Some(Bytes::from_static(b"agg-1")),
            Some(Bytes::from_static(br#"{"a": 1}"#)),
            (),
        )
        .with_header("id", "e-3");
        let e = avro.encode(&mut bad).await.unwrap_err().to_string();
        assert!(
            e.starts_with("event e-3 does not match key schema 4 of subject \"r-key\": "),
            "{e}"
        );
        assert_eq!(bad.key.as_deref(), Some(&b"agg-1"[..]));
        assert_eq!(bad.value.as_deref(), Some(&br#"{"a": 1}"#[..]));
        // No key subject: refused, as a missing value subject is.
        let mut none = Record::new("u", Some(Bytes::from_static(b"k")), None, ());
        memory
            .lock()
            .unwrap()
            .subjects
            .insert("u-value".into(), (7, SCHEMA.into()));
        let e = avro.encode(&mut none).await.unwrap_err();
        assert!(matches!(e, SchemaError::Refused { .. }), "{e}");
        // JSON Schema: the key as a JSON string, quotes included.
        memory
            .lock()
            .unwrap()
            .subjects
            .insert("t-key".into(), (5, r#"{"type": "string"}"#.into()));
        memory
            .lock()
            .unwrap()
            .subjects
            .insert("t-value".into(), (6, r#"{"type": "object"}"#.into()));
        let json =
            SchemaRegistry::in_memory(SubjectStrategy::Topic, SchemaKind::JsonSchema, memory)
                .with_keys();
        let mut r = Record::new("t", Some(Bytes::from_static(b"agg-1")), None, ());
        assert_eq!(json.encode(&mut r).await.unwrap(), None);
        assert_eq!(r.key.as_deref().unwrap(), b"\0\0\0\0\x05\"agg-1\"");
        // Keys stay text unless asked.
        let (plain, _) = registry(&[("t-value", 7), ("t-key", 3)]);
        let mut r = Record::new("t", Some(Bytes::from_static(b"agg-1")), None, ());
        plain.encode(&mut r).await.unwrap();
        assert_eq!(r.key.as_deref().unwrap(), b"agg-1");
    }

    #[tokio::test]
    async fn a_json_schema_validates_and_the_payload_goes_out_as_stored() {
        let memory = Arc::new(Mutex::new(Memory::default()));
        memory.lock().unwrap().subjects.insert(
            "t-value".into(),
            (9, r#"{"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}"#.into()),
        );
        let registry =
            SchemaRegistry::in_memory(SubjectStrategy::Topic, SchemaKind::JsonSchema, memory);
        let mut ok = Record::new("t", None, Some(Bytes::from_static(br#"{"a": 5}"#)), ());
        assert_eq!(registry.encode(&mut ok).await.unwrap(), Some(9));
        assert_eq!(ok.value.as_deref().unwrap(), b"\0\0\0\0\x09{\"a\": 5}");
        let mut bad = Record::new("t", None, Some(Bytes::from_static(br#"{"a": "x"}"#)), ())
            .with_header("id", "e-2");
        let e = registry.encode(&mut bad).await.unwrap_err().to_string();
        assert!(
            e.starts_with("event e-2 does not match schema 9 of subject \"t-value\": ")
                && e.contains("/a"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn a_schema_that_does_not_compile_is_refused() {
        // "record" is an Avro type, no JSON Schema type.
        let memory = Arc::new(Mutex::new(Memory::default()));
        memory
            .lock()
            .unwrap()
            .subjects
            .insert("t-value".into(), (1, r#"{"type": "record"}"#.into()));
        let registry =
            SchemaRegistry::in_memory(SubjectStrategy::Topic, SchemaKind::JsonSchema, memory);
        let e = registry.schema("t-value").await.unwrap_err();
        assert!(matches!(e, SchemaError::Refused { .. }), "{e}");
        assert!(e.to_string().contains("is not a valid JSON schema"), "{e}");
    }

    fn deriving(kind: SchemaKind, memory: &Arc<Mutex<Memory>>) -> SchemaRegistry {
        SchemaRegistry::in_memory(SubjectStrategy::Record, kind, Arc::clone(memory)).deriving()
    }

    fn event(id: &'static str, payload: &str) -> Record<()> {
        Record::new(
            "t",
            Some(Bytes::from_static(b"agg-1")),
            Some(Bytes::from(payload.to_owned())),
            (),
        )
        .with_header("id", id)
        .with_header(EVENT_TYPE_HEADER, "shop.Placed")
    }

    #[tokio::test]
    async fn a_derived_schema_is_registered_once_per_shape_and_only_grows() {
        for kind in [SchemaKind::JsonSchema, SchemaKind::Avro] {
            let memory = Arc::new(Mutex::new(Memory::default()));
            let registry = deriving(kind, &memory);
            let mut first = event("e-1", r#"{"n": 1, "label": "a"}"#);
            assert_eq!(registry.encode(&mut first).await.unwrap(), Some(100));
            let mut same = event("e-2", r#"{"n": 2, "label": "b"}"#);
            assert_eq!(registry.encode(&mut same).await.unwrap(), Some(100));
            let mut fewer = event("e-3", r#"{"n": 3}"#);
            assert_eq!(
                registry.encode(&mut fewer).await.unwrap(),
                Some(100),
                "a field left out fits"
            );
            let mut wider = event("e-4", r#"{"n": 4.5, "note": null}"#);
            assert_eq!(registry.encode(&mut wider).await.unwrap(), Some(101));
            assert_eq!(memory.lock().unwrap().registered.len(), 2);
            // The second version holds every payload so far.
            let latest = memory.lock().unwrap().subjects["shop.Placed"].1.clone();
            let shape = match kind {
                SchemaKind::Avro => derive::Shape::from_avro_schema(&latest),
                _ => derive::Shape::from_json_schema(&latest),
            }
            .unwrap();
            for p in [r#"{"n": 1, "label": "a"}"#, r#"{"n": 4.5, "note": null}"#] {
                let v: serde_json::Value = serde_json::from_str(p).unwrap();
                assert!(
                    shape.holds(&derive::Shape::of(&v).unwrap()),
                    "{p}: {latest}"
                );
            }
            if kind == SchemaKind::JsonSchema {
                assert_eq!(
                    wider.value.as_deref().unwrap(),
                    b"\0\0\0\0\x65{\"n\": 4.5, \"note\": null}"
                );
            }

            // Another process continues the subject's derived schema: the
            // old shapes register nothing new.
            let again = deriving(kind, &memory);
            let mut old = event("e-5", r#"{"n": 5, "label": "c"}"#);
            assert_eq!(again.encode(&mut old).await.unwrap(), Some(101));
            assert_eq!(memory.lock().unwrap().registered.len(), 2);
        }
    }

    #[tokio::test]
    async fn a_subject_someone_else_registered_is_refused_and_an_outage_stalls() {
        let memory = Arc::new(Mutex::new(Memory::default()));
        memory
            .lock()
            .unwrap()
            .subjects
            .insert("shop.Placed".into(), (7, SCHEMA.into()));
        let registry = deriving(SchemaKind::Avro, &memory);
        let mut e = event("e-1", r#"{"a": 1}"#);
        let refused = registry.encode(&mut e).await.unwrap_err();
        assert!(matches!(refused, SchemaError::Refused { .. }), "{refused}");
        assert!(
            refused
                .to_string()
                .contains("its latest schema (id 7) was not derived by walbox"),
            "{refused}"
        );
        assert_eq!(e.value.as_deref(), Some(&br#"{"a": 1}"#[..]), "untouched");
        memory.lock().unwrap().subjects.clear();
        memory.lock().unwrap().down = true;
        let outage = registry.encode(&mut e).await.unwrap_err();
        assert!(outage.is_transient(), "{outage}");
        memory.lock().unwrap().down = false;
        assert_eq!(registry.encode(&mut e).await.unwrap(), Some(100));
    }

    #[tokio::test]
    async fn a_payload_no_schema_can_be_derived_for_is_invalid() {
        let memory = Arc::new(Mutex::new(Memory::default()));
        let avro = deriving(SchemaKind::Avro, &memory);
        let mut dashed = event("e-1", r#"{"order-id": 1}"#);
        let e = avro.encode(&mut dashed).await.unwrap_err().to_string();
        assert!(
            e.starts_with("event e-1 does not match the schema derived for subject \"shop.Placed\": field \"order-id\" is not an Avro name"),
            "{e}"
        );
        let json = deriving(SchemaKind::JsonSchema, &memory);
        let many: serde_json::Map<String, serde_json::Value> = (0..=derive::MAX_FIELDS)
            .map(|i| (format!("sku-{i}"), 1.into()))
            .collect();
        let mut keys_as_data = event("e-2", &serde_json::Value::Object(many).to_string());
        let e = json
            .encode(&mut keys_as_data)
            .await
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 2000 fields"), "{e}");
        let mut not_json = event("e-3", "not json");
        let e = json.encode(&mut not_json).await.unwrap_err();
        assert!(matches!(e, SchemaError::Invalid { .. }), "{e}");
        assert!(memory.lock().unwrap().registered.is_empty());
    }

    #[tokio::test]
    async fn derived_keys_are_a_string_schema_registered_once() {
        let memory = Arc::new(Mutex::new(Memory::default()));
        let registry = deriving(SchemaKind::Avro, &memory).with_keys();
        let mut a = event("e-1", r#"{"n": 1}"#);
        registry.encode(&mut a).await.unwrap();
        let mut b = event("e-2", r#"{"n": 2}"#);
        registry.encode(&mut b).await.unwrap();
        let registered = memory.lock().unwrap().registered.clone();
        assert_eq!(registered.len(), 2, "{registered:?}");
        assert_eq!(
            registered[1],
            ("t-key".to_owned(), r#""string""#.to_owned())
        );
        assert_eq!(b.key.as_deref().unwrap(), b"\0\0\0\0\x65\x0aagg-1");
    }

    #[test]
    fn the_cache_is_bounded_by_count_and_bytes() {
        let now = Instant::now();
        let registered = |len| Registered {
            id: 1,
            schema: Arc::new(Compiled::Avro(Schema::Int)),
            text_len: len,
        };
        let mut cache = Cache::default();
        for i in 0..MAX_SUBJECTS + 10 {
            cache.insert(
                &format!("s{i}"),
                registered(10),
                now + Duration::from_millis(i as u64),
            );
        }
        assert_eq!(cache.subjects.len(), MAX_SUBJECTS);
        assert!(!cache.subjects.contains_key("s0"), "the oldest went first");
        cache.insert(
            "big",
            registered(MAX_CACHED_BYTES),
            now + Duration::from_secs(99),
        );
        assert_eq!(cache.subjects.len(), 1);
        assert_eq!(cache.bytes, MAX_CACHED_BYTES);
    }
}
