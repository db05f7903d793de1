//! `walbox resync --since TIME`: recreates the slot and republishes the
//! outbox rows whose timestamp column is at or after TIME, for an operator
//! who knows from when events went missing (a slot lost, dropped, or
//! restored from a backup). The same path `walbox run` takes by itself for
//! an invalidated slot with `on_slot_invalidated = "recreate"`.

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
    /// deduplicate by event id).
    #[arg(long, value_name = "TIME")]
    since: String,
    /// Also when a process streams from the slot: it is terminated first.
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
    let mut client = connect_control(&c.pg).await?;
    preflight(&client, &c.table, &mapping.required_columns()).await?;
    ensure_publication(&client, &c.publication, &c.table, None).await?;
    if let Some(status) = slot_status(&client, &c.slot).await? {
        if status.active && !args.force {
            return Err(slot_manager::Error::SlotActive {
                slot: c.slot.clone(),
                pid: status.active_pid.unwrap_or(0),
            }
            .into());
        }
    }
    let plan = Plan {
        pg: &c.pg,
        slot: &c.slot,
        failover: false,
        table: &c.table,
        mapping: &mapping,
        settings: &settings,
    };
    if let Outcome::Published {
        total,
        dead_lettered,
        ..
    } = republish_since(plan, &mut client, &args.since, args.force).await?
    {
        println!(
            "slot {:?}: recreated; republished {total} events from {} ({dead_lettered} to the dead-letter topic); `walbox run` streams from here",
            c.slot, args.since
        );
    }
    Ok(())
}
