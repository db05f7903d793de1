//! The relay: replication stream → decoder → outbox mapping → Kafka, with
//! [`Progress`](crate::progress::Progress) deciding what may be confirmed.
//!
//! ```text
//!  Source ─► XLogData / keepalive ─► Core::on_message ─► mapping ─► queued ─► Destination::send ─► broker
//!    ▲                                  │ progress.begin/event/commit                                 │
//!    └── status update ◄── progress ◄───┴──────── progress.ack ◄── Core::handle_report ◄── Deliveries::next
//!                                                  (refused + dead-letter topic: a copy is queued)
//! ```
//!
//! What the relay decides lives in its core (`core/`): a synchronous state
//! machine without I/O that takes inputs (a replication message, a delivery
//! report, a coverage reading, a commit's outcome, a tick) and returns
//! effects (records to send, a status update, a Kafka transaction to begin,
//! commit or abort, a position to save, an error to stop with); its tests
//! feed it frames (`core/tests/`). The session (`session/`) is the loop
//! that feeds it and carries the effects out. The relay is generic over its
//! two ends, so that loop runs in unit tests against in-memory fakes (see
//! `tests/`):
//! - a [`Source`] opens replication sessions ([`ReplicationStream`]s): in
//!   production, Postgres through slot-manager ([`PostgresSource`]), or a
//!   backfill's rows copied out of the outbox table (`backfill/publish.rs`,
//!   one session through [`run_once`]: its stream ends);
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
//! and ignored, since the server re-sends whatever was not confirmed (and
//! what it re-sends that walbox already delivered is skipped, see
//! [`Progress`](crate::progress::Progress)). On shutdown the relay reads the
//! rest of the open transaction, waits for the reports of what it sent (all
//! bounded by the shutdown timeout; a second signal cuts it short), and sends
//! a final status update.
//!
//! # Coverage
//!
//! The stream is silent when the outbox table leaves the publication. Every
//! [`COVERAGE_INTERVAL`](session::COVERAGE_INTERVAL) (every
//! [`COVERAGE_WHILE_WAITING`](session::COVERAGE_WHILE_WAITING) while
//! delivered events wait) the relay reads the publication's coverage of the
//! table from the catalog; a reading that matches the previous one, with no
//! change of the coverage in flight, verifies the coverage up to its own
//! WAL position, and nothing past the verified position is confirmed. A gap
//! (the table not published for INSERT) or a change (the table recreated,
//! the publication altered) stops the relay with the slot before any event
//! the change could have hidden.

mod backoff;
mod core;
mod destination;
mod error;
mod session;
mod source;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use pgoutput_decoder::{Lsn, PgTimestamp};
use slot_manager::OutboxTables;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::config::EventSource;
use crate::dead_letter::{DeadLetterKind, DeadLetters};
use crate::exactly_once::ExactlyOnce;
use crate::mapping::OutboxMapping;
use crate::metrics::Metrics;
use crate::progress::EventToken;
use crate::spans::{EventSpan, Spans};

pub use backoff::Backoff;
pub use destination::{Deliveries, Destination, Ends, NoTransactions, Transactional};
pub use error::{AbortCause, DriftError, RunError, TransactionsError};
pub use source::{
    CopiedRow, Done, Input, PostgresSource, ReplicationStream, Source, SourceError, Started,
};

/// What travels with a record to the broker and back: where it belongs in
/// the stream, and what it carries.
#[derive(Clone, Debug)]
pub struct Token {
    event: EventToken,
    /// The row's WAL position.
    lsn: Lsn,
    /// Its transaction's commit position.
    commit_lsn: Lsn,
    /// The event's index among its Postgres transaction's events. With
    /// `lsn` it names the event (exactly-once: a `COPY`'s rows share one
    /// WAL position); with `commit_lsn`, its place in the stream (the
    /// quarantine).
    index: u64,
    commit_time: PgTimestamp,
    /// The topic the event was meant for (empty when the row named none).
    topic: Arc<str>,
    /// The event's id, when something needs it after the acknowledgement:
    /// a receipt, or the continuous audit.
    event_id: Option<Box<str>>,
    carries: Carries,
    /// When walbox read the frame that carried the event (`None` when no
    /// frame did: a backfilled row, a released one, a progress record), and
    /// when it handed the record to the broker's client: walbox's part of
    /// the latency (see [`core::Split`]).
    read: Option<Instant>,
    sent: Option<Instant>,
}

