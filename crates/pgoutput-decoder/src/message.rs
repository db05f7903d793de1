//! The pgoutput messages and the decoder that knows the session's protocol
//! version and whether a streamed block is open.

use bytes::Bytes;

use crate::change::{DeleteBody, InsertBody, MessageBody, TruncateBody, UpdateBody};
use crate::error::{DecodeError, DecodeErrorKind};
use crate::reader::Reader;
use crate::relation::{RelationBody, TypeBody};
use crate::transaction::{
    BeginBody, BeginPrepareBody, CommitBody, CommitPreparedBody, OriginBody, PrepareBody,
    RollbackPreparedBody, StreamAbortBody, StreamCommitBody, StreamStartBody,
};

/// A pgoutput message: the payload of one XLogData.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LogicalMessage {
    /// `B`: a transaction begins.
    Begin(BeginBody),
    /// `C`: the transaction commits.
    Commit(CommitBody),
    /// `O`: the transaction came from another origin.
    Origin(OriginBody),
    /// `R`: a table's schema.
    Relation(RelationBody),
    /// `Y`: a type's name.
    Type(TypeBody),
    /// `I`: a row inserted.
    Insert(InsertBody),
    /// `U`: a row updated.
    Update(UpdateBody),
    /// `D`: a row deleted.
    Delete(DeleteBody),
    /// `T`: tables truncated.
    Truncate(TruncateBody),
    /// `M`: a logical decoding message.
    Message(MessageBody),
    /// `S` (v2+): a block of a streamed transaction starts.
    StreamStart(StreamStartBody),
    /// `E` (v2+): the block ends.
    StreamStop,
    /// `c` (v2+): a streamed transaction commits.
    StreamCommit(StreamCommitBody),
    /// `A` (v2+): a streamed (sub)transaction aborts.
    StreamAbort(StreamAbortBody),
    /// `b` (v3+): a transaction being prepared begins.
    BeginPrepare(BeginPrepareBody),
    /// `P` (v3+): the transaction is prepared.
    Prepare(PrepareBody),
    /// `K` (v3+): a prepared transaction commits.
    CommitPrepared(CommitPreparedBody),
    /// `r` (v3+): a prepared transaction rolls back.
    RollbackPrepared(RollbackPreparedBody),
    /// `p` (v3+): a streamed transaction is prepared.
    StreamPrepare(PrepareBody),
}

impl LogicalMessage {
    /// The message's tag byte.
    pub fn tag(&self) -> u8 {
        match self {
            LogicalMessage::Begin(_) => b'B',
            LogicalMessage::Commit(_) => b'C',
            LogicalMessage::Origin(_) => b'O',
            LogicalMessage::Relation(_) => b'R',
            LogicalMessage::Type(_) => b'Y',
            LogicalMessage::Insert(_) => b'I',
            LogicalMessage::Update(_) => b'U',
            LogicalMessage::Delete(_) => b'D',
            LogicalMessage::Truncate(_) => b'T',
            LogicalMessage::Message(_) => b'M',
            LogicalMessage::StreamStart(_) => b'S',
            LogicalMessage::StreamStop => b'E',
            LogicalMessage::StreamCommit(_) => b'c',
            LogicalMessage::StreamAbort(_) => b'A',
            LogicalMessage::BeginPrepare(_) => b'b',
            LogicalMessage::Prepare(_) => b'P',
            LogicalMessage::CommitPrepared(_) => b'K',
            LogicalMessage::RollbackPrepared(_) => b'r',
            LogicalMessage::StreamPrepare(_) => b'p',
        }
    }
}

/// Decodes the pgoutput messages of one replication session.
///
/// The wire format depends on the negotiated `proto_version` (1–4), on
/// whether a streamed block is open (inside one, data messages carry the
/// transaction id), and, for Stream Abort, on `streaming = parallel` (v4).
/// The decoder tracks the stream state from Stream Start / Stream Stop, so
/// feed it every message of the session, in order.
#[derive(Clone, Debug)]
pub struct Decoder {
    version: u32,
    parallel_streaming: bool,
    in_stream: bool,
}

/// The protocol versions this decoder speaks.
pub const SUPPORTED_VERSIONS: std::ops::RangeInclusive<u32> = 1..=4;

/// The protocol version was not one of [`SUPPORTED_VERSIONS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unsupported pgoutput protocol version {0} (supported: 1 to 4)")]
pub struct UnsupportedVersion(pub u32);

impl Decoder {
    /// A decoder for `proto_version` (1–4).
    pub fn new(proto_version: u32) -> Result<Decoder, UnsupportedVersion> {
        if !SUPPORTED_VERSIONS.contains(&proto_version) {
            return Err(UnsupportedVersion(proto_version));
        }
        Ok(Decoder {
            version: proto_version,
            parallel_streaming: false,
            in_stream: false,
        })
    }

