//! The Kafka side of walbox.
//!
//! This crate owns producing: an rdkafka producer configured to protect the
//! delivery contract, records that carry an opaque *ack token*, and the delivery
//! reports that tell the caller each token's fate, in the neutral types of
//! sink-core ([`Sink`] is a [`sink_core::Destination`] and a
//! [`sink_core::Transactional`]). It knows nothing of Postgres:
//! the caller decides what a token means (walbox uses it to find the
//! transaction, and so the LSN, an event came from).
//!
//! ```no_run
//! # async fn example() -> Result<(), sink_kafka::SinkError> {
//! use sink_kafka::{Record, Sink, SinkConfig};
//! let (sink, mut reports) = Sink::<u64>::new(&SinkConfig::new("localhost:9092"))?;
//! let record = Record::new("orders", Some("order-17".into()), Some("{}".into()), 1u64);
//! let permit = sink.reserve(record.size()).await;
//! sink.send(permit, record).await;
//! let report = reports.next().await.expect("one report per record");
//! assert_eq!(report.token, 1);
//! # Ok(()) }
//! ```
//!
//! # Transactions
//!
//! With [`SinkConfig::transactional_id`] the producer is transactional:
//! [`Sink::init_transactions`] once, then `begin_transaction`, `send`s,
//! `commit_transaction` (or `abort_transaction`). The token-based reports and
//! the in-flight permits work as without; a record's report says it reached
//! the broker, the commit says it became visible. See `transaction.rs`.

mod config;
mod destination;
mod error;
pub mod inspect;
pub mod msk_iam;
mod problem;
mod reader;
mod sink;
mod stats;
mod transaction;

pub use config::{
    contract_defaults, is_secret_property, redact_url_passwords, redact_userinfo, SinkConfig,
    TopicSpec, CONTRACT_PINNED,
};
pub use error::SinkError;
pub use problem::{BrokerProblem, ProblemKind};
pub use reader::{
    read_range, read_topics, RangeRead, ReadFrom, ReadRecord, ReadSummary, RecordTime, Truncated,
};
pub use sink::{shutdown, Brokers, CompactedTopicError, Reports, Sink};
pub use stats::{BrokerRtt, ProducerStats, STATISTICS_INTERVAL_MS};
pub use transaction::probe_transactions;

// The neutral types this sink speaks (sink-core), for callers that use
// only this crate.
pub use sink_core::{
    Delivered, DeliveryError, DeliveryErrorKind, Header, Permit, Record, Report, TxnError,
    TxnErrorKind,
};

/// The version of the librdkafka walbox is built with (`2.12.1`).
pub fn librdkafka_version() -> String {
    rdkafka::util::get_rdkafka_version().1
}
