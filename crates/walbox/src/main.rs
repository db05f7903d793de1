//! `walbox`: streams a Postgres transactional outbox to Kafka from the WAL.
//!
//! `main` stays thin: it parses the command line, runs `try_main`, and turns
//! a failure into one line on stderr (with its cause chain) and an exit code:
//! 0 success, 1 a runtime failure, 2 a usage or configuration error.

mod migrate;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use slot_manager::{
    connect_control, drop_slot, ensure_publication, ensure_slot, preflight, slot_status, Ensured,
};
use walbox::config::{CommonArgs, ConfigError, KafkaArgs, LogFormat, Settings};

/// Streams a Postgres transactional outbox to Kafka from the WAL (pgoutput),
/// confirming the replication slot only after the broker acknowledged every
/// event up to it.
///
/// Settings come from --config FILE (TOML), WALBOX_* environment variables
/// and flags; flags win. See docs/configuration.md.
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
    /// Creates the publication (inserts of the outbox table) and the pgoutput
    /// replication slot, after checking wal_level, the role's REPLICATION
    /// privilege and the table's columns. Idempotent: says what it created
    /// and what already existed.
    InitSlot {
        #[command(flatten)]
        common: CommonArgs,
        /// Create a failover slot, synchronized to standbys (Postgres 17+).
        #[arg(long)]
        failover: bool,
    },
    /// Streams the outbox to Kafka until SIGINT/SIGTERM, then drains in-flight
    /// deliveries, confirms what was delivered, and exits 0.
    Run {
        #[command(flatten)]
        common: CommonArgs,
        #[command(flatten)]
        kafka: KafkaArgs,
    },
    /// Drops the replication slot. Refused while a process streams from it,
    /// unless --force (which terminates that process first).
    DropSlot {
        #[command(flatten)]
        common: CommonArgs,
        /// Terminate the process holding the slot first.
        #[arg(long)]
        force: bool,
        /// Also drop the publication.
        #[arg(long)]
        drop_publication: bool,
    },
    /// Shows the slot: active and by whom, confirmed position, retained WAL.
    Status {
        #[command(flatten)]
        common: CommonArgs,
    },
}

/// A failure reported to the operator.
#[derive(Debug, thiserror::Error)]
enum CliError {
    #[error(transparent)]
    Migrate(#[from] migrate::MigrateError),
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    #[error(transparent)]
    Run(#[from] walbox::relay::RunError),
    #[error("replication slot {0:?} does not exist; create it with `walbox init-slot`")]
    NoSlot(String),
    #[error("cannot serve metrics on {0}")]
    Metrics(std::net::SocketAddr, #[source] std::io::Error),
}

impl CliError {
    fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Config(_) => ExitCode::from(2),
            _ => ExitCode::FAILURE,
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("WALBOX_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn ensured(what: &str, name: &str, e: Ensured) {
    match e {
        Ensured::Created => println!("{what} {name:?}: created"),
        Ensured::AlreadyPresent => println!("{what} {name:?}: already present"),
    }
}

async fn try_main(cli: Cli) -> Result<(), CliError> {
    match cli.command {
        Command::Migrate(args) => migrate::run(args).await?,
        Command::InitSlot { common, failover } => {
            let s = Settings::resolve(&common, None)?;
            let client = connect_control(&s.pg).await?;
            preflight(&client, &s.table, &s.mapping.required_columns(), None).await?;
            ensured(
                "publication",
                &s.publication,
                ensure_publication(&client, &s.publication, &s.table).await?,
            );
            ensured(
                "slot",
                &s.slot,
                ensure_slot(&client, &s.slot, failover).await?,
            );
        }
        Command::DropSlot {
            common,
            force,
            drop_publication,
        } => {
            let s = Settings::resolve(&common, None)?;
            let client = connect_control(&s.pg).await?;
            let publication = drop_publication.then_some(s.publication.as_str());
            let dropped = drop_slot(&client, &s.slot, force, publication).await?;
            if let Some(pid) = dropped.terminated_pid {
                println!("terminated process {pid}, which held the slot");
            }
            println!(
                "slot {:?}: {}",
                s.slot,
                if dropped.slot {
                    "dropped"
                } else {
                    "did not exist"
                }
            );
            if drop_publication {
                println!(
                    "publication {:?}: {}",
                    s.publication,
                    if dropped.publication {
                        "dropped"
                    } else {
                        "did not exist"
                    }
                );
            }
        }
        Command::Status { common } => {
            let s = Settings::resolve(&common, None)?;
            let client = connect_control(&s.pg).await?;
            let st = slot_status(&client, &s.slot)
                .await?
                .ok_or_else(|| CliError::NoSlot(s.slot.clone()))?;
            let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
            println!("slot:                {}", s.slot);
            println!(
                "active:              {}",
                match st.active_pid {
                    Some(pid) => format!("yes (process {pid})"),
                    None => "no".into(),
                }
            );
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
        }
        Command::Run { common, kafka } => {
            let s = Settings::resolve(&common, Some(&kafka))?;
            init_logging(s.log_format);
            let (tx, rx) = tokio::sync::watch::channel(false);
            tokio::spawn(async move {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                        .expect("install a SIGTERM handler");
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                tracing::info!("shutting down: draining in-flight deliveries");
                let _ = tx.send(true);
            });
            let metrics = walbox::metrics::Metrics::new();
            if let Some(addr) = s.metrics_addr {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| CliError::Metrics(addr, e))?;
                tracing::info!(%addr, "serving /metrics, /healthz, /readyz");
                let m = std::sync::Arc::clone(&metrics);
                tokio::spawn(async move {
                    if let Err(e) = walbox::metrics::serve(listener, m).await {
                        tracing::error!(error = %e, "metrics endpoint stopped");
                    }
                });
            }
            walbox::relay::run(&s, rx, metrics).await?;
            tracing::info!("stopped");
        }
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
                let text = cause.to_string();
                if !line.contains(&text) {
                    line.push_str(&format!(": {text}"));
                }
                source = cause.source();
            }
            eprintln!("{line}");
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
