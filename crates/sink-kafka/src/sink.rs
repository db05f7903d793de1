//! The producer and its delivery reports.
//!
//! ```text
//! caller ── reserve(size) ──► Permit ── send(permit, record) ──► librdkafka queue ──► broker
//!    ▲                                                                       │
//!    └──── Reports::next() ◄── bounded channel ◄── delivery callback ◄───────┘
//! ```
//!
//! Reports only report: a record the broker refused for good
//! ([`DeliveryErrorKind::Permanent`]) comes back in [`Report::returned`], and
//! what to do with it (halt, or a dead-letter topic) is the caller's policy.
//!
//! # Bounded memory, no deadlock
//!
//! librdkafka frees queue space only after a record's delivery callback has
//! run, so that callback must never wait for the caller. The sink therefore
//! bounds what is in flight itself: [`Sink::reserve`] takes a slot and the
//! record's bytes from two semaphores, and they return only when the caller
//! receives the record's report from [`Reports::next`]. The report channel
//! holds as many reports as there are slots, so the callback always finds
//! room, and the producer queue is sized above the same bounds.
//!
//! `reserve` is cancel-safe (use it in `select!` beside `Reports::next`,
//! reports first); `send` is not, but only waits in the rare case the
//! producer queue is full anyway, and then for deliveries, not on a timer.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DeliveryResult, Producer, ProducerContext, PurgeConfig, ThreadedProducer,
};
use rdkafka::ClientContext;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};

use crate::config::{redact_values, SinkConfig, TopicSpec};
use crate::error::{DeliveryError, DeliveryErrorKind, SinkError};
use crate::problem::{BrokerProblem, ProblemLog, Verdict};
use crate::record::Record;

/// Where a delivered record landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Delivered {
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
}

/// A record's fate.
#[derive(Debug)]
pub struct Report<T> {
    /// The record's token.
    pub token: T,
    /// Where it landed, or why it did not.
    pub result: Result<Delivered, DeliveryError>,
    /// The record itself when the broker refused it for good
    /// ([`DeliveryErrorKind::Permanent`]), so the caller can dead-letter it.
    pub returned: Option<Record<()>>,
}

/// What travels with a record through librdkafka.
struct Pending<T> {
    token: T,
    permits: Permit,
}

/// A delivery callback's result, sent to [`Reports`] with the permits.
struct Raw<T> {
    pending: Pending<T>,
    report: Result<Delivered, DeliveryError>,
    returned: Option<Record<()>>,
}

struct SinkContext<T> {
    tx: mpsc::Sender<Raw<T>>,
    room: Arc<Notify>,
    /// Secret property values, scrubbed from librdkafka's messages.
    secrets: Arc<[String]>,
    /// Connection-level failures, for the startup check and for logging
    /// each one once rather than on every reconnect.
    problems: Arc<ProblemLog>,
    gap: Arc<Gap>,
    movement: Arc<Movement>,
    stats: Arc<crate::stats::StatsCell>,
}

/// When the sink last saw deliveries move: a report, or records starting
/// to wait after none did. See [`Sink::stalled_for`].
struct Movement {
    start: Instant,
    /// Milliseconds since `start`.
    last: AtomicU64,
}

impl Movement {
    fn new() -> Movement {
        Movement {
            start: Instant::now(),
            last: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }

    fn since(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// Whether a record failed for good while the sink is gapless (see
/// [`SinkConfig::gapless`]): from then on nothing more is produced.
struct Gap {
    gapless: bool,
    failed: AtomicBool,
}

impl Gap {
    /// Notes a record's failure.
    fn note(&self, kind: DeliveryErrorKind) {
        if self.gapless
            && matches!(
                kind,
                DeliveryErrorKind::Permanent | DeliveryErrorKind::Fatal
            )
        {
            self.failed.store(true, Ordering::Release);
        }
    }

    /// True when nothing more may be produced.
    fn closed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }
}

impl<T: Send + Sync + 'static> ClientContext for SinkContext<T> {
    fn error(&self, error: KafkaError, reason: &str) {
        let reason = redact_values(reason, &self.secrets);
        let verdict = match error.rdkafka_error_code() {
            Some(code) => self.problems.record(code, &reason),
            None => Verdict::Log(None),
        };
        match verdict {
            Verdict::Quiet => {}
            Verdict::Log(Some(problem)) if problem.kind.is_definite() => {
                tracing::error!(%problem, "Kafka refuses walbox's connection; deliveries wait until this is fixed (nothing is confirmed past them)");
            }
            Verdict::Log(_) => {
                let error = redact_values(&error.to_string(), &self.secrets);
                tracing::warn!(%error, %reason, "kafka client error");
            }
        }
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        self.stats.record(&statistics);
    }

    // librdkafka's own log lines repeat what the error callback reports
    // (above, deduplicated and scrubbed); keep the rest.
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, log_message: &str) {
        if fac == "FAIL" {
            return;
        }
        // walbox sets this one on purpose (see SinkConfig::gapless); the
        // "experimental" warning would greet every start.
        if fac == "CONFWARN" && log_message.contains("enable.gapless.guarantee is experimental") {
            return;
        }
        let line = redact_values(log_message, &self.secrets);
        rdkafka::client::DefaultClientContext.log(level, fac, &line);
    }
}

