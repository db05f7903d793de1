//! Exactly-once mode in the core: Kafka transactions around the events,
//! each closed by a progress record (the rule is in
//! [`crate::exactly_once`]).
//!
//! ```text
//!  Idle ──first record sent──► Open ──bound reached, nothing waiting──► Closing
//!   ▲                                   (progress record queued)           │ record sent
//!   └──── acks the events to Progress ◄── commit ok ◄── Committing ◄───────┘
//!         (the slot may move)             commit failed: abort, new session, replay
//! ```
//!
//! An event's delivery report only says the broker has it; the event counts
//! as delivered for [`Progress`](crate::progress::Progress) when its Kafka
//! transaction committed. A failed record fails its transaction: the session
//! ends, the transaction is aborted, and the new session's replay (Postgres
//! re-sends from the slot's position) is cut at the last committed progress
//! record, so nothing is written twice. An event the broker refused for
//! good is remembered by its WAL position and, on the replay, goes to the
//! dead-letter topic inside the new transaction (without a dead-letter
//! topic it stops walbox, as in at-least-once mode).

use std::sync::Arc;

use bytes::Bytes;
use pgoutput_decoder::{Lsn, PgTimestamp};
use sink_core::{DeliveryErrorKind, Record, Report, TxnError, TxnErrorKind};
use tokio::time::Instant;

use super::transactions::{KafkaTxn, Transactions};
use super::{Core, Effect, Effects, HistoryChange, Observation, ProgressNote, TransactionNote};
use crate::exactly_once::Position;
use crate::progress::{Ack, History};
use crate::relay::{AbortCause, Carries, RunError, Token, TransactionsError};

/// What exactly-once mode needs before a session streams.
pub(in crate::relay) enum EosStartup {
    /// Nothing (at-least-once mode, or the progress is known).
    Ready,
    /// Register the producer (`register`, once per process), then read the
    /// committed progress of `transactional_id` in `topic` and hand it to
    /// [`Core::on_progress_read`].
    ReadProgress {
        register: bool,
        topic: String,
        transactional_id: String,
    },
}

/// At most this many refused events are remembered for their replay; more
/// at once stops walbox (something is refusing everything).
const MAX_REFUSED: usize = 10_000;

/// How long a failed transaction's other records may take to report before
/// the session ends anyway.
const DOOMED_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// How many times an abort that timed out is called again.
const ABORT_ATTEMPTS: u32 = 3;

/// Transactions in a row whose progress record may be refused for good
/// (each aborted and written again) before walbox stops.
const PROGRESS_REFUSALS: u32 = 3;

