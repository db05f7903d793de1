//! Whether the publication publishes the outbox table's INSERTs, read from
//! the catalog at a known WAL position.
//!
//! The replication stream says nothing when a table leaves the publication:
//! its changes simply stop arriving, and keepalives would carry the slot past
//! them. So the caller reads [`Coverage`] now and then and compares
//! [`Coverage::fingerprint`]s: any change to what makes up the coverage (the
//! table recreated, the publication altered or recreated, the table dropped
//! from it and added back) changes the fingerprint, even when the change was
//! undone between two reads.

use pgoutput_decoder::Lsn;
use tokio_postgres::{Client, Statement};

use crate::error::Error;
use crate::shard::ShardFilter;
use crate::sql::{quote_ident, TableName};

/// One reading of what `publication` publishes of `table`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coverage {
    /// The server's WAL position, read before the catalog: every catalog
    /// change committed before it that has become visible is reflected here.
    pub wal_lsn: Lsn,
    /// The table's OID, if it exists.
    pub table_oid: Option<u32>,
    /// Why INSERTs of the table are not (all) published, with the fix;
    /// `None` when they are.
    pub gap: Option<String>,
    /// The identity of every catalog row that makes up the coverage.
    pub fingerprint: String,
    /// Whether a change of the catalog rows behind this reading was in
    /// flight as they were read: what the reading can verify (see
    /// [`ChangeInFlight`]).
    pub in_flight: ChangeInFlight,
    /// With several outbox tables ([`CoverageReader::read_tables`]): each
    /// published one's coverage (the reading's own `table_oid` is then
    /// `None` and its fingerprint theirs together). Empty for one table.
    pub tables: Vec<TableCoverage>,
    /// Tables added to the publication just before this reading by the
    /// reader's caller, which made sure no event of theirs was missed
    /// ([`crate::pick_up`]).
    pub added: Vec<TableName>,
}

/// One table's part of a reading of several.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableCoverage {
    /// The table.
    pub table: TableName,
    /// Its OID.
    pub oid: Option<u32>,
    /// The identity of the catalog rows of its coverage.
    pub fingerprint: String,
}

/// Whether a transaction was changing the catalog rows behind a reading
/// (the table's `pg_class` row, the publication, its entry for the table or
/// the table's schema) when they were read. A transaction that updates or
/// deletes such a row stamps the version it replaces with its id (`xmax`)
/// long before it commits; a reading that still sees that version while
/// the transaction has not ended sees a change that is not visible yet, and
/// whose commit record may already be in the WAL walbox reads:
///
/// ```text
///   BEGIN; ALTER PUBLICATION …   commit record in the WAL       visible to new snapshots
///   ├──── in progress ───────────────┼─── flushing; waiting for ───────┤
///                                    │    synchronous standbys (unbounded)
///                                    └─ logical decoding already follows the change
/// ```
///
/// Postgres reports the transaction `in progress` until it is visible.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeInFlight {
    /// No such transaction: every change of the coverage committed before
    /// [`Coverage::wal_lsn`] is in this reading, which verifies the
    /// coverage up to its own position.
    Nothing,
    /// One that has not ended: the reading verifies nothing (its commit
    /// may lie anywhere before [`Coverage::wal_lsn`], however long ago it
    /// was written, while synchronous standbys hold it).
    Pending,
}

/// SQL for the commit-log state of the transaction that stamped a catalog
/// row version `xmax` (a 32-bit id): widened to 64 bits with the epoch of
/// the snapshot's next id. An id at or past that next id (within half the
/// id space) began after the snapshot: `in progress`. `NULL` when none
/// stamped it, or when it is too old to be in the commit log (then long
/// finished).
fn xmax_state(xmax: &str) -> String {
    format!(
        "(SELECT CASE WHEN x = 0 THEN NULL
                      WHEN (x - lo + 4294967296) % 4294967296 < 2147483648 THEN 'in progress'
                      ELSE txid_status((CASE WHEN x < lo THEN ep ELSE ep - 1 END << 32) | x)
                 END
            FROM (SELECT {xmax}::text::bigint AS x,
                         txid_snapshot_xmax(txid_current_snapshot()) & 4294967295 AS lo,
                         txid_snapshot_xmax(txid_current_snapshot()) >> 32 AS ep) v)"
    )
}

