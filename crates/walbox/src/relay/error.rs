//! Why the relay stops: [`RunError`], transient or definite, and its typed
//! parts.

use pgoutput_decoder::{DecodeError, Lsn, PgTimestamp};
use sink_core::{DeliveryError, TxnError, TxnErrorKind};
use slot_manager::OutboxTables;

use super::SourceError;
use crate::mapping::MapError;
use crate::progress::ProgressError;

/// Why the relay stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// Postgres (connection, slot, preflight).
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    /// A row could not be mapped and no dead-letter topic is configured.
    #[error(
        "{0}; the slot stays before this event (configure a dead-letter topic to skip such rows)"
    )]
    Map(#[from] MapError),
    /// The broker refused an event for good, or the producer failed.
    #[error("{0}; the slot stays before this event")]
    Delivery(DeliveryError),
    /// The dead-letter copy of an event failed too.
    #[error("the dead-letter copy failed too: {0}; the slot stays before this event")]
    DeadLetter(DeliveryError),
    /// The producer could not be created.
    #[error(transparent)]
    Sink(#[from] sink_kafka::SinkError),
    /// `sink = "rabbitmq"`: the broker did not answer, or refused walbox.
    #[error(transparent)]
    RabbitMq(#[from] sink_amqp::ConnectError),
    /// `sink = "sqs"`: SQS did not answer, or refused walbox.
    #[error(transparent)]
    Sqs(#[from] sink_sqs::ConnectError),
    /// `sink = "nats"`: the server did not answer, or refused walbox.
    #[error(transparent)]
    Nats(#[from] sink_nats::ConnectError),
    /// `sink = "webhook"`: the HTTP client cannot be set up.
    #[error(transparent)]
    Webhook(#[from] sink_webhook::SetupError),
    /// The brokers did not answer at startup.
    #[error("Kafka brokers {brokers} did not answer within 10 s")]
    Broker {
        /// The bootstrap list.
        brokers: String,
        /// Why.
        #[source]
        source: Box<sink_kafka::SinkError>,
    },
    /// A broker refused walbox's connection at startup (TLS or SASL).
    #[error("Kafka brokers {brokers} refused the connection: {problem}")]
    BrokerRefused {
        /// The bootstrap list.
        brokers: String,
        /// What was refused, and which settings to check.
        problem: Box<sink_kafka::BrokerProblem>,
    },
    /// The stream broke the transaction rules.
    #[error(transparent)]
    Protocol(#[from] ProgressError),
    /// A replication message could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A tuple does not match its Relation message.
    #[error("{0}: the stream is inconsistent; the slot stays before this event")]
    ColumnCount(#[from] pgoutput_decoder::ColumnCountMismatch),
    /// The publication no longer publishes the outbox table's INSERTs as it
    /// did: the message says what changed and what to do.
    #[error(transparent)]
    Drift(#[from] DriftError),
    /// Exactly-once: another instance with the same transactional id took
    /// over; this one must stop.
    #[error("the Kafka producer with transactional id {id} was fenced off ({detail}): another walbox instance with this id took over, or the broker aborted a transaction left open past transaction.timeout.ms (this process paused or starved); stopping: nothing uncommitted is visible, and the next start writes it again")]
    Fenced {
        /// The transactional id.
        id: String,
        /// The broker's words.
        detail: String,
    },
    /// Exactly-once: the Kafka transaction was aborted; a new session writes
    /// its events again after the last committed progress.
    #[error("{0}; the Kafka transaction was aborted and its events are written again from the last committed progress")]
    Aborted(AbortCause),
    /// Exactly-once cannot work with this broker or producer.
    #[error("exactly-once delivery: {0}")]
    Transactions(#[from] TransactionsError),
    /// Exactly-once: the committed progress could not be read (a broker
    /// unreachable, a leader election, a transaction still open on the
    /// progress topic): nothing is streamed until it is.
    #[error("exactly-once delivery: could not read the committed progress from topic {topic}: {detail}; nothing is streamed until it is read, trying again")]
    ProgressUnread {
        /// The progress topic.
        topic: String,
        /// What failed.
        detail: String,
    },
    /// Exactly-once: no broker answered the progress topic's check in time
    /// (an outage, a broker just back from one): checked again after a
    /// backoff.
    #[error("exactly-once delivery: {0}; nothing is streamed until the progress topic is checked, trying again")]
    ProgressTopicUnchecked(String),
    /// Unexpected message for the negotiated protocol.
    #[error("unexpected {0} message: walbox streams with protocol 1 and no streaming")]
    Unexpected(char),
    /// Claim-check: an oversized value could not be stored.
    #[error(transparent)]
    ClaimCheck(#[from] crate::claim_check::ClaimCheckError),
    /// `format = "avro"`: a value could not be serialized (the registry
    /// did not answer or refused, or the payload does not fit its schema
    /// and there is no dead-letter topic).
    #[error(transparent)]
    Schema(#[from] crate::schema_registry::SchemaError),
    /// The quarantine cannot hold an event (full, or the event has no
    /// aggregate): the slot stays before it.
    #[error("{0}")]
    Quarantine(#[from] crate::quarantine::QuarantineError),
    /// A Relation message gave the payload column a type this session did
    /// not resolve (a domain made after it started, for a table it picked
    /// up or one altered): a new session reads the catalog again.
    #[error("the payload column of table {table} has type OID {type_oid}, which this session has not resolved (a domain made since it started); starting a new session, which reads the catalog again")]
    UnresolvedType {
        /// `schema.table`.
        table: String,
        /// The column's declared type.
        type_oid: u32,
    },
    /// Postgres did not answer in time: the connection is presumed dead,
    /// and a new session opens new ones.
    #[error("{what}: no answer from Postgres within {after:?}; the connection is presumed dead")]
    TimedOut {
        /// What waited.
        what: String,
        /// How long.
        after: std::time::Duration,
    },
    /// The source refused to stream, or its stream failed, other than
    /// through Postgres: an unfinished backfill or heal of the slot
    /// ([`SourceError::BackfillPending`]: the caller finishes it, or waits
    /// while another instance does), a backfill row too large.
    #[error(transparent)]
    Source(SourceError),
}

impl RunError {
    /// A transactional failure of the producer with `transactional_id`.
    pub fn from_txn(transactional_id: &str, e: TxnError) -> RunError {
        match e.kind {
            TxnErrorKind::Fenced => RunError::Fenced {
                id: transactional_id.to_owned(),
                detail: e.message,
            },
            TxnErrorKind::Unsupported => RunError::Transactions(TransactionsError::Unsupported {
                id: transactional_id.to_owned(),
                error: e,
            }),
            TxnErrorKind::Abortable | TxnErrorKind::Retriable => {
                RunError::Aborted(AbortCause::Transaction(e))
            }
            TxnErrorKind::Fatal => RunError::Transactions(TransactionsError::Producer(e)),
        }
    }

    /// Why a session ended, as `walbox_reconnects_total`'s `reason` label:
    /// `slot_busy` (another instance streams from the slot), `postgres`
    /// (connection or server), `kafka` (a broker), `transactions` (an
    /// aborted Kafka transaction), `schema_registry` (the registry did not
    /// answer), `rabbitmq` and `sqs` (the broker did not answer at start),
    /// `other`.
    pub fn reason(&self) -> &'static str {
        match self {
            _ if self.slot_busy() => "slot_busy",
            RunError::Postgres(_) | RunError::UnresolvedType { .. } | RunError::TimedOut { .. } => {
                "postgres"
            }
            RunError::Broker { .. } | RunError::ProgressTopicUnchecked(_) => "kafka",
            RunError::Aborted(_) | RunError::ProgressUnread { .. } => "transactions",
            RunError::Schema(_) => "schema_registry",
            RunError::RabbitMq(_) => "rabbitmq",
            RunError::Sqs(_) => "sqs",
            RunError::Nats(_) => "nats",
            RunError::Webhook(_) => "other",
            RunError::Map(_)
            | RunError::Delivery(_)
            | RunError::DeadLetter(_)
            | RunError::Sink(_)
            | RunError::BrokerRefused { .. }
            | RunError::Protocol(_)
            | RunError::Decode(_)
            | RunError::ColumnCount(_)
            | RunError::Drift(_)
            | RunError::Fenced { .. }
            | RunError::Transactions(_)
            | RunError::Unexpected(_)
            | RunError::ClaimCheck(_)
            | RunError::Quarantine(_)
            | RunError::Source(_) => "other",
        }
    }

    /// True when another process streams from the slot: this instance is a
    /// standby.
    pub fn slot_busy(&self) -> bool {
        matches!(
            self,
            RunError::Postgres(slot_manager::Error::SlotActive { .. })
        )
    }

    /// True when a new session may succeed (see [`slot_manager::Error::is_transient`]).
    /// Every variant is classified here, none by default: a new one must
    /// say whether a retry can cure it.
    pub fn is_transient(&self) -> bool {
        match self {
            RunError::Postgres(e) => e.is_transient(),
            RunError::Aborted(_)
            | RunError::ProgressUnread { .. }
            | RunError::ProgressTopicUnchecked(_)
            | RunError::UnresolvedType { .. }
            | RunError::TimedOut { .. } => true,
            RunError::ClaimCheck(e) => e.is_transient(),
            RunError::Schema(e) => e.is_transient(),
            RunError::RabbitMq(e) => e.is_transient(),
            RunError::Sqs(e) => e.is_transient(),
            RunError::Nats(e) => e.is_transient(),
            // Its CA file: the same file fails the same way again.
            RunError::Webhook(_) => false,
            // Definite: the same input fails the same way again; each says
            // what to change.
            RunError::Map(_)
            | RunError::Delivery(_)
            | RunError::DeadLetter(_)
            | RunError::Sink(_)
            | RunError::Broker { .. }
            | RunError::BrokerRefused { .. }
            | RunError::Protocol(_)
            | RunError::Decode(_)
            | RunError::ColumnCount(_)
            | RunError::Drift(_)
            | RunError::Fenced { .. }
            | RunError::Transactions(_)
            | RunError::Unexpected(_)
            | RunError::Quarantine(_)
            | RunError::Source(_) => false,
        }
    }
}

/// Why the publication's coverage of the outbox table stopped the relay.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DriftError {
    /// The table is not published for INSERT.
    #[error("{gap}; walbox stopped with the slot at {held}, before any event this could hide; fix it and restart walbox (any rows inserted while it did not cover the table are in the table, not in the stream: {remedy})")]
    NotPublished {
        /// How, with the fix.
        gap: String,
        /// How to publish the rows the stream did not carry.
        remedy: &'static str,
        /// Where the slot stays.
        held: Lsn,
        /// The commit time of the newest transaction delivered before.
        committed: Option<PgTimestamp>,
    },
    /// The coverage changed while walbox ran (the table recreated, the
    /// publication altered).
    #[error("{change} while walbox ran; walbox stopped with the slot at {held}, before any event the change could hide. Check that the publication covers {tables} for INSERT, then restart walbox; rows inserted while it did not are in the table but not in the stream: {remedy} (docs/operations.md, \"Publication drift\")")]
    Changed {
        /// What changed.
        change: String,
        /// Where the slot stays.
        held: Lsn,
        /// The outbox tables.
        tables: OutboxTables,
        /// How to publish the rows the stream did not carry.
        remedy: &'static str,
        /// The commit time of the newest transaction delivered before.
        committed: Option<PgTimestamp>,
    },
}

impl DriftError {
    /// How to publish the rows a drift kept from the stream: one table's
    /// are republished by walbox; several tables' by re-inserting them.
    pub fn remedy(tables: &OutboxTables) -> &'static str {
        match tables.single() {
            Some(_) => "`walbox resync --drift` republishes them, or set on_drift = \"heal\"",
            None => "re-insert them so that they stream, e.g. WITH moved AS (DELETE FROM <table> WHERE <condition> RETURNING *) INSERT INTO <table> SELECT * FROM moved (docs/configuration.md, \"Several outbox tables\")",
        }
    }

    /// Where the slot stays.
    pub fn held(&self) -> Lsn {
        match self {
            DriftError::NotPublished { held, .. } | DriftError::Changed { held, .. } => *held,
        }
    }

    /// The commit time of the newest transaction delivered before the
    /// stop: every row the stream did not carry committed after it.
    pub fn committed(&self) -> Option<PgTimestamp> {
        match self {
            DriftError::NotPublished { committed, .. } | DriftError::Changed { committed, .. } => {
                *committed
            }
        }
    }
}

/// Why an exactly-once session aborted its Kafka transaction (the next
/// session writes its events again).
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AbortCause {
    /// The commit failed, and can be retried from the last progress.
    #[error("the commit failed: {0}")]
    CommitFailed(TxnError),
    /// The broker refused an event for good: it is dead-lettered on the
    /// replay.
    #[error("the broker refused an event for good ({0})")]
    Refused(DeliveryError),
    /// A record failed, not for good.
    #[error("a record failed: {0}")]
    RecordFailed(DeliveryError),
    /// A transactional call failed in a way that aborting cures.
    #[error("{0}")]
    Transaction(TxnError),
}

/// Why exactly-once delivery cannot go on with this broker, producer or
/// committed progress.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransactionsError {
    /// The brokers do not run transactions for walbox.
    #[error("{error}: the brokers must support Kafka transactions (Apache Kafka 0.11 or later, with the transaction state topic available) and grant walbox Write on transactional id {id}; use delivery = \"at-least-once\" otherwise")]
    Unsupported {
        /// The transactional id.
        id: String,
        /// The broker's answer.
        error: TxnError,
    },
    /// The producer failed for good.
    #[error("{0}")]
    Producer(TxnError),
    /// The open transaction could not be aborted.
    #[error("could not abort the open Kafka transaction: {0}")]
    AbortFailed(TxnError),
    /// The progress topic is not (or cannot be made) a compacted topic.
    #[error("{0}")]
    ProgressTopic(String),
    /// The brokers refused the progress record for good, transaction after
    /// transaction.
    #[error("the brokers refused walbox's progress record for good {times} times in a row on topic {topic} ({error}): without it no transaction commits; check that topic's max.message.bytes and walbox's Write right on it")]
    ProgressRefused {
        /// The progress topic.
        topic: String,
        /// How many transactions in a row.
        times: u32,
        /// The last refusal.
        error: DeliveryError,
    },
    /// The last progress record cannot be decoded.
    #[error("the last progress record of {id} in topic {topic} is unreadable ({detail}); see docs/guarantees.md, \"Resetting the progress\"")]
    ProgressUnreadable {
        /// The transactional id.
        id: String,
        /// The progress topic.
        topic: String,
        /// Why.
        detail: String,
    },
    /// The committed progress stops inside a Postgres transaction that this
    /// run's source counts differently.
    #[error("the committed progress of {id} stops inside a Postgres transaction ({progress}, counted with source = {was}); this run has source = {now}, which counts that transaction's events differently and would skip the wrong ones: run with source = {was} until walbox has passed transaction {lsn}, then change it")]
    SourceChanged {
        /// The transactional id.
        id: String,
        /// The committed progress.
        progress: String,
        /// The source that wrote it.
        was: &'static str,
        /// This run's.
        now: &'static str,
        /// The transaction it stops in.
        lsn: Lsn,
    },
}
