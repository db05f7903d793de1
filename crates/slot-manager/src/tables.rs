//! The outbox tables one slot streams: a table, a list of tables, or
//! patterns (`tenant_*.outbox_events`, for a schema per tenant), found in
//! the catalog; and picking up a new matching table into the publication
//! only when that cannot lose an event.
//!
//! A table joins a publication at the commit of `ALTER PUBLICATION … ADD
//! TABLE`: rows committed before are never streamed. So a matching table
//! walbox finds outside the publication is added only if it has never held
//! a row: under a `SHARE` lock (no insert can commit meanwhile; inserts in
//! progress finish first), its files are empty (an insert, committed,
//! aborted or deleted since, leaves a page until a vacuum truncates it) and
//! the statistics count no insert into it (a vacuum that truncated it
//! reported them long before). Otherwise it is left out and the caller
//! stops, saying how to publish the rows it holds.

use std::fmt;

use tokio_postgres::{Client, GenericClient, IsolationLevel};

use crate::error::Error;
use crate::sql::{quote_ident, ParseTableNameError, TableName};

/// The outbox tables: entries of the form `schema.table`, where `*` in
/// either part matches any run of characters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxTables {
    entries: Vec<TableName>,
}

impl OutboxTables {
    /// Parses a comma-separated list of table names (`table`,
    /// `schema.table`, parts optionally quoted), each possibly a pattern.
    pub fn parse(text: &str) -> Result<OutboxTables, ParseTableNameError> {
        let mut entries: Vec<TableName> = Vec::new();
        for part in split_list(text) {
            let table = TableName::parse(part)?;
            if !entries.contains(&table) {
                entries.push(table);
            }
        }
        if entries.is_empty() {
            return Err(ParseTableNameError::new(text, "no table named"));
        }
        Ok(OutboxTables { entries })
    }

    /// One table.
    pub fn one(table: TableName) -> OutboxTables {
        OutboxTables {
            entries: vec![table],
        }
    }

    /// The table, when this is one table (no list, no pattern).
    pub fn single(&self) -> Option<&TableName> {
        match &self.entries[..] {
            [one] if !is_pattern(one) => Some(one),
            _ => None,
        }
    }

    /// The entries as written.
    pub fn entries(&self) -> &[TableName] {
        &self.entries
    }

    /// The entries that name one table (no pattern).
    pub fn named(&self) -> impl Iterator<Item = &TableName> {
        self.entries.iter().filter(|e| !is_pattern(e))
    }

    /// Whether `schema.name` is one of the tables.
    pub fn matches(&self, schema: &str, name: &str) -> bool {
        self.entries
            .iter()
            .any(|e| glob(e.schema(), schema) && glob(e.name(), name))
    }

    /// The existing tables that match (ordinary and partitioned tables, not
    /// partitions), sorted. A table named without a pattern must exist.
    pub async fn resolve(&self, client: &impl GenericClient) -> Result<Vec<TableName>, Error> {
        let (schemas, names): (Vec<String>, Vec<String>) = self
            .entries
            .iter()
            .map(|e| (like(e.schema()), like(e.name())))
            .unzip();
        let rows = client
            .query(
                "SELECT n.nspname::text, c.relname::text
                   FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                  WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
                    AND EXISTS (SELECT 1 FROM unnest($1::text[], $2::text[]) p(s, t)
                                 WHERE n.nspname LIKE p.s AND c.relname LIKE p.t)
                  ORDER BY 1, 2",
                &[&schemas, &names],
            )
            .await
            .map_err(Error::sql("look up the outbox tables"))?;
        let found: Vec<TableName> = rows
            .iter()
            .map(|r| TableName::new(r.get::<_, String>(0), r.get::<_, String>(1)))
            .filter(|t| self.matches(t.schema(), t.name()))
            .collect();
        if let Some(missing) = self.named().find(|e| !found.contains(e)) {
            return Err(Error::Precondition(format!(
                "table {missing} does not exist: create it (`walbox migrate` creates public.outbox_events) or point --table at your outbox"
            )));
        }
        Ok(found)
    }

