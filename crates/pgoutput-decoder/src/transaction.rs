//! Transaction boundaries: Begin/Commit, Origin, streamed transactions (v2+)
//! and two-phase commit (v3+).

use crate::error::DecodeError;
use crate::lsn::Lsn;
use crate::reader::Reader;
use crate::text::Text;
use crate::time::PgTimestamp;

/// Begin (`B`): a transaction's changes follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeginBody {
    pub(crate) final_lsn: Lsn,
    pub(crate) commit_time: PgTimestamp,
    pub(crate) xid: u32,
}

impl BeginBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(BeginBody {
            final_lsn: r.lsn("final LSN")?,
            commit_time: PgTimestamp::from_pg_micros(r.i64("commit timestamp")?),
            xid: r.u32("xid")?,
        })
    }

    /// The LSN of the transaction's commit record; the matching Commit's
    /// `commit_lsn` must equal it.
    pub fn final_lsn(&self) -> Lsn {
        self.final_lsn
    }

    /// When the transaction committed.
    pub fn commit_time(&self) -> PgTimestamp {
        self.commit_time
    }

    /// Transaction id.
    pub fn xid(&self) -> u32 {
        self.xid
    }
}

/// Commit (`C`): the end of the transaction started by the last Begin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitBody {
    pub(crate) flags: u8,
    pub(crate) commit_lsn: Lsn,
    pub(crate) end_lsn: Lsn,
    pub(crate) commit_time: PgTimestamp,
}

impl CommitBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(CommitBody {
            flags: r.u8("flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time: PgTimestamp::from_pg_micros(r.i64("commit timestamp")?),
        })
    }

    /// Flags (currently always 0).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The LSN of the commit record.
    pub fn commit_lsn(&self) -> Lsn {
        self.commit_lsn
    }

    /// The end of the commit record: the position to confirm once the
    /// transaction is fully processed.
    pub fn end_lsn(&self) -> Lsn {
        self.end_lsn
    }

    /// When the transaction committed.
    pub fn commit_time(&self) -> PgTimestamp {
        self.commit_time
    }
}

/// Origin (`O`): the transaction was replicated from another node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OriginBody {
    pub(crate) commit_lsn: Lsn,
    pub(crate) name: Text,
}

impl OriginBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(OriginBody {
            commit_lsn: r.lsn("origin commit LSN")?,
            name: r.cstr("origin name")?,
        })
    }

    /// The commit LSN on the origin server.
    pub fn commit_lsn(&self) -> Lsn {
        self.commit_lsn
    }

    /// The origin's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Stream Start (`S`, v2+): a block of a large in-progress transaction follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamStartBody {
    pub(crate) xid: u32,
    pub(crate) first_segment: bool,
}

impl StreamStartBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(StreamStartBody {
            xid: r.u32("xid")?,
            first_segment: r.u8("first segment flag")? == 1,
        })
    }

    /// The streamed transaction's id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// True for the transaction's first block.
    pub fn first_segment(&self) -> bool {
        self.first_segment
    }
}

/// Stream Commit (`c`, v2+): a streamed transaction committed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamCommitBody {
    pub(crate) xid: u32,
    pub(crate) flags: u8,
    pub(crate) commit_lsn: Lsn,
    pub(crate) end_lsn: Lsn,
    pub(crate) commit_time: PgTimestamp,
}

impl StreamCommitBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(StreamCommitBody {
            xid: r.u32("xid")?,
            flags: r.u8("flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time: PgTimestamp::from_pg_micros(r.i64("commit timestamp")?),
        })
    }

    /// The transaction's id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// Flags (currently always 0).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The LSN of the commit record.
    pub fn commit_lsn(&self) -> Lsn {
        self.commit_lsn
    }

    /// The end of the commit record.
    pub fn end_lsn(&self) -> Lsn {
        self.end_lsn
    }

    /// When the transaction committed.
    pub fn commit_time(&self) -> PgTimestamp {
        self.commit_time
    }
}

/// Stream Abort (`A`, v2+): a streamed (sub)transaction rolled back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamAbortBody {
    pub(crate) xid: u32,
    pub(crate) subxid: u32,
    pub(crate) abort: Option<(Lsn, PgTimestamp)>,
}

impl StreamAbortBody {
    pub(crate) fn decode(r: &mut Reader, with_abort_info: bool) -> Result<Self, DecodeError> {
        let xid = r.u32("xid")?;
        let subxid = r.u32("subtransaction xid")?;
        let abort = if with_abort_info {
            Some((
                r.lsn("abort LSN")?,
                PgTimestamp::from_pg_micros(r.i64("abort timestamp")?),
            ))
        } else {
            None
        };
        Ok(StreamAbortBody { xid, subxid, abort })
    }

    /// The top-level transaction's id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// The aborted subtransaction's id (equal to `xid` when the whole
    /// transaction aborted).
    pub fn subxid(&self) -> u32 {
        self.subxid
    }

    /// The abort's LSN: sent by protocol v4 with parallel streaming only.
    pub fn abort_lsn(&self) -> Option<Lsn> {
        self.abort.map(|(lsn, _)| lsn)
    }

    /// The abort's time: sent by protocol v4 with parallel streaming only.
    pub fn abort_time(&self) -> Option<PgTimestamp> {
        self.abort.map(|(_, t)| t)
    }
}