    /// Declares that the session asked for `streaming = 'parallel'` (v4), so
    /// Stream Abort messages carry the abort LSN and timestamp.
    pub fn with_parallel_streaming(mut self, parallel: bool) -> Decoder {
        self.parallel_streaming = parallel;
        self
    }

    /// The protocol version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// True between Stream Start and Stream Stop.
    pub fn in_stream(&self) -> bool {
        self.in_stream
    }

    /// Decodes one message (the `data` of one XLogData). Slices of the
    /// message (tuples, names, content) share its buffer.
    pub fn decode(&mut self, data: Bytes) -> Result<LogicalMessage, DecodeError> {
        let mut r = Reader::new(data, "pgoutput message");
        if r.remaining() == 0 {
            return Err(r.error(DecodeErrorKind::Empty));
        }
        let tag = r.u8("tag")?;
        let (name, needs) = match tag {
            b'B' => ("Begin", 1),
            b'C' => ("Commit", 1),
            b'O' => ("Origin", 1),
            b'R' => ("Relation", 1),
            b'Y' => ("Type", 1),
            b'I' => ("Insert", 1),
            b'U' => ("Update", 1),
            b'D' => ("Delete", 1),
            b'T' => ("Truncate", 1),
            b'M' => ("Message", 1),
            b'S' => ("Stream Start", 2),
            b'E' => ("Stream Stop", 2),
            b'c' => ("Stream Commit", 2),
            b'A' => ("Stream Abort", 2),
            b'b' => ("Begin Prepare", 3),
            b'P' => ("Prepare", 3),
            b'K' => ("Commit Prepared", 3),
            b'r' => ("Rollback Prepared", 3),
            b'p' => ("Stream Prepare", 3),
            other => return Err(r.error_at(0, DecodeErrorKind::UnknownTag(other as char))),
        };
        r.rename(name);
        if self.version < needs {
            return Err(r.error_at(
                0,
                DecodeErrorKind::NotInVersion {
                    version: self.version,
                    needs,
                },
            ));
        }
        // Inside a streamed block, data and schema messages lead with the xid.
        let streamed =
            self.in_stream && matches!(tag, b'R' | b'Y' | b'I' | b'U' | b'D' | b'T' | b'M');
        let xid = if streamed {
            Some(r.u32("streamed xid")?)
        } else {
            None
        };
        let message = match tag {
            b'B' => LogicalMessage::Begin(BeginBody::decode(&mut r)?),
            b'C' => LogicalMessage::Commit(CommitBody::decode(&mut r)?),
            b'O' => LogicalMessage::Origin(OriginBody::decode(&mut r)?),
            b'R' => LogicalMessage::Relation(RelationBody::decode(&mut r, xid)?),
            b'Y' => LogicalMessage::Type(TypeBody::decode(&mut r, xid)?),
            b'I' => LogicalMessage::Insert(InsertBody::decode(&mut r, xid)?),
            b'U' => LogicalMessage::Update(UpdateBody::decode(&mut r, xid)?),
            b'D' => LogicalMessage::Delete(DeleteBody::decode(&mut r, xid)?),
            b'T' => LogicalMessage::Truncate(TruncateBody::decode(&mut r, xid)?),
            b'M' => LogicalMessage::Message(MessageBody::decode(&mut r, xid)?),
            b'S' => LogicalMessage::StreamStart(StreamStartBody::decode(&mut r)?),
            b'E' => LogicalMessage::StreamStop,
            b'c' => LogicalMessage::StreamCommit(StreamCommitBody::decode(&mut r)?),
            b'A' => {
                let with_abort_info = self.version >= 4 && self.parallel_streaming;
                LogicalMessage::StreamAbort(StreamAbortBody::decode(&mut r, with_abort_info)?)
            }
            b'b' => LogicalMessage::BeginPrepare(BeginPrepareBody::decode(&mut r)?),
            b'P' => LogicalMessage::Prepare(PrepareBody::decode(&mut r)?),
            b'K' => LogicalMessage::CommitPrepared(CommitPreparedBody::decode(&mut r)?),
            b'r' => LogicalMessage::RollbackPrepared(RollbackPreparedBody::decode(&mut r)?),
            _ => LogicalMessage::StreamPrepare(PrepareBody::decode(&mut r)?),
        };
        r.finish()?;
        // Only a message that decoded completely changes the stream state.
        match message {
            LogicalMessage::StreamStart(_) => self.in_stream = true,
            LogicalMessage::StreamStop => self.in_stream = false,
            _ => {}
        }
        Ok(message)
    }
}