/// librdkafka's refusal of a configuration, naming the property but never
/// its value (its own message ends with the value).
fn describe_create_error(error: &KafkaError, config: &SinkConfig) -> String {
    let text = match error {
        KafkaError::ClientConfig(_, description, key, _value) => {
            format!("{description} (property {key})")
        }
        other => {
            let text = other.to_string();
            // OpenSSL's words for a key it could not decrypt.
            if text.contains("ssl.key.location") && text.contains("PEM lib") {
                format!("{text} (a wrong ssl.key.password, or a key file that is not PEM)")
            } else {
                text
            }
        }
    };
    config.redact(&text)
}

impl<T: Send + Sync + 'static> ProducerContext for SinkContext<T> {
    type DeliveryOpaque = Box<Pending<T>>;

    fn delivery(&self, result: &DeliveryResult<'_>, pending: Box<Pending<T>>) {
        let raw = match result {
            Ok(m) => Raw {
                pending: *pending,
                report: Ok(Delivered {
                    partition: m.partition(),
                    offset: m.offset(),
                }),
                returned: None,
            },
            Err((e, m)) => {
                let error = DeliveryError::from_kafka(e).with_authorization_hint(m.topic());
                self.gap.note(error.kind);
                // Copied only for the rare permanent refusal.
                let returned = (error.kind == DeliveryErrorKind::Permanent).then(|| Record {
                    topic: m.topic().into(),
                    key: m.key().map(Bytes::copy_from_slice),
                    value: m.payload().map(Bytes::copy_from_slice),
                    headers: m
                        .headers()
                        .map(|hs| {
                            hs.iter()
                                .map(|h| crate::Header {
                                    name: h.key.to_owned().into(),
                                    value: Bytes::copy_from_slice(h.value.unwrap_or_default()),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                    timestamp_ms: m.timestamp().to_millis(),
                    token: (),
                });
                Raw {
                    pending: *pending,
                    report: Err(error),
                    returned,
                }
            }
        };
        self.movement.touch();
        // Never waits: the channel has a place for every record in flight.
        if let Err(mpsc::error::TrySendError::Full(raw)) = self.tx.try_send(raw) {
            let _ = self.tx.blocking_send(raw);
        }
        self.room.notify_waiters();
    }
}

/// librdkafka's transactional calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxnCall {
    Init,
    Commit,
    Abort,
}

/// In-flight capacity taken by [`Sink::reserve`] for one record; returned
/// when the record's report is received (or when dropped unused).
#[derive(Debug)]
pub struct Permit {
    _slot: OwnedSemaphorePermit,
    _bytes: OwnedSemaphorePermit,
}

struct Inner<T: Send + Sync + 'static> {
    producer: ThreadedProducer<SinkContext<T>>,
    /// For failures found before producing (size, unknown topic).
    tx: mpsc::Sender<Raw<T>>,
    slots: Arc<Semaphore>,
    slots_total: usize,
    kib: Arc<Semaphore>,
    kib_total: u32,
    room: Arc<Notify>,
    known_topics: Mutex<HashSet<String>>,
    /// Topics found missing, and when (see [`MISSING_TOPIC_MEMORY`]).
    missing_topics: Mutex<HashMap<String, Instant>>,
    /// Until when topic checks are skipped: the last one found no broker.
    brokers_down_until: Mutex<Option<Instant>>,
    message_max_bytes: usize,
    problems: Arc<ProblemLog>,
    gap: Arc<Gap>,
    movement: Arc<Movement>,
    stats: Arc<crate::stats::StatsCell>,
    create_topics: Option<TopicSpec>,
    /// For creating topics: made on first use, from the producer's settings.
    admin_config: rdkafka::ClientConfig,
    /// Brokers and security only: for the consumer reading a topic back.
    connection: rdkafka::ClientConfig,
    admin: Mutex<Option<Arc<AdminClient<DefaultClientContext>>>>,
    /// The same secrets as the client context's, for admin errors.
    secrets: Arc<[String]>,
}

/// The refusal of a record whose topic the broker does not know.
fn missing_topic(topic: &str) -> DeliveryError {
    DeliveryError::new(
        DeliveryErrorKind::Permanent,
        Some(RDKafkaErrorCode::UnknownTopicOrPartition),
        format!("topic {topic} does not exist (waited {MISSING_TOPIC_GRACE:?}): create it, set topics.create = true, or fix the topic template"),
    )
}

/// What a topic check found.
pub(crate) enum TopicVerdict {
    Known,
    /// The broker does not know the topic (yet).
    Missing(DeliveryError),
    Refused(DeliveryError),
    /// The broker answered without a clear verdict: produce.
    Unsure,
    /// No broker answered.
    NoBroker,
}

/// What a metadata request found (the Kafka protocol carries no broker
/// version to report).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Brokers {
    /// Brokers in the cluster's metadata.
    pub count: usize,
    /// The broker that answered (`host:port/id`).
    pub answered_by: String,
}

