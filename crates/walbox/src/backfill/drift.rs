//! Publication drift healed from the outbox table: the rows inserted while
//! the publication did not cover the table never entered the stream
//! (Postgres decodes each change with the catalog of its time), but they
//! are in the table.
//!
//! The slot is kept where the drift stop held it. The rows whose timestamp
//! is at or after the last delivered commit less the margin are copied out
//! of one snapshot taken now, after the publication covers the table again,
//! and published before the slot streams on. So:
//!
//! - nothing is lost: a row committed before the snapshot is in it; one
//!   committed after is published, so in the stream; and the stream from
//!   the held position still carries every change it carried before, the
//!   rows of a table since dropped included (which a recreated slot would
//!   not);
//! - per key, first arrivals keep the table's order: every row of the gap
//!   and after it up to the snapshot is published from the snapshot, in
//!   order, before the stream's copies of any of them;
//! - duplicates: the stream then sends again what it carries after the
//!   held position (rows published before the gap or after the fix), and
//!   the margin's rows. Consumers deduplicate by event id, as after any
//!   crash.

use tokio_postgres::Client;

use super::{backfill, BackfillError, Outcome, Plan};
use crate::bookkeeping::backfills::{self as store, Request};
use crate::bookkeeping::drift;

/// Republishes the rows of `plan.table` whose timestamp column is at or
/// after `since` from a snapshot taken now ([`copy_drift_rows`]), then
/// publishes them (resumable like any backfill: `walbox run` finishes an
/// interrupted one before streaming). The slot must exist: it streams on
/// from where it was.
pub async fn heal_drift(
    plan: Plan<'_>,
    control: &mut Client,
    since: &str,
) -> Result<Outcome, BackfillError> {
    let request = copy_drift_rows(plan, control, since).await?;
    backfill(plan, control, &request).await
}

/// The first half of [`heal_drift`]: copies the rows to republish from a
/// snapshot taken now and records them as the slot's unfinished backfill,
/// forgetting its drift stop in the same transaction. From then on
/// `walbox run` streams nothing until they are published; [`backfill`]
/// with the returned request publishes them.
pub async fn copy_drift_rows(
    plan: Plan<'_>,
    control: &mut Client,
    since: &str,
) -> Result<Request, BackfillError> {
    let request = super::since_request(plan, control, since).await?;
    if slot_manager::slot_status(control, plan.slot)
        .await?
        .is_none()
    {
        return Err(BackfillError::NoSlotToHeal(plan.slot.to_owned()));
    }
    store::prepare(control).await?;
    if !store::lock(control, plan.slot).await? {
        return Err(BackfillError::Busy(plan.slot.to_owned()));
    }
    let columns = super::mapped_columns(plan, control).await?;
    // The drift stop is forgotten with the copy: from here on the
    // backfill's record says what to finish.
    let forget = crate::bookkeeping::exist(control, &["walbox.drift_stops"])
        .await?
        .then_some(drift::FORGET);
    let total = store::copy_current(
        control,
        plan.slot,
        plan.table,
        &request,
        &columns,
        &plan.mapping.id,
        forget,
    )
    .await?;
    tracing::info!(
        slot = plan.slot,
        since,
        rows = total,
        "republishing the outbox rows since the drift; the slot streams on after them"
    );
    crate::testpoint::reached("drift_heal.copied").await;
    Ok(request)
}