/// What a record carries.
#[derive(Clone, Debug)]
enum Carries {
    /// An event of the stream: walbox's span of it (when spans are
    /// exported), whether the continuous audit sampled it, and whether its
    /// value is serialized with its schema already (`format = "avro"`).
    Event {
        span: Option<Box<EventSpan>>,
        sampled: bool,
        serialized: bool,
    },
    /// A dead-letter copy of an event, and why.
    DeadLetter(DeadLetterKind),
    /// The progress record that closes a Kafka transaction (exactly-once):
    /// no event.
    Progress,
    /// A held event's record, released from the quarantine by this
    /// release: no event of the stream. `serialized`: released as it was
    /// sent (the broker refused it serialized, or as a claim-check pointer).
    Released {
        release: crate::quarantine::ReleaseId,
        serialized: bool,
    },
}

impl Token {
    /// Its transaction's commit time as a record's origin carries it (µs
    /// since the Unix epoch); 0 for none (a backfilled row, a released one).
    fn origin_time(&self) -> i64 {
        if self.commit_time == PgTimestamp::default() {
            0
        } else {
            self.commit_time.as_unix_micros()
        }
    }

    /// Why, when it is a dead-letter copy.
    fn dead_letter(&self) -> Option<DeadLetterKind> {
        match self.carries {
            Carries::DeadLetter(kind) => Some(kind),
            _ => None,
        }
    }

    /// True for the progress record closing a Kafka transaction.
    fn is_progress(&self) -> bool {
        matches!(self.carries, Carries::Progress)
    }

    /// The release, when it is a released event's.
    fn released(&self) -> Option<crate::quarantine::ReleaseId> {
        match self.carries {
            Carries::Released { release, .. } => Some(release),
            _ => None,
        }
    }

    /// True when the audit sampled this event.
    fn sampled(&self) -> bool {
        matches!(self.carries, Carries::Event { sampled: true, .. })
    }

    /// The event's span, when one is exported.
    fn span(&self) -> Option<&EventSpan> {
        match &self.carries {
            Carries::Event { span, .. } => span.as_deref(),
            _ => None,
        }
    }

    /// True when its record's value is still to be serialized with its
    /// schema: an event's or a released one's not serialized yet.
    fn to_serialize(&self) -> bool {
        matches!(
            self.carries,
            Carries::Event {
                serialized: false,
                ..
            } | Carries::Released {
                serialized: false,
                ..
            }
        )
    }

    /// Its record's value is serialized now.
    fn serialized(&mut self) {
        if let Carries::Event { serialized, .. } | Carries::Released { serialized, .. } =
            &mut self.carries
        {
            *serialized = true;
        }
    }

    /// The same place in the stream, carrying its dead-letter copy.
    fn into_dead_letter(self, kind: DeadLetterKind) -> Token {
        Token {
            carries: Carries::DeadLetter(kind),
            ..self
        }
    }
}

/// What the process asks of the relay, in increasing urgency.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stop {
    /// Keep streaming.
    #[default]
    No,
    /// The first SIGTERM/SIGINT: read the rest of the open transaction,
    /// wait for in-flight deliveries, confirm, return (all within the
    /// shutdown timeout).
    Graceful,
    /// A second signal: confirm what was acked and return now.
    Now,
}

/// What the relay needs to know.
#[derive(Clone, Debug)]
pub struct RelayConfig {
    /// The stream events come from (the slot; a backfill's rows are a
    /// stream of their own): with each event's commit position and index,
    /// the record's [`sink_core::Origin`].
    pub stream: Arc<str>,
    /// The outbox tables (relations of other tables are ignored).
    pub tables: OutboxTables,
    /// Which columns hold what.
    pub mapping: OutboxMapping,
    /// Where events come from: table rows, messages, or both.
    pub source: EventSource,
    /// The prefix of the logical decoding messages that are events.
    pub message_prefix: String,
    /// What happens to undeliverable events.
    pub dead_letters: DeadLetters,
    /// Hold them instead (`on_failure = "quarantine"`), at most this many;
    /// `None`: off. Takes precedence over `dead_letters`.
    pub quarantine: Option<u64>,
    /// Status update interval.
    pub status_interval: Duration,
    /// How long a shutdown may take to finish the open transaction and wait
    /// for in-flight deliveries.
    pub shutdown_timeout: Duration,
    /// Exactly-once delivery through Kafka transactions; `None`: at least once.
    pub exactly_once: Option<ExactlyOnce>,
    /// At a start, read back what the broker holds of the replay and skip
    /// it (`skip_delivered`): the look-back per partition, in records;
    /// `None`: off. Needs [`Ends::tails`].
    pub skip_delivered: Option<u64>,
    /// Save the delivered position and its commit time every 10 s, for
    /// recreating a lost slot ([`crate::backfill::heal`]).
    pub save_positions: bool,
    /// A span per event, exported over OTLP; `None`: off.
    pub spans: Option<Spans>,
    /// The continuous audit's tap; `None`: off.
    pub audit: Option<std::sync::Arc<crate::continuous_audit::Tap>>,
    /// Where delivery receipts go; `None`: off.
    pub receipts: Option<crate::receipts::Recorder>,
    /// Where oversized values go (`claim_check.bucket`); `None`: off.
    pub claim_check: Option<crate::claim_check::ClaimCheck>,
    /// Serializes values with their schemas (`format = "avro"`); `None`:
    /// the mapping's value is the record's.
    pub schema_registry: Option<crate::schema_registry::SchemaRegistry>,
}

