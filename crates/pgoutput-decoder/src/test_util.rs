//! Frames for tests of code that consumes this crate (feature `test-util`):
//! the messages a walsender sends, built with the crate's own encoder, so
//! a test states what it sends (a Begin, a row) and not its bytes.

use bytes::{BufMut, Bytes, BytesMut};

use crate::change::{InsertBody, MessageBody};
use crate::encode::encode;
use crate::framing::ReplicationMessage;
use crate::lsn::Lsn;
use crate::message::LogicalMessage;
use crate::relation::RelationBody;
use crate::time::PgTimestamp;
use crate::transaction::{BeginBody, CommitBody};
use crate::tuple::TupleData;

/// XLogData carrying `data` (a pgoutput message) at `wal_start`, sent when
/// the server's WAL ended at `wal_end`.
pub fn xlog(wal_start: Lsn, wal_end: Lsn, data: Bytes) -> ReplicationMessage {
    let mut b = BytesMut::with_capacity(25 + data.len());
    b.put_u8(b'w');
    b.put_u64(wal_start.as_u64());
    b.put_u64(wal_end.as_u64());
    b.put_i64(0);
    b.put_slice(&data);
    ReplicationMessage::parse(b.freeze()).expect("a valid XLogData")
}

/// A primary keepalive.
pub fn keepalive(wal_end: Lsn, reply_requested: bool) -> ReplicationMessage {
    let mut b = BytesMut::with_capacity(18);
    b.put_u8(b'k');
    b.put_u64(wal_end.as_u64());
    b.put_i64(0);
    b.put_u8(u8::from(reply_requested));
    ReplicationMessage::parse(b.freeze()).expect("a valid keepalive")
}

/// `Begin` of the transaction that commits at `final_lsn`.
pub fn begin(final_lsn: Lsn, commit_time: PgTimestamp, xid: u32) -> Bytes {
    encode(&LogicalMessage::Begin(BeginBody {
        final_lsn,
        commit_time,
        xid,
    }))
}

/// `Commit` of the transaction committed at `commit_lsn`, ending at `end_lsn`.
pub fn commit(commit_lsn: Lsn, end_lsn: Lsn, commit_time: PgTimestamp) -> Bytes {
    encode(&LogicalMessage::Commit(CommitBody {
        flags: 0,
        commit_lsn,
        end_lsn,
        commit_time,
    }))
}

/// `Relation` of table `namespace.name` with OID `oid` and these columns
/// (name, type OID).
pub fn relation(oid: u32, namespace: &str, name: &str, columns: &[(&str, u32)]) -> Bytes {
    let body = RelationBody::from_catalog(
        oid,
        namespace,
        name,
        columns.iter().map(|(n, t)| ((*n).to_owned(), *t)),
    );
    encode(&LogicalMessage::Relation(body))
}

/// `Insert` into relation `oid` of these values in text format (`None`:
/// NULL).
pub fn insert(oid: u32, values: &[Option<&str>]) -> Bytes {
    let tuple = TupleData::from_text(values.iter().map(|v| v.map(str::as_bytes)))
        .expect("at most 65,535 columns");
    encode(&LogicalMessage::Insert(InsertBody {
        xid: None,
        relation_oid: oid,
        tuple,
    }))
}

/// A logical decoding message (`pg_logical_emit_message`) at `lsn`.
pub fn message(transactional: bool, lsn: Lsn, prefix: &str, content: &[u8]) -> Bytes {
    encode(&LogicalMessage::Message(MessageBody {
        xid: None,
        flags: u8::from(transactional),
        lsn,
        prefix: prefix.to_owned().into(),
        content: Bytes::copy_from_slice(content),
    }))
}
