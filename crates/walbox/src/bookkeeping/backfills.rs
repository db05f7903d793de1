//! A backfill's state, kept in Postgres next to the outbox (schema
//! `walbox`), so that an interrupted backfill resumes where it stopped:
//!
//! - `walbox.backfills`: one row per slot: the condition and order, the
//!   state (`snapshot` → `publishing` → `done`), how many rows there are and
//!   how many were delivered;
//! - `walbox.backfill_rows`: the rows to publish, copied from the slot's
//!   snapshot as text and numbered in publishing order. Copying them once
//!   fixes the set: a rerun publishes exactly what the snapshot held, even
//!   though the snapshot itself is gone. Deleted when the backfill is done.

use pgoutput_decoder::Lsn;
use slot_manager::{quote_ident, quote_literal, Error, ExportedSlot, TableName};

use crate::bookkeeping;
use tokio_postgres::{Client, GenericClient};

/// The tables, created on first use (see [`crate::bookkeeping`]).
const TABLES: &str = "
CREATE TABLE IF NOT EXISTS walbox.backfills (
    slot text PRIMARY KEY,
    outbox_table text NOT NULL,
    condition text NOT NULL,
    order_by text NOT NULL,
    state text NOT NULL CHECK (state IN ('snapshot', 'publishing', 'done')),
    consistent_point pg_lsn,
    columns text[],
    type_oids oid[],
    total bigint,
    published bigint NOT NULL DEFAULT 0,
    started_at timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz
);
CREATE TABLE IF NOT EXISTS walbox.backfill_rows (
    slot text NOT NULL,
    n bigint NOT NULL,
    row_values text[] NOT NULL,
    PRIMARY KEY (slot, n)
);
GRANT SELECT ON walbox.backfills TO PUBLIC;";

/// What a backfill is doing, from `walbox.backfills`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Recorded, but its snapshot was not copied: the slot, if it exists,
    /// was made by this backfill and never streamed.
    Snapshot,
    /// Rows copied; `published` of `total` delivered.
    Publishing(Publishing),
    /// Finished.
    Done {
        /// Rows published.
        total: u64,
    },
}

/// A backfill whose rows are copied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Publishing {
    /// Rows to publish.
    pub total: u64,
    /// Rows 1..=published were delivered.
    pub published: u64,
    /// The slot's consistent point: these rows committed before it.
    pub consistent_point: Lsn,
    /// The copied columns, with their type OIDs, in `row_values` order.
    pub columns: Vec<(String, u32)>,
}

/// What was asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The SQL condition (`published_at IS NULL`).
    pub condition: String,
    /// The SQL ordering (`created_at, id`).
    pub order_by: String,
}

/// Creates the schema and tables if missing (only then: a role that may
/// use them need not be allowed to create them).
pub async fn prepare(client: &Client) -> Result<(), Error> {
    if bookkeeping::exist(client, &["walbox.backfills", "walbox.backfill_rows"]).await? {
        return Ok(());
    }
    bookkeeping::create(
        client,
        TABLES,
        "create walbox.backfills for the backfill's bookkeeping",
    )
    .await
}

/// Holds the lock that keeps two backfills of one slot apart, for the
/// session's lifetime (released when the connection closes, kill -9 too).
pub async fn lock(client: &Client, slot: &str) -> Result<bool, Error> {
    let row = client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtext('walbox.backfill.' || $1))",
            &[&slot],
        )
        .await
        .map_err(Error::sql("take the backfill lock"))?;
    Ok(row.get(0))
}

