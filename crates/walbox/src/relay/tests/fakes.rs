//! In-memory ends for the relay's unit tests: a scripted replication source
//! and a broker the test acknowledges by hand.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pgoutput_decoder::test_util as frames;
use pgoutput_decoder::{Lsn, PgTimestamp, ReplicationMessage, StandbyStatusUpdate};
use sink_core::tail::{Found, Mark, Tail, TailQuery, TailReader};
use sink_core::{
    Admission, Delivered, DeliveryError, DeliveryErrorKind, Permit, Record, Report, TxnError,
    TxnErrorKind,
};
use tokio::sync::mpsc;

use slot_manager::{ChangeInFlight, Coverage};

use crate::quarantine::{HeldEvent, HeldKey, Place, Request, Step};
use crate::relay::{
    Deliveries, Destination, Done, Ends, Input, RelayConfig, ReplicationStream, Source,
    SourceError, Started, Token, Transactional,
};

// ---- frames ---------------------------------------------------------------

/// Type OIDs used by the fake outbox table.
pub(in crate::relay) const UUID: u32 = 2950;
pub(in crate::relay) const TEXT: u32 = 25;
pub(in crate::relay) const JSONB: u32 = 3802;

/// The fake outbox table's OID.
pub(in crate::relay) const OUTBOX: u32 = 16_384;

/// XLogData at `lsn` (the server's WAL ending there too).
fn xlog(lsn: u64, data: Bytes) -> ReplicationMessage {
    frames::xlog(Lsn::from(lsn), Lsn::from(lsn), data)
}

/// `Begin` of the transaction committing at `final_lsn`, at the time
/// `final_lsn` microseconds after the Postgres epoch.
pub(in crate::relay) fn begin(final_lsn: u64) -> ReplicationMessage {
    let time = PgTimestamp::from_pg_micros(final_lsn as i64);
    xlog(
        final_lsn.saturating_sub(50),
        frames::begin(Lsn::from(final_lsn), time, 1000),
    )
}

/// `Commit` of that transaction, ending at `end_lsn`.
pub(in crate::relay) fn commit(final_lsn: u64, end_lsn: u64) -> ReplicationMessage {
    let (at, end) = (Lsn::from(final_lsn), Lsn::from(end_lsn));
    frames::xlog(at, end, frames::commit(at, end, PgTimestamp::default()))
}

/// The fake outbox table's columns: walbox's defaults.
pub(in crate::relay) const COLUMNS: [(&str, u32); 5] = [
    ("id", UUID),
    ("aggregate_type", TEXT),
    ("aggregate_id", TEXT),
    ("event_type", TEXT),
    ("payload", JSONB),
];

/// `Relation` for `public.outbox_events` with walbox's default columns.
pub(in crate::relay) fn relation() -> ReplicationMessage {
    relation_of(OUTBOX, "outbox_events", &COLUMNS)
}

/// `Relation` for table `public.<name>` with OID `oid` and `columns`.
pub(in crate::relay) fn relation_of(
    oid: u32,
    name: &str,
    columns: &[(&str, u32)],
) -> ReplicationMessage {
    xlog(0, frames::relation(oid, "public", name, columns))
}

/// `Insert` of an outbox row at `lsn`; `None` columns are NULL.
pub(in crate::relay) fn insert(
    lsn: u64,
    id: &str,
    aggregate_id: Option<&str>,
    payload: &str,
) -> ReplicationMessage {
    insert_row(
        lsn,
        OUTBOX,
        &[
            Some(id),
            Some("order"),
            aggregate_id,
            Some("Created"),
            Some(payload),
        ],
    )
}

/// `Insert` into the relation `oid` at `lsn` of these column values.
pub(in crate::relay) fn insert_row(
    lsn: u64,
    oid: u32,
    values: &[Option<&str>],
) -> ReplicationMessage {
    xlog(lsn, frames::insert(oid, values))
}

/// A logical decoding message at `lsn` (`Message`, protocol 1).
pub(in crate::relay) fn message(
    lsn: u64,
    transactional: bool,
    prefix: &str,
    content: &str,
) -> ReplicationMessage {
    let data = frames::message(transactional, Lsn::from(lsn), prefix, content.as_bytes());
    xlog(lsn, data)
}