/// The producing half: reserve capacity, send records. Cheap to clone.
pub struct Sink<T: Send + Sync + 'static> {
    inner: Arc<Inner<T>>,
}

impl<T: Send + Sync + 'static> Clone for Sink<T> {
    fn clone(&self) -> Self {
        Sink {
            inner: Arc::clone(&self.inner),
        }
    }
}

/// The reporting half: each sent record's fate, once.
pub struct Reports<T: Send + Sync + 'static> {
    rx: mpsc::Receiver<Raw<T>>,
    /// Keeps the producer, and so its delivery callbacks, alive while
    /// reports are awaited.
    producer: Arc<Inner<T>>,
}

/// A startup check looks for a definite refusal this often.
const BROKER_CHECK_SLICE: Duration = Duration::from_millis(500);
/// How long the first send to a topic may take to learn whether it exists.
const TOPIC_CHECK_TIMEOUT: Duration = Duration::from_secs(5);
/// After a topic check found no broker, checks are skipped for this long
/// (records are produced and librdkafka waits for the brokers): an outage
/// costs one check's timeout, not one per new topic.
const BROKERS_DOWN_BACKOFF: Duration = Duration::from_secs(30);
/// How long a topic the broker does not know is waited for before it
/// counts as refused. Kept short: the caller waits meanwhile (and answers
/// no keepalive), and a topic created just before its first record shows
/// in metadata well within it.
const MISSING_TOPIC_GRACE: Duration = Duration::from_secs(5);
/// After a topic was found missing, its records are refused at once for
/// this long (each one waiting out the grace would stall the stream); then
/// it is looked up again.
const MISSING_TOPIC_MEMORY: Duration = Duration::from_secs(30);
/// How often a missing topic is looked up again meanwhile.
const TOPIC_RECHECK: Duration = Duration::from_millis(500);
/// At most this many topics are remembered as checked; past it the set
/// starts over (a topic template fed by arbitrary values must not grow
/// memory).
const MAX_KNOWN_TOPICS: usize = 10_000;
/// Per-record overhead librdkafka counts against `message.max.bytes`.
const RECORD_OVERHEAD: usize = 128;

