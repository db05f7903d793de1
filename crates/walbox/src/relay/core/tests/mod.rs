//! The core alone, synchronously: frames in, effects out. No runtime, no
//! fakes of the two ends: a test states the messages the server sends and
//! the reports the broker gives, and reads what the core asks for (records
//! to send, status updates, commits, the position it would confirm, the
//! error it stops with). Time is the [`Harness`]'s: it moves only when the
//! test says so (the core reads no clock).

use std::collections::HashMap;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pgoutput_decoder::test_util as frames;
use pgoutput_decoder::{Lsn, PgTimestamp, ReplicationMessage};
use sink_core::{Delivered, Record, Report, TxnError};
use slot_manager::{ChangeInFlight, Coverage};
use tokio::time::Instant;

mod delivery;
mod exactly_once;
mod messages;
mod relations;
mod sessions;
mod tables;

use super::{Core, Effect, EosStartup, SessionStart, ToSend};
use crate::config::EventSource;
use crate::dead_letter::{DeadLetterKind, DeadLetters};
use crate::exactly_once::{Bounds, ExactlyOnce};
use crate::metrics::Metrics;
use crate::relay::{RelayConfig, RunError, Token};

/// The core on a clock the test moves (quinn's `Pair`, with one end): each
/// input goes in at the harness's time, and every effect the core asks for
/// is read back at once: status updates and commits kept for the test,
/// observations written to [`Harness::metrics`] by the driver's own
/// `observe`. Other methods of the core are reached through `Deref`.
pub(super) struct Harness<'a> {
    core: Core<'a>,
    /// The simulated clocks: monotonic and wall, moved together.
    now: Instant,
    wall: PgTimestamp,
    /// Status updates asked for, in order.
    pub(super) statuses: Vec<pgoutput_decoder::StandbyStatusUpdate>,
    /// Commits asked for.
    pub(super) commits: usize,
    metrics: Arc<Metrics>,
}

impl<'a> Harness<'a> {
    pub(super) fn new(config: &'a RelayConfig) -> Self {
        Harness {
            core: Core::new(config),
            now: Instant::now(),
            wall: PgTimestamp::from_pg_micros(1_000_000_000),
            statuses: Vec::new(),
            commits: 0,
            metrics: Metrics::new(),
        }
    }

    /// The harness's time.
    pub(super) fn now(&self) -> Instant {
        self.now
    }

    /// Moves both clocks forward by `by`.
    pub(super) fn advance(&mut self, by: Duration) {
        self.now += by;
        self.wall = PgTimestamp::from_pg_micros(self.wall.as_pg_micros() + by.as_micros() as i64);
    }

    /// Reads every effect the core asked for.
    fn pump(&mut self) {
        while let Some(effect) = self.core.poll_effect() {
            match effect {
                Effect::Status(update) => self.statuses.push(update),
                Effect::Commit => self.commits += 1,
                Effect::Observe(o) => {
                    crate::relay::session::observe::observe(self.core.config, &self.metrics, o);
                }
            }
        }
    }

    /// The metrics, with every observation so far written.
    pub(super) fn metrics(&mut self) -> &Metrics {
        self.pump();
        &self.metrics
    }

    pub(super) fn message(&mut self, frame: ReplicationMessage) -> Result<(), RunError> {
        let result = self.core.on_message(frame, self.now, self.wall);
        self.pump();
        result
    }

    pub(super) fn report(&mut self, report: Report<Token>) -> Result<(), RunError> {
        let result = self.core.handle_report(report, self.now, self.wall);
        self.pump();
        result
    }

    pub(super) fn coverage(&mut self, reading: Coverage) -> Result<(), RunError> {
        let result = self.core.on_coverage(reading, self.now);
        self.pump();
        result
    }

    /// The time the core asked for came, or passed.
    pub(super) fn timeout(&mut self) {
        self.core.handle_timeout(self.now, false);
        self.pump();
    }

    /// A turn of the driver (exactly-once), `in_flight` records unreported.
    pub(super) fn upkeep(&mut self, finishing: bool, in_flight: usize) -> Result<(), RunError> {
        let result = self.core.upkeep(self.now, finishing, in_flight);
        self.pump();
        result
    }