/// A version 1 event envelope.
pub(in crate::relay) fn envelope(id: &str, aggregate_id: &str, payload: &str) -> String {
    format!(
        r#"{{"v":1,"id":"{id}","aggregate_type":"order","aggregate_id":"{aggregate_id}","event_type":"Created","payload":{payload}}}"#
    )
}

/// The highest position the status updates in `status` confirmed, if any
/// (read through [`Server::status_handle`] after the server handle moved).
pub(in crate::relay) fn highest_confirmed(status: &Mutex<Vec<StandbyStatusUpdate>>) -> Option<u64> {
    status
        .lock()
        .unwrap()
        .iter()
        .map(|u| u.flush.as_u64())
        .max()
}

/// A primary keepalive.
pub(in crate::relay) fn keepalive(wal_end: u64, reply: bool) -> ReplicationMessage {
    frames::keepalive(Lsn::from(wal_end), reply)
}

// ---- source ---------------------------------------------------------------

type Item = Result<ReplicationMessage, SourceError>;

/// Sessions the relay will open, in order; with none left, `start` waits.
/// They share one database: its catalog and its WAL head.
pub(super) struct FakeSource {
    sessions: VecDeque<(FakeStream, Lsn, String, Option<Lsn>)>,
    database: Database,
}

/// The fake database's state the relay reads besides the stream.
#[derive(Clone)]
pub(super) struct Database {
    /// What `coverage` answers (its `wal_lsn` is replaced by the head).
    pub(super) catalog: Arc<Mutex<Coverage>>,
    /// Coverage readings taken so far.
    pub(super) readings: Arc<AtomicUsize>,
    /// The newest WAL position sent by any session.
    head: Arc<AtomicU64>,
    /// Positions saved by the relay: (delivered, commit time).
    pub(super) positions: Arc<Mutex<Vec<(Lsn, PgTimestamp)>>>,
    /// The quarantine's tables.
    pub(super) held: Arc<Mutex<HeldTables>>,
}

/// The quarantine's tables, in memory.
#[derive(Default)]
pub(super) struct HeldTables {
    /// Held events by place.
    pub(super) events: std::collections::BTreeMap<Place, HeldEvent>,
    /// Held aggregates and their requests, in the order they were held.
    pub(super) keys: Vec<(Bytes, Option<Request>)>,
    /// Writes of held events fail (Postgres unreachable) while set.
    pub(super) unwritable: bool,
    /// Releases that failed, and why.
    pub(super) failed_releases: Vec<(Bytes, String)>,
    /// Events a release reads at a time, when not the default 2.
    pub(super) release_batch: Option<usize>,
}

impl Database {
    /// The operator asks for `request` on `key`; false if it is not held.
    pub(super) fn request(&self, key: &str, request: Request) -> bool {
        let mut held = self.held.lock().unwrap();
        match held.keys.iter_mut().find(|(k, _)| k == key.as_bytes()) {
            Some((_, r)) => {
                *r = Some(request);
                true
            }
            None => false,
        }
    }

    /// The ids of the held events of `key`, in stream order.
    pub(super) fn held_ids(&self, key: &str) -> Vec<String> {
        let held = self.held.lock().unwrap();
        held.events
            .values()
            .filter(|e| e.key == key.as_bytes())
            .map(|e| header(&e.record, "id").unwrap_or_default().to_owned())
            .collect()
    }

    /// The held aggregates.
    pub(super) fn held_keys(&self) -> Vec<String> {
        let held = self.held.lock().unwrap();
        held.keys
            .iter()
            .map(|(k, _)| String::from_utf8_lossy(k).into_owned())
            .collect()
    }
}

impl Database {
    /// What readings find in flight: by default nothing, so each reading
    /// verifies up to its own position.
    pub(super) fn in_flight(&self, in_flight: ChangeInFlight) {
        self.catalog.lock().unwrap().in_flight = in_flight;
    }

    /// Changes the catalog: a new fingerprint and table OID, and a gap.
    pub(super) fn alter(&self, fingerprint: &str, table_oid: Option<u32>, gap: Option<&str>) {
        let mut c = self.catalog.lock().unwrap();
        c.fingerprint = fingerprint.into();
        c.table_oid = table_oid;
        c.gap = gap.map(str::to_owned);
    }
}

