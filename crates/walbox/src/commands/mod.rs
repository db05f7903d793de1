//! One module per subcommand. Each loads the configuration (which also sets
//! up logging) and does its one job; a failure is a [`CliError`], which
//! `main` prints as one line and turns into the exit code.

pub mod audit;
pub mod config;
pub mod doctor;
pub mod drop_slot;
pub mod init_slot;
pub mod migrate;
pub mod quarantine;
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
    /// `walbox quarantine`: the aggregate is not held.
    #[error(
        "slot {slot:?} holds nothing for {key:?} (walbox quarantine list shows what it holds)"
    )]
    NotHeld {
        /// The slot.
        slot: String,
        /// The record key asked for.
        key: String,
    },
    /// `walbox quarantine release`: a released event was refused again.
    #[error("the release of {key:?} failed and it stays held: {error}")]
    ReleaseFailed {
        /// The record key.
        key: String,
        /// Why.
        error: String,
    },
    /// `walbox quarantine release|drop`: no running walbox carried the
    /// request out in time.
    #[error("the {request} of {key:?} was not carried out within {secs} s: `walbox run` (with on_failure = \"quarantine\") carries it out, and will when it runs; the request stays")]
    NotCarriedOut {
        /// `release` or `drop`.
        request: &'static str,
        /// The record key.
        key: String,
        /// How long it waited.
        secs: u64,
    },
    /// `walbox doctor` found problems (or could not check): its exit
    /// status is the worst verdict's.
    #[error("doctor: {summary}")]
    Doctor {
        /// 1 a warning, 2 a failure, 3 a check not made.
        status: u8,
        /// The count of each verdict.
        summary: String,
    },
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
            CliError::Doctor { status, .. } => ExitCode::from(*status),
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
