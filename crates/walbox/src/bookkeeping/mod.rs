//! walbox's own tables in Postgres, in the schema `walbox`, and every
//! statement walbox runs against them: a backfill's or heal's state and
//! copied rows ([`backfills`]) and the saved delivered position
//! ([`positions`]). Each table is created on first use, by whoever may.

pub mod backfills;
pub mod drift;
pub mod joined;
pub mod positions;
pub mod quarantine;

use slot_manager::Error;
use tokio_postgres::Client;

/// Creates the schema only if missing (`CREATE SCHEMA IF NOT EXISTS` still
/// needs the right to create one), readable by everyone: whoever runs
/// `walbox run` or `walbox status` may read a backfill's state and the
/// saved position (conditions, counts and positions, nothing secret).
const SCHEMA: &str = "
DO $$ BEGIN
  IF to_regnamespace('walbox') IS NULL THEN
    CREATE SCHEMA walbox;
    GRANT USAGE ON SCHEMA walbox TO PUBLIC;
  END IF;
END $$;";

/// Creates the schema if missing, then runs `tables` (its `CREATE TABLE IF
/// NOT EXISTS` statements); `context` names them in an error.
pub async fn create(client: &Client, tables: &str, context: &str) -> Result<(), Error> {
    client.batch_execute(SCHEMA).await.map_err(|e| {
        let context = if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) {
            format!("{context} (grant CREATE on the database to walbox's role, or create the schema walbox for it)")
        } else {
            context.to_owned()
        };
        Error::sql(context)(e)
    })?;
    client
        .batch_execute(tables)
        .await
        .map_err(Error::sql(context))
}

/// Whether every one of `tables` (`walbox.…`) exists.
pub async fn exist(client: &Client, tables: &[&str]) -> Result<bool, Error> {
    let names: Vec<String> = tables.iter().map(|t| (*t).to_owned()).collect();
    Ok(client
        .query_one(
            "SELECT bool_and(to_regclass(t) IS NOT NULL) FROM unnest($1::text[]) t",
            &[&names],
        )
        .await
        .map_err(Error::sql("look for walbox's tables"))?
        .get(0))
}
