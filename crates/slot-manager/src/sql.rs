//! Quoting of identifiers and literals for SQL and replication commands.
//!
//! Replication commands (`START_REPLICATION`, `CREATE_REPLICATION_SLOT`) only
//! exist in the simple query protocol, so names cannot be bound as parameters:
//! every name that reaches a command string goes through these functions.

use std::fmt;

/// Quotes an identifier the way Postgres' `quote_ident` does when quoting is
/// needed: wrapped in double quotes, embedded double quotes doubled.
///
/// Always quoting is correct (it also preserves case); `"my slot"` and
/// `"a""b"` round-trip exactly.
pub fn quote_ident(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for c in name.chars() {
        if c == '"' {
            out.push('"');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Quotes a string literal: wrapped in single quotes, embedded single quotes
/// doubled. When the value holds a backslash the `E''` form is used with
/// backslashes doubled, so the result is right whatever
/// `standard_conforming_strings` is set to.
pub fn quote_literal(value: &str) -> String {
    let has_backslash = value.contains('\\');
    let mut out = String::with_capacity(value.len() + 3);
    if has_backslash {
        out.push('E');
    }
    out.push('\'');
    for c in value.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Quotes a string literal for a replication command (`START_REPLICATION`
/// options). The replication grammar knows only `'…'` with embedded quotes
/// doubled, no `E''` form, and takes backslashes as they are.
pub fn quote_replication_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The longest name Postgres keeps (`NAMEDATALEN - 1` bytes); longer names
/// are cut silently, so walbox refuses them instead.
pub const MAX_NAME_BYTES: usize = 63;

/// A table name as the operator writes it: `table` or `schema.table`, where
/// either part may be double-quoted (`"Outbox"."events.v2"`). Unquoted parts
/// fold to lower case, as in SQL. A name without a schema means `public`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TableName {
    schema: String,
    name: String,
}

/// The text is not a table name of the form `table` or `schema.table`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid table name {input:?}: {reason} (expected `table` or `schema.table`, parts may be \"quoted\")")]
pub struct ParseTableNameError {
    input: String,
    reason: String,
}

impl ParseTableNameError {
    pub(crate) fn new(input: &str, reason: &str) -> ParseTableNameError {
        ParseTableNameError {
            input: input.to_owned(),
            reason: reason.to_owned(),
        }
    }
}

impl TableName {
    /// A table name from its two parts, taken verbatim (no case folding).
    pub fn new(schema: impl Into<String>, name: impl Into<String>) -> Self {
        TableName {
            schema: schema.into(),
            name: name.into(),
        }
    }

    /// Parses `table`, `schema.table`, with optional double quotes per part.
    pub fn parse(input: &str) -> Result<Self, ParseTableNameError> {
        let err = |reason: &str| ParseTableNameError {
            input: input.to_owned(),
            reason: reason.to_owned(),
        };
        let mut parts = Vec::with_capacity(2);
        let mut chars = input.trim().chars().peekable();
        loop {
            let mut part = String::new();
            if chars.peek() == Some(&'"') {
                chars.next();
                loop {
                    match chars.next() {
                        Some('"') if chars.peek() == Some(&'"') => {
                            chars.next();
                            part.push('"');
                        }
                        Some('"') => break,
                        Some(c) => part.push(c),
                        None => return Err(err("unterminated quote")),
                    }
                }
                if part.is_empty() {
                    return Err(err("empty quoted name"));
                }
            } else {
                while let Some(&c) = chars.peek() {
                    if c == '.' {
                        break;
                    }
                    if c == '"' || c.is_whitespace() {
                        return Err(err("unquoted names cannot hold quotes or spaces"));
                    }
                    // Postgres folds unquoted names in ASCII only.
                    part.push(c.to_ascii_lowercase());
                    chars.next();
                }
                if part.is_empty() {
                    return Err(err("empty name"));
                }
            }
            parts.push(part);
            match chars.next() {
                None => break,
                Some('.') if parts.len() < 2 => continue,
                Some('.') => return Err(err("too many dots")),
                Some(_) => return Err(err("unexpected text after a quoted name")),
            }
        }
        if let Some(long) = parts.iter().find(|p| p.len() > MAX_NAME_BYTES) {
            return Err(err(&format!(
                "{long:?} is {} bytes; Postgres names are at most {MAX_NAME_BYTES} (it would cut it)",
                long.len()
            )));
        }
        let name = parts.pop().expect("at least one part was pushed");
        let schema = parts.pop().unwrap_or_else(|| "public".to_owned());
        Ok(TableName { schema, name })
    }

    /// The schema, as stored in the catalog.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The table's own name, as stored in the catalog.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `"schema"."name"`, safe to splice into SQL.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.quoted())
    }
}

impl std::str::FromStr for TableName {
    type Err = ParseTableNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TableName::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_identifiers() {
        assert_eq!(quote_ident("walbox"), "\"walbox\"");
        assert_eq!(quote_ident("my slot"), "\"my slot\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_ident(""), "\"\"");
    }

    #[test]
    fn quotes_literals() {
        assert_eq!(quote_literal("walbox_outbox"), "'walbox_outbox'");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal("a\\b'c"), "E'a\\\\b''c'");
        // The replication grammar: no E'' form, backslashes as they are.
        assert_eq!(quote_replication_literal("a\\b'c"), "'a\\b''c'");
    }

    #[test]
    fn folds_like_postgres_and_refuses_what_it_would_cut() {
        // ASCII only: Postgres leaves other letters as written.
        let t = TableName::parse("Événements.ÄUSSERE").unwrap();
        assert_eq!((t.schema(), t.name()), ("Événements", "Äussere"));
        let t = TableName::parse(&"a".repeat(63)).unwrap();
        assert_eq!(t.name().len(), 63);
        let e = TableName::parse(&"a".repeat(64)).unwrap_err().to_string();
        assert!(
            e.contains("is 64 bytes; Postgres names are at most 63"),
            "{e}"
        );
        // Bytes, not characters: 32 two-byte letters are 64 bytes.
        assert!(TableName::parse(&format!("\"{}\"", "é".repeat(32))).is_err());
    }

    #[test]
    fn parses_table_names() {
        let t = TableName::parse("outbox_events").unwrap();
        assert_eq!((t.schema(), t.name()), ("public", "outbox_events"));
        let t = TableName::parse("App.Outbox").unwrap();
        assert_eq!((t.schema(), t.name()), ("app", "outbox"));
        let t = TableName::parse("\"My Schema\".\"events.v\"\"2\"").unwrap();
        assert_eq!((t.schema(), t.name()), ("My Schema", "events.v\"2"));
        assert_eq!(t.quoted(), "\"My Schema\".\"events.v\"\"2\"");
        assert_eq!(TableName::parse(&t.quoted()).unwrap(), t);
    }

    #[test]
    fn rejects_bad_table_names() {
        for bad in [
            "", ".", "a.", ".a", "a.b.c", "\"a", "\"\"", "a b", "\"a\"x", "a\"b",
        ] {
            let e = TableName::parse(bad).unwrap_err();
            assert!(
                e.to_string().starts_with("invalid table name"),
                "{bad}: {e}"
            );
        }
    }
}
