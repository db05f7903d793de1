//! `walbox resync --since TIME`: recreates the slot and republishes the
//! outbox rows whose timestamp column is at or after TIME, for an operator
//! who knows from when events went missing (a slot lost, dropped, or
//! restored from a backup). The same path `walbox run` takes by itself for
//! an invalidated slot with `on_slot_invalidated = "recreate"`.
//!
//! `walbox resync --drift`: after walbox stopped for publication drift and
//! the publication was fixed, republishes the rows the stream did not
//! carry, from the time the stop recorded, and keeps the slot (see
//! [`crate::backfill::heal_drift`]); the same path `walbox run` takes by
//! itself with `on_drift = "heal"`.

use slot_manager::{connect_control, ensure_publication, preflight, slot_status};

use super::{loaded, CliError};
use crate::backfill::{republish_since, Outcome, Plan};
use crate::config::{ConfigError, EventSource, RunFlags};

/// Arguments of `walbox resync`.
#[derive(Debug, clap::Args)]
pub struct ResyncArgs {
    #[command(flatten)]
    settings: RunFlags,
    /// Republish the rows whose timestamp column (mapping.timestamp) is at
    /// or after this time, e.g. "2026-11-22 08:00:00+00". Earlier rows are
    /// not sent; later ones may have been sent before (consumers
    /// deduplicate by event id). With --drift: instead of the time the
    /// drift stop recorded.
    #[arg(long, value_name = "TIME", required_unless_present = "drift")]
    since: Option<String>,
    /// After a stop for publication drift, once the publication covers the
    /// table again: republish the rows the stream did not carry (from the
    /// last delivered commit before the stop, less
    /// slot_recreate_margin_secs) and keep the slot, which streams on after
    /// them. Run it before `walbox run` streams again, so that each key's
    /// events keep their order.
    #[arg(long)]
    drift: bool,
    /// Also when a process streams from the slot: it is terminated first
    /// (with --drift: once the rows are copied; it then waits for them).
    #[arg(long)]
    force: bool,
}

/// Drops and recreates the slot, republishing from `--since`.
pub async fn run(args: ResyncArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let c = config.connection()?;
    let mapping = config.mapping()?;
    let settings = config.run()?;
    if c.shards > 1 {
        return Err(ConfigError(
            "resync with shards > 1 is not supported: it would republish every shard's rows through one slot (resync each shard's table range by hand, or run it unsharded)".into(),
        )
        .into());
    }
    if c.source != EventSource::Table {
        return Err(ConfigError(
            "resync republishes rows of the outbox table; events written as logical decoding messages (source = messages or both) are in no table, so those lost with the slot cannot be republished".into(),
        )
        .into());
    }
    let table = c.table("walbox resync")?;
    let mut client = connect_control(&c.pg).await?;
    preflight(&client, table, &mapping.required_columns()).await?;
    let plan = Plan {
        pg: &c.pg,
        slot: &c.slot,
        failover: false,
        table,
        mapping: &mapping,
        settings: &settings,
    };
    if args.drift {
        return resync_drift(plan, &c.publication, &mut client, args).await;
    }
    let since = args.since.as_deref().unwrap_or_default();
    ensure_publication(&client, &c.publication, table, None).await?;
    if let Some(status) = slot_status(&client, &c.slot).await? {
        if status.active && !args.force {
            return Err(slot_manager::Error::SlotActive {
                slot: c.slot.clone(),
                pid: status.active_pid.unwrap_or(0),
            }
            .into());
        }
    }
    if let Outcome::Published {
        total,
        dead_lettered,
        ..
    } = republish_since(plan, &mut client, since, args.force).await?
    {
        println!(
            "slot {:?}: recreated; republished {total} events from {since} ({dead_lettered} to the dead-letter topic); `walbox run` streams from here",
            c.slot
        );
    }
    Ok(())
}

/// `--drift`: republishes what the stream did not carry since the recorded
/// drift stop, keeping the slot.
async fn resync_drift(
    plan: Plan<'_>,
    publication: &str,
    client: &mut tokio_postgres::Client,
    args: ResyncArgs,
) -> Result<(), CliError> {
    let slot = plan.slot;
    let stop = crate::bookkeeping::drift::load(client, slot).await?;
    let since = match (&args.since, &stop) {
        (Some(since), _) => since.clone(),
        (None, None) => {
            return Err(ConfigError(format!(
                "slot {slot:?} has no drift stop recorded (walbox.drift_stops): nothing to heal; to republish from a time you know, use --since TIME"
            ))
            .into())
        }
        (None, Some(stop)) => stop
            .since(plan.settings.margin)
            .ok_or_else(|| crate::backfill::BackfillError::NoDriftTime(slot.to_owned()))?,
    };
    let reading = slot_manager::coverage(client, publication, plan.table, None).await?;
    if let Some(gap) = reading.gap {
        return Err(ConfigError(format!(
            "{gap}: fix the publication first; the rows republished are those inserted before the fix"
        ))
        .into());
    }
    let holder = slot_status(client, slot)
        .await?
        .filter(|s| s.active)
        .and_then(|s| s.active_pid);
    if let (Some(pid), false) = (holder, args.force) {
        return Err(slot_manager::Error::SlotActive {
            slot: slot.to_owned(),
            pid,
        }
        .into());
    }
    let request = crate::backfill::copy_drift_rows(plan, client, &since).await?;
    if let Some(pid) = holder {
        // The copy is recorded: the process reconnects, finds the backfill
        // unfinished and waits until this one has published it.
        client
            .execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .map_err(slot_manager::Error::sql(
                "terminate the process streaming from the slot",
            ))?;
        println!("terminated process {pid}, which streamed from the slot");
    }
    let outcome = crate::backfill::backfill(plan, client, &request)
        .await
        .map_err(CliError::from)?;
    if let Outcome::Published {
        total,
        dead_lettered,
        ..
    } = outcome
    {
        println!(
            "slot {slot:?}: kept; republished {total} events inserted since {since} ({dead_lettered} to the dead-letter topic); `walbox run` streams on from the slot"
        );
    }
    Ok(())
}