    /// The tables `publication` publishes that match, sorted.
    pub async fn published(
        &self,
        client: &impl GenericClient,
        publication: &str,
    ) -> Result<Vec<TableName>, Error> {
        let mut tables = publication_tables(client, publication).await?;
        tables.retain(|t| self.matches(t.schema(), t.name()));
        Ok(tables)
    }

    /// The matching tables ([`Self::resolve`]) and those `publication`
    /// publishes ([`Self::published`]), read in one snapshot: a transaction
    /// that renames a table and publishes it commits for both or neither
    /// (two statements apart could see the new name without the
    /// membership, and take a freshly published table for a gap).
    pub async fn resolve_with_published(
        &self,
        client: &mut Client,
        publication: &str,
    ) -> Result<(Vec<TableName>, Vec<TableName>), Error> {
        let snapshot = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(Error::sql("open a snapshot of the catalog"))?;
        let found = self.resolve(&snapshot).await?;
        let published = self.published(&snapshot, publication).await?;
        snapshot
            .commit()
            .await
            .map_err(Error::sql("close the snapshot of the catalog"))?;
        Ok((found, published))
    }
}

/// Every table `publication` publishes (`pg_publication_tables`), sorted.
pub async fn publication_tables(
    client: &impl GenericClient,
    publication: &str,
) -> Result<Vec<TableName>, Error> {
    let rows = client
        .query(
            "SELECT schemaname::text, tablename::text FROM pg_publication_tables
              WHERE pubname = $1 ORDER BY 1, 2",
            &[&publication],
        )
        .await
        .map_err(Error::sql("look up the publication's tables"))?;
    Ok(rows
        .iter()
        .map(|r| TableName::new(r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect())
}

impl fmt::Display for OutboxTables {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            // A pattern as written: quoting would make its `*` literal.
            if is_pattern(e) {
                write!(f, "{}.{}", e.schema(), e.name())?;
            } else {
                write!(f, "{e}")?;
            }
        }
        Ok(())
    }
}

/// A published table holding rows committed before it joined the
/// publication: the stream never carried them (unless during an earlier
/// membership of the table, which walbox cannot tell apart).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EarlierRows {
    /// The table.
    pub table: TableName,
    /// How many such rows it holds (counted up to [`EARLIER_ROWS_COUNTED`]).
    pub rows: i64,
    /// The SQL condition naming them (for the fix: re-insert them).
    pub condition: String,
}

/// [`rows_before_joining`] counts up to this many rows of a table.
pub const EARLIER_ROWS_COUNTED: i64 = 1000;

impl EarlierRows {
    /// The statement that re-inserts the rows, so that they stream.
    pub fn fix(&self) -> String {
        format!(
            "WITH moved AS (DELETE FROM {t} WHERE {c} RETURNING *) INSERT INTO {t} SELECT * FROM moved",
            t = self.table.quoted(),
            c = self.condition
        )
    }

    /// How many, in words.
    pub fn count(&self) -> String {
        match self.rows >= EARLIER_ROWS_COUNTED {
            true => format!("at least {} rows", self.rows),
            false => format!("{} row{}", self.rows, if self.rows == 1 { "" } else { "s" }),
        }
    }
}

/// A table's entry in a publication (`pg_publication_rel`): which table,
/// and the transaction and command that added it. The pair (OID,
/// transaction) names one joining: a table dropped and added back, or
/// dropped and recreated, joins again under another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Joined {
    /// The table.
    pub table: TableName,
    /// Its OID.
    pub oid: u32,
    /// The transaction that added it (`xmin` of its entry), as text.
    pub xid: String,
    /// The command within it (`cmin` of its entry).
    cid: i64,
}