impl Core<'_> {
    /// At a session's start: what exactly-once mode must do before
    /// streaming (register the producer once, read the committed progress
    /// until it was read). `server_wal` is the server's WAL position as the
    /// session started, and `same` whether the session found the server on
    /// the history of the one before.
    pub(super) fn start_transactions(
        &mut self,
        history: &str,
        server_wal: Lsn,
        same: History,
    ) -> EosStartup {
        let Some(eos) = self.mode.transactions_mut() else {
            return EosStartup::Ready;
        };
        let new_history =
            same == History::New || (!eos.history.is_empty() && eos.history != history);
        eos.history = history.to_owned();
        eos.txn = KafkaTxn::Idle;
        eos.doomed = None;
        if new_history {
            self.effects
                .observe(Observation::Progress(ProgressNote::Forgotten));
            eos.committed = None;
        }
        if let Some(p) = eos.committed.take_if(|p| p.beyond(server_wal)) {
            wal_behind_the_record(&p, server_wal, &mut self.effects);
        }
        if eos.initialized {
            return EosStartup::Ready;
        }
        EosStartup::ReadProgress {
            register: !eos.producer_ready,
            topic: eos.config.progress_topic.clone(),
            transactional_id: eos.config.transactional_id.clone(),
        }
    }

    /// The producer is registered (`init_transactions` done, once per
    /// process: a standby waiting for the slot fences no one).
    pub(in crate::relay) fn on_producer_registered(&mut self) {
        if let Some(eos) = self.mode.transactions_mut() {
            eos.producer_ready = true;
        }
    }

    /// The committed progress as read from the progress topic (its last
    /// value for walbox's transactional id): where this session resumes.
    /// Unread progress is never "no progress": the session ends and the
    /// next one reads again.
    pub(in crate::relay) fn on_progress_read(
        &mut self,
        read: Result<Option<Bytes>, String>,
        server_wal: Lsn,
    ) -> Result<(), RunError> {
        let Some(eos) = self.mode.transactions_mut() else {
            return Ok(());
        };
        let history = eos.history.clone();
        let id = eos.config.transactional_id.clone();
        let topic = &eos.config.progress_topic;
        let value = read.map_err(|e| RunError::ProgressUnread {
            topic: topic.clone(),
            detail: e,
        })?;
        eos.initialized = true;
        eos.committed = match value.map(|v| Position::decode(&v)) {
            None => {
                self.effects
                    .observe(Observation::Progress(ProgressNote::None {
                        topic: topic.clone(),
                        id,
                    }));
                None
            }
            Some(Ok(p)) if p.history != history => {
                self.effects
                    .observe(Observation::Progress(ProgressNote::OtherHistory {
                        topic: topic.clone(),
                        recorded: p.history,
                        now: history,
                    }));
                None
            }
            Some(Ok(p)) if p.beyond(server_wal) => {
                wal_behind_the_record(&p, server_wal, &mut self.effects);
                None
            }
            // Inside a split transaction, the count is of what the source
            // that wrote it reads: another source would skip other events.
            Some(Ok(p))
                if p.events.is_some() && p.counts.is_some_and(|c| c != eos.config.source) =>
            {
                let (was, now) = (source_name(p.counts), source_name(Some(eos.config.source)));
                return Err(RunError::Transactions(TransactionsError::SourceChanged {
                    id,
                    progress: p.to_string(),
                    was,
                    now,
                    lsn: p.commit_lsn,
                }));
            }
            Some(Ok(p)) => {
                self.effects
                    .observe(Observation::Progress(ProgressNote::Resuming {
                        topic: topic.clone(),
                        id,
                        after: p.to_string(),
                    }));
                Some(p)
            }
            Some(Err(e)) => {
                return Err(RunError::Transactions(
                    TransactionsError::ProgressUnreadable {
                        id,
                        topic: topic.clone(),
                        detail: e.to_string(),
                    },
                ))
            }
        };
        Ok(())
    }

    /// Before a record is sent: a transaction must be open. True when one
    /// must be begun first.
    pub(super) fn before_send(&mut self, record: &Record<Token>, now: Instant) -> bool {
        let Some(eos) = self.mode.transactions_mut() else {
            return false;
        };
        let begin = matches!(eos.txn, KafkaTxn::Idle);
        if begin {
            eos.txn = KafkaTxn::Open {
                since: now,
                events: 0,
                bytes: 0,
                tokens: Vec::new(),
            };
        }
        match &mut eos.txn {
            KafkaTxn::Open {
                events,
                bytes,
                tokens,
                ..
            } => {
                *events += 1;
                *bytes += record.size();
                tokens.push(record.token.clone());
            }
            KafkaTxn::Closing { .. } if record.token.is_progress() => {}
            other => unreachable!("a record sent while the transaction is {other:?}"),
        }
        begin
    }

    /// The Kafka transaction [`Core::take_send`] asked for could not begin:
    /// none is open, and the session ends with this error.
    pub(in crate::relay) fn on_begin_failed(&mut self, e: TxnError) -> RunError {
        let Some(eos) = self.mode.transactions_mut() else {
            unreachable!("a transaction is begun only in exactly-once mode")
        };
        eos.txn = KafkaTxn::Idle;
        RunError::from_txn(&eos.config.transactional_id, e)
    }

    /// A turn of the driver at `now` (exactly-once; `in_flight` records sent
    /// and not reported, `finishing`: shutting down): a failed transaction
    /// whose records were heard ends the session; an open one past a bound
    /// closes; a closed one commits ([`Effect::Commit`]) once every record
    /// sent in it, its progress record included, has reported.
    pub(in crate::relay) fn upkeep(
        &mut self,
        now: Instant,
        finishing: bool,
        in_flight: usize,
    ) -> Result<(), RunError> {
        if let Some(e) = self.doomed_and_heard(in_flight, now) {
            return Err(e);
        }
        self.close_if_due(now, finishing);
        self.start_commit(now, finishing, in_flight);
        Ok(())
    }

    /// Closes the open transaction when a bound is reached (or `finishing`
    /// once no Postgres transaction is open) and nothing waits to be sent:
    /// queues its progress record.
    fn close_if_due(&mut self, now: Instant, finishing: bool) {
        let in_transaction = self.progress.in_transaction();
        let Some(eos) = self.mode.transactions_mut() else {
            return;
        };
        if eos.doomed.is_some() {
            return;
        }
        let KafkaTxn::Open { since, .. } = &eos.txn else {
            return;
        };
        let due = eos.full()
            || now >= *since + eos.config.bounds.max_time
            || (finishing && !in_transaction);
        if !due || !self.outgoing.is_empty() {
            return;
        }
        let position = eos.position(in_transaction);
        let KafkaTxn::Open { tokens, .. } = std::mem::take(&mut eos.txn) else {
            unreachable!("matched above")
        };
        let record = Record {
            topic: eos.config.progress_topic.as_str().into(),
            key: Some(Bytes::from(eos.config.transactional_id.clone())),
            value: Some(Bytes::from(position.encode(&eos.config.slot))),
            headers: Vec::new(),
            timestamp_ms: None,
            origin: None,
            token: Token {
                event: self.progress.marker(),
                lsn: position.commit_lsn,
                commit_lsn: position.commit_lsn,
                index: 0,
                commit_time: PgTimestamp::default(),
                topic: Arc::from(""),
                event_id: None,
                read: None,
                sent: None,
                carries: Carries::Progress,
            },
        };
        self.outgoing.push_back(record);
        self.effects
            .observe(Observation::Transaction(TransactionNote::Closing {
                events: tokens.len(),
                position: position.to_string(),
            }));
        eos.txn = KafkaTxn::Closing { tokens, position };
    }

    /// Asks for the commit ([`Effect::Commit`]) once the progress record
    /// is sent and every record of the transaction has reported
    /// (`in_flight` is 0); never for a failed transaction: it is aborted.
    ///
    /// Waiting for the reports is what makes a refusal always heard before
    /// the commit: librdkafka's commit flushes first, and a record refused
    /// for good while that flush runs leaves the records queued behind it
    /// unreported until the flush times out (30 s), then fails the commit.
    /// The commit would wait for the same acknowledgements anyway.
    ///
    /// While `finishing` (shutting down) the commit is asked as soon as the
    /// progress record is sent: the shutdown is bounded either way, and a
    /// commit under way when the bound passes is left to the next start.
    fn start_commit(&mut self, now: Instant, finishing: bool, in_flight: usize) {
        let Some(eos) = self.mode.transactions_mut() else {
            return;
        };
        let closed = matches!(eos.txn, KafkaTxn::Closing { .. });
        let unheard = in_flight > 0 && !finishing;
        if !closed || !self.outgoing.is_empty() || eos.doomed.is_some() || unheard {
            return;
        }
        let KafkaTxn::Closing { tokens, position } = std::mem::take(&mut eos.txn) else {
            unreachable!("matched above")
        };
        self.effects
            .observe(Observation::Transaction(TransactionNote::Committing {
                events: tokens.len(),
            }));
        eos.txn = KafkaTxn::Committing {
            tokens,
            position,
            since: now,
        };
        self.effects.push(Effect::Commit);
    }

    /// The commit's outcome: the events are delivered (acked to the
    /// progress, which may make a status update due), or the session ends.
    pub(in crate::relay) fn on_committed(
        &mut self,
        result: Result<(), TxnError>,
        now: Instant,
        wall: PgTimestamp,
    ) -> Result<(), RunError> {
        let Some(eos) = self.mode.transactions_mut() else {
            return Ok(());
        };
        let KafkaTxn::Committing {
            tokens,
            position,
            since,
        } = std::mem::take(&mut eos.txn)
        else {
            return Ok(());
        };
        self.effects
            .observe(Observation::Transaction(TransactionNote::Ended {
                took: now - since,
                committed: result.is_ok(),
            }));
        if let Err(e) = result {
            if e.kind == TxnErrorKind::Retriable {
                // librdkafka's rule: a commit that timed out is called again
                // (the records are still in it; another call would conflict).
                self.effects
                    .observe(Observation::Transaction(TransactionNote::CommitRetried {
                        error: e.to_string(),
                    }));
                eos.txn = KafkaTxn::Closing { tokens, position };
                return Ok(());
            }
            // The records are still in the transaction: abort it.
            eos.txn = KafkaTxn::Closing {
                tokens: Vec::new(),
                position,
            };
            if e.kind != TxnErrorKind::Abortable {
                return Err(RunError::from_txn(&eos.config.transactional_id, e));
            }
            // Once every record sent in it has reported: shutting down, a
            // commit may begin before they all did, so a record's refusal
            // can reach walbox after the commit's failure, and one refused
            // for good must be known as such for its replay (else it is
            // sent, refused and aborted again, for ever).
            eos.doom(AbortCause::CommitFailed(e), now);
            return Ok(());
        }
        eos.progress_refusals = 0;
        eos.committed = Some(position);
        if !eos.refused.is_empty() {
            for t in tokens.iter().filter(|t| t.dead_letter().is_some()) {
                eos.refused.remove(&(t.lsn, t.index));
            }
        }
        let mut update = None;
        for token in tokens {
            if let Ack::Current(Some(u)) = self.progress.ack(token.event, now)? {
                update = Some(u);
            }
            self.delivered(token, None, wall, None);
        }
        self.effects.status(update);
        Ok(())
    }

    /// A delivery report in exactly-once mode: success waits for the
    /// commit; a failure fails the transaction.
    pub(super) fn on_transactional_report(
        &mut self,
        report: Report<Token>,
        now: Instant,
    ) -> Result<(), RunError> {
        let Report { token, result, .. } = report;
        let error = match result {
            Ok(at) => {
                self.sampled(&token, &at);
                return Ok(());
            }
            Err(error) => error,
        };
        if !self.progress.is_current(token.event) || error.kind == DeliveryErrorKind::Purged {
            // An aborted transaction's record: its events are written again.
            return Ok(());
        }
        if token.dead_letter().is_some() {
            return Err(self.dead_letter_failed(&token, error));
        }
        let eos = self
            .mode
            .transactions_mut()
            .expect("reports are transactional in exactly-once mode");
        let to_dead_letter = error.kind == DeliveryErrorKind::Permanent
            && !token.is_progress()
            && self.config.dead_letters.topic().is_some();
        if to_dead_letter && eos.refused.len() < MAX_REFUSED {
            self.effects
                .observe(Observation::Transaction(TransactionNote::Refused {
                    error: error.to_string(),
                    topic: Arc::clone(&token.topic),
                    lsn: token.lsn,
                }));
            eos.refused.insert((token.lsn, token.index), error.clone());
            eos.doom(AbortCause::Refused(error), now);
            return Ok(());
        }
        if token.is_progress() && error.kind == DeliveryErrorKind::Permanent {
            // A refusal of the progress record itself (a fault of the
            // moment, as an injected one, or the topic's settings): the
            // transaction is written again, a few times.
            eos.progress_refusals += 1;
            if eos.progress_refusals >= PROGRESS_REFUSALS {
                return Err(RunError::Transactions(TransactionsError::ProgressRefused {
                    topic: eos.config.progress_topic.clone(),
                    times: eos.progress_refusals,
                    error,
                }));
            }
            eos.doom(AbortCause::RecordFailed(error), now);
            return Ok(());
        }
        if error.kind == DeliveryErrorKind::Fenced {
            // Another instance with this transactional id took over.
            return Err(RunError::Fenced {
                id: eos.config.transactional_id.clone(),
                detail: error.message,
            });
        }
        if matches!(
            error.kind,
            DeliveryErrorKind::Permanent | DeliveryErrorKind::Fatal
        ) {
            return Err(self.delivery_failed(&token, error));
        }
        // The other records of the transaction fail too, each with its
        // reason: all are heard before the session ends, so an event refused
        // for good is known as such, whichever report comes first.
        eos.doom(AbortCause::RecordFailed(error), now);
        Ok(())
    }

    /// Exactly-once: a failed transaction ends the session once every record
    /// sent in it has reported (`in_flight` is 0) or [`DOOMED_WAIT`] passed.
    fn doomed_and_heard(&self, in_flight: usize, now: Instant) -> Option<RunError> {
        let (why, since) = self.mode.transactions()?.doomed.as_ref()?;
        let heard = in_flight == 0 || now - *since >= DOOMED_WAIT;
        heard.then(|| RunError::Aborted(why.clone()))
    }

    /// When the failed transaction stops waiting for its reports.
    pub(super) fn doomed_until(&self) -> Option<Instant> {
        let (_, since) = self.mode.transactions()?.doomed.as_ref()?;
        Some(*since + DOOMED_WAIT)
    }

    /// True while records may not be sent (the transaction commits, or failed).
    pub(in crate::relay) fn commit_under_way(&self) -> bool {
        self.mode
            .transactions()
            .is_some_and(Transactions::committing)
    }

    /// True while nothing new may be read: the transaction closes, commits
    /// or failed.
    pub(in crate::relay) fn transaction_busy(&self) -> bool {
        self.mode.transactions().is_some_and(Transactions::busy)
    }

    /// When the open transaction reaches its time bound.
    pub(in crate::relay) fn transaction_due(&self) -> Option<Instant> {
        self.mode.transactions().and_then(Transactions::due)
    }

    /// True when the open transaction holds all it may: a read stops there.
    pub(in crate::relay) fn transaction_full(&self) -> bool {
        self.mode.transactions().is_some_and(Transactions::full)
    }

    /// True when no Kafka transaction is open (always, in at-least-once mode).
    pub(in crate::relay) fn transaction_idle(&self) -> bool {
        self.mode.transactions().is_none_or(Transactions::idle)
    }

    /// Forgets the open Kafka transaction without ending it (shutting down
    /// past its bound): the next start's `init_transactions` aborts it.
    pub(in crate::relay) fn abandon_transaction(&mut self) {
        if let Some(eos) = self.mode.transactions_mut() {
            eos.abandon();
        }
    }

    /// At a session's end: true when a Kafka transaction is open and must be
    /// aborted (so the next session starts a new one; its events are written
    /// again then). Its progress record, if queued, is dropped.
    pub(in crate::relay) fn abort_needed(&mut self) -> bool {
        let Some(eos) = self.mode.transactions_mut() else {
            return false;
        };
        if eos.idle() {
            return false;
        }
        eos.txn = KafkaTxn::Idle;
        self.outgoing.retain(|r| !r.token.is_progress());
        true
    }

    /// The outcome of the `attempt`th abort: `Ok(true)` when done,
    /// `Ok(false)` when it is to be called again (it timed out, as
    /// librdkafka asks), or why the producer cannot go on (a restart starts
    /// a new one, and its init completes what is open).
    pub(in crate::relay) fn on_aborted(
        &mut self,
        result: Result<(), TxnError>,
        attempt: u32,
    ) -> Result<bool, RunError> {
        let id = self
            .mode
            .transactions()
            .map_or("", |e| e.config.transactional_id.as_str());
        match result {
            Ok(()) => {
                self.effects
                    .observe(Observation::Transaction(TransactionNote::Aborted));
                Ok(true)
            }
            Err(e) if e.kind == TxnErrorKind::Retriable && attempt < ABORT_ATTEMPTS => {
                self.effects
                    .observe(Observation::Transaction(TransactionNote::AbortRetried {
                        error: e.to_string(),
                    }));
                Ok(false)
            }
            Err(e) if e.kind == TxnErrorKind::Fenced => Err(RunError::from_txn(id, e)),
            Err(e) => Err(RunError::Transactions(TransactionsError::AbortFailed(e))),
        }
    }
}

/// A source as the configuration names it.
fn source_name(source: Option<crate::config::EventSource>) -> &'static str {
    use crate::config::EventSource;
    match source {
        Some(EventSource::Table) => "table",
        Some(EventSource::Messages) => "messages",
        Some(EventSource::Both) => "both",
        None => "unknown",
    }
}

/// The committed progress lies past the end of the server's WAL: the server
/// was restored on the same timeline, and what it writes at those positions
/// now was never in Kafka.
fn wal_behind_the_record(recorded: &Position, server_wal: Lsn, effects: &mut Effects) {
    let change = HistoryChange::ProgressPastWal {
        recorded: recorded.to_string(),
        server_wal,
    };
    effects.observe(Observation::HistoryChanged(change));
}