    /// The outcome of the commit asked for.
    pub(super) fn committed(&mut self, result: Result<(), TxnError>) -> Result<(), RunError> {
        assert!(self.commits > 0, "a commit was asked for");
        self.commits -= 1;
        let result = self.core.on_committed(result, self.now, self.wall);
        self.pump();
        result
    }

    /// The first waiting record, sent now.
    pub(super) fn take_send(&mut self) -> Option<ToSend> {
        self.core.take_send(self.now)
    }
}

impl<'a> Deref for Harness<'a> {
    type Target = Core<'a>;
    fn deref(&self) -> &Core<'a> {
        &self.core
    }
}

impl DerefMut for Harness<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.core
    }
}

const OUTBOX: u32 = 16_384;
const HISTORY: &str = "7000000000000000001/1";

/// The relay tests' configuration (topic `events`, no headers or
/// timestamp column), without saving positions, with `exactly_once`.
pub(super) fn config(dead_letters: DeadLetters, exactly_once: Option<ExactlyOnce>) -> RelayConfig {
    RelayConfig {
        stream: std::sync::Arc::from("walbox"),
        exactly_once,
        skip_delivered: None,
        save_positions: false,
        ..crate::relay::tests::config(dead_letters)
    }
}

pub(super) fn transactions(max_events: usize) -> Option<ExactlyOnce> {
    Some(ExactlyOnce {
        progress_topic: "progress".into(),
        transactional_id: "walbox-test".into(),
        slot: "walbox".into(),
        source: EventSource::Table,
        bounds: Bounds {
            max_events,
            max_bytes: 1 << 20,
            max_time: Duration::from_secs(60),
        },
    })
}

pub(super) fn at(lsn: u64) -> Lsn {
    Lsn::from(lsn)
}

fn xlog(lsn: u64, data: Bytes) -> ReplicationMessage {
    frames::xlog(at(lsn), at(lsn), data)
}

/// The frames of one transaction committing at `commit` (ending at
/// `commit + 8`) with one outbox row per `(lsn, id, aggregate id)`.
fn transaction(commit: u64, rows: &[(u64, &str, Option<&str>)]) -> Vec<ReplicationMessage> {
    let time = PgTimestamp::from_pg_micros(1_000);
    let columns = [
        ("id", 2950),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("event_type", 25),
        ("payload", 3802),
    ];
    let mut frames = vec![
        xlog(commit - 100, frames::begin(at(commit), time, 700)),
        xlog(
            commit - 100,
            frames::relation(OUTBOX, "public", "outbox_events", &columns),
        ),
    ];
    for (lsn, id, aggregate) in rows {
        let values = [
            Some(*id),
            Some("order"),
            *aggregate,
            Some("Created"),
            Some(r#"{"n":1}"#),
        ];
        frames.push(xlog(*lsn, frames::insert(OUTBOX, &values)));
    }
    frames.push(frames::xlog(
        at(commit),
        at(commit + 8),
        frames::commit(at(commit), at(commit + 8), time),
    ));
    frames
}

/// One transaction as the fakes' server sends it: Begin, a row per
/// `(id, aggregate id)` 10 apart from `final_lsn - 80` (all at
/// `final_lsn - 80` when `copy`, as a `COPY` writes them), Commit ending
/// at `final_lsn + 10`.
pub(super) fn rows(
    final_lsn: u64,
    events: &[(&str, Option<&str>)],
    copy: bool,
) -> Vec<ReplicationMessage> {
    use crate::relay::tests::fakes::{begin, commit, insert};
    let mut frames = vec![begin(final_lsn)];
    for (i, (id, key)) in events.iter().enumerate() {
        let at = final_lsn - 80 + if copy { 0 } else { 10 * i as u64 };
        frames.push(insert(at, id, *key, "{}"));
    }
    frames.push(commit(final_lsn, final_lsn + 10));
    frames
}

/// A reading that verifies the coverage up to `wal`.
pub(super) fn covered(wal: u64) -> Coverage {
    Coverage {
        wal_lsn: at(wal),
        table_oid: Some(OUTBOX),
        gap: None,
        fingerprint: "covered".into(),
        in_flight: ChangeInFlight::Nothing,
        tables: Vec::new(),
        added: Vec::new(),
    }
}

/// A core on `config` with a session started at the slot's position `slot`
/// (exactly-once: registered, no progress committed yet).
pub(super) fn started(config: &RelayConfig, slot: u64) -> Harness<'_> {
    let mut core = Harness::new(config);
    start(&mut core, slot);
    core.coverage(covered(1 << 20)).unwrap();
    core
}

