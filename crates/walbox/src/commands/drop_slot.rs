//! `walbox drop-slot`.

use slot_manager::{connect_control, drop_slot};

use super::{loaded, CliError};
use crate::config::ConnectionFlags;

/// Arguments of `walbox drop-slot`.
#[derive(Debug, clap::Args)]
pub struct DropSlotArgs {
    #[command(flatten)]
    settings: ConnectionFlags,
    /// Terminate the process holding the slot first.
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
