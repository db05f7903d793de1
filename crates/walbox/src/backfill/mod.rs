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
//! as it moves (at most every 50 ms). A rerun after a crash publishes from there: duplicates are
//! at most the rows in flight or delivered in the last second, never a
//! loss. `walbox run` refuses to stream while a backfill is unfinished, so
//! one aggregate's backfilled events always precede its streamed ones.
//!
//! The backfill writes with the at-least-once producer, exactly-once mode
//! included: its rows carry their event ids for deduplication.

mod drift;
mod heal;
pub mod order;
mod publish;

use std::time::Duration;

use slot_manager::{slot_status, PgConfig, ReplicationClient, TableName};
use tokio_postgres::Client;

pub use crate::bookkeeping::backfills::Request;
use crate::bookkeeping::backfills::{self as store, Publishing, State};
use crate::config::RunSettings;
use crate::mapping::{MapError, OutboxMapping};
pub use drift::{copy_drift_rows, heal_drift};
pub use heal::{heal, republish_since};

/// Rows read from `walbox.backfill_rows` at a time.
const BATCH: i64 = 2_000;
/// How often the cursor is saved while it does not move (it is saved
/// when it moves, at most every 50 ms).
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
    /// Publishing stopped: a row that cannot be mapped with no dead-letter
    /// topic, a delivery that failed, Postgres.
    #[error("{source}; the backfill stopped with every row up to {resume_after} delivered: fix the cause and rerun `walbox init-slot --backfill` (or `walbox run`) to resume after it")]
    Stopped {
        /// Rows up to this one were delivered (the saved cursor).
        resume_after: u64,
        /// Why.
        source: Box<crate::relay::RunError>,
    },
    /// The producer.
    #[error(transparent)]
    Run(#[from] crate::relay::RunError),
    /// The configured broker cannot take republished rows.
    #[error(transparent)]
    Refused(#[from] crate::config::ConfigError),
    /// A lost slot, and no saved position to republish from.
    #[error("replication slot {0:?} is invalidated and walbox saved no position to republish from (it saves one every 10 s while streaming with on_slot_invalidated = \"recreate\"); republish from a time you know with `walbox resync --since TIME`")]
    NoSavedPosition(String),
    /// Republishing by time needs the timestamp column.
    #[error("republishing from the outbox table by time needs the timestamp column (mapping.timestamp); with none, use `walbox init-slot --backfill` with a condition of your own after dropping the slot")]
    NoTimestamp,
    /// A drift stop whose last delivered commit time walbox never knew.
    #[error("slot {0:?} stopped for publication drift, and walbox knew no commit time to republish from (none delivered since it started, and no position saved); republish from a time you know, before the stop: `walbox resync --drift --since TIME`")]
    NoDriftTime(String),
    /// Healing drift streams on from the slot, which is gone.
    #[error("replication slot {0:?} does not exist: healing publication drift republishes what the slot's stream did not carry and streams on from it; with the slot gone, republish from a time you know with `walbox resync --since TIME`")]
    NoSlotToHeal(String),
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
            // Made by a backfill that stopped before copying its snapshot,
            // or the lost slot a heal recorded itself to replace: `walbox
            // run` streams from neither while the record is unfinished.
            tracing::info!(
                slot,
                "dropping the slot of an unfinished backfill or heal that has not copied its snapshot yet"
            );
            slot_manager::drop_slot(control, slot, false, None).await?;
            crate::testpoint::reached("backfill.slot_dropped").await;
            (start(plan, control, request).await?, false)
        }
        None if slot_exists => return Err(BackfillError::SlotExists(slot.to_owned())),
        // No record, or one of a slot since dropped: a new backfill.
        _ => (start(plan, control, request).await?, false),
    };
    let outcome = publish::publish(plan, control, &publishing, resumed).await?;
    store::finish(control, slot).await?;
    Ok(outcome)
}

/// The columns of the outbox table the mapping needs, with their type OIDs;
/// one missing is refused.
async fn mapped_columns(
    plan: Plan<'_>,
    control: &Client,
) -> Result<Vec<(String, u32)>, BackfillError> {
    let wanted = plan.mapping.required_columns();
    let columns = store::columns(control, plan.table, &wanted).await?;
    match wanted
        .iter()
        .find(|w| !columns.iter().any(|(c, _)| c == *w))
    {
        Some(missing) => Err(BackfillError::MissingColumn((*missing).to_owned())),
        None => Ok(columns),
    }
}

/// The request that republishes the rows whose timestamp column is at or
/// after `since` (checked to be a time Postgres reads), in the order
/// [`order::choose`] picks for the table.
async fn since_request(
    plan: Plan<'_>,
    control: &Client,
    since: &str,
) -> Result<Request, BackfillError> {
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
    let order = order::choose(control, plan.table, plan.mapping).await?;
    order.report(plan.table);
    Ok(Request {
        condition: format!(
            "{} >= {}::timestamptz",
            slot_manager::quote_ident(ts),
            slot_manager::quote_literal(since)
        ),
        order_by: order.sql,
    })
}

/// Records the backfill, creates the slot with a snapshot and copies the
/// matching rows out of it.
async fn start(
    plan: Plan<'_>,
    control: &mut Client,
    request: &Request,
) -> Result<Publishing, BackfillError> {
    let columns = mapped_columns(plan, control).await?;
    store::begin(control, plan.slot, plan.table, request).await?;
    let mut replication = ReplicationClient::connect(plan.pg).await?;
    let exported = replication
        .create_slot_exporting_snapshot(plan.slot, plan.failover)
        .await?;
    tracing::info!(slot = plan.slot, consistent_point = %exported.consistent_point, "slot created; copying the rows to backfill from its snapshot");
    crate::testpoint::reached("backfill.slot_created").await;
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
    crate::testpoint::reached("backfill.copied").await;
    Ok(Publishing {
        total,
        published: 0,
        consistent_point: exported.consistent_point,
        columns,
    })
}
