//! Backfill at slot creation (`walbox init-slot --backfill COND`): the rows
//! that matched `COND` when the slot was made are published like streamed
//! events, then `walbox run` streams what committed after.
//!
//! The slot is created with an exported snapshot. Its consistent point
//! splits every transaction in two sets with nothing in between: committed
//! before it (seen by the snapshot, published by the backfill) or after it
//! (streamed from the slot). Nothing is missed, nothing is sent by both.
//!
//! Resuming: the matching rows are first copied out of the snapshot into
//! `walbox.backfill_rows`, numbered in publishing order ([`store`]); the
//! number of the last row that was delivered with all before it is saved
//! every second. A rerun after a crash publishes from there: duplicates are
//! at most the rows in flight or delivered in the last second, never a
//! loss. `walbox run` refuses to stream while a backfill is unfinished, so
//! one aggregate's backfilled events always precede its streamed ones.
//!
//! The backfill writes with the at-least-once producer, exactly-once mode
//! included: its rows carry their event ids for deduplication.

pub mod cursor;
pub mod store;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use pgoutput_decoder::{Lsn, RelationBody, TupleData};
use sink_kafka::{DeliveryError, Record, Sink};
use slot_manager::{domain_base_types, slot_status, PgConfig, ReplicationClient, TableName};
use tokio_postgres::Client;

use crate::config::RunSettings;
use crate::dead_letter::{DeadLetters, Origin};
use crate::mapping::{ColumnIndexes, MapError, OutboxMapping};
use cursor::Cursor;
pub use store::Request;
use store::{Publishing, State};

/// Rows read from `walbox.backfill_rows` at a time.
const BATCH: i64 = 2_000;
/// How often the cursor is saved.
const SAVE_EVERY: Duration = Duration::from_secs(1);
/// How often a progress line is written.
const REPORT_EVERY: Duration = Duration::from_secs(2);

/// Why a backfill stopped. Every variant leaves a state a rerun resumes.
#[derive(Debug, thiserror::Error)]
pub enum BackfillError {
    /// Postgres.
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    /// Another backfill of this slot holds the lock.
    #[error("another `walbox init-slot --backfill` is running for slot {0:?}")]
    Busy(String),
    /// The slot exists and was not made by a backfill.
    #[error("replication slot {0:?} already exists: a backfill must create the slot (its snapshot is the boundary between backfilled and streamed events); drop it with `walbox drop-slot` first, or choose another --slot")]
    SlotExists(String),
    /// A rerun asked for another backfill than the unfinished one.
    #[error("slot {slot:?} has an unfinished backfill of {condition:?} ordered by {order_by:?}; rerun with the same --backfill and --backfill-order to finish it, or drop the slot to start over")]
    Mismatch {
        /// The slot.
        slot: String,
        /// The recorded condition.
        condition: String,
        /// The recorded order.
        order_by: String,
    },
    /// A copied column is gone from the outbox table.
    #[error("the outbox table has no column {0:?}, which the mapping needs")]
    MissingColumn(String),
    /// The table cannot be mapped (a column's type).
    #[error(transparent)]
    Mapping(MapError),
    /// A row too large for a Kafka record.
    #[error("backfill row {0}: too large to publish")]
    RowTooLarge(u64),
    /// A row that cannot be mapped, with no dead-letter topic.
    #[error("backfill row {n}: {error}; set dead_letter_topic to publish such rows there, or fix the row, then rerun to resume")]
    Unmappable {
        /// The row's number.
        n: u64,
        /// Why.
        error: MapError,
    },
    /// A delivery failed (with no dead-letter topic, or not for good).
    #[error("backfill row {n}: {error}; rerun `walbox init-slot --backfill` to resume after row {resume_after}")]
    Delivery {
        /// The row's number.
        n: u64,
        /// Why.
        error: DeliveryError,
        /// Where a rerun resumes.
        resume_after: u64,
    },
    /// The producer.
    #[error(transparent)]
    Run(#[from] crate::relay::RunError),
    /// A lost slot, and no saved position to republish from.
    #[error("replication slot {0:?} is invalidated and walbox saved no position to republish from (it saves one every 10 s while streaming with on_slot_invalidated = \"recreate\"); republish from a time you know with `walbox resync --since TIME`")]
    NoSavedPosition(String),
    /// Republishing by time needs the timestamp column.
    #[error("republishing from the outbox table by time needs the timestamp column (mapping.timestamp); with none, use `walbox init-slot --backfill` with a condition of your own after dropping the slot")]
    NoTimestamp,
    /// `--since` is not a time Postgres reads.
    #[error("--since {0:?} is not a timestamp Postgres reads (e.g. '2026-11-22 08:00:00+00')")]
    BadTime(String),
}

/// What [`backfill`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Published `published` of `total` rows (`resumed`: after an
    /// interrupted run), `dead_lettered` of them to the dead-letter topic.
    Published {
        /// Rows in the backfill.
        total: u64,
        /// Rows this run published.
        published: u64,
        /// Of those, dead-lettered.
        dead_lettered: u64,
        /// This run finished an interrupted one.
        resumed: bool,
    },
    /// The slot's backfill was already done.
    AlreadyDone {
        /// Rows it published.
        total: u64,
    },
}