/// What a stream that ended ([`Input::End`]) delivered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    /// Dead-letter copies delivered.
    pub dead_lettered: u64,
}

/// Runs one session from `source` into `destination` until its stream ends
/// and every record sent has its report (a backfill's rows), or an error.
/// Nothing is retried: a rerun resumes from what the stream saved.
pub async fn run_once<S, D, X, R>(
    config: &RelayConfig,
    source: &mut S,
    ends: Ends<'_, D, X>,
    reports: &mut R,
    metrics: Arc<Metrics>,
) -> Result<Finished, RunError>
where
    S: Source,
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    // No signal ends it: its sender is gone.
    let (_, mut shutdown) = watch::channel(Stop::No);
    let mut session = session::Session::new(config, ends, reports, metrics).ending();
    session
        .run(source, &mut shutdown, &mut Backoff::new())
        .await?;
    Ok(session.finished())
}

/// The longest a standby waits between attempts to take the slot.
pub const STANDBY_POLL: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs sessions from `source` into `destination` until `shutdown` asks to
/// stop (then `Ok`) or a definite error. Transient errors start a new
/// session after a backoff.
pub async fn run<S, D, X, R>(
    config: &RelayConfig,
    source: &mut S,
    ends: Ends<'_, D, X>,
    reports: &mut R,
    mut shutdown: watch::Receiver<Stop>,
    metrics: Arc<Metrics>,
) -> Result<(), RunError>
where
    S: Source,
    D: Destination<Token>,
    X: Transactional<Token>,
    R: Deliveries<Token>,
{
    let mut backoff = Backoff::new();
    let mut session = session::Session::new(config, ends, reports, metrics.clone());
    loop {
        let result = session.run(source, &mut shutdown, &mut backoff).await;
        metrics.set_streaming(false);
        match result {
            Ok(()) => return Ok(()),
            Err(e) if e.is_transient() => {
                if wait_to_retry(&e, &mut backoff, &metrics, &shutdown).await {
                    return Ok(());
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// The one retry step after a transient error, for the relay's sessions
/// and for what `walbox run` does before streaming: the error counted
/// (`walbox_reconnects_total` by reason) and said with its causes (the
/// OS's reason is what the operator needs), then the backoff's delay
/// waited. A standby polls the busy slot at least every [`STANDBY_POLL`],
/// to take over soon after the active instance is gone. True when a
/// signal came first.
pub async fn wait_to_retry(
    e: &RunError,
    backoff: &mut Backoff,
    metrics: &Metrics,
    shutdown: &watch::Receiver<Stop>,
) -> bool {
    metrics.count_reconnect(e.reason());
    let was_standby = metrics.is_standby();
    metrics.set_standby(e.slot_busy());
    let delay = if e.slot_busy() {
        backoff.delay().min(STANDBY_POLL)
    } else {
        backoff.delay()
    };
    let error = crate::logging::chain(e);
    if e.slot_busy() {
        // The normal state of the pair's second pod: said once, at INFO,
        // as it becomes one (walbox_standby says it meanwhile).
        if !was_standby {
            tracing::info!(%error, "another instance streams from the slot; waiting as a standby to take over");
        }
    } else {
        tracing::warn!(%error, retry_in = ?delay, "not streaming; will retry");
    }
    let mut shutdown = shutdown.clone();
    tokio::select! {
        () = tokio::time::sleep(delay) => false,
        () = session::stopped(&mut shutdown, Stop::Graceful) => true,
    }
}
