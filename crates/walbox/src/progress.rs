//! What may be confirmed to Postgres, and when to say so: the one owner of
//! the slot position.
//!
//! # When the slot may advance
//!
//! A transaction spans Begin(`final_lsn`) … Commit(`commit_lsn`, `end_lsn`);
//! Commit's `commit_lsn` must equal Begin's `final_lsn`, and a Begin inside an
//! open transaction is a protocol error. Each event the transaction produced
//! gets an [`EventToken`]; the broker's acknowledgement of the event is
//! [`Progress::ack`]. A transaction is *complete* when it has committed and
//! each of its events has been acked (a transaction without events is complete
//! at its Commit).
//!
//! The *delivered* position is the `end_lsn` of the newest transaction such
//! that it and every earlier one are complete. With nothing pending and no
//! transaction open, a keepalive's `wal_end` counts as delivered too, which
//! keeps an idle or filtered slot from holding WAL while other tables change.
//!
//! The *confirmable* position is the delivered one, capped where the
//! publication is known to have covered the outbox table for INSERT
//! ([`Progress::covered`]): the stream is silent about a table that left the
//! publication, so without the cap keepalives would confirm past events
//! walbox never saw. Neither position moves backward.
//!
//! ```text
//! commit order:  T1 (end 0/100) ── T2 (end 0/200) ── T3 (end 0/300)
//! events acked:  2/2               1/2               0/0 (no events)
//! confirmable:   0/100  ← T2 waits for its last ack; T3 waits for T2
//! ```
//!
//! # Sessions
//!
//! Each replication connection is a *session*; [`Progress::start_session`]
//! begins one at the slot's confirmed position and forgets every transaction
//! of the previous one (the server re-sends whatever was not confirmed).
//! Tokens carry their session's number, so a delivery report that arrives
//! after a reconnect is recognised as [`Ack::Stale`] and can never complete a
//! transaction of the new session.
//!
//! # Replays of what was already delivered
//!
//! Before Postgres 17 a slot's confirmed position reaches disk only at a
//! checkpoint, so after a fast restart (or a crash) the slot resumes from an
//! older position and the server re-sends transactions walbox had delivered
//! and confirmed. The tracker remembers the newest position it knew to be
//! delivered; when a session on the *same server history* (same system
//! identifier and timeline) starts before it, every transaction whose commit
//! LSN is below it is a replay: [`Progress::replaying`] tells the relay to
//! skip its events, and the first status update re-confirms the position. This
//! matches the server's own rule (a transaction is re-sent when its commit LSN
//! is at or after the slot's position). On a new history (a promoted standby,
//! a restored cluster) LSNs of the old history mean nothing: the slot's
//! position is the truth and nothing is skipped.
//!
//! # Memory
//!
//! One small entry per transaction not yet confirmable. Consecutive committed
//! transactions without events fold into the entry before them (PG 13/14 send
//! Begin/Commit for every transaction in the database, so one event stuck at
//! the broker must not grow the tracker at the database's transaction rate);
//! entries therefore number at most the events in flight plus two, and the
//! relay bounds the events in flight.
//!
//! # Status updates
//!
//! A standby status update reports `write` = the last WAL received and
//! `flush` = `apply` = the confirmable position. One is due at least every
//! status interval (keep it below `wal_sender_timeout / 2`), at once when a
//! keepalive asks for a reply, and soon after the confirmable position moves
//! (at most once per eager gap, so a stream of acks is not a stream of
//! updates). The methods that can make one due return it; the caller sends it.

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use pgoutput_decoder::{Lsn, PgTimestamp, StandbyStatusUpdate};

/// The default status interval.
pub const DEFAULT_STATUS_INTERVAL: Duration = Duration::from_secs(1);

/// The least time between two updates sent because the confirmable position
/// moved: a crash then re-sends little beyond what was in flight (see
/// `relay::session::COVERAGE_WHILE_WAITING` for what 50 ms against 100 ms
/// did to the duplicates of a kill -9).
pub const EAGER_GAP: Duration = Duration::from_millis(50);

/// Identifies one event until the broker acknowledged it. Cheap to copy; it is
/// the ack token the Kafka sink carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EventToken {
    session: u64,
    tx: u64,
}

