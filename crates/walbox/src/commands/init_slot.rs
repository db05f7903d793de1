//! `walbox init-slot`: the publication and the slot, idempotently.

use slot_manager::{connect_control, ensure_publication, ensure_slot, preflight, Ensured};

use super::{loaded, CliError};
use crate::config::MappingFlags;

/// Arguments of `walbox init-slot`.
#[derive(Debug, clap::Args)]
pub struct InitSlotArgs {
    #[command(flatten)]
    settings: MappingFlags,
    /// Create a failover slot, synchronized to standbys (Postgres 17+).
    #[arg(long)]
    failover: bool,
}

fn say(what: &str, name: &str, e: Ensured) {
    match e {
        Ensured::Created => println!("{what} {name:?}: created"),
        Ensured::AlreadyPresent => println!("{what} {name:?}: already present"),
    }
}

/// Checks the server and table, then ensures the publication and the slot.
pub async fn run(args: InitSlotArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let c = config.connection()?;
    let mapping = config.mapping()?;
    let client = connect_control(&c.pg).await?;
    preflight(&client, &c.table, &mapping.required_columns()).await?;
    say(
        "publication",
        &c.publication,
        ensure_publication(&client, &c.publication, &c.table).await?,
    );
    say(
        "slot",
        &c.slot,
        ensure_slot(&client, &c.slot, args.failover).await?,
    );
    Ok(())
}
