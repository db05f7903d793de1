//! The table's side of the audit: the outbox rows in the window, read in
//! one `REPEATABLE READ` snapshot in the stream's order
//! ([`crate::backfill::order`]), each mapped as walbox maps it (the topic
//! and key it belongs on), streamed into the sort one row at a time.
//!
//! The payload is not read (`NULL` in its place): the audit needs an
//! event's id, route and type, and reading every payload would cost the
//! primary the window's bytes again. A row the relay could not map for its
//! payload alone (a text payload that is not JSON) is found on the
//! dead-letter topic by its id all the same.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::TryStreamExt;
use pgoutput_decoder::{Lsn, RelationBody, TupleData};
use slot_manager::{domain_base_types, quote_ident, Error, TableName};
use tokio_postgres::{Client, IsolationLevel};

use super::findings::{Place, Sighting, NO_TYPE};
use super::spill::Spill;
use super::AuditError;
use crate::backfill::order::{self, Follows};
use crate::bookkeeping::backfills as store;
use crate::mapping::OutboxMapping;

/// The window, as the database reads it: whole milliseconds, so a row's
/// timestamp column is in it exactly when its record's timestamp (the
/// column in milliseconds) is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    /// From (Unix ms, inclusive).
    pub(crate) since_ms: i64,
    /// To (Unix ms, exclusive).
    pub(crate) until_ms: i64,
}

impl Window {
    /// Whether a record timestamp is in the window.
    pub(crate) fn holds(&self, ms: i64) -> bool {
        (self.since_ms..self.until_ms).contains(&ms)
    }
}

/// How the operator gave the window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WindowSpec {
    /// `--since` (and `--until`, else now): timestamps Postgres parses.
    Between {
        /// From.
        since: String,
        /// To; `None`: now.
        until: Option<String>,
    },
    /// `--last`: the last so long, up to now.
    Last(std::time::Duration),
}

/// What the table's side read.
#[derive(Debug)]
pub(crate) struct TableSide {
    pub(crate) window: Window,
    /// The WAL position when the snapshot was taken: every row it holds
    /// committed before it.
    pub(crate) snapshot_lsn: Lsn,
    /// Rows in the window with an event id.
    pub(crate) rows: u64,
    /// Rows in the window without one: nothing can find their copies.
    pub(crate) without_id: u64,
    /// The topics the rows' mapping names.
    pub(crate) topics: BTreeSet<String>,
    /// The order the rows were ranked in.
    pub(crate) order: Follows,
    /// The id column's type, for looking ids up.
    pub(crate) id_type: IdType,
}

