//! The order in which rows read from the outbox table are published
//! (backfill, heal, resync): per aggregate, the order the stream would have
//! given, as far as the table and the server can tell it.
//!
//! The stream gives commit order, and within a transaction insertion order.
//! From the table:
//!
//! 1. With `track_commit_timestamp = on`, `pg_xact_commit_timestamp(xmin)`
//!    is each row's commit time: commit order, then within a transaction
//!    the sequence column's order (insertion), else the event id. (Rows
//!    frozen since, or older than the commit timestamps kept, have none and
//!    come first: they are the oldest.)
//! 2. Else a sequence column (an identity column, or one whose default is
//!    `nextval`, as `walbox migrate`'s `seq bigserial`): insertion order. It differs
//!    from commit order for one aggregate only where two transactions
//!    inserted events of that aggregate concurrently and committed in the
//!    other order.
//! 3. Else the timestamp column, then the event id: with `now()` as the
//!    timestamp (one value per transaction), a transaction's events of one
//!    aggregate go out in event-id order, not insertion order. walbox warns.

use slot_manager::{quote_ident, Error, TableName};
use tokio_postgres::Client;

use crate::mapping::OutboxMapping;

/// An order for the rows of `table`, as SQL for `ORDER BY`, and how good
/// it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowOrder {
    /// SQL for `ORDER BY` (the event id is appended to break ties).
    pub sql: String,
    /// What it follows, in a few words (logs, `--help`, docs).
    pub follows: Follows,
}

/// What a [`RowOrder`] follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Follows {
    /// Commit order (commit timestamps), insertion order within a transaction.
    Commits,
    /// Insertion order (a sequence column).
    Insertion,
    /// The timestamp column (or the event id): not the stream's order
    /// within a transaction.
    Timestamp,
}

/// Chooses the order for `table` (see the module docs).
pub async fn choose(
    client: &Client,
    table: &TableName,
    mapping: &OutboxMapping,
) -> Result<RowOrder, Error> {
    let row = client
        .query_one(
            "SELECT current_setting('track_commit_timestamp') = 'on',
                    (SELECT a.attname::text FROM pg_attribute a
                       JOIN pg_class c ON c.oid = a.attrelid
                       JOIN pg_namespace n ON n.oid = c.relnamespace
                       LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                      WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0
                        AND NOT a.attisdropped
                        AND a.atttypid IN ('int2'::regtype, 'int4'::regtype, 'int8'::regtype)
                        AND (a.attidentity <> ''
                             OR pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval(%')
                      ORDER BY a.attnum LIMIT 1)",
            &[&table.schema(), &table.name()],
        )
        .await
        .map_err(Error::sql(
            "read how the outbox table's rows can be ordered",
        ))?;
    let commit_timestamps: bool = row.get(0);
    let sequence: Option<String> = row.get(1);
    Ok(order_from(commit_timestamps, sequence.as_deref(), mapping))
}

fn order_from(
    commit_timestamps: bool,
    sequence: Option<&str>,
    mapping: &OutboxMapping,
) -> RowOrder {
    let sequence = sequence.map(quote_ident);
    match (commit_timestamps, sequence) {
        (true, Some(seq)) => RowOrder {
            sql: format!("pg_xact_commit_timestamp(xmin) NULLS FIRST, {seq}"),
            follows: Follows::Commits,
        },
        (true, None) => RowOrder {
            sql: "pg_xact_commit_timestamp(xmin) NULLS FIRST".into(),
            follows: Follows::Commits,
        },
        (false, Some(seq)) => RowOrder {
            sql: seq,
            follows: Follows::Insertion,
        },
        (false, None) => RowOrder {
            sql: quote_ident(mapping.timestamp.as_deref().unwrap_or(&mapping.id)),
            follows: Follows::Timestamp,
        },
    }
}

impl RowOrder {
    /// Logs what the order follows; a warning where it is not the stream's.
    pub fn report(&self, table: &TableName) {
        match self.follows {
            Follows::Commits => {
                tracing::info!(%table, order = %self.sql, "rows published in commit order (commit timestamps)")
            }
            Follows::Insertion => {
                tracing::info!(%table, order = %self.sql, "rows published in insertion order (the sequence column)")
            }
            Follows::Timestamp => {
                tracing::warn!(%table, order = %self.sql, "rows published in timestamp order: {table} has no sequence column and track_commit_timestamp is off, so one transaction's events of an aggregate go out in event-id order, not the order they were inserted in; add one (walbox migrate adds seq) or set track_commit_timestamp = on")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefers_commit_timestamps_then_a_sequence_then_the_timestamp() {
        let m = OutboxMapping::default();
        let o = order_from(true, Some("seq"), &m);
        assert_eq!(
            (o.sql.as_str(), o.follows),
            (
                "pg_xact_commit_timestamp(xmin) NULLS FIRST, \"seq\"",
                Follows::Commits
            )
        );
        assert_eq!(order_from(true, None, &m).follows, Follows::Commits);
        let o = order_from(false, Some("Seq"), &m);
        assert_eq!((o.sql.as_str(), o.follows), ("\"Seq\"", Follows::Insertion));
        let o = order_from(false, None, &m);
        assert_eq!(
            (o.sql.as_str(), o.follows),
            ("\"created_at\"", Follows::Timestamp)
        );
        let no_ts = OutboxMapping {
            timestamp: None,
            ..OutboxMapping::default()
        };
        assert_eq!(order_from(false, None, &no_ts).sql, "\"id\"");
    }
}