impl<T: Send + Sync + 'static> Sink<T> {
    /// Creates the producer. Nothing is sent to the broker until the first record.
    pub fn new(config: &SinkConfig) -> Result<(Sink<T>, Reports<T>), SinkError> {
        let client_config = config.client_config()?;
        let (tx, rx) = mpsc::channel(config.max_in_flight);
        let room = Arc::new(Notify::new());
        let problems = Arc::new(ProblemLog::default());
        let secrets: Arc<[String]> = config.secret_values().into();
        let movement = Arc::new(Movement::new());
        let stats = Arc::new(crate::stats::StatsCell::default());
        let gap = Arc::new(Gap {
            gapless: config.gapless && config.transactional_id.is_none(),
            failed: AtomicBool::new(false),
        });
        let context = SinkContext {
            tx: tx.clone(),
            room: Arc::clone(&room),
            secrets: Arc::clone(&secrets),
            problems: Arc::clone(&problems),
            gap: Arc::clone(&gap),
            movement: Arc::clone(&movement),
            stats: Arc::clone(&stats),
        };
        let producer: ThreadedProducer<SinkContext<T>> = client_config
            .create_with_context(context)
            .map_err(|e| SinkError::Create(describe_create_error(&e, config)))?;
        let kib_total = u32::try_from(config.max_in_flight_bytes.div_ceil(1024))
            .unwrap_or(Semaphore::MAX_PERMITS as u32)
            .min(Semaphore::MAX_PERMITS as u32);
        let inner = Arc::new(Inner {
            producer,
            tx,
            slots: Arc::new(Semaphore::new(config.max_in_flight)),
            slots_total: config.max_in_flight,
            kib: Arc::new(Semaphore::new(kib_total as usize)),
            kib_total,
            room,
            known_topics: Mutex::new(HashSet::new()),
            missing_topics: Mutex::new(HashMap::new()),
            brokers_down_until: Mutex::new(None),
            message_max_bytes: config.message_max_bytes(),
            problems,
            gap,
            movement,
            stats,
            create_topics: config.create_topics.clone(),
            admin_config: {
                // A second client with the same transactional.id would be a
                // second transactional producer.
                let mut c = client_config.clone();
                c.remove("transactional.id");
                c
            },
            connection: config.connection_config(),
            admin: Mutex::new(None),
            secrets,
        });
        Ok((
            Sink {
                inner: Arc::clone(&inner),
            },
            Reports {
                rx,
                producer: inner,
            },
        ))
    }

    /// The producer's queue and the brokers' round trips from librdkafka's
    /// last statistics (none before the first, or with
    /// `statistics.interval.ms=0`).
    pub fn statistics(&self) -> Option<crate::ProducerStats> {
        self.inner.stats.last()
    }

    /// Checks that the brokers answer a metadata request within `timeout`;
    /// says who answered.
    /// Use it at startup: later, an unreachable broker only stalls
    /// deliveries until it is back. A TLS or authentication failure ends the
    /// check at once ([`SinkError::Refused`]): no retry fixes those. The
    /// error says why, from what librdkafka reported while trying.
    pub async fn check_brokers(&self, timeout: Duration) -> Result<Brokers, SinkError> {
        self.inner.problems.set_checking(true);
        let result = self.check_brokers_until(Instant::now() + timeout).await;
        self.inner.problems.set_checking(false);
        result
    }

    async fn check_brokers_until(&self, deadline: Instant) -> Result<Brokers, SinkError> {
        loop {
            let inner = Arc::clone(&self.inner);
            let slice = deadline
                .saturating_duration_since(Instant::now())
                .min(BROKER_CHECK_SLICE);
            let answer = tokio::task::spawn_blocking(move || {
                inner
                    .producer
                    .client()
                    .fetch_metadata(None, slice)
                    .map(|m| Brokers {
                        count: m.brokers().len(),
                        answered_by: m.orig_broker_name().to_owned(),
                    })
            })
            .await
            .map_err(|e| SinkError::Config(e.to_string()))?;
            let problem = self.inner.problems.last();
            match (answer, problem) {
                (Ok(brokers), _) => {
                    self.inner.problems.clear();
                    return Ok(brokers);
                }
                (Err(_), Some(p)) if p.kind.is_definite() => return Err(SinkError::Refused(p)),
                (Err(e), last) if Instant::now() >= deadline => {
                    return Err(SinkError::Unreachable {
                        source: e,
                        last: last.map(|p| p.detail),
                    })
                }
                (Err(_), _) => {}
            }
        }
    }

    /// The last connection-level failure librdkafka reported, if no broker
    /// answered since the last [`Sink::check_brokers`].
    pub fn broker_problem(&self) -> Option<BrokerProblem> {
        self.inner.problems.last()
    }

    /// Waits for room for one record of `size` bytes (see [`Record::size`]).
    /// Cancel-safe.
    pub async fn reserve(&self, size: usize) -> Permit {
        let kib = u32::try_from(size.div_ceil(1024).max(1))
            .unwrap_or(u32::MAX)
            .min(self.inner.kib_total);
        let slot = Arc::clone(&self.inner.slots)
            .acquire_owned()
            .await
            .expect("semaphore never closed");
        let bytes = Arc::clone(&self.inner.kib)
            .acquire_many_owned(kib)
            .await
            .expect("semaphore never closed");
        Permit {
            _slot: slot,
            _bytes: bytes,
        }
    }

    /// Bytes in flight (counted in KiB, as reserved).
    pub fn in_flight_bytes(&self) -> usize {
        (self.inner.kib_total as usize - self.inner.kib.available_permits()) * 1024
    }

    /// Records in flight: sent, report not yet received by the caller.
    pub fn in_flight(&self) -> usize {
        self.inner.slots_in_use()
    }

    /// How long records have been waiting without any delivery report:
    /// zero when nothing is in flight. librdkafka retries without end what
    /// a broker answers with a retriable error (`NOT_ENOUGH_REPLICAS` below
    /// `min.insync.replicas`, a leader election, a broker down) and says
    /// nothing meanwhile; this is how that shows.
    pub fn stalled_for(&self) -> Duration {
        if self.in_flight() == 0 {
            Duration::ZERO
        } else {
            self.inner.movement.since()
        }
    }

    /// Enqueues `record`; its fate arrives on [`Reports`]. A record that cannot
    /// be produced as it is (larger than `message.max.bytes`, a topic the
    /// broker says does not exist) is reported as a permanent failure within
    /// seconds, not left waiting.
    pub async fn send(&self, permit: Permit, record: Record<T>) {
        let inner = &self.inner;
        if inner.slots_in_use() <= 1 {
            // Nothing else was waiting: the wait starts now.
            inner.movement.touch();
        }
        if inner.gap.closed() {
            let error = DeliveryError::new(
                DeliveryErrorKind::Withheld,
                None,
                "not sent: an earlier record failed for good, and nothing may be written after it",
            );
            let (record, token) = record.split_token();
            inner.fail_before_producing(record, token, permit, error);
            return;
        }
        let size = record.size() + record.headers.len() * 16 + RECORD_OVERHEAD;
        if size > inner.message_max_bytes {
            let error = DeliveryError::new(
                DeliveryErrorKind::Permanent,
                Some(RDKafkaErrorCode::MessageSizeTooLarge),
                format!(
                    "record of {size} bytes for topic {} exceeds message.max.bytes ({})",
                    record.topic, inner.message_max_bytes
                ),
            );
            tracing::error!(topic = %record.topic, size, "record too large for message.max.bytes");
            let (record, token) = record.split_token();
            inner.fail_before_producing(record, token, permit, error);
            return;
        }
        if let Err(error) = self.check_topic(&record.topic).await {
            tracing::error!(topic = %record.topic, %error, "cannot produce to topic");
            let (record, token) = record.split_token();
            inner.fail_before_producing(record, token, permit, error);
            return;
        }
        let (record, token) = record.split_token();
        let mut headers = OwnedHeaders::new_with_capacity(record.headers.len());
        for h in &record.headers {
            headers = headers.insert(Header {
                key: &h.name,
                value: Some(h.value.as_ref()),
            });
        }
        let mut pending = Box::new(Pending {
            token,
            permits: permit,
        });
        // Waiting for room is registered only once the queue was found full
        // (registering costs a lock per record); the attempt is repeated
        // after registering, so a delivery that freed room in between is
        // not missed.
        let mut room = None;
        loop {
            let mut base: BaseRecord<'_, [u8], [u8], Box<Pending<T>>> =
                BaseRecord::with_opaque_to(&record.topic, pending).headers(headers);
            if let Some(k) = record.key.as_deref() {
                base = base.key(k);
            }
            if let Some(v) = record.value.as_deref() {
                base = base.payload(v);
            }
            if let Some(ts) = record.timestamp_ms {
                base = base.timestamp(ts);
            }
            match inner.producer.send(base) {
                Ok(()) => return,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), mut base)) => {
                    headers = base.headers.take().unwrap_or_default();
                    pending = base.delivery_opaque;
                    match room.take() {
                        None => {
                            let mut notified = Box::pin(inner.room.notified());
                            notified.as_mut().enable();
                            room = Some(notified);
                        }
                        // Wait for a delivery to free queue space (no timer).
                        Some(notified) => notified.await,
                    }
                }
                Err((e, base)) => {
                    let error = DeliveryError::from_kafka(&e);
                    let Pending { token, permits } = *base.delivery_opaque;
                    inner.fail_before_producing(record, token, permits, error);
                    return;
                }
            }
        }
    }

    /// Checks once per topic that the broker knows it. A topic it does not
    /// know is created when [`SinkConfig::create_topics`] says how, and
    /// otherwise waited for up to [`MISSING_TOPIC_GRACE`] (one created a
    /// moment before its first record is not refused). While the brokers
    /// are unreachable the check is skipped (see [`BROKERS_DOWN_BACKOFF`]).
    /// Remembers that the brokers know `topic`: its records are produced
    /// without another check.
    pub(crate) fn remember_known(&self, topic: &str) {
        let mut known = self.inner.known_topics.lock().expect("not poisoned");
        if known.len() >= MAX_KNOWN_TOPICS {
            known.clear();
        }
        known.insert(topic.to_owned());
    }

    async fn check_topic(&self, topic: &str) -> Result<(), DeliveryError> {
        if self
            .inner
            .known_topics
            .lock()
            .expect("not poisoned")
            .contains(topic)
        {
            return Ok(());
        }
        let down_until = *self.inner.brokers_down_until.lock().expect("not poisoned");
        if down_until.is_some_and(|t| Instant::now() < t) {
            return Ok(());
        }
        // Found missing a moment ago: refused at once; found missing a while
        // ago: one more look, without the grace.
        let mut deadline = Instant::now() + MISSING_TOPIC_GRACE;
        {
            let mut missing = self.inner.missing_topics.lock().expect("not poisoned");
            match missing.get(topic) {
                Some(since) if since.elapsed() < MISSING_TOPIC_MEMORY => {
                    return Err(missing_topic(topic))
                }
                Some(_) => {
                    missing.remove(topic);
                    deadline = Instant::now();
                }
                None => {}
            }
        }
        let mut created = false;
        loop {
            match self.topic_verdict(topic).await {
                TopicVerdict::Known => {
                    self.remember_known(topic);
                    return Ok(());
                }
                TopicVerdict::Missing(e) => {
                    if let (Some(spec), false) = (&self.inner.create_topics, created) {
                        self.create_topic(topic, spec).await?;
                        created = true;
                    } else if Instant::now() >= deadline {
                        let mut missing = self.inner.missing_topics.lock().expect("not poisoned");
                        if missing.len() >= MAX_KNOWN_TOPICS {
                            missing.clear();
                        }
                        missing.insert(topic.to_owned(), Instant::now());
                        return Err(e);
                    } else if !created {
                        tracing::info!(topic, "topic does not exist (yet); waiting up to {MISSING_TOPIC_GRACE:?} for it");
                    }
                    tokio::time::sleep(TOPIC_RECHECK).await;
                }
                TopicVerdict::Refused(e) => return Err(e),
                TopicVerdict::Unsure => return Ok(()),
                TopicVerdict::NoBroker => {
                    tracing::warn!(topic, "no broker answered a topic check; producing without it for {BROKERS_DOWN_BACKOFF:?}");
                    *self.inner.brokers_down_until.lock().expect("not poisoned") =
                        Some(Instant::now() + BROKERS_DOWN_BACKOFF);
                    return Ok(());
                }
            }
        }
    }

    /// What the broker's metadata says about `topic`.
    pub(crate) async fn topic_verdict(&self, topic: &str) -> TopicVerdict {
        let inner = Arc::clone(&self.inner);
        let name = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            match inner.producer.client().fetch_metadata(Some(&name), TOPIC_CHECK_TIMEOUT) {
                Ok(md) => match md.topics().iter().find(|t| t.name() == name) {
                    Some(t) if t.error().is_none() && !t.partitions().is_empty() => TopicVerdict::Known,
                    Some(t) => match t.error().map(RDKafkaErrorCode::from) {
                        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
                            TopicVerdict::Missing(missing_topic(&name))
                        }
                        Some(code @ (RDKafkaErrorCode::InvalidTopic | RDKafkaErrorCode::TopicAuthorizationFailed)) => {
                            TopicVerdict::Refused(DeliveryError::new(
                                DeliveryErrorKind::Permanent,
                                Some(code),
                                format!("topic {name} cannot be produced to: {code} (grant walbox Write on it, or fix the topic template)"),
                            ))
                        }
                        // Leader election and the like: produce and let librdkafka wait.
                        _ => TopicVerdict::Unsure,
                    },
                    None => TopicVerdict::Unsure,
                },
                // The broker is unreachable: not the topic's fault; librdkafka waits.
                Err(_) => TopicVerdict::NoBroker,
            }
        })
        .await
        .unwrap_or(TopicVerdict::Unsure)
    }

    /// Creates `topic` as `spec` says. An existing topic is fine (another
    /// process made it first); a refusal is permanent for this record.
    pub(crate) async fn create_topic(
        &self,
        topic: &str,
        spec: &TopicSpec,
    ) -> Result<(), DeliveryError> {
        let refused = |why: String| {
            DeliveryError::new(
                DeliveryErrorKind::Permanent,
                None,
                format!("topic {topic} does not exist and could not be created: {why}"),
            )
        };
        let admin = self.inner.admin().map_err(|e| refused(e.to_string()))?;
        let mut new = NewTopic::new(
            topic,
            spec.partitions.unwrap_or(-1),
            TopicReplication::Fixed(spec.replication_factor.unwrap_or(-1)),
        );
        for (k, v) in &spec.config {
            new = new.set(k, v);
        }
        let options = AdminOptions::new().operation_timeout(Some(TOPIC_CHECK_TIMEOUT));
        let result = admin.create_topics([&new], &options).await;
        match result.as_deref() {
            Ok([Ok(_)]) | Ok([Err((_, RDKafkaErrorCode::TopicAlreadyExists))]) => {
                tracing::info!(topic, partitions = ?spec.partitions, replication_factor = ?spec.replication_factor, "created topic");
                Ok(())
            }
            Ok([Err((_, code)), ..]) => Err(refused(
                if *code == RDKafkaErrorCode::TopicAuthorizationFailed
                    || *code == RDKafkaErrorCode::ClusterAuthorizationFailed
                {
                    format!("{code} (walbox's principal needs Create on the topic or the cluster: kafka-acls --add --allow-principal User:… --operation Create --topic {topic}; or create the topic yourself)")
                } else {
                    code.to_string()
                },
            )),
            Ok(_) => Err(refused("no answer for the topic".into())),
            Err(e) => Err(refused(self.inner.redact(&e.to_string()))),
        }
    }

    /// Waits up to `timeout` for everything in flight to be delivered
    /// (blocking the calling thread is avoided). Returns true when nothing
    /// is left in librdkafka's queues.
    pub async fn flush(&self, timeout: Duration) -> bool {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || inner.producer.flush(timeout).is_ok())
            .await
            .unwrap_or(false)
    }

    /// Gives up on what is still queued or in flight: each such record is
    /// reported with [`DeliveryErrorKind::Purged`] (never silently dropped).
    pub fn purge(&self) {
        self.inner
            .producer
            .purge(PurgeConfig::default().queue().inflight());
    }
}