/// Reads the window's rows into `spill` (see the module docs).
pub(crate) async fn read(
    client: &mut Client,
    table: &TableName,
    mapping: &OutboxMapping,
    spec: &WindowSpec,
    spill: &mut Spill<Sighting>,
    progress: &AtomicU64,
) -> Result<TableSide, AuditError> {
    let Some(ts_column) = mapping.timestamp.as_deref() else {
        return Err(AuditError::Config(
            "the audit selects rows by the timestamp column, and mapping.timestamp is unset: map the column rows are stamped with".into(),
        ));
    };
    let wanted = mapping.required_columns();
    let columns = store::columns(client, table, &wanted).await?;
    // A mapped column the table lacks: the mapping says which, and as what.
    let domains = domain_base_types(client, table).await?;
    let relation =
        RelationBody::from_catalog(0, table.schema(), table.name(), columns.iter().cloned());
    let indexes = mapping
        .resolve_with(&relation, &domains)
        .map_err(|e| AuditError::Config(e.to_string()))?;
    let order = order::choose(client, table, mapping).await?;
    let id_type = columns
        .iter()
        .find(|(c, _)| *c == mapping.id)
        .map_or(IdType::Other, |(_, oid)| {
            IdType::of(domains.get(oid).copied().unwrap_or(*oid))
        });
    let event_type_at = mapping
        .event_type
        .as_deref()
        .and_then(|e| columns.iter().position(|(c, _)| c == e));

    let select: Vec<String> = columns
        .iter()
        .map(|(c, _)| {
            if *c == mapping.payload {
                format!("NULL::text AS {}", quote_ident(c))
            } else {
                format!("{}::text", quote_ident(c))
            }
        })
        .collect();
    let sql = format!(
        "SELECT {} FROM {table} WHERE {ts} >= $1::text::timestamptz AND {ts} < $2::text::timestamptz ORDER BY {}, {}",
        select.join(", "),
        order.sql,
        quote_ident(&mapping.id),
        ts = quote_ident(ts_column),
    );

    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(Error::sql("begin the audit's snapshot"))?;
    tx.batch_execute("SET LOCAL TimeZone = 'UTC'")
        .await
        .map_err(Error::sql("set the audit's time zone"))?;
    // The snapshot is taken by this statement; the position is read after
    // it, so every commit the snapshot sees is before the position.
    let (since, until, last): (Option<String>, Option<String>, Option<String>) = match spec {
        WindowSpec::Between { since, until } => (Some(since.clone()), until.clone(), None),
        WindowSpec::Last(d) => (None, None, Some(format!("{} milliseconds", d.as_millis()))),
    };
    let head = tx
        .query_one(
            "WITH w AS (
               SELECT date_trunc('milliseconds', coalesce($1::text::timestamptz, now() - $3::text::interval)) AS since,
                      date_trunc('milliseconds', coalesce($2::text::timestamptz, now())) AS until)
             SELECT pg_current_wal_lsn()::text, since::text, until::text,
                    (extract(epoch FROM since) * 1000)::int8, (extract(epoch FROM until) * 1000)::int8
               FROM w",
            &[&since, &until, &last],
        )
        .await
        .map_err(|e| match e.code() {
            Some(c) if c.code().starts_with("22") => AuditError::Config(format!(
                "the window: {}",
                e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned())
            )),
            _ => Error::sql("read the audit's window")(e).into(),
        })?;
    let snapshot_lsn: Lsn = head
        .get::<_, String>(0)
        .parse()
        .map_err(|_| AuditError::Config("pg_current_wal_lsn() returned no position".into()))?;
    let (since_text, until_text): (String, String) = (head.get(1), head.get(2));
    let window = Window {
        since_ms: head.get(3),
        until_ms: head.get(4),
    };
    if window.since_ms >= window.until_ms {
        return Err(AuditError::Config(format!(
            "the window is empty: it starts at {since_text} and ends at {until_text}"
        )));
    }

    let mut side = TableSide {
        window,
        snapshot_lsn,
        rows: 0,
        without_id: 0,
        topics: BTreeSet::new(),
        order: order.follows,
        id_type,
    };
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&since_text, &until_text];
    let rows = tx
        .query_raw(sql.as_str(), params)
        .await
        .map_err(Error::sql("read the outbox table's window"))?;
    futures_util::pin_mut!(rows);
    let mut topics_seen: HashMap<std::sync::Arc<str>, ()> = HashMap::new();
    let mut rank = 0u64;
    while let Some(row) = rows
        .try_next()
        .await
        .map_err(Error::sql("read the outbox table's window"))?
    {
        rank += 1;
        progress.store(rank, Ordering::Relaxed);
        let values: Vec<Option<&str>> = (0..columns.len()).map(|i| row.get(i)).collect();
        let Some(tuple) = TupleData::from_text(values.iter().map(|v| v.map(str::as_bytes))) else {
            return Err(AuditError::Config(format!(
                "row {rank} of the window is too wide to map"
            )));
        };
        let Some(id) = mapping.event_id_of(&indexes, &tuple) else {
            side.without_id += 1;
            continue;
        };
        let event_type = event_type_at
            .and_then(|i| values[i])
            .unwrap_or(NO_TYPE)
            .to_owned();
        let route = match mapping.map(&indexes, &tuple) {
            Ok(event) => {
                if !topics_seen.contains_key(&event.topic) {
                    topics_seen.insert(event.topic.clone(), ());
                    side.topics.insert(event.topic.to_string());
                }
                Some((event.topic.to_string(), event.key.to_vec()))
            }
            Err(_) => None,
        };
        side.rows += 1;
        spill.push(Sighting {
            id,
            place: Place::Row {
                rank,
                route,
                event_type,
            },
        })?;
    }
    tx.commit()
        .await
        .map_err(Error::sql("end the audit's snapshot"))?;
    Ok(side)
}

