//! `walbox audit`: proof of delivery, checked against the user's own
//! systems. It compares a window of the outbox table with what the topics
//! hold and reports, per event type, events **missing** from the broker,
//! **duplicates**, a key's events **out of order**, events on the broker
//! that are **not in the table** (unknown), and events on another topic or
//! key than the mapping gives (**misrouted**).
//!
//! How, in bounded memory:
//! 1. The table's side ([`table`]): the window's rows in one snapshot, in
//!    the stream's order, each mapped as the relay maps it.
//! 2. The grace for events in flight: a row without a copy is missing only
//!    if the slot is confirmed past the WAL position of the snapshot (then
//!    walbox delivered every row it holds). When rows lack a copy and the
//!    slot is not there yet, the audit waits (`--wait`) for it and reads the
//!    topics again; if it does not get there, those rows are counted as
//!    *unconfirmed* (maybe in flight), not missing, and the report says so.
//!    A clean audit never waits.
//! 3. The broker's side ([`Readback::read_topics`]): the topics the rows
//!    map to and the dead-letter topic, from the window's start to their
//!    end when the read starts: Kafka's partitions (by the brokers' time
//!    index, `read_committed`), JetStream's streams, or RabbitMQ's audit
//!    stream.
//! 4. Both sides go through an external sort by event id ([`spill`]): the
//!    rows, sorted once, merged with each read of the topics; then the
//!    rows' first copies through a third sort by topic and key: the
//!    [`findings`]. Memory: `--memory` for the three sorts' buffers
//!    together (a third each); temporary disk: about 100 bytes per row and
//!    per record read.
//!
//! A copy no row in the snapshot explains is looked up in the table again
//! before it counts as unknown: its row may have committed after the
//! snapshot.

pub mod findings;
mod spill;
pub mod table;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgoutput_decoder::Lsn;
use serde::Serialize;
use sink_core::readback::{ReadBack, ReadFrom, ReadSummary, RecordTime};
use slot_manager::{connect_control, slot_status, PgConfig, TableName};

use crate::backfill::order::Follows;
use crate::dead_letter::headers as dead_letter_headers;
use crate::mapping::timestamp::rfc3339_ms;
use crate::mapping::OutboxMapping;
use crate::readback::Readback;
use findings::{Arrival, ById, Findings, Place, Sighting, NO_TYPE};
use spill::Spill;
pub use table::WindowSpec;

/// Copies no row explained, looked up in the table this many at a time.
const LOOKUP_BATCH: usize = 1_000;
/// A topic partition that makes no progress this long ends the read.
const READ_STALL: Duration = Duration::from_secs(60);
/// How often the slot's position is read while waiting for it.
const SLOT_POLL: Duration = Duration::from_millis(200);

/// Why an audit could not be made (findings are not errors).
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    /// The configuration or the arguments: exit 2.
    #[error("{0}")]
    Config(String),
    /// Postgres.
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    /// Reading the broker (the message names it).
    #[error("{0}")]
    Broker(String),
    /// The sort's temporary files.
    #[error("the audit's temporary files: {0}")]
    Io(#[from] std::io::Error),
    /// A slot to wait for does not exist.
    #[error("replication slot {0:?} does not exist; the audit measures delivery against the slot's confirmed position")]
    NoSlot(String),
}

/// What to audit.
pub struct AuditPlan<'a> {
    /// Postgres.
    pub pg: &'a PgConfig,
    /// The slots that stream the table (every shard's).
    pub slots: Vec<String>,
    /// The outbox table.
    pub table: &'a TableName,
    /// How rows map to records.
    pub mapping: &'a OutboxMapping,
    /// The broker, read back with the producer's connection settings.
    pub readback: &'a Readback,
    /// The dead-letter topic, if one is configured.
    pub dead_letter_topic: Option<&'a str>,
    /// The window.
    pub window: WindowSpec,
    /// How long to wait for the slot to pass the snapshot.
    pub wait: Duration,
    /// Memory for the sorts' buffers, all three together.
    pub memory: usize,
    /// Examples kept per kind of finding.
    pub max_examples: usize,
    /// Retention: rows older than this are deleted after delivery, so
    /// records older than it are not reported as unknown.
    pub retention: Option<Duration>,
    /// Whether records the table does not hold are findings (off when
    /// events are also emitted as logical decoding messages, which are in
    /// no table).
    pub check_unknown: bool,
    /// Read the topics from their first record, not from the window's
    /// start by the brokers' time index (for brokers that have none).
    pub from_beginning: bool,
    /// Counters a progress display reads.
    pub progress: Arc<Progress>,
}

