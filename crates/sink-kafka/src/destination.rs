//! The Kafka sink as sink-core's [`Destination`] and [`Transactional`].

use std::time::Duration;

use bytes::Bytes;
use sink_core::{
    Admission, Deliveries, Destination, Permit, Record, Report, Transactional, TxnError,
};

use crate::{Reports, Sink};

/// How long the transaction coordinator may take to register the producer
/// (and complete what an older one left open).
const INIT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a commit may take: its records' deliveries, then the markers.
const COMMIT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long an abort may take.
const ABORT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long reading a topic back may take.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

impl<T: Send + Sync + 'static> Destination<T> for Sink<T> {
    fn admission(&self) -> &Admission {
        Sink::admission(self)
    }

    async fn send(&self, permit: Permit, record: Record<T>) {
        Sink::send(self, permit, record).await
    }

    /// From the delivery callbacks (a record librdkafka holds moves when
    /// its report is made, before the caller receives it).
    fn stalled_for(&self) -> Duration {
        Sink::stalled_for(self)
    }

    fn problem(&self) -> Option<String> {
        self.broker_problem().map(|p| p.to_string())
    }
}

impl<T: Send + Sync + 'static> Deliveries<T> for Reports<T> {
    async fn next(&mut self) -> Option<Report<T>> {
        Reports::next(self).await
    }
}

impl<T: Send + Sync + 'static> Transactional<T> for Sink<T> {
    async fn init(&self) -> Result<(), TxnError> {
        self.init_transactions(INIT_TIMEOUT).await
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
