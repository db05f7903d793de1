//! Kafka transactions: a transactional sink ([`SinkConfig::transactional_id`])
//! writes records that become visible to `read_committed` consumers only
//! when [`Sink::commit_transaction`] succeeds, all together.
//!
//! ```text
//! init_transactions ─► begin ─► send … send ─► commit ─► begin ─► …
//!   (fences older                 │ a record fails, or the commit is
//!    producers with               └─► abortable: abort ─► begin ─► …
//!    the same id)           fenced (another producer took the id): stop
//! ```
//!
//! The caller decides what a transaction holds and what to do after an
//! abort; this module only drives librdkafka's state machine and says which
//! kind of failure happened ([`TxnErrorKind`]).
//!
//! # Reading what was committed
//!
//! [`Sink::read_committed_last`] reads a compacted topic with a
//! `read_committed` consumer up to its end and returns the last value
//! written under a key: how a caller finds the progress it committed
//! together with its records.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::admin::{AdminOptions, ResourceSpecifier};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use crate::sink::{Sink, TopicVerdict, TxnCall};
use crate::SinkConfig;

/// How a transactional call failed, which decides what the caller does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TxnErrorKind {
    /// Another producer initialised the same `transactional.id`: this one
    /// is fenced off for good. Stop; the other one carries on.
    Fenced,
    /// The transaction cannot commit (a record failed, the coordinator
    /// aborted it after `transaction.timeout.ms`): abort it and write its
    /// contents again in a new one.
    Abortable,
    /// It did not finish in time (a broker unreachable): the call may be
    /// repeated, or the transaction aborted.
    Retriable,
    /// The broker does not support transactions, or does not let this
    /// producer use them (authorization, `transaction.max.timeout.ms`).
    Unsupported,
    /// The producer is unusable.
    Fatal,
}

/// A transactional call's failure.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct TxnError {
    /// What to do about it.
    pub kind: TxnErrorKind,
    /// What happened.
    pub message: String,
}

impl TxnError {
    pub(crate) fn new(kind: TxnErrorKind, message: impl Into<String>) -> Self {
        TxnError {
            kind,
            message: message.into(),
        }
    }

    /// Classifies an error of librdkafka's transactional API.
    pub(crate) fn from_kafka(what: &str, e: &KafkaError) -> TxnError {
        let message = format!("{what}: {e}");
        let kind = match e {
            KafkaError::Transaction(t) => match t.code() {
                // librdkafka's own code for a producer fenced mid-produce
                // (Apache Kafka answers the produce with an old-epoch
                // error, which librdkafka raises as fatal "fenced").
                RDKafkaErrorCode::Fenced => TxnErrorKind::Fenced,
                RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
                | RDKafkaErrorCode::InvalidProducerIdMapping
                    if t.is_fatal() || t.code() == RDKafkaErrorCode::ProducerFenced =>
                {
                    TxnErrorKind::Fenced
                }
                RDKafkaErrorCode::TransactionalIdAuthorizationFailed
                | RDKafkaErrorCode::ClusterAuthorizationFailed
                | RDKafkaErrorCode::InvalidTransactionTimeout
                | RDKafkaErrorCode::UnsupportedVersion
                | RDKafkaErrorCode::UnsupportedFeature
                | RDKafkaErrorCode::UnsupportedForMessageFormat => TxnErrorKind::Unsupported,
                _ if t.is_fatal() => TxnErrorKind::Fatal,
                _ if t.txn_requires_abort() => TxnErrorKind::Abortable,
                RDKafkaErrorCode::OperationTimedOut | RDKafkaErrorCode::MessageTimedOut => {
                    TxnErrorKind::Retriable
                }
                _ if t.is_retriable() => TxnErrorKind::Retriable,
                // A call in the wrong state, and the like: a bug to stop on.
                _ => TxnErrorKind::Fatal,
            },
            // commit_transaction flushes first; a flush that timed out.
            KafkaError::Flush(_) => TxnErrorKind::Retriable,
            _ => TxnErrorKind::Fatal,
        };
        TxnError::new(kind, message)
    }
}

/// A topic a transactional sink reads back must keep the last value per
/// key for good.
const COMPACT: &str = "compact";

/// How long a topic's configuration may take to be described.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(3);