impl ChangeInFlight {
    /// From the commit-log states of the rows' stamps (`in progress`,
    /// `committed`, `aborted`, or none). A `committed` stamp on a version
    /// the reading still sees is a transaction that became visible just
    /// after the reading's snapshot: pending for this reading too.
    fn of(states: &[Option<String>]) -> ChangeInFlight {
        let pending = states
            .iter()
            .flatten()
            .any(|state| matches!(state.as_str(), "in progress" | "committed"));
        if pending {
            ChangeInFlight::Pending
        } else {
            ChangeInFlight::Nothing
        }
    }
}

/// Reads coverage again and again on one connection: its statements are
/// prepared on the first reading and reused (planning the catalog query
/// took 1.9 ms of the primary's CPU per reading, executing it 0.24 ms,
/// measured with pgbench on Postgres 15), as the relay reads every 50 ms
/// while events wait for the check.
#[derive(Debug, Default)]
pub struct CoverageReader {
    /// The WAL position statement.
    position: Option<Statement>,
    /// The catalog statement (made for the server version the first
    /// reading found).
    catalog: Option<Statement>,
    /// The publication-only statement, for a reading of no table.
    publication: Option<Statement>,
}

impl CoverageReader {
    /// Reads the coverage of `table` by `publication`, or of the
    /// publication alone without a table (see [`coverage`] and
    /// [`message_coverage`]).
    pub async fn read(
        &mut self,
        client: &Client,
        publication: &str,
        table: Option<&TableName>,
        shard: Option<&ShardFilter>,
    ) -> Result<Coverage, Error> {
        let (wal_lsn, version) = self.wal_now(client).await?;
        let catalog = prepared(&mut self.catalog, client, || match table {
            Some(_) => catalog_sql(version),
            None => publication_sql(),
        })
        .await?;
        match table {
            Some(table) => read_table(client, &catalog, wal_lsn, publication, table, shard).await,
            None => read_publication(client, &catalog, wal_lsn, publication).await,
        }
    }
}

impl CoverageReader {
    /// The WAL position now and the server's version, in a statement of
    /// its own: the catalog read's snapshot must come after it (see
    /// [`ChangeInFlight`]).
    async fn wal_now(&mut self, client: &Client) -> Result<(Lsn, i32), Error> {
        let position = prepared(&mut self.position, client, || WAL_POSITION.to_owned()).await?;
        wal_position(client, &position).await
    }

    /// Reads the coverage of each of `tables` by `publication` at one WAL
    /// position: a gap is the first table's that has one, a change in
    /// flight any table's. With no table, the publication's existence.
    pub async fn read_tables(
        &mut self,
        client: &Client,
        publication: &str,
        tables: &[TableName],
    ) -> Result<Coverage, Error> {
        let (wal_lsn, version) = self.wal_now(client).await?;
        if tables.is_empty() {
            let statement = prepared(&mut self.publication, client, publication_sql).await?;
            return read_publication(client, &statement, wal_lsn, publication).await;
        }
        let catalog = prepared(&mut self.catalog, client, || catalog_sql(version)).await?;
        let mut all = Coverage {
            wal_lsn,
            table_oid: None,
            gap: None,
            fingerprint: String::new(),
            in_flight: ChangeInFlight::Nothing,
            tables: Vec::with_capacity(tables.len()),
            added: Vec::new(),
        };
        for table in tables {
            let one = read_table(client, &catalog, wal_lsn, publication, table, None).await?;
            if all.gap.is_none() {
                all.gap = one.gap;
            }
            if one.in_flight == ChangeInFlight::Pending {
                all.in_flight = ChangeInFlight::Pending;
            }
            if !all.fingerprint.is_empty() {
                all.fingerprint.push_str("; ");
            }
            all.fingerprint
                .push_str(&format!("{table}: {}", one.fingerprint));
            all.tables.push(TableCoverage {
                table: table.clone(),
                oid: one.table_oid,
                fingerprint: one.fingerprint,
            });
        }
        Ok(all)
    }
}

