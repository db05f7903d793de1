//! `walbox drop-slot`.

use slot_manager::{connect_control, drop_slot, pending_events, slot_status};

use super::{loaded, CliError};
use crate::config::ConnectionFlags;

/// Arguments of `walbox drop-slot`.
#[derive(Debug, clap::Args)]
pub struct DropSlotArgs {
    #[command(flatten)]
    settings: ConnectionFlags,
    /// Drop it anyway: when a process holds the slot (it is terminated
    /// first), and when the slot still holds events not yet delivered (they
    /// are lost). Without it, drop-slot counts what the slot holds
    /// (decoding its pending WAL, which takes a while on a large backlog)
    /// and refuses if any event is left.
    #[arg(long)]
    force: bool,
    /// Also drop the publication.
    #[arg(long)]
    drop_publication: bool,
}

fn outcome(done: bool) -> &'static str {
    if done {
        "dropped"
    } else {
        "did not exist"
    }
}

/// Drops the slot (and the publication); with shards and no `shard`,
/// every shard's.
pub async fn run(args: DropSlotArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let base = config.connection()?;
    let client = connect_control(&base.pg).await?;
    for c in base.selected_shards() {
        if !args.force {
            refuse_if_pending(&client, &c).await?;
        }
        let publication = args.drop_publication.then_some(c.publication.as_str());
        let dropped = drop_slot(&client, &c.slot, args.force, publication).await?;
        if let Some(pid) = dropped.terminated_pid {
            println!("terminated process {pid}, which held the slot");
        }
        println!("slot {:?}: {}", c.slot, outcome(dropped.slot));
        // A backfill's bookkeeping belongs to its slot.
        if let Err(e) = crate::bookkeeping::backfills::forget(&client, &c.slot).await {
            tracing::warn!(error = %e, "the slot's backfill record in walbox.backfills was not removed");
        }
        if let Err(e) = crate::bookkeeping::drift::forget(&client, &c.slot).await {
            tracing::warn!(error = %e, "the slot's drift stop in walbox.drift_stops was not removed");
        }
        if let Err(e) = crate::bookkeeping::joined::forget(&client, &c.slot).await {
            tracing::warn!(error = %e, "the slot's record in walbox.published_tables was not removed");
        }
        if args.drop_publication {
            println!(
                "publication {:?}: {}",
                c.publication,
                outcome(dropped.publication)
            );
        }
    }
    Ok(())
}

/// Refuses to drop a slot that still holds events walbox has not delivered.
/// A slot that is held is left to [`drop_slot`]'s own refusal.
async fn refuse_if_pending(
    client: &tokio_postgres::Client,
    c: &crate::config::Connection,
) -> Result<(), CliError> {
    let Some(status) = slot_status(client, &c.slot).await? else {
        return Ok(());
    };
    if status.active {
        return Ok(());
    }
    let pending = pending_events(client, &c.slot, &c.publication, c.source.messages())
        .await
        .map_err(|e| CliError::DropRefused {
            slot: c.slot.clone(),
            why: format!("what it still holds cannot be told ({e})"),
        })?;
    if pending.events > 0 {
        return Err(CliError::DropRefused {
            slot: c.slot.clone(),
            why: format!(
                "it still holds {} event(s) not yet delivered, in {} bytes of WAL after its confirmed position; dropping it loses them",
                pending.events, pending.wal_bytes
            ),
        });
    }
    Ok(())
}
