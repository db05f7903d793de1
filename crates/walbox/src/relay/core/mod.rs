//! The relay's core: everything the relay decides, synchronously and
//! without I/O, in quinn-proto's shape. It reads no clock (the driver
//! passes `now`, and the wall clock where latency is measured), writes no
//! log or metric, and sends nothing: inputs go in through `on_*`/`handle_*`
//! methods, and what it asks for comes out of [`Core::poll_effect`] (in the
//! order decided), [`Core::take_send`] (records, as room allows) and
//! [`Core::poll_timeout`] (when to wake it). The session (`session/`) is
//! the driver that does the I/O; the tests (`core/tests/`) drive it on a
//! clock they move by hand.
//!
//! | input                                   | method                          | effects                                    |
//! |-----------------------------------------|---------------------------------|--------------------------------------------|
//! | a session started                       | [`Core::start_session`]         | exactly-once: register, read the progress  |
//! | the committed progress read             | [`Core::on_progress_read`]      | stop (unreadable, or another source)       |
//! | a replication message                   | [`Core::handle_input`]              | records queued; status                     |
//! | a backfill's row (and its relation)     | [`Core::handle_input`]              | its record queued; status                  |
//! | a delivery report                       | [`Core::handle_report`]             | status; a dead-letter copy queued; stop    |
//! | a coverage reading                      | [`Core::on_coverage`]           | status; stop (drift)                       |
//! | the time asked for came                 | [`Core::handle_timeout`]        | status                                     |
//! | a record at the front, at a start       | [`Core::check_front`]           | skip it (the broker has it); read a topic back |
//! | a topic read back                       | [`Core::on_tail`]               | —                                          |
//! | room for the first queued record        | [`Core::take_send`]             | send it (exactly-once: begin a transaction first) |
//! | a turn of the driver (exactly-once)     | [`Core::upkeep`]                | progress record queued; [`Effect::Commit`]; stop |
//! | a commit's outcome                      | [`Core::on_committed`]          | status (the events are delivered); stop    |
//! | the session ends                        | [`Core::abort_needed`]          | abort the open Kafka transaction           |
//! | the slot sampled                        | [`Core::position_to_save`]      | save the delivered position                |
//!
//! Every input may also add [`Observation`]s (metrics, log lines, receipts,
//! spans ended, the audit's samples), written by `session/observe.rs`.
//! "Stop with this error" is the `Err` of the input's call. The delivery
//! rule itself (what may be confirmed) is
//! [`Progress`](crate::progress::Progress)'s; the core routes events and
//! reports to it. Two decisions still reach outside as the event is mapped:
//! its span's ids are drawn ([`crate::spans::Spans::begin`]) and the
//! audit's request for a sample is taken ([`crate::continuous_audit::Tap::take`]).

mod coverage;
mod effect;
mod exactly_once;
mod message;
mod quarantine;
mod report;
mod resume;
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
use crate::progress::{History, Progress, EAGER_GAP};

pub(super) use effect::{Effect, HistoryChange, Observation, ProgressNote, Split, TransactionNote};
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

/// The effects decided and not yet read by the driver.
#[derive(Debug, Default)]
pub(super) struct Effects(VecDeque<Effect>);

impl Effects {
    fn observe(&mut self, observation: Observation) {
        self.0.push_back(Effect::Observe(observation));
    }

    fn status(&mut self, update: Option<StandbyStatusUpdate>) {
        if let Some(update) = update {
            self.0.push_back(Effect::Status(update));
        }
    }

    fn push(&mut self, effect: Effect) {
        self.0.push_back(effect);
    }
}

/// What the driver sets the gauges from.
#[derive(Clone, Copy, Debug)]
pub(super) struct Positions {
    pub(super) received: Lsn,
    pub(super) confirmable: Lsn,
    pub(super) delivered_commit_time: Option<PgTimestamp>,
    pub(super) oldest_unacked_commit_time: Option<PgTimestamp>,
}