/// The statement in `slot`, prepared from `sql` on first use.
async fn prepared(
    slot: &mut Option<Statement>,
    client: &Client,
    sql: impl FnOnce() -> String,
) -> Result<Statement, Error> {
    if let Some(statement) = slot {
        return Ok(statement.clone());
    }
    let statement = client
        .prepare(&sql())
        .await
        .map_err(Error::sql("prepare a coverage statement"))?;
    Ok(slot.insert(statement).clone())
}

const WAL_POSITION: &str = "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                          ELSE pg_current_wal_lsn() END)::text,
                    current_setting('server_version_num')::int";

/// The server's WAL position now (the replay position on a standby), and
/// its version.
async fn wal_position(client: &Client, statement: &Statement) -> Result<(Lsn, i32), Error> {
    let position = client
        .query_one(statement, &[])
        .await
        .map_err(Error::sql("read the WAL position"))?;
    let wal_lsn: Lsn = position
        .get::<_, String>(0)
        .parse()
        .map_err(|_| Error::Protocol("pg_current_wal_lsn() is not an LSN".into()))?;
    Ok((wal_lsn, position.get(1)))
}

/// Reads what a slot that streams logical decoding messages only depends on:
/// that `publication` exists (the walsender needs it, though messages
/// belong to no table). Its identity is the fingerprint, so a publication
/// dropped and recreated between two readings is a change too.
pub async fn message_coverage(client: &Client, publication: &str) -> Result<Coverage, Error> {
    CoverageReader::default()
        .read(client, publication, None, None)
        .await
}

/// Reads the coverage of `table` by `publication`: all of its INSERTs, or
/// for a shard, those its row filter selects.
pub async fn coverage(
    client: &Client,
    publication: &str,
    table: &TableName,
    shard: Option<&ShardFilter>,
) -> Result<Coverage, Error> {
    CoverageReader::default()
        .read(client, publication, Some(table), shard)
        .await
}

fn publication_sql() -> String {
    format!(
        "SELECT oid::int8, {} FROM pg_publication WHERE pubname = $1",
        xmax_state("xmax")
    )
}

async fn read_publication(
    client: &Client,
    statement: &Statement,
    wal_lsn: Lsn,
    publication: &str,
) -> Result<Coverage, Error> {
    let row = client
        .query_opt(statement, &[&publication])
        .await
        .map_err(Error::sql("look up the publication"))?;
    let oid: Option<i64> = row.as_ref().map(|r| r.get(0));
    let in_flight = ChangeInFlight::of(&[row.and_then(|r| r.get(1))]);
    Ok(Coverage {
        wal_lsn,
        table_oid: None,
        gap: oid.is_none().then(|| {
            format!("publication {publication:?} does not exist (walbox init-slot creates it)")
        }),
        fingerprint: format!("publication {}", oid.unwrap_or(0)),
        in_flight,
        tables: Vec::new(),
        added: Vec::new(),
    })
}