impl<T: Send + Sync + 'static> Sink<T> {
    /// Registers the `transactional.id` with the broker's transaction
    /// coordinator, which fences every older producer with the same id and
    /// completes (aborts) what such a producer left open. Call it once,
    /// before the first [`Sink::begin_transaction`].
    pub async fn init_transactions(&self, timeout: Duration) -> Result<(), TxnError> {
        let result = self
            .transactional(TxnCall::Init, timeout)
            .await
            .map_err(|e| TxnError::from_kafka("initialise transactions", &e));
        match result {
            // A broker without a transaction coordinator never answers
            // FindCoordinator(transaction) usefully: librdkafka waits.
            Err(e) if e.kind == TxnErrorKind::Retriable => Err(TxnError::new(
                TxnErrorKind::Unsupported,
                format!(
                    "{} (no transaction coordinator answered within {timeout:?}: does the broker support transactions?)",
                    e.message
                ),
            )),
            other => other,
        }
    }

    /// Starts a transaction: records sent from now on belong to it. Local
    /// to librdkafka, no round trip.
    pub fn begin_transaction(&self) -> Result<(), TxnError> {
        self.begin()
            .map_err(|e| TxnError::from_kafka("begin a transaction", &e))
    }

    /// Commits the transaction: waits until every record sent in it was
    /// delivered, then makes them visible together. Fails
    /// [`TxnErrorKind::Abortable`] when a record failed.
    pub async fn commit_transaction(&self, timeout: Duration) -> Result<(), TxnError> {
        self.transactional(TxnCall::Commit, timeout)
            .await
            .map_err(|e| TxnError::from_kafka("commit the transaction", &e))
    }

    /// Aborts the transaction: what was sent in it is never visible to a
    /// `read_committed` consumer; records still queued are purged (and
    /// reported as such).
    pub async fn abort_transaction(&self, timeout: Duration) -> Result<(), TxnError> {
        self.transactional(TxnCall::Abort, timeout)
            .await
            .map_err(|e| TxnError::from_kafka("abort the transaction", &e))
    }

    /// Makes sure `topic` exists and is compacted: created (one partition,
    /// `cleanup.policy=compact`, the topic settings of
    /// [`SinkConfig::create_topics`] otherwise) when missing; an existing
    /// one with another `cleanup.policy` is refused, since deleting old
    /// segments would delete the last value of a quiet key. A broker that
    /// cannot describe topic configurations is let through with a warning.
    pub async fn ensure_compacted_topic(&self, topic: &str) -> Result<(), String> {
        match self.topic_verdict(topic).await {
            TopicVerdict::Missing(_) => return self.create_compacted_topic(topic).await,
            TopicVerdict::Refused(e) => return Err(e.message),
            TopicVerdict::NoBroker => {
                return Err(format!(
                    "topic {topic}: no broker answered a metadata request"
                ))
            }
            // Its records are produced without another check.
            TopicVerdict::Known => self.remember_known(topic),
            TopicVerdict::Unsure => {}
        }
        let admin = self.admin().map_err(|e| e.to_string())?;
        // A broker that does not implement DescribeConfigs (librdkafka's
        // MockCluster) never answers: a short wait, then a warning.
        let options = AdminOptions::new()
            .request_timeout(Some(DESCRIBE_TIMEOUT))
            .operation_timeout(Some(DESCRIBE_TIMEOUT));
        let described = tokio::time::timeout(
            DESCRIBE_TIMEOUT + Duration::from_secs(1),
            admin.describe_configs([&ResourceSpecifier::Topic(topic)], &options),
        )
        .await;
        let policy = match described {
            Ok(Ok(results)) => match results.into_iter().next() {
                Some(Ok(resource)) => {
                    match resource.get("cleanup.policy").and_then(|e| e.value.clone()) {
                        Some(policy) => policy,
                        None => {
                            tracing::warn!(topic, "the broker did not say the topic's cleanup.policy; make sure it is compact");
                            return Ok(());
                        }
                    }
                }
                Some(Err(RDKafkaErrorCode::UnknownTopicOrPartition)) => {
                    return self.create_compacted_topic(topic).await
                }
                Some(Err(code)) => {
                    tracing::warn!(topic, %code, "cannot read the topic's cleanup.policy; make sure it is compact");
                    return Ok(());
                }
                None => return Ok(()),
            },
            Ok(Err(e)) => {
                tracing::warn!(topic, error = %self.redact(&e.to_string()), "cannot read the topic's cleanup.policy (the broker does not describe configurations?); make sure it is compact");
                return Ok(());
            }
            Err(_) => {
                tracing::warn!(
                    topic,
                    "no answer describing the topic; make sure its cleanup.policy is compact"
                );
                return Ok(());
            }
        };
        if policy.split(',').any(|p| p.trim() == COMPACT) {
            Ok(())
        } else {
            Err(format!(
                "topic {topic} has cleanup.policy={policy}: its old records would be deleted with the last value of a quiet key; set cleanup.policy=compact on it"
            ))
        }
    }

    /// Creates `topic` with one partition and `cleanup.policy=compact`
    /// (the replication factor and other settings of
    /// [`SinkConfig::create_topics`], if any), as the sink creates any topic.
    async fn create_compacted_topic(&self, topic: &str) -> Result<(), String> {
        let mut spec = self.create_topics_spec().unwrap_or_default();
        spec.partitions = Some(1);
        spec.config.remove("retention.ms");
        spec.config.insert("cleanup.policy".into(), COMPACT.into());
        self.create_topic(topic, &spec)
            .await
            .map_err(|e| format!("{} (it must have cleanup.policy=compact)", e.message))
    }

    /// Reads `topic` from its start to its end with a `read_committed`
    /// consumer and returns the last value written under `key` (`None`:
    /// the key has no value; a deletion marker counts as none). Only what
    /// committed transactions wrote is seen; the end is the last stable
    /// offset, so call it after [`Sink::init_transactions`] has completed
    /// whatever an older producer left open.
    pub async fn read_committed_last(
        &self,
        topic: &str,
        key: &str,
        timeout: Duration,
    ) -> Result<Option<Bytes>, String> {
        let config = self.consumer_config();
        let (topic, key) = (topic.to_owned(), key.to_owned());
        let secrets = self.secrets();
        let context = ReaderContext {
            secrets: Arc::clone(&secrets),
        };
        tokio::task::spawn_blocking(move || {
            read_last_blocking(config, context, &topic, &key, timeout)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| crate::config::redact_values(&e, &secrets))
    }
}