/// What a backfill needs to know.
#[derive(Clone, Copy, Debug)]
pub struct Plan<'a> {
    /// The connection settings (the slot is made on a replication connection).
    pub pg: &'a PgConfig,
    /// The slot to create.
    pub slot: &'a str,
    /// A failover slot (Postgres 17+).
    pub failover: bool,
    /// The outbox table.
    pub table: &'a TableName,
    /// How rows become records.
    pub mapping: &'a OutboxMapping,
    /// The producer and dead-letter policy.
    pub settings: &'a RunSettings,
}

/// Creates the slot with a snapshot and publishes the rows that match
/// `request` in it, or finishes an interrupted backfill of the slot.
/// `control` must have passed the preflight checks; the publication exists.
pub async fn backfill(
    plan: Plan<'_>,
    control: &mut Client,
    request: &Request,
) -> Result<Outcome, BackfillError> {
    let slot = plan.slot;
    store::prepare(control).await?;
    if !store::lock(control, slot).await? {
        return Err(BackfillError::Busy(slot.to_owned()));
    }
    let slot_exists = slot_status(control, slot).await?.is_some();
    let recorded = store::load(control, slot).await?;
    let (publishing, resumed) = match recorded {
        Some((_, State::Done { total })) if slot_exists => {
            return Ok(Outcome::AlreadyDone { total });
        }
        Some((recorded, State::Publishing(p))) if slot_exists => {
            if recorded != *request {
                return Err(BackfillError::Mismatch {
                    slot: slot.to_owned(),
                    condition: recorded.condition,
                    order_by: recorded.order_by,
                });
            }
            tracing::info!(
                slot,
                published = p.published,
                total = p.total,
                "resuming the interrupted backfill"
            );
            (p, true)
        }
        Some((_, State::Snapshot)) if slot_exists => {
            // Made by a backfill that stopped before copying its snapshot;
            // `walbox run` refuses such a slot, so it never streamed.
            tracing::info!(
                slot,
                "dropping the slot an interrupted backfill made before copying its snapshot"
            );
            slot_manager::drop_slot(control, slot, false, None).await?;
            (start(plan, control, request).await?, false)
        }
        None if slot_exists => return Err(BackfillError::SlotExists(slot.to_owned())),
        // No record, or one of a slot since dropped: a new backfill.
        _ => (start(plan, control, request).await?, false),
    };
    let outcome = publish(plan, control, &publishing, resumed).await?;
    store::finish(control, slot).await?;
    Ok(outcome)
}

/// Records the backfill, creates the slot with a snapshot and copies the
/// matching rows out of it.
async fn start(
    plan: Plan<'_>,
    control: &mut Client,
    request: &Request,
) -> Result<Publishing, BackfillError> {
    let wanted = plan.mapping.required_columns();
    let columns = store::columns(control, plan.table, &wanted).await?;
    if let Some(missing) = wanted
        .iter()
        .find(|w| !columns.iter().any(|(c, _)| c == *w))
    {
        return Err(BackfillError::MissingColumn((*missing).to_owned()));
    }
    store::begin(control, plan.slot, plan.table, request).await?;
    let mut replication = ReplicationClient::connect(plan.pg).await?;
    let exported = replication
        .create_slot_exporting_snapshot(plan.slot, plan.failover)
        .await?;
    tracing::info!(slot = plan.slot, consistent_point = %exported.consistent_point, "slot created; copying the rows to backfill from its snapshot");
    let total = store::copy_snapshot(
        control,
        plan.slot,
        plan.table,
        request,
        &exported,
        &columns,
        &plan.mapping.id,
    )
    .await?;
    // The snapshot was needed until the copy committed.
    drop(replication);
    tracing::info!(slot = plan.slot, rows = total, "rows to backfill");
    Ok(Publishing {
        total,
        published: 0,
        consistent_point: exported.consistent_point,
        columns,
    })
}

/// A record's token: its row, and whether it is the dead-letter copy.
type Token = (u64, bool);