/// The entries of `tables` in `publication` (a table published another
/// way, `FOR ALL TABLES` or `FOR TABLES IN SCHEMA`, has none).
pub async fn joined(
    client: &Client,
    publication: &str,
    tables: &[TableName],
) -> Result<Vec<Joined>, Error> {
    if tables.is_empty() {
        return Ok(Vec::new());
    }
    let (schemas, names): (Vec<&str>, Vec<&str>) =
        tables.iter().map(|t| (t.schema(), t.name())).unzip();
    let rows = client
        .query(
            "SELECT n.nspname::text, c.relname::text, c.oid, pr.xmin::text, pr.cmin::text::int8
               FROM pg_publication p
               JOIN pg_publication_rel pr ON pr.prpubid = p.oid
               JOIN pg_class c ON c.oid = pr.prrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
               JOIN unnest($2::text[], $3::text[]) t(s, r) ON t.s = n.nspname AND t.r = c.relname
              WHERE p.pubname = $1
              ORDER BY 1, 2",
            &[&publication, &schemas, &names],
        )
        .await
        .map_err(Error::sql(
            "look up when outbox tables joined the publication",
        ))?;
    Ok(rows
        .iter()
        .map(|r| Joined {
            table: TableName::new(r.get::<_, String>(0), r.get::<_, String>(1)),
            oid: r.get(2),
            xid: r.get(3),
            cid: r.get(4),
        })
        .collect())
}

/// Whether the table of `entry` holds rows inserted before it joined the
/// publication, which the stream never carried (unless during an earlier
/// membership of the table, which cannot be told apart). A row's age is
/// its inserting transaction's (`xmin`, and within the transaction that
/// added the table, its command, `cmin`), against the entry's: this holds
/// however the table came to be published (added by hand, renamed into a
/// pattern and added, dropped and added back), whatever else that
/// transaction changed. It reads the table (up to
/// [`EARLIER_ROWS_COUNTED`] such rows): call it for a table that joined
/// unseen, not for every table every time.
///
/// What it cannot see: rows deleted since; rows of a transaction that
/// began after the one adding the table and committed before it (an
/// insert racing the `ALTER PUBLICATION`); rows inserted in a
/// subtransaction of the adding transaction before it added the table.
pub async fn rows_before_joining(
    client: &Client,
    entry: &Joined,
) -> Result<Option<EarlierRows>, Error> {
    // The literal comes from the catalog (a number), quoted anyway.
    let xid = format!("'{}'::xid", entry.xid.replace('\'', ""));
    let condition = format!(
        "age(xmin) > age({xid}) OR (xmin = {xid} AND cmin::text::int8 < {})",
        entry.cid
    );
    let table = &entry.table;
    let rows: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM (SELECT 1 FROM {} WHERE {condition} LIMIT {EARLIER_ROWS_COUNTED}) e",
                table.quoted()
            ),
            &[],
        )
        .await
        .map_err(Error::sql(format!(
            "look for rows of {table} older than its joining the publication"
        )))?
        .get(0);
    Ok((rows > 0).then(|| EarlierRows {
        table: table.clone(),
        rows,
        condition,
    }))
}

/// What [`pick_up`] did with a matching table outside the publication.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PickUp {
    /// It never held a row: added to the publication.
    Added,
    /// It holds or held rows, which the stream never carried: left out.
    Written {
        /// Bytes in its files.
        bytes: i64,
        /// Inserts the statistics count.
        inserts: i64,
    },
    /// Its lock was not granted within a moment (inserts in progress): try
    /// again at the next reading.
    Busy,
}