impl Default for FakeSource {
    fn default() -> Self {
        FakeSource {
            sessions: VecDeque::new(),
            database: Database {
                catalog: Arc::new(Mutex::new(Coverage {
                    wal_lsn: Lsn::ZERO,
                    table_oid: Some(OUTBOX),
                    gap: None,
                    fingerprint: "covered".into(),
                    in_flight: ChangeInFlight::Nothing,
                    tables: Vec::new(),
                    added: Vec::new(),
                })),
                readings: Arc::default(),
                head: Arc::new(AtomicU64::new(0)),
                positions: Arc::default(),
                held: Arc::default(),
            },
        }
    }
}

/// The test's end of one session.
pub(super) struct Server {
    tx: Option<mpsc::UnboundedSender<Item>>,
    status: Arc<Mutex<Vec<StandbyStatusUpdate>>>,
    closed: Arc<Mutex<bool>>,
    /// Messages sent by the server and not yet read by the relay.
    unread: Arc<AtomicUsize>,
    head: Arc<AtomicU64>,
}

pub(super) struct FakeStream {
    rx: mpsc::UnboundedReceiver<Item>,
    status: Arc<Mutex<Vec<StandbyStatusUpdate>>>,
    closed: Arc<Mutex<bool>>,
    unread: Arc<AtomicUsize>,
    database: Database,
}

impl FakeSource {
    /// Adds a session that starts at the slot position `start`.
    pub(super) fn session(&mut self, start: u64) -> Server {
        self.session_on("system 1 timeline 1", start)
    }

    /// Adds a session on the server history `history`.
    pub(super) fn session_on(&mut self, history: &str, start: u64) -> Server {
        self.add_session(history, start, None)
    }

    /// Adds a session on a server restored from a snapshot: its WAL ends at
    /// `wal_end`, whatever earlier sessions saw.
    pub(super) fn session_restored(&mut self, history: &str, start: u64, wal_end: u64) -> Server {
        self.add_session(history, start, Some(Lsn::new(wal_end)))
    }

    fn add_session(&mut self, history: &str, start: u64, wal_end: Option<Lsn>) -> Server {
        let (tx, rx) = mpsc::unbounded_channel();
        let status = Arc::new(Mutex::new(Vec::new()));
        let closed = Arc::new(Mutex::new(false));
        let unread = Arc::new(AtomicUsize::new(0));
        self.sessions.push_back((
            FakeStream {
                rx,
                status: Arc::clone(&status),
                closed: Arc::clone(&closed),
                unread: Arc::clone(&unread),
                database: self.database.clone(),
            },
            Lsn::new(start),
            history.to_owned(),
            wal_end,
        ));
        Server {
            tx: Some(tx),
            status,
            closed,
            unread,
            head: Arc::clone(&self.database.head),
        }
    }

    /// The database behind the sessions.
    pub(super) fn database(&self) -> Database {
        self.database.clone()
    }
}

impl Server {
    /// The server sends `message`.
    pub(super) fn send(&self, message: ReplicationMessage) {
        let wal_end = match &message {
            ReplicationMessage::XLogData(x) => x.wal_end(),
            ReplicationMessage::PrimaryKeepalive(k) => k.wal_end(),
            _ => Lsn::ZERO,
        };
        self.head.fetch_max(wal_end.as_u64(), Ordering::SeqCst);
        self.unread.fetch_add(1, Ordering::SeqCst);
        let _ = self.tx.as_ref().expect("connected").send(Ok(message));
    }

    /// A whole transaction committing at `final_lsn` (ending 10 later) with
    /// one event per `(id, aggregate id)`, at `final_lsn - 80`, `- 70`, …
    pub(super) fn transaction(&self, final_lsn: u64, events: &[(&str, Option<&str>)]) {
        self.transaction_at(final_lsn, final_lsn as i64, events);
    }

    /// [`Server::transaction`] committed `pg_micros` after the Postgres
    /// epoch.
    pub(super) fn transaction_at(
        &self,
        final_lsn: u64,
        pg_micros: i64,
        events: &[(&str, Option<&str>)],
    ) {
        let time = PgTimestamp::from_pg_micros(pg_micros);
        self.send(xlog(
            final_lsn.saturating_sub(50),
            frames::begin(Lsn::from(final_lsn), time, 1000),
        ));
        for (i, (id, key)) in events.iter().enumerate() {
            self.send(insert(final_lsn - 80 + 10 * i as u64, id, *key, "{}"));
        }
        self.send(commit(final_lsn, final_lsn + 10));
    }

