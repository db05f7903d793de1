//! `walbox`: streams a Postgres transactional outbox to Kafka from the WAL.
//!
//! This binary owns the operator surface (the CLI and its configuration) and,
//! as the connector grows, the relay loop that joins `slot-manager` and
//! `sink-kafka`. See `docs/` and `walbox --help`.

mod migrate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Streams a Postgres transactional outbox to Kafka from the WAL (pgoutput),
/// confirming the replication slot only after the broker acknowledged every
/// event up to it.
#[derive(Debug, Parser)]
#[command(name = "walbox", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Applies walbox's SQL migrations (the default outbox table
    /// `public.outbox_events` and the consumer dedup table
    /// `public.processed_events`). Safe to run again: applied migrations are
    /// recorded in `public.walbox_migrations` and skipped.
    Migrate(migrate::MigrateArgs),
    /// Creates the publication and the logical replication slot (idempotent).
    InitSlot,
    /// Streams the outbox to Kafka until SIGINT/SIGTERM.
    Run,
    /// Drops the replication slot (refused while it is active unless --force).
    DropSlot,
    /// Shows the slot's state: active, confirmed position, retained WAL.
    Status,
}

/// A failure reported to the operator: one line with its cause chain.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Migrate(#[from] migrate::MigrateError),
    #[error("`walbox {0}` is not available in this build yet")]
    NotBuilt(&'static str),
}

async fn try_main(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate(args) => migrate::run(args).await?,
        Command::InitSlot => return Err(CliError::NotBuilt("init-slot")),
        Command::Run => return Err(CliError::NotBuilt("run")),
        Command::DropSlot => return Err(CliError::NotBuilt("drop-slot")),
        Command::Status => return Err(CliError::NotBuilt("status")),
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("walbox: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(try_main(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let mut line = format!("walbox: {e}");
            let mut source = std::error::Error::source(&e);
            while let Some(cause) = source {
                line.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("{line}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }
}