/// How far the audit got: rows read, records read.
#[derive(Debug, Default)]
pub struct Progress {
    /// Rows read from the table.
    pub rows: AtomicU64,
    /// Records read from the topics.
    pub records: AtomicU64,
    /// What the audit is doing.
    pub stage: std::sync::Mutex<&'static str>,
}

impl Progress {
    fn stage(&self, stage: &'static str) {
        if let Ok(mut s) = self.stage.lock() {
            *s = stage;
        }
    }
}

/// A slot's position when the audit compared.
#[derive(Clone, Debug, Serialize)]
pub struct SlotPosition {
    /// The slot.
    pub slot: String,
    /// Its confirmed position.
    pub confirmed: Option<String>,
}

/// A partition whose first records were deleted.
#[derive(Clone, Debug, Serialize)]
pub struct TruncatedPartition {
    /// Topic.
    pub topic: String,
    /// Partition.
    pub partition: i32,
    /// Its first offset.
    pub first_offset: i64,
}

/// The audit's result.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The table.
    pub table: String,
    /// From (RFC 3339, inclusive).
    pub since: String,
    /// To (RFC 3339, exclusive).
    pub until: String,
    /// The WAL position of the table's snapshot.
    pub snapshot_lsn: String,
    /// The slots' positions after waiting.
    pub slots: Vec<SlotPosition>,
    /// Whether every slot was confirmed past the snapshot: rows without a
    /// copy are missing (else unconfirmed).
    pub slots_caught_up: bool,
    /// What the rows' per-key order follows.
    pub order: &'static str,
    /// Rows in the window without an event id (not checkable).
    pub rows_without_id: u64,
    /// Records read from the topics.
    pub records_read: u64,
    /// Records on the event topics without an `id` header (not walbox's).
    pub records_without_id: u64,
    /// The topics read.
    pub topics: Vec<String>,
    /// Topics the broker does not know.
    pub absent_topics: Vec<String>,
    /// Partitions whose first records were deleted (retention,
    /// DeleteRecords): window events there may show as missing.
    pub truncated_partitions: Vec<TruncatedPartition>,
    /// Whether records the table does not hold were looked for.
    pub unknown_checked: bool,
    /// Sort runs written to disk (0: it all fit in memory).
    pub sort_runs: usize,
    /// How long the audit took (ms).
    pub elapsed_ms: u64,
    /// What was found.
    #[serde(flatten)]
    pub findings: Findings,
}

impl Report {
    /// How many findings: what makes `walbox audit` exit 1.
    pub fn findings(&self) -> u64 {
        self.findings.total.findings()
    }
}