impl<T: Send + Sync + 'static> Sink<T> {
    /// librdkafka's begin_transaction: local, it does not wait.
    pub(crate) fn begin(&self) -> Result<(), KafkaError> {
        self.inner.producer.begin_transaction()
    }

    /// Runs a transactional call on the blocking pool (they wait for the
    /// broker).
    pub(crate) async fn transactional(
        &self,
        call: TxnCall,
        timeout: Duration,
    ) -> Result<(), KafkaError> {
        let inner = Arc::clone(&self.inner);
        tokio::task::spawn_blocking(move || match call {
            TxnCall::Init => inner.producer.init_transactions(timeout),
            TxnCall::Commit => {
                // rust-rdkafka's commit flushes first, polling in slices of
                // 100 ms that the producer's own polling thread leaves empty:
                // every commit took 100 ms. Waiting here for the deliveries
                // (the polling thread serves them) makes that flush a no-op.
                let deadline = Instant::now() + timeout;
                while inner.producer.in_flight_count() > 0 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(200));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                inner
                    .producer
                    .commit_transaction(left.max(Duration::from_millis(1)))
            }
            TxnCall::Abort => inner.producer.abort_transaction(timeout),
        })
        .await
        .expect("a producer call does not panic")
    }

    pub(crate) fn admin(&self) -> Result<Arc<AdminClient<DefaultClientContext>>, KafkaError> {
        self.inner.admin()
    }

    pub(crate) fn redact(&self, text: &str) -> String {
        self.inner.redact(text)
    }

    pub(crate) fn secrets(&self) -> Arc<[String]> {
        Arc::clone(&self.inner.secrets)
    }

    pub(crate) fn create_topics_spec(&self) -> Option<TopicSpec> {
        self.inner.create_topics.clone()
    }

    pub(crate) fn consumer_config(&self) -> rdkafka::ClientConfig {
        self.inner.connection.clone()
    }
}

