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
//! Reading what was committed is [`Sink::read_committed_last`]
//! (`sink/committed.rs`).

use std::sync::Arc;
use std::time::Duration;

use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use sink_core::{TxnError, TxnErrorKind};

use crate::sink::{Sink, TxnCall};
use crate::SinkConfig;

/// Classifies an error of librdkafka's transactional API.
pub(crate) fn txn_error(what: &str, e: &KafkaError) -> TxnError {
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

impl<T: Send + Sync + 'static> Sink<T> {
    /// Registers the `transactional.id` with the broker's transaction
    /// coordinator, which fences every older producer with the same id and
    /// completes (aborts) what such a producer left open. Call it once,
    /// before the first [`Sink::begin_transaction`].
    pub async fn init_transactions(&self, timeout: Duration) -> Result<(), TxnError> {
        let result = self
            .transactional(TxnCall::Init, timeout)
            .await
            .map_err(|e| txn_error("initialise transactions", &e));
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
            .map_err(|e| txn_error("begin a transaction", &e))
    }

    /// Commits the transaction: waits until every record sent in it was
    /// delivered, then makes them visible together. Fails
    /// [`TxnErrorKind::Abortable`] when a record failed.
    pub async fn commit_transaction(&self, timeout: Duration) -> Result<(), TxnError> {
        self.transactional(TxnCall::Commit, timeout)
            .await
            .map_err(|e| txn_error("commit the transaction", &e))
    }

    /// Aborts the transaction: what was sent in it is never visible to a
    /// `read_committed` consumer; records still queued are purged (and
    /// reported as such).
    pub async fn abort_transaction(&self, timeout: Duration) -> Result<(), TxnError> {
        self.transactional(TxnCall::Abort, timeout)
            .await
            .map_err(|e| txn_error("abort the transaction", &e))
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
    let tokens = config
        .tokens()
        .map_err(|e| TxnError::new(TxnErrorKind::Fatal, e.to_string()))?;
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
        let producer: ThreadedProducer<crate::msk_iam::TokenContext> = client
            .create_with_context(crate::msk_iam::TokenContext(tokens.clone()))
            .map_err(|e| TxnError::new(TxnErrorKind::Fatal, e.to_string()))?;
        if let Some(tokens) = &tokens {
            tokens.prime(producer.client());
        }
        producer
            .init_transactions(timeout)
            .map_err(|e| txn_error("initialise transactions", &e))
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
            .map_err(|e| txn_error("begin a transaction", &e))?;
        producer
            .send::<[u8], [u8]>(BaseRecord::to(&topic).key(id.as_bytes()))
            .map_err(|(e, _)| txn_error("write in a transaction", &e))?;
        producer
            .commit_transaction(timeout)
            .map_err(|e| txn_error("commit a transaction", &e))
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
        self.translate_msk_iam(&mut c);
        c
    }
}