/// The stream broke the transaction rules, or a token was acked twice.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProgressError {
    /// Begin while a transaction was open.
    #[error(
        "Begin (final LSN {new}) inside the open transaction ending at {open}: protocol error"
    )]
    NestedBegin {
        /// The open transaction's final LSN.
        open: Lsn,
        /// The new Begin's final LSN.
        new: Lsn,
    },
    /// Commit with no open transaction.
    #[error("Commit (commit LSN {0}) without a Begin: protocol error")]
    CommitWithoutBegin(Lsn),
    /// Commit's commit LSN is not the Begin's final LSN.
    #[error(
        "Commit LSN {commit_lsn} does not match Begin's final LSN {final_lsn}: protocol error"
    )]
    CommitMismatch {
        /// From Begin.
        final_lsn: Lsn,
        /// From Commit.
        commit_lsn: Lsn,
    },
    /// An event outside Begin … Commit.
    #[error("an event arrived outside a transaction: protocol error")]
    EventOutsideTransaction,
    /// An ack for a token of this session that is not outstanding.
    #[error("ack for an event that is not in flight (acked twice?)")]
    UnknownToken,
}

/// Whether a new session continues the server history of the previous one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum History {
    /// Same system identifier and timeline (or the first session): LSNs
    /// compare, and transactions below what was delivered are replays.
    Same,
    /// Another server history: the slot's position is the only truth.
    New,
}

/// What an ack did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ack {
    /// The event belongs to this session and is acked; maybe an update is due.
    Current(Option<StandbyStatusUpdate>),
    /// The event belongs to an earlier session: ignored (the server re-sends
    /// its transaction, which is tracked anew).
    Stale,
}

#[derive(Clone, Copy, Debug)]
struct Tx {
    /// Set at Commit.
    end_lsn: Option<Lsn>,
    /// Events issued and not yet acked.
    unacked: u32,
    /// The commit timestamp (the newest, for folded transactions).
    commit_time: PgTimestamp,
}

/// When status updates are due.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    interval: Duration,
    eager_gap: Duration,
    last_sent: Option<Instant>,
    last_sent_flush: Lsn,
}

/// The transaction prefix and the status-update schedule; see the module docs.
#[derive(Clone, Debug)]
pub struct Progress {
    session: u64,
    /// Transactions not yet confirmable, oldest first; the front has
    /// sequence number `front_seq`.
    txs: VecDeque<Tx>,
    front_seq: u64,
    /// The open transaction's final LSN (it is the back of `txs`).
    open: Option<Lsn>,
    /// The open transaction was delivered in an earlier session.
    replaying: bool,
    /// Everything below was delivered (acked); kept across sessions of the
    /// same history.
    delivered: Lsn,
    /// The commit timestamp of the newest transaction below `delivered`
    /// this process saw delivered.
    delivered_commit_time: Option<PgTimestamp>,
    /// The publication is known to have covered the outbox table up to here
    /// (see [`Progress::covered`]).
    covered: Lsn,
    received: Lsn,
    unacked_events: u64,
    schedule: Schedule,
}

impl Progress {
    /// Tracks nothing yet; call [`Progress::start_session`] once streaming.
    pub fn new(interval: Duration, eager_gap: Duration) -> Self {
        Progress {
            session: 0,
            txs: VecDeque::new(),
            front_seq: 0,
            open: None,
            replaying: false,
            delivered: Lsn::ZERO,
            delivered_commit_time: None,
            covered: Lsn::ZERO,
            received: Lsn::ZERO,
            unacked_events: 0,
            schedule: Schedule {
                interval,
                eager_gap: eager_gap.min(interval),
                last_sent: None,
                last_sent_flush: Lsn::ZERO,
            },
        }
    }

    /// A new replication session streaming from the slot's confirmed
    /// position `confirmed`: earlier sessions' transactions are forgotten and
    /// their tokens become stale. The first status update is due at once.
    ///
    /// Returns the position below which transactions are replays of what was
    /// delivered (see the module docs), or `None` when the session starts at
    /// or after it.
    pub fn start_session(&mut self, confirmed: Lsn, history: History) -> Option<Lsn> {
        self.session += 1;
        self.txs.clear();
        self.front_seq = 0;
        self.open = None;
        self.replaying = false;
        self.unacked_events = 0;
        // The slot may also have been moved ahead by someone else.
        (self.delivered, self.covered) = match history {
            History::Same => (self.delivered.max(confirmed), self.covered.max(confirmed)),
            History::New => (confirmed, confirmed),
        };
        self.received = confirmed;
        self.schedule.last_sent = None;
        self.schedule.last_sent_flush = confirmed;
        (self.delivered > confirmed).then_some(self.delivered)
    }

