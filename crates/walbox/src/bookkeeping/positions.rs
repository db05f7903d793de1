//! The delivered position walbox saves in Postgres (`walbox.positions`),
//! with the commit time of the newest transaction below it: where a lost
//! slot is republished from ([`crate::backfill::heal`]), and how far
//! retention may delete ([`crate::retention`]). Written every 10 s while
//! streaming, only with `on_slot_invalidated = "recreate"` or `retention`.
//!
//! The saved time can only lag: every transaction after the saved position
//! committed after it, so republishing from it (less a margin) loses
//! nothing, and deleting before it removes only delivered rows.

use pgoutput_decoder::{Lsn, PgTimestamp};
use slot_manager::Error;
use tokio_postgres::Client;

use crate::bookkeeping;

/// The table, created on first use (see [`crate::bookkeeping`]).
const TABLE: &str = "
CREATE TABLE IF NOT EXISTS walbox.positions (
    slot text PRIMARY KEY,
    delivered_lsn pg_lsn NOT NULL,
    committed_at timestamptz NOT NULL,
    saved_at timestamptz NOT NULL DEFAULT now()
);
GRANT SELECT ON walbox.positions TO PUBLIC;";

/// Saves `slot`'s delivered position and the commit time of the newest
/// transaction below it; creates the table on first use.
pub async fn save(
    client: &Client,
    slot: &str,
    delivered: Lsn,
    committed: PgTimestamp,
) -> Result<(), Error> {
    let upsert = "INSERT INTO walbox.positions (slot, delivered_lsn, committed_at, saved_at)
                  VALUES ($1, $2::text::pg_lsn, to_timestamp($3::int8 / 1000000.0), now())
                  ON CONFLICT (slot) DO UPDATE SET delivered_lsn = EXCLUDED.delivered_lsn,
                      committed_at = EXCLUDED.committed_at, saved_at = now()";
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
        [&slot, &delivered.to_string(), &committed.as_unix_micros()];
    match client.execute(upsert, &params).await {
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => {
            bookkeeping::create(client, TABLE, "create walbox.positions").await?;
            client
                .execute(upsert, &params)
                .await
                .map_err(Error::sql("save the delivered position"))?;
        }
        other => {
            other.map_err(Error::sql("save the delivered position"))?;
        }
    }
    Ok(())
}

/// `SELECT columns FROM walbox.positions WHERE slot = $1`, with `params`
/// (`params[0]` is the slot); `None` when the slot saved nothing or the
/// table does not exist.
pub async fn select(
    client: &Client,
    columns: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<tokio_postgres::Row>, Error> {
    read(
        client,
        &format!("SELECT {columns} FROM walbox.positions WHERE slot = $1"),
        params,
    )
    .await
}

/// Like [`select`], over the rows of every slot in `$1` (a text array),
/// aggregated: no row unless each of them saved one.
pub async fn select_every(
    client: &Client,
    columns: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<tokio_postgres::Row>, Error> {
    let sql = format!(
        "SELECT {columns} FROM walbox.positions WHERE slot = ANY($1)
         HAVING count(DISTINCT slot) = cardinality($1)"
    );
    read(client, &sql, params).await
}

/// One row of `sql` on walbox.positions; `None` when there is none or the
/// table does not exist.
async fn read(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<tokio_postgres::Row>, Error> {
    if !bookkeeping::exist(client, &["walbox.positions"]).await? {
        return Ok(None);
    }
    client
        .query_opt(sql, params)
        .await
        .map_err(Error::sql("read walbox.positions"))
}

/// The commit time `slot` last saved, less `margin`, as a timestamptz
/// literal; `None` if it saved none.
pub async fn saved_commit_time(
    client: &Client,
    slot: &str,
    margin: std::time::Duration,
) -> Result<Option<String>, Error> {
    let row = select(
        client,
        "to_char((committed_at - make_interval(secs => $2)) AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US') || '+00'",
        &[&slot, &margin.as_secs_f64()],
    )
    .await?;
    Ok(row.map(|r| r.get(0)))
}

/// What `slot` last saved, for `walbox status`: `(delivered_lsn,
/// committed_at, saved_at)` as text.
pub async fn saved(client: &Client, slot: &str) -> Result<Option<(String, String, String)>, Error> {
    let row = select(
        client,
        "delivered_lsn::text, committed_at::text, saved_at::text",
        &[&slot],
    )
    .await?;
    Ok(row.map(|r| (r.get(0), r.get(1), r.get(2))))
}