    /// Messages the relay has not read yet (still in the socket, as it were).
    pub(super) fn unread(&self) -> usize {
        self.unread.load(Ordering::SeqCst)
    }

    /// The connection breaks (a transient error) after what was sent.
    pub(super) fn disconnect(&mut self) {
        self.tx.take();
    }

    /// The status updates received so far.
    pub(super) fn updates(&self) -> Vec<StandbyStatusUpdate> {
        self.status.lock().unwrap().clone()
    }

    /// The highest position confirmed so far (0 if none).
    pub(super) fn confirmed(&self) -> u64 {
        highest_confirmed(&self.status).unwrap_or(0)
    }

    /// The status updates, readable after the server handle moved.
    pub(super) fn status_handle(&self) -> Arc<Mutex<Vec<StandbyStatusUpdate>>> {
        Arc::clone(&self.status)
    }

    /// True once the relay closed the session cleanly.
    pub(super) fn closed(&self) -> bool {
        *self.closed.lock().unwrap()
    }
}

impl Source for FakeSource {
    type Stream = FakeStream;

    async fn start(&mut self) -> Result<Started<FakeStream>, SourceError> {
        match self.sessions.pop_front() {
            Some((stream, confirmed, history, wal_end)) => Ok(Started {
                stream,
                confirmed,
                history,
                // Past anything a test sends, unless it was restored.
                server_wal: wal_end.unwrap_or(Lsn::new(u64::MAX)),
                domains: Default::default(),
            }),
            None => std::future::pending().await,
        }
    }
}

impl ReplicationStream for FakeStream {
    async fn next(&mut self) -> Result<Input, SourceError> {
        match self.rx.recv().await {
            Some(item) => {
                self.unread.fetch_sub(1, Ordering::SeqCst);
                item.map(Input::Message)
            }
            None => Err(SourceError::Postgres(slot_manager::Error::StreamEnded)),
        }
    }

    async fn send_status(&mut self, update: StandbyStatusUpdate) -> Result<(), SourceError> {
        self.status.lock().unwrap().push(update);
        Ok(())
    }

    async fn coverage(&mut self) -> Result<Coverage, SourceError> {
        self.database.readings.fetch_add(1, Ordering::SeqCst);
        let mut reading = self.database.catalog.lock().unwrap().clone();
        // Read now: the WAL written so far is what the server sent so far.
        reading.wal_lsn = Lsn::new(self.database.head.load(Ordering::SeqCst));
        Ok(reading)
    }

    async fn slot_sample(&mut self) -> Option<slot_manager::SlotStatus> {
        None
    }

    async fn save_position(
        &mut self,
        delivered: Lsn,
        committed: PgTimestamp,
    ) -> Result<(), SourceError> {
        self.database
            .positions
            .lock()
            .unwrap()
            .push((delivered, committed));
        Ok(())
    }

    async fn quarantine(&mut self, step: &Step, events: &[HeldEvent]) -> Result<Done, SourceError> {
        let mut held = self.database.held.lock().unwrap();
        Ok(match step {
            Step::Write => {
                if held.unwritable {
                    return Err(SourceError::Postgres(slot_manager::Error::StreamEnded));
                }
                let mut new = 0;
                for e in events {
                    if !held.keys.iter().any(|(k, _)| *k == e.key) {
                        held.keys.push((e.key.clone(), None));
                    }
                    if held.events.insert(e.place, e.clone()).is_none() {
                        new += 1;
                    }
                }
                Done::Written(new)
            }
            Step::Poll => Done::Polled(
                held.keys
                    .iter()
                    .filter(|(_, r)| r.is_some())
                    .map(|(k, r)| HeldKey {
                        key: k.clone(),
                        request: *r,
                    })
                    .collect(),
            ),
            Step::Sync => {
                let keys = held
                    .keys
                    .iter()
                    .map(|(k, r)| HeldKey {
                        key: k.clone(),
                        request: *r,
                    })
                    .collect();
                Done::Synced(keys, held.events.len() as u64)
            }
            Step::Load { key, after } => Done::Loaded(
                held.events
                    .values()
                    .filter(|e| e.key == *key && after.is_none_or(|a| e.place > a))
                    .take(held.release_batch.unwrap_or(2))
                    .cloned()
                    .collect(),
            ),
            Step::Released { key, through } => {
                let before = held.events.len();
                held.events.retain(|p, e| !(e.key == *key && p <= through));
                Done::Deleted((before - held.events.len()) as u64)
            }
            Step::Forget { key } => {
                let before = held.events.len();
                held.events.retain(|_, e| e.key != *key);
                held.keys.retain(|(k, _)| k != key);
                Done::Deleted((before - held.events.len()) as u64)
            }
            Step::ReleaseFailed { key, error } => {
                for (k, r) in &mut held.keys {
                    if k == key {
                        *r = None;
                    }
                }
                held.failed_releases.push((key.clone(), error.clone()));
                Done::Recorded
            }
        })
    }

