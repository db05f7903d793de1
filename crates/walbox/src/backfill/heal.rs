//! A lost slot healed from the outbox table, by time.

use std::time::Duration;

use slot_manager::slot_status;
use tokio_postgres::Client;

use super::{backfill, BackfillError, Outcome, Plan};
use crate::bookkeeping::backfills as store;

/// Recreates the invalidated `slot` and republishes the outbox rows whose
/// timestamp is at or after the commit time walbox last saved, less
/// `margin` (see [`crate::bookkeeping::positions`]).
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
    let since = crate::bookkeeping::positions::saved_commit_time(control, plan.slot, margin)
        .await?
        .ok_or_else(|| BackfillError::NoSavedPosition(plan.slot.to_owned()))?;
    tracing::warn!(
        slot = plan.slot,
        since = %since,
        "the slot is invalidated (it lost WAL it needed): recreating it and republishing the outbox rows from the saved position's commit time less the margin"
    );
    republish_since(plan, control, &since, false).await
}

/// Drops `slot` (if it exists) and makes it again with a backfill of the
/// outbox rows whose timestamp column is at or after `since`; `terminate`:
/// a process streaming from the slot is terminated first.
///
/// The heal is recorded in `walbox.backfills` before anything is dropped,
/// so each step can be interrupted (a signal, kill -9, a lost connection)
/// and the next `walbox run` (or the same command again) resumes it from
/// the record: the old slot dropped if still there, the new one made, the
/// rows copied from its snapshot, published after the saved cursor.
pub async fn republish_since(
    plan: Plan<'_>,
    control: &mut Client,
    since: &str,
    terminate: bool,
) -> Result<Outcome, BackfillError> {
    let request = super::since_request(plan, control, since).await?;
    store::prepare(control).await?;
    if !store::lock(control, plan.slot).await? {
        return Err(BackfillError::Busy(plan.slot.to_owned()));
    }
    // The intent first: from here on, whatever happens, a record says what
    // to finish, and `walbox run` streams nothing until it is done.
    store::begin(control, plan.slot, plan.table, &request).await?;
    crate::testpoint::reached("heal.recorded").await;
    if terminate
        && slot_status(control, plan.slot)
            .await?
            .is_some_and(|s| s.active)
    {
        slot_manager::drop_slot(control, plan.slot, true, None).await?;
    }
    // The record in state `snapshot`: the old slot (if any) is dropped,
    // and a new one made with its snapshot.
    backfill(plan, control, &request).await
}
