//! The relay's core: everything the relay decides, synchronously and
//! without I/O. The session (`session/`) feeds it inputs and carries out
//! the effects it asks for; tests feed it frames and read the effects.
//!
//! | input                                   | method                          | effects                                    |
//! |-----------------------------------------|---------------------------------|--------------------------------------------|
//! | a session started                       | [`Core::start_session`]         | exactly-once: register, read the progress  |
//! | the committed progress read             | [`Core::on_progress_read`]      | stop (unreadable, or another source)       |
//! | a replication message                   | [`Core::on_message`]            | records queued; a status update            |
//! | a backfill's row (and its relation)     | [`Core::on_row`], [`Core::on_relation`] | its record queued; a status update |
//! | a delivery report                       | [`Core::on_report`]             | a status update; a dead-letter copy queued; stop |
//! | a coverage reading                      | [`Core::on_coverage`]           | a status update; stop (drift)              |
//! | a tick of the status timer              | [`Core::tick`]                  | a status update                            |
//! | room for the first queued record        | [`Core::take_send`]             | send it (exactly-once: begin a transaction first) |
//! | a turn of the loop (exactly-once)       | [`Core::close_if_due`], [`Core::start_commit`] | progress record queued; commit |
//! | a commit's outcome                      | [`Core::on_committed`]          | a status update (the events are delivered); stop |
//! | the session ends                        | [`Core::abort_needed`]          | abort the open Kafka transaction           |
//! | the slot sampled                        | [`Core::position_to_save`]      | save the delivered position                |
//!
//! A status update is returned (`Option<StandbyStatusUpdate>`); "stop with
//! this error" is the `Err` of the same call; records to send wait in the
//! core's queue until the session has room for them ([`Core::waiting`]).
//! The delivery rule itself (what may be confirmed) is
//! [`Progress`](crate::progress::Progress)'s; the core routes events and
//! reports to it.

mod coverage;
mod exactly_once;
mod message;
mod quarantine;
mod report;
mod transactions;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use pgoutput_decoder::{Decoder, Lsn, PgTimestamp, StandbyStatusUpdate};
use sink_core::Record;
use slot_manager::Coverage;
use tokio::time::Instant;

use super::{Input, RelayConfig, RunError, Token};
use crate::mapping::{ColumnIndexes, MapError, Topics};
use crate::metrics::Metrics;
use crate::progress::{History, Progress, EAGER_GAP};

pub(super) use exactly_once::EosStartup;

/// How old the transaction being read must be for walbox to count as
/// draining a backlog.
const BEHIND: std::time::Duration = std::time::Duration::from_millis(100);

/// What a session learned as it started.
pub(super) struct SessionStart<'s> {
    /// The slot's confirmed position.
    pub(super) confirmed: Lsn,
    /// The server's history (system identifier and timeline).
    pub(super) history: &'s str,
    /// The server's WAL position as the session started.
    pub(super) server_wal: Lsn,
    /// The outbox table's domain types (OID → base OID).
    pub(super) domains: HashMap<u32, u32>,
}

/// A record to send now.
pub(super) struct ToSend {
    /// Exactly-once: a Kafka transaction must be begun before it.
    pub(super) begin_transaction: bool,
    pub(super) record: Record<Token>,
}

/// The relay's state across sessions, and the current session's.
pub(super) struct Core<'a> {
    pub(super) config: &'a RelayConfig,
    pub(super) metrics: Arc<Metrics>,
    /// The one owner of what may be confirmed.
    progress: Progress,
    /// This session's decoder.
    decoder: Decoder,
    /// Records waiting for room: the event just mapped, dead-letter copies,
    /// progress records.
    outgoing: VecDeque<Record<Token>>,
    /// Outbox relations by OID (the root table; partitions publish as the
    /// root), resolved from this session's Relation messages.
    outbox: HashMap<u32, Arc<Result<ColumnIndexes, MapError>>>,
    /// The open transaction's commit time (from Begin).
    commit_time: PgTimestamp,
    /// Events the open transaction queued so far (for commit to read).
    queued_in_transaction: u64,
    /// Topic names by aggregate type, shared by the records and tokens of
    /// their events.
    topics: Topics,
    /// The last reading of the publication's coverage of the outbox table
    /// (kept across sessions: a change between two sessions is a change).
    coverage: Option<Coverage>,
    /// Since when readings find a change of the coverage in flight, and
    /// whether that was reported.
    change_pending_since: Option<(Instant, bool)>,
    /// The server history of the last session.
    history: Option<String>,
    /// This session's domain types of the outbox table (OID → base OID).
    domains: HashMap<u32, u32>,
    /// Exactly-once mode's state; `None` in at-least-once mode.
    eos: Option<transactions::Transactions>,
    /// The position last saved (`config.save_positions`), and whether a
    /// failure to save was reported.
    saved_position: Option<Lsn>,
    save_failure_reported: bool,
    /// A non-transactional message with the events' prefix was reported.
    nontransactional_reported: bool,
    /// Dead-letter copies delivered.
    dead_lettered: u64,
    /// The quarantine (`on_failure = "quarantine"`); `None`: off.
    quarantine: Option<crate::quarantine::Quarantine<Token>>,
    /// At least once: the index of the open transaction's next event.
    event_index: u64,
}