/// Runs the audit (see the module docs).
pub async fn audit(plan: AuditPlan<'_>) -> Result<Report, AuditError> {
    let started = Instant::now();
    let progress = Arc::clone(&plan.progress);
    let mut client = connect_control(plan.pg).await?;
    for slot in &plan.slots {
        if slot_status(&client, slot).await?.is_none() {
            return Err(AuditError::NoSlot(slot.clone()));
        }
    }

    progress.stage("reading the table");
    // The rows' sort, the copies' and the arrivals' are alive together.
    let per_sort = (plan.memory / 3).max(1);
    let mut rows: Spill<Sighting> = Spill::new(per_sort);
    let side = table::read(
        &mut client,
        plan.table,
        plan.mapping,
        &plan.window,
        &mut rows,
        &progress.rows,
    )
    .await?;
    let rows = rows.seal()?;
    let mut topics: Vec<String> = side.topics.iter().cloned().collect();
    if let Some(d) = plan.dead_letter_topic {
        if !topics.iter().any(|t| t == d) {
            topics.push(d.to_owned());
        }
    }

    // Rows with a copy need no waiting; only rows without one depend on
    // whether the slot passed them. An idle walbox learns of WAL past its
    // last transaction only from the walsender's keepalives (up to
    // wal_sender_timeout / 2 apart): the audit waits only when it must.
    let (mut slots, mut caught_up) =
        wait_for_slots(&client, &plan.slots, side.snapshot_lsn, Duration::ZERO).await?;
    let mut waited = false;
    loop {
        progress.stage("reading the topics");
        let (copies, summary, records_without_id) =
            read_copies(&plan, &side, &topics, per_sort).await?;
        progress.stage("comparing");
        let mut findings = Findings::new(plan.max_examples);
        let mut arrivals: Spill<Arrival> = Spill::new(per_sort);
        let mut candidates = Vec::new();
        let sort_runs = rows.runs() + copies.runs();
        for group in ById::new(spill::merge(rows.pass()?, copies.sorted()?)) {
            let (id, places) = group?;
            let verdict = findings.id(&id, &places, caught_up);
            if let Some(a) = verdict.arrival {
                arrivals.push(a)?;
            }
            candidates.extend(verdict.unknown);
            if candidates.len() >= LOOKUP_BATCH {
                settle_unknown(&client, &plan, &side, &mut findings, &mut candidates).await?;
            }
        }
        settle_unknown(&client, &plan, &side, &mut findings, &mut candidates).await?;
        let sort_runs = sort_runs + arrivals.runs();
        findings.arrivals(arrivals.sorted()?)?;

        if caught_up || waited || findings.total.unconfirmed == 0 {
            let window = side.window;
            return Ok(Report {
                table: plan.table.to_string(),
                since: rfc3339_ms(window.since_ms),
                until: rfc3339_ms(window.until_ms),
                snapshot_lsn: side.snapshot_lsn.to_string(),
                slots,
                slots_caught_up: caught_up,
                order: match side.order {
                    Follows::Commits => "commit order",
                    Follows::Insertion => "insertion order (a sequence column)",
                    Follows::Timestamp => "the timestamp column, then the event id",
                },
                rows_without_id: side.without_id,
                records_read: summary.records,
                records_without_id,
                topics,
                absent_topics: summary.absent_topics,
                truncated_partitions: summary
                    .truncated
                    .into_iter()
                    .map(|t| TruncatedPartition {
                        topic: t.topic,
                        partition: t.partition,
                        first_offset: t.first_offset,
                    })
                    .collect(),
                unknown_checked: plan.check_unknown,
                sort_runs,
                elapsed_ms: started.elapsed().as_millis() as u64,
                findings,
            });
        }
        // Rows without a copy, and the slot not past them yet: wait for it,
        // then read the topics again (what it delivered meanwhile is there).
        progress.stage("waiting for the slot");
        (slots, caught_up) =
            wait_for_slots(&client, &plan.slots, side.snapshot_lsn, plan.wait).await?;
        waited = true;
    }
}

/// The copies on the topics, sorted by event id: what [`read_topics`]
/// finds from the window's start (see the module docs), how much it read,
/// and how many records had no `id` header.
async fn read_copies(
    plan: &AuditPlan<'_>,
    side: &table::TableSide,
    topics: &[String],
    memory: usize,
) -> Result<(Spill<Sighting>, ReadSummary, u64), AuditError> {
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    // Retention deletes rows after delivery: older records have no row.
    let horizon = plan
        .retention
        .map_or(i64::MIN, |keep| now_ms - keep.as_millis() as i64);
    let window = side.window;
    let from = if plan.from_beginning {
        ReadFrom::Beginning
    } else {
        ReadFrom::Time(window.since_ms)
    };
    let collect = Collect {
        check_unknown: plan.check_unknown,
        horizon,
        window,
        dead_letters: plan.dead_letter_topic.map(str::to_owned),
        wanted: topics.iter().cloned().collect(),
        progress: Arc::clone(&plan.progress),
        copies: Spill::new(memory),
        without_id: 0,
    };
    let (summary, collect) = plan
        .readback
        .read_topics(topics.to_vec(), from, READ_STALL, collect)
        .await
        .map_err(AuditError::Broker)?;
    Ok((collect.copies, summary, collect.without_id))
}