pub(super) fn start(core: &mut Harness<'_>, slot: u64) {
    start_on(core, slot, HISTORY, 1 << 20);
}

/// A session at the slot's position `slot` on the server history
/// `history` whose WAL ends at `server_wal` (exactly-once: registered, no
/// progress committed yet).
pub(super) fn start_on(core: &mut Harness<'_>, slot: u64, history: &str, server_wal: u64) {
    let start = SessionStart {
        confirmed: at(slot),
        history,
        server_wal: at(server_wal),
        domains: HashMap::new(),
    };
    if let EosStartup::ReadProgress { .. } = core.start_session(start) {
        core.on_producer_registered();
        core.on_progress_read(Ok(None), at(server_wal)).unwrap();
    }
    core.pump();
}

pub(super) fn feed(core: &mut Harness<'_>, frames: Vec<ReplicationMessage>) {
    for frame in frames {
        core.message(frame).unwrap();
    }
}

/// The records the core asks to send now.
pub(super) fn records(core: &mut Harness<'_>) -> Vec<Record<Token>> {
    sends(core).into_iter().map(|s| s.record).collect()
}

/// The records the core asks to send now, each acknowledged.
pub(super) fn deliver(core: &mut Harness<'_>) -> Vec<Record<Token>> {
    let records = records(core);
    for r in &records {
        report(core, acked(r.token.clone())).unwrap();
    }
    records
}

/// Every record the core asks to send now.
pub(super) fn sends(core: &mut Harness<'_>) -> Vec<ToSend> {
    std::iter::from_fn(|| core.take_send()).collect()
}

pub(super) fn acked(token: Token) -> Report<Token> {
    Report {
        token,
        result: Ok(Delivered::Kafka {
            partition: 0,
            offset: 0,
        }),
        returned: None,
        client_micros: None,
    }
}

pub(super) use crate::relay::tests::fakes::refused;

pub(super) fn report(core: &mut Harness<'_>, report: Report<Token>) -> Result<(), RunError> {
    core.report(report)
}

/// The position the core would confirm now.
pub(super) fn confirmable(core: &mut Harness<'_>) -> u64 {
    let now = core.now();
    core.final_update(now).flush.as_u64()
}

fn header<'r>(record: &'r Record<Token>, name: &str) -> Option<&'r [u8]> {
    record
        .headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| h.value.as_ref())
}

#[test]
fn an_event_is_sent_keyed_and_confirmed_only_once_acked() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    feed(
        &mut core,
        transaction(1_000, &[(950, "e-1", Some("order-7"))]),
    );
    let mut sent = sends(&mut core);
    assert_eq!(sent.len(), 1);
    let send = sent.remove(0);
    assert!(!send.begin_transaction);
    let record = send.record;
    assert_eq!(&*record.topic, "events");
    assert_eq!(record.key.as_deref(), Some(&b"order-7"[..]));
    assert_eq!(header(&record, "id"), Some(&b"e-1"[..]));
    assert_eq!(record.value.as_deref(), Some(&br#"{"n":1}"#[..]));
    assert_eq!(
        confirmable(&mut core),
        0,
        "nothing confirmed before the ack"
    );
    report(&mut core, acked(record.token)).unwrap();
    assert_eq!(confirmable(&mut core), 1_008);
}

#[test]
fn the_slot_waits_for_the_oldest_unacked_event() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    feed(&mut core, transaction(2_000, &[(1_950, "e-2", Some("b"))]));
    let sent = sends(&mut core);
    let [first, second] = <[ToSend; 2]>::try_from(sent).ok().expect("two records");
    report(&mut core, acked(second.record.token)).unwrap();
    assert_eq!(confirmable(&mut core), 0, "the first event is not acked");
    report(&mut core, acked(first.record.token)).unwrap();
    assert_eq!(confirmable(&mut core), 2_008);
}

