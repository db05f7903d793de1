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
    /// cannot stop a walsender. A NULL id counts as the empty one: Postgres
    /// publishes no row whose filter is NULL, so without the `COALESCE` such
    /// a row would reach no shard, where unsharded it is an unmappable
    /// event for the dead-letter policy. Now one shard owns NULL and empty
    /// ids, and its relay treats them as it would unsharded.
    pub fn sql(&self) -> String {
        format!(
            "(hashtext(COALESCE({}::text, '')) & 2147483647) % {} = {}",
            quote_ident(&self.column),
            self.count,
            self.index
        )
    }

    /// Whether a row filter as the catalog shows it (`pg_publication_tables.
    /// rowfilter`, Postgres' own rendering of the stored expression) is this
    /// shard's. Postgres renders every operator's operands in parentheses,
    /// so the rendering spells out the expression's structure: it is
    /// compared whole, after white space, with only what Postgres may
    /// render either way left open (the column quoted or not, cast to text
    /// or not, as its type needs). A filter that differs anywhere else
    /// (another precedence, another function, another count) is not this
    /// shard's.
    pub fn matches(&self, rowfilter: &str) -> bool {
        let found = without_whitespace(rowfilter);
        self.column_renderings().any(|column| {
            found
                == without_whitespace(&format!(
                    "(((hashtext(COALESCE({column}, ''::text)) & 2147483647) % {}) = {})",
                    self.count, self.index
                ))
        })
    }

    /// True when `rowfilter` is this shard's filter as walbox wrote it
    /// before NULL ids were owned by a shard: it publishes no row whose
    /// aggregate id is NULL.
    pub fn is_without_nulls(&self, rowfilter: &str) -> bool {
        let found = without_whitespace(rowfilter);
        self.column_renderings().any(|column| {
            found
                == without_whitespace(&format!(
                    "(((hashtext({column}) & 2147483647) % {}) = {})",
                    self.count, self.index
                ))
        })
    }

    /// The ways Postgres renders the column inside the filter: quoted only
    /// where it must be, and cast to text unless it is text already.
    fn column_renderings(&self) -> impl Iterator<Item = String> {
        let quoted = quote_ident(&self.column);
        let mut names = vec![quoted.clone()];
        if quoted[1..quoted.len() - 1] == self.column && is_plain(&self.column) {
            names.push(self.column.clone());
        }
        names
            .into_iter()
            .flat_map(|name| [format!("({name})::text"), name])
    }
}

/// A name Postgres may print without quotes: lower-case letters, digits and
/// underscores, not starting with a digit. (A keyword among them stays
/// quoted; the quoted form is always accepted.)
fn is_plain(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The expression without white space (none of it is inside a literal: the
/// only one is `''`).
fn without_whitespace(expression: &str) -> String {
    expression.chars().filter(|c| !c.is_whitespace()).collect()
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
            "(hashtext(COALESCE(\"aggregate_id\"::text, '')) & 2147483647) % 4 = 1"
        );
        // As Postgres 15-18 render it, for a text and a varchar column.
        assert!(s.matches("(((hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647) % 4) = 1)"));
        assert!(s.matches(
            "(((hashtext(COALESCE((aggregate_id)::text, ''::text)) & 2147483647) % 4) = 1)"
        ));
        assert!(!s.matches("(((hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647) % 4) = 2)"));
        assert!(!s.matches("(((hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647) % 8) = 1)"));
        assert!(
            !s.matches("(((hashtext(COALESCE(aggregate_type, ''::text)) & 2147483647) % 4) = 1)")
        );
        assert!(!s.matches("((hashtext(COALESCE(aggregate_id, ''::text)) % 4) = 1)"));
        assert!(!s.matches(""));
    }

    #[test]
    fn another_precedence_is_another_filter() {
        let s = shard(1, 4, "aggregate_id");
        // `hashtext(…) & 2147483647 % 4 = 1` as written by hand: `%` binds
        // tighter than `&`, and Postgres stores (and renders) it so. The
        // same tokens without their parentheses, another set of rows.
        assert!(!s.matches("((hashtext(COALESCE(aggregate_id, ''::text)) & (2147483647 % 4)) = 1)"));
        assert!(!s.matches("(hashtext(COALESCE(aggregate_id, ''::text)) & 2147483647 % 4 = 1)"));
    }

    #[test]
    fn the_filter_without_nulls_is_recognised_as_such() {
        let s = shard(2, 4, "aggregate_id");
        let old = "(((hashtext((aggregate_id)::text) & 2147483647) % 4) = 2)";
        assert!(
            !s.matches(old),
            "it loses NULL ids: not this shard's filter"
        );
        assert!(s.is_without_nulls(old));
        assert!(s.is_without_nulls("(((hashtext(aggregate_id) & 2147483647) % 4) = 2)"));
        assert!(!s.is_without_nulls("(((hashtext(aggregate_id) & 2147483647) % 4) = 1)"));
    }

    #[test]
    fn quotes_the_column() {
        let s = shard(0, 2, "aggregateId");
        assert_eq!(
            s.sql(),
            "(hashtext(COALESCE(\"aggregateId\"::text, '')) & 2147483647) % 2 = 0"
        );
        assert!(s.matches(
            "(((hashtext(COALESCE((\"aggregateId\")::text, ''::text)) & 2147483647) % 2) = 0)"
        ));
        // Unquoted, it would be another column (aggregateid).
        assert!(!s.matches(
            "(((hashtext(COALESCE((aggregateId)::text, ''::text)) & 2147483647) % 2) = 0)"
        ));
    }
}
