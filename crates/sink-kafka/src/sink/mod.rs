//! The producer and its delivery reports.
//!
//! ```text
//! caller ── reserve(size) ──► Permit ── send(permit, record) ──► librdkafka queue ──► broker
//!    ▲                                                                       │
//!    └──── Reports::next() ◄── report channel ◄─── delivery callback ◄───────┘
//! ```
//!
//! The delivery callbacks run where the producer's queue is served: a task
//! on the runtime that made the sink (`serve.rs` says why, and when a
//! thread of its own serves it instead).
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
//! record's bytes from the admission, and they return only when the caller
//! receives the record's report from [`Reports::next`]. The report channel
//! never refuses the callback, and holds no more reports than there are
//! slots (each holds its record's permit); the producer queue is sized
//! above the same bounds.
//!
//! `reserve` is cancel-safe (use it in `select!` beside `Reports::next`,
//! reports first); `send` is not, but only waits in the rare case the
//! producer queue is full anyway, and then for deliveries, not on a timer.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseProducer, Producer, PurgeConfig};
use rdkafka::util::IntoOpaque;
use sink_core::tail::{MARK_ROOM, ORIGIN_HEADER};
use sink_core::{Admission, DeliveryErrorKind, Permit, Record, Report};
use tokio::sync::{mpsc, Notify};

use crate::config::{redact_values, SinkConfig, TopicSpec};
use crate::error::{Failure, SinkError};
use crate::problem::{BrokerProblem, ProblemLog};

mod committed;
mod context;
mod produce;
mod serve;
mod tail;
mod topics;
pub use topics::CompactedTopicError;

use context::{Gap, Movement, Pending, Raw, SinkContext};
use produce::{Headers, TopicHandle};

/// librdkafka's transactional calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TxnCall {
    Init,
    Commit,
    Abort,
}

struct Inner<T: Send + Sync + 'static> {
    /// Dropped before the producer (fields drop in order).
    _serving: serve::Serving,
    producer: Arc<serve::Producer<SinkContext<T>>>,
    /// For failures found before producing (size, unknown topic).
    tx: mpsc::UnboundedSender<Raw<T>>,
    admission: Admission,
    room: Arc<Notify>,
    /// Topics the brokers were found to know, with the handle their
    /// records are produced through. Dropped before the producer (see
    /// `Drop for Inner`).
    known_topics: Mutex<HashMap<String, TopicHandle>>,
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
    /// `AWS_MSK_IAM`'s token maker.
    tokens: Option<Arc<crate::msk_iam::Tokens>>,
}

impl<T: Send + Sync + 'static> Inner<T> {
    /// A new handle of `topic` on this producer (`None`: a name librdkafka
    /// refuses).
    #[allow(unsafe_code)]
    fn topic_handle(&self, topic: &str) -> Option<TopicHandle> {
        // SAFETY: the producer is live, and handles are dropped before it
        // (`Drop for Inner`, and callers hold `&Inner` while they use one).
        unsafe { TopicHandle::new(self.producer.client().native_ptr(), topic) }
    }
}

impl<T: Send + Sync + 'static> Drop for Inner<T> {
    fn drop(&mut self) {
        // librdkafka wants the application's topic handles destroyed before
        // the producer; fields drop after this, the producer first.
        self.known_topics
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
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
    rx: mpsc::UnboundedReceiver<Raw<T>>,
    /// Keeps the producer, and so its delivery callbacks, alive while
    /// reports are awaited.
    producer: Arc<Inner<T>>,
}

/// A startup check looks for a definite refusal this often.
const BROKER_CHECK_SLICE: Duration = Duration::from_millis(500);
/// What the origin header adds to a record, at most: its name and a mark
/// with a slot name of 63 bytes.
const MARK_SIZE: usize = ORIGIN_HEADER.len() + MARK_ROOM;
/// Per-record overhead librdkafka counts against `message.max.bytes`.
const RECORD_OVERHEAD: usize = 128;