#[test]
fn a_refused_event_is_dead_lettered_before_the_slot_passes_it() {
    let config = config(DeadLetters::to_topic("dead"), None);
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let record = sends(&mut core).remove(0).record;
    report(&mut core, refused(record)).unwrap();
    assert_eq!(confirmable(&mut core), 0, "refused, not delivered");
    let copy = sends(&mut core).remove(0).record;
    assert_eq!(&*copy.topic, "dead");
    assert_eq!(copy.key.as_deref(), Some(&b"a"[..]));
    assert_eq!(copy.token.dead_letter(), Some(DeadLetterKind::Refused));
    report(&mut core, acked(copy.token)).unwrap();
    assert_eq!(confirmable(&mut core), 1_008);
}

#[test]
fn without_a_dead_letter_topic_a_refusal_stops_before_the_event() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let record = sends(&mut core).remove(0).record;
    let stopped = report(&mut core, refused(record)).unwrap_err();
    assert!(matches!(stopped, RunError::Delivery(_)), "{stopped}");
    assert_eq!(confirmable(&mut core), 0);
}

#[test]
fn an_unmappable_row_stops_before_it_without_a_dead_letter_topic() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    let mut frames = transaction(1_000, &[(950, "e-1", None)]);
    let commit = frames.pop().unwrap();
    let insert = frames.pop().unwrap();
    feed(&mut core, frames);
    let stopped = core.message(insert).unwrap_err();
    assert!(matches!(stopped, RunError::Map(_)), "{stopped}");
    drop(commit);
    assert_eq!(confirmable(&mut core), 0);
}

#[test]
fn a_replay_of_what_was_delivered_is_not_sent_again() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let record = sends(&mut core).remove(0).record;
    report(&mut core, acked(record.token)).unwrap();
    // The server restarted before a checkpoint: the slot resumes at 0.
    start(&mut core, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    assert!(sends(&mut core).is_empty(), "the replay is skipped");
    feed(&mut core, transaction(2_000, &[(1_950, "e-2", Some("a"))]));
    let next = sends(&mut core);
    assert_eq!(next.len(), 1);
    assert_eq!(header(&next[0].record, "id"), Some(&b"e-2"[..]));
}

#[test]
fn a_changed_coverage_stops_with_the_slot_before_what_it_could_hide() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let record = sends(&mut core).remove(0).record;
    report(&mut core, acked(record.token)).unwrap();
    let changed = Coverage {
        fingerprint: "recreated".into(),
        table_oid: Some(OUTBOX + 1),
        ..covered(1 << 21)
    };
    let stopped = core.coverage(changed).unwrap_err();
    assert!(matches!(stopped, RunError::Drift(_)), "{stopped}");
}

#[test]
fn exactly_once_events_are_delivered_only_when_their_transaction_commits() {
    let config = config(DeadLetters::halt(), transactions(1));
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let event = sends(&mut core).remove(0);
    assert!(
        event.begin_transaction,
        "the first record opens a transaction"
    );
    core.upkeep(false, 1).unwrap();
    assert_eq!(core.commits, 0, "its progress record is not sent yet");
    let progress = sends(&mut core).remove(0);
    assert!(!progress.begin_transaction);
    assert_eq!(&*progress.record.topic, "progress");
    core.upkeep(false, 2).unwrap();
    assert_eq!(core.commits, 0, "sent, not yet acknowledged");
    report(&mut core, acked(event.record.token)).unwrap();
    report(&mut core, acked(progress.record.token)).unwrap();
    core.upkeep(false, 0).unwrap();
    assert_eq!(core.commits, 1, "every record acknowledged: commit");
    assert_eq!(confirmable(&mut core), 0, "acked but not committed");
    core.committed(Ok(())).unwrap();
    assert_eq!(confirmable(&mut core), 1_008);
}

#[test]
fn exactly_once_a_failed_commit_confirms_nothing_and_aborts() {
    let config = config(DeadLetters::halt(), transactions(1));
    let mut core = started(&config, 0);
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let event = sends(&mut core).remove(0);
    core.upkeep(false, 1).unwrap();
    let progress = sends(&mut core).remove(0);
    core.upkeep(false, 2).unwrap();
    report(&mut core, acked(event.record.token)).unwrap();
    report(&mut core, acked(progress.record.token)).unwrap();
    core.upkeep(false, 0).unwrap();
    let failed = TxnError {
        kind: sink_core::TxnErrorKind::Abortable,
        message: "Broker: Coordinator not available".into(),
    };
    core.committed(Err(failed)).unwrap();
    let stopped = core
        .upkeep(false, 0)
        .expect_err("every record reported: the session ends");
    assert!(matches!(stopped, RunError::Aborted(_)), "{stopped}");
    assert!(core.abort_needed(), "the transaction is aborted");
    assert_eq!(confirmable(&mut core), 0);
}