impl<'a> Core<'a> {
    pub(super) fn new(config: &'a RelayConfig, metrics: Arc<Metrics>) -> Self {
        Core {
            config,
            metrics,
            progress: Progress::new(config.status_interval, EAGER_GAP),
            decoder: Decoder::new(1).expect("version 1 is supported"),
            outgoing: VecDeque::new(),
            outbox: HashMap::new(),
            commit_time: PgTimestamp::default(),
            queued_in_transaction: 0,
            topics: Topics::default(),
            coverage: None,
            change_pending_since: None,
            history: None,
            domains: HashMap::new(),
            eos: config
                .exactly_once
                .clone()
                .map(transactions::Transactions::new),
            saved_position: None,
            save_failure_reported: false,
            nontransactional_reported: false,
            dead_lettered: 0,
            quarantine: config.quarantine.map(crate::quarantine::Quarantine::new),
            event_index: 0,
        }
    }

    /// A session started: compares its server history with the last
    /// session's, resumes the progress at the slot's position, forgets the
    /// last session's relations and queued records. Returns what exactly-once
    /// mode must do before streaming.
    pub(super) fn start_session(&mut self, start: SessionStart<'_>) -> EosStartup {
        let SessionStart {
            confirmed,
            history,
            server_wal,
            domains,
        } = start;
        let delivered = self.progress.delivered();
        let same = match &self.history {
            Some(before) if before != history => {
                tracing::warn!(before = %before, now = %history, "the server's history changed (failover or restore): resuming from the slot's position");
                self.metrics.count_history_change("timeline");
                History::New
            }
            Some(_) if server_wal < delivered => {
                tracing::warn!(server_wal = %server_wal, %delivered, "the server's WAL ends before what walbox delivered: it was restored on the same timeline (a disk snapshot, or a backup started without recovery); its transactions at those positions are new, resuming from the slot's position");
                self.metrics.count_history_change("wal_behind");
                History::New
            }
            _ => History::Same,
        };
        self.history = Some(history.to_owned());
        if same == History::New {
            // The last reading's WAL position belongs to the old history:
            // it verifies nothing here. Coverage starts over from a baseline.
            self.coverage = None;
        }
        if let Some(delivered) = self.progress.start_session(confirmed, same) {
            tracing::warn!(slot = %confirmed, %delivered, "the slot resumed before what walbox confirmed (Postgres restarted before a checkpoint?); transactions up to the confirmed position are skipped, not sent twice");
        }
        self.decoder = Decoder::new(1).expect("version 1 is supported");
        self.outgoing.clear();
        self.outbox.clear();
        self.domains = domains;
        if let Some(q) = &mut self.quarantine {
            q.start_session();
        }
        self.start_transactions(history, server_wal, same)
    }

    /// One input of a stream (not [`Input::End`], which the session
    /// handles); returns the status update due, if any.
    pub(super) fn on_input(
        &mut self,
        input: Input,
        now: Instant,
    ) -> Result<Option<StandbyStatusUpdate>, RunError> {
        match input {
            Input::Message(message) => self.on_message(message, now),
            Input::Relation(relation) => {
                self.on_relation(&relation);
                Ok(None)
            }
            Input::Row(row) => self.on_row(row, now),
            Input::End => Ok(None),
        }
    }

    /// Dead-letter copies delivered so far.
    pub(super) fn dead_lettered(&self) -> u64 {
        self.dead_lettered
    }

    /// The size of the first record waiting to be sent, if any.
    pub(super) fn waiting(&self) -> Option<usize> {
        self.outgoing.front().map(Record::size)
    }

    /// The first waiting record, to be serialized or claim-checked in
    /// place.
    pub(super) fn front_mut(&mut self) -> Option<&mut Record<Token>> {
        self.outgoing.front_mut()
    }

    /// The first waiting record, when it is an event's (not a dead-letter
    /// copy nor a progress record) whose value is not serialized with its
    /// schema yet. A record released from the quarantine that the broker
    /// had refused is marked serialized: it is released as it was sent
    /// (serialized, or a claim-check pointer).
    pub(super) fn front_to_serialize(&mut self) -> Option<&mut Record<Token>> {
        self.outgoing.front_mut().filter(|r| {
            let t = &r.token;
            !t.serialized && t.dead_letter.is_none() && !t.progress_record
        })
    }