/// Publishes rows after `p.published`, saving the cursor as deliveries
/// arrive.
async fn publish(
    plan: Plan<'_>,
    control: &Client,
    p: &Publishing,
    resumed: bool,
) -> Result<Outcome, BackfillError> {
    let relation = RelationBody::from_catalog(
        0,
        plan.table.schema(),
        plan.table.name(),
        p.columns.iter().cloned(),
    );
    let domains = domain_base_types(control, plan.table).await?;
    let indexes = plan
        .mapping
        .resolve_with(&relation, &domains)
        .map_err(BackfillError::Mapping)?;
    let mut sink_config = plan.settings.sink.clone();
    // Not in a Kafka transaction: see the module's documentation.
    sink_config.transactional_id = None;
    let (sink, mut reports) =
        Sink::<Token>::new(&sink_config).map_err(crate::relay::RunError::from)?;
    crate::commands::run::check_brokers(&sink, &sink_config.bootstrap_servers).await?;

    let rows = Rows {
        mapping: plan.mapping,
        indexes: &indexes,
        dead_letters: &plan.settings.dead_letters,
        consistent_point: p.consistent_point,
    };
    let mut cursor = Cursor::after(p.published);
    let mut read_up_to = p.published;
    let mut outgoing: VecDeque<Record<Token>> = VecDeque::new();
    let mut dead_lettered = 0u64;
    let mut saved = p.published;
    let started = Instant::now();
    let mut save = tokio::time::interval(SAVE_EVERY);
    save.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut report = tokio::time::interval(REPORT_EVERY);
    report.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    report.tick().await;
    while cursor.done() < p.total {
        if outgoing.is_empty() && read_up_to < p.total && sink.in_flight() < BATCH as usize {
            for (n, values) in store::rows_after(control, plan.slot, read_up_to, BATCH).await? {
                read_up_to = n;
                outgoing.push_back(rows.record(n, &values)?);
            }
            if outgoing.is_empty() {
                // Fewer rows than recorded (deleted by hand): nothing more.
                read_up_to = p.total;
                for n in cursor.done() + 1..=p.total {
                    cursor.delivered(n);
                }
                continue;
            }
        }
        let size = outgoing.front().map_or(0, Record::size);
        tokio::select! {
            biased;
            Some(r) = reports.next() => {
                let (n, is_copy) = r.token;
                match r.result {
                    Ok(_) => {
                        dead_lettered += u64::from(is_copy);
                        cursor.delivered(n);
                    }
                    Err(error) => {
                        let copy = if is_copy { None } else { plan.settings.dead_letters.refused(&error, r.returned, p.consistent_point, (n, true)) };
                        match copy {
                            Some(copy) => {
                                tracing::warn!(%error, row = n, dead_letter_topic = %copy.topic, "dead-lettering the backfill row the broker refused");
                                outgoing.push_front(copy);
                            }
                            None => {
                                let resume_after = cursor.done();
                                let _ = store::save(control, plan.slot, resume_after).await;
                                return Err(BackfillError::Delivery { n, error, resume_after });
                            }
                        }
                    }
                }
            }
            permit = sink.reserve(size), if !outgoing.is_empty() => {
                if let Some(record) = outgoing.pop_front() {
                    sink.send(permit, record).await;
                }
            }
            _ = save.tick() => {
                if cursor.done() > saved {
                    store::save(control, plan.slot, cursor.done()).await?;
                    saved = cursor.done();
                }
            }
            _ = report.tick() => {
                let done = cursor.done();
                tracing::info!(
                    published = done,
                    total = p.total,
                    percent = format!("{:.1}", 100.0 * done as f64 / p.total.max(1) as f64),
                    "backfill progress"
                );
            }
        }
    }
    tracing::info!(
        slot = plan.slot,
        published = p.total - p.published,
        dead_lettered,
        elapsed = ?started.elapsed(),
        "backfill published"
    );
    drop(sink);
    Ok(Outcome::Published {
        total: p.total,
        published: p.total - p.published,
        dead_lettered,
        resumed,
    })
}

/// Turns copied rows into records, exactly as streamed rows.
struct Rows<'a> {
    mapping: &'a OutboxMapping,
    indexes: &'a ColumnIndexes,
    dead_letters: &'a DeadLetters,
    consistent_point: Lsn,
}