    async fn close(self) {
        *self.closed.lock().unwrap() = true;
    }
}

// ---- destination ----------------------------------------------------------

/// A record the fake broker holds until the test decides its fate.
struct InFlight {
    record: Record<Token>,
    permits: InFlightPermits,
    /// The producer's epoch when sent in a transaction.
    epoch: Option<u64>,
    /// The handle whose reports channel gets its report.
    reports: mpsc::UnboundedSender<(Report<Token>, InFlightPermits)>,
}

struct BrokerState {
    in_flight: VecDeque<InFlight>,
    /// Every record visible to a `read_committed` consumer, in order: acked
    /// ones, and in transactions the committed ones.
    delivered: Vec<Record<()>>,
    /// Kafka transactions: the transactional id's current epoch (0: never
    /// initialised); a producer with an older one is fenced.
    epoch: u64,
    /// Records acked inside the open transaction: not visible yet.
    open_txn: Vec<Record<()>>,
    /// The next commit fails with this.
    fail_next_commit: Option<TxnError>,
    /// The next reads of the progress fail (a leader election, a
    /// transaction still open on the progress topic).
    failing_reads: usize,
    /// Every broker is down: commits and aborts time out (30 s and 10 s,
    /// as the sink's bounds).
    unresponsive: bool,
    /// Reading topics back fails (no right to read them).
    unreadable: bool,
    /// How long reading a topic back takes.
    read_delay: std::time::Duration,
    /// Topics read back so far.
    tail_reads: usize,
    commits: usize,
    aborts: usize,
}

/// The fake broker: bounded like the sink (events and KiB), reports by hand.
#[derive(Clone)]
pub(super) struct Broker {
    state: Arc<Mutex<BrokerState>>,
    admission: Admission,
    reports: mpsc::UnboundedSender<(Report<Token>, InFlightPermits)>,
    /// This producer's transactional epoch, and whether a transaction is open.
    epoch: Arc<AtomicU64>,
    in_txn: Arc<AtomicBool>,
}

type InFlightPermits = Permit;

/// The relay's ends on `broker`: its transactions in exactly-once mode.
pub(super) fn ends<'a>(config: &RelayConfig, broker: &'a Broker) -> Ends<'a, Broker, Broker> {
    Ends {
        destination: broker,
        transactions: config.exactly_once.is_some().then_some(broker),
        tails: config
            .skip_delivered
            .is_some()
            .then_some(broker as &dyn TailReader),
    }
}

/// The relay's report stream from the fake broker.
pub(super) struct FakeReports {
    rx: mpsc::UnboundedReceiver<(Report<Token>, InFlightPermits)>,
}

impl Broker {
    /// A broker taking at most `events` records and `kib` KiB in flight.
    pub(super) fn new(events: usize, kib: usize) -> (Broker, FakeReports) {
        let (tx, rx) = mpsc::unbounded_channel();
        (
            Broker {
                state: Arc::new(Mutex::new(BrokerState {
                    in_flight: VecDeque::new(),
                    delivered: Vec::new(),
                    epoch: 0,
                    open_txn: Vec::new(),
                    fail_next_commit: None,
                    failing_reads: 0,
                    unresponsive: false,
                    unreadable: false,
                    read_delay: std::time::Duration::ZERO,
                    tail_reads: 0,
                    commits: 0,
                    aborts: 0,
                })),
                admission: Admission::new(events, kib * 1024),
                reports: tx,
                epoch: Arc::new(AtomicU64::new(0)),
                in_txn: Arc::new(AtomicBool::new(false)),
            },
            FakeReports { rx },
        )
    }