/// A backfill's row of `relation` (the catalog's columns, OID 0).
fn row(n: u64, id: &str, aggregate: Option<&str>) -> crate::relay::CopiedRow {
    let values = [
        Some(id),
        Some("order"),
        aggregate,
        Some("Created"),
        Some(r#"{"n":1}"#),
    ];
    crate::relay::CopiedRow {
        n,
        relation: 0,
        tuple: pgoutput_decoder::TupleData::from_text(values.iter().map(|v| v.map(str::as_bytes)))
            .unwrap(),
        lsn: at(77),
    }
}

#[test]
fn backfilled_rows_go_the_same_way_and_confirm_the_delivered_prefix() {
    let config = config(DeadLetters::to_topic("dead"), None);
    let mut core = started(&config, 10);
    let relation = pgoutput_decoder::RelationBody::from_catalog(
        0,
        "public",
        "outbox_events",
        [
            ("id", 2950),
            ("aggregate_type", 25),
            ("aggregate_id", 25),
            ("event_type", 25),
            ("payload", 3802),
        ]
        .map(|(n, t)| (n.to_owned(), t)),
    );
    core.on_relation(&relation);
    let now = core.now();
    core.on_row(row(11, "e-11", Some("a")), now).unwrap();
    // No aggregate id: unmappable, dead-lettered.
    core.on_row(row(12, "e-12", None), now).unwrap();
    core.on_row(row(13, "e-13", Some("b")), now).unwrap();
    let [first, unmappable, third] = <[ToSend; 3]>::try_from(sends(&mut core))
        .ok()
        .expect("three records");
    assert_eq!(header(&first.record, "id"), Some(&b"e-11"[..]));
    assert_eq!(&*unmappable.record.topic, "dead");
    assert_eq!(
        unmappable.record.token.dead_letter(),
        Some(DeadLetterKind::Unmappable)
    );
    report(&mut core, acked(third.record.token)).unwrap();
    report(&mut core, acked(first.record.token)).unwrap();
    assert_eq!(confirmable(&mut core), 11, "row 12 is not delivered yet");
    report(&mut core, acked(unmappable.record.token)).unwrap();
    assert_eq!(confirmable(&mut core), 13);
    assert_eq!(core.dead_lettered(), 1);
}

/// On the test's own clock: status updates go out when the core asks to be
/// woken (`poll_timeout`), never between; an acknowledgement soon after the
/// last update is held back by the eager gap and goes out at its end.
#[test]
fn status_updates_go_out_when_the_core_asks_to_be_woken() {
    let config = config(DeadLetters::halt(), None);
    let mut core = started(&config, 0);
    core.timeout();
    let first = core.statuses.len();
    assert!(first > 0, "the first update goes out at once");
    let t0 = core.now();
    assert_eq!(
        core.poll_timeout(),
        Some(t0 + Duration::from_secs(1)),
        "the next one a status interval later"
    );
    feed(&mut core, transaction(1_000, &[(950, "e-1", Some("a"))]));
    let record = sends(&mut core).remove(0).record;
    core.advance(Duration::from_millis(10));
    report(&mut core, acked(record.token)).unwrap();
    assert_eq!(
        core.statuses.len(),
        first,
        "within the eager gap: held back"
    );
    let gap_end = t0 + crate::progress::EAGER_GAP;
    assert_eq!(core.poll_timeout(), Some(gap_end));
    core.advance(gap_end - core.now() - Duration::from_millis(1));
    core.timeout();
    assert_eq!(core.statuses.len(), first, "not before the gap's end");
    core.advance(Duration::from_millis(1));
    core.timeout();
    let update = core.statuses.last().expect("an update");
    assert_eq!(update.flush.as_u64(), 1_008, "the acknowledged transaction");
    assert_eq!(core.statuses.len(), first + 1);
}
