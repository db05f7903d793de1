//! Resolving changes to column names.

use std::collections::HashMap;

use crate::relation::RelationBody;
use crate::tuple::{Column, TupleData};

/// The tables seen in a session, by OID, from their Relation messages.
///
/// pgoutput sends a Relation before a table's first change and again when
/// its schema changes (and, for partitions published via the root, for the
/// leaf too), so the latest message per OID wins.
#[derive(Clone, Debug, Default)]
pub struct RelationCache {
    relations: HashMap<u32, RelationBody>,
}

/// A change's relation is not in the cache: the Relation message was not
/// seen (the stream did not start at a transaction boundary, or a message
/// was skipped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("change for relation OID {0} arrived before its Relation message")]
pub struct UnknownRelation(pub u32);

/// A tuple does not have the columns its relation declares.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tuple of {table} has {tuple} columns, its Relation message declares {relation}")]
pub struct ColumnCountMismatch {
    /// The table, `schema.name`.
    pub table: String,
    /// Columns in the tuple.
    pub tuple: usize,
    /// Columns in the Relation message.
    pub relation: usize,
}

impl RelationCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records (or replaces) a relation.
    pub fn insert(&mut self, relation: RelationBody) {
        self.relations.insert(relation.oid(), relation);
    }

    /// The relation with this OID.
    pub fn get(&self, oid: u32) -> Result<&RelationBody, UnknownRelation> {
        self.relations.get(&oid).ok_or(UnknownRelation(oid))
    }

    /// Number of relations known.
    pub fn len(&self) -> usize {
        self.relations.len()
    }

    /// True when no relation is known.
    pub fn is_empty(&self) -> bool {
        self.relations.is_empty()
    }

    /// Pairs a tuple with its relation's column names.
    pub fn resolve<'a>(&'a self, oid: u32, tuple: &'a TupleData) -> Result<Row<'a>, RowError> {
        let relation = self.get(oid)?;
        if relation.columns().len() != tuple.len() {
            return Err(RowError::ColumnCount(ColumnCountMismatch {
                table: format!("{}.{}", relation.namespace(), relation.name()),
                tuple: tuple.len(),
                relation: relation.columns().len(),
            }));
        }
        Ok(Row { relation, tuple })
    }
}

/// Why a tuple could not be resolved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    /// The relation is not known.
    #[error(transparent)]
    UnknownRelation(#[from] UnknownRelation),
    /// The tuple's shape disagrees with its relation.
    #[error(transparent)]
    ColumnCount(#[from] ColumnCountMismatch),
}

/// A tuple with its relation: columns by name.
#[derive(Clone, Copy, Debug)]
pub struct Row<'a> {
    relation: &'a RelationBody,
    tuple: &'a TupleData,
}

impl<'a> Row<'a> {
    /// The relation.
    pub fn relation(&self) -> &'a RelationBody {
        self.relation
    }

    /// The tuple.
    pub fn tuple(&self) -> &'a TupleData {
        self.tuple
    }

    /// The column named `name`, or `None` when the table has no such column.
    pub fn column(&self, name: &str) -> Option<Column<'a>> {
        let index = self.relation.column_index(name)?;
        self.tuple.get(index)
    }

    /// The text value of column `name`, borrowed from the message: `None`
    /// when the column is missing, NULL, unchanged TOAST, binary or not UTF-8.
    pub fn text(&self, name: &str) -> Option<&'a str> {
        self.column(name)?.as_str()
    }

    /// `(name, value)` for every column, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, Column<'a>)> + 'a {
        self.relation
            .columns()
            .iter()
            .map(|c| c.name())
            .zip(self.tuple.iter())
    }
}