/// Checks, before anything is written, that the brokers run transactions
/// end to end for this producer's settings: a separate producer (with
/// `transactional.id` `<id>.probe`, so it fences no running instance)
/// initialises, writes a deletion marker for key `<id>.probe` to `topic`
/// in a transaction, and commits it. A broker that accepts the first steps
/// but not the commit (Tansu answers InitProducerId but not EndTxn) is
/// caught here, not after the first events were written.
pub async fn probe_transactions(
    config: &SinkConfig,
    topic: &str,
    timeout: Duration,
) -> Result<(), TxnError> {
    let id = format!(
        "{}.probe",
        config.transactional_id.as_deref().unwrap_or("walbox")
    );
    let mut client = config.connection_config();
    client.set("transactional.id", &id).set("linger.ms", "0");
    let secrets: Arc<[String]> = config.secret_values().into();
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
        let producer: ThreadedProducer<DefaultProducerContext> = client
            .create()
            .map_err(|e| TxnError::new(TxnErrorKind::Fatal, e.to_string()))?;
        producer
            .init_transactions(timeout)
            .map_err(|e| TxnError::from_kafka("initialise transactions", &e))
            .map_err(|e| match e.kind {
                TxnErrorKind::Retriable => TxnError::new(
                    TxnErrorKind::Unsupported,
                    format!(
                        "{} (no transaction coordinator answered within {timeout:?})",
                        e.message
                    ),
                ),
                _ => e,
            })?;
        producer
            .begin_transaction()
            .map_err(|e| TxnError::from_kafka("begin a transaction", &e))?;
        producer
            .send::<[u8], [u8]>(BaseRecord::to(&topic).key(id.as_bytes()))
            .map_err(|(e, _)| TxnError::from_kafka("write in a transaction", &e))?;
        producer
            .commit_transaction(timeout)
            .map_err(|e| TxnError::from_kafka("commit a transaction", &e))
    })
    .await
    .map_err(|e| TxnError::new(TxnErrorKind::Fatal, e.to_string()))?
    .map_err(|e| TxnError::new(e.kind, crate::config::redact_values(&e.message, &secrets)))
}

impl SinkConfig {
    /// Connection settings only (brokers, security): for the clients a sink
    /// uses beside its producer.
    pub(crate) fn connection_config(&self) -> rdkafka::ClientConfig {
        const CONNECTION: &[&str] = &[
            "security.",
            "sasl.",
            "ssl.",
            "ssl_",
            "enable.ssl",
            "socket.",
            "client.",
            "broker.",
            "reconnect.",
            "api.version",
            "https.",
            "topic.metadata",
            "metadata.",
            "debug",
            "log_level",
        ];
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.bootstrap_servers);
        for (k, v) in &self.properties {
            if CONNECTION.iter().any(|p| k.starts_with(p)) {
                c.set(k, v);
            }
        }
        c
    }
}

