//! What the core asks of its driver: [`Effect`]s, read with
//! [`Core::poll_effect`](super::Core::poll_effect) after each input, in the
//! order they were decided. An [`Observation`] is something to note (a
//! metric, a log line, a receipt, a span's end, the audit's sample): the
//! core decides that it happened and what it says, the driver
//! (`session/observe.rs`) writes it.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pgoutput_decoder::{Lsn, PgTimestamp, StandbyStatusUpdate};
use sink_core::{Delivered, DeliveryErrorKind};
use tokio::time::Instant;

use crate::relay::Token;

/// One thing the core asks for.
#[derive(Debug)]
pub(in crate::relay) enum Effect {
    /// Send this status update to the server (a later one supersedes it:
    /// each carries every position so far).
    Status(StandbyStatusUpdate),
    /// Exactly-once: commit the closed Kafka transaction (its progress
    /// record was sent); hand the outcome to
    /// [`Core::on_committed`](super::Core::on_committed).
    Commit,
    /// Note this.
    Observe(Observation),
}

/// Something that happened, for metrics, logs, receipts, spans and the
/// continuous audit.
#[derive(Debug)]
pub(in crate::relay) enum Observation {
    /// An event counts as delivered at `wall` (at least once: the broker
    /// acknowledged it `at`; exactly once: its transaction committed).
    Delivered {
        token: Token,
        at: Option<Delivered>,
        wall: PgTimestamp,
        /// At least once, for an event read from the stream: its latency
        /// from being read to its report being handled, split.
        split: Option<Split>,
    },
    /// An event of an earlier session was acknowledged `at` (its receipt;
    /// the new session re-sends it).
    Acknowledged {
        token: Token,
        at: Delivered,
    },
    /// A released event was acknowledged `at`.
    Released {
        token: Token,
        at: Delivered,
    },
    /// The continuous audit sampled this event; the broker has it `at`.
    Sampled {
        event_id: Box<str>,
        topic: Arc<str>,
        at: Delivered,
    },
    /// A transaction's `events` were read, `micros` after their commit.
    Read {
        events: u64,
        micros: i64,
    },
    /// An event of a replay walbox delivered already was skipped.
    ReplaySkipped,
    /// An event of a replay was found on the broker at a start, `at`, and
    /// not sent again (its receipt is written; it is not counted as
    /// published again).
    FoundDelivered {
        token: Token,
        at: Delivered,
    },
    /// A topic was read back at a start: its partitions, the records read,
    /// the events of this slot found there, the partitions whose look-back
    /// ended before a confirmed record, how long it took.
    TailRead {
        topic: Arc<str>,
        partitions: u32,
        read: u64,
        found: usize,
        cut_short: Vec<i32>,
        micros: u64,
    },
    /// A topic could not be read back: its replayed events are sent again.
    TailUnreadable {
        topic: Arc<str>,
        error: String,
    },
    /// The server is not on the history walbox delivered from.
    HistoryChanged(HistoryChange),
    /// The slot resumed before what walbox confirmed.
    SlotBehind {
        slot: Lsn,
        delivered: Lsn,
    },
    /// A non-transactional message with the events' prefix (`first`: the
    /// first of this process).
    NonTransactional {
        lsn: Lsn,
        prefix: String,
        first: bool,
    },
    /// The outbox table appears under another name.
    Renamed {
        oid: u32,
        name: String,
    },
    /// A change of the coverage stays in flight for long.
    ChangePending {
        slot: Lsn,
        waited: Duration,
    },
    /// An outbox table was dropped.
    TableDropped {
        table: String,
    },
    /// A record goes to the dead-letter topic (`why`: in words).
    DeadLettering {
        why: &'static str,
        error: String,
        topic: Option<Arc<str>>,
        lsn: Lsn,
        dead_letter_topic: Arc<str>,
    },
    /// Walbox stops at this event (`what`: in words).
    Stopping {
        what: &'static str,
        error: String,
        lsn: Lsn,
    },
    /// A delivery failed and stops walbox.
    DeliveryFailed {
        topic: Arc<str>,
        kind: DeliveryErrorKind,
        error: String,
        lsn: Lsn,
    },
    /// A report of an earlier session failed; ignored.
    StaleFailure {
        error: String,
    },
    /// Saving the delivered position failed (said once until it works
    /// again), or works again.
    PositionNotSaved {
        error: String,
    },
    PositionSavedAgain,
    /// Exactly-once: what the committed progress says.
    Progress(ProgressNote),
    /// Exactly-once: the Kafka transaction.
    Transaction(TransactionNote),
    /// The quarantine holds an aggregate it did not hold.
    Holding {
        key: Bytes,
        lsn: Lsn,
        error: String,
    },
    /// A held aggregate's release starts.
    Releasing {
        key: Bytes,
    },
    /// A released event was refused again: the release stops, the
    /// aggregate stays held.
    ReleaseRefused {
        key: Bytes,
        error: String,
    },
    /// A released aggregate flows again.
    FlowsAgain {
        key: Bytes,
    },
    /// `new` events were held.
    Held {
        new: u64,
    },
    /// A held aggregate's events were dropped, as asked.
    DroppedHeld {
        key: Bytes,
        events: u64,
    },
    /// The quarantine's size.
    Quarantined {
        aggregates: usize,
        events: u64,
    },
}

