//! Schema messages: Relation and Type.

use crate::error::{DecodeError, DecodeErrorKind};
use crate::reader::Reader;
use crate::text::Text;

/// How a table identifies the old row of an UPDATE or DELETE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ReplicaIdentity {
    /// The primary key (`d`).
    Default,
    /// Nothing (`n`).
    Nothing,
    /// All columns (`f`).
    Full,
    /// The columns of a chosen unique index (`i`).
    Index,
}

/// One column of a [`RelationBody`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelationColumn {
    pub(crate) flags: u8,
    pub(crate) name: Text,
    pub(crate) type_oid: u32,
    pub(crate) type_modifier: i32,
}

impl RelationColumn {
    /// Column name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True when the column is part of the replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & 1 == 1
    }

    /// Raw flags.
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The column type's OID (e.g. 2950 for uuid, 3802 for jsonb).
    pub fn type_oid(&self) -> u32 {
        self.type_oid
    }

    /// The type modifier (`atttypmod`), -1 when none.
    pub fn type_modifier(&self) -> i32 {
        self.type_modifier
    }
}

/// Relation (`R`): a table's schema, sent before its first change in a
/// session and again when it changes. Later changes refer to it by `oid`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelationBody {
    pub(crate) xid: Option<u32>,
    pub(crate) oid: u32,
    pub(crate) namespace: Text,
    pub(crate) name: Text,
    pub(crate) replica_identity: ReplicaIdentity,
    pub(crate) columns: Vec<RelationColumn>,
}

/// The least bytes a column entry can take (flags, an empty name's NUL,
/// type OID, type modifier): bounds the column vector before allocating it.
const MIN_COLUMN_BYTES: usize = 1 + 1 + 4 + 4;

impl RelationBody {
    /// A relation described from the catalog rather than the stream (a
    /// snapshot backfill reads rows with SQL): `columns` are `(name, type
    /// OID)` in the order of the tuples that go with it.
    pub fn from_catalog(
        oid: u32,
        namespace: &str,
        name: &str,
        columns: impl IntoIterator<Item = (String, u32)>,
    ) -> RelationBody {
        RelationBody {
            xid: None,
            oid,
            namespace: Text::from(namespace.to_owned()),
            name: Text::from(name.to_owned()),
            replica_identity: ReplicaIdentity::Default,
            columns: columns
                .into_iter()
                .map(|(name, type_oid)| RelationColumn {
                    flags: 0,
                    name: Text::from(name),
                    type_oid,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        let oid = r.u32("relation OID")?;
        let namespace = r.cstr("namespace")?;
        let name = r.cstr("relation name")?;
        let at = r.position();
        let replica_identity = match r.u8("replica identity")? {
            b'd' => ReplicaIdentity::Default,
            b'n' => ReplicaIdentity::Nothing,
            b'f' => ReplicaIdentity::Full,
            b'i' => ReplicaIdentity::Index,
            other => {
                return Err(r.error_at(
                    at,
                    DecodeErrorKind::UnexpectedMarker {
                        found: other as char,
                        expected: "replica identity 'd', 'n', 'f' or 'i'",
                    },
                ))
            }
        };
        let count = r.count(false, "column count")?;
        let mut columns = Vec::with_capacity(count.min(r.remaining() / MIN_COLUMN_BYTES));
        for _ in 0..count {
            columns.push(RelationColumn {
                flags: r.u8("column flags")?,
                name: r.cstr("column name")?,
                type_oid: r.u32("column type OID")?,
                type_modifier: r.i32("column type modifier")?,
            });
        }
        Ok(RelationBody {
            xid,
            oid,
            namespace,
            name,
            replica_identity,
            columns,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// The relation's OID; changes refer to the table by it.
    pub fn oid(&self) -> u32 {
        self.oid
    }

    /// Schema name (`pg_catalog` is sent as an empty string).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Table name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Replica identity setting.
    pub fn replica_identity(&self) -> ReplicaIdentity {
        self.replica_identity
    }

    /// The published columns, in the order tuples send them.
    pub fn columns(&self) -> &[RelationColumn] {
        &self.columns
    }

    /// The index of the column named `name`.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c.name() == name)
    }
}

/// Type (`Y`): a non-built-in type used by a following Relation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeBody {
    pub(crate) xid: Option<u32>,
    pub(crate) oid: u32,
    pub(crate) namespace: Text,
    pub(crate) name: Text,
}

impl TypeBody {
    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        Ok(TypeBody {
            xid,
            oid: r.u32("type OID")?,
            namespace: r.cstr("namespace")?,
            name: r.cstr("type name")?,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// The type's OID.
    pub fn oid(&self) -> u32 {
        self.oid
    }

    /// Schema name.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Type name.
    pub fn name(&self) -> &str {
        &self.name
    }
}
