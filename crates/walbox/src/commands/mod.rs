//! One module per subcommand. Each loads the configuration (which also sets
//! up logging) and does its one job; a failure is a [`CliError`], which
//! `main` prints as one line and turns into the exit code.

pub mod audit;
pub mod config;
pub mod drop_slot;
pub mod init_slot;
pub mod migrate;
pub mod resync;
pub mod run;
pub mod status;

use std::process::ExitCode;

use crate::config::{Config, ConfigError, LogFormat};

/// A failure reported to the operator.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// `walbox migrate`.
    #[error(transparent)]
    Migrate(#[from] migrate::MigrateError),
    /// A configuration error: exit status 2.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Postgres.
    #[error(transparent)]
    Postgres(#[from] slot_manager::Error),
    /// The relay.
    #[error(transparent)]
    Run(#[from] crate::relay::RunError),
    /// A backfill.
    #[error(transparent)]
    Backfill(#[from] crate::backfill::BackfillError),
    /// `drop-slot` without `--force` on a slot that may hold events.
    #[error("replication slot {slot:?} was not dropped: {why}. Let walbox run deliver them, or drop it anyway with --force")]
    DropRefused {
        /// The slot.
        slot: String,
        /// Why.
        why: String,
    },
    /// No such slot.
    #[error("replication slot {0:?} does not exist; create it with `walbox init-slot`")]
    NoSlot(String),
    /// `walbox audit` could not be made.
    #[error("audit: {0}")]
    Audit(#[from] crate::audit::AuditError),
    /// `walbox audit` found problems: exit status 1.
    #[error("audit: {0} findings")]
    Findings(u64),
    /// The metrics address cannot be bound.
    #[error("cannot serve metrics on {0}")]
    Metrics(std::net::SocketAddr, #[source] std::io::Error),
}

impl CliError {
    /// 2 for configuration errors, 3 for an audit that could not be made
    /// (its 1 means findings), 1 for the rest.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Config(_) => ExitCode::from(2),
            CliError::Audit(_) => ExitCode::from(3),
            _ => ExitCode::FAILURE,
        }
    }
}

/// Sets up logging to stderr, once (see [`crate::logging`]).
pub fn init_logging(format: LogFormat) {
    crate::logging::init(format);
}

/// The configuration, with logging set up as it says.
pub(crate) fn loaded(config: Result<Config, ConfigError>) -> Result<Config, CliError> {
    let config = config?;
    init_logging(config.log_format());
    Ok(config)
}