/// The recorded backfill of `slot`, with its request; `None` if there is
/// none (or no bookkeeping tables at all).
pub async fn load(client: &Client, slot: &str) -> Result<Option<(Request, State)>, Error> {
    if !bookkeeping::exist(client, &["walbox.backfills"]).await? {
        return Ok(None);
    }
    let Some(row) = client
        .query_opt(
            "SELECT condition, order_by, state, total, published, consistent_point::text,
                    columns, type_oids::int8[]
               FROM walbox.backfills WHERE slot = $1",
            &[&slot],
        )
        .await
        .map_err(Error::sql("read walbox.backfills"))?
    else {
        return Ok(None);
    };
    let request = Request {
        condition: row.get(0),
        order_by: row.get(1),
    };
    let count = |i: usize| row.get::<_, Option<i64>>(i).unwrap_or(0).max(0) as u64;
    let state = match row.get::<_, &str>(2) {
        "snapshot" => State::Snapshot,
        "done" => State::Done { total: count(3) },
        _ => {
            let names: Vec<String> = row.get::<_, Option<_>>(6).unwrap_or_default();
            let oids: Vec<i64> = row.get::<_, Option<_>>(7).unwrap_or_default();
            let consistent_point = row
                .get::<_, Option<String>>(5)
                .and_then(|l| l.parse().ok())
                .unwrap_or(Lsn::ZERO);
            State::Publishing(Publishing {
                total: count(3),
                published: count(4),
                consistent_point,
                columns: names
                    .into_iter()
                    .zip(oids.into_iter().map(|o| o as u32))
                    .collect(),
            })
        }
    };
    Ok(Some((request, state)))
}

/// Records a new backfill of `slot` in state `snapshot`, replacing any
/// earlier record.
pub async fn begin(
    client: &Client,
    slot: &str,
    table: &TableName,
    request: &Request,
) -> Result<(), Error> {
    record(client, slot, table, request, "snapshot").await
}

/// Records a new backfill of `slot` in `state`, replacing any earlier
/// record and its copied rows.
async fn record(
    client: &impl GenericClient,
    slot: &str,
    table: &TableName,
    request: &Request,
    state: &str,
) -> Result<(), Error> {
    client
        .execute(
            "INSERT INTO walbox.backfills (slot, outbox_table, condition, order_by, state)
             VALUES ($1, $2, $3, $4, $5)
             ON CONFLICT (slot) DO UPDATE SET outbox_table = $2, condition = $3, order_by = $4,
                 state = $5, consistent_point = NULL, columns = NULL, type_oids = NULL,
                 total = NULL, published = 0, started_at = now(), finished_at = NULL",
            &[
                &slot,
                &table.to_string(),
                &request.condition,
                &request.order_by,
                &state,
            ],
        )
        .await
        .map_err(Error::sql("record the backfill in walbox.backfills"))?;
    client
        .execute("DELETE FROM walbox.backfill_rows WHERE slot = $1", &[&slot])
        .await
        .map_err(Error::sql("clear walbox.backfill_rows"))?;
    Ok(())
}

/// The outbox table's columns that `names` lists, with their type OIDs, in
/// the table's order.
pub async fn columns(
    client: &Client,
    table: &TableName,
    names: &[&str],
) -> Result<Vec<(String, u32)>, Error> {
    let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
    let rows = client
        .query(
            "SELECT a.attname::text, a.atttypid::int8 FROM pg_attribute a
               JOIN pg_class c ON c.oid = a.attrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0
                AND NOT a.attisdropped AND a.attname = ANY($3)
              ORDER BY a.attnum",
            &[&table.schema(), &table.name(), &names],
        )
        .await
        .map_err(Error::sql("read the outbox table's columns"))?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u32))
        .collect())
}

/// Copies the rows matching the request from the exported `snapshot` into
/// `walbox.backfill_rows`, numbered in publishing order, and moves the
/// backfill to `publishing`. Returns how many rows there are.
///
/// The condition and order are the operator's SQL; they run in one
/// statement of the extended protocol, so a `;` is refused by Postgres
/// rather than run. The event id orders rows the given order leaves tied.
pub async fn copy_snapshot(
    client: &mut Client,
    slot: &str,
    table: &TableName,
    request: &Request,
    exported: &ExportedSlot,
    columns: &[(String, u32)],
    id_column: &str,
) -> Result<u64, Error> {
    let tx = repeatable_read(client).await?;
    tx.batch_execute(&format!(
        "SET TRANSACTION SNAPSHOT {}; SET LOCAL DateStyle = 'ISO'",
        quote_literal(&exported.snapshot)
    ))
    .await
    .map_err(Error::sql("import the slot's snapshot"))?;
    let total = copy_rows(&tx, slot, table, request, columns, id_column).await?;
    publishing(
        &tx,
        slot,
        total,
        &exported.consistent_point.to_string(),
        columns,
    )
    .await?;
    tx.commit()
        .await
        .map_err(Error::sql("commit the backfill's snapshot copy"))?;
    Ok(total)
}

