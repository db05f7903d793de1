//! The relay: replication stream → decoder → outbox mapping → Kafka, with
//! [`Progress`](crate::progress::Progress) deciding what may be confirmed.
//!
//! ```text
//!  Source ─► XLogData / keepalive ─► Session::on_message ─► mapping ─► outgoing ─► Destination::send ─► broker
//!    ▲                                  │ progress.begin/event/commit                                    │
//!    └── status update ◄── progress ◄───┴──────── progress.ack ◄── Session::on_report ◄── Deliveries::next
//!                                                  (refused + dead-letter topic: a copy joins outgoing)
//! ```
//!
//! The relay is generic over its two ends, so its loop runs in unit tests
//! against in-memory fakes (see `tests.rs`):
//! - a [`Source`] opens replication sessions ([`ReplicationStream`]s): in
//!   production, Postgres through slot-manager ([`PostgresSource`]);
//! - a [`Destination`] takes records and [`Deliveries`] reports their fate:
//!   in production, the Kafka sink.
//!
//! # The loop
//!
//! Delivery reports are handled before new input (`biased`), so acks free
//! room and move the position first. The stream is read only while no record
//! waits for room, so memory stays within the in-flight bounds plus one
//! record; while full, status updates keep going out on their schedule (and
//! a keepalive read ahead is answered). A transient error (the connection
//! dropped, the server restarted, the slot is busy) starts a new session after
//! a backoff with jitter; reports of the old session's events are then stale
//! and ignored, since the server re-sends whatever was not confirmed. On
//! shutdown the relay stops reading, waits (bounded) for the reports of what
//! it sent, and sends a final status update.

mod backoff;
mod destination;
mod handlers;
mod session;
mod source;

#[cfg(test)]
mod fakes;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use pgoutput_decoder::{DecodeError, Lsn, PgTimestamp};
use sink_kafka::DeliveryError;
use slot_manager::TableName;
use tokio::sync::watch;

use crate::dead_letter::{DeadLetterKind, DeadLetters};
use crate::mapping::{MapError, OutboxMapping};
use crate::metrics::Metrics;
use crate::progress::{EventToken, ProgressError};

pub use backoff::Backoff;
pub use destination::{Deliveries, Destination};
pub use source::{PostgresSource, ReplicationStream, Source};

/// What travels with an event to the broker and back.
#[derive(Clone, Debug)]
pub struct Token {
    event: EventToken,
    /// The row's WAL position.
    lsn: Lsn,
    commit_time: PgTimestamp,
    /// The topic the event was meant for (empty when the row named none).
    topic: Arc<str>,
    /// Set on a dead-letter copy: why.
    dead_letter: Option<DeadLetterKind>,
}

/// What the relay needs to know.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// The outbox table (relations of other tables are ignored).
    pub table: TableName,
    /// Which columns hold what.
    pub mapping: OutboxMapping,
    /// What happens to undeliverable events.
    pub dead_letters: DeadLetters,
    /// Status update interval.
    pub status_interval: Duration,
    /// How long a shutdown waits for in-flight deliveries.
    pub shutdown_timeout: Duration,
}

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
    /// The brokers did not answer at startup.
    #[error("Kafka brokers {brokers} did not answer within 10 s")]
    Broker {
        /// The bootstrap list.
        brokers: String,
        /// Why.
        #[source]
        source: sink_kafka::SinkError,
    },
    /// The stream broke the transaction rules.
    #[error(transparent)]
    Protocol(#[from] ProgressError),
    /// A replication message could not be decoded.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// Unexpected message for the negotiated protocol.
    #[error("unexpected {0} message: walbox streams with protocol 1 and no streaming")]
    Unexpected(char),
}

impl RunError {
    /// True when a new session may succeed (see [`slot_manager::Error::is_transient`]).
    pub fn is_transient(&self) -> bool {
        matches!(self, RunError::Postgres(e) if e.is_transient())
    }
}

/// Runs sessions from `source` into `destination` until `shutdown` turns
/// true (then `Ok`) or a definite error. Transient errors start a new
/// session after a backoff.
pub async fn run<S, D, R>(
    config: &RelayConfig,
    source: &mut S,
    destination: &D,
    reports: &mut R,
    mut shutdown: watch::Receiver<bool>,
    metrics: Arc<Metrics>,
) -> Result<(), RunError>
where
    S: Source,
    D: Destination,
    R: Deliveries,
{
    let mut backoff = Backoff::new();
    let mut session = session::Session::new(config, destination, reports, metrics.clone());
    loop {
        let result = session.run(source, &mut shutdown, &mut backoff).await;
        metrics.set_streaming(false);
        match result {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() => {
                let delay = backoff.delay();
                tracing::warn!(error = %e, retry_in = ?delay, "not streaming; will retry");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = shutdown.changed() => return Ok(()),
                }
            }
            Err(e) => return Err(e),
        }
    }
}