    /// The first waiting record's payload does not fit its schema: it
    /// follows the failure policy like a refused one (its dead-letter copy
    /// takes its place, or walbox stops with the slot before it; with the
    /// quarantine, it holds its aggregate, and a released one stops its
    /// release).
    pub(super) fn front_invalid(
        &mut self,
        error: crate::schema_registry::SchemaError,
    ) -> Result<(), RunError> {
        if self.quarantines() {
            return self.hold_invalid(error);
        }
        let mut record = self.outgoing.pop_front().expect("a record is waiting");
        let lsn = record.token.lsn;
        record.token.dead_letter = Some(crate::dead_letter::DeadLetterKind::Invalid);
        record.token.sampled = false;
        let topic = Arc::clone(&record.token.topic);
        match self.config.dead_letters.invalid(&error, record, lsn) {
            Some(copy) => {
                tracing::warn!(%error, %topic, %lsn, dead_letter_topic = %copy.topic, "dead-lettering an event that does not match its schema");
                self.outgoing.push_front(copy);
                Ok(())
            }
            None => {
                tracing::error!(%error, %topic, %lsn, "an event does not match its schema");
                Err(RunError::Schema(error))
            }
        }
    }

    /// The first waiting record, now that there is room for it (exactly-once:
    /// inside the open Kafka transaction, which it may have to begin).
    pub(super) fn take_send(&mut self, now: Instant) -> Option<ToSend> {
        let record = self.outgoing.pop_front()?;
        let begin_transaction = self.before_send(&record, now);
        Some(ToSend {
            begin_transaction,
            record,
        })
    }

    /// Exactly-once, shutting down: records not yet sent are dropped (what
    /// is confirmed is what committed; a record sent now would open a Kafka
    /// transaction nobody commits).
    pub(super) fn drop_waiting(&mut self) {
        self.outgoing.clear();
    }

    /// A tick of the status timer: the status update due, if any.
    pub(super) fn tick(&mut self, now: Instant) -> Option<StandbyStatusUpdate> {
        self.progress.tick(now)
    }

    /// When the next status update is due.
    pub(super) fn next_status_due(&self) -> Instant {
        self.progress.next_due()
    }

    /// The last status update of a session: everything confirmable now.
    pub(super) fn final_update(&mut self, now: Instant) -> StandbyStatusUpdate {
        self.progress.final_update(now)
    }

    /// True while a Postgres transaction is open in the stream.
    pub(super) fn in_transaction(&self) -> bool {
        self.progress.in_transaction()
    }

    /// Events sent or queued and not acknowledged yet.
    pub(super) fn unacked_events(&self) -> u64 {
        self.progress.unacked_events()
    }

    /// True while delivered events wait for the coverage to be verified.
    pub(super) fn awaiting_coverage(&self) -> bool {
        self.progress.delivered() > self.progress.confirmable()
    }

    /// True in exactly-once mode.
    pub(super) fn exactly_once(&self) -> bool {
        self.eos.is_some()
    }

    /// Whether reading should pause after the received messages ran out:
    /// the open (or last) transaction committed more than [`BEHIND`] ago,
    /// so walbox is draining a backlog the walsender sends as fast as it
    /// can. Its socket then fills while walbox waits, and the next turn
    /// reads many events at once instead of waking per event (pgoutput
    /// sends each change with its own write); the latency added is within
    /// the lag there already is. Live, nothing pauses.
    pub(super) fn behind(&self) -> bool {
        let age = PgTimestamp::now().as_unix_micros() - self.commit_time.as_unix_micros();
        self.commit_time != PgTimestamp::default() && age > BEHIND.as_micros() as i64
    }

    /// The gauges: what is in flight (the destination's count and bytes),
    /// positions, commit times.
    pub(super) fn update_gauges(&self, in_flight: usize, in_flight_bytes: usize) {
        let m = &self.metrics;
        m.in_flight_events.set(in_flight as i64);
        m.in_flight_bytes.set(in_flight_bytes as i64);
        m.received_lsn
            .set(self.progress.received_lsn().as_u64() as i64);
        m.confirmed_lsn
            .set(self.progress.confirmable().as_u64() as i64);
        m.set_commit_times(
            self.progress.delivered_commit_time().map(|(_, t)| t),
            self.progress.oldest_unacked_commit_time(),
        );
    }

    /// The delivered position and its commit time, when it moved since the
    /// last save (`save_positions`).
    pub(super) fn position_to_save(&self) -> Option<(Lsn, PgTimestamp)> {
        if !self.config.save_positions {
            return None;
        }
        let (delivered, committed) = self.progress.delivered_commit_time()?;
        (self.saved_position != Some(delivered)).then_some((delivered, committed))
    }

    /// The outcome of saving `position`. A failure is reported once and
    /// does not stop streaming: it only leaves the saved position older
    /// (more events republished if the slot is ever lost, never fewer).
    pub(super) fn on_position_saved(
        &mut self,
        position: Lsn,
        result: Result<(), super::SourceError>,
    ) {
        match result {
            Ok(()) => {
                self.saved_position = Some(position);
                if self.save_failure_reported {
                    tracing::info!("saving the delivered position in walbox.positions again");
                    self.save_failure_reported = false;
                }
            }
            Err(e) if !self.save_failure_reported => {
                self.save_failure_reported = true;
                tracing::warn!(error = %e, "cannot save the delivered position in walbox.positions: should the slot be lost, walbox republishes from the last position saved, or cannot recreate it (grant walbox's role INSERT and UPDATE on walbox.positions, or CREATE on the database)");
            }
            Err(_) => {}
        }
    }
}