    /// True while the open transaction is a replay of one delivered in an
    /// earlier session: its events must not be sent again.
    pub fn replaying(&self) -> bool {
        self.open.is_some() && self.replaying
    }

    /// WAL received up to `wal_end` (any XLogData).
    pub fn received(&mut self, wal_end: Lsn) {
        self.received = self.received.max(wal_end);
    }

    /// A Begin message whose commit timestamp does not matter (tests).
    #[cfg(test)]
    pub(crate) fn begin(&mut self, final_lsn: Lsn) -> Result<(), ProgressError> {
        self.begin_at(final_lsn, PgTimestamp::default())
    }

    /// A Begin message, with the transaction's commit timestamp.
    pub fn begin_at(
        &mut self,
        final_lsn: Lsn,
        commit_time: PgTimestamp,
    ) -> Result<(), ProgressError> {
        if let Some(open) = self.open {
            return Err(ProgressError::NestedBegin {
                open,
                new: final_lsn,
            });
        }
        self.txs.push_back(Tx {
            end_lsn: None,
            unacked: 0,
            commit_time,
        });
        self.open = Some(final_lsn);
        self.replaying = final_lsn < self.delivered;
        Ok(())
    }

    /// The final (commit) LSN of the open transaction, if one is open.
    pub fn open_transaction(&self) -> Option<Lsn> {
        self.open
    }

    /// An event of the open transaction, about to be sent; ack its token when
    /// the broker acknowledged it.
    pub fn event(&mut self) -> Result<EventToken, ProgressError> {
        if self.open.is_none() {
            return Err(ProgressError::EventOutsideTransaction);
        }
        debug_assert!(!self.replaying, "a replayed transaction sends no events");
        let seq = self.front_seq + self.txs.len() as u64 - 1;
        let tx = self
            .txs
            .back_mut()
            .expect("an open transaction is in the queue");
        tx.unacked += 1;
        self.unacked_events += 1;
        Ok(EventToken {
            session: self.session,
            tx: seq,
        })
    }

    /// A Commit message.
    pub fn commit(
        &mut self,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        now: Instant,
    ) -> Result<Option<StandbyStatusUpdate>, ProgressError> {
        let final_lsn = self
            .open
            .ok_or(ProgressError::CommitWithoutBegin(commit_lsn))?;
        if final_lsn != commit_lsn {
            return Err(ProgressError::CommitMismatch {
                final_lsn,
                commit_lsn,
            });
        }
        self.open = None;
        self.replaying = false;
        let tx = self
            .txs
            .back_mut()
            .expect("an open transaction is in the queue");
        tx.end_lsn = Some(end_lsn);
        // A complete transaction behind a committed one folds into it: when
        // that one is complete, both are.
        if tx.unacked == 0 && self.txs.len() >= 2 {
            let before = self.txs.len() - 2;
            if self.txs[before].end_lsn.is_some() {
                let folded = self.txs.pop_back().map(|t| t.commit_time);
                let into = &mut self.txs[before];
                into.end_lsn = Some(end_lsn);
                into.commit_time = into.commit_time.max(folded.unwrap_or_default());
            }
        }
        self.advance();
        Ok(self.poll(now, false))
    }

    /// The commit timestamp of the newest transaction this process saw
    /// delivered, with every one before it: every later transaction
    /// committed after it (give or take clock steps on the server).
    pub fn delivered_commit_time(&self) -> Option<(Lsn, PgTimestamp)> {
        self.delivered_commit_time.map(|t| (self.delivered, t))
    }

    /// The commit timestamp of the oldest transaction with events not yet
    /// acknowledged (the newest of folded ones: an age from it errs short).
    pub fn oldest_unacked_commit_time(&self) -> Option<PgTimestamp> {
        self.txs
            .iter()
            .find(|t| t.unacked > 0)
            .map(|t| t.commit_time)
    }