/// The catalog query of a table's coverage, for a server of `version`.
fn catalog_sql(version: i32) -> String {
    // PG 15 added schema publications, row filters and column lists.
    let (schema_entry, schema_xmax, filters) = if version >= 150_000 {
        (
            "(SELECT pn.oid::int8 FROM pg_publication_namespace pn, p, t
               WHERE pn.pnpubid = p.oid AND pn.pnnspid = t.relnamespace)",
            xmax_state(
                "(SELECT pn.xmax FROM pg_publication_namespace pn, p, t
                   WHERE pn.pnpubid = p.oid AND pn.pnnspid = t.relnamespace)",
            ),
            "(SELECT pt.rowfilter FROM pg_publication_tables pt
               WHERE pt.pubname = $1 AND pt.schemaname = $2 AND pt.tablename = $3),
             (SELECT pr.prattrs::text FROM pg_publication_rel pr, p, t
               WHERE pr.prpubid = p.oid AND pr.prrelid = t.oid)",
        )
    } else {
        (
            "NULL::int8",
            "NULL::text".to_owned(),
            "NULL::text, NULL::text",
        )
    };
    let stamps = [
        xmax_state("(SELECT xmax FROM t)"),
        xmax_state("(SELECT xmax FROM p)"),
        xmax_state(
            "(SELECT pr.xmax FROM pg_publication_rel pr, p, t
               WHERE pr.prpubid = p.oid AND pr.prrelid = t.oid)",
        ),
        schema_xmax,
    ]
    .join(", ");
    format!(
        "WITH t AS (SELECT c.oid, c.relkind, c.relnamespace, c.xmax FROM pg_class c
                      JOIN pg_namespace n ON n.oid = c.relnamespace
                     WHERE n.nspname = $2 AND c.relname = $3),
              p AS (SELECT oid, xmin, xmax, pubinsert, puballtables, pubviaroot
                      FROM pg_publication WHERE pubname = $1)
         SELECT (SELECT oid::int8 FROM t), (SELECT relkind::text FROM t),
                (SELECT oid::int8 FROM p), (SELECT xmin::text FROM p),
                (SELECT pubinsert FROM p), (SELECT puballtables FROM p), (SELECT pubviaroot FROM p),
                (SELECT pr.oid::int8 FROM pg_publication_rel pr, p, t
                  WHERE pr.prpubid = p.oid AND pr.prrelid = t.oid),
                {schema_entry},
                EXISTS (SELECT 1 FROM pg_publication_tables pt
                         WHERE pt.pubname = $1 AND pt.schemaname = $2 AND pt.tablename = $3),
                {filters}, {stamps}"
    )
}

async fn read_table(
    client: &Client,
    statement: &Statement,
    wal_lsn: Lsn,
    publication: &str,
    table: &TableName,
    shard: Option<&ShardFilter>,
) -> Result<Coverage, Error> {
    let row = client
        .query_one(statement, &[&publication, &table.schema(), &table.name()])
        .await
        .map_err(Error::sql(
            "read the publication's coverage of the outbox table",
        ))?;
    let reading = Reading {
        table_oid: row.get::<_, Option<i64>>(0).map(|o| o as u32),
        relkind: row.get(1),
        publication_oid: row.get(2),
        publication_xmin: row.get(3),
        publishes_insert: row.get(4),
        all_tables: row.get(5),
        via_root: row.get(6),
        table_entry: row.get(7),
        schema_entry: row.get(8),
        listed: row.get(9),
        row_filter: row.get(10),
        columns: row.get(11),
    };
    Ok(Coverage {
        wal_lsn,
        table_oid: reading.table_oid,
        gap: reading.gap(publication, table, shard),
        fingerprint: reading.fingerprint(),
        in_flight: ChangeInFlight::of(&[row.get(12), row.get(13), row.get(14), row.get(15)]),
        tables: Vec::new(),
        added: Vec::new(),
    })
}

/// The catalog rows behind a coverage.
#[derive(Clone, Debug, Default)]
struct Reading {
    table_oid: Option<u32>,
    relkind: Option<String>,
    publication_oid: Option<i64>,
    publication_xmin: Option<String>,
    publishes_insert: Option<bool>,
    all_tables: Option<bool>,
    via_root: Option<bool>,
    table_entry: Option<i64>,
    schema_entry: Option<i64>,
    listed: bool,
    row_filter: Option<String>,
    /// An explicit column list (attribute numbers), if any.
    columns: Option<String>,
}