/// How the server's history differs from the one walbox delivered from.
#[derive(Debug)]
pub(in crate::relay) enum HistoryChange {
    /// Another system identifier or timeline (failover, restore).
    Timeline { before: String, now: String },
    /// The server's WAL ends before what walbox delivered: restored on
    /// the same timeline.
    WalBehind { server_wal: Lsn, delivered: Lsn },
    /// Exactly-once: the committed progress lies past the end of the
    /// server's WAL.
    ProgressPastWal { recorded: String, server_wal: Lsn },
}

/// Exactly-once: what the committed progress says.
#[derive(Debug)]
pub(in crate::relay) enum ProgressNote {
    /// The history changed: it no longer applies.
    Forgotten,
    /// None committed yet.
    None { topic: String, id: String },
    /// It belongs to another server history.
    OtherHistory {
        topic: String,
        recorded: String,
        now: String,
    },
    /// The session resumes after it.
    Resuming {
        topic: String,
        id: String,
        after: String,
    },
}

/// Exactly-once: the Kafka transaction.
#[derive(Debug)]
pub(in crate::relay) enum TransactionNote {
    /// Its progress record is queued.
    Closing { events: usize, position: String },
    /// Its commit starts.
    Committing { events: usize },
    /// The commit did not finish in time; it is called again.
    CommitRetried { error: String },
    /// It committed, or failed to, after `took`.
    Ended { took: Duration, committed: bool },
    /// A refused event goes to the dead-letter topic on the replay.
    Refused {
        error: String,
        topic: Arc<str>,
        lsn: Lsn,
    },
    /// It was aborted.
    Aborted,
    /// The abort did not finish in time; it is called again.
    AbortRetried { error: String },
}

/// An acknowledged event's latency from walbox reading its frame to walbox
/// handling its delivery report, and what of it the broker's client held
/// the record for, by the client's own clock. The rest is walbox's own part:
/// mapping, waiting for room in flight, the hand-over to the client, and the
/// report's way back from the client's thread to the relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::relay) struct Split {
    /// From reading the frame to handing the record to the client, µs.
    pub(in crate::relay) read_to_send: u64,
    /// From reading the frame to handling the report, µs.
    pub(in crate::relay) read_to_report: u64,
    /// The client's part, µs (`None` when it does not say).
    pub(in crate::relay) client: Option<u64>,
}

impl Split {
    /// The split of `token`'s latency, its report handled at `now` (the
    /// client said it held the record `client` µs); `None` for what was not
    /// read from the stream, not sent, or is a dead-letter copy (not the
    /// event's own delivery).
    pub(in crate::relay) fn of(token: &Token, now: Instant, client: Option<u64>) -> Option<Split> {
        if token.dead_letter().is_some() {
            return None;
        }
        let (read, sent) = (token.read?, token.sent?);
        let micros = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Some(Split {
            read_to_send: micros(sent.saturating_duration_since(read)),
            read_to_report: micros(now.saturating_duration_since(read)),
            client,
        })
    }
}
