//! The exactly-once state of the relay, across sessions: the Kafka
//! transaction's state, what the committed progress says to skip, and the
//! events the broker refused for good. [`super::exactly_once`] drives it.

use std::collections::HashMap;

use pgoutput_decoder::Lsn;
use sink_core::DeliveryError;
use tokio::time::Instant;

use crate::exactly_once::{ExactlyOnce, Position, Skip};
use crate::relay::{AbortCause, Token};

/// The Kafka transaction's state.
#[derive(Debug, Default)]
pub(super) enum KafkaTxn {
    /// None open.
    #[default]
    Idle,
    /// Records are being sent into it.
    Open {
        since: Instant,
        events: usize,
        bytes: usize,
        tokens: Vec<Token>,
    },
    /// Its progress record waits to be sent; then it commits.
    Closing {
        tokens: Vec<Token>,
        position: Position,
    },
    /// Committing since `since`.
    Committing {
        tokens: Vec<Token>,
        position: Position,
        since: Instant,
    },
}

/// The exactly-once state of the relay, across sessions.
#[derive(Debug)]
pub(super) struct Transactions {
    pub(super) config: ExactlyOnce,
    /// `init_transactions` done (once per process, after the first session
    /// acquired the slot: a standby waiting for the slot fences no one).
    pub(super) producer_ready: bool,
    /// The committed progress was read (after `init_transactions`, which
    /// ends what an earlier instance left open); until then every session
    /// reads it again.
    pub(super) initialized: bool,
    /// The last committed progress, when it belongs to this session's history.
    pub(super) committed: Option<Position>,
    /// This session's server history.
    pub(super) history: String,
    pub(super) txn: KafkaTxn,
    /// The open Postgres transaction: its final LSN, what to skip of it, and
    /// how many outbox rows were seen in it.
    pub(super) open_lsn: Lsn,
    pub(super) skip: Skip,
    pub(super) rows: u64,
    /// The last Postgres transaction whose Commit was read.
    pub(super) last_commit: Option<Lsn>,
    /// Events the broker refused for good, by WAL position and index in
    /// their transaction (a `COPY`'s rows share a position): dead-lettered
    /// on their replay.
    pub(super) refused: HashMap<(Lsn, u64), DeliveryError>,
    /// The open transaction failed (why, since when): nothing more is sent
    /// or read, and the session ends once its records have reported.
    pub(super) doomed: Option<(AbortCause, Instant)>,
    /// Transactions in a row whose progress record the brokers refused for
    /// good.
    pub(super) progress_refusals: u32,
}

impl Transactions {
    pub(super) fn new(config: ExactlyOnce) -> Self {
        Transactions {
            config,
            producer_ready: false,
            initialized: false,
            committed: None,
            history: String::new(),
            txn: KafkaTxn::Idle,
            open_lsn: Lsn::ZERO,
            skip: Skip::Nothing,
            rows: 0,
            last_commit: None,
            refused: HashMap::new(),
            doomed: None,
            progress_refusals: 0,
        }
    }

    /// The open transaction failed; the first reason is kept.
    pub(super) fn doom(&mut self, why: AbortCause, now: Instant) {
        if self.doomed.is_none() {
            self.doomed = Some((why, now));
        }
    }

    /// A Begin: what of this transaction Kafka has already.
    pub(super) fn begin(&mut self, final_lsn: Lsn) {
        self.open_lsn = final_lsn;
        self.rows = 0;
        self.skip = match &self.committed {
            Some(p) => p.skip(&self.history, final_lsn),
            None => Skip::Nothing,
        };
    }

    /// A Commit.
    pub(super) fn commit(&mut self, commit_lsn: Lsn) {
        self.last_commit = Some(commit_lsn);
        self.skip = Skip::Nothing;
        self.rows = 0;
    }

    /// The next outbox row of the open transaction: true when Kafka has it.
    pub(super) fn next_row_skipped(&mut self) -> bool {
        let index = self.rows;
        self.rows += 1;
        self.skip.skips(index)
    }

    /// The refusal of the event at `lsn` in an aborted transaction, if it
    /// was refused for good: its replay goes to the dead-letter topic. Kept
    /// until the transaction holding the dead-letter copy commits (if that
    /// one aborts too, the next replay dead-letters it again).
    pub(super) fn refusal(&self, lsn: Lsn, index: u64) -> Option<DeliveryError> {
        if self.refused.is_empty() {
            return None;
        }
        self.refused.get(&(lsn, index)).cloned()
    }

    /// The index of the open transaction's current event (the one
    /// [`Transactions::next_row_skipped`] was last asked about).
    pub(super) fn current_index(&self) -> u64 {
        self.rows.saturating_sub(1)
    }

    /// True while records may not be sent (the transaction commits, or failed).
    pub(super) fn committing(&self) -> bool {
        matches!(self.txn, KafkaTxn::Committing { .. }) || self.doomed.is_some()
    }

    /// True while nothing new may be read: the transaction closes, commits
    /// or failed.
    pub(super) fn busy(&self) -> bool {
        matches!(
            self.txn,
            KafkaTxn::Closing { .. } | KafkaTxn::Committing { .. }
        ) || self.doomed.is_some()
    }

    /// When the open transaction reaches its time bound.
    pub(super) fn due(&self) -> Option<Instant> {
        if self.doomed.is_some() {
            return None;
        }
        match &self.txn {
            KafkaTxn::Open { since, .. } => Some(*since + self.config.bounds.max_time),
            _ => None,
        }
    }

    /// True when the open transaction holds as many events or bytes as one
    /// may: reading stops until it closes.
    pub(super) fn full(&self) -> bool {
        let b = self.config.bounds;
        matches!(&self.txn, KafkaTxn::Open { events, bytes, .. }
            if *events >= b.max_events || *bytes >= b.max_bytes)
    }

    /// Forgets the open Kafka transaction without ending it (shutting down
    /// past its bound): the next start's `init_transactions` aborts it.
    pub(super) fn abandon(&mut self) {
        self.txn = KafkaTxn::Idle;
    }

    /// True when no Kafka transaction is open.
    pub(super) fn idle(&self) -> bool {
        matches!(self.txn, KafkaTxn::Idle)
    }

    /// Where everything sent so far reaches: the open Postgres transaction's
    /// rows so far, or the whole of the last one read.
    pub(super) fn position(&self, in_transaction: bool) -> Position {
        let (commit_lsn, events) = if in_transaction {
            (self.open_lsn, Some(self.rows))
        } else {
            (self.last_commit.unwrap_or(Lsn::ZERO), None)
        };
        Position {
            history: self.history.clone(),
            commit_lsn,
            events,
            counts: Some(self.config.source),
        }
    }
}