impl Reading {
    fn gap(
        &self,
        publication: &str,
        table: &TableName,
        shard: Option<&ShardFilter>,
    ) -> Option<String> {
        let p = quote_ident(publication);
        let Some(_) = self.table_oid else {
            return Some(format!(
                "table {table} no longer exists (dropped or renamed): restore it, or point walbox at the new table"
            ));
        };
        let Some(_) = self.publication_oid else {
            return Some(format!(
                "publication {publication} no longer exists: recreate it with `walbox init-slot`"
            ));
        };
        if self.publishes_insert != Some(true) {
            return Some(format!(
                "publication {publication} no longer publishes INSERTs: ALTER PUBLICATION {p} SET (publish = 'insert')"
            ));
        }
        if !self.listed {
            if self.relkind.as_deref() == Some("p") && self.via_root != Some(true) {
                return Some(format!(
                    "table {table} is partitioned and publication {publication} publishes its partitions under their own names: \
                     ALTER PUBLICATION {p} SET (publish_via_partition_root = true)"
                ));
            }
            return Some(format!(
                "publication {publication} does not include table {table}: ALTER PUBLICATION {p} ADD TABLE {}",
                table.quoted()
            ));
        }
        if let Some(shard) = shard {
            let (publishes, consequence) = match &self.row_filter {
                Some(filter) if shard.matches(filter) => return None,
                Some(filter) if shard.is_without_nulls(filter) => (
                    format!("the rows of {table} WHERE {filter}"),
                    " (walbox's filter before NULL ids had a shard: a row whose aggregate id is NULL reaches no shard)",
                ),
                Some(filter) => (format!("the rows of {table} WHERE {filter}"), ""),
                None => (
                    format!("every row of {table}"),
                    " (every shard would send them)",
                ),
            };
            return Some(format!(
                "publication {publication} publishes {publishes}, not shard {} of {}'s{consequence}: \
                 ALTER PUBLICATION {p} SET TABLE {} WHERE ({})",
                shard.index,
                shard.count,
                table.quoted(),
                shard.sql()
            ));
        }
        if let Some(filter) = &self.row_filter {
            return Some(format!(
                "publication {publication} publishes only the rows of {table} WHERE {filter}; walbox would never see the others: \
                 ALTER PUBLICATION {p} SET TABLE {}",
                table.quoted()
            ));
        }
        None
    }

    fn fingerprint(&self) -> String {
        let o = |v: Option<i64>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
        format!(
            "table {} pub {} xmin {} all {} entry {} schema {} filter {} columns {}",
            self.table_oid
                .map_or_else(|| "-".to_owned(), |v| v.to_string()),
            o(self.publication_oid),
            self.publication_xmin.as_deref().unwrap_or("-"),
            self.all_tables.unwrap_or(false),
            o(self.table_entry),
            o(self.schema_entry),
            self.row_filter.as_deref().unwrap_or("-"),
            self.columns.as_deref().unwrap_or("-"),
        )
    }
}

