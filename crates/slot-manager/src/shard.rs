//! Sharded streaming: the outbox split over several publications, each with
//! a row filter on a hash of the aggregate id, each read by its own slot
//! (and walsender). One aggregate always hashes to one shard, so its events
//! stay in order; different aggregates are streamed in parallel.
//!
//! Row filters need Postgres 15. Every walsender still decodes all of the
//! WAL; what divides by the number of shards is the sending (see
//! docs/operations.md, "Sharded streaming").

use crate::sql::quote_ident;

/// The least server version that has publication row filters.
pub const LEAST_SHARDED_SERVER: i32 = 150_000;

/// The most shards walbox makes: each is a slot and a walsender, and every
/// walsender decodes all of the WAL.
pub const MAX_SHARDS: u32 = 64;

/// One shard: which of `count` it is, and the column its hash is taken of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardFilter {
    /// This shard, from 0.
    pub index: u32,
    /// How many shards there are.
    pub count: u32,
    /// The aggregate id column.
    pub column: String,
}

impl ShardFilter {
    /// The row filter, as SQL: the aggregate id's hash, made non-negative,
    /// modulo the shard count. Built-in immutable functions and operators
    /// only (what row filters allow); it cannot fail on any value, so it
    /// cannot stop a walsender.
    pub fn sql(&self) -> String {
        format!(
            "(hashtext({}::text) & 2147483647) % {} = {}",
            quote_ident(&self.column),
            self.count,
            self.index
        )
    }

    /// Whether a row filter as the catalog shows it (`pg_publication_tables.
    /// rowfilter`, Postgres' own rendering of [`ShardFilter::sql`]) is this
    /// shard's. Postgres adds parentheses and, for a column that is not
    /// text, a cast, and quotes the column only where needed: those are
    /// ignored, nothing else is.
    pub fn matches(&self, rowfilter: &str) -> bool {
        normalize(rowfilter) == normalize(&self.sql())
    }
}

/// Drops what Postgres' rendering adds or leaves out: whitespace,
/// parentheses, `::text` casts, quotes it needs no more than walbox's.
fn normalize(expression: &str) -> String {
    expression
        .replace("::text", "")
        .chars()
        .filter(|c| !c.is_whitespace() && !matches!(c, '(' | ')' | '"'))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(index: u32, count: u32, column: &str) -> ShardFilter {
        ShardFilter {
            index,
            count,
            column: column.into(),
        }
    }

    #[test]
    fn renders_and_recognises_its_filter() {
        let s = shard(1, 4, "aggregate_id");
        assert_eq!(
            s.sql(),
            "(hashtext(\"aggregate_id\"::text) & 2147483647) % 4 = 1"
        );
        // As Postgres 15-18 render it, for a text and a varchar column.
        assert!(s.matches("(((hashtext(aggregate_id) & 2147483647) % 4) = 1)"));
        assert!(s.matches("(((hashtext((aggregate_id)::text) & 2147483647) % 4) = 1)"));
        assert!(!s.matches("(((hashtext(aggregate_id) & 2147483647) % 4) = 2)"));
        assert!(!s.matches("(((hashtext(aggregate_id) & 2147483647) % 8) = 1)"));
        assert!(!s.matches("(((hashtext(aggregate_type) & 2147483647) % 4) = 1)"));
        assert!(!s.matches("((hashtext(aggregate_id) % 4) = 1)"));
        assert!(!s.matches(""));
    }

    #[test]
    fn quotes_the_column() {
        let s = shard(0, 2, "aggregateId");
        assert_eq!(
            s.sql(),
            "(hashtext(\"aggregateId\"::text) & 2147483647) % 2 = 0"
        );
        assert!(s.matches("(((hashtext((\"aggregateId\")::text) & 2147483647) % 2) = 0)"));
    }
}