    /// Another producer on the same broker (a second walbox process): its
    /// own bounds, reports and transactional epoch.
    pub(super) fn another_producer(&self, events: usize, kib: usize) -> (Broker, FakeReports) {
        let (mut broker, reports) = Broker::new(events, kib);
        broker.state = Arc::clone(&self.state);
        (broker, reports)
    }

    /// The next commit fails with `error`.
    pub(super) fn fail_next_commit(&self, kind: TxnErrorKind) {
        self.state.lock().unwrap().fail_next_commit = Some(TxnError {
            kind,
            message: format!("injected {kind:?}"),
        });
    }

    /// Every broker down (`true`) or back: commits and aborts time out.
    pub(super) fn set_unresponsive(&self, down: bool) {
        self.state.lock().unwrap().unresponsive = down;
    }

    /// The next `n` reads of the committed progress fail.
    pub(super) fn fail_progress_reads(&self, n: usize) {
        self.state.lock().unwrap().failing_reads = n;
    }

    /// Transactions committed and aborted so far.
    pub(super) fn commits_and_aborts(&self) -> (usize, usize) {
        let state = self.state.lock().unwrap();
        (state.commits, state.aborts)
    }

    /// Records acked in the open transaction (not visible).
    pub(super) fn uncommitted(&self) -> usize {
        self.state.lock().unwrap().open_txn.len()
    }

    /// A producer whose epoch is not the id's current one is fenced.
    fn check_epoch(&self, state: &BrokerState) -> Result<(), TxnError> {
        if self.epoch.load(Ordering::SeqCst) == state.epoch {
            return Ok(());
        }
        Err(TxnError {
            kind: TxnErrorKind::Fenced,
            message: "producer fenced".into(),
        })
    }

    /// Takes this producer's records of its open transaction off the wire.
    fn take_own(&self, state: &mut BrokerState) -> Vec<InFlight> {
        let epoch = Some(self.epoch.load(Ordering::SeqCst));
        let (own, rest): (Vec<InFlight>, Vec<InFlight>) = std::mem::take(&mut state.in_flight)
            .into_iter()
            .partition(|f| f.epoch == epoch);
        state.in_flight = rest.into();
        own
    }

    /// Records sent and not yet reported.
    pub(super) fn pending(&self) -> usize {
        self.state.lock().unwrap().in_flight.len()
    }

    /// The keys of the records sent and not yet reported, oldest first.
    pub(super) fn pending_keys(&self) -> Vec<String> {
        let state = self.state.lock().unwrap();
        state.in_flight.iter().map(|f| key_of(&f.record)).collect()
    }

    /// Acknowledges the oldest pending record; false if there is none.
    pub(super) fn ack_oldest(&self) -> bool {
        self.ack_where(|_| true)
    }

    /// Acknowledges the oldest pending record with `key`.
    pub(super) fn ack_key(&self, key: &str) -> bool {
        self.ack_where(|r| key_of(r) == key)
    }

    /// Refuses the oldest pending record with `key` for good, handing it
    /// back (as the sink does); false if there is none.
    pub(super) fn refuse_key(&self, key: &str) -> bool {
        self.fail_key(key, refused)
    }

    /// Reports the oldest pending record with `key` by `report`; false if
    /// there is none.
    fn fail_key(&self, key: &str, report: impl FnOnce(Record<Token>) -> Report<Token>) -> bool {
        let mut state = self.state.lock().unwrap();
        let Some(i) = state
            .in_flight
            .iter()
            .position(|f| key_of(&f.record) == key)
        else {
            return false;
        };
        let f = state.in_flight.remove(i).expect("found");
        let _ = f.reports.send((report(f.record), f.permits));
        true
    }

    /// Reports the oldest pending record with `key` as not answered in
    /// time ([`DeliveryErrorKind::RetriableExhausted`]); false if there is
    /// none.
    pub(super) fn time_out_key(&self, key: &str) -> bool {
        self.fail_key(key, |record| {
            let (returned, token) = record.split_token();
            Report {
                token,
                result: Err(DeliveryError::new(
                    DeliveryErrorKind::RetriableExhausted,
                    "no ack in time",
                )),
                returned: Some(returned),
                client_micros: None,
            }
        })
    }

    /// Acknowledges everything pending.
    pub(super) fn ack_all(&self) {
        while self.ack_oldest() {}
    }

