//! Data changes: Insert, Update, Delete, Truncate, and logical decoding messages.

use bytes::Bytes;

use crate::error::{DecodeError, DecodeErrorKind};
use crate::lsn::Lsn;
use crate::reader::Reader;
use crate::text::Text;
use crate::tuple::TupleData;

fn expect_marker(
    r: &mut Reader,
    allowed: &[u8],
    expected: &'static str,
) -> Result<u8, DecodeError> {
    let at = r.position();
    let m = r.u8(expected)?;
    if allowed.contains(&m) {
        Ok(m)
    } else {
        Err(r.error_at(
            at,
            DecodeErrorKind::UnexpectedMarker {
                found: m as char,
                expected,
            },
        ))
    }
}

/// Insert (`I`): a new row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsertBody {
    pub(crate) xid: Option<u32>,
    pub(crate) relation_oid: u32,
    pub(crate) tuple: TupleData,
}

impl InsertBody {
    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        let relation_oid = r.u32("relation OID")?;
        expect_marker(r, b"N", "'N' (new tuple)")?;
        Ok(InsertBody {
            xid,
            relation_oid,
            tuple: TupleData::decode(r)?,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// The OID of the table (see the preceding Relation message).
    pub fn relation_oid(&self) -> u32 {
        self.relation_oid
    }

    /// The new row.
    pub fn tuple(&self) -> &TupleData {
        &self.tuple
    }
}

/// The old row an Update or Delete carries, depending on replica identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OldTuple {
    /// The replica identity key columns (`K`); other columns are null.
    Key(TupleData),
    /// The whole old row (`O`, replica identity full).
    Full(TupleData),
}

impl OldTuple {
    /// The tuple, whichever kind.
    pub fn tuple(&self) -> &TupleData {
        match self {
            OldTuple::Key(t) | OldTuple::Full(t) => t,
        }
    }
}

/// Update (`U`): a changed row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpdateBody {
    pub(crate) xid: Option<u32>,
    pub(crate) relation_oid: u32,
    pub(crate) old: Option<OldTuple>,
    pub(crate) new: TupleData,
}

impl UpdateBody {
    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        let relation_oid = r.u32("relation OID")?;
        let old = match expect_marker(r, b"KON", "'K', 'O' or 'N'")? {
            b'K' => Some(OldTuple::Key(TupleData::decode(r)?)),
            b'O' => Some(OldTuple::Full(TupleData::decode(r)?)),
            _ => None,
        };
        if old.is_some() {
            expect_marker(r, b"N", "'N' (new tuple)")?;
        }
        Ok(UpdateBody {
            xid,
            relation_oid,
            old,
            new: TupleData::decode(r)?,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// The OID of the table.
    pub fn relation_oid(&self) -> u32 {
        self.relation_oid
    }

    /// The old key or row, when the key changed or replica identity is full.
    pub fn old(&self) -> Option<&OldTuple> {
        self.old.as_ref()
    }

    /// The new row; unchanged TOASTed columns are [`crate::Column::UnchangedToast`].
    pub fn new_tuple(&self) -> &TupleData {
        &self.new
    }
}

/// Delete (`D`): a removed row, identified by its key or whole old row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeleteBody {
    pub(crate) xid: Option<u32>,
    pub(crate) relation_oid: u32,
    pub(crate) old: OldTuple,
}

impl DeleteBody {
    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        let relation_oid = r.u32("relation OID")?;
        let old = match expect_marker(r, b"KO", "'K' or 'O'")? {
            b'K' => OldTuple::Key(TupleData::decode(r)?),
            _ => OldTuple::Full(TupleData::decode(r)?),
        };
        Ok(DeleteBody {
            xid,
            relation_oid,
            old,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// The OID of the table.
    pub fn relation_oid(&self) -> u32 {
        self.relation_oid
    }

    /// The deleted row's key or whole row.
    pub fn old(&self) -> &OldTuple {
        &self.old
    }
}

/// Truncate (`T`): tables emptied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TruncateBody {
    pub(crate) xid: Option<u32>,
    pub(crate) options: u8,
    pub(crate) relation_oids: Vec<u32>,
}

impl TruncateBody {
    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        let count = r.count(true, "relation count")?;
        let options = r.u8("options")?;
        let mut relation_oids = Vec::with_capacity(count.min(r.remaining() / 4));
        for _ in 0..count {
            relation_oids.push(r.u32("relation OID")?);
        }
        Ok(TruncateBody {
            xid,
            options,
            relation_oids,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// `TRUNCATE … CASCADE`.
    pub fn cascade(&self) -> bool {
        self.options & 1 != 0
    }

    /// `TRUNCATE … RESTART IDENTITY`.
    pub fn restart_identity(&self) -> bool {
        self.options & 2 != 0
    }

    /// The truncated tables.
    pub fn relation_oids(&self) -> &[u32] {
        &self.relation_oids
    }
}

/// Message (`M`): a `pg_logical_emit_message` (needs `messages 'true'`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageBody {
    pub(crate) xid: Option<u32>,
    pub(crate) flags: u8,
    pub(crate) lsn: Lsn,
    pub(crate) prefix: Text,
    pub(crate) content: Bytes,
}

impl MessageBody {
    pub(crate) fn decode(r: &mut Reader, xid: Option<u32>) -> Result<Self, DecodeError> {
        Ok(MessageBody {
            xid,
            flags: r.u8("flags")?,
            lsn: r.lsn("message LSN")?,
            prefix: r.cstr("prefix")?,
            content: r.len_prefixed("content")?,
        })
    }

    /// Inside a streamed block (v2+): the id of the (sub)transaction that
    /// made the change, which a Stream Abort may name as its `subxid`.
    pub fn xid(&self) -> Option<u32> {
        self.xid
    }

    /// True for a transactional message (sent inside its transaction, only
    /// if it commits); false for one sent at once, whatever happens after.
    pub fn transactional(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The message's LSN.
    pub fn lsn(&self) -> Lsn {
        self.lsn
    }

    /// The prefix the emitter chose.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The content: arbitrary bytes, not necessarily text.
    pub fn content(&self) -> &Bytes {
        &self.content
    }
}
