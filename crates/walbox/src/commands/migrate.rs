//! `walbox migrate`: the SQL in `migrations/`, embedded in the binary.

use slot_manager::connect_control;

use super::{loaded, CliError};
use crate::config::ConnectionFlags;

/// The numbered migrations, in order: (version, file name, SQL).
pub(crate) const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "0001_outbox_events.sql",
        include_str!("../../../../migrations/0001_outbox_events.sql"),
    ),
    (
        2,
        "0002_processed_events.sql",
        include_str!("../../../../migrations/0002_processed_events.sql"),
    ),
    (
        3,
        "0003_emit.sql",
        include_str!("../../../../migrations/0003_emit.sql"),
    ),
    (
        4,
        "0004_outbox_seq.sql",
        include_str!("../../../../migrations/0004_outbox_seq.sql"),
    ),
    (
        5,
        "0005_receipts.sql",
        include_str!("../../../../migrations/0005_receipts.sql"),
    ),
    (
        6,
        "0006_receipts_every_broker.sql",
        include_str!("../../../../migrations/0006_receipts_every_broker.sql"),
    ),
    (
        7,
        "0007_backlog.sql",
        include_str!("../../../../migrations/0007_backlog.sql"),
    ),
];

/// Arguments of `walbox migrate`.
#[derive(Debug, clap::Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    settings: ConnectionFlags,
}

/// Why a migration failed.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Connecting, with the same TLS and authentication as every other command.
    #[error(transparent)]
    Connect(slot_manager::Error),
    /// A migration's SQL failed.
    #[error("apply migration {name}")]
    Apply {
        /// The migration's file name.
        name: &'static str,
        /// Why.
        #[source]
        source: tokio_postgres::Error,
    },
    /// The bookkeeping table could not be read or written.
    #[error("record migrations")]
    Bookkeeping(#[source] tokio_postgres::Error),
}

/// Key of the advisory lock that serializes concurrent `walbox migrate` runs.
const LOCK_KEY: i64 = 0x7761_6c62_6f78; // "walbox"

/// The outbox table the migrations create.
const OWN_TABLE: &str = "public.outbox_events";

/// Applies what is not applied yet, each migration in its own transaction.
pub async fn run(args: MigrateArgs) -> Result<(), CliError> {
    let config = loaded(args.settings.load())?;
    let c = config.connection()?;
    // The migrations create walbox's own table; they cannot make another.
    let own: slot_manager::TableName = OWN_TABLE.parse().expect("a table name");
    if c.source.table() && c.tables.single() != Some(&own) {
        return Err(crate::config::ConfigError(format!(
            "table {}: migrate creates walbox's own outbox table, {own}, and cannot create or change another; an outbox table of your own needs no migrate (walbox init-slot checks its columns; docs/configuration.md, \"Outbox mapping\")",
            c.tables
        ))
        .into());
    }
    Ok(apply(&c.pg).await?)
}

async fn apply(pg: &slot_manager::PgConfig) -> Result<(), MigrateError> {
    let mut client = connect_control(pg).await.map_err(MigrateError::Connect)?;
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS public.walbox_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await
        .map_err(MigrateError::Bookkeeping)?;
    for (version, name, sql) in MIGRATIONS {
        let tx = client
            .transaction()
            .await
            .map_err(MigrateError::Bookkeeping)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
            .await
            .map_err(MigrateError::Bookkeeping)?;
        let done = tx
            .query_opt(
                "SELECT 1 FROM public.walbox_migrations WHERE version = $1",
                &[version],
            )
            .await
            .map_err(MigrateError::Bookkeeping)?
            .is_some();
        if done {
            println!("{name}: already applied");
            continue;
        }
        tx.batch_execute(sql)
            .await
            .map_err(|source| MigrateError::Apply { name, source })?;
        tx.execute(
            "INSERT INTO public.walbox_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await
        .map_err(MigrateError::Bookkeeping)?;
        tx.commit().await.map_err(MigrateError::Bookkeeping)?;
        println!("{name}: applied");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_migrations_match_the_repository() {
        let on_disk: Vec<String> = walbox_test_harness::migrations::migration_files()
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let embedded: Vec<String> = MIGRATIONS.iter().map(|(_, n, _)| (*n).to_owned()).collect();
        assert_eq!(embedded, on_disk, "add new migrations/ files to MIGRATIONS");
        for (i, (version, name, _)) in MIGRATIONS.iter().enumerate() {
            assert_eq!(*version as usize, i + 1);
            assert!(name.starts_with(&format!("{version:04}_")));
        }
    }
}