/// What changed between two readings, in words (for the stop message).
pub fn describe_change(before: &Coverage, after: &Coverage) -> String {
    match (before.table_oid, after.table_oid) {
        (Some(a), Some(b)) if a != b => {
            format!("the outbox table was dropped and recreated (OID {a} → {b})")
        }
        _ => "the publication changed (altered, recreated, or the table was removed from it and added back)".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn covered() -> Reading {
        Reading {
            table_oid: Some(16_400),
            relkind: Some("r".into()),
            publication_oid: Some(16_500),
            publication_xmin: Some("750".into()),
            publishes_insert: Some(true),
            all_tables: Some(false),
            via_root: Some(true),
            table_entry: Some(16_501),
            schema_entry: None,
            listed: true,
            row_filter: None,
            columns: Some("id,payload".into()),
        }
    }

    fn gap(r: Reading) -> String {
        r.gap(
            "walbox_outbox",
            &TableName::new("public", "outbox_events"),
            None,
        )
        .expect("a gap")
    }

    #[test]
    fn a_covered_table_has_no_gap() {
        let t = TableName::new("public", "outbox_events");
        assert_eq!(covered().gap("walbox_outbox", &t, None), None);
    }

    #[test]
    fn a_shard_is_covered_by_its_own_filter_only() {
        let t = TableName::new("public", "outbox_events");
        let shard = ShardFilter {
            index: 2,
            count: 4,
            column: "aggregate_id".into(),
        };
        let filtered = |f: &str| Reading {
            row_filter: Some(f.into()),
            ..covered()
        };
        let own = filtered("(((hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647) % 4) = 2)");
        assert_eq!(own.gap("walbox_outbox_2", &t, Some(&shard)), None);
        // Without the shard, a filter hides rows.
        assert!(own.gap("walbox_outbox_2", &t, None).is_some());
        // The filter of earlier releases: NULL ids reach no shard.
        let g = filtered("(((hashtext(aggregate_id) & 2147483647) % 4) = 2)")
            .gap("walbox_outbox_2", &t, Some(&shard))
            .expect("a gap");
        assert!(
            g.contains("NULL reaches no shard")
                && g.contains("COALESCE(\"aggregate_id\"::text, '')"),
            "{g}"
        );
        let other =
            filtered("(((hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647) % 4) = 3)");
        let g = other
            .gap("walbox_outbox_2", &t, Some(&shard))
            .expect("a gap");
        assert!(
            g.contains("not shard 2 of 4's") && g.contains("% 4 = 2"),
            "{g}"
        );
        let g = covered()
            .gap("walbox_outbox_2", &t, Some(&shard))
            .expect("a gap");
        assert!(g.contains("every row"), "{g}");
    }

    #[test]
    fn each_gap_names_its_fix() {
        let g = gap(Reading {
            table_oid: None,
            ..covered()
        });
        assert!(g.contains("no longer exists"), "{g}");
        let g = gap(Reading {
            publication_oid: None,
            ..covered()
        });
        assert!(g.contains("walbox init-slot"), "{g}");
        let g = gap(Reading {
            publishes_insert: Some(false),
            ..covered()
        });
        assert!(g.contains("SET (publish = 'insert')"), "{g}");
        let g = gap(Reading {
            listed: false,
            ..covered()
        });
        assert!(
            g.contains("ADD TABLE \"public\".\"outbox_events\"")
                || g.contains("ADD TABLE public.outbox_events"),
            "{g}"
        );
        let g = gap(Reading {
            listed: false,
            relkind: Some("p".into()),
            via_root: Some(false),
            ..covered()
        });
        assert!(g.contains("publish_via_partition_root = true"), "{g}");
        let g = gap(Reading {
            row_filter: Some("(aggregate_type = 'order'::text)".into()),
            ..covered()
        });
        assert!(g.contains("WHERE (aggregate_type"), "{g}");
    }

    #[test]
    fn any_change_of_the_rows_changes_the_fingerprint() {
        let base = covered().fingerprint();
        let changed = [
            Reading {
                table_oid: Some(16_999),
                ..covered()
            },
            Reading {
                publication_xmin: Some("751".into()),
                ..covered()
            },
            Reading {
                table_entry: Some(16_777),
                ..covered()
            },
            Reading {
                publication_oid: Some(17_000),
                ..covered()
            },
            Reading {
                columns: Some("id".into()),
                ..covered()
            },
        ];
        for r in changed {
            assert_ne!(r.fingerprint(), base, "{r:?}");
        }
        assert_eq!(covered().fingerprint(), base);
    }
}
