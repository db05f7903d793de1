//! `walbox`: streams a Postgres transactional outbox to Kafka from the WAL.
//!
//! `main` stays thin: it parses the command line, dispatches to the
//! subcommand's module, and turns a failure into one line on stderr (with its
//! cause chain) and an exit code: 0 success, 1 a runtime failure, 2 a usage
//! or configuration error.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use walbox::commands::{self, CliError};

/// Streams a Postgres transactional outbox to Kafka from the WAL (pgoutput),
/// confirming the replication slot only after the broker acknowledged every
/// event up to it.
///
/// Settings come from --config FILE (TOML), WALBOX_* environment variables
/// (any of them also as WALBOX_…_FILE, read from that file) and flags; flags
/// win. `walbox config` shows the result. See docs/configuration.md.
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
    Migrate(commands::migrate::MigrateArgs),
    /// Creates the publication (inserts of the outbox table) and the pgoutput
    /// replication slot, after checking wal_level and the table's columns
    /// (the right to replicate is the server's to check: a refusal names
    /// the grant). Idempotent: says what it created and what already
    /// existed, so a rerun finishes what a failed one left. With --backfill, first publishes the rows
    /// that match in the new slot's snapshot (switching over from a polling
    /// relay).
    InitSlot(commands::init_slot::InitSlotArgs),
    /// Streams the outbox to Kafka until SIGINT/SIGTERM, then drains in-flight
    /// deliveries, confirms what was delivered, and exits 0.
    Run(commands::run::RunArgs),
    /// Drops the replication slot. Refused while a process streams from it,
    /// unless --force (which terminates that process first).
    DropSlot(commands::drop_slot::DropSlotArgs),
    /// Shows the slot: active and by whom, confirmed position, retained WAL,
    /// and its backfill.
    Status(commands::status::StatusArgs),
    /// Recreates the slot and republishes the outbox rows whose timestamp is
    /// at or after --since: for events a lost, dropped or restored slot
    /// never streamed. Stop `walbox run` first (or --force).
    Resync(commands::resync::ResyncArgs),
    /// What on_failure = "quarantine" holds: `list` the held aggregates,
    /// `show KEY` its events, `release KEY` (republish them in order, then
    /// let it flow) or `drop KEY` (delete them). The running `walbox run`
    /// carries out a release or drop; the command waits for it.
    Quarantine(commands::quarantine::QuarantineArgs),
    /// Checks delivery: compares a window of the outbox table (--since and
    /// --until, or --last) with what the broker holds, and reports per
    /// event type events missing from the broker, duplicates, a key's events
    /// out of order, and events on the broker that are not in the table.
    /// Reads without consuming: Kafka's topics (no group, nothing
    /// committed), JetStream's streams (an ordered consumer) or RabbitMQ's
    /// rabbitmq.audit_stream; SQS and webhooks cannot be read back.
    /// Exit status: 0 clean, 1 findings, 2 a configuration error, 3 the
    /// audit could not be made.
    Audit(commands::audit::AuditArgs),
    /// Checks the configuration as `run` would and prints the effective
    /// settings (secrets redacted) with where each came from. Exits 2 on any
    /// configuration error.
    Config(commands::config::ConfigArgs),
    /// Checks a deployment end to end with run's configuration before it
    /// goes live: Postgres (wal_level, slot and walsender headroom,
    /// max_slot_wal_keep_size, the role's rights, the publication covering
    /// exactly the outbox, each table against its mapping, the slot and a
    /// failover slot's standby), Kafka (topics, replication,
    /// min.insync.replicas, cleanup.policy, max.message.bytes against the
    /// largest payload, the principal's rights, read without writing), the
    /// metrics port and certificates' expiry. One line per check: pass,
    /// info, WARN, UNCHECKED or FAIL, what it saw and the fix. Exit status:
    /// 0 all pass, 1 a warning, 2 a failure, 3 a check could not be made.
    Doctor(commands::doctor::DoctorArgs),
}

async fn dispatch(command: Command) -> Result<(), CliError> {
    match command {
        Command::Migrate(args) => commands::migrate::run(args).await,
        Command::InitSlot(args) => commands::init_slot::run(args).await,
        Command::Run(args) => commands::run::run(args).await,
        Command::DropSlot(args) => commands::drop_slot::run(args).await,
        Command::Status(args) => commands::status::run(args).await,
        Command::Resync(args) => commands::resync::run(args).await,
        Command::Quarantine(args) => commands::quarantine::run(args).await,
        Command::Audit(args) => commands::audit::run(args).await,
        Command::Config(args) => commands::config::run(args),
        Command::Doctor(args) => commands::doctor::run(args).await,
    }
}

/// The error and its causes, each said once.
fn one_line(e: &CliError) -> String {
    format!("walbox: {}", walbox::logging::chain(e))
}

fn main() -> ExitCode {
    // An old flag name: the rename, before clap guesses at a spelling.
    let renamed = std::env::args()
        .skip(1)
        .take_while(|a| a != "--")
        .find_map(|a| walbox::config::renamed_flag(&a));
    if let Some(line) = renamed {
        walbox::logging::fatal(&format!("walbox: {line}"));
        return ExitCode::from(2);
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // A usage error in JSON mode is one JSON line like every other.
        Err(e) if e.use_stderr() && walbox::logging::asked_for_json() => {
            let text = e.to_string();
            let line = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            walbox::logging::fatal(&format!("walbox: {line}"));
            return ExitCode::from(2);
        }
        // A usage error may quote an argument: redacted like every line.
        Err(e) if e.use_stderr() => {
            eprint!("{}", walbox::redaction::redact(&e.render().to_string()));
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("walbox: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            walbox::logging::fatal(&one_line(&e));
            e.exit_code()
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