/// The reading consumer's client context: the end of a partition is what
/// it reads for, not an error to log; other errors are logged scrubbed.
struct ReaderContext {
    secrets: Arc<[String]>,
}

impl rdkafka::ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF) {
            return;
        }
        let reason = crate::config::redact_values(reason, &self.secrets);
        tracing::warn!(%reason, "kafka client error while reading a topic back");
    }
}

impl ConsumerContext for ReaderContext {}

fn read_last_blocking(
    mut config: rdkafka::ClientConfig,
    context: ReaderContext,
    topic: &str,
    key: &str,
    timeout: Duration,
) -> Result<Option<Bytes>, String> {
    let deadline = Instant::now() + timeout;
    // The end to read to is the high watermark, which only a
    // read_uncommitted client is told: a read_committed one hears of the
    // last stable offset, which stops at the first record of any open
    // transaction, also another producer's (shards share the progress
    // topic), and the records committed after it would go unseen.
    let ends: BaseConsumer = config
        .clone()
        .set("isolation.level", "read_uncommitted")
        .create()
        .map_err(|e| format!("create a consumer: {e}"))?;
    let consumer: BaseConsumer<ReaderContext> = config
        .set("group.id", "walbox-progress-reader")
        .set("isolation.level", "read_committed")
        .set("enable.partition.eof", "true")
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create_with_context(context)
        .map_err(|e| format!("create a consumer: {e}"))?;
    let md = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("read topic {topic}: {e}"))?;
    let partitions = match md.topics().iter().find(|t| t.name() == topic) {
        // A topic that does not exist holds no progress.
        Some(t) if t.error() == Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => {
            return Ok(None)
        }
        None => return Ok(None),
        // Anything else (a leader election, an authorization refusal) is
        // an error to retry, never "nothing there".
        Some(t) => match t.error() {
            Some(e) => {
                return Err(format!(
                    "read topic {topic}: {:?}",
                    RDKafkaErrorCode::from(e)
                ))
            }
            None => t.partitions().len() as i32,
        },
    };
    if partitions == 0 {
        return Ok(None);
    }
    let mut tpl = TopicPartitionList::new();
    let mut targets: HashMap<i32, i64> = HashMap::new();
    for p in 0..partitions {
        let remaining = deadline.saturating_duration_since(Instant::now());
        let (_, high) = ends
            .fetch_watermarks(topic, p, remaining)
            .map_err(|e| format!("read the end of topic {topic} [{p}]: {e}"))?;
        if high > 0 {
            targets.insert(p, high);
            tpl.add_partition_offset(topic, p, Offset::Beginning)
                .map_err(|e| e.to_string())?;
        }
    }
    if targets.is_empty() {
        return Ok(None);
    }
    consumer
        .assign(&tpl)
        .map_err(|e| format!("read topic {topic}: {e}"))?;
    let mut last: Option<Bytes> = None;
    let mut waiting_since: Option<Instant> = None;
    let mut told = false;
    while !targets.is_empty() {
        if Instant::now() >= deadline {
            return Err(format!(
                "read topic {topic}: not at its end within {timeout:?} (a transaction on it still open?)"
            ));
        }
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                if m.key() == Some(key.as_bytes()) {
                    last = m.payload().map(Bytes::copy_from_slice);
                }
                // Past the end captured above: this partition is read.
                if m.offset() + 1 >= targets.get(&m.partition()).copied().unwrap_or(0) {
                    targets.remove(&m.partition());
                }
                continue;
            }
            // The end of what a read_committed consumer may read now: the
            // end captured above, or an open transaction's first record.
            Some(Err(KafkaError::PartitionEOF(_))) | None => {}
            Some(Err(e)) => return Err(format!("read topic {topic}: {e}")),
        }
        // Commit and abort markers (and aborted records) are skipped
        // without a message: the position says how far the reading got.
        let position = consumer
            .position()
            .map_err(|e| format!("read topic {topic}: {e}"))?;
        for e in position.elements() {
            if let Offset::Offset(o) = e.offset() {
                if o >= targets.get(&e.partition()).copied().unwrap_or(i64::MAX) {
                    targets.remove(&e.partition());
                }
            }
        }
        if !targets.is_empty() {
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if !told && since.elapsed() > Duration::from_secs(5) {
                told = true;
                tracing::warn!(%topic, "reading the committed progress waits for a transaction still open on the progress topic (another producer's, e.g. a killed shard's, until its transaction.timeout.ms)");
            }
        }
    }
    Ok(last)
}