/// The relay's state across sessions, and the current session's.
pub(super) struct Core<'a> {
    pub(super) config: &'a RelayConfig,
    /// What the driver is asked to do, in order.
    effects: Effects,
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
    /// When the frame being handled was read (`None` for a backfilled
    /// row): its events' [`Token`]s carry it.
    frame_at: Option<Instant>,
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
    /// How events count as delivered, with that mode's own state.
    mode: Mode,
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
    /// This session's server history, as records are marked with it.
    history_id: u64,
    /// This session's look-up of what the broker holds already
    /// (`skip_delivered`); `None`: off, or over.
    resume: Option<resume::Resume>,
}

/// How events count as delivered, each mode with its own state: an
/// at-least-once event never reaches exactly-once code.
#[derive(Debug)]
enum Mode {
    /// When the broker acknowledged them; `next_index` is the index of the
    /// open Postgres transaction's next event.
    AtLeastOnce { next_index: u64 },
    /// When their Kafka transaction committed (see `exactly_once.rs`).
    ExactlyOnce(Box<transactions::Transactions>),
}

impl Mode {
    fn transactions(&self) -> Option<&transactions::Transactions> {
        match self {
            Mode::AtLeastOnce { .. } => None,
            Mode::ExactlyOnce(t) => Some(t),
        }
    }

    fn transactions_mut(&mut self) -> Option<&mut transactions::Transactions> {
        match self {
            Mode::AtLeastOnce { .. } => None,
            Mode::ExactlyOnce(t) => Some(t),
        }
    }

    fn exactly_once(&self) -> bool {
        matches!(self, Mode::ExactlyOnce(_))
    }
}

impl<'a> Core<'a> {
    pub(super) fn new(config: &'a RelayConfig) -> Self {
        Core {
            config,
            effects: Effects::default(),
            progress: Progress::new(config.status_interval, EAGER_GAP),
            decoder: Decoder::new(1).expect("version 1 is supported"),
            outgoing: VecDeque::new(),
            outbox: HashMap::new(),
            commit_time: PgTimestamp::default(),
            queued_in_transaction: 0,
            frame_at: None,
            topics: Topics::default(),
            coverage: None,
            change_pending_since: None,
            history: None,
            domains: HashMap::new(),
            mode: match config.exactly_once.clone() {
                None => Mode::AtLeastOnce { next_index: 0 },
                Some(c) => Mode::ExactlyOnce(Box::new(transactions::Transactions::new(c))),
            },
            saved_position: None,
            save_failure_reported: false,
            nontransactional_reported: false,
            dead_lettered: 0,
            quarantine: config.quarantine.map(crate::quarantine::Quarantine::new),
            history_id: 0,
            resume: None,
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
                let change = HistoryChange::Timeline {
                    before: before.clone(),
                    now: history.to_owned(),
                };
                self.effects.observe(Observation::HistoryChanged(change));
                History::New
            }
            Some(_) if server_wal < delivered => {
                let change = HistoryChange::WalBehind {
                    server_wal,
                    delivered,
                };
                self.effects.observe(Observation::HistoryChanged(change));
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
            self.effects.observe(Observation::SlotBehind {
                slot: confirmed,
                delivered,
            });
        }
        self.decoder = Decoder::new(1).expect("version 1 is supported");
        self.outgoing.clear();
        self.outbox.clear();
        self.domains = domains;
        if let Some(q) = &mut self.quarantine {
            q.start_session();
        }
        self.history_id = sink_core::tail::history_id(history);
        self.start_resume(resume::ResumeStart {
            stream: &self.config.stream,
            history: self.history_id,
            confirmed,
            server_wal,
        });
        self.start_transactions(history, server_wal, same)
    }

    /// One input of a stream (not [`Input::End`], which the session
    /// handles), received at `now` (`wall` on the wall clock).
    pub(super) fn handle_input(
        &mut self,
        input: Input,
        now: Instant,
        wall: PgTimestamp,
    ) -> Result<(), RunError> {
        match input {
            Input::Message(message) => self.on_message(message, now, wall),
            Input::Relation(relation) => {
                self.on_relation(&relation);
                Ok(())
            }
            Input::Row(row) => self.on_row(row, now),
            Input::End => Ok(()),
        }
    }