    fn ack_where(&self, pick: impl Fn(&Record<Token>) -> bool) -> bool {
        let mut state = self.state.lock().unwrap();
        let Some(i) = state.in_flight.iter().position(|f| pick(&f.record)) else {
            return false;
        };
        let f = state.in_flight.remove(i).expect("found");
        Self::ack(&mut state, f);
        true
    }

    fn ack(state: &mut BrokerState, f: InFlight) {
        let InFlight {
            record,
            permits,
            epoch,
            reports,
        } = f;
        let (copy, token) = record.split_token();
        let result = match epoch {
            Some(e) if e != state.epoch => Err(DeliveryError::new(
                DeliveryErrorKind::Fenced,
                "producer fenced",
            )),
            Some(_) => {
                state.open_txn.push(copy);
                Ok(Delivered::Kafka {
                    partition: 0,
                    offset: -1,
                })
            }
            None => {
                state.delivered.push(copy);
                Ok(Delivered::Kafka {
                    partition: 0,
                    offset: state.delivered.len() as i64 - 1,
                })
            }
        };
        let report = Report {
            token,
            result,
            returned: None,
            client_micros: None,
        };
        let _ = reports.send((report, permits));
    }

    /// Every record acknowledged so far.
    pub(super) fn delivered(&self) -> Vec<Record<()>> {
        self.state.lock().unwrap().delivered.clone()
    }

    /// The process died: what was in flight never reached the broker, and
    /// no report of it comes.
    pub(super) fn lose_in_flight(&self) {
        self.state.lock().unwrap().in_flight.clear();
    }

    /// Reading topics back fails from now on.
    pub(super) fn set_unreadable(&self) {
        self.state.lock().unwrap().unreadable = true;
    }

    /// Reading a topic back takes `delay` from now on.
    pub(super) fn set_read_delay(&self, delay: std::time::Duration) {
        self.state.lock().unwrap().read_delay = delay;
    }

    /// Topics read back so far.
    pub(super) fn tail_reads(&self) -> usize {
        self.state.lock().unwrap().tail_reads
    }
}

/// Reads the delivered records of a topic from the last back, as the Kafka
/// sink reads one partition: by the mark each record carries.
impl TailReader for Broker {
    fn read_tail<'a>(
        &'a self,
        topic: &'a str,
        query: &'a TailQuery,
    ) -> Pin<Box<dyn Future<Output = Result<Tail, String>> + 'a>> {
        Box::pin(async move {
            let delay = self.state.lock().unwrap().read_delay;
            tokio::time::sleep(delay).await;
            let mut state = self.state.lock().unwrap();
            state.tail_reads += 1;
            if state.unreadable {
                return Err("Broker: Topic authorization failed".into());
            }
            let mut tail = Tail {
                partitions: 1,
                ..Tail::default()
            };
            let records = state.delivered.iter().enumerate().rev();
            for (offset, record) in records.filter(|(_, r)| &*r.topic == topic) {
                if tail.read >= query.look_back {
                    tail.cut_short.push(0);
                    break;
                }
                tail.read += 1;
                let Some(mark) = record.origin.as_ref().map(sink_core::Origin::mark) else {
                    continue;
                };
                let mark = Mark::parse(mark.as_bytes()).expect("a mark reads back");
                if mark.stream != query.stream || mark.history != query.history {
                    continue;
                }
                if mark.position < query.since {
                    break;
                }
                tail.found.push(Found {
                    position: mark.position,
                    index: mark.index,
                    commit_time: mark.commit_time,
                    at: Delivered::Kafka {
                        partition: 0,
                        offset: offset as i64,
                    },
                });
            }
            Ok(tail)
        })
    }
}

/// The broker's report refusing `record` for good, handing it back (as
/// the sink does).
pub(in crate::relay) fn refused(record: Record<Token>) -> Report<Token> {
    let (returned, token) = record.split_token();
    Report {
        token,
        result: Err(DeliveryError::new(
            DeliveryErrorKind::Permanent,
            "Broker: Message size too large",
        )),
        returned: Some(returned),
        client_micros: None,
    }
}

/// A record's key as text (`""` for none).
pub(in crate::relay) fn key_of<T>(r: &Record<T>) -> String {
    r.key
        .as_ref()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .unwrap_or_default()
}

/// A record's header as text.
pub(in crate::relay) fn header<'a, T>(r: &'a Record<T>, name: &str) -> Option<&'a str> {
    r.headers
        .iter()
        .find(|h| h.name == name)
        .map(|h| std::str::from_utf8(&h.value).expect("text header"))
}