impl<T: Send + Sync + 'static> Sink<T> {
    /// Creates the producer. Nothing is sent to the broker until the first record.
    pub fn new(config: &SinkConfig) -> Result<(Sink<T>, Reports<T>), SinkError> {
        let client_config = config.client_config()?;
        // Unbounded, as the admission bounds it: a report holds its
        // record's permit until received. (A bounded channel's semaphore
        // took a lock per report received.)
        let (tx, rx) = mpsc::unbounded_channel();
        let room = Arc::new(Notify::new());
        let problems = Arc::new(ProblemLog::new(config.msk_iam()));
        let secrets: Arc<[String]> = config.secret_values().into();
        let movement = Arc::new(Movement::new());
        let stats = Arc::new(crate::stats::StatsCell::default());
        let gap = Arc::new(Gap {
            gapless: config.gapless && config.transactional_id.is_none(),
            failed: AtomicBool::new(false),
        });
        let tokens = config.tokens()?;
        let context = SinkContext {
            tokens: tokens.clone(),
            tx: tx.clone(),
            room: Arc::clone(&room),
            secrets: Arc::clone(&secrets),
            problems: Arc::clone(&problems),
            gap: Arc::clone(&gap),
            movement: Arc::clone(&movement),
            stats: Arc::clone(&stats),
        };
        let producer: BaseProducer<SinkContext<T>> = client_config
            .create_with_context(context)
            .map_err(|e| SinkError::Create(config.refusal(&e)))?;
        if let Some(tokens) = &tokens {
            tokens.prime(producer.client());
        }
        // A token refresh may wait for AWS: not on the caller's runtime.
        let (producer, serving) = serve::start(producer, tokens.is_some());
        let inner = Arc::new(Inner {
            _serving: serving,
            producer,
            tx,
            admission: Admission::new(config.max_in_flight, config.max_in_flight_bytes),
            room,
            known_topics: Mutex::new(HashMap::new()),
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
                // Its metadata requests look a topic up, never have the
                // broker create it (see `ensure_compacted_topic`).
                c.set("allow.auto.create.topics", "false");
                c
            },
            connection: config.connection_config(),
            admin: Mutex::new(None),
            secrets,
            tokens,
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
        self.inner.admission.reserve(size).await
    }

    /// Its in-flight bound.
    pub fn admission(&self) -> &Admission {
        &self.inner.admission
    }

    /// Bytes in flight (counted in KiB, as reserved).
    pub fn in_flight_bytes(&self) -> usize {
        self.inner.admission.in_flight_bytes()
    }

    /// Records in flight: sent, report not yet received by the caller.
    pub fn in_flight(&self) -> usize {
        self.inner.admission.in_flight()
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
    #[allow(unsafe_code)]
    pub async fn send(&self, permit: Permit, record: Record<T>) {
        let inner = &self.inner;
        if inner.admission.in_flight() <= 1 {
            // Nothing else was waiting: the wait starts now.
            inner.movement.touch();
        }
        if inner.gap.closed() {
            let error = Failure::new(
                DeliveryErrorKind::Withheld,
                None,
                "not sent: an earlier record failed for good, and nothing may be written after it",
            );
            let (record, token) = record.split_token();
            inner.fail_before_producing(record, token, permit, error);
            return;
        }
        let mark = record.origin.as_ref().map_or(0, |_| MARK_SIZE);
        let size = record.size() + mark + record.headers.len() * 16 + RECORD_OVERHEAD;
        if size > inner.message_max_bytes {
            let error = Failure::new(
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
        let handle = match self.check_topic(&record.topic).await {
            Ok(Some(handle)) => Some(handle),
            // Not checked (no broker answered, or no clear answer): produced
            // all the same, through a handle of its own.
            Ok(None) => inner.topic_handle(&record.topic),
            Err(error) => {
                tracing::error!(topic = %record.topic, %error, "cannot produce to topic");
                let (record, token) = record.split_token();
                inner.fail_before_producing(record, token, permit, error);
                return;
            }
        };
        let (record, token) = record.split_token();
        let Some(handle) = handle else {
            let error = Failure::new(
                DeliveryErrorKind::Permanent,
                Some(RDKafkaErrorCode::InvalidTopic),
                format!("librdkafka refuses the topic name {:?}", record.topic),
            );
            inner.fail_before_producing(record, token, permit, error);
            return;
        };
        let mut headers = Headers::with_capacity(record.headers.len() + 1);
        for h in &record.headers {
            headers.add(&h.name, &h.value);
        }
        // Where it came from: what a restart reads back (see `tail.rs`),
        // written on the stack (the headers copy it).
        if let Some(origin) = &record.origin {
            let mut room = [0u8; MARK_ROOM];
            let long;
            let mark = match origin.write_mark(&mut room) {
                Some(mark) => mark,
                None => {
                    long = origin.mark();
                    long.as_bytes()
                }
            };
            headers.add(ORIGIN_HEADER, mark);
        }
        let message = produce::Message {
            key: record.key.as_deref(),
            value: record.value.as_deref(),
            timestamp_ms: record.timestamp_ms.unwrap_or(0),
        };
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
            let opaque = pending.into_ptr();
            let rk = inner.producer.client().native_ptr();
            // SAFETY: `rk` is the producer `handle` was made by (both held
            // by `inner`), and the opaque is the `Box<Pending<T>>` its
            // delivery callback takes back.
            let refused = unsafe { produce::produce(rk, &handle, &message, headers, opaque) };
            let code;
            (code, headers) = match refused {
                Ok(()) => return,
                Err(refused) => refused,
            };
            // SAFETY: refused, so librdkafka did not keep the opaque.
            pending = unsafe { Box::<Pending<T>>::from_ptr(opaque) };
            if code != RDKafkaErrorCode::QueueFull {
                let error = Failure::from_kafka(&KafkaError::MessageProduction(code));
                let Pending { token, permits } = *pending;
                inner.fail_before_producing(record, token, permits, error);
                return;
            }
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
                // 100 ms that the task serving the producer's queue leaves
                // empty: every commit took 100 ms. Waiting here for the
                // deliveries (that task serves them) makes that flush a no-op.
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
}

impl<T: Send + Sync + 'static> Inner<T> {
    /// The admin client, made on first use.
    fn admin(&self) -> Result<Arc<AdminClient<DefaultClientContext>>, KafkaError> {
        let mut admin = self.admin.lock().expect("not poisoned");
        let made = match admin.as_ref() {
            Some(a) => Arc::clone(a),
            None => {
                let made = Arc::new(
                    self.admin_config
                        .create::<AdminClient<DefaultClientContext>>()?,
                );
                *admin = Some(Arc::clone(&made));
                made
            }
        };
        // An admin client never serves librdkafka's token refresh: a
        // fresh token each time it is used.
        if let Some(tokens) = &self.tokens {
            tokens.prime(made.inner());
        }
        Ok(made)
    }

    fn redact(&self, text: &str) -> String {
        redact_values(text, &self.secrets)
    }

    /// Reports a failure found before the record reached librdkafka.
    fn fail_before_producing(
        &self,
        returned: Record<()>,
        token: T,
        permits: Permit,
        error: Failure,
    ) {
        self.gap.note(error.kind);
        self.movement.touch();
        let raw = Raw {
            pending: Pending { token, permits },
            returned: (error.kind == DeliveryErrorKind::Permanent).then_some(returned),
            report: Err(error),
            client_micros: None,
        };
        let _ = self.tx.send(raw);
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
            client_micros,
        } = self.rx.recv().await?;
        drop(pending.permits);
        Some(Report {
            token: pending.token,
            result: report.map_err(|e| self.with_fatal_cause(e).into_error()),
            returned,
            client_micros,
        })
    }

    /// A report of librdkafka's generic "fatal error", or of a record it
    /// purged because the producer hit a fatal error (a record never sent
    /// when no producer id could be had), names the producer's actual fatal
    /// error (e.g. fenced by a newer producer with the same transactional
    /// id, or no right to a producer id), code and reason. A record purged
    /// at a shutdown, with no fatal error, stays purged.
    fn with_fatal_cause(&self, e: Failure) -> Failure {
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
            Some((code, reason)) => Failure::new(
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