    /// The next thing the core asks for, in the order decided.
    pub(super) fn poll_effect(&mut self) -> Option<Effect> {
        self.effects.0.pop_front()
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
        self.outgoing.front_mut().filter(|r| r.token.to_serialize())
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
        let (record, token) = self
            .outgoing
            .pop_front()
            .expect("a record is waiting")
            .split_token();
        let lsn = token.lsn;
        let topic = Arc::clone(&token.topic);
        let record =
            record.with_token(token.into_dead_letter(crate::dead_letter::DeadLetterKind::Invalid));
        let text = error.to_string();
        match self.config.dead_letters.invalid(&error, record, lsn) {
            Some(copy) => {
                self.effects.observe(Observation::DeadLettering {
                    why: "dead-lettering an event that does not match its schema",
                    error: text,
                    topic: Some(topic),
                    lsn,
                    dead_letter_topic: Arc::clone(&copy.topic),
                });
                self.outgoing.push_front(copy);
                Ok(())
            }
            None => {
                self.effects.observe(Observation::Stopping {
                    what: "an event does not match its schema",
                    error: text,
                    lsn,
                });
                Err(RunError::Schema(error))
            }
        }
    }

    /// The first waiting record, now that there is room for it (exactly-once:
    /// inside the open Kafka transaction, which it may have to begin).
    pub(super) fn take_send(&mut self, now: Instant) -> Option<ToSend> {
        let mut record = self.outgoing.pop_front()?;
        record.token.sent = Some(now);
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

    /// When the core wants [`Core::handle_timeout`] next: a status update
    /// due, or (exactly-once) the open transaction's time bound while
    /// nothing waits to be sent (it closes only then), or the end of a
    /// failed transaction's wait for its reports. `None`: at once.
    pub(super) fn poll_timeout(&self) -> Option<Instant> {
        let mut due = self.progress.next_due()?;
        if self.outgoing.is_empty() {
            if let Some(bound) = self.transaction_due() {
                due = due.min(bound);
            }
        }
        if let Some(until) = self.doomed_until() {
            due = due.min(until);
        }
        Some(due)
    }

    /// The time asked for by [`Core::poll_timeout`] came (`reply_requested`:
    /// the status update asks the server for a reply). What is due in
    /// exactly-once mode follows at [`Core::upkeep`].
    pub(super) fn handle_timeout(&mut self, now: Instant, reply_requested: bool) {
        let mut update = self.progress.tick(now);
        if let Some(u) = &mut update {
            u.reply_requested = reply_requested;
        }
        self.effects.status(update);
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
        self.mode.exactly_once()
    }

    /// Whether reading should pause after the received messages ran out:
    /// the open (or last) transaction committed more than [`BEHIND`] ago,
    /// so walbox is draining a backlog the walsender sends as fast as it
    /// can. Its socket then fills while walbox waits, and the next turn
    /// reads many events at once instead of waking per event (pgoutput
    /// sends each change with its own write); the latency added is within
    /// the lag there already is. Live, nothing pauses.
    pub(super) fn behind(&self, wall: PgTimestamp) -> bool {
        let age = wall.as_unix_micros() - self.commit_time.as_unix_micros();
        self.commit_time != PgTimestamp::default() && age > BEHIND.as_micros() as i64
    }

    /// The positions and commit times the gauges show.
    pub(super) fn positions(&self) -> Positions {
        Positions {
            received: self.progress.received_lsn(),
            confirmable: self.progress.confirmable(),
            delivered_commit_time: self.progress.delivered_commit_time().map(|(_, t)| t),
            oldest_unacked_commit_time: self.progress.oldest_unacked_commit_time(),
        }
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
                    self.effects.observe(Observation::PositionSavedAgain);
                    self.save_failure_reported = false;
                }
            }
            Err(e) if !self.save_failure_reported => {
                self.save_failure_reported = true;
                self.effects.observe(Observation::PositionNotSaved {
                    error: e.to_string(),
                });
            }
            Err(_) => {}
        }
    }
}