impl<T: Send + Sync + 'static> Inner<T> {
    /// The admin client, made on first use.
    fn admin(&self) -> Result<Arc<AdminClient<DefaultClientContext>>, KafkaError> {
        let mut admin = self.admin.lock().expect("not poisoned");
        if let Some(a) = admin.as_ref() {
            return Ok(Arc::clone(a));
        }
        let made = Arc::new(
            self.admin_config
                .create::<AdminClient<DefaultClientContext>>()?,
        );
        *admin = Some(Arc::clone(&made));
        Ok(made)
    }

    fn redact(&self, text: &str) -> String {
        redact_values(text, &self.secrets)
    }

    fn slots_in_use(&self) -> usize {
        self.slots_total - self.slots.available_permits()
    }

    /// Reports a failure found before the record reached librdkafka.
    fn fail_before_producing(
        &self,
        returned: Record<()>,
        token: T,
        permits: Permit,
        error: DeliveryError,
    ) {
        self.gap.note(error.kind);
        self.movement.touch();
        let raw = Raw {
            pending: Pending { token, permits },
            returned: (error.kind == DeliveryErrorKind::Permanent).then_some(returned),
            report: Err(error),
        };
        // The permit guarantees a place in the channel.
        let _ = self.tx.try_send(raw);
    }
}