    /// The broker acknowledged the event (or its dead-letter copy).
    pub fn ack(&mut self, token: EventToken, now: Instant) -> Result<Ack, ProgressError> {
        if token.session != self.session {
            return Ok(Ack::Stale);
        }
        let tx = token
            .tx
            .checked_sub(self.front_seq)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.txs.get_mut(i))
            .ok_or(ProgressError::UnknownToken)?;
        if tx.unacked == 0 {
            return Err(ProgressError::UnknownToken);
        }
        tx.unacked -= 1;
        self.unacked_events -= 1;
        self.advance();
        Ok(Ack::Current(self.poll(now, false)))
    }

    /// A token of this session that stands for no event (the exactly-once
    /// progress record): never acked, recognised as stale after the session.
    pub fn marker(&self) -> EventToken {
        EventToken {
            session: self.session,
            tx: u64::MAX,
        }
    }

    /// True when `token` belongs to the current session.
    pub fn is_current(&self, token: EventToken) -> bool {
        token.session == self.session
    }

    /// A keepalive: its `wal_end` is confirmable when nothing is pending and
    /// no transaction is open; an update is due at once if it asks for one.
    pub fn keepalive(
        &mut self,
        wal_end: Lsn,
        reply_requested: bool,
        now: Instant,
    ) -> Option<StandbyStatusUpdate> {
        self.received(wal_end);
        if self.open.is_none() && self.txs.is_empty() {
            self.delivered = self.delivered.max(wal_end);
        }
        self.poll(now, reply_requested)
    }

    /// The update due at `now`, if any (call it when [`Progress::next_due`]
    /// is reached).
    pub fn tick(&mut self, now: Instant) -> Option<StandbyStatusUpdate> {
        self.poll(now, false)
    }

    /// When the next update is due: the periodic one or, if a confirmation
    /// is held back by the eager gap, the gap's end (so the last ack of a
    /// burst is reported within the gap, not a whole interval later).
    /// `None`: at once (none was sent yet).
    pub fn next_due(&self) -> Option<Instant> {
        let s = &self.schedule;
        let last = s.last_sent?;
        Some(if self.confirmable() > s.last_sent_flush {
            last + s.eager_gap
        } else {
            last + s.interval
        })
    }

    /// The update reporting the current positions, marked as sent (the last
    /// one of a session, at shutdown).
    pub fn final_update(&mut self, now: Instant) -> StandbyStatusUpdate {
        self.mark_sent(now)
    }

    /// The newest position that may be confirmed to Postgres.
    pub fn confirmable(&self) -> Lsn {
        self.delivered.min(self.covered)
    }

    /// Everything below `lsn` was delivered: the acked prefix, whether or
    /// not the publication's coverage is verified that far.
    pub fn delivered(&self) -> Lsn {
        self.delivered
    }

    /// The publication is known to have covered the outbox table for INSERT
    /// up to `lsn`; nothing past it is confirmed, so a table that left the
    /// publication cannot have the slot carried past its unseen events.
    pub fn covered(&mut self, lsn: Lsn, now: Instant) -> Option<StandbyStatusUpdate> {
        self.covered = self.covered.max(lsn);
        self.poll(now, false)
    }

    /// The newest position received.
    pub fn received_lsn(&self) -> Lsn {
        self.received
    }

    /// Events of this session sent and not yet acked.
    pub fn unacked_events(&self) -> u64 {
        self.unacked_events
    }

    /// Transactions not yet confirmable (open, committed with unacked events,
    /// or waiting for an earlier one).
    pub fn pending_transactions(&self) -> usize {
        self.txs.len()
    }

    /// True while a transaction is between Begin and Commit.
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    fn poll(&mut self, now: Instant, reply_requested: bool) -> Option<StandbyStatusUpdate> {
        let s = &self.schedule;
        let periodic = s.last_sent.is_none_or(|t| now >= t + s.interval);
        let moved = self.confirmable() > s.last_sent_flush
            && s.last_sent.is_none_or(|t| now >= t + s.eager_gap);
        (periodic || reply_requested || moved).then(|| self.mark_sent(now))
    }

    fn mark_sent(&mut self, now: Instant) -> StandbyStatusUpdate {
        self.schedule.last_sent = Some(now);
        let flush = self.confirmable();
        self.schedule.last_sent_flush = flush;
        StandbyStatusUpdate {
            write: self.received.max(flush),
            flush,
            apply: flush,
            // Stamped as it is sent (the source's `send_status`).
            client_time: PgTimestamp::default(),
            reply_requested: false,
        }
    }

    fn advance(&mut self) {
        while let Some(Tx {
            end_lsn: Some(end),
            unacked: 0,
            commit_time,
        }) = self.txs.front().copied()
        {
            self.delivered = self.delivered.max(end);
            self.delivered_commit_time = self.delivered_commit_time.max(Some(commit_time));
            self.txs.pop_front();
            self.front_seq += 1;
        }
    }
}

#[cfg(test)]
mod tests;