/// Begin Prepare (`b`, v3+): the changes of a transaction being prepared follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BeginPrepareBody {
    pub(crate) prepare_lsn: Lsn,
    pub(crate) end_lsn: Lsn,
    pub(crate) prepare_time: PgTimestamp,
    pub(crate) xid: u32,
    pub(crate) gid: Text,
}

impl BeginPrepareBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(BeginPrepareBody {
            prepare_lsn: r.lsn("prepare LSN")?,
            end_lsn: r.lsn("end LSN")?,
            prepare_time: PgTimestamp::from_pg_micros(r.i64("prepare timestamp")?),
            xid: r.u32("xid")?,
            gid: r.cstr("gid")?,
        })
    }

    /// The LSN of the prepare record.
    pub fn prepare_lsn(&self) -> Lsn {
        self.prepare_lsn
    }

    /// The end of the prepared transaction.
    pub fn end_lsn(&self) -> Lsn {
        self.end_lsn
    }

    /// When it was prepared.
    pub fn prepare_time(&self) -> PgTimestamp {
        self.prepare_time
    }

    /// Transaction id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// The prepared transaction's global identifier.
    pub fn gid(&self) -> &str {
        &self.gid
    }
}

/// Prepare (`P`, v3+) and Stream Prepare (`p`, v3+): the transaction is prepared.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareBody {
    pub(crate) flags: u8,
    pub(crate) prepare_lsn: Lsn,
    pub(crate) end_lsn: Lsn,
    pub(crate) prepare_time: PgTimestamp,
    pub(crate) xid: u32,
    pub(crate) gid: Text,
}

impl PrepareBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(PrepareBody {
            flags: r.u8("flags")?,
            prepare_lsn: r.lsn("prepare LSN")?,
            end_lsn: r.lsn("end LSN")?,
            prepare_time: PgTimestamp::from_pg_micros(r.i64("prepare timestamp")?),
            xid: r.u32("xid")?,
            gid: r.cstr("gid")?,
        })
    }

    /// Flags (currently always 0).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The LSN of the prepare record.
    pub fn prepare_lsn(&self) -> Lsn {
        self.prepare_lsn
    }

    /// The end of the prepared transaction.
    pub fn end_lsn(&self) -> Lsn {
        self.end_lsn
    }

    /// When it was prepared.
    pub fn prepare_time(&self) -> PgTimestamp {
        self.prepare_time
    }

    /// Transaction id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// The prepared transaction's global identifier.
    pub fn gid(&self) -> &str {
        &self.gid
    }
}

/// Commit Prepared (`K`, v3+).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitPreparedBody {
    pub(crate) flags: u8,
    pub(crate) commit_lsn: Lsn,
    pub(crate) end_lsn: Lsn,
    pub(crate) commit_time: PgTimestamp,
    pub(crate) xid: u32,
    pub(crate) gid: Text,
}

impl CommitPreparedBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(CommitPreparedBody {
            flags: r.u8("flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time: PgTimestamp::from_pg_micros(r.i64("commit timestamp")?),
            xid: r.u32("xid")?,
            gid: r.cstr("gid")?,
        })
    }

    /// Flags (currently always 0).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The LSN of the commit prepared record.
    pub fn commit_lsn(&self) -> Lsn {
        self.commit_lsn
    }

    /// The end of the commit prepared record.
    pub fn end_lsn(&self) -> Lsn {
        self.end_lsn
    }

    /// When it committed.
    pub fn commit_time(&self) -> PgTimestamp {
        self.commit_time
    }

    /// Transaction id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// The prepared transaction's global identifier.
    pub fn gid(&self) -> &str {
        &self.gid
    }
}

/// Rollback Prepared (`r`, v3+).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RollbackPreparedBody {
    pub(crate) flags: u8,
    pub(crate) prepare_end_lsn: Lsn,
    pub(crate) rollback_end_lsn: Lsn,
    pub(crate) prepare_time: PgTimestamp,
    pub(crate) rollback_time: PgTimestamp,
    pub(crate) xid: u32,
    pub(crate) gid: Text,
}

impl RollbackPreparedBody {
    pub(crate) fn decode(r: &mut Reader) -> Result<Self, DecodeError> {
        Ok(RollbackPreparedBody {
            flags: r.u8("flags")?,
            prepare_end_lsn: r.lsn("prepare end LSN")?,
            rollback_end_lsn: r.lsn("rollback end LSN")?,
            prepare_time: PgTimestamp::from_pg_micros(r.i64("prepare timestamp")?),
            rollback_time: PgTimestamp::from_pg_micros(r.i64("rollback timestamp")?),
            xid: r.u32("xid")?,
            gid: r.cstr("gid")?,
        })
    }

    /// Flags (currently always 0).
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// The end of the prepared transaction.
    pub fn prepare_end_lsn(&self) -> Lsn {
        self.prepare_end_lsn
    }

    /// The end of the rollback prepared record.
    pub fn rollback_end_lsn(&self) -> Lsn {
        self.rollback_end_lsn
    }

    /// When it was prepared.
    pub fn prepare_time(&self) -> PgTimestamp {
        self.prepare_time
    }

    /// When it was rolled back.
    pub fn rollback_time(&self) -> PgTimestamp {
        self.rollback_time
    }

    /// Transaction id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// The prepared transaction's global identifier.
    pub fn gid(&self) -> &str {
        &self.gid
    }
}