/// Takes the records read as sightings of their event ids.
struct Collect {
    check_unknown: bool,
    /// Records older than this have no row (retention).
    horizon: i64,
    window: table::Window,
    dead_letters: Option<String>,
    /// The topics the rows map to (a RabbitMQ audit stream holds every
    /// routing key).
    wanted: std::collections::HashSet<String>,
    progress: Arc<Progress>,
    copies: Spill<Sighting>,
    /// Records without an `id` header.
    without_id: u64,
}

impl crate::readback::Each for Collect {
    fn each(&mut self, r: &dyn ReadBack) -> Result<(), String> {
        self.progress.records.fetch_add(1, Ordering::Relaxed);
        if self.dead_letters.as_deref() == Some(r.topic()) {
            let Some(id) = r.header(dead_letter_headers::EVENT_ID) else {
                return Ok(());
            };
            let id = String::from_utf8_lossy(id).into_owned();
            return self
                .copies
                .push(Sighting {
                    id,
                    place: Place::DeadLetter {
                        partition: r.partition(),
                        offset: r.offset(),
                    },
                })
                .map_err(|e| e.to_string());
        }
        if !self.wanted.contains(r.topic()) {
            return Ok(());
        }
        let in_window = match r.time() {
            RecordTime::Create(t) if !self.window.holds(t) => return Ok(()),
            RecordTime::Create(t) => self.check_unknown && t >= self.horizon,
            RecordTime::LogAppend(_) | RecordTime::None => false,
        };
        let Some(id) = r.header(crate::mapping::ID_HEADER) else {
            self.without_id += 1;
            return Ok(());
        };
        self.copies
            .push(Sighting {
                id: String::from_utf8_lossy(id).into_owned(),
                place: Place::Copy {
                    topic: r.topic().to_owned(),
                    partition: r.partition(),
                    offset: r.offset(),
                    key: r.key().unwrap_or_default().to_vec(),
                    event_type: r.header(crate::mapping::EVENT_TYPE_HEADER).map_or_else(
                        || NO_TYPE.to_owned(),
                        |t| String::from_utf8_lossy(t).into_owned(),
                    ),
                    in_window,
                },
            })
            .map_err(|e| e.to_string())
    }
}

/// Counts the candidates whose ids the table does not hold now as unknown.
async fn settle_unknown(
    client: &tokio_postgres::Client,
    plan: &AuditPlan<'_>,
    side: &table::TableSide,
    findings: &mut Findings,
    candidates: &mut Vec<findings::Example>,
) -> Result<(), AuditError> {
    if candidates.is_empty() {
        return Ok(());
    }
    let mut ids: Vec<String> = candidates.iter().map(|c| c.id.clone()).collect();
    ids.sort();
    ids.dedup();
    let present = table::present_now(client, plan.table, plan.mapping, side.id_type, &ids).await?;
    for c in candidates.drain(..) {
        if !present.contains(&c.id) {
            findings.unknown(c);
        }
    }
    Ok(())
}

/// Waits up to `wait` for every slot to be confirmed at or past `lsn`.
async fn wait_for_slots(
    client: &tokio_postgres::Client,
    slots: &[String],
    lsn: Lsn,
    wait: Duration,
) -> Result<(Vec<SlotPosition>, bool), AuditError> {
    let deadline = Instant::now() + wait;
    loop {
        let mut positions = Vec::with_capacity(slots.len());
        let mut all = true;
        for slot in slots {
            let status = slot_status(client, slot)
                .await?
                .ok_or_else(|| AuditError::NoSlot(slot.clone()))?;
            all &= status.confirmed_flush_lsn.is_some_and(|c| c >= lsn);
            positions.push(SlotPosition {
                slot: slot.clone(),
                confirmed: status.confirmed_flush_lsn.map(|c| c.to_string()),
            });
        }
        if all || Instant::now() >= deadline {
            return Ok((positions, all));
        }
        tokio::time::sleep(SLOT_POLL).await;
    }
}
