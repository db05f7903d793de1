//! Where events go: records in, delivery reports out.

use std::time::Duration;

use bytes::Bytes;
use sink_kafka::{Permit, Record, Report, Reports, Sink, TxnError};

use super::{RunError, Token};
use crate::stall::StallClock;

/// How long the transaction coordinator may take to register walbox (and
/// complete what an older instance left open).
const INIT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a commit may take: its records' deliveries, then the markers.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an abort may take.
const ABORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long reading the progress topic back may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the brokers may take to answer at startup.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Fails fast on brokers that are not there at all, or refuse walbox;
/// once running, an outage only stalls deliveries (the outbox in Postgres
/// is the buffer).
pub async fn check_brokers<T: Send + Sync + 'static>(
    sink: &Sink<T>,
    brokers: &str,
) -> Result<sink_kafka::Brokers, RunError> {
    let brokers = brokers.to_owned();
    match sink.check_brokers(BROKER_CHECK_TIMEOUT).await {
        Ok(found) => Ok(found),
        Err(sink_kafka::SinkError::Refused(problem)) => {
            let problem = Box::new(problem);
            Err(RunError::BrokerRefused { brokers, problem })
        }
        Err(source) => {
            let source = Box::new(source);
            Err(RunError::Broker { brokers, source })
        }
    }
}

/// Takes records, within bounds on what is in flight. Methods take `&self`
/// so that reserving room and receiving reports ([`Deliveries`]) can wait in
/// one `select!`.
#[allow(async_fn_in_trait)]
pub trait Destination {
    /// Room for one record, returned when its report is received.
    type Permit;

    /// Waits for room for a record of `size` bytes. Cancel-safe.
    async fn reserve(&self, size: usize) -> Self::Permit;

    /// Sends a record; its fate arrives on [`Deliveries::next`].
    async fn send(&self, permit: Self::Permit, record: Record<Token>);

    /// Records sent whose report was not received yet.
    fn in_flight(&self) -> usize;

    /// Their bytes.
    fn in_flight_bytes(&self) -> usize;

    /// Exactly-once: registers the transactional producer, fencing older
    /// ones with the same id. Once, before the first [`Destination::begin`].
    /// Kafka's alone: the other brokers refuse it (and the configuration
    /// refuses exactly-once with them first).
    async fn init_transactions(&self) -> Result<(), TxnError> {
        Err(at_least_once())
    }

    /// Exactly-once: the last committed value of `key` in `topic`.
    async fn last_committed(&self, _topic: &str, _key: &str) -> Result<Option<Bytes>, String> {
        Err(at_least_once().message)
    }

    /// Exactly-once: records sent from now on belong to a new transaction.
    fn begin(&self) -> Result<(), TxnError> {
        Err(at_least_once())
    }

    /// Exactly-once: makes the transaction's records visible, all of them.
    async fn commit(&self) -> Result<(), TxnError> {
        Err(at_least_once())
    }

    /// Exactly-once: discards the transaction's records.
    async fn abort(&self) -> Result<(), TxnError> {
        Err(at_least_once())
    }
}

/// What a destination without transactions answers to their calls.
fn at_least_once() -> TxnError {
    TxnError {
        kind: sink_kafka::TxnErrorKind::Unsupported,
        message: "exactly-once delivery is Kafka's: this broker delivers at least once".into(),
    }
}

/// Each sent record's fate, once.
#[allow(async_fn_in_trait)]
pub trait Deliveries {
    /// The next report; `None` when the destination is gone. Cancel-safe.
    async fn next(&mut self) -> Option<Report<Token>>;
}

impl Destination for Sink<Token> {
    type Permit = Permit;

    async fn reserve(&self, size: usize) -> Permit {
        Sink::reserve(self, size).await
    }

    async fn send(&self, permit: Permit, record: Record<Token>) {
        Sink::send(self, permit, record).await
    }

    fn in_flight(&self) -> usize {
        Sink::in_flight(self)
    }

    fn in_flight_bytes(&self) -> usize {
        Sink::in_flight_bytes(self)
    }

    async fn init_transactions(&self) -> Result<(), TxnError> {
        Sink::init_transactions(self, INIT_TIMEOUT).await
    }

    async fn last_committed(&self, topic: &str, key: &str) -> Result<Option<Bytes>, String> {
        self.read_committed_last(topic, key, READ_TIMEOUT).await
    }

    fn begin(&self) -> Result<(), TxnError> {
        self.begin_transaction()
    }

    async fn commit(&self) -> Result<(), TxnError> {
        self.commit_transaction(COMMIT_TIMEOUT).await
    }

    async fn abort(&self) -> Result<(), TxnError> {
        self.abort_transaction(ABORT_TIMEOUT).await
    }
}

impl Deliveries for Reports<Token> {
    async fn next(&mut self) -> Option<Report<Token>> {
        Reports::next(self).await
    }
}

/// A destination whose sends run a [`StallClock`] (with [`ClockedReports`]
/// on its reports): the stall watch of the brokers whose sinks keep none.
#[derive(Debug)]
pub struct Clocked<'a, D> {
    /// The destination.
    pub inner: &'a D,
    /// The clock.
    pub clock: &'a StallClock,
}

impl<D: Destination> Destination for Clocked<'_, D> {
    type Permit = D::Permit;

    async fn reserve(&self, size: usize) -> D::Permit {
        self.inner.reserve(size).await
    }

    async fn send(&self, permit: D::Permit, record: Record<Token>) {
        self.clock.sent();
        self.inner.send(permit, record).await
    }

    fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    fn in_flight_bytes(&self) -> usize {
        self.inner.in_flight_bytes()
    }

    async fn init_transactions(&self) -> Result<(), TxnError> {
        self.inner.init_transactions().await
    }

    async fn last_committed(&self, topic: &str, key: &str) -> Result<Option<Bytes>, String> {
        self.inner.last_committed(topic, key).await
    }

    fn begin(&self) -> Result<(), TxnError> {
        self.inner.begin()
    }

    async fn commit(&self) -> Result<(), TxnError> {
        self.inner.commit().await
    }

    async fn abort(&self) -> Result<(), TxnError> {
        self.inner.abort().await
    }
}

/// Reports that run a [`StallClock`].
#[derive(Debug)]
pub struct ClockedReports<'a, R> {
    /// The reports.
    pub inner: &'a mut R,
    /// The clock.
    pub clock: &'a StallClock,
}

impl<R: Deliveries> Deliveries for ClockedReports<'_, R> {
    async fn next(&mut self) -> Option<Report<Token>> {
        let report = self.inner.next().await;
        if report.is_some() {
            self.clock.reported();
        }
        report
    }
}