/// Of `ids` (copies no row in the snapshot explained), the ones the table
/// holds now: rows that committed after the snapshot, not unknown events.
/// An id the column's type cannot hold (another producer's record with
/// `id: abc` beside a uuid column) is in no row: it is not looked up, so
/// one foreign record cannot fail the cast of a whole batch.
pub(crate) async fn present_now(
    client: &Client,
    table: &TableName,
    mapping: &OutboxMapping,
    id_type: IdType,
    ids: &[String],
) -> Result<Vec<String>, AuditError> {
    let id = quote_ident(&mapping.id);
    let (test, ids): (String, Vec<&String>) = match id_type {
        IdType::Uuid => (
            format!("{id} = ANY($1::text[]::uuid[])"),
            ids.iter().filter(|i| is_uuid(i)).collect(),
        ),
        IdType::Integer(ty) => (
            format!("{id} = ANY($1::text[]::{ty}[])"),
            ids.iter().filter(|i| fits(i, ty)).collect(),
        ),
        // text and varchar take any id, through the column's index.
        IdType::Text => (format!("{id} = ANY($1::text[])"), ids.iter().collect()),
        // Others are compared as text (no index).
        IdType::Other => (
            format!("{id}::text = ANY($1::text[])"),
            ids.iter().collect(),
        ),
    };
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let sql = format!("SELECT {id}::text FROM {table} WHERE {test}");
    let rows = client
        .query(sql.as_str(), &[&ids])
        .await
        .map_err(Error::sql("look up event ids in the outbox table"))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// The id column's type, as far as looking ids up cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IdType {
    /// `uuid`.
    Uuid,
    /// `smallint`, `integer` or `bigint`.
    Integer(&'static str),
    /// `text` or `varchar`.
    Text,
    /// Anything else.
    Other,
}

impl IdType {
    /// The type of OID `oid` (a domain's base type's).
    fn of(oid: u32) -> IdType {
        match oid {
            2950 => IdType::Uuid,
            21 => IdType::Integer("smallint"),
            23 => IdType::Integer("integer"),
            20 => IdType::Integer("bigint"),
            25 | 1043 => IdType::Text,
            _ => IdType::Other,
        }
    }
}

/// A uuid as Postgres writes one (`8-4-4-4-12` hex digits); the ids
/// compared are the text of the `id` header, which walbox writes that way.
fn is_uuid(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        })
}

/// Whether `s` is a whole number the integer type `ty` holds.
fn fits(s: &str, ty: &str) -> bool {
    match ty {
        "smallint" => s.parse::<i16>().is_ok(),
        "integer" => s.parse::<i32>().is_ok(),
        _ => s.parse::<i64>().is_ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_a_column_cannot_hold_are_not_looked_up() {
        assert!(is_uuid("7f9c24e5-2b1a-4c2e-9a0e-1c2d3e4f5a6b"));
        assert!(is_uuid("7F9C24E5-2B1A-4C2E-9A0E-1C2D3E4F5A6B"));
        for bad in [
            "abc",
            "",
            "7f9c24e52b1a4c2e9a0e1c2d3e4f5a6b0000",
            "7f9c24e5-2b1a-4c2e-9a0e-1c2d3e4f5a6g",
        ] {
            assert!(!is_uuid(bad), "{bad}");
        }
        assert!(fits("32767", "smallint") && !fits("32768", "smallint"));
        assert!(fits("-7", "integer") && !fits("7.5", "integer"));
        assert!(fits("9223372036854775807", "bigint") && !fits("x", "bigint"));
    }
}
