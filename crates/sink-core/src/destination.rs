//! The traits a broker's sink implements.

use std::time::Duration;

use bytes::Bytes;

use crate::{Admission, Permit, Record, Report};

/// Takes records, within the in-flight bound ([`crate::Admission`]).
/// Methods take `&self`, so that reserving room and receiving reports
/// ([`Deliveries`]) can wait in one `select!`.
///
/// The promise a destination keeps: each record sent gets exactly one
/// [`Report`], and a delivered report means the broker holds the record
/// durably (Kafka: acks=all; RabbitMQ: a publisher confirm; SQS: stored).
/// A record not yet reported may still arrive, or not: the caller confirms
/// its source only up to what was reported delivered.
#[allow(async_fn_in_trait)]
pub trait Destination<T> {
    /// The in-flight bound this destination keeps (one per sink).
    fn admission(&self) -> &Admission;

    /// Sends a record; its fate arrives on [`Deliveries::next`].
    async fn send(&self, permit: Permit, record: Record<T>);

    /// Waits for room for a record of `size` bytes ([`Record::size`]).
    /// Cancel-safe.
    async fn reserve(&self, size: usize) -> Permit {
        self.admission().reserve(size).await
    }

    /// Records sent whose report was not received yet.
    fn in_flight(&self) -> usize {
        self.admission().in_flight()
    }

    /// Their bytes.
    fn in_flight_bytes(&self) -> usize {
        self.admission().in_flight_bytes()
    }

    /// How long records have waited without any report (zero when none
    /// waits): a broker down, or refusing to acknowledge.
    fn stalled_for(&self) -> Duration {
        self.admission().stalled_for()
    }

    /// The broker's last connection-level problem, if it is having one.
    fn problem(&self) -> Option<String> {
        None
    }
}

/// Each sent record's fate, once.
#[allow(async_fn_in_trait)]
pub trait Deliveries<T> {
    /// The next report; `None` when the destination is gone. Cancel-safe.
    async fn next(&mut self) -> Option<Report<T>>;
}

/// A destination whose records can be written in transactions: visible to
/// readers all together at a commit, or not at all (Kafka's transactions,
/// read with `isolation.level=read_committed`).
///
/// ```text
/// init ─► begin ─► send … send ─► commit ─► begin ─► …
///                      │ a record failed, or the commit is abortable:
///                      └─► abort ─► begin ─► …
/// ```
#[allow(async_fn_in_trait)]
pub trait Transactional<T>: Destination<T> {
    /// Registers with the broker, fencing older producers of the same
    /// identity and completing what they left open. Once, before the first
    /// [`Transactional::begin`].
    async fn init(&self) -> Result<(), TxnError>;

    /// The value of `key` in the last committed record of `topic` that has
    /// it: how the caller finds what its last transaction covered.
    async fn last_committed(&self, topic: &str, key: &str) -> Result<Option<Bytes>, String>;

    /// Records sent from now on belong to a new transaction.
    fn begin(&self) -> Result<(), TxnError>;

    /// Makes the transaction's records visible, all of them.
    async fn commit(&self) -> Result<(), TxnError>;

    /// Discards the transaction's records.
    async fn abort(&self) -> Result<(), TxnError>;
}

/// How a transactional call failed, which decides what the caller does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TxnErrorKind {
    /// Another producer took the same identity: this one is fenced off for
    /// good. Stop; the other one carries on.
    Fenced,
    /// The transaction cannot commit (a record failed, the broker aborted
    /// it after its timeout): abort it and write its contents again.
    Abortable,
    /// It did not finish in time (a broker unreachable): the call may be
    /// repeated, or the transaction aborted.
    Retriable,
    /// The broker does not support transactions, or does not let this
    /// producer use them (authorization, its maximum transaction timeout).
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
    /// What happened, without secrets.
    pub message: String,
}

impl TxnError {
    /// A failure of `kind`.
    pub fn new(kind: TxnErrorKind, message: impl Into<String>) -> Self {
        TxnError {
            kind,
            message: message.into(),
        }
    }
}