impl Destination<Token> for Broker {
    fn admission(&self) -> &Admission {
        &self.admission
    }

    async fn send(&self, permits: InFlightPermits, record: Record<Token>) {
        let epoch = self
            .in_txn
            .load(Ordering::SeqCst)
            .then(|| self.epoch.load(Ordering::SeqCst));
        let closes = epoch.is_some() && record.token.is_progress();
        let mut state = self.state.lock().unwrap();
        state.in_flight.push_back(InFlight {
            record,
            permits,
            epoch,
            reports: self.reports.clone(),
        });
        // The progress record closes the transaction: the broker answers
        // for everything of it still pending, as a real one does within
        // milliseconds, before walbox asks for the commit. (Records the
        // test acks, refuses or times out by hand are answered before.)
        if closes {
            for f in self.take_own(&mut state) {
                Self::ack(&mut state, f);
            }
        }
    }
}

impl Transactional<Token> for Broker {
    async fn init(&self) -> Result<(), TxnError> {
        let mut state = self.state.lock().unwrap();
        // Completes (aborts) what an older producer left open, and fences it.
        state.epoch += 1;
        state.open_txn.clear();
        self.epoch.store(state.epoch, Ordering::SeqCst);
        Ok(())
    }

    async fn last_committed(&self, topic: &str, key: &str) -> Result<Option<Bytes>, String> {
        let mut state = self.state.lock().unwrap();
        if state.failing_reads > 0 {
            state.failing_reads -= 1;
            return Err(format!("read topic {topic}: injected leader election"));
        }
        Ok(state
            .delivered
            .iter()
            .rev()
            .find(|r| &*r.topic == topic && r.key.as_deref() == Some(key.as_bytes()))
            .and_then(|r| r.value.clone()))
    }

    fn begin(&self) -> Result<(), TxnError> {
        let state = self.state.lock().unwrap();
        self.check_epoch(&state)?;
        drop(state);
        assert!(
            !self.in_txn.swap(true, Ordering::SeqCst),
            "begin inside a transaction"
        );
        Ok(())
    }

    async fn commit(&self) -> Result<(), TxnError> {
        if self.state.lock().unwrap().unresponsive {
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
            return Err(TxnError {
                kind: TxnErrorKind::Retriable,
                message: "commit timed out (brokers down)".into(),
            });
        }
        let mut state = self.state.lock().unwrap();
        assert!(
            self.in_txn.load(Ordering::SeqCst),
            "commit without a transaction"
        );
        self.check_epoch(&state)?;
        // A commit flushes: the transaction's records are acked first.
        for f in self.take_own(&mut state) {
            Self::ack(&mut state, f);
        }
        if let Some(e) = state.fail_next_commit.take() {
            return Err(e);
        }
        let committed = std::mem::take(&mut state.open_txn);
        state.delivered.extend(committed);
        state.commits += 1;
        self.in_txn.store(false, Ordering::SeqCst);
        Ok(())
    }

    async fn abort(&self) -> Result<(), TxnError> {
        if self.state.lock().unwrap().unresponsive {
            tokio::time::sleep(std::time::Duration::from_secs(10)).await;
            return Err(TxnError {
                kind: TxnErrorKind::Retriable,
                message: "abort timed out (brokers down)".into(),
            });
        }
        let mut state = self.state.lock().unwrap();
        self.check_epoch(&state)?;
        // Queued records are purged (and reported as such).
        for f in self.take_own(&mut state) {
            let (_, token) = f.record.split_token();
            let report = Report {
                token,
                result: Err(DeliveryError::new(DeliveryErrorKind::Purged, "purged")),
                returned: None,
                client_micros: None,
            };
            let _ = f.reports.send((report, f.permits));
        }
        state.open_txn.clear();
        state.aborts += 1;
        self.in_txn.store(false, Ordering::SeqCst);
        Ok(())
    }
}

impl Deliveries<Token> for FakeReports {
    async fn next(&mut self) -> Option<Report<Token>> {
        // The permits return when the relay receives the report, as in the sink.
        self.rx.recv().await.map(|(report, _permits)| report)
    }
}

/// A payload of about `n` bytes.
pub(super) fn payload(n: usize) -> String {
    format!("{{\"pad\": \"{}\"}}", "x".repeat(n.saturating_sub(12)))
}
