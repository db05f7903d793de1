//! `walbox status`.

use slot_manager::{connect_control, slot_status};

use super::{loaded, CliError};
use crate::config::ConnectionFlags;

/// Arguments of `walbox status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    settings: ConnectionFlags,
}

/// Prints the slot's state.
pub async fn run(args: StatusArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let c = config.connection()?;
    let client = connect_control(&c.pg).await?;
    let st = slot_status(&client, &c.slot)
        .await?
        .ok_or_else(|| CliError::NoSlot(c.slot.clone()))?;
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let active = match st.active_pid {
        Some(pid) => format!("yes (process {pid})"),
        None => "no".into(),
    };
    println!("slot:                {}", c.slot);
    println!("active:              {active}");
    println!(
        "confirmed_flush_lsn: {}",
        opt(st.confirmed_flush_lsn.map(|l| l.to_string()))
    );
    println!(
        "restart_lsn:         {}",
        opt(st.restart_lsn.map(|l| l.to_string()))
    );
    println!(
        "retained_wal_bytes:  {}",
        opt(st.retained_wal_bytes.map(|b| b.to_string()))
    );
    println!("wal_status:          {}", opt(st.wal_status));
    println!(
        "safe_wal_size:       {}",
        st.safe_wal_size
            .map_or_else(|| "unlimited".into(), |b| b.to_string())
    );
    if let Some((lsn, committed, saved)) = crate::positions::saved(&client, &c.slot).await? {
        println!("saved position:      {lsn} (commit {committed}, saved {saved})");
    }
    if let Some(backfill) = crate::backfill::describe(&client, &c.slot).await? {
        println!("backfill:            {backfill}");
    }
    Ok(())
}