/// Records a backfill of `slot` that streams nothing new: the rows matching
/// the request now (one REPEATABLE READ snapshot) are copied and the
/// record is in state `publishing` when it first becomes visible, so no
/// resume ever drops or recreates the slot for it; `also` (a statement on
/// `$1`, the slot), if any, runs in the same transaction. The slot streams on from
/// where it was after the rows are published (`walbox run` waits for
/// them). Returns how many rows there are.
pub async fn copy_current(
    client: &mut Client,
    slot: &str,
    table: &TableName,
    request: &Request,
    columns: &[(String, u32)],
    id_column: &str,
    also: Option<&str>,
) -> Result<u64, Error> {
    let tx = repeatable_read(client).await?;
    tx.batch_execute("SET LOCAL DateStyle = 'ISO'")
        .await
        .map_err(Error::sql("start the copy's transaction"))?;
    record(&tx, slot, table, request, "publishing").await?;
    let total = copy_rows(&tx, slot, table, request, columns, id_column).await?;
    let position: String = tx
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .map_err(Error::sql("read the WAL position"))?
        .get(0);
    publishing(&tx, slot, total, &position, columns).await?;
    if let Some(also) = also {
        tx.execute(also, &[&slot])
            .await
            .map_err(Error::sql("record the backfill"))?;
    }
    tx.commit()
        .await
        .map_err(Error::sql("commit the backfill's copy"))?;
    Ok(total)
}

/// A REPEATABLE READ transaction: one snapshot for the copy.
async fn repeatable_read(client: &mut Client) -> Result<tokio_postgres::Transaction<'_>, Error> {
    client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .map_err(Error::sql("start the copy's transaction"))
}

/// Copies the rows matching the request, as `tx` sees them, into
/// `walbox.backfill_rows`, numbered in publishing order.
async fn copy_rows(
    tx: &tokio_postgres::Transaction<'_>,
    slot: &str,
    table: &TableName,
    request: &Request,
    columns: &[(String, u32)],
    id_column: &str,
) -> Result<u64, Error> {
    let values = columns
        .iter()
        .map(|(c, _)| format!("{}::text", quote_ident(c)))
        .collect::<Vec<_>>()
        .join(", ");
    let copy = format!(
        "INSERT INTO walbox.backfill_rows (slot, n, row_values)
         SELECT $1, row_number() OVER (ORDER BY {order}, {id}), ARRAY[{values}]
           FROM {table} WHERE ({condition})",
        order = request.order_by,
        id = quote_ident(id_column),
        table = table.quoted(),
        condition = request.condition,
    );
    tx.execute(&copy, &[&slot]).await.map_err(Error::sql(
        "select the rows to backfill (check --backfill and --backfill-order)",
    ))
}

/// Moves the backfill to `publishing` with `total` rows of `columns`.
async fn publishing(
    tx: &tokio_postgres::Transaction<'_>,
    slot: &str,
    total: u64,
    consistent_point: &str,
    columns: &[(String, u32)],
) -> Result<(), Error> {
    let names: Vec<&str> = columns.iter().map(|(c, _)| c.as_str()).collect();
    let oids: Vec<i64> = columns.iter().map(|(_, o)| i64::from(*o)).collect();
    tx.execute(
        "UPDATE walbox.backfills SET state = 'publishing', total = $2, published = 0,
                consistent_point = $3::text::pg_lsn, columns = $4, type_oids = $5::int8[]::oid[]
          WHERE slot = $1",
        &[&slot, &(total as i64), &consistent_point, &names, &oids],
    )
    .await
    .map_err(Error::sql("record the backfill's snapshot"))?;
    Ok(())
}

