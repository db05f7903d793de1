//! Decoding of Postgres logical replication streams that use the `pgoutput`
//! output plugin, protocol versions 1 to 4.
//!
//! This crate owns the bytes: it turns the payload of a replication `CopyData`
//! message into typed values and encodes the one message a client sends back
//! (the standby status update). It does no I/O and knows nothing of sockets,
//! tokio or Kafka, so every parser can be tested and fuzzed from byte fixtures.
//!
//! ```text
//! CopyData payload ──ReplicationMessage::parse──► XLogData { wal_start, wal_end, data }
//!                                                │           PrimaryKeepalive { wal_end, reply_requested }
//!                                   Decoder::decode(data)
//!                                                ▼
//!          LogicalMessage::{Begin, Relation, Insert, …, Commit, Stream*, *Prepare*}
//!                                                │
//!                        RelationCache::resolve(oid, tuple) → Row: columns by name
//! ```
//!
//! # Guarantees
//!
//! * **Zero-copy.** Frames are [`bytes::Bytes`]; tuples, names and message
//!   contents are slices of the frame. An Insert is decoded without a heap
//!   allocation; its columns are read lazily.
//! * **Never panics on input.** Every length is checked against the bytes that
//!   remain before it is used; a count never sizes an allocation beyond what the
//!   remaining bytes could hold. A malformed message is a [`DecodeError`] with
//!   the message kind, the byte offset and what was expected (truncation,
//!   negative length, unknown tag or marker, invalid UTF-8, trailing bytes).
//! * **Versioned.** [`Decoder`] is told the negotiated protocol version and
//!   tracks streamed blocks, where data messages carry a transaction id.

mod cache;
mod change;
mod error;
mod framing;
mod lsn;
mod message;
mod reader;
mod relation;
mod text;
mod time;
mod transaction;
mod tuple;

#[cfg(any(test, feature = "test-util"))]
mod encode;
#[cfg(any(test, feature = "test-util"))]
pub mod test_util;
#[cfg(test)]
mod tests;

pub use cache::{ColumnCountMismatch, RelationCache, Row, RowError, UnknownRelation};
pub use change::{DeleteBody, InsertBody, MessageBody, OldTuple, TruncateBody, UpdateBody};
pub use error::{DecodeError, DecodeErrorKind};
pub use framing::{PrimaryKeepaliveBody, ReplicationMessage, StandbyStatusUpdate, XLogDataBody};
pub use lsn::{Lsn, ParseLsnError};
pub use message::{Decoder, LogicalMessage, UnsupportedVersion, SUPPORTED_VERSIONS};
pub use relation::{RelationBody, RelationColumn, ReplicaIdentity, TypeBody};
pub use text::Text;
pub use time::PgTimestamp;
pub use transaction::{
    BeginBody, BeginPrepareBody, CommitBody, CommitPreparedBody, OriginBody, PrepareBody,
    RollbackPreparedBody, StreamAbortBody, StreamCommitBody, StreamStartBody,
};
pub use tuple::{Column, Columns, TupleData};