impl<T: Send + Sync + 'static> Reports<T> {
    /// The next record's fate, once per record sent. Receiving it returns the
    /// record's in-flight capacity. Cancel-safe.
    pub async fn next(&mut self) -> Option<Report<T>> {
        let Raw {
            pending,
            report,
            returned,
        } = self.rx.recv().await?;
        drop(pending.permits);
        Some(Report {
            token: pending.token,
            result: report.map_err(|e| self.with_fatal_cause(e)),
            returned,
        })
    }

    /// A report of librdkafka's generic "fatal error", or of a record it
    /// purged because the producer hit a fatal error (a record never sent
    /// when no producer id could be had), names the producer's actual fatal
    /// error (e.g. fenced by a newer producer with the same transactional
    /// id, or no right to a producer id), code and reason. A record purged
    /// at a shutdown, with no fatal error, stays purged.
    fn with_fatal_cause(&self, e: DeliveryError) -> DeliveryError {
        if !matches!(
            e.code,
            Some(
                RDKafkaErrorCode::Fatal
                    | RDKafkaErrorCode::PurgeQueue
                    | RDKafkaErrorCode::PurgeInflight
            )
        ) {
            return e;
        }
        match self.producer.producer.client().fatal_error() {
            Some((code, reason)) => DeliveryError::new(
                DeliveryErrorKind::Fatal,
                Some(code),
                crate::config::redact_values(
                    &format!("{}: {reason}", e.message),
                    &self.producer.secrets,
                ),
            )
            .with_authorization_hint(""),
            None => e,
        }
    }
}