/// Up to `limit` rows after row `after`, in order: `(n, values)`.
pub async fn rows_after(
    client: &Client,
    slot: &str,
    after: u64,
    limit: i64,
) -> Result<Vec<(u64, Vec<Option<String>>)>, Error> {
    let rows = client
        .query(
            "SELECT n, row_values FROM walbox.backfill_rows
              WHERE slot = $1 AND n > $2 ORDER BY n LIMIT $3",
            &[&slot, &(after as i64), &limit],
        )
        .await
        .map_err(Error::sql("read walbox.backfill_rows"))?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, i64>(0) as u64, r.get(1)))
        .collect())
}

/// Saves how far the deliveries got.
pub async fn save(client: &Client, slot: &str, published: u64) -> Result<(), Error> {
    client
        .execute(
            "UPDATE walbox.backfills SET published = $2 WHERE slot = $1 AND published < $2",
            &[&slot, &(published as i64)],
        )
        .await
        .map_err(Error::sql("save the backfill's progress"))?;
    Ok(())
}

/// Marks the backfill done and drops its copied rows.
pub async fn finish(client: &mut Client, slot: &str) -> Result<(), Error> {
    let tx = client
        .transaction()
        .await
        .map_err(Error::sql("finish the backfill"))?;
    tx.execute(
        "UPDATE walbox.backfills SET state = 'done', published = total, finished_at = now()
          WHERE slot = $1",
        &[&slot],
    )
    .await
    .map_err(Error::sql("finish the backfill"))?;
    tx.execute("DELETE FROM walbox.backfill_rows WHERE slot = $1", &[&slot])
        .await
        .map_err(Error::sql("drop the backfill's copied rows"))?;
    tx.commit().await.map_err(Error::sql("finish the backfill"))
}

/// Forgets the backfill of `slot` (when its slot is dropped).
pub async fn forget(client: &Client, slot: &str) -> Result<(), Error> {
    if !bookkeeping::exist(client, &["walbox.backfills", "walbox.backfill_rows"]).await? {
        return Ok(());
    }
    for table in ["walbox.backfill_rows", "walbox.backfills"] {
        client
            .execute(&format!("DELETE FROM {table} WHERE slot = $1"), &[&slot])
            .await
            .map_err(Error::sql("forget the slot's backfill"))?;
    }
    Ok(())
}

/// The request of `slot`'s unfinished backfill or heal, in any state
/// (`walbox run` finishes it before streaming), if any. Its record holds
/// all a rerun needs: the condition (for a heal, the time it republishes
/// from) and the order; a record in state `snapshot` is started over (its
/// slot, if any, never streamed), one in `publishing` resumes after its
/// saved cursor.
pub async fn resumable(
    client: &Client,
    slot: &str,
) -> Result<Option<Request>, slot_manager::Error> {
    Ok(match load(client, slot).await? {
        Some((request, State::Snapshot | State::Publishing(_))) => Some(request),
        _ => None,
    })
}

/// Whether `slot` has a backfill that is not done (then `walbox run` must
/// not stream yet): `(published, total)`.
pub async fn unfinished(
    client: &Client,
    slot: &str,
) -> Result<Option<(u64, u64)>, slot_manager::Error> {
    Ok(match load(client, slot).await? {
        Some((_, State::Snapshot)) => Some((0, 0)),
        Some((_, State::Publishing(p))) => Some((p.published, p.total)),
        _ => None,
    })
}

/// The slot's backfill in a few words, for `walbox status`.
pub async fn describe(client: &Client, slot: &str) -> Result<Option<String>, slot_manager::Error> {
    Ok(load(client, slot).await?.map(|(request, state)| {
        let what = format!("{:?} ordered by {:?}", request.condition, request.order_by);
        match state {
            State::Snapshot => format!("unfinished, before its snapshot was copied ({what}); `walbox run` or a rerun of the command that began it finishes it"),
            State::Publishing(p) => format!(
                "unfinished: {} of {} events published ({what}); `walbox run` or a rerun of `walbox init-slot --backfill` finishes it",
                p.published, p.total
            ),
            State::Done { total } => format!("done: {total} events ({what})"),
        }
    }))
}