/// Adds `table` to `publication` if it has never held a row (see the
/// module's documentation), in one transaction on `client`.
pub async fn pick_up(
    client: &mut Client,
    publication: &str,
    table: &TableName,
) -> Result<PickUp, Error> {
    let tx = client
        .transaction()
        .await
        .map_err(Error::sql("begin picking up a table"))?;
    tx.batch_execute("SET LOCAL lock_timeout = '2s'")
        .await
        .map_err(Error::sql("set lock_timeout"))?;
    match tx
        .batch_execute(&format!("LOCK TABLE {} IN SHARE MODE", table.quoted()))
        .await
    {
        Ok(()) => {}
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
            return Ok(PickUp::Busy)
        }
        Err(e) => {
            return Err(Error::Precondition(format!(
                "table {table} matches the outbox tables and is not published; walbox could not lock it to add it ({}): add it with ALTER PUBLICATION {} ADD TABLE {} while it is empty",
                e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned()),
                quote_ident(publication),
                table.quoted()
            )))
        }
    }
    // The table and, when partitioned, its partitions (pg_partition_tree
    // lists nothing for a table outside a partition tree).
    let row = tx
        .query_one(
            "SELECT coalesce(sum(pg_relation_size(relid)), 0)::int8,
                    coalesce(sum(pg_stat_get_tuples_inserted(relid)), 0)::int8
               FROM (SELECT $1::text::regclass AS relid
                     UNION SELECT relid FROM pg_partition_tree($1::text::regclass)) t",
            &[&table.quoted()],
        )
        .await
        .map_err(Error::sql("measure a table to pick up"))?;
    let (bytes, inserts): (i64, i64) = (row.get(0), row.get(1));
    if bytes != 0 || inserts != 0 {
        return Ok(PickUp::Written { bytes, inserts });
    }
    let add = format!(
        "ALTER PUBLICATION {} ADD TABLE {}",
        quote_ident(publication),
        table.quoted()
    );
    if let Err(e) = tx.batch_execute(&add).await {
        return Err(Error::Precondition(format!(
            "table {table} matches the outbox tables and is not published; adding it was refused ({}): have the publication's owner run {add} while it is empty",
            e.as_db_error().map_or_else(|| e.to_string(), |d| d.message().to_owned()),
        )));
    }
    tx.commit()
        .await
        .map_err(Error::sql("commit adding a table to the publication"))?;
    Ok(PickUp::Added)
}

fn is_pattern(t: &TableName) -> bool {
    t.schema().contains('*') || t.name().contains('*')
}

/// Whether `text` matches `pattern`, where `*` matches any run of
/// characters and everything else itself.
fn glob(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    // The classic two-pointer match with backtracking to the last star.
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < t.len() {
        if i < p.len() && p[i] != '*' && p[i] == t[j] {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

/// A pattern as SQL `LIKE`: `*` is `%`, and `%`, `_` and `\` match
/// themselves.
fn like(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    for c in pattern.chars() {
        match c {
            '*' => out.push('%'),
            '%' | '_' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c => out.push(c),
        }
    }
    out
}

/// Splits a comma-separated list, leaving commas inside double quotes.
fn split_list(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in text.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                parts.push(text[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(text[start..].trim());
    parts.into_iter().filter(|p| !p.is_empty()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_any_run_of_characters() {
        for (pattern, text, matches) in [
            ("tenant_*", "tenant_a", true),
            ("tenant_*", "tenant_", true),
            ("tenant_*", "tenants", false),
            ("*", "anything", true),
            ("*_events", "outbox_events", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "aXbY", false),
            ("outbox", "outbox", true),
            ("outbox", "outbox2", false),
            ("t_*", "tXa", false),
        ] {
            assert_eq!(glob(pattern, text), matches, "{pattern} ~ {text}");
        }
        assert_eq!(like("tenant_*"), "tenant\\_%");
        assert_eq!(like("a%b"), "a\\%b");
    }

    #[test]
    fn lists_and_patterns_parse_and_match() {
        let t = OutboxTables::parse("tenant_*.outbox_events, app.outbox ,\"Odd,Name\".x").unwrap();
        assert_eq!(t.entries().len(), 3);
        assert!(t.single().is_none());
        assert!(t.matches("tenant_a", "outbox_events"));
        assert!(!t.matches("tenant_a", "outbox"));
        assert!(t.matches("app", "outbox"));
        assert!(t.matches("Odd,Name", "x"));
        assert_eq!(
            t.to_string(),
            "tenant_*.outbox_events, \"app\".\"outbox\", \"Odd,Name\".\"x\""
        );
        let one = OutboxTables::parse("outbox_events").unwrap();
        assert_eq!(
            one.single(),
            Some(&TableName::new("public", "outbox_events"))
        );
        assert!(OutboxTables::parse("public.*").unwrap().single().is_none());
        assert_eq!(
            OutboxTables::parse("a, a").unwrap(),
            OutboxTables::parse("a").unwrap()
        );
        assert!(OutboxTables::parse(" , ").is_err());
        assert!(OutboxTables::parse("a b").is_err());
    }
}