impl Rows<'_> {
    fn record(&self, n: u64, values: &[Option<String>]) -> Result<Record<Token>, BackfillError> {
        let tuple = TupleData::from_text(values.iter().map(|v| v.as_deref().map(str::as_bytes)))
            .ok_or(BackfillError::RowTooLarge(n))?;
        match self.mapping.map(self.indexes, &tuple) {
            Ok(event) => Ok(Record {
                topic: event.topic,
                key: Some(event.key),
                value: event.value,
                headers: event.headers,
                timestamp_ms: event.timestamp_ms,
                token: (n, false),
            }),
            Err(error) => {
                let topic = self.mapping.topic_of(self.indexes, &tuple);
                let event_id = self.mapping.event_id_of(self.indexes, &tuple);
                let payload = tuple.value_bytes(self.indexes.payload_index());
                let origin = Origin {
                    topic: topic.as_deref(),
                    lsn: self.consistent_point,
                    event_id: event_id.as_deref(),
                };
                match self
                    .dead_letters
                    .unmappable(&error, payload, origin, (n, true))
                {
                    Some(copy) => {
                        tracing::warn!(%error, row = n, dead_letter_topic = %copy.topic, "dead-lettering the backfill row that cannot be mapped");
                        Ok(copy)
                    }
                    None => Err(BackfillError::Unmappable { n, error }),
                }
            }
        }
    }
}

/// The request of `slot`'s interrupted backfill whose rows were copied
/// (`walbox run` finishes it before streaming), if any.
pub async fn resumable(
    client: &Client,
    slot: &str,
) -> Result<Option<Request>, slot_manager::Error> {
    Ok(match store::load(client, slot).await? {
        Some((request, State::Publishing(_))) => Some(request),
        _ => None,
    })
}

/// Recreates the invalidated `slot` and republishes the outbox rows whose
/// timestamp is at or after the commit time walbox last saved, less
/// `margin` (see [`store::save_position`]).
///
/// Every transaction after the saved position committed after the saved
/// commit time; its rows carry a timestamp taken before their commit (the
/// column's `now()` is the transaction's start), so the margin covers
/// transactions that ran for less than it. Duplicates: what was delivered
/// after the saved position, and the margin's rows.
pub async fn heal(
    plan: Plan<'_>,
    control: &mut Client,
    margin: Duration,
) -> Result<Outcome, BackfillError> {
    let since = store::saved_commit_time(control, plan.slot, margin)
        .await?
        .ok_or_else(|| BackfillError::NoSavedPosition(plan.slot.to_owned()))?;
    tracing::warn!(
        slot = plan.slot,
        since = %since,
        "the slot is invalidated (it lost WAL it needed): recreating it and republishing the outbox rows from the saved position's commit time less the margin"
    );
    republish_since(plan, control, &since).await
}

/// Drops `slot` (if it exists) and makes it again with a backfill of the
/// outbox rows whose timestamp column is at or after `since`.
pub async fn republish_since(
    plan: Plan<'_>,
    control: &mut Client,
    since: &str,
) -> Result<Outcome, BackfillError> {
    let ts = plan
        .mapping
        .timestamp
        .as_deref()
        .ok_or(BackfillError::NoTimestamp)?;
    if control
        .query_one("SELECT $1::text::timestamptz", &[&since])
        .await
        .is_err()
    {
        return Err(BackfillError::BadTime(since.to_owned()));
    }
    store::prepare(control).await?;
    if !store::lock(control, plan.slot).await? {
        return Err(BackfillError::Busy(plan.slot.to_owned()));
    }
    if slot_status(control, plan.slot).await?.is_some() {
        slot_manager::drop_slot(control, plan.slot, false, None).await?;
    }
    store::forget(control, plan.slot).await?;
    let column = slot_manager::quote_ident(ts);
    let request = Request {
        condition: format!(
            "{column} >= {}::timestamptz",
            slot_manager::quote_literal(since)
        ),
        order_by: column,
    };
    backfill(plan, control, &request).await
}

/// Whether `slot` has a backfill that is not done (then `walbox run` must
/// not stream yet): `(published, total)`.
pub async fn unfinished(
    client: &Client,
    slot: &str,
) -> Result<Option<(u64, u64)>, slot_manager::Error> {
    Ok(match store::load(client, slot).await? {
        Some((_, State::Snapshot)) => Some((0, 0)),
        Some((_, State::Publishing(p))) => Some((p.published, p.total)),
        _ => None,
    })
}

/// The slot's backfill in a few words, for `walbox status`.
pub async fn describe(client: &Client, slot: &str) -> Result<Option<String>, slot_manager::Error> {
    Ok(store::load(client, slot).await?.map(|(request, state)| {
        let what = format!("{:?} ordered by {:?}", request.condition, request.order_by);
        match state {
            State::Snapshot => format!("interrupted before its snapshot was copied ({what}); rerun `walbox init-slot --backfill`"),
            State::Publishing(p) => format!(
                "unfinished: {} of {} events published ({what}); rerun `walbox init-slot --backfill` to finish, `walbox run` waits for it",
                p.published, p.total
            ),
            State::Done { total } => format!("done: {total} events ({what})"),
        }
    }))
}