/// Shuts down: flushes for up to `timeout`, then purges what is left so that
/// every record in flight is accounted for in the returned reports (purged
/// ones with [`DeliveryErrorKind::Purged`]). Nothing is dropped silently.
pub async fn shutdown<T: Send + Sync + 'static>(
    sink: Sink<T>,
    mut reports: Reports<T>,
    timeout: Duration,
) -> Vec<Report<T>> {
    let mut out = Vec::new();
    // Reports must be drained while flushing: their permits are what the
    // in-flight count measures.
    let flushed = {
        let flush = sink.flush(timeout);
        tokio::pin!(flush);
        loop {
            tokio::select! {
                biased;
                Some(r) = reports.next() => out.push(r),
                ok = &mut flush => break ok,
            }
        }
    };
    if !flushed {
        tracing::warn!(
            in_flight = sink.in_flight(),
            "flush timed out; purging what is left"
        );
        sink.purge();
        let inner = Arc::clone(&sink.inner);
        // Purged records get their delivery callbacks on the next poll.
        let _ =
            tokio::task::spawn_blocking(move || inner.producer.flush(Duration::from_secs(1))).await;
    }
    while sink.in_flight() > 0 {
        match tokio::time::timeout(Duration::from_secs(5), reports.next()).await {
            Ok(Some(r)) => out.push(r),
            _ => break,
        }
    }
    out
}
